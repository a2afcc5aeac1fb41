//! Resource usage of the kernels in an AMDGPU code object, read from the code object itself.
//!
//! A code object (what `build.rs` embeds, see [`crate::kernels`]) is an ELF64 little-endian file
//! whose `NT_AMDGPU_METADATA` note (type 32, owner `AMDGPU`) holds a MessagePack map: the target
//! (`amdhsa.target`) and, per kernel (`amdhsa.kernels`), the registers, spills, scratch and LDS
//! the compiler allocated. [`parse`] reads that note with no external tool and adds the
//! occupancy those resources allow ([`ArchLimits::occupancy`]); [`resource_table`] prints the
//! result as `hipkv info --kernels` shows it.
//!
//! Malformed input (truncated, corrupt or not a code object at all) is a [`CodeObjectError`],
//! never a panic: every offset read from the file is bounds-checked, and MessagePack nesting and
//! lengths are limited by the bytes actually present.

use std::fmt::Write as _;

/// `e_machine` of AMDGPU code objects.
const EM_AMDGPU: u16 = 224;
/// Note type of the MessagePack metadata in code objects v3 and later.
const NT_AMDGPU_METADATA: u32 = 32;
const SHT_NOTE: u32 = 7;
const PT_NOTE: u32 = 4;
/// MessagePack containers nested deeper than this are rejected (LLVM's metadata nests 4 deep).
const MAX_DEPTH: usize = 32;

/// Why a code object could not be read.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CodeObjectError {
    #[error("not an ELF file (no \\x7fELF magic)")]
    NotElf,
    #[error("not a 64-bit little-endian ELF (EI_CLASS {class}, EI_DATA {data})")]
    NotElf64Le { class: u8, data: u8 },
    #[error("ELF machine {0} is not AMDGPU ({EM_AMDGPU})")]
    NotAmdgpu(u16),
    #[error("{what} at byte {offset} runs past the end of the {len}-byte code object")]
    Truncated {
        what: &'static str,
        offset: u64,
        len: usize,
    },
    #[error("no NT_AMDGPU_METADATA note (type 32, owner \"AMDGPU\")")]
    NoMetadata,
    #[error("malformed MessagePack metadata at byte {offset} of the note: {reason}")]
    MsgPack { offset: usize, reason: &'static str },
    #[error("{context} has no `{field}`")]
    MissingField {
        context: String,
        field: &'static str,
    },
    #[error("`{field}` of {context} is not {expected}")]
    BadField {
        context: String,
        field: &'static str,
        expected: &'static str,
    },
}

type Result<T, E = CodeObjectError> = std::result::Result<T, E>;

/// What one kernel of a code object uses, from its metadata, plus the occupancy that allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// `.name`: the kernel's source name, such as `hipkv_attn_q8_q8_d128`.
    pub name: String,
    /// `.symbol`: its kernel descriptor symbol (`<name>.kd`).
    pub symbol: String,
    /// The processor of `amdhsa.target` without target features, such as `gfx1201`.
    pub arch: String,
    /// `.vgpr_count`: VGPRs per work-item (arch VGPRs; AGPRs are counted in on gfx90a).
    pub vgpr_count: u32,
    /// `.sgpr_count`: SGPRs per wave, including VCC and other reserved ones.
    pub sgpr_count: u32,
    /// `.vgpr_spill_count`: VGPRs spilled to scratch.
    pub vgpr_spill_count: u32,
    /// `.sgpr_spill_count`: SGPRs spilled (to VGPR lanes, or to scratch beyond that).
    pub sgpr_spill_count: u32,
    /// `.private_segment_fixed_size`: scratch bytes per work-item, spills included.
    pub private_segment_fixed_size: u32,
    /// `.group_segment_fixed_size`: static LDS bytes per workgroup (dynamic LDS is set at launch
    /// and not included).
    pub group_segment_fixed_size: u32,
    /// `.wavefront_size`: 32 or 64.
    pub wavefront_size: u32,
    /// `.max_flat_workgroup_size`: the largest workgroup it may be launched with
    /// (`__launch_bounds__`, else 1024).
    pub max_flat_workgroup_size: u32,
    /// `.workgroup_processor_mode`: whether it runs in WGP mode (gfx10+); absent before
    /// code object v5.
    pub workgroup_processor_mode: Option<bool>,
    /// Waves per SIMD that the VGPRs, LDS and workgroup size allow when only this kernel runs
    /// ([`ArchLimits::occupancy`]); `None` for an arch without [`ArchLimits`].
    pub occupancy_waves_per_simd: Option<u32>,
}

/// Reads every kernel's resources from the metadata note of an AMDGPU code object.
pub fn parse(code_object: &[u8]) -> Result<Vec<KernelResources>> {
    let note = metadata_note(code_object)?;
    let mut reader = MsgPackReader { buf: note, pos: 0 };
    let root = reader.value(0)?;
    let top = "the metadata map";
    let root = root.as_map().ok_or(CodeObjectError::BadField {
        context: top.into(),
        field: "(root)",
        expected: "a map",
    })?;
    let target = str_field(root, top, "amdhsa.target")?;
    let arch = arch_of_target(target).ok_or_else(|| CodeObjectError::BadField {
        context: top.into(),
        field: "amdhsa.target",
        expected: "a target such as amdgcn-amd-amdhsa--gfx1201",
    })?;
    let limits = ArchLimits::for_arch(arch);
    let kernels =
        field(root, top, "amdhsa.kernels")?
            .as_array()
            .ok_or(CodeObjectError::BadField {
                context: top.into(),
                field: "amdhsa.kernels",
                expected: "an array",
            })?;
    kernels
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let index = format!("kernel #{i}");
            let k = k.as_map().ok_or(CodeObjectError::BadField {
                context: top.into(),
                field: "amdhsa.kernels",
                expected: "an array of maps",
            })?;
            let name = str_field(k, &index, ".name")?.to_string();
            let ctx = format!("kernel `{name}`");
            let u = |f: &'static str| u32_field(k, &ctx, f);
            let workgroup_processor_mode = match get(k, ".workgroup_processor_mode") {
                None => None,
                Some(v) => Some(v.as_flag().ok_or_else(|| CodeObjectError::BadField {
                    context: ctx.clone(),
                    field: ".workgroup_processor_mode",
                    expected: "0, 1 or a boolean",
                })?),
            };
            let mut r = KernelResources {
                symbol: str_field(k, &ctx, ".symbol")?.to_string(),
                arch: arch.to_string(),
                vgpr_count: u(".vgpr_count")?,
                sgpr_count: u(".sgpr_count")?,
                vgpr_spill_count: u(".vgpr_spill_count")?,
                sgpr_spill_count: u(".sgpr_spill_count")?,
                private_segment_fixed_size: u(".private_segment_fixed_size")?,
                group_segment_fixed_size: u(".group_segment_fixed_size")?,
                wavefront_size: u(".wavefront_size")?,
                max_flat_workgroup_size: u(".max_flat_workgroup_size")?,
                workgroup_processor_mode,
                occupancy_waves_per_simd: None,
                name,
            };
            r.occupancy_waves_per_simd = limits.and_then(|l| {
                l.occupancy(
                    r.wavefront_size,
                    r.vgpr_count,
                    r.group_segment_fixed_size,
                    r.max_flat_workgroup_size,
                    r.workgroup_processor_mode.unwrap_or(true),
                )
            });
            Ok(r)
        })
        .collect()
}

/// The resources of every kernel in every code object embedded in this build
/// ([`crate::kernels::code_objects`]), once per arch: the kernels that every head_dim's object
/// holds (`hipkv_attn_prep`, `hipkv_attn_combine`, `hipkv_copy_blocks`) are the same code in
/// each, and are listed from the first. Empty when none were built.
pub fn embedded_kernels() -> Result<Vec<KernelResources>> {
    let mut all: Vec<KernelResources> = Vec::new();
    for object in crate::kernels::code_objects() {
        for kernel in parse(object.bytes)? {
            if !all
                .iter()
                .any(|k| k.arch == kernel.arch && k.name == kernel.name)
            {
                all.push(kernel);
            }
        }
    }
    Ok(all)
}

/// `gfx1201` from `amdgcn-amd-amdhsa--gfx1201` or `amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-`.
fn arch_of_target(target: &str) -> Option<&str> {
    let (_, processor) = target.rsplit_once("--")?;
    let arch = processor.split(':').next()?;
    (!arch.is_empty()).then_some(arch)
}

/// The registers, wave slots and LDS that bound occupancy on one AMDGPU processor, as LLVM's
/// AMDGPU backend models them: LLVM 19, the clang `scripts/install-hip-toolchain.sh` installs
/// for `build.rs` (another compiler, such as a ROCm hipcc, may differ: rerun the check below).
///
/// From `llvm/lib/Target/AMDGPU/Utils/AMDGPUBaseInfo.cpp` (`IsaInfo::getTotalNumVGPRs`,
/// `getVGPRAllocGranule`, `getMaxWavesPerEU`, `getNumWavesPerEUWithNumVGPRs`,
/// `getLocalMemorySize`, `getEUsPerCU`, `getMaxWorkGroupsPerCU`), `AMDGPUSubtarget.cpp`
/// (`getOccupancyWithLocalMemSize`) and `GCNSubtarget.cpp` (`computeOccupancy`, which is what
/// the `; Occupancy: N` comment of `clang -S` prints), with the per-processor features of
/// `AMDGPU.td` / `GCNProcessors.td`:
///
/// - gfx1200/gfx1201 (RDNA4) have `Feature1_5xVGPRs`, like gfx1100/gfx1101/gfx1151: a SIMD's
///   register file holds 1536 wave32 VGPRs (192 KiB), allocated in blocks of 24 (wave64: 768 in
///   blocks of 12). Other gfx10.3/gfx11 parts have 1024 in blocks of 16, gfx10.1 1024 in blocks
///   of 8.
/// - At most 16 waves per SIMD since gfx10.3 (20 on gfx10.1). SGPRs do not limit occupancy on
///   gfx10+.
/// - 64 KiB of LDS per CU; a workgroup in WGP mode (the default) shares a WGP's 128 KiB with
///   the workgroups of 4 SIMDs, in CU mode a CU's 64 KiB with those of 2 SIMDs.
///
/// Validated against the compiler's own `; Occupancy:` comments: `tests/data/codeobj-fixture.hip`
/// (`src/codeobj.rs` tests) for gfx1201, and `scripts/check-occupancy-formula.sh` for every
/// VGPR count 1–256 and 80 LDS × workgroup-size cases on each processor listed here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchLimits {
    /// VGPRs of one SIMD available to wave32 waves (`getTotalNumVGPRs`; wave64 gets half).
    pub vgprs_per_simd_wave32: u32,
    /// VGPRs are allocated to a wave32 wave in blocks of this many (`getVGPRAllocGranule`;
    /// wave64 allocates half as many per block).
    pub vgpr_granule_wave32: u32,
    /// Wave slots per SIMD (`getMaxWavesPerEU`).
    pub max_waves_per_simd: u32,
    /// LDS bytes per CU (`getLocalMemorySize` in CU mode; twice this per WGP).
    pub lds_bytes_per_cu: u32,
}

impl ArchLimits {
    /// The limits of a processor (`gfx1201`), for the RDNA processors LLVM 19 knows; `None` for
    /// others (GCN and CDNA parts, whose VGPR files and wave slots differ, are not modelled).
    pub fn for_arch(arch: &str) -> Option<ArchLimits> {
        let (vgprs, granule, waves) = match arch {
            "gfx1200" | "gfx1201" | "gfx1100" | "gfx1101" | "gfx1151" => (1536, 24, 16),
            "gfx1102" | "gfx1103" | "gfx1150" | "gfx1152" | "gfx1030" | "gfx1031" | "gfx1032"
            | "gfx1033" | "gfx1034" | "gfx1035" | "gfx1036" => (1024, 16, 16),
            "gfx1010" | "gfx1011" | "gfx1012" | "gfx1013" => (1024, 8, 20),
            _ => return None,
        };
        Some(ArchLimits {
            vgprs_per_simd_wave32: vgprs,
            vgpr_granule_wave32: granule,
            max_waves_per_simd: waves,
            lds_bytes_per_cu: 64 << 10,
        })
    }

    /// Waves per SIMD of a kernel when only it runs, as LLVM computes it: the smaller of what
    /// its VGPRs allow and what its LDS and workgroup size allow (`None` for a wavefront size
    /// other than 32 or 64).
    ///
    /// - VGPRs: a wave holds `vgprs` rounded up to the granule; `⌊file / that⌋` waves fit, at
    ///   least 1, at most the wave slots. Fewer VGPRs than one granule: all wave slots.
    /// - LDS and workgroup size: a workgroup of `w = ⌈workgroup_size / wavefront⌉` waves is
    ///   resident on one CU (CU mode: 2 SIMDs, 64 KiB) or WGP (4 SIMDs, 128 KiB). At most
    ///   `⌊LDS / lds_bytes⌋` workgroups fit (none fitting counts as 1 wave), and at most
    ///   `slots / w` (single-wave workgroups: `slots`) with `slots` the wave slots of all its
    ///   SIMDs, capped at 16 (CU mode) or 32 (WGP mode) barriers for multi-wave workgroups. The
    ///   resident waves spread over the SIMDs: `⌈groups · w / SIMDs⌉`, at most the wave slots.
    pub fn occupancy(
        &self,
        wavefront_size: u32,
        vgprs: u32,
        lds_bytes: u32,
        workgroup_size: u32,
        wgp_mode: bool,
    ) -> Option<u32> {
        let wave64 = match wavefront_size {
            32 => false,
            64 => true,
            _ => return None,
        };
        let (file, granule) = if wave64 {
            (self.vgprs_per_simd_wave32 / 2, self.vgpr_granule_wave32 / 2)
        } else {
            (self.vgprs_per_simd_wave32, self.vgpr_granule_wave32)
        };
        let max = self.max_waves_per_simd;
        let by_vgprs = if vgprs < granule {
            max
        } else {
            (file / vgprs.div_ceil(granule).saturating_mul(granule)).clamp(1, max)
        };

        let (simds, lds, barriers) = if wgp_mode {
            (4, 2 * self.lds_bytes_per_cu, 32)
        } else {
            (2, self.lds_bytes_per_cu, 16)
        };
        let waves_per_group = workgroup_size.max(1).div_ceil(wavefront_size);
        let slots = max * simds;
        let max_groups = if waves_per_group == 1 {
            slots
        } else {
            (slots / waves_per_group).min(barriers)
        };
        let fitting = lds / lds_bytes.max(1);
        let by_lds = if max_groups == 0 {
            // A workgroup with more waves than the CU or WGP has slots (never with the 1024
            // work-items a workgroup may have): it cannot be resident, LLVM says 0.
            0
        } else if fitting == 0 {
            1
        } else {
            (fitting.min(max_groups) * waves_per_group)
                .div_ceil(simds)
                .min(max)
        };
        Some(by_vgprs.min(by_lds))
    }
}

/// A text table of kernel resources, one row per kernel, as `hipkv info --kernels` prints it.
pub fn resource_table(kernels: &[KernelResources]) -> String {
    let headers = [
        "kernel",
        "arch",
        "VGPRs",
        "SGPRs",
        "VGPR spills",
        "SGPR spills",
        "scratch B",
        "LDS B",
        "wave",
        "waves/SIMD",
    ];
    let rows: Vec<[String; 10]> = kernels
        .iter()
        .map(|k| {
            [
                k.name.clone(),
                k.arch.clone(),
                k.vgpr_count.to_string(),
                k.sgpr_count.to_string(),
                k.vgpr_spill_count.to_string(),
                k.sgpr_spill_count.to_string(),
                k.private_segment_fixed_size.to_string(),
                k.group_segment_fixed_size.to_string(),
                k.wavefront_size.to_string(),
                k.occupancy_waves_per_simd
                    .map_or_else(|| "?".to_string(), |o| o.to_string()),
            ]
        })
        .collect();
    let mut widths = headers.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            // Names left-aligned, numbers right-aligned.
            if i < 2 {
                let _ = write!(s, "{cell:<w$}");
            } else {
                let _ = write!(s, "{cell:>w$}");
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&headers);
    for row in &rows {
        line(&row.each_ref().map(String::as_str));
    }
    out
}

// ---- ELF ----------------------------------------------------------------------------------

/// Bounds-checked little-endian reads from the code object.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn slice(&self, offset: u64, len: u64, what: &'static str) -> Result<&'a [u8]> {
        let truncated = CodeObjectError::Truncated {
            what,
            offset,
            len: self.0.len(),
        };
        let start = usize::try_from(offset).map_err(|_| truncated.clone())?;
        let len = usize::try_from(len).map_err(|_| truncated.clone())?;
        let end = start.checked_add(len).ok_or(truncated.clone())?;
        self.0.get(start..end).ok_or(truncated)
    }

    fn u16(&self, offset: u64, what: &'static str) -> Result<u16> {
        let b = self.slice(offset, 2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&self, offset: u64, what: &'static str) -> Result<u32> {
        let b = self.slice(offset, 4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&self, offset: u64, what: &'static str) -> Result<u64> {
        let b = self.slice(offset, 8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// The descriptor of the `NT_AMDGPU_METADATA` note: the first one in a `SHT_NOTE` section, or
/// in a `PT_NOTE` segment when the section headers are stripped.
fn metadata_note(file: &[u8]) -> Result<&[u8]> {
    let elf = Bytes(file);
    let ident = elf.slice(0, 16, "ELF identification")?;
    if ident[..4] != *b"\x7fELF" {
        return Err(CodeObjectError::NotElf);
    }
    if ident[4] != 2 || ident[5] != 1 {
        return Err(CodeObjectError::NotElf64Le {
            class: ident[4],
            data: ident[5],
        });
    }
    let machine = elf.u16(18, "e_machine")?;
    if machine != EM_AMDGPU {
        return Err(CodeObjectError::NotAmdgpu(machine));
    }

    let mut note_areas = Vec::new();
    let shoff = elf.u64(40, "e_shoff")?;
    let shentsize = u64::from(elf.u16(58, "e_shentsize")?);
    let shnum = u64::from(elf.u16(60, "e_shnum")?);
    if shoff != 0 && shentsize >= 64 {
        elf.slice(shoff, shnum * shentsize, "section header table")?;
        for i in 0..shnum {
            let sh = shoff.saturating_add(i * shentsize);
            if elf.u32(sh.saturating_add(4), "section header")? == SHT_NOTE {
                let offset = elf.u64(sh.saturating_add(24), "section header")?;
                let size = elf.u64(sh.saturating_add(32), "section header")?;
                let align = elf.u64(sh.saturating_add(48), "section header")?;
                note_areas.push((elf.slice(offset, size, "note section")?, align));
            }
        }
    }
    if note_areas.is_empty() {
        let phoff = elf.u64(32, "e_phoff")?;
        let phentsize = u64::from(elf.u16(54, "e_phentsize")?);
        let phnum = u64::from(elf.u16(56, "e_phnum")?);
        if phoff != 0 && phentsize >= 56 {
            elf.slice(phoff, phnum * phentsize, "program header table")?;
            for i in 0..phnum {
                let ph = phoff.saturating_add(i * phentsize);
                if elf.u32(ph, "program header")? == PT_NOTE {
                    let offset = elf.u64(ph.saturating_add(8), "program header")?;
                    let size = elf.u64(ph.saturating_add(32), "program header")?;
                    let align = elf.u64(ph.saturating_add(48), "program header")?;
                    note_areas.push((elf.slice(offset, size, "note segment")?, align));
                }
            }
        }
    }

    for (area, align) in note_areas {
        if let Some(desc) = find_note(area, align, b"AMDGPU", NT_AMDGPU_METADATA)? {
            return Ok(desc);
        }
    }
    Err(CodeObjectError::NoMetadata)
}

/// Walks the notes of one note area: `namesz`, `descsz`, `type`, then the name and the
/// descriptor, each padded to the area's alignment (4, or 8 where the area says so).
fn find_note<'a>(area: &'a [u8], align: u64, owner: &[u8], kind: u32) -> Result<Option<&'a [u8]>> {
    let align = if align == 8 { 8 } else { 4 };
    let notes = Bytes(area);
    let mut at = 0u64;
    while at + 12 <= area.len() as u64 {
        let namesz = u64::from(notes.u32(at, "note header")?);
        let descsz = u64::from(notes.u32(at + 4, "note header")?);
        let note_type = notes.u32(at + 8, "note header")?;
        let name_at = at + 12;
        let name = notes.slice(name_at, namesz, "note name")?;
        let desc_at = name_at + namesz.next_multiple_of(align);
        let desc = notes.slice(desc_at, descsz, "note descriptor")?;
        // Owner names are NUL-terminated ("AMDGPU\0").
        let name = name.strip_suffix(b"\0").unwrap_or(name);
        if note_type == kind && name == owner {
            return Ok(Some(desc));
        }
        at = desc_at + descsz.next_multiple_of(align);
    }
    Ok(None)
}

// ---- MessagePack ----------------------------------------------------------------------------

/// A decoded MessagePack value; strings borrow from the note. Floats, binaries and extensions
/// (which the metadata never needs here) are read past and kept as [`Value::Other`].
#[derive(Debug)]
enum Value<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    Str(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    Other,
}

impl<'a> Value<'a> {
    fn as_map(&self) -> Option<&[(Value<'a>, Value<'a>)]> {
        match self {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    fn as_array(&self) -> Option<&[Value<'a>]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<&'a str> {
        match self {
            Value::Str(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    fn as_u32(&self) -> Option<u32> {
        match self {
            Value::Int(i) => u32::try_from(*i).ok(),
            _ => None,
        }
    }

    /// LLVM writes flags such as `.workgroup_processor_mode` as 0/1 and others as booleans.
    fn as_flag(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            Value::Int(0) => Some(false),
            Value::Int(1) => Some(true),
            _ => None,
        }
    }
}

fn get<'v, 'a>(map: &'v [(Value<'a>, Value<'a>)], key: &str) -> Option<&'v Value<'a>> {
    map.iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if *s == key.as_bytes()))
        .map(|(_, v)| v)
}

fn field<'v, 'a>(
    map: &'v [(Value<'a>, Value<'a>)],
    context: &str,
    key: &'static str,
) -> Result<&'v Value<'a>> {
    get(map, key).ok_or_else(|| CodeObjectError::MissingField {
        context: context.into(),
        field: key,
    })
}

fn str_field<'a>(
    map: &[(Value<'a>, Value<'a>)],
    context: &str,
    key: &'static str,
) -> Result<&'a str> {
    field(map, context, key)?
        .as_str()
        .ok_or_else(|| CodeObjectError::BadField {
            context: context.into(),
            field: key,
            expected: "a UTF-8 string",
        })
}

fn u32_field(map: &[(Value<'_>, Value<'_>)], context: &str, key: &'static str) -> Result<u32> {
    field(map, context, key)?
        .as_u32()
        .ok_or_else(|| CodeObjectError::BadField {
            context: context.into(),
            field: key,
            expected: "an integer in 0..2^32",
        })
}

/// A MessagePack decoder for the subset LLVM writes, and the rest of the format so that any
/// input decodes or fails cleanly.
struct MsgPackReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> MsgPackReader<'a> {
    fn error(&self, reason: &'static str) -> CodeObjectError {
        CodeObjectError::MsgPack {
            offset: self.pos,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let bytes = self
            .pos
            .checked_add(n)
            .and_then(|end| self.buf.get(self.pos..end))
            .ok_or_else(|| self.error("value runs past the end of the note"))?;
        self.pos += n;
        Ok(bytes)
    }

    /// A big-endian unsigned integer of `n` ≤ 8 bytes.
    fn uint(&mut self, n: usize) -> Result<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize> {
        let len = self.uint(n)?;
        usize::try_from(len).map_err(|_| self.error("length does not fit in memory"))
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>> {
        if depth > MAX_DEPTH {
            return Err(self.error("containers nested too deep"));
        }
        let tag = self.take(1)?[0];
        Ok(match tag {
            0x00..=0x7f => Value::Int(i128::from(tag)),
            0x80..=0x8f => self.map(usize::from(tag & 0x0f), depth)?,
            0x90..=0x9f => self.array(usize::from(tag & 0x0f), depth)?,
            0xa0..=0xbf => Value::Str(self.take(usize::from(tag & 0x1f))?),
            0xc0 => Value::Nil,
            0xc1 => return Err(self.error("reserved tag 0xc1")),
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (tag - 0xc4))?;
                self.take(n)?;
                Value::Other
            }
            0xc7..=0xc9 => {
                // Length, type byte, data.
                let n = self.len(1 << (tag - 0xc7))?;
                self.take(n.saturating_add(1))?;
                Value::Other
            }
            0xca => {
                self.take(4)?;
                Value::Other
            }
            0xcb => {
                self.take(8)?;
                Value::Other
            }
            0xcc..=0xcf => Value::Int(i128::from(self.uint(1 << (tag - 0xcc))?)),
            0xd0..=0xd3 => {
                let n = 1usize << (tag - 0xd0);
                let raw = self.uint(n)?;
                // Sign-extend the n-byte two's complement value.
                let shift = 64 - 8 * n as u32;
                Value::Int(i128::from(((raw << shift) as i64) >> shift))
            }
            0xd4..=0xd8 => {
                self.take(1 + (1 << (tag - 0xd4)))?;
                Value::Other
            }
            0xd9..=0xdb => {
                let n = self.len(1 << (tag - 0xd9))?;
                Value::Str(self.take(n)?)
            }
            0xdc | 0xdd => {
                let n = self.len(if tag == 0xdc { 2 } else { 4 })?;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.len(if tag == 0xde { 2 } else { 4 })?;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int(i128::from(tag as i8)),
        })
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>> {
        // Every element takes at least one byte: a length beyond the bytes left is corrupt, and
        // never allocated for.
        if n > self.buf.len() - self.pos {
            return Err(self.error("array longer than the note"));
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>> {
        if n > (self.buf.len() - self.pos) / 2 {
            return Err(self.error("map longer than the note"));
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            entries.push((k, v));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Built by `scripts/make-codeobj-fixture.sh` from `tests/data/codeobj-fixture.hip`.
    const FIXTURE: &[u8] = include_bytes!("../tests/data/codeobj-fixture.gfx1201.hsaco");
    /// `llvm-readelf-19 --notes` of the fixture.
    const NOTES: &str = include_str!("../tests/data/codeobj-fixture.notes.txt");
    /// `kernel occupancy` from the `; Occupancy: N` comments of `clang++-19 -S`.
    const OCCUPANCY: &str = include_str!("../tests/data/codeobj-fixture.occupancy.txt");

    fn fixture() -> Vec<KernelResources> {
        parse(FIXTURE).expect("the fixture parses")
    }

    fn kernel<'k>(ks: &'k [KernelResources], name: &str) -> &'k KernelResources {
        ks.iter()
            .find(|k| k.name == name)
            .unwrap_or_else(|| panic!("no kernel {name}"))
    }

    /// `key: value` pairs per kernel from `llvm-readelf --notes` YAML: each kernel is a list
    /// item (`  - .args:`) of `amdhsa.kernels`, its own fields indented by 4 spaces.
    fn readelf_kernels() -> Vec<Vec<(String, String)>> {
        let mut kernels: Vec<Vec<(String, String)>> = Vec::new();
        for line in NOTES.lines() {
            if line.starts_with("  - .") {
                kernels.push(Vec::new());
            }
            let own = line
                .strip_prefix("    ")
                .or_else(|| line.strip_prefix("  - "))
                .filter(|l| l.starts_with('.'));
            if let (Some(l), Some(k)) = (own, kernels.last_mut())
                && let Some((key, value)) = l.split_once(':')
            {
                k.push((key.to_string(), value.trim().to_string()));
            }
        }
        kernels
    }

    #[test]
    fn fixture_matches_llvm_readelf() {
        let parsed = fixture();
        let listed = readelf_kernels();
        assert_eq!(parsed.len(), listed.len());
        assert_eq!(parsed.len(), 9);
        for (k, fields) in parsed.iter().zip(&listed) {
            let f = |key: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, v)| v.as_str())
                    .unwrap_or_else(|| panic!("readelf lists no {key} for {}", k.name))
            };
            assert_eq!(k.name, f(".name"));
            assert_eq!(k.symbol, f(".symbol"));
            for (key, value) in [
                (".vgpr_count", k.vgpr_count),
                (".sgpr_count", k.sgpr_count),
                (".vgpr_spill_count", k.vgpr_spill_count),
                (".sgpr_spill_count", k.sgpr_spill_count),
                (".private_segment_fixed_size", k.private_segment_fixed_size),
                (".group_segment_fixed_size", k.group_segment_fixed_size),
                (".wavefront_size", k.wavefront_size),
                (".max_flat_workgroup_size", k.max_flat_workgroup_size),
            ] {
                assert_eq!(value.to_string(), f(key), "{} {key}", k.name);
            }
            assert_eq!(
                k.workgroup_processor_mode,
                Some(f(".workgroup_processor_mode") == "1")
            );
            assert_eq!(k.arch, "gfx1201");
        }
        assert!(NOTES.contains("amdhsa.target:   amdgcn-amd-amdhsa--gfx1201"));
    }

    #[test]
    fn fixture_values_spelled_out() {
        let ks = fixture();
        let v97 = kernel(&ks, "fx_v97");
        assert_eq!(
            (
                v97.vgpr_count,
                v97.symbol.as_str(),
                v97.max_flat_workgroup_size
            ),
            (97, "fx_v97.kd", 32)
        );
        let lds = kernel(&ks, "fx_lds20000_wg256");
        assert_eq!(
            (lds.group_segment_fixed_size, lds.max_flat_workgroup_size),
            (20000, 256)
        );
        let scratch = kernel(&ks, "fx_scratch");
        assert_eq!(
            (scratch.private_segment_fixed_size, scratch.vgpr_spill_count),
            (272, 0)
        );
        assert_eq!(scratch.max_flat_workgroup_size, 1024);
        let vspill = kernel(&ks, "fx_vspill");
        assert_eq!(
            (
                vspill.vgpr_count,
                vspill.vgpr_spill_count,
                vspill.private_segment_fixed_size
            ),
            (256, 2, 12)
        );
        let sspill = kernel(&ks, "fx_sspill");
        assert_eq!((sspill.sgpr_count, sspill.sgpr_spill_count), (108, 4));
        assert!(ks.iter().all(|k| k.wavefront_size == 32));
    }

    /// The formula against the compiler's own occupancy for each fixture kernel: VGPR steps at
    /// 96/97 and 168/169, 256 VGPRs, LDS-bound one-wave and 8-wave workgroups, scratch, spills.
    #[test]
    fn occupancy_matches_the_compiler() {
        let ks = fixture();
        let mut checked = 0;
        for line in OCCUPANCY.lines() {
            let (name, occ) = line.split_once(' ').expect("`kernel occupancy`");
            let k = kernel(&ks, name);
            assert_eq!(
                k.occupancy_waves_per_simd,
                Some(occ.parse().unwrap()),
                "{name}: {k:?}"
            );
            checked += 1;
        }
        assert_eq!(checked, ks.len());
        assert_eq!(kernel(&ks, "fx_v97").occupancy_waves_per_simd, Some(12));
        assert_eq!(
            kernel(&ks, "fx_lds16k_wg32").occupancy_waves_per_simd,
            Some(2)
        );
    }

    #[test]
    fn occupancy_formula_by_hand() {
        let l = ArchLimits::for_arch("gfx1201").unwrap();
        let occ = |v, lds, wg| l.occupancy(32, v, lds, wg, true).unwrap();
        // VGPRs: 1536 / round_up(v, 24), at most 16.
        assert_eq!(occ(1, 0, 32), 16);
        assert_eq!(occ(96, 0, 32), 16);
        assert_eq!(occ(97, 0, 32), 12);
        assert_eq!(occ(120, 0, 32), 12);
        assert_eq!(occ(121, 0, 32), 10);
        assert_eq!(occ(192, 0, 32), 8);
        assert_eq!(occ(193, 0, 32), 7);
        assert_eq!(occ(256, 0, 32), 5);
        // LDS: 128 KiB per WGP of 4 SIMDs.
        assert_eq!(occ(8, 4096, 32), 8);
        assert_eq!(occ(8, 65536, 32), 1);
        assert_eq!(occ(8, 65536, 1024), 16);
        assert_eq!(occ(8, 40000, 512), 12);
        // wave64 halves the file and the granule; CU mode halves LDS and SIMDs.
        assert_eq!(l.occupancy(64, 97, 0, 64, true), Some(7)); // 768 / 108
        assert_eq!(l.occupancy(32, 8, 16384, 32, false), Some(2));
        assert_eq!(l.occupancy(16, 8, 0, 32, true), None);
        assert_eq!(ArchLimits::for_arch("gfx90a"), None);
    }

    #[test]
    fn target_to_arch() {
        assert_eq!(
            arch_of_target("amdgcn-amd-amdhsa--gfx1201"),
            Some("gfx1201")
        );
        assert_eq!(
            arch_of_target("amdgcn-amd-amdhsa--gfx90a:sramecc+:xnack-"),
            Some("gfx90a")
        );
        assert_eq!(arch_of_target("gfx1201"), None);
        assert_eq!(arch_of_target("amdgcn-amd-amdhsa--"), None);
    }

    #[test]
    fn table_has_a_row_per_kernel() {
        let ks = fixture();
        let table = resource_table(&ks);
        assert_eq!(table.lines().count(), ks.len() + 1);
        assert!(table.lines().next().unwrap().starts_with("kernel"));
        let row = table.lines().find(|l| l.starts_with("fx_sspill ")).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "fx_sspill",
                "gfx1201",
                "3",
                "108",
                "0",
                "4",
                "0",
                "0",
                "32",
                "16"
            ]
        );
    }

    #[test]
    fn not_code_objects_are_errors() {
        assert_eq!(
            parse(b""),
            Err(CodeObjectError::Truncated {
                what: "ELF identification",
                offset: 0,
                len: 0
            })
        );
        assert_eq!(parse(&[0u8; 64]), Err(CodeObjectError::NotElf));
        let mut elf32 = FIXTURE.to_vec();
        elf32[4] = 1;
        assert_eq!(
            parse(&elf32),
            Err(CodeObjectError::NotElf64Le { class: 1, data: 1 })
        );
        let mut x86 = FIXTURE.to_vec();
        x86[18..20].copy_from_slice(&62u16.to_le_bytes());
        assert_eq!(parse(&x86), Err(CodeObjectError::NotAmdgpu(62)));
        // The note renamed: a valid ELF without metadata.
        let mut renamed = FIXTURE.to_vec();
        let at = FIXTURE.windows(7).position(|w| w == b"AMDGPU\0").unwrap();
        renamed[at] = b'X';
        assert_eq!(parse(&renamed), Err(CodeObjectError::NoMetadata));
    }

    #[test]
    fn program_headers_when_section_headers_are_gone() {
        let mut stripped = FIXTURE.to_vec();
        stripped[40..48].fill(0); // e_shoff
        assert_eq!(parse(&stripped), Ok(fixture()));
    }

    /// Every prefix of the fixture, and the fixture with bytes overwritten throughout, parses or
    /// fails with an error: never a panic, never a runaway allocation.
    #[test]
    fn truncated_and_corrupt_input_never_panics() {
        for len in 0..FIXTURE.len() {
            assert!(
                parse(&FIXTURE[..len]).is_err(),
                "prefix of {len} bytes parsed"
            );
        }
        let mut rng = crate::synth::Rng::new(7);
        for _ in 0..2000 {
            let mut bytes = FIXTURE.to_vec();
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(bytes.len());
                bytes[at] = rng.below(256) as u8;
            }
            let _ = parse(&bytes);
        }
        // Garbage after a valid ELF header.
        for seed in 0..200 {
            let mut rng = crate::synth::Rng::new(seed);
            let mut bytes = FIXTURE[..64].to_vec();
            bytes.extend((0..rng.below(4096)).map(|_| rng.below(256) as u8));
            let _ = parse(&bytes);
        }
    }

    /// The metadata note alone, damaged in ways a byte flip rarely reaches.
    #[test]
    fn malformed_msgpack_is_an_error() {
        let decode = |b: &[u8]| MsgPackReader { buf: b, pos: 0 }.value(0).map(|_| ());
        // A map claiming 2^32 - 1 entries, an array of 65535, a string past the end.
        assert!(decode(&[0xdf, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[0xdc, 0xff, 0xff, 0x01]).is_err());
        assert!(decode(&[0xd9, 0x10, b'a']).is_err());
        assert!(decode(&[0xc1]).is_err());
        // Nesting 1000 deep.
        assert!(decode(&[0x91; 1000]).is_err());
        assert!(
            decode(
                &[0x91; 10]
                    .iter()
                    .chain(&[0xc0])
                    .copied()
                    .collect::<Vec<_>>()
            )
            .is_ok()
        );
        // Every prefix of the real note fails cleanly; the whole note decodes.
        let note = metadata_note(FIXTURE).unwrap();
        for len in 0..note.len() {
            assert!(decode(&note[..len]).is_err(), "note prefix of {len} bytes");
        }
        assert!(decode(note).is_ok());
    }

    #[test]
    fn msgpack_scalars() {
        fn one(b: &[u8]) -> Value<'_> {
            MsgPackReader { buf: b, pos: 0 }.value(0).unwrap()
        }
        assert!(matches!(one(&[0xd0, 0xff]), Value::Int(-1)));
        assert!(matches!(one(&[0xd1, 0x80, 0x00]), Value::Int(-32768)));
        assert!(matches!(one(&[0xe0]), Value::Int(-32)));
        assert!(
            matches!(one(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            Value::Int(i) if i == i128::from(u64::MAX))
        );
        assert!(matches!(one(&[0xcd, 0x01, 0x00]), Value::Int(256)));
        assert!(matches!(one(&[0xc0]), Value::Nil));
        // Binaries, floats and extensions are skipped whole: the next value follows.
        for skipped in [
            &[0xc4, 0x02, 1, 2][..],
            &[0xca, 0x3f, 0x80, 0, 0],
            &[0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0],
            &[0xd4, 0x01, 0x02],
            &[0xc7, 0x02, 0x01, 0xaa, 0xbb],
        ] {
            let mut bytes = skipped.to_vec();
            bytes.push(0x07);
            let mut r = MsgPackReader {
                buf: &bytes,
                pos: 0,
            };
            assert!(matches!(r.value(0).unwrap(), Value::Other), "{skipped:?}");
            assert!(matches!(r.value(0).unwrap(), Value::Int(7)), "{skipped:?}");
        }
        assert!(matches!(one(&[0xa2, b'h', b'i']), Value::Str(b"hi")));
        assert!(one(&[0xc3]).as_flag() == Some(true));
        assert!(one(&[0x00]).as_flag() == Some(false));
        assert!(one(&[0xd0, 0xff]).as_u32().is_none());
    }
}

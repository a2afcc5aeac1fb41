//! What each embedded GPU kernel's machine code is made of, counted in its disassembly
//! (`llvm-objdump -d --mcpu=<arch>`): `hipkv info --kernels` prints it beside the resources.
//!
//! These are static counts over the whole kernel, not the instructions a step executes: a loop
//! counts once. They answer the first questions of a GPU cost model without a GPU: does the
//! kernel read memory through global or flat addresses (a flat load also waits on the LDS
//! counter), in bytes or in 16-byte vectors, and does its arithmetic use dot or packed
//! instructions. A change to the kernels shows up here as a changed row.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What `llvm-objdump` is looked for as, in order, after `$HIPKV_LLVM_BIN/llvm-objdump`.
const OBJDUMPS: [&str; 3] = [
    "llvm-objdump-19",
    "llvm-objdump",
    "/opt/rocm/llvm/bin/llvm-objdump",
];

#[derive(Debug, thiserror::Error)]
pub enum CensusError {
    #[error(
        "no llvm-objdump found (looked for $HIPKV_LLVM_BIN/llvm-objdump, {}); \
         scripts/install-hip-toolchain.sh installs one",
        OBJDUMPS.join(", ")
    )]
    NoObjdump,
    #[error("cannot write {path} for llvm-objdump: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{tool} failed on {source_name}: {why}")]
    Disassemble {
        tool: String,
        source_name: String,
        why: String,
    },
}

/// A kernel's instructions by class. Each counts in at most one of `valu`, `salu`, `smem`,
/// `vmem_load`, `vmem_store`, `lds` and `wait` (others, such as scratch accesses, only in
/// `instructions`); the other fields are subsets of those.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub instructions: usize,
    pub valu: usize,
    /// `v_fma*`/`v_fmac*` (f32 and f16 multiply-adds), of `valu`.
    pub fma: usize,
    /// `v_dot*` (packed dot products, integer or f16), of `valu`.
    pub dot: usize,
    /// `v_pk_*` (two 16-bit lanes per register), of `valu`.
    pub packed: usize,
    pub salu: usize,
    /// Scalar memory loads (`s_load*`, `s_buffer_load*`).
    pub smem: usize,
    /// Vector memory loads: `global_load*`, `flat_load*` and `buffer_load*` together.
    pub vmem_load: usize,
    /// Of `vmem_load`, those through flat (generic) addresses.
    pub flat_load: usize,
    /// Of `vmem_load`, those of a single byte (`*_u8`, `*_i8`).
    pub byte_load: usize,
    /// Bytes all of `vmem_load` request per lane, summed (`b128` 16, `b32` 4, `u8` 1, …).
    pub vmem_load_bytes: usize,
    pub vmem_store: usize,
    /// LDS instructions (`ds_*`).
    pub lds: usize,
    /// `s_wait_*` instructions.
    pub wait: usize,
    /// Of `wait`, the combined `s_wait_loadcnt_dscnt`: a wait for memory that also waits for LDS.
    pub wait_load_lds: usize,
}

impl Census {
    /// Counts one instruction `times` times (a loop's body executes more than once).
    pub fn count(&mut self, mnemonic: &str, times: usize) {
        let n = |is: bool| times * usize::from(is);
        self.instructions += times;
        let vmem = ["global_", "flat_", "buffer_"]
            .iter()
            .any(|p| mnemonic.starts_with(p));
        if vmem && mnemonic.contains("_load") {
            self.vmem_load += times;
            self.flat_load += n(mnemonic.starts_with("flat_"));
            let bytes = load_bytes(mnemonic);
            self.byte_load += n(bytes == 1);
            self.vmem_load_bytes += times * bytes;
        } else if vmem {
            self.vmem_store += times;
        } else if mnemonic.starts_with("ds_") {
            self.lds += times;
        } else if mnemonic.starts_with("s_wait") {
            self.wait += times;
            self.wait_load_lds += n(mnemonic == "s_wait_loadcnt_dscnt");
        } else if mnemonic.starts_with("s_load") || mnemonic.starts_with("s_buffer_load") {
            self.smem += times;
        } else if mnemonic.starts_with("s_") {
            self.salu += times;
        } else if mnemonic.starts_with("v_") {
            self.valu += times;
            self.fma += n(mnemonic.starts_with("v_fma"));
            self.dot += n(mnemonic.starts_with("v_dot"));
            self.packed += n(mnemonic.starts_with("v_pk_"));
        }
    }
}

/// Bytes per lane of a vector load, from its suffix: `b128` 16, `b96` 12, `b64` 8, `b32` 4,
/// 16-bit 2, 8-bit 1; atomics and anything unknown count 4.
fn load_bytes(mnemonic: &str) -> usize {
    let suffix = mnemonic.rsplit('_').next().unwrap_or("");
    match suffix {
        "b128" => 16,
        "b96" => 12,
        "b64" => 8,
        "u16" | "i16" | "b16" => 2,
        "u8" | "i8" => 1,
        _ => 4,
    }
}

/// Each function's census in `llvm-objdump -d` output, in order: a function starts at its
/// `<address> <name>:` line; instruction lines start with a tab.
pub fn parse(disassembly: &str) -> Vec<(String, Census)> {
    let mut out: Vec<(String, Census)> = Vec::new();
    for line in disassembly.lines() {
        if let Some(name) = line
            .split_once(" <")
            .filter(|(addr, _)| !addr.is_empty() && addr.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|(_, rest)| rest.strip_suffix(">:"))
        {
            out.push((name.to_string(), Census::default()));
        } else if let (Some(body), Some((_, census))) = (line.strip_prefix('\t'), out.last_mut())
            && let Some(mnemonic) = body.split_whitespace().next()
        {
            census.count(mnemonic, 1);
        }
    }
    out
}

/// `llvm-objdump`: `$HIPKV_LLVM_BIN/llvm-objdump`, else the first of `OBJDUMPS` that runs.
pub fn objdump() -> Result<PathBuf, CensusError> {
    let pinned = std::env::var_os("HIPKV_LLVM_BIN").map(|d| Path::new(&d).join("llvm-objdump"));
    pinned
        .into_iter()
        .chain(OBJDUMPS.iter().map(PathBuf::from))
        .find(|tool| {
            Command::new(tool)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .ok_or(CensusError::NoObjdump)
}

/// The census of every function in one code object.
pub fn of_code_object(
    tool: &Path,
    object: &hipkv::kernels::CodeObject,
) -> Result<Vec<(String, Census)>, CensusError> {
    Ok(parse(&disassemble(tool, object)?))
}

/// `llvm-objdump -d` of one code object.
pub fn disassemble(
    tool: &Path,
    object: &hipkv::kernels::CodeObject,
) -> Result<String, CensusError> {
    let path = std::env::temp_dir().join(format!("hipkv-{}-{}", std::process::id(), object.source));
    std::fs::write(&path, object.bytes).map_err(|source| CensusError::Write {
        path: path.clone(),
        source,
    })?;
    let output = Command::new(tool)
        .arg("-d")
        .arg(format!("--mcpu={}", object.arch))
        .arg(&path)
        .output();
    // The file was only for the tool; a failure to remove it loses nothing.
    let _ = std::fs::remove_file(&path);
    let failed = |why: String| CensusError::Disassemble {
        tool: tool.display().to_string(),
        source_name: object.source.to_string(),
        why,
    };
    let output = output.map_err(|e| failed(e.to_string()))?;
    if !output.status.success() {
        return Err(failed(
            String::from_utf8_lossy(&output.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// One row per kernel.
pub fn table(kernels: &[(String, Census)]) -> String {
    let w = kernels
        .iter()
        .map(|(n, _)| n.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut out = format!(
        "{:<w$}  {:>6}  {:>5}  {:>5}  {:>4}  {:>4}  {:>5}  {:>4}  {:>5}  {:>5}  {:>5}  {:>6}  {:>5}  {:>5}  {:>7}\n",
        "kernel",
        "instrs",
        "VALU",
        "FMA",
        "dot",
        "pk",
        "SALU",
        "SMEM",
        "loads",
        "flat",
        "byte",
        "B/load",
        "LDS",
        "waits",
        "ld+ds w"
    );
    for (name, c) in kernels {
        let per_load = if c.vmem_load == 0 {
            "-".to_string()
        } else {
            format!("{:.1}", c.vmem_load_bytes as f64 / c.vmem_load as f64)
        };
        out += &format!(
            "{name:<w$}  {:>6}  {:>5}  {:>5}  {:>4}  {:>4}  {:>5}  {:>4}  {:>5}  {:>5}  {:>5}  {:>6}  {:>5}  {:>5}  {:>7}\n",
            c.instructions,
            c.valu,
            c.fma,
            c.dot,
            c.packed,
            c.salu,
            c.smem,
            c.vmem_load,
            c.flat_load,
            c.byte_load,
            per_load,
            c.lds,
            c.wait,
            c.wait_load_lds,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "
/tmp/x.hsaco:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000015e00 <hipkv_attn_a>:
\ts_load_b128 s[56:59], s[0:1], 0xb0                         // 000000015E04: F4004E00
\tflat_load_u8 v39, v[21:22] offset:-15                      // 000000016790: EC04007C
\tflat_load_b128 v[1:4], v[21:22]                            // 000000016790: EC04007C
\tglobal_load_b32 v5, v[6:7], off
\ts_wait_loadcnt_dscnt 0x0
\tv_fmac_f32_e32 v1, v2, v3
\tv_dot4_i32_iu8 v1, v2, v3, v1
\tv_pk_mul_f16 v1, v2, v3
\tv_cvt_f32_f16_e32 v1, v2
\tds_load_b32 v1, v2
\tglobal_store_b32 v[1:2], v3, off
\ts_add_co_i32 s1, s2, s3
\ts_endpgm

0000000000016000 <hipkv_attn_b>:
\tbuffer_load_d16_u8 v1, off, s[0:3], 0
\ts_wait_loadcnt 0x0
";

    #[test]
    fn every_instruction_counts_in_its_class() {
        let kernels = parse(SAMPLE);
        let names: Vec<&str> = kernels.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["hipkv_attn_a", "hipkv_attn_b"]);
        let a = kernels[0].1;
        assert_eq!(
            a,
            Census {
                instructions: 13,
                valu: 4,
                fma: 1,
                dot: 1,
                packed: 1,
                salu: 2,
                smem: 1,
                vmem_load: 3,
                flat_load: 2,
                byte_load: 1,
                vmem_load_bytes: 1 + 16 + 4,
                vmem_store: 1,
                lds: 1,
                wait: 1,
                wait_load_lds: 1,
            }
        );
        let b = kernels[1].1;
        assert_eq!(
            (b.instructions, b.vmem_load, b.byte_load, b.flat_load),
            (2, 1, 1, 0)
        );
        assert_eq!((b.wait, b.wait_load_lds), (1, 0));
    }

    #[test]
    fn the_table_has_a_row_per_kernel() {
        let table = table(&parse(SAMPLE));
        assert_eq!(table.lines().count(), 3);
        let row = table.lines().nth(1).unwrap();
        assert!(row.starts_with("hipkv_attn_a"), "{row}");
        assert!(row.contains(" 7.0 "), "bytes per load: {row}");
    }
}

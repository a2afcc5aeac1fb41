//! The GPU code objects `build.rs` compiled from `hip/` and embedded, one per kernel source and
//! arch in `HIPKV_ARCHS`.

/// One embedded code object (an AMDGPU ELF: `hipModuleLoadData` takes these bytes).
#[derive(Clone, Copy, Debug)]
pub struct CodeObject {
    /// The arch it was compiled for, such as `gfx1201`.
    pub arch: &'static str,
    /// The source it was compiled from, with the arch: `attention.gfx1201.hsaco`.
    pub source: &'static str,
    pub bytes: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/code_objects.rs"));

/// Every embedded code object; empty when the crate was built without a HIP compiler.
pub fn code_objects() -> &'static [CodeObject] {
    CODE_OBJECTS
}

/// The issue model's probes (`hipkv info --kernels`), one code object per arch and head_dim:
/// `hipkv_probe_<key>_<value>_d<head_dim>` is one steady-state block of the attention kernel of
/// that name, compiled so that its disassembly is what a wave executes (attention.hip's
/// `probe_block`). Never loaded onto a GPU; empty when the crate was built without a HIP
/// compiler.
pub fn probe_objects() -> &'static [CodeObject] {
    PROBE_OBJECTS
}

/// The code objects built for `arch` (such as `gfx1201`): one per kernel source and head_dim.
/// A device whose arch the build does not cover is an error naming both and the rebuild.
pub fn code_objects_for(arch: &str) -> crate::Result<Vec<&'static CodeObject>> {
    let found: Vec<&CodeObject> = CODE_OBJECTS.iter().filter(|o| o.arch == arch).collect();
    if found.is_empty() {
        let mut built: Vec<String> = CODE_OBJECTS.iter().map(|o| o.arch.to_string()).collect();
        built.dedup();
        return Err(crate::Error::ArchNotBuilt {
            device: arch.to_string(),
            built,
        });
    }
    Ok(found)
}

/// A kernel source in `hip/`: the HIP backend loads one code object of each, that of its cache's
/// head_dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// `hip/attention.hip`: the attention kernels, `hipkv_attn_prep` and `hipkv_attn_combine`.
    Attention,
    /// `hip/write.hip`: the write kernels and `hipkv_copy_blocks`.
    Write,
}

impl KernelSource {
    /// The file stem of the source, which starts its code objects' names.
    pub fn stem(self) -> &'static str {
        match self {
            KernelSource::Attention => "attention",
            KernelSource::Write => "write",
        }
    }

    /// The source that defines the kernel `name`.
    pub fn of_kernel(name: &str) -> KernelSource {
        if name.starts_with("hipkv_write") || name == "hipkv_copy_blocks" {
            KernelSource::Write
        } else {
            KernelSource::Attention
        }
    }
}

/// The code object of `source` for `arch` and `head_dim`: the one the HIP backend loads for a
/// cache of that head_dim, which must hold every kernel of that source it launches there.
pub fn code_object_for(
    arch: &str,
    source: KernelSource,
    head_dim: usize,
) -> crate::Result<&'static CodeObject> {
    let tag = format!(".d{head_dim}.");
    code_objects_for(arch)?
        .into_iter()
        .find(|o| o.source.starts_with(source.stem()) && o.source.contains(&tag))
        .ok_or_else(|| {
            crate::Error::Unsupported(format!(
                "head_dim {head_dim} on {arch} (no {} code object for it)",
                source.stem()
            ))
        })
}

/// Why no code objects were built (`None` when they were).
pub fn gpu_build_skipped() -> Option<&'static str> {
    SKIPPED
}

/// The name of the decode-attention kernel for a key format, value format and head_dim.
pub fn attention_kernel_name(k: crate::Format, v: crate::Format, head_dim: usize) -> String {
    format!(
        "hipkv_attn_{}_{}_d{head_dim}",
        k.kernel_name(),
        v.kernel_name()
    )
}

/// The name of the write kernel that stores new tokens into a stream stored in `format`.
pub fn write_kernel_name(format: crate::Format, head_dim: usize) -> String {
    format!("hipkv_write_{}_d{head_dim}", format.kernel_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arch_not_built_names_the_rebuild() {
        let e = code_objects_for("gfx9999").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("the GPU is gfx9999"), "{text}");
        assert!(text.ends_with("rebuild with HIPKV_ARCHS=gfx9999"), "{text}");
        for o in CODE_OBJECTS {
            // Two kernel sources, three head_dims each.
            assert_eq!(code_objects_for(o.arch).unwrap().len(), 6, "{}", o.arch);
            // One probe object per head_dim, kept out of what a device loads.
            let probes = PROBE_OBJECTS.iter().filter(|p| p.arch == o.arch).count();
            assert_eq!(probes, 3, "{}", o.arch);
        }
    }
}

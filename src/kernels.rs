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

/// The name of the append kernel that writes new tokens into a stream stored in `format`.
pub fn append_kernel_name(format: crate::Format, head_dim: usize) -> String {
    format!("hipkv_append_{}_d{head_dim}", format.kernel_name())
}

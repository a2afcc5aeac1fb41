//! Where attention runs. The CPU backend is the reference engine and the fallback everywhere.

pub(crate) mod cpu;
mod simd;

/// The arithmetic the CPU backend runs on this machine: `"AVX2+FMA+F16C"` or `"portable"`
/// (also what `HIPKV_CPU_SIMD=portable` forces).
pub fn cpu_kernels() -> &'static str {
    if simd::avx2_enabled() {
        "AVX2+FMA+F16C"
    } else {
        "portable"
    }
}

//! Where attention runs. The CPU backend is the reference engine and the fallback everywhere;
//! the emulator backend runs the HIP kernels' own code on the CPU.

mod choice;
pub(crate) mod cpu;
mod emu;
mod simd;
mod split;

pub use choice::{BACKEND_ENV, HipStatus};
pub(crate) use emu::{AppendTarget, append as emu_append, attend as emu_attend};
pub use split::{GFX1201_COMPUTE_UNITS, SplitPlan};

/// The engine that runs a cache's attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Rust kernels on every core: the reference engine.
    #[default]
    Cpu,
    /// The HIP kernels of `hip/` (append and attention), compiled for the host and run by the
    /// SIMT emulator, through the launch path a GPU takes. Attention is decode only (one new
    /// token per query); slow, for tests.
    Emu,
}

/// The arithmetic the CPU backend runs on this machine: `"AVX2+FMA+F16C"` or `"portable"`
/// (also what `HIPKV_CPU_SIMD=portable` forces).
pub fn cpu_kernels() -> &'static str {
    if simd::avx2_enabled() {
        "AVX2+FMA+F16C"
    } else {
        "portable"
    }
}

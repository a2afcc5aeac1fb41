//! Where attention runs. The CPU backend is the reference engine and the fallback everywhere;
//! the emulator backend runs the HIP kernels' own code on the CPU.

mod choice;
pub(crate) mod cpu;
pub(crate) mod device;
mod emu;
mod simd;
mod split;

pub use choice::{BACKEND_ENV, HipStatus};
pub use device::DeviceMemory;
pub(crate) use device::stream_abi;
pub use split::{GFX1201_COMPUTE_UNITS, SplitPlan};

/// The engine that runs a cache's attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Rust kernels on every core: the reference engine.
    #[default]
    Cpu,
    /// The device-resident cache of the `Hip` backend with host memory standing in for device
    /// memory and the HIP kernels of `hip/` (append and attention) run by the SIMT emulator:
    /// the GPU's code path up to the runtime calls. Attention is decode only (one new token per
    /// query); slow, for tests.
    Emu,
    /// The cache in GPU memory, the HIP kernels launched on a stream of the first GPU whose
    /// arch this build has kernels for. Attention is decode only (one new token per query).
    Hip,
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

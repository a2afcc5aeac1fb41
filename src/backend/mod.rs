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
pub use emu::{KernelLoads, LoadCounts, trace_loads};
pub use split::{GFX1201_COMPUTE_UNITS, SplitPlan};

use crate::abi::{hipkv_attn_params, hipkv_copy_params, hipkv_write_params};
use crate::error::Result;
use crate::hip::{Device, StreamHandle};
use crate::paged::{AttendPlan, Layout};
use crate::rope::RopeTable;
use device::Timer;

/// What every backend does for the paged core (`crate::paged`): its memory, and the paged calls,
/// each executing the very params struct the kernels take. Three implementations: the CPU
/// (host memory, Rust kernels), the emulated device (host memory, the HIP kernels run by the
/// SIMT emulator) and the GPU.
pub(crate) trait Engine: Send + Sync {
    fn backend(&self) -> Backend;

    /// The GPU, for `Hip`.
    fn device(&self) -> Option<&Device> {
        None
    }

    /// A zeroed allocation of `bytes`.
    fn alloc(&self, bytes: usize) -> Result<DeviceMemory>;

    /// Copies `src` to `dst` at byte `offset`, after the work queued on `stream`.
    fn upload(
        &self,
        dst: &DeviceMemory,
        offset: usize,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<()>;

    /// Copies bytes `offset..offset + dst.len()` of `src` into `dst`, after the work queued on
    /// `stream` (a fault in that work surfaces here).
    fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        stream: StreamHandle,
    ) -> Result<()>;

    /// Queues a copy of `bytes` bytes from `src` to `dst`, both in this backend's memory.
    ///
    /// # Safety
    /// Both ranges lie in live allocations of this backend until the copy completes, and do not
    /// overlap.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: StreamHandle) -> Result<()>;

    /// Waits for the work queued on `stream`; a fault in it is the error.
    fn finish(&self, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }

    fn start_timer(&self, _stream: StreamHandle) -> Result<Timer> {
        Ok(Timer::Wall(std::time::Instant::now()))
    }

    /// Seconds since `timer` started, on the device's clock where it has one.
    fn stop_timer(&self, timer: Timer, stream: StreamHandle) -> Result<f64> {
        match timer {
            Timer::Events(start, stop) => {
                stop.record(stream)?;
                Ok(f64::from(stop.elapsed_ms_since(&start)?) / 1e3)
            }
            Timer::Wall(start) => Ok(start.elapsed().as_secs_f64()),
        }
    }

    /// `write_kv` of one stream.
    ///
    /// # Safety
    /// Every address in `p` lies in a live allocation of this backend until the work completes,
    /// large enough for what `hipkv_abi.h` says the call reads and writes.
    unsafe fn write_kv(
        &self,
        p: &hipkv_write_params,
        layout: &Layout,
        stream: StreamHandle,
    ) -> Result<()>;

    /// `attend`, with its launch plan (`rope`: the table of `pre_rope` keys, for the CPU).
    ///
    /// # Safety
    /// As [`write_kv`](Self::write_kv).
    unsafe fn attend(
        &self,
        p: &hipkv_attn_params,
        plan: &AttendPlan,
        layout: &Layout,
        rope: Option<&RopeTable>,
        stream: StreamHandle,
    ) -> Result<()>;

    /// `copy_blocks`.
    ///
    /// # Safety
    /// As [`write_kv`](Self::write_kv).
    unsafe fn copy_blocks(&self, p: &hipkv_copy_params, stream: StreamHandle) -> Result<()>;
}

/// Opens `backend` for kernels of `head_dim`: for `Hip`, the first GPU whose arch this build has
/// kernels for, and its code objects.
pub(crate) fn open_engine(backend: Backend, head_dim: usize) -> Result<Box<dyn Engine>> {
    Ok(match backend {
        Backend::Cpu => Box::new(cpu::paged::CpuEngine::default()),
        Backend::Emu => Box::new(device::EmuEngine),
        Backend::Hip => Box::new(device::HipGpu::open(head_dim)?),
    })
}

/// The engine that runs a cache's attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Rust kernels on every core: the reference engine.
    #[default]
    Cpu,
    /// The `Hip` backend's code path with host memory standing in for device memory and the
    /// HIP kernels of `hip/` (write and attention) run by the SIMT emulator: everything up to
    /// the runtime calls. Slow, for tests.
    Emu,
    /// The cache in GPU memory, the HIP kernels queued on a stream of the first GPU whose arch
    /// this build has kernels for.
    Hip,
}

/// The arithmetic the CPU backend runs on this machine: `"AVX-512+VNNI"`,
/// `"AVX2+FMA+F16C"` or `"portable"` (`HIPKV_CPU_SIMD=avx2` or `=portable` caps it).
pub fn cpu_kernels() -> &'static str {
    simd::Tier::detected().name()
}

//! Memory and kernel launches of every backend. `Hip` allocates device memory and launches the
//! kernels of `hip/` on a server's stream; `Emu` runs the very same code with host allocations
//! and the SIMT emulator in place of `hipMalloc`/`hipMemcpy`/`hipModuleLaunchKernel`, so CI
//! exercises every step of the device path (allocation, uploads, launches, downloads, free)
//! except the runtime calls themselves; `Cpu` keeps its memory in the same host allocations and
//! runs the Rust kernels of [`super::cpu`] instead.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::time::Instant;

use crate::abi::{HIPKV_THREADS, HIPKV_WAVE, hipkv_stream_layout};
use crate::error::{Error, Result};
use crate::hip::{
    Device, DeviceBuffer, DeviceCopy, Event, Module, StreamHandle, count_allocation, count_copy,
    count_synchronization, runtime,
};
use crate::kernels::code_objects_for;
use crate::scheme::{Format, StreamLayout};

use super::emu;
use super::{Backend, HipStatus};

/// Alignment of every allocation: what a 128-bit load needs, and what `hipMalloc` gives.
pub(crate) const ALIGN: usize = 256;

/// Where a backend's memory lives and how its kernels run.
pub(crate) enum Gpu {
    /// Host allocations; the Rust kernels.
    Cpu,
    /// Host allocations; the HIP kernels run by the SIMT emulator.
    Emu,
    Hip(HipGpu),
}

/// A GPU opened for one head_dim: the code objects of its kernels.
pub(crate) struct HipGpu {
    device: Device,
    attention: Module,
    write: Module,
}

/// Zeroed, [`ALIGN`]-aligned host memory standing in for a device allocation: written and
/// read through its address only, as device memory is.
pub(crate) struct HostAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is owned by this value and only reached through its address.
unsafe impl Send for HostAlloc {}
// SAFETY: shared access only hands out the address; writes through it are ordered by the calls
// that make them, as for device memory.
unsafe impl Sync for HostAlloc {}

impl HostAlloc {
    fn new(bytes: usize, backend: &'static str) -> Result<HostAlloc> {
        let oom = Error::OutOfMemory {
            bytes: bytes as u128,
            backend,
        };
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| oom.clone())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(oom)?;
        Ok(HostAlloc { ptr, layout })
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One allocation of a backend's memory, zeroed when made, freed on drop.
pub struct DeviceMemory(Mem);

enum Mem {
    Host(HostAlloc),
    Hip(DeviceBuffer<u8>),
}

impl DeviceMemory {
    /// The address kernels see (device memory for `Hip`, host memory otherwise).
    pub fn addr(&self) -> u64 {
        match &self.0 {
            Mem::Host(h) => h.ptr.as_ptr() as u64,
            Mem::Hip(b) => b.device_ptr() as u64,
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.0 {
            Mem::Host(h) => h.layout.size(),
            Mem::Hip(b) => b.len(),
        }
    }

    fn check(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.bytes() => Ok(()),
            _ => Err(Error::OutOfRange {
                what: "device memory byte",
                index: offset.saturating_add(n),
                limit: self.bytes() + 1,
            }),
        }
    }
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// The time of the work between two points of a device's queue.
pub(crate) enum Timer {
    Wall(Instant),
    Events(Event, Event),
}

impl Gpu {
    /// Opens `backend` for kernels of `head_dim`: for `Hip`, the first GPU whose arch this build
    /// has kernels for, and its code objects.
    pub(crate) fn open(backend: Backend, head_dim: usize) -> Result<Gpu> {
        match backend {
            Backend::Cpu => Ok(Gpu::Cpu),
            Backend::Emu => Ok(Gpu::Emu),
            Backend::Hip => HipGpu::open(head_dim).map(Gpu::Hip),
        }
    }

    /// The backend this memory belongs to.
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Gpu::Cpu => Backend::Cpu,
            Gpu::Emu => Backend::Emu,
            Gpu::Hip(_) => Backend::Hip,
        }
    }

    /// The GPU, for `Hip`.
    pub(crate) fn device(&self) -> Option<&Device> {
        match self {
            Gpu::Cpu | Gpu::Emu => None,
            Gpu::Hip(h) => Some(&h.device),
        }
    }

    /// A zeroed allocation of `bytes`.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        match self {
            Gpu::Cpu => HostAlloc::new(bytes, "cpu").map(|h| DeviceMemory(Mem::Host(h))),
            Gpu::Emu => {
                count_allocation();
                HostAlloc::new(bytes, "emu").map(|h| DeviceMemory(Mem::Host(h)))
            }
            Gpu::Hip(h) => {
                h.bind()?;
                let buf = DeviceBuffer::new(bytes.max(1))?;
                let zeros = vec![0u8; bytes.max(1)];
                buf.write_at(0, &zeros)?;
                Ok(DeviceMemory(Mem::Hip(buf)))
            }
        }
    }

    /// Copies `src` to `dst` at byte `offset`, after the work queued on `stream` so far.
    pub(crate) fn upload(
        &self,
        dst: &DeviceMemory,
        offset: usize,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<()> {
        dst.check(offset, src.len())?;
        match &dst.0 {
            Mem::Host(h) => {
                // The emulated device counts what the GPU's copy would make: a wait, a copy.
                if matches!(self, Gpu::Emu) {
                    self.finish(stream)?;
                    count_copy();
                }
                // SAFETY: the range lies inside the allocation (checked) and `src` is host
                // memory of another allocation; no reference into the allocation exists.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        h.ptr.as_ptr().add(offset),
                        src.len(),
                    )
                };
                Ok(())
            }
            Mem::Hip(b) => {
                self.finish(stream)?;
                b.write_at(offset, src)
            }
        }
    }

    /// Copies bytes `offset..offset + dst.len()` of `src` into `dst`, after the work queued on
    /// `stream` so far (a kernel fault surfaces here).
    pub(crate) fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        stream: StreamHandle,
    ) -> Result<()> {
        src.check(offset, dst.len())?;
        match &src.0 {
            Mem::Host(h) => {
                if matches!(self, Gpu::Emu) {
                    self.finish(stream)?;
                    count_copy();
                }
                // SAFETY: the range lies inside the allocation (checked); nothing writes it
                // during the copy (host-memory backends finish their work before returning).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        h.ptr.as_ptr().add(offset),
                        dst.as_mut_ptr(),
                        dst.len(),
                    )
                };
                Ok(())
            }
            Mem::Hip(b) => {
                self.finish(stream)?;
                b.read_at(offset, dst)
            }
        }
    }

    /// Queues a copy of `bytes` bytes from `src` to `dst`, both in this backend's memory.
    ///
    /// # Safety
    /// Both ranges lie in live allocations of this backend until the copy completes, and do not
    /// overlap.
    pub(crate) unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        match self {
            Gpu::Cpu | Gpu::Emu => {
                // SAFETY: the caller's contract, in host memory.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }
            Gpu::Hip(h) => {
                h.bind()?;
                // SAFETY: the caller's contract.
                unsafe { stream.copy_device(dst, src, bytes) }
            }
        }
    }

    /// Queues kernel `name` over `grid` workgroups of `waves` waves on `stream`.
    ///
    /// # Safety
    /// `params` is the kernel's params struct and every address in it lies in a live allocation
    /// of this backend until the work completes, large enough for what the kernel reads and
    /// writes.
    pub(crate) unsafe fn launch<P: Copy>(
        &self,
        name: &str,
        params: &P,
        grid: [u32; 3],
        waves: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        let block = [HIPKV_WAVE * waves, 1, 1];
        match self {
            Gpu::Cpu => unreachable!("the CPU backend runs Rust kernels"),
            Gpu::Emu => emu::launch(name, params, grid, block),
            Gpu::Hip(h) => {
                h.bind()?;
                let module = if name.starts_with("hipkv_write") || name == "hipkv_copy_blocks" {
                    &h.write
                } else {
                    &h.attention
                };
                let function = module.function(name)?;
                // SAFETY: the caller's contract.
                unsafe { module.launch(function, grid, block, params, stream) }
            }
        }
    }

    /// Waits for the work queued on `stream`; a fault in it is the error.
    pub(crate) fn finish(&self, stream: StreamHandle) -> Result<()> {
        match self {
            Gpu::Cpu => Ok(()),
            Gpu::Emu => {
                count_synchronization();
                Ok(())
            }
            Gpu::Hip(h) => {
                h.bind()?;
                stream.synchronize()
            }
        }
    }

    pub(crate) fn start_timer(&self, stream: StreamHandle) -> Result<Timer> {
        match self {
            Gpu::Cpu | Gpu::Emu => Ok(Timer::Wall(Instant::now())),
            Gpu::Hip(h) => {
                h.bind()?;
                let (start, stop) = (Event::new()?, Event::new()?);
                start.record(stream)?;
                Ok(Timer::Events(start, stop))
            }
        }
    }

    /// Seconds since `timer` started, on the device's clock for `Hip`.
    pub(crate) fn stop_timer(&self, timer: Timer, stream: StreamHandle) -> Result<f64> {
        match timer {
            Timer::Events(start, stop) => {
                stop.record(stream)?;
                Ok(f64::from(stop.elapsed_ms_since(&start)?) / 1e3)
            }
            Timer::Wall(start) => Ok(start.elapsed().as_secs_f64()),
        }
    }
}

impl HipGpu {
    /// Makes this GPU the calling thread's current device (HIP keeps one per thread, and a
    /// cache may be used from any thread).
    fn bind(&self) -> Result<()> {
        Ok(runtime()?.set_device(self.device.ordinal)?)
    }

    fn open(head_dim: usize) -> Result<HipGpu> {
        let status = HipStatus::probe();
        let device = status
            .usable_device()
            .cloned()
            .ok_or_else(|| Error::BackendUnavailable {
                backend: "hip",
                why: status.obstacle().unwrap_or_default(),
            })?;
        let objects = code_objects_for(&device.arch)?;
        runtime()?.set_device(device.ordinal)?;
        let tag = format!(".d{head_dim}.");
        let load = |stem: &str| -> Result<Module> {
            let object = objects
                .iter()
                .find(|o| o.source.starts_with(stem) && o.source.contains(&tag))
                .ok_or_else(|| {
                    Error::Unsupported(format!(
                        "head_dim {head_dim} on {} (no {stem} code object for it)",
                        device.arch
                    ))
                })?;
            Module::load(object)
        };
        Ok(HipGpu {
            attention: load("attention")?,
            write: load("write")?,
            device,
        })
    }
}

/// Workgroups of one wave: every kernel but attention.
pub(crate) const ONE_WAVE: u32 = HIPKV_THREADS / HIPKV_WAVE;

/// The bytes of a slice of plain numbers.
pub(crate) fn as_bytes<T: DeviceCopy>(values: &[T]) -> &[u8] {
    // SAFETY: `DeviceCopy` values have no padding, so every byte is initialized; the length
    // covers exactly `values`.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), size_of_val(values)) }
}

pub(crate) fn stream_abi(l: &StreamLayout, head_dim: usize) -> hipkv_stream_layout {
    let group = match l.format {
        Format::Tok { group, .. } => group.size(head_dim),
        _ => head_dim,
    };
    let u = |x: usize| u32::try_from(x).expect("page offsets fit in u32");
    hipkv_stream_layout {
        rows: u(l.rows),
        row_bytes: u(l.row_bytes),
        params: u(l.params),
        counts: u(l.counts),
        slots: u(l.slots),
        outlier_slots: u(l.outlier_slots),
        group: u(group),
        residual: u32::from(l.format.is_grouped_by_tokens()),
    }
}

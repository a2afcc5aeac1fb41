//! Memory, and the two backends that run the kernels of `hip/`: `Hip` allocates device memory
//! and launches them on a server's stream; `Emu` runs the very same launches with host
//! allocations and the SIMT emulator in place of `hipMalloc`/`hipMemcpy`/
//! `hipModuleLaunchKernel`, so CI exercises every step of the device path (allocation, uploads,
//! launches, downloads, free) except the runtime calls themselves. Which kernels a paged call
//! launches is written once (`launch_*`), for both. The CPU backend keeps its memory in the
//! same host allocations and runs the Rust kernels of [`super::cpu`] instead.

use std::alloc::{Layout as AllocLayout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::time::Instant;

use crate::abi::{
    HIPKV_THREADS, HIPKV_WAVE, hipkv_attn_params, hipkv_copy_params, hipkv_stream_layout,
    hipkv_write_params,
};
use crate::error::{Error, Result};
use crate::hip::{
    Device, DeviceBuffer, DeviceCopy, Event, Module, StreamHandle, count_allocation, count_copy,
    count_synchronization, runtime,
};
use crate::kernels::{KernelSource, attention_kernel_name, code_object_for, write_kernel_name};
use crate::paged::{AttendPlan, Layout};
use crate::rope::RopeTable;
use crate::scheme::{Format, Stream, StreamLayout};

use super::emu;
use super::{Backend, Engine, HipStatus};

/// Alignment of every allocation: what a 128-bit load needs, and what `hipMalloc` gives.
pub(crate) const ALIGN: usize = 256;

/// `Backend::Hip`: a GPU opened for one head_dim, with the code objects of its kernels.
pub(crate) struct HipGpu {
    device: Device,
    attention: Module,
    write: Module,
}

/// Zeroed, [`ALIGN`]-aligned host memory standing in for a device allocation: written and
/// read through its address only, as device memory is.
pub(crate) struct HostAlloc {
    ptr: NonNull<u8>,
    layout: AllocLayout,
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
        let layout = AllocLayout::from_size_align(bytes.max(1), ALIGN).map_err(|_| oom.clone())?;
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

/// Host memory standing in for device memory, for the CPU backend and the emulated device.
pub(crate) fn host_alloc(bytes: usize, backend: &'static str) -> Result<DeviceMemory> {
    HostAlloc::new(bytes, backend).map(|h| DeviceMemory(Mem::Host(h)))
}

/// Copies `src` into host memory `dst` at `offset`.
pub(crate) fn host_upload(dst: &DeviceMemory, offset: usize, src: &[u8]) -> Result<()> {
    dst.check(offset, src.len())?;
    let Mem::Host(h) = &dst.0 else {
        return Err(Error::Unsupported("device memory on a host backend".into()));
    };
    // SAFETY: the range lies inside the allocation (checked) and `src` is host memory of
    // another allocation; no reference into the allocation exists.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), h.ptr.as_ptr().add(offset), src.len()) };
    Ok(())
}

/// Copies bytes `offset..offset + dst.len()` of host memory `src` into `dst`.
pub(crate) fn host_download(src: &DeviceMemory, offset: usize, dst: &mut [u8]) -> Result<()> {
    src.check(offset, dst.len())?;
    let Mem::Host(h) = &src.0 else {
        return Err(Error::Unsupported("device memory on a host backend".into()));
    };
    // SAFETY: the range lies inside the allocation (checked); nothing writes it during the
    // copy (host-memory backends finish their work before returning).
    unsafe {
        std::ptr::copy_nonoverlapping(h.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
    };
    Ok(())
}

/// Copies `bytes` bytes between two places of host memory.
///
/// # Safety
/// Both ranges lie in live allocations and do not overlap.
pub(crate) unsafe fn host_copy(dst: u64, src: u64, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
}

/// A device that runs the kernels of `hip/`: the GPU, or the emulator on host memory.
pub(crate) trait Launch {
    /// Queues kernel `name` over `grid` workgroups of `waves` waves on `stream`.
    ///
    /// # Safety
    /// `params` is the kernel's params struct and every address in it lies in a live
    /// allocation of this device until the work completes, large enough for what the kernel
    /// reads and writes.
    unsafe fn launch<P: Copy + 'static>(
        &self,
        name: &str,
        params: &P,
        grid: [u32; 3],
        waves: u32,
        stream: StreamHandle,
    ) -> Result<()>;
}

/// `write_kv` of one stream, as kernels: the write kernel, then for a per-channel stream the
/// residual kernel.
///
/// # Safety
/// As [`Engine::write_kv`].
pub(crate) unsafe fn launch_write_kv<L: Launch>(
    l: &L,
    p: &hipkv_write_params,
    layout: &Layout,
    stream: StreamHandle,
) -> Result<()> {
    let kind = if p.stream == 0 { Stream::K } else { Stream::V };
    let format = layout.scheme().format(kind);
    let d = layout.head_dim();
    let grid = [p.tokens, p.g.kv_heads, 1];
    // SAFETY: the caller's contract.
    unsafe { l.launch(&write_kernel_name(format, d), p, grid, ONE_WAVE, stream)? };
    if format.is_grouped_by_tokens() {
        // SAFETY: as above.
        unsafe {
            l.launch(
                &format!("hipkv_write_residual_d{d}"),
                p,
                grid,
                ONE_WAVE,
                stream,
            )?
        };
    }
    Ok(())
}

/// `attend`, as kernels: prepare the queries, attend, combine.
///
/// # Safety
/// As [`Engine::attend`].
pub(crate) unsafe fn launch_attend<L: Launch>(
    l: &L,
    p: &hipkv_attn_params,
    plan: &AttendPlan,
    layout: &Layout,
    stream: StreamHandle,
) -> Result<()> {
    let spec = layout.spec();
    let kv_heads = p.g.kv_heads;
    let name = attention_kernel_name(spec.scheme.k, spec.scheme.v, spec.head_dim);
    let grid = [p.num_seqs * p.tiles_per_seq, kv_heads, p.splits];
    let rows = p.tokens * spec.q_heads as u32;
    // SAFETY: the caller's contract.
    unsafe {
        l.launch(
            "hipkv_attn_prep",
            p,
            [p.tokens, kv_heads, 1],
            ONE_WAVE,
            stream,
        )?;
        l.launch(&name, p, grid, plan.waves as u32, stream)?;
        l.launch("hipkv_attn_combine", p, [rows, 1, 1], ONE_WAVE, stream)
    }
}

/// `copy_blocks`, as a kernel: a workgroup per (pair, 4 KiB of a block).
///
/// # Safety
/// As [`Engine::copy_blocks`].
pub(crate) unsafe fn launch_copy_blocks<L: Launch>(
    l: &L,
    p: &hipkv_copy_params,
    stream: StreamHandle,
) -> Result<()> {
    let chunks = p.block_bytes.div_ceil(4096) as u32;
    // SAFETY: the caller's contract.
    unsafe {
        l.launch(
            "hipkv_copy_blocks",
            p,
            [p.pairs, chunks, 1],
            ONE_WAVE,
            stream,
        )
    }
}

/// `Backend::Emu`: host memory, the kernels run by the SIMT emulator. It counts the runtime
/// calls a GPU would make for its allocations and copies (`hip::traffic`).
pub(crate) struct EmuEngine;

impl Launch for EmuEngine {
    unsafe fn launch<P: Copy + 'static>(
        &self,
        name: &str,
        params: &P,
        grid: [u32; 3],
        waves: u32,
        _stream: StreamHandle,
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        emu::launch(name, params, grid, [HIPKV_WAVE * waves, 1, 1])
    }
}

impl Engine for EmuEngine {
    fn backend(&self) -> Backend {
        Backend::Emu
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        count_allocation();
        host_alloc(bytes, "emu")
    }

    fn upload(
        &self,
        dst: &DeviceMemory,
        offset: usize,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<()> {
        // What the GPU's copy would cost: a wait, a copy.
        self.finish(stream)?;
        count_copy();
        host_upload(dst, offset, src)
    }

    fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        stream: StreamHandle,
    ) -> Result<()> {
        self.finish(stream)?;
        count_copy();
        host_download(src, offset, dst)
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, _stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { host_copy(dst, src, bytes) };
        Ok(())
    }

    fn finish(&self, _stream: StreamHandle) -> Result<()> {
        count_synchronization();
        Ok(())
    }

    unsafe fn write_kv(
        &self,
        p: &hipkv_write_params,
        layout: &Layout,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_write_kv(self, p, layout, stream) }
    }

    unsafe fn attend(
        &self,
        p: &hipkv_attn_params,
        plan: &AttendPlan,
        layout: &Layout,
        _rope: Option<&RopeTable>,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_attend(self, p, plan, layout, stream) }
    }

    unsafe fn copy_blocks(&self, p: &hipkv_copy_params, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_copy_blocks(self, p, stream) }
    }
}

impl Launch for HipGpu {
    unsafe fn launch<P: Copy + 'static>(
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
        self.bind()?;
        let module = match KernelSource::of_kernel(name) {
            KernelSource::Attention => &self.attention,
            KernelSource::Write => &self.write,
        };
        let function = module.function(name)?;
        // SAFETY: the caller's contract.
        unsafe { module.launch(function, grid, [HIPKV_WAVE * waves, 1, 1], params, stream) }
    }
}

impl Engine for HipGpu {
    fn backend(&self) -> Backend {
        Backend::Hip
    }

    fn device(&self) -> Option<&Device> {
        Some(&self.device)
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        self.bind()?;
        let buf = DeviceBuffer::new(bytes.max(1))?;
        buf.write_at(0, &vec![0u8; bytes.max(1)])?;
        Ok(DeviceMemory(Mem::Hip(buf)))
    }

    fn upload(
        &self,
        dst: &DeviceMemory,
        offset: usize,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<()> {
        dst.check(offset, src.len())?;
        let Mem::Hip(b) = &dst.0 else {
            return Err(Error::Unsupported("host memory on the GPU backend".into()));
        };
        self.finish(stream)?;
        b.write_at(offset, src)
    }

    fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        stream: StreamHandle,
    ) -> Result<()> {
        src.check(offset, dst.len())?;
        let Mem::Hip(b) = &src.0 else {
            return Err(Error::Unsupported("host memory on the GPU backend".into()));
        };
        self.finish(stream)?;
        b.read_at(offset, dst)
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize, stream: StreamHandle) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { stream.copy_device(dst, src, bytes) }
    }

    fn finish(&self, stream: StreamHandle) -> Result<()> {
        self.bind()?;
        stream.synchronize()
    }

    fn start_timer(&self, stream: StreamHandle) -> Result<Timer> {
        self.bind()?;
        let (start, stop) = (Event::new()?, Event::new()?);
        start.record(stream)?;
        Ok(Timer::Events(start, stop))
    }

    unsafe fn write_kv(
        &self,
        p: &hipkv_write_params,
        layout: &Layout,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_write_kv(self, p, layout, stream) }
    }

    unsafe fn attend(
        &self,
        p: &hipkv_attn_params,
        plan: &AttendPlan,
        layout: &Layout,
        _rope: Option<&RopeTable>,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_attend(self, p, plan, layout, stream) }
    }

    unsafe fn copy_blocks(&self, p: &hipkv_copy_params, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_copy_blocks(self, p, stream) }
    }
}

impl HipGpu {
    /// Makes this GPU the calling thread's current device (HIP keeps one per thread, and a
    /// cache may be used from any thread).
    fn bind(&self) -> Result<()> {
        Ok(runtime()?.set_device(self.device.ordinal)?)
    }

    pub(crate) fn open(head_dim: usize) -> Result<HipGpu> {
        let status = HipStatus::probe();
        let device = status
            .usable_device()
            .cloned()
            .ok_or_else(|| Error::BackendUnavailable {
                backend: "hip",
                why: status.obstacle().unwrap_or_default(),
            })?;
        runtime()?.set_device(device.ordinal)?;
        let load = |source: KernelSource| -> Result<Module> {
            Module::load(code_object_for(&device.arch, source, head_dim)?)
        };
        Ok(HipGpu {
            attention: load(KernelSource::Attention)?,
            write: load(KernelSource::Write)?,
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

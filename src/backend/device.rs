//! The device-resident cache: the bytes of a [`KvCache`](crate::KvCache) on a device backend
//! (pages, sinks, residual windows, block tables, outlier thresholds) held in device
//! allocations, written by the append kernels and read by the decode-attention kernels.
//!
//! `hip` runs this code on a GPU. `emu` runs the very same code with host allocations and the
//! SIMT emulator in place of `hipMalloc`/`hipMemcpy`/`hipModuleLaunchKernel`, so CI exercises
//! every step of the device path (allocation, uploads, launches, downloads, free) except the
//! runtime calls themselves.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::abi::{
    HIPKV_MAX_GQA, HIPKV_THREADS, hipkv_append_params, hipkv_attn_params, hipkv_combine_params,
    hipkv_rows, hipkv_stream_layout,
};
use crate::cache::{CacheConfig, Query, SeqState};
use crate::error::{Error, Result};
use crate::hip::{Device, DeviceBuffer, DeviceCopy, Event, Module, Stream, runtime};
use crate::kernels::{append_kernel_name, attention_kernel_name, code_objects_for};
use crate::quant::OutlierThresholds;
use crate::rope::{RopeLayout, RopeTable};
use crate::scheme::{Format, HeadLayout, Stream as KvStream, StreamLayout};

use super::cpu::{CacheView, prepare_queries};
use super::emu;
use super::split::{GFX1201_COMPUTE_UNITS, SplitPlan};
use super::{Backend, HipStatus};

/// Alignment of every allocation and of every array packed into the scratch buffer: what a
/// 128-bit load needs, and what `hipMalloc` gives.
const ALIGN: usize = 256;

/// Where a device backend's memory lives and how its kernels run.
pub(crate) enum Gpu {
    /// Host allocations; kernels run by the SIMT emulator.
    Emu,
    Hip(HipGpu),
}

/// A GPU opened for one cache: its stream and the code objects of the cache's head_dim.
pub(crate) struct HipGpu {
    device: Device,
    stream: Stream,
    attention: Module,
    quantize: Module,
}

/// Zeroed, [`ALIGN`]-aligned host memory standing in for a device allocation: written and
/// read through its address only, as device memory is.
pub(crate) struct HostAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is owned by this value and only reached through its address.
unsafe impl Send for HostAlloc {}
// SAFETY: shared access only hands out the address; writes through it are ordered by the
// cache's own `&mut self` methods and the scratch mutex, as for device memory.
unsafe impl Sync for HostAlloc {}

impl HostAlloc {
    fn new(bytes: usize) -> Result<HostAlloc> {
        let layout =
            Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| Error::OutOfMemory {
                bytes: bytes as u128,
                backend: "emu",
            })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(Error::OutOfMemory {
            bytes: bytes as u128,
            backend: "emu",
        })?;
        Ok(HostAlloc { ptr, layout })
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One device allocation, freed on drop.
pub(crate) enum Alloc {
    Host(HostAlloc),
    Hip(DeviceBuffer<u8>),
}

impl Alloc {
    /// The address kernels see.
    fn addr(&self) -> usize {
        match self {
            Alloc::Host(h) => h.ptr.as_ptr() as usize,
            Alloc::Hip(b) => b.device_ptr() as usize,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Alloc::Host(h) => h.layout.size(),
            Alloc::Hip(b) => b.len(),
        }
    }

    fn check(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.bytes() => Ok(()),
            _ => Err(Error::OutOfRange {
                what: "device allocation byte",
                index: offset.saturating_add(n),
                limit: self.bytes() + 1,
            }),
        }
    }
}

/// The time of the work between two points of a device's queue.
pub(crate) enum Timer {
    Wall(Instant),
    Events(Event, Event),
}

impl Gpu {
    /// Opens `backend` (`Emu` or `Hip`) for a cache of `head_dim`: for `Hip`, the first GPU
    /// whose arch this build has kernels for, its stream and code objects.
    pub(crate) fn open(backend: Backend, head_dim: usize) -> Result<Gpu> {
        match backend {
            Backend::Emu => Ok(Gpu::Emu),
            Backend::Hip => HipGpu::open(head_dim).map(Gpu::Hip),
            Backend::Cpu => unreachable!("the CPU backend keeps its bytes in host memory"),
        }
    }

    /// The backend this memory belongs to.
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Gpu::Emu => Backend::Emu,
            Gpu::Hip(_) => Backend::Hip,
        }
    }

    /// The GPU, for `Hip`.
    pub(crate) fn device(&self) -> Option<&Device> {
        match self {
            Gpu::Emu => None,
            Gpu::Hip(h) => Some(&h.device),
        }
    }

    /// A zeroed allocation of `bytes`.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<Alloc> {
        match self {
            Gpu::Emu => HostAlloc::new(bytes).map(Alloc::Host),
            Gpu::Hip(h) => {
                h.bind()?;
                let mut buf = DeviceBuffer::new(bytes.max(1))?;
                buf.zero(&h.stream)?;
                h.stream.synchronize()?;
                Ok(Alloc::Hip(buf))
            }
        }
    }

    /// Copies `src` to `dst` at byte `offset`, after the work queued so far.
    pub(crate) fn write(&self, dst: &Alloc, offset: usize, src: &[u8]) -> Result<()> {
        dst.check(offset, src.len())?;
        match dst {
            Alloc::Host(h) => {
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
            Alloc::Hip(b) => {
                self.finish()?;
                b.write_at(offset, src)
            }
        }
    }

    /// Copies bytes `offset..offset + dst.len()` of `src` into `dst`, after the work queued so
    /// far (a kernel fault surfaces here).
    pub(crate) fn read(&self, src: &Alloc, offset: usize, dst: &mut [u8]) -> Result<()> {
        src.check(offset, dst.len())?;
        match src {
            Alloc::Host(h) => {
                // SAFETY: the range lies inside the allocation (checked); nothing writes it
                // during the copy (emulated kernels have finished when `launch` returns).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        h.ptr.as_ptr().add(offset),
                        dst.as_mut_ptr(),
                        dst.len(),
                    )
                };
                Ok(())
            }
            Alloc::Hip(b) => {
                self.finish()?;
                b.read_at(offset, dst)
            }
        }
    }

    /// Queues kernel `name` over `grid` workgroups of one wave.
    ///
    /// # Safety
    /// `params` is the kernel's params struct and every address in it lies in a live
    /// allocation of this `Gpu`, large enough for what the kernel reads and writes.
    unsafe fn launch<P: Copy>(&self, name: &str, params: &P, grid: [u32; 3]) -> Result<()> {
        match self {
            Gpu::Emu => emu::launch(name, params, grid),
            Gpu::Hip(h) => {
                h.bind()?;
                let module = if name.starts_with("hipkv_append") {
                    &h.quantize
                } else {
                    &h.attention
                };
                let function = module.function(name)?;
                // SAFETY: the caller's contract; the allocations outlive the queued work
                // because every cache call finishes its work before returning.
                unsafe { module.launch(function, grid, [HIPKV_THREADS, 1, 1], params, &h.stream) }
            }
        }
    }

    /// Waits for the queued work; a fault in it is the error.
    pub(crate) fn finish(&self) -> Result<()> {
        match self {
            Gpu::Emu => Ok(()),
            Gpu::Hip(h) => h.stream.synchronize(),
        }
    }

    fn start_timer(&self) -> Result<Timer> {
        match self {
            Gpu::Emu => Ok(Timer::Wall(Instant::now())),
            Gpu::Hip(h) => {
                let (start, stop) = (Event::new()?, Event::new()?);
                start.record(&h.stream)?;
                Ok(Timer::Events(start, stop))
            }
        }
    }

    /// Seconds since `timer` started, on the device's clock for `Hip`.
    fn stop_timer(&self, timer: Timer) -> Result<f64> {
        match (self, timer) {
            (Gpu::Hip(h), Timer::Events(start, stop)) => {
                stop.record(&h.stream)?;
                Ok(f64::from(stop.elapsed_ms_since(&start)?) / 1e3)
            }
            (_, Timer::Wall(start)) => Ok(start.elapsed().as_secs_f64()),
            (Gpu::Emu, Timer::Events(..)) => unreachable!("the emulator has no events"),
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
            quantize: load("quantize")?,
            stream: Stream::new()?,
            device,
        })
    }
}

/// One layer's device allocations.
struct DeviceLayer {
    pool: Alloc,
    /// `sequences × pages_per_seq` u32 page ids.
    block_tables: Alloc,
    /// Per stream: `sequences ×` one sequence's f16 sink rows.
    sinks: [Alloc; 2],
    /// Per stream: `sequences ×` one sequence's f16 residual window (1 byte when unused).
    residual: [Alloc; 2],
    /// Per stream: outlier thresholds `lo` then `hi`, `kv_heads × head_dim` f32 each.
    thresholds: [Option<Alloc>; 2],
}

/// Sizes of the per-sequence regions, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqBytes {
    pub(crate) pages: usize,
    pub(crate) sinks: usize,
    pub(crate) residual: [usize; 2],
}

/// The bytes of a cache's layers on a device backend.
pub(crate) struct DeviceStore {
    gpu: Gpu,
    config: CacheConfig,
    layout: HeadLayout,
    page_bytes: usize,
    seq_bytes: SeqBytes,
    layers: Vec<DeviceLayer>,
    /// The RoPE cos/sin table (`pre_rope` keys are rotated by the attention kernels).
    rope: Option<Alloc>,
    /// The append kernels' count of outliers dropped for lack of slots (one u64).
    dropped: Alloc,
    /// Per-call inputs and outputs, grown on demand.
    scratch: Mutex<Option<Alloc>>,
}

impl std::fmt::Debug for DeviceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStore")
            .field("backend", &self.gpu.backend())
            .field("device", &self.gpu.device().map(|d| &d.name))
            .field("bytes", &self.allocated_bytes())
            .finish()
    }
}

/// Packs arrays into one upload: each at an [`ALIGN`]ed offset of a host staging buffer.
#[derive(Default)]
struct Staging {
    bytes: Vec<u8>,
}

impl Staging {
    /// Appends `values` and returns their offset.
    fn put<T: DeviceCopy>(&mut self, values: &[T]) -> usize {
        let at = self.bytes.len().next_multiple_of(ALIGN);
        self.bytes.resize(at, 0);
        self.bytes.extend_from_slice(as_bytes(values));
        at
    }

    /// Reserves `bytes` the kernels write (not uploaded) after the staged arrays.
    fn reserve(&self, used: &mut usize, bytes: usize) -> usize {
        let at = (*used).max(self.bytes.len()).next_multiple_of(ALIGN);
        *used = at + bytes;
        at
    }
}

impl DeviceStore {
    /// Allocates a zeroed store for every layer of `config` on `gpu`.
    pub(crate) fn new(
        gpu: Gpu,
        config: CacheConfig,
        layout: HeadLayout,
        page_bytes: usize,
        seq_bytes: SeqBytes,
        rope: Option<&RopeTable>,
    ) -> Result<DeviceStore> {
        let total_pages = seq_bytes.pages * config.sequences;
        let n = config.sequences;
        let layers = (0..config.layers)
            .map(|_| {
                Ok(DeviceLayer {
                    pool: gpu.alloc(total_pages * page_bytes)?,
                    block_tables: gpu.alloc(total_pages * 4)?,
                    sinks: [
                        gpu.alloc(n * seq_bytes.sinks)?,
                        gpu.alloc(n * seq_bytes.sinks)?,
                    ],
                    residual: [
                        gpu.alloc(n * seq_bytes.residual[0])?,
                        gpu.alloc(n * seq_bytes.residual[1])?,
                    ],
                    thresholds: [None, None],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = match rope {
            Some(table) => {
                let flat = table.flat();
                let alloc = gpu.alloc(size_of_val(flat.as_slice()))?;
                gpu.write(&alloc, 0, as_bytes(&flat))?;
                Some(alloc)
            }
            None => None,
        };
        Ok(DeviceStore {
            dropped: gpu.alloc(8)?,
            gpu,
            config,
            layout,
            page_bytes,
            seq_bytes,
            layers,
            rope,
            scratch: Mutex::new(None),
        })
    }

    pub(crate) fn backend(&self) -> Backend {
        self.gpu.backend()
    }

    pub(crate) fn device(&self) -> Option<&Device> {
        self.gpu.device()
    }

    /// Bytes of K and V storage (pages, sinks, residual windows), as the CPU cache counts them.
    pub(crate) fn allocated_bytes(&self) -> usize {
        let n = self.config.sequences;
        let per_seq = 2 * self.seq_bytes.sinks + self.seq_bytes.residual.iter().sum::<usize>();
        self.layers.len() * (self.seq_bytes.pages * n * self.page_bytes + n * per_seq)
    }

    /// Copies a host layer (pool, and each sequence's sinks, residual windows and block table)
    /// to the device.
    pub(crate) fn upload_layer(&self, layer: usize, pool: &[u8], seqs: &[SeqState]) -> Result<()> {
        let l = &self.layers[layer];
        self.gpu.write(&l.pool, 0, pool)?;
        for (s, seq) in seqs.iter().enumerate() {
            for i in 0..2 {
                self.gpu
                    .write(&l.sinks[i], s * self.seq_bytes.sinks, &seq.sinks[i])?;
                self.gpu.write(
                    &l.residual[i],
                    s * self.seq_bytes.residual[i],
                    &seq.residual[i],
                )?;
            }
            self.write_block_table(layer, s, &seq.pages, 0)?;
        }
        Ok(())
    }

    /// Copies a layer back into host buffers shaped as the CPU cache's.
    pub(crate) fn download_layer(
        &self,
        layer: usize,
        pool: &mut [u8],
        seqs: &mut [SeqState],
    ) -> Result<()> {
        let l = &self.layers[layer];
        self.gpu.read(&l.pool, 0, pool)?;
        for (s, seq) in seqs.iter_mut().enumerate() {
            for i in 0..2 {
                self.gpu
                    .read(&l.sinks[i], s * self.seq_bytes.sinks, &mut seq.sinks[i])?;
                self.gpu.read(
                    &l.residual[i],
                    s * self.seq_bytes.residual[i],
                    &mut seq.residual[i],
                )?;
            }
        }
        Ok(())
    }

    /// Writes `pages[from..]` into the block table of `seq`.
    fn write_block_table(
        &self,
        layer: usize,
        seq: usize,
        pages: &[u32],
        from: usize,
    ) -> Result<()> {
        let at = (seq * self.seq_bytes.pages + from) * 4;
        self.gpu.write(
            &self.layers[layer].block_tables,
            at,
            as_bytes(&pages[from..]),
        )
    }

    /// Stores a layer's outlier thresholds of one stream.
    pub(crate) fn set_thresholds(
        &mut self,
        layer: usize,
        stream: usize,
        thresholds: &OutlierThresholds,
    ) -> Result<()> {
        let n = thresholds.lo.len() * 4;
        let alloc = self.gpu.alloc(2 * n)?;
        self.gpu.write(&alloc, 0, as_bytes(&thresholds.lo))?;
        self.gpu.write(&alloc, n, as_bytes(&thresholds.hi))?;
        self.layers[layer].thresholds[stream] = Some(alloc);
        Ok(())
    }

    /// The scratch buffer, at least `bytes` long.
    fn scratch(&self, bytes: usize) -> Result<MutexGuard<'_, Option<Alloc>>> {
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|a| a.bytes() < bytes) {
            let grown = bytes.max(guard.as_ref().map_or(0, |a| 2 * a.bytes()));
            *guard = None;
            *guard = Some(self.gpu.alloc(grown)?);
        }
        Ok(guard)
    }

    /// Appends `k` and `v` (`n × kv_heads × head_dim` f16 bits, in their stored form) to `seq`
    /// after its `state.len` tokens with the append kernels. `state` already holds the pages
    /// the new tokens need, those from `new_pages` on just taken from the pool. Returns the
    /// outliers dropped.
    pub(crate) fn append(
        &self,
        layer: usize,
        seq: usize,
        state: &SeqState,
        new_pages: usize,
        k: &[u16],
        v: &[u16],
    ) -> Result<u64> {
        let cfg = &self.config;
        let first_pos = state.len;
        let d = cfg.head_dim;
        let l = &self.layers[layer];
        self.write_block_table(layer, seq, &state.pages, new_pages)?;
        self.gpu.write(&self.dropped, 0, &0u64.to_le_bytes())?;
        let mut staging = Staging::default();
        let x_at = [staging.put(k), staging.put(v)];
        let scratch = self.scratch(staging.bytes.len())?;
        let scratch = scratch.as_ref().expect("scratch allocated");
        self.gpu.write(scratch, 0, &staging.bytes)?;

        let tokens = k.len() / (cfg.kv_heads * d);
        let grid = [tokens as u32, cfg.kv_heads as u32, 1];
        let block_table = l.block_tables.addr() + seq * self.seq_bytes.pages * 4;
        for (i, stream) in [KvStream::K, KvStream::V].into_iter().enumerate() {
            let layout = self.layout.stream(stream);
            let thresholds = l.thresholds[i].as_ref().map(Alloc::addr);
            let lo_bytes = cfg.kv_heads * d * 4;
            let params = hipkv_append_params {
                pool: l.pool.addr() as *mut u8,
                page_bytes: self.page_bytes as u64,
                head_block_bytes: self.layout.bytes as u32,
                kv_heads: cfg.kv_heads as u32,
                head_dim: d as u32,
                group_tokens: cfg.scheme.group_tokens as u32,
                sinks: cfg.scheme.sinks as u32,
                first_pos: first_pos as u32,
                tokens: tokens as u32,
                layout: stream_abi(layout, d),
                block_table: block_table as *const u32,
                x: (scratch.addr() + x_at[i]) as *const u16,
                sink_buf: (l.sinks[i].addr() + seq * self.seq_bytes.sinks) as *mut u16,
                residual: (l.residual[i].addr() + seq * self.seq_bytes.residual[i]) as *mut u16,
                outlier_lo: thresholds.map_or(std::ptr::null(), |a| a as *const f32),
                outlier_hi: thresholds.map_or(std::ptr::null(), |a| (a + lo_bytes) as *const f32),
                outliers_dropped: self.dropped.addr() as *mut u64,
            };
            // SAFETY: every address lies in this store's allocations, sized for the layer's
            // pages, the sequence's regions and the staged tokens; thresholds exist for every
            // stream with an outlier store (the cache checks calibration first).
            unsafe {
                self.gpu
                    .launch(&append_kernel_name(layout.format, d), &params, grid)?
            };
            if layout.format.is_grouped_by_tokens() {
                // SAFETY: as above.
                unsafe { self.gpu.launch("hipkv_append_residual", &params, grid)? };
            }
        }
        let mut dropped = [0u8; 8];
        self.gpu.read(&self.dropped, 0, &mut dropped)?;
        Ok(u64::from_le_bytes(dropped))
    }

    /// Decode attention (one new token per query) over `seqs`; writes each query's output.
    /// With `timed`, returns the seconds the attention and combine kernels took (device events
    /// on a GPU, the wall clock of the launches on the emulator).
    pub(crate) fn attend(
        &self,
        layer: usize,
        rope: Option<&RopeTable>,
        seqs: &[(usize, &SeqState)],
        queries: &mut [Query<'_>],
        scale: f32,
        timed: bool,
    ) -> Result<Option<f64>> {
        let cfg = &self.config;
        let scheme = &cfg.scheme;
        let (d, gqa) = (cfg.head_dim, cfg.gqa());
        let width = cfg.q_heads * d;
        if queries.iter().any(|q| q.q.len() != width) {
            return Err(Error::Unsupported(format!(
                "the {:?} backend attends one decode token per query",
                self.backend()
            )));
        }
        if gqa > HIPKV_MAX_GQA as usize {
            return Err(Error::Unsupported(format!(
                "GQA {gqa} on the {:?} backend (at most {HIPKV_MAX_GQA})",
                self.backend()
            )));
        }
        let view = CacheView {
            config: cfg,
            layout: &self.layout,
            page_bytes: self.page_bytes,
            pool: &[],
            rope,
        };
        let states: Vec<&SeqState> = seqs.iter().map(|(_, s)| *s).collect();
        let prepared = prepare_queries(&view, &states, queries, scale);
        let q: Vec<f32> = prepared
            .iter()
            .flatten()
            .flat_map(|h| h.rows.iter().copied())
            .collect();
        // Σ q over each key parameter group (for per-token key minimums), laid out
        // [query][KV head][group][row].
        let k_group = stream_abi(&self.layout.k, d).group as usize;
        let groups = d / k_group;
        let q_group_sums: Vec<f32> = q
            .chunks_exact(gqa * d)
            .flat_map(|head| {
                (0..groups).flat_map(move |g| {
                    (0..gqa)
                        .map(move |r| head[r * d + g * k_group..][..k_group].iter().sum::<f32>())
                })
            })
            .collect();

        let max_pages = states.iter().map(|s| view.pages(s.len)).max().unwrap_or(0);
        let row_groups = (gqa as u32).div_ceil(hipkv_rows(d as u32));
        let workgroups = queries.len() * cfg.kv_heads * row_groups as usize;
        let compute_units = self
            .device()
            .map_or(GFX1201_COMPUTE_UNITS, |dev| dev.compute_units);
        let plan = SplitPlan::new(max_pages, workgroups, compute_units);
        let splits = plan.splits;

        let l = &self.layers[layer];
        let per_seq = |base: &Alloc, bytes: usize| -> Vec<u64> {
            seqs.iter()
                .map(|&(s, _)| (base.addr() + s * bytes) as u64)
                .collect()
        };
        let mut staging = Staging::default();
        let at_q = staging.put(&q);
        let at_sums = staging.put(&q_group_sums);
        let seq_len: Vec<u32> = states.iter().map(|s| s.len as u32).collect();
        let at_len = staging.put(&seq_len);
        let at_tables = staging.put(&per_seq(&l.block_tables, self.seq_bytes.pages * 4));
        let at_sinks_k = staging.put(&per_seq(&l.sinks[0], self.seq_bytes.sinks));
        let at_sinks_v = staging.put(&per_seq(&l.sinks[1], self.seq_bytes.sinks));
        let at_res_k = staging.put(&per_seq(&l.residual[0], self.seq_bytes.residual[0]));
        let at_res_v = staging.put(&per_seq(&l.residual[1], self.seq_bytes.residual[1]));
        let rows = queries.len() * cfg.kv_heads * gqa;
        let mut used = 0;
        let at_acc = staging.reserve(&mut used, rows * splits * d * 4);
        let at_max = staging.reserve(&mut used, rows * splits * 4);
        let at_sum = staging.reserve(&mut used, rows * splits * 4);
        let at_out = staging.reserve(&mut used, rows * d * 4);
        let scratch = self.scratch(used)?;
        let scratch = scratch.as_ref().expect("scratch allocated");
        self.gpu.write(scratch, 0, &staging.bytes)?;
        let base = scratch.addr();

        let params = hipkv_attn_params {
            pool: l.pool.addr() as *const u8,
            page_bytes: self.page_bytes as u64,
            head_block_bytes: self.layout.bytes as u32,
            kv_heads: cfg.kv_heads as u32,
            gqa: gqa as u32,
            head_dim: d as u32,
            group_tokens: scheme.group_tokens as u32,
            sinks: scheme.sinks as u32,
            splits: splits as u32,
            pages_per_split: plan.pages_per_split as u32,
            pre_rope: u32::from(scheme.pre_rope),
            rope_pairs_interleaved: u32::from(
                rope.is_none_or(|r| r.layout() == RopeLayout::Interleaved),
            ),
            k: stream_abi(&self.layout.k, d),
            v: stream_abi(&self.layout.v, d),
            seq_len: (base + at_len) as *const u32,
            block_table: (base + at_tables) as *const *const u32,
            sinks_k: (base + at_sinks_k) as *const *const u16,
            sinks_v: (base + at_sinks_v) as *const *const u16,
            residual_k: (base + at_res_k) as *const *const u16,
            residual_v: (base + at_res_v) as *const *const u16,
            q: (base + at_q) as *const f32,
            q_group_sums: (base + at_sums) as *const f32,
            rope_cos_sin: self
                .rope
                .as_ref()
                .map_or(std::ptr::null(), |r| r.addr() as *const f32),
            partial_acc: (base + at_acc) as *mut f32,
            partial_max: (base + at_max) as *mut f32,
            partial_sum: (base + at_sum) as *mut f32,
        };
        let combine = hipkv_combine_params {
            partial_acc: params.partial_acc,
            partial_max: params.partial_max,
            partial_sum: params.partial_sum,
            out: (base + at_out) as *mut f32,
            rows: rows as u32,
            gqa: gqa as u32,
            splits: splits as u32,
            head_dim: d as u32,
        };
        let name = attention_kernel_name(scheme.k, scheme.v, d);
        let grid = [
            splits as u32,
            cfg.kv_heads as u32 * row_groups,
            queries.len() as u32,
        ];
        let timer = if timed {
            Some(self.gpu.start_timer()?)
        } else {
            None
        };
        // SAFETY: the addresses lie in this store's allocations: the layer's pages, block
        // tables, sinks and residual windows, the RoPE table, and the scratch buffer holding
        // the staged inputs and room for `splits` partials per row and the output.
        unsafe {
            self.gpu.launch(&name, &params, grid)?;
            self.gpu
                .launch("hipkv_attn_combine", &combine, [rows as u32, 1, 1])?;
        }
        let seconds = timer.map(|t| self.gpu.stop_timer(t)).transpose()?;
        let mut out = vec![0u8; rows * d * 4];
        self.gpu.read(scratch, at_out, &mut out)?;
        for (query, o) in queries.iter_mut().zip(out.chunks_exact(width * 4)) {
            for (x, b) in query.out.iter_mut().zip(o.chunks_exact(4)) {
                *x = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
        }
        Ok(seconds)
    }
}

/// The bytes of a slice of plain numbers.
fn as_bytes<T: DeviceCopy>(values: &[T]) -> &[u8] {
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

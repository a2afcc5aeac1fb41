//! hipkv inside a server: a paged KV cache whose blocks the server allocates, assigns and
//! frees, driven by calls that take device addresses and the server's stream and only queue
//! work on it — no allocation, no copy, no synchronization — so that a whole decode step can be
//! captured in a HIP graph.
//!
//! The shape follows what servers already pass their attention libraries (vLLM's
//! `reshape_and_cache` and `paged_attention`, FlashAttention's varlen calls):
//! - [`Layout`]: the scheme and the model's heads, from which hipkv reports the bytes of one
//!   block (`block_tokens` tokens of every KV head of one layer, quantized, with parameters and
//!   outlier stores), of one sequence slot's state and of the workspace of a batch;
//! - [`PagedCache::write_kv`]: a batch's new keys and values (f16, bf16 or f32), one cache slot
//!   (`block × block_tokens + offset`), sequence slot and position per token, quantized on the
//!   device;
//! - [`PagedCache::attend`]: the queries of a varlen batch of decode tokens and prefill chunks
//!   (`query_start_loc`, `seq_lens`, block tables, sequence slots), output in the query's dtype;
//! - [`PagedCache::copy_blocks`] for copy-on-write and [`PagedCache::fork`] for the state of a
//!   forked sequence;
//! - [`PagedCache::check`]: every index a server passes is checked inside the kernels; a bad one
//!   skips its token or sequence, writes nothing outside it, and is reported here as a typed
//!   error naming the kernel, the item and the index.
//!
//! Position `p` of a sequence lives in block `block_table[p / block_tokens]` at row
//! `p % block_tokens`. The per-sequence state a scheme needs outside blocks lives in a pool that
//! hipkv owns, indexed by a sequence slot the server chooses: the f16 rows of the first `sinks`
//! positions (never read from blocks) and, for per-channel formats, the f16 rows of the
//! sequence's open (last, not full) block, which is quantized when its last position is written.
//! `docs/serving.md` has the contract.

mod layout;
mod plan;

use crate::abi::{
    HIPKV_DTYPE_BF16, HIPKV_DTYPE_F16, HIPKV_DTYPE_F32, HIPKV_INT_QUERY_PER_BLOCK,
    hipkv_attn_params, hipkv_copy_params, hipkv_device_error, hipkv_write_params,
};
use crate::backend::{Backend, Engine, GFX1201_COMPUTE_UNITS, cpu, device, open_engine};
use crate::calibration::Calibration;
use crate::error::{Error, Result};
use crate::hip::{Device, StreamHandle};
use crate::quant::{Codebook, MAX_LEVELS, OutlierThresholds};
use crate::rope::RopeTable;
use crate::scheme::{Stream, StreamSet};

pub use crate::backend::DeviceMemory;
pub use layout::{BatchLimits, Layout, LayoutSpec};
pub use plan::AttendPlan;

use device::as_bytes;

/// Element type of keys, values, queries and outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    BF16,
    F32,
}

impl DType {
    pub fn bytes(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
        }
    }

    pub(crate) fn abi(self) -> u32 {
        match self {
            DType::F16 => HIPKV_DTYPE_F16,
            DType::BF16 => HIPKV_DTYPE_BF16,
            DType::F32 => HIPKV_DTYPE_F32,
        }
    }
}

/// A batch's new tokens for [`PagedCache::write_kv`]: addresses in the backend's memory.
#[derive(Clone, Copy, Debug)]
pub struct KvBatch {
    pub tokens: usize,
    pub dtype: DType,
    /// `tokens × kv_heads × head_dim` of `dtype` each (keys rotated by RoPE, unless the scheme
    /// stores them before RoPE).
    pub k: u64,
    pub v: u64,
    /// `tokens` i64: the cache slot of each token, `block × block_tokens + position %
    /// block_tokens`.
    pub slot_mapping: u64,
    /// `tokens` i32: the sequence slot of each token.
    pub seq_slots: u64,
    /// `tokens` i32: the position of each token in its sequence. A sequence's tokens are listed
    /// in order, consecutively.
    pub positions: u64,
}

/// A varlen batch of queries for [`PagedCache::attend`]: host-side counts and bounds, and
/// addresses in the backend's memory.
#[derive(Clone, Copy, Debug)]
pub struct QueryBatch {
    pub num_seqs: usize,
    /// Query tokens in all: `query_start_loc[num_seqs]`.
    pub tokens: usize,
    /// Bounds the device values keep to (checked there): the longest query chunk and the
    /// longest sequence of the batch; they size the launch.
    pub max_q_len: usize,
    pub max_seq_len: usize,
    /// Width of `block_tables`.
    pub max_blocks_per_seq: usize,
    pub dtype: DType,
    pub softmax_scale: f32,
    /// Sliding window (Gemma's and Mistral's local layers): each query token attends to its own
    /// position and the `window − 1` before it, and the blocks wholly below are not read (their
    /// ids are not even checked, so a server may have freed them). `None`: every position.
    pub window: Option<usize>,
    /// `tokens × q_heads × head_dim` of `dtype`, rotated by RoPE.
    pub q: u64,
    /// Same shape and dtype as `q`.
    pub out: u64,
    /// `num_seqs + 1` i32: sequence s has query tokens `query_start_loc[s]..query_start_loc[s+1]`,
    /// the last of its `seq_lens[s]` tokens (already written), each attending causally.
    pub query_start_loc: u64,
    /// `num_seqs` i32.
    pub seq_lens: u64,
    /// `num_seqs × max_blocks_per_seq` i32 block ids.
    pub block_tables: u64,
    /// `num_seqs` i32.
    pub seq_slots: u64,
}

/// The workspace of one [`PagedCache::attend`] call: `layout.workspace_bytes(limits)` of the
/// backend's memory at `addr`, for calls of up to `limits.max_tokens` query tokens.
#[derive(Clone, Copy, Debug)]
pub struct Workspace {
    pub addr: u64,
    pub limits: BatchLimits,
}

/// Outlier thresholds of one layer: keys, and values when the scheme stores value outliers.
struct Thresholds {
    k: DeviceMemory,
    v: Option<DeviceMemory>,
}

/// The codebooks of one layer: in the backend's memory (the key levels at float 0, the value
/// levels at float `MAX_LEVELS`, `2^bits` each) and on the host.
struct LayerCodebooks {
    mem: DeviceMemory,
    books: [Option<Codebook>; 2],
}

/// A paged KV cache on one backend: the layout, the state pool of every sequence slot and layer,
/// the sticky error word, and the per-layer outlier thresholds and codebooks. The blocks
/// themselves are the server's: each call takes the address of one layer's
/// `layout.cache_bytes()`.
pub struct PagedCache {
    layout: Layout,
    layers: usize,
    engine: Box<dyn Engine>,
    /// `max_seqs` slots × `layers` × `layout.state_bytes()`.
    state: DeviceMemory,
    /// One `hipkv_device_error`.
    error: DeviceMemory,
    /// The outliers dropped for lack of slots (one u64).
    dropped: DeviceMemory,
    thresholds: Vec<Option<Thresholds>>,
    /// Per layer, the codebooks of `nuq` schemes.
    codebooks: Vec<Option<LayerCodebooks>>,
    /// The RoPE cos/sin table `pre_rope` keys are rotated with.
    rope: Option<DeviceMemory>,
    /// The same table on the host, for the CPU backend.
    rope_table: Option<RopeTable>,
}

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache")
            .field("backend", &self.engine.backend())
            .field("layers", &self.layers)
            .field("scheme", &self.layout.scheme().to_string())
            .finish()
    }
}

impl PagedCache {
    /// A cache of `layers` layers on `backend`. Allocates (and zeroes) the state pool.
    pub fn new(layout: Layout, layers: usize, backend: Backend) -> Result<PagedCache> {
        if layers == 0 {
            return Err(Error::Unsupported("layers must be positive".into()));
        }
        let spec = layout.spec();
        let engine = open_engine(backend, spec.head_dim)?;
        let state_bytes = (spec.max_seqs as u128)
            .checked_mul(layers as u128 * layout.state_bytes() as u128)
            .filter(|&b| b <= isize::MAX as u128)
            .ok_or(Error::OutOfMemory {
                bytes: u128::MAX,
                backend: "any",
            })?;
        let state = engine.alloc(state_bytes as usize)?;
        let error = engine.alloc(size_of::<hipkv_device_error>())?;
        let dropped = engine.alloc(8)?;
        let rope_table = spec
            .rope
            .filter(|_| spec.scheme.pre_rope)
            .map(|r| RopeTable::new(r, spec.head_dim, spec.max_positions));
        let rope = match &rope_table {
            Some(table) => {
                let flat = table.flat();
                let mem = engine.alloc(size_of_val(flat.as_slice()))?;
                engine.upload(&mem, 0, as_bytes(&flat), StreamHandle::DEFAULT)?;
                Some(mem)
            }
            None => None,
        };
        Ok(PagedCache {
            layout,
            layers,
            engine,
            state,
            error,
            dropped,
            thresholds: (0..layers).map(|_| None).collect(),
            codebooks: (0..layers).map(|_| None).collect(),
            rope,
            rope_table,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    pub fn backend(&self) -> Backend {
        self.engine.backend()
    }

    /// The GPU, on `Backend::Hip`.
    pub fn device(&self) -> Option<&Device> {
        self.engine.device()
    }

    /// Bytes of the state pool hipkv holds: every slot of every layer.
    pub fn state_pool_bytes(&self) -> usize {
        self.layout.spec().max_seqs * self.layers * self.layout.state_bytes()
    }

    /// Allocates `bytes` of this backend's memory, zeroed (setup time: it synchronizes).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        self.engine.alloc(bytes)
    }

    /// Copies host bytes into this backend's memory after the work queued on `stream`
    /// (synchronously: for setup and for an owner that stages host data, not for a step).
    pub fn upload(
        &self,
        dst: &DeviceMemory,
        offset: usize,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<()> {
        self.engine.upload(dst, offset, src, stream)
    }

    /// Copies this backend's memory into host bytes after the work queued on `stream`.
    pub fn download(
        &self,
        src: &DeviceMemory,
        offset: usize,
        dst: &mut [u8],
        stream: StreamHandle,
    ) -> Result<()> {
        self.engine.download(src, offset, dst, stream)
    }

    /// Sets a layer's outlier thresholds (`v` exactly when the scheme stores value outliers).
    /// Setup time: it allocates and copies.
    pub fn set_outlier_thresholds(
        &mut self,
        layer: usize,
        k: &OutlierThresholds,
        v: Option<&OutlierThresholds>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let spec = self.layout.spec();
        let (h, d) = (spec.kv_heads, spec.head_dim);
        let Some(o) = spec.scheme.outliers else {
            return Err(Error::Unsupported(format!(
                "scheme {} has no outlier store",
                spec.scheme
            )));
        };
        if o.values != v.is_some() {
            return Err(Error::Unsupported(format!(
                "scheme {} {} value thresholds",
                spec.scheme,
                if o.values { "needs" } else { "takes no" }
            )));
        }
        for t in std::iter::once(k).chain(v) {
            t.validate(h, d)?;
        }
        let set = self.upload_thresholds(k, v)?;
        self.thresholds[layer] = Some(set);
        Ok(())
    }

    /// Device copies of checked thresholds.
    fn upload_thresholds(
        &self,
        k: &OutlierThresholds,
        v: Option<&OutlierThresholds>,
    ) -> Result<Thresholds> {
        let upload = |t: &OutlierThresholds| -> Result<DeviceMemory> {
            let n = t.lo.len() * 4;
            let mem = self.engine.alloc(2 * n)?;
            self.engine
                .upload(&mem, 0, as_bytes(&t.lo), StreamHandle::DEFAULT)?;
            self.engine
                .upload(&mem, n, as_bytes(&t.hi), StreamHandle::DEFAULT)?;
            Ok(mem)
        };
        Ok(Thresholds {
            k: upload(k)?,
            v: v.map(upload).transpose()?,
        })
    }

    /// Whether `layer` has the outlier thresholds its scheme needs.
    pub fn has_thresholds(&self, layer: usize) -> bool {
        self.layout.scheme().outliers.is_none()
            || self.thresholds.get(layer).is_some_and(Option::is_some)
    }

    /// Sets a layer's codebooks: one for each stream the scheme's `nuq` names, of that stream's
    /// code width, `None` for the others. Setup time: it allocates and copies.
    pub fn set_codebooks(
        &mut self,
        layer: usize,
        k: Option<&Codebook>,
        v: Option<&Codebook>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let books = self.upload_codebooks(k, v)?;
        self.codebooks[layer] = Some(books);
        Ok(())
    }

    /// A device copy of a layer's codebooks (K's levels, then V's, `MAX_LEVELS` each), checked
    /// against the scheme.
    fn upload_codebooks(
        &self,
        k: Option<&Codebook>,
        v: Option<&Codebook>,
    ) -> Result<LayerCodebooks> {
        let scheme = self.layout.scheme();
        let mut levels = [0f32; 2 * MAX_LEVELS];
        for (i, (stream, book)) in [(Stream::K, k), (Stream::V, v)].into_iter().enumerate() {
            let wants = scheme.codebook_bits(stream);
            match book {
                Some(b) if Some(b.bits()) == wants => {
                    levels[i * MAX_LEVELS..][..b.levels().len()].copy_from_slice(b.levels());
                }
                None if wants.is_none() => {}
                _ => {
                    return Err(Error::Unsupported(format!(
                        "scheme {scheme} takes {}",
                        wants.map_or(format!("no {stream} codebook"), |b| format!(
                            "a {stream} codebook of {}-bit codes",
                            b.bits()
                        )),
                    )));
                }
            }
        }
        let mem = self.engine.alloc(size_of_val(&levels))?;
        self.engine
            .upload(&mem, 0, as_bytes(&levels), StreamHandle::DEFAULT)?;
        Ok(LayerCodebooks {
            mem,
            books: [k.cloned(), v.cloned()],
        })
    }

    /// Sets every layer's outlier thresholds and codebooks from a calibration made for this
    /// cache's scheme and shape ([`Calibration::check_fits`]); nothing unless all of it fits.
    /// Setup time, as the setters it calls.
    pub fn apply_calibration(&mut self, c: &Calibration) -> Result<()> {
        let spec = *self.layout.spec();
        c.check_fits(spec.scheme, self.layers, spec.kv_heads, spec.head_dim)?;
        // Every layer's device copies first: a failed allocation or upload leaves the cache as
        // it was.
        let staged = c
            .layers
            .iter()
            .map(|layer| {
                let thresholds = layer
                    .outliers
                    .as_ref()
                    .map(|(k, v)| self.upload_thresholds(k, v.as_ref()))
                    .transpose()?;
                let books = layer
                    .codebooks
                    .as_ref()
                    .map(|(k, v)| self.upload_codebooks(k.as_ref(), v.as_ref()))
                    .transpose()?;
                Ok((thresholds, books))
            })
            .collect::<Result<Vec<_>>>()?;
        for (l, (thresholds, books)) in staged.into_iter().enumerate() {
            if thresholds.is_some() {
                self.thresholds[l] = thresholds;
            }
            if books.is_some() {
                self.codebooks[l] = books;
            }
        }
        Ok(())
    }

    /// Whether `layer` has the codebooks its scheme needs.
    pub fn has_codebooks(&self, layer: usize) -> bool {
        self.layout.scheme().nuq == StreamSet::None
            || self.codebooks.get(layer).is_some_and(Option::is_some)
    }

    /// The device address of `layer`'s codebook of `stream` (null: uniform codes).
    fn levels(&self, layer: usize, stream: Stream) -> *const f32 {
        match &self.codebooks[layer] {
            Some(c) if self.layout.scheme().nuq.applies(stream) => {
                let offset = if stream == Stream::K {
                    0
                } else {
                    MAX_LEVELS * 4
                };
                (c.mem.addr() + offset as u64) as *const f32
            }
            _ => std::ptr::null(),
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.layers {
            return Err(Error::OutOfRange {
                what: "layer",
                index: layer,
                limit: self.layers,
            });
        }
        Ok(())
    }

    fn layer_state(&self, layer: usize) -> (u32, u64) {
        let per_layer = self.layout.state_bytes();
        (
            u32::try_from(layer * per_layer).expect("a slot's state fits in 4 GiB"),
            (self.layers * per_layer) as u64,
        )
    }

    /// Stores a batch's new keys and values in layer `layer`'s blocks at `cache` (and the slot
    /// states), quantizing them. Only queues work on `stream`.
    ///
    /// # Safety
    /// `cache` addresses `layout.cache_bytes()` of this backend's memory, and every address in
    /// `batch` the elements its comment states; all stay allocated until the work completes, and
    /// nothing else writes them meanwhile.
    pub unsafe fn write_kv(
        &self,
        layer: usize,
        cache: u64,
        batch: &KvBatch,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_layer(layer)?;
        if !self.has_thresholds(layer) {
            return Err(Error::OutliersNotCalibrated { layer });
        }
        if !self.has_codebooks(layer) {
            return Err(Error::CodebooksNotCalibrated { layer });
        }
        if batch.tokens == 0 {
            return Ok(());
        }
        let tokens = u32::try_from(batch.tokens).map_err(|_| Error::OutOfRange {
            what: "tokens of one write",
            index: batch.tokens,
            limit: u32::MAX as usize,
        })?;
        let (layer_state, slot_state_bytes) = self.layer_state(layer);
        let spec = self.layout.spec();
        for stream_kind in [Stream::K, Stream::V] {
            let thresholds = self.thresholds[layer]
                .as_ref()
                .and_then(|t| match stream_kind {
                    Stream::K => Some(&t.k),
                    Stream::V => t.v.as_ref(),
                });
            let lo = thresholds.map_or(0, DeviceMemory::addr);
            let hi_offset = (spec.kv_heads * spec.head_dim * 4) as u64;
            let params = hipkv_write_params {
                g: self.layout.geometry(),
                stream: stream_kind as u32,
                dtype: batch.dtype.abi(),
                tokens,
                layer_state,
                cache: cache as *mut u8,
                state: self.state.addr() as *mut u8,
                slot_state_bytes,
                x: match stream_kind {
                    Stream::K => batch.k,
                    Stream::V => batch.v,
                } as *const std::ffi::c_void,
                slot_mapping: batch.slot_mapping as *const i64,
                seq_slots: batch.seq_slots as *const i32,
                positions: batch.positions as *const i32,
                outlier_lo: if lo == 0 { 0 } else { lo } as *const f32,
                outlier_hi: if lo == 0 { 0 } else { lo + hi_offset } as *const f32,
                outliers_dropped: self.dropped.addr() as *mut u64,
                levels: self.levels(layer, stream_kind),
                error: self.error.addr() as *mut hipkv_device_error,
            };
            // SAFETY: the caller's contract; the state pool, error word, counter and
            // thresholds are this cache's, sized by its layout.
            unsafe { self.engine.write_kv(&params, &self.layout, stream)? };
        }
        Ok(())
    }

    /// Attends a varlen batch of queries over layer `layer`'s blocks at `cache`, writing `out`.
    /// Only queues work on `stream`.
    ///
    /// # Safety
    /// `cache` addresses `layout.cache_bytes()` and `workspace.addr`
    /// `layout.workspace_bytes(workspace.limits)` of this backend's memory, and every address in
    /// `batch` the elements its comment states; all stay allocated until the work completes, and
    /// nothing else writes them meanwhile.
    pub unsafe fn attend(
        &self,
        layer: usize,
        cache: u64,
        batch: &QueryBatch,
        workspace: &Workspace,
        stream: StreamHandle,
    ) -> Result<()> {
        self.plan_attend(layer, batch, workspace.limits)
            .and_then(|(plan, params)| {
                // SAFETY: the caller's contract.
                unsafe { self.run_attend(&plan, &params, cache, workspace, stream) }
            })
    }

    /// [`attend`](Self::attend), timed: the seconds from before its first kernel to after its
    /// last (device events on a GPU, the wall clock elsewhere). Waits for the work.
    ///
    /// # Safety
    /// As [`attend`](Self::attend).
    pub unsafe fn attend_timed(
        &self,
        layer: usize,
        cache: u64,
        batch: &QueryBatch,
        workspace: &Workspace,
        stream: StreamHandle,
    ) -> Result<f64> {
        let (plan, params) = self.plan_attend(layer, batch, workspace.limits)?;
        let timer = self.engine.start_timer(stream)?;
        // SAFETY: the caller's contract.
        unsafe { self.run_attend(&plan, &params, cache, workspace, stream)? };
        self.engine.stop_timer(timer, stream)
    }

    /// The launch plan and the kernels' params (without the caller's addresses of cache and
    /// workspace) of an attention call, after checking what the host knows of it.
    fn plan_attend(
        &self,
        layer: usize,
        batch: &QueryBatch,
        limits: BatchLimits,
    ) -> Result<(AttendPlan, hipkv_attn_params)> {
        self.check_layer(layer)?;
        if !self.has_codebooks(layer) {
            return Err(Error::CodebooksNotCalibrated { layer });
        }
        let spec = self.layout.spec();
        let bt = self.layout.block_tokens();
        let widest = spec.max_positions.div_ceil(bt);
        let checks = [
            (
                "query tokens of one attend (the workspace's max_tokens)",
                batch.tokens,
                limits.max_tokens + 1,
            ),
            (
                "sequences of one attend (max_seqs)",
                batch.num_seqs,
                spec.max_seqs + 1,
            ),
            (
                "max_q_len (above the batch's tokens)",
                batch.max_q_len,
                batch.tokens + 1,
            ),
            (
                "max_seq_len (max_positions)",
                batch.max_seq_len,
                spec.max_positions + 1,
            ),
            (
                "block table width (max_positions / block_tokens)",
                batch.max_blocks_per_seq,
                widest + 1,
            ),
        ];
        if let Some(&(what, index, limit)) = checks.iter().find(|(_, i, l)| i >= l) {
            return Err(Error::OutOfRange { what, index, limit });
        }
        if batch.max_q_len > batch.max_seq_len {
            return Err(Error::OutOfRange {
                what: "max_q_len (above max_seq_len)",
                index: batch.max_q_len,
                limit: batch.max_seq_len + 1,
            });
        }
        if !batch.softmax_scale.is_finite() {
            return Err(Error::BadSoftmaxScale(batch.softmax_scale));
        }
        if batch.window == Some(0) {
            return Err(Error::EmptyWindow);
        }
        // A window that reaches every position the layout holds is no window.
        let window = batch.window.filter(|&w| w < spec.max_positions);
        let compute_units = self
            .device()
            .map_or(GFX1201_COMPUTE_UNITS, |d| d.compute_units);
        let plan = AttendPlan::new(
            &self.layout,
            limits,
            batch.num_seqs,
            batch.tokens,
            batch.max_q_len,
            batch.max_seq_len,
            window,
            compute_units,
        );
        let (layer_state, slot_state_bytes) = self.layer_state(layer);
        let u = |x: usize| x as u32;
        let params = hipkv_attn_params {
            g: self.layout.geometry(),
            dtype: batch.dtype.abi(),
            num_seqs: u(batch.num_seqs),
            tokens: u(batch.tokens),
            max_q_len: u(batch.max_q_len),
            max_seq_len: u(batch.max_seq_len),
            max_blocks_per_seq: u(batch.max_blocks_per_seq),
            tiles_per_seq: u(plan.tiles_per_seq),
            splits: u(plan.splits),
            blocks_per_split: u(plan.blocks_per_split),
            layer_state,
            slot_state_bytes,
            softmax_scale: batch.softmax_scale,
            window: window.map_or(0, u),
            int_query: match (spec.scheme.int_query, spec.scheme.rounds_query_per_step()) {
                (false, _) => 0,
                (true, true) => u(spec.scheme.k.nominal_bits()),
                (true, false) => u(spec.scheme.k.nominal_bits()) | HIPKV_INT_QUERY_PER_BLOCK,
            },
            cache: std::ptr::null(),
            state: self.state.addr() as *const u8,
            q: batch.q as *const std::ffi::c_void,
            out: batch.out as *mut std::ffi::c_void,
            query_start_loc: batch.query_start_loc as *const i32,
            seq_lens: batch.seq_lens as *const i32,
            block_tables: batch.block_tables as *const i32,
            seq_slots: batch.seq_slots as *const i32,
            rope_cos_sin: self
                .rope
                .as_ref()
                .map_or(std::ptr::null(), |r| r.addr() as *const f32),
            q_f32: std::ptr::null_mut(),
            q_group_sums: std::ptr::null_mut(),
            partial_acc: std::ptr::null_mut(),
            partial_max: std::ptr::null_mut(),
            partial_sum: std::ptr::null_mut(),
            q_codes: std::ptr::null_mut(),
            q_scales: std::ptr::null_mut(),
            k_levels: self.levels(layer, Stream::K),
            v_levels: self.levels(layer, Stream::V),
            error: self.error.addr() as *mut hipkv_device_error,
        };
        Ok((plan, params))
    }

    /// # Safety
    /// As [`attend`](Self::attend).
    unsafe fn run_attend(
        &self,
        plan: &AttendPlan,
        params: &hipkv_attn_params,
        cache: u64,
        workspace: &Workspace,
        stream: StreamHandle,
    ) -> Result<()> {
        if params.tokens == 0 {
            return Ok(());
        }
        let w = self.layout.workspace(workspace.limits);
        let at = |offset: usize| (workspace.addr + offset as u64) as *mut f32;
        let p = hipkv_attn_params {
            cache: cache as *const u8,
            q_f32: at(w.q),
            q_group_sums: at(w.q_sums),
            partial_acc: at(w.acc),
            partial_max: at(w.max),
            partial_sum: at(w.sum),
            q_codes: w
                .int_query
                .map_or(std::ptr::null_mut(), |(codes, _)| at(codes) as *mut u32),
            q_scales: w
                .int_query
                .map_or(std::ptr::null_mut(), |(_, scales)| at(scales)),
            ..*params
        };
        // SAFETY: the caller's contract; the workspace parts lie within its
        // `workspace_bytes`, which the plan's splits respect.
        unsafe {
            self.engine
                .attend(&p, plan, &self.layout, self.rope_table.as_ref(), stream)
        }
    }

    /// Copies blocks within layer cache `cache`: `pairs` addresses `n` pairs of i32
    /// `(source, destination)`, for copy-on-write of a shared block. Only queues work.
    ///
    /// # Safety
    /// `cache` addresses `layout.cache_bytes()` and `pairs` `2n` i32 of this backend's memory,
    /// allocated until the work completes. No destination is also a source.
    pub unsafe fn copy_blocks(
        &self,
        cache: u64,
        pairs: u64,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let block_bytes = self.layout.block_bytes();
        let params = hipkv_copy_params {
            cache: cache as *mut u8,
            block_bytes: block_bytes as u64,
            num_blocks: self.layout.spec().num_blocks as u32,
            pairs: u32::try_from(n).map_err(|_| Error::OutOfRange {
                what: "block pairs of one copy",
                index: n,
                limit: u32::MAX as usize,
            })?,
            block_pairs: pairs as *const i32,
            error: self.error.addr() as *mut hipkv_device_error,
        };
        // SAFETY: the caller's contract.
        unsafe { self.engine.copy_blocks(&params, stream) }
    }

    /// Copies the state of sequence slot `src` (every layer's) to slot `dst`, for a sequence
    /// forked from `src`'s. Only queues work on `stream`.
    pub fn fork(&self, src: usize, dst: usize, stream: StreamHandle) -> Result<()> {
        let slots = self.layout.spec().max_seqs;
        for slot in [src, dst] {
            if slot >= slots {
                return Err(Error::OutOfRange {
                    what: "sequence slot",
                    index: slot,
                    limit: slots,
                });
            }
        }
        let bytes = self.layers * self.layout.state_bytes();
        if src == dst || bytes == 0 {
            return Ok(());
        }
        let base = self.state.addr();
        // SAFETY: two different slots of this cache's state pool, each `bytes` long.
        unsafe {
            self.engine.copy(
                base + (dst * bytes) as u64,
                base + (src * bytes) as u64,
                bytes,
                stream,
            )
        }
    }

    /// Waits for the work queued on `stream`, then turns the first out-of-range index any
    /// kernel met since the last check into an error (and clears it).
    pub fn check(&self, stream: StreamHandle) -> Result<()> {
        let mut word = [0u8; size_of::<hipkv_device_error>()];
        self.engine.download(&self.error, 0, &mut word, stream)?;
        // SAFETY: `hipkv_device_error` is plain integers; any bytes are a valid value.
        let e: hipkv_device_error = unsafe { std::ptr::read_unaligned(word.as_ptr().cast()) };
        if e.what == 0 {
            return Ok(());
        }
        self.engine.upload(
            &self.error,
            0,
            &[0u8; size_of::<hipkv_device_error>()],
            stream,
        )?;
        Err(Error::from_device(&e))
    }

    /// Outliers dropped for lack of slots since the last call (waits for `stream`).
    pub fn take_outliers_dropped(&self, stream: StreamHandle) -> Result<u64> {
        let mut bytes = [0u8; 8];
        self.engine.download(&self.dropped, 0, &mut bytes, stream)?;
        if bytes != [0; 8] {
            self.engine.upload(&self.dropped, 0, &[0; 8], stream)?;
        }
        Ok(u64::from_le_bytes(bytes))
    }

    /// Dequantizes positions `0..len` of the sequence in slot `slot` whose blocks are `blocks`,
    /// from layer cache `cache`: `(k, v)`, each `len × kv_heads × head_dim`, keys as attention
    /// sees them (rotated by RoPE where stored before it), a `rot` scheme's rows rotated back.
    /// For tests and inspection: it waits for the default stream and copies the layer to the
    /// host; attention never makes this copy.
    pub fn read_back(
        &self,
        layer: usize,
        cache: &DeviceMemory,
        blocks: &[i32],
        slot: usize,
        len: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut all = self.read_back_seqs(layer, cache, &[(blocks, slot, len)])?;
        Ok(all.pop().expect("one sequence"))
    }

    /// [`read_back`](Self::read_back) of several sequences `(blocks, slot, len)`, copying the
    /// layer to the host once.
    pub fn read_back_seqs(
        &self,
        layer: usize,
        cache: &DeviceMemory,
        seqs: &[(&[i32], usize, usize)],
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        if cache.bytes() < self.layout.cache_bytes() {
            return Err(Error::Shape {
                what: "layer cache (layout.cache_bytes())",
                expected: self.layout.cache_bytes(),
                got: cache.bytes(),
            });
        }
        let mut host = vec![0u8; self.layout.cache_bytes()];
        self.engine
            .download(cache, 0, &mut host, StreamHandle::DEFAULT)?;
        seqs.iter()
            .map(|&(blocks, slot, len)| self.dequantize(layer, &host, blocks, slot, len))
            .collect()
    }

    /// One sequence of a host copy of a layer cache, dequantized.
    fn dequantize(
        &self,
        layer: usize,
        host: &[u8],
        blocks: &[i32],
        slot: usize,
        len: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let spec = self.layout.spec();
        let (h, d) = (spec.kv_heads, spec.head_dim);
        if slot >= spec.max_seqs {
            return Err(Error::OutOfRange {
                what: "sequence slot",
                index: slot,
                limit: spec.max_seqs,
            });
        }
        let needed = len.div_ceil(self.layout.block_tokens());
        if blocks.len() < needed
            || blocks[..needed]
                .iter()
                .any(|&b| b < 0 || b as usize >= spec.num_blocks)
        {
            return Err(Error::Shape {
                what: "blocks of the sequence (ids within the layout, one per block it holds)",
                expected: needed,
                got: blocks.len(),
            });
        }
        let state = self.download_state(layer, slot)?;
        let books = match &self.codebooks[layer] {
            Some(c) => [c.books[0].as_ref(), c.books[1].as_ref()],
            None => [None, None],
        };
        let view = cpu::CacheView {
            layout: &self.layout,
            cache: host,
            rope: None,
            books,
        };
        let seq = cpu::PagedSeq {
            len,
            blocks,
            state: &state,
        };
        let rotation = spec.scheme.rotation;
        let mut k = vec![0f32; len * h * d];
        let mut v = vec![0f32; len * h * d];
        for head in 0..h {
            for block in view.blocks(&seq, head, 0..usize::MAX) {
                for t in 0..block.tokens {
                    let pos = block.first_pos + t;
                    let at = (pos * h + head) * d;
                    block.k.dequantize(t, &mut k[at..at + d]);
                    block.v.dequantize(t, &mut v[at..at + d]);
                    // H/√d is its own inverse.
                    if rotation.applies(Stream::K) {
                        crate::quant::hadamard_exact(&mut k[at..at + d]);
                    }
                    if rotation.applies(Stream::V) {
                        crate::quant::hadamard_exact(&mut v[at..at + d]);
                    }
                    if let Some(rope) = &self.rope_table {
                        rope.rotate(&mut k[at..at + d], pos);
                    }
                }
            }
        }
        Ok((k, v))
    }

    /// The state of slot `slot` of `layer`, as bytes (tests and the owning cache's reads).
    pub fn download_state(&self, layer: usize, slot: usize) -> Result<Vec<u8>> {
        self.check_layer(layer)?;
        let per_layer = self.layout.state_bytes();
        let mut out = vec![0u8; per_layer];
        let at = (slot * self.layers + layer) * per_layer;
        self.engine
            .download(&self.state, at, &mut out, StreamHandle::DEFAULT)?;
        Ok(out)
    }

    /// Overwrites the state of slot `slot` of `layer` (the owning cache's moves).
    pub fn upload_state(&self, layer: usize, slot: usize, bytes: &[u8]) -> Result<()> {
        self.check_layer(layer)?;
        let per_layer = self.layout.state_bytes();
        if bytes.len() != per_layer {
            return Err(Error::Shape {
                what: "slot state (layout.state_bytes())",
                expected: per_layer,
                got: bytes.len(),
            });
        }
        let at = (slot * self.layers + layer) * per_layer;
        self.engine
            .upload(&self.state, at, bytes, StreamHandle::DEFAULT)
    }
}

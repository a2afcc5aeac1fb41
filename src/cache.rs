//! The owning KV cache: a thin owner over the paged core ([`crate::paged`]) that allocates the
//! blocks of every layer, hands them to sequences in order, and takes host slices, so that a
//! program without a block allocator of its own (an eval harness, a benchmark, a CPU engine)
//! gets the same storage and the same kernels a server drives through the paged calls.
//!
//! Position `p` of a sequence lives in block `p / G` of its block list, row `p % G`; the f16
//! rows of positions below `sinks` and, for per-channel formats, of the open block live in the
//! sequence's slot state (slot = sequence index). Per-token formats are quantized as tokens
//! arrive; a per-channel block is quantized when its last position is written.

use std::sync::Mutex;

use crate::backend::{Backend, DeviceMemory};
use crate::calibration::{Calibration, LayerCalibration};
use crate::error::{Error, Result};
use crate::hip::{Device, StreamHandle};
use crate::paged::{
    BatchLimits, DType, KvBatch, Layout, LayoutSpec, PagedCache, QueryBatch, Workspace,
};
use crate::quant::{self, Codebook, OutlierThresholds};
use crate::rope::{Rope, RopeTable};
use crate::scheme::{HeadLayout, Scheme, Stream, StreamSet};

/// Shape and scheme of a cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheConfig {
    pub layers: usize,
    /// Sequences the cache holds at once.
    pub sequences: usize,
    pub kv_heads: usize,
    /// Query heads; a multiple of `kv_heads` (GQA).
    pub q_heads: usize,
    pub head_dim: usize,
    /// Tokens each sequence may hold, per layer.
    pub capacity: usize,
    pub scheme: Scheme,
    /// RoPE applied by the cache to keys and queries (`None`: the caller rotates them).
    pub rope: Option<Rope>,
}

impl CacheConfig {
    /// Query heads per KV head.
    pub fn gqa(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The paged layout of this cache: one block list of `capacity` tokens per sequence.
    fn layout(&self) -> Result<Layout> {
        let positive = [
            ("layers", self.layers),
            ("sequences", self.sequences),
            ("capacity", self.capacity),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, n)| *n == 0) {
            return Err(Error::Unsupported(format!("{what} must be positive")));
        }
        if self.capacity > u32::MAX as usize / 2 {
            return Err(Error::Unsupported(format!("capacity {}", self.capacity)));
        }
        let blocks = self
            .sequences
            .checked_mul(self.capacity.div_ceil(self.scheme.group_tokens))
            .ok_or(Error::OutOfMemory {
                bytes: u128::MAX,
                backend: "any",
            })?;
        Layout::new(LayoutSpec {
            scheme: self.scheme,
            kv_heads: self.kv_heads,
            q_heads: self.q_heads,
            head_dim: self.head_dim,
            num_blocks: blocks,
            max_seqs: self.sequences,
            max_positions: self.capacity,
            rope: self.rope,
        })
    }
}

/// One query of a batched [`KvCache::attend_many`] call.
pub struct Query<'a> {
    pub seq: usize,
    /// `q_len × q_heads × head_dim`, the chunk's last `q_len` tokens, unrotated when the cache
    /// applies RoPE.
    pub q: &'a [f32],
    /// Same shape as `q`.
    pub out: &'a mut [f32],
}

/// One sequence of one layer: its length and blocks.
#[derive(Clone, Debug, Default)]
struct Seq {
    len: usize,
    blocks: Vec<i32>,
}

/// One layer: its blocks' memory, the blocks nobody holds, the sequences.
struct Layer {
    cache: DeviceMemory,
    free: Vec<i32>,
    seqs: Vec<Seq>,
    outliers: Option<(OutlierThresholds, Option<OutlierThresholds>)>,
    codebooks: Option<(Option<Codebook>, Option<Codebook>)>,
    /// The sliding window its queries attend within ([`KvCache::set_sliding_window`]).
    window: Option<usize>,
}

/// A quantized KV cache, in host memory (the CPU backend) or device memory (`Hip`, and `Emu`
/// which runs the device path on host memory).
pub struct KvCache {
    config: CacheConfig,
    paged: PagedCache,
    layers: Vec<Layer>,
    /// The host-side RoPE of keys (unless stored before RoPE) and queries.
    rope: Option<RopeTable>,
    outliers_dropped: u64,
    /// A device buffer for the inputs and outputs of one call (GPU only), grown on demand.
    staging: Mutex<Option<DeviceMemory>>,
    /// The attention workspace, grown with the largest call so far.
    workspace: Mutex<Option<(DeviceMemory, BatchLimits)>>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("config", &self.config)
            .field("backend", &self.backend())
            .finish()
    }
}

/// Host arrays of one call, at addresses the backend reads: the arrays themselves on the
/// host-memory backends, copies in the staging buffer on a GPU.
struct Staged<'a> {
    addrs: Vec<u64>,
    /// The staging buffer, held while the call uses it (GPU only).
    buffer: Option<std::sync::MutexGuard<'a, Option<DeviceMemory>>>,
}

impl KvCache {
    /// Allocates a cache on the CPU: every block each sequence may need, and the slot states.
    pub fn new(config: CacheConfig) -> Result<KvCache> {
        KvCache::with_backend(config, Backend::Cpu)
    }

    /// Allocates a cache on `backend`: for `Hip` in device memory, with nothing of it in host
    /// memory but the block lists; for `Emu` the same path on host memory.
    pub fn with_backend(mut config: CacheConfig, backend: Backend) -> Result<KvCache> {
        // Sinks beyond the capacity are clamped to it (every token is then a sink).
        config.scheme.sinks = config.scheme.sinks.min(config.capacity);
        let layout = config.layout()?;
        // The whole cache, counted in u128 first: a size no allocator can give is refused here
        // rather than by a loop of allocations.
        let per_layer =
            layout.cache_bytes() as u128 + (config.sequences * layout.state_bytes()) as u128;
        let total = per_layer.saturating_mul(config.layers as u128);
        if total > isize::MAX as u128 {
            return Err(Error::OutOfMemory {
                bytes: total,
                backend: "any",
            });
        }
        let paged = PagedCache::new(layout, config.layers, backend)?;
        let per_seq = config.capacity.div_ceil(config.scheme.group_tokens);
        let layers = (0..config.layers)
            .map(|_| {
                Ok(Layer {
                    cache: paged.alloc(layout.cache_bytes())?,
                    free: (0..(per_seq * config.sequences) as i32).rev().collect(),
                    seqs: vec![Seq::default(); config.sequences],
                    outliers: None,
                    codebooks: None,
                    window: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            rope: config
                .rope
                .map(|r| RopeTable::new(r, config.head_dim, config.capacity)),
            config,
            paged,
            layers,
            outliers_dropped: 0,
            staging: Mutex::new(None),
            workspace: Mutex::new(None),
        })
    }

    /// The configuration, with `scheme.sinks` clamped to `capacity`.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The paged layout under this cache.
    pub fn layout(&self) -> &Layout {
        self.paged.layout()
    }

    /// Layout of one head's part of a block.
    pub fn head_layout(&self) -> &HeadLayout {
        self.paged.layout().head_layout()
    }

    /// Tokens stored for `seq` in `layer`.
    pub fn len(&self, layer: usize, seq: usize) -> Result<usize> {
        self.check_layer_seq(layer, seq)?;
        Ok(self.layers[layer].seqs[seq].len)
    }

    /// Bytes the cache allocated for K and V storage (blocks and slot states), in host or device
    /// memory.
    pub fn allocated_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.cache.bytes()).sum::<usize>() + self.paged.state_pool_bytes()
    }

    /// Outliers that did not fit their token's slots and stayed in the dense row instead.
    pub fn outliers_dropped(&self) -> u64 {
        self.outliers_dropped
    }

    /// Bytes one attention step over `seq` in `layer` reads: the f16 sink rows, and of every
    /// block it touches the rows past the sinks (their codes, their parameters, the page's
    /// per-channel parameters, their outlier counts and slots, the slots at capacity), or in
    /// their place the f16 rows a scheme reads instead: the open block's of a per-channel stream
    /// (residual window), the values of the blocks in the value window. Without outliers, the
    /// attention kernels read exactly these bytes (tests/cost.rs traces them).
    pub fn bytes_read(&self, layer: usize, seq: usize) -> Result<usize> {
        let len = self.len(layer, seq)?;
        let s = &self.config.scheme;
        let head = self.paged.layout().head_layout();
        let f16_row = self.config.head_dim * 2;
        let g = s.group_tokens;
        let mut per_head = 2 * len.min(s.sinks) * f16_row;
        for block in 0..len.div_ceil(g) {
            let first = block * g;
            let tokens = (len - first).min(g);
            // Rows past the sinks: what the f16 windows hold of this block.
            let rows = tokens - s.sinks.saturating_sub(first).min(tokens);
            let in_window = s.value_window > 0 && first + g + s.value_window > len;
            for stream in [Stream::K, Stream::V] {
                let l = head.stream(stream);
                per_head += if stream == Stream::V && in_window
                    || tokens < g && l.format.is_grouped_by_tokens()
                {
                    rows * f16_row
                } else if rows == 0 {
                    0
                } else {
                    let params = if l.format.is_grouped_by_tokens() {
                        l.format.params_bytes(g, self.config.head_dim)
                    } else {
                        l.format.params_bytes(rows, self.config.head_dim)
                    };
                    let outliers = if l.outlier_slots > 0 {
                        (2 + 4 * l.outlier_slots) * rows
                    } else {
                        0
                    };
                    rows * l.row_bytes + params + outliers
                };
            }
        }
        Ok(per_head * self.config.kv_heads)
    }

    /// Makes layer `layer`'s queries attend within a sliding window from now on (Gemma's and
    /// Mistral's local layers): each to its own position and the `window − 1` before it; `None`
    /// (the default) to every position. Attention reads only the blocks within the window, but
    /// the cache still keeps every token: `capacity` bounds the sequence, not the window.
    pub fn set_sliding_window(&mut self, layer: usize, window: Option<usize>) -> Result<()> {
        self.check_layer_seq(layer, 0)?;
        if window == Some(0) {
            return Err(Error::EmptyWindow);
        }
        self.layers[layer].window = window;
        Ok(())
    }

    /// The sliding window of layer `layer`'s queries ([`set_sliding_window`](Self::set_sliding_window)).
    pub fn sliding_window(&self, layer: usize) -> Result<Option<usize>> {
        self.check_layer_seq(layer, 0)?;
        Ok(self.layers[layer].window)
    }

    /// Sets the outlier thresholds of a layer (`v` only when the scheme stores value outliers).
    pub fn set_outlier_thresholds(
        &mut self,
        layer: usize,
        k: OutlierThresholds,
        v: Option<OutlierThresholds>,
    ) -> Result<()> {
        self.check_layer_seq(layer, 0)?;
        self.paged.set_outlier_thresholds(layer, &k, v.as_ref())?;
        self.layers[layer].outliers = Some((k, v));
        Ok(())
    }

    /// What every layer has been calibrated to so far (for [`Calibration::to_text`]).
    pub fn calibration(&self) -> Calibration {
        Calibration {
            scheme: self.config.scheme,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
            layers: self
                .layers
                .iter()
                .map(|l| LayerCalibration {
                    outliers: l.outliers.clone(),
                    codebooks: l.codebooks.clone(),
                })
                .collect(),
        }
    }

    /// Sets every layer's outlier thresholds and codebooks from `c` (a calibration file, or
    /// another cache's [`calibration`](Self::calibration)): its scheme and shape must be this
    /// cache's, and every layer must hold what the scheme needs. Checked, and copied to the
    /// device, before anything is set: on an error the cache is as it was.
    pub fn apply_calibration(&mut self, c: &Calibration) -> Result<()> {
        // The paged cache checks it all and sets nothing unless every layer's copy is made.
        self.paged.apply_calibration(c)?;
        for (mine, theirs) in self.layers.iter_mut().zip(&c.layers) {
            if theirs.outliers.is_some() {
                mine.outliers = theirs.outliers.clone();
            }
            if theirs.codebooks.is_some() {
                mine.codebooks = theirs.codebooks.clone();
            }
        }
        Ok(())
    }

    /// Calibrates whatever layer `layer` of the scheme needs from sample tokens laid out as for
    /// [`append`](Self::append): outlier thresholds
    /// ([`calibrate_outliers`](Self::calibrate_outliers)) then codebooks
    /// ([`calibrate_codebooks`](Self::calibrate_codebooks)); nothing for other schemes.
    pub fn calibrate(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        first_position: usize,
    ) -> Result<()> {
        let scheme = self.config.scheme;
        if scheme.outliers.is_some() {
            self.calibrate_outliers(layer, k, v, first_position)?;
        }
        if scheme.nuq != StreamSet::None {
            self.calibrate_codebooks(layer, k, v, first_position)?;
        }
        Ok(())
    }

    /// Calibrates a layer's outlier thresholds from sample tokens laid out as for
    /// [`append`](Self::append) (unrotated; rotated here to `first_position..` unless keys are
    /// stored before RoPE).
    pub fn calibrate_outliers(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        first_position: usize,
    ) -> Result<()> {
        let Some(o) = self.config.scheme.outliers else {
            return Err(Error::Unsupported(format!(
                "scheme {} has no outlier store",
                self.config.scheme
            )));
        };
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        let k = self.calibration_keys(k, first_position)?;
        check_finite(Stream::V, v, h, d)?;
        let kt = OutlierThresholds::calibrate(&k, h, d, o.fraction)?;
        let vt = if o.values {
            Some(OutlierThresholds::calibrate(v, h, d, o.fraction)?)
        } else {
            None
        };
        self.set_outlier_thresholds(layer, kt, vt)
    }

    /// Sample keys as the cache stores them before any quantization: rotated by RoPE to
    /// `first_position..` (unless the scheme keeps keys before RoPE), checked finite.
    fn calibration_keys(&self, k: &[f32], first_position: usize) -> Result<Vec<f32>> {
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        let mut k = k.to_vec();
        if let Some(rope) = self.rope.as_ref().filter(|_| !self.config.scheme.pre_rope) {
            let tokens = k.len() / (h * d);
            if first_position + tokens > self.config.capacity {
                return Err(Error::OutOfRange {
                    what: "calibration position",
                    index: first_position + tokens,
                    limit: self.config.capacity + 1,
                });
            }
            for (t, token) in k.chunks_exact_mut(h * d).enumerate() {
                for head in token.chunks_exact_mut(d) {
                    rope.rotate(head, first_position + t);
                }
            }
        }
        check_finite(Stream::K, &k, h, d)?;
        Ok(k)
    }

    /// Sets the codebooks of a layer: one for each stream the scheme's `nuq` names.
    pub fn set_codebooks(
        &mut self,
        layer: usize,
        k: Option<Codebook>,
        v: Option<Codebook>,
    ) -> Result<()> {
        self.check_layer_seq(layer, 0)?;
        self.paged.set_codebooks(layer, k.as_ref(), v.as_ref())?;
        self.layers[layer].codebooks = Some((k, v));
        Ok(())
    }

    /// Fits a layer's codebooks ([`Codebook::fit`]) to sample tokens laid out as for
    /// [`append`](Self::append), transformed as the cache would store them (RoPE at
    /// `first_position..` unless keys are kept before it, the Walsh–Hadamard rotation, the
    /// outlier split when the layer has thresholds, f16 rounding) and normalized per group as
    /// the quantizer does; per-channel groups are `group_tokens` consecutive samples.
    pub fn calibrate_codebooks(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        first_position: usize,
    ) -> Result<()> {
        self.check_layer_seq(layer, 0)?;
        let scheme = self.config.scheme;
        if scheme.nuq == StreamSet::None {
            return Err(Error::Unsupported(format!(
                "scheme {scheme} has no codebooks (nuq)"
            )));
        }
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        let k = self.calibration_keys(k, first_position)?;
        check_finite(Stream::V, v, h, d)?;
        let mut books = [None, None];
        for (i, (stream, x)) in [(Stream::K, &k[..]), (Stream::V, v)]
            .into_iter()
            .enumerate()
        {
            let Some(bits) = scheme.codebook_bits(stream) else {
                continue;
            };
            let thresholds =
                self.layers[layer]
                    .outliers
                    .as_ref()
                    .and_then(|(kt, vt)| match stream {
                        Stream::K => Some(kt),
                        Stream::V => vt.as_ref(),
                    });
            let slots = scheme.outlier_slots(stream, d);
            let mut samples = Vec::new();
            for head in 0..h {
                let mut rows: Vec<f32> = x
                    .chunks_exact(d)
                    .skip(head)
                    .step_by(h)
                    .flat_map(|row| {
                        let mut row = row.to_vec();
                        if scheme.rotation.applies(stream) {
                            quant::hadamard(&mut row);
                        }
                        row.iter_mut().for_each(|x| *x = quant::round_f16(*x));
                        row
                    })
                    .collect();
                if let Some(t) = thresholds {
                    let (lo, hi) = t.head(head);
                    for row in rows.chunks_exact_mut(d) {
                        quant::split_outliers(row, lo, hi, slots);
                    }
                }
                let format = scheme.format(stream);
                quant::normalized_codes(format, &rows, d, scheme.group_tokens, &mut samples);
            }
            books[i] = Some(Codebook::fit(bits, &samples)?);
        }
        let [kb, vb] = books;
        self.set_codebooks(layer, kb, vb)
    }

    fn check_layer_seq(&self, layer: usize, seq: usize) -> Result<()> {
        if layer >= self.config.layers {
            return Err(Error::OutOfRange {
                what: "layer",
                index: layer,
                limit: self.config.layers,
            });
        }
        if seq >= self.config.sequences {
            return Err(Error::OutOfRange {
                what: "sequence",
                index: seq,
                limit: self.config.sequences,
            });
        }
        Ok(())
    }

    /// Empties a sequence in every layer and returns its blocks to the pool.
    pub fn clear(&mut self, seq: usize) -> Result<()> {
        self.check_layer_seq(0, seq)?;
        for layer in &mut self.layers {
            let s = &mut layer.seqs[seq];
            s.len = 0;
            layer.free.extend(s.blocks.drain(..).rev());
        }
        Ok(())
    }

    /// `parts` at addresses the backend reads, and room for `out` bytes after them on a GPU
    /// (the last address then).
    fn stage(&self, parts: &[&[u8]], out: usize) -> Result<Staged<'_>> {
        if self.paged.backend() != Backend::Hip {
            return Ok(Staged {
                addrs: parts.iter().map(|p| p.as_ptr() as u64).collect(),
                buffer: None,
            });
        }
        let align = |n: usize| n.next_multiple_of(crate::backend::device::ALIGN);
        let mut offsets = Vec::with_capacity(parts.len() + 1);
        let mut end = 0;
        for p in parts.iter().map(|p| p.len()).chain([out]) {
            offsets.push(end);
            end = align(end + p);
        }
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|m| m.bytes() < end) {
            *guard = None;
            *guard = Some(self.paged.alloc(end.max(2 * guard_len(&guard)))?);
        }
        let mem = guard.as_ref().expect("staging allocated");
        for (p, &at) in parts.iter().zip(&offsets) {
            self.paged.upload(mem, at, p, StreamHandle::DEFAULT)?;
        }
        Ok(Staged {
            addrs: offsets.iter().map(|&o| mem.addr() + o as u64).collect(),
            buffer: Some(guard),
        })
    }

    /// Appends tokens to a sequence of a layer. `k` and `v` are `n × kv_heads × head_dim`
    /// (unrotated when the cache applies RoPE). Values are rounded to f16 first. On any error
    /// nothing the sequence holds changes.
    pub fn append(&mut self, layer: usize, seq: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_layer_seq(layer, seq)?;
        let cfg = self.config;
        let width = cfg.kv_heads * cfg.head_dim;
        if !k.len().is_multiple_of(width) {
            return Err(Error::Shape {
                what: "keys (a multiple of kv_heads × head_dim)",
                expected: k.len().next_multiple_of(width),
                got: k.len(),
            });
        }
        if v.len() != k.len() {
            return Err(Error::Shape {
                what: "values (as many as keys)",
                expected: k.len(),
                got: v.len(),
            });
        }
        let n = k.len() / width;
        let len = self.layers[layer].seqs[seq].len;
        if len + n > cfg.capacity {
            return Err(Error::CacheFull {
                layer,
                seq,
                len,
                capacity: cfg.capacity,
                requested: n,
            });
        }
        for (stream, data) in [(Stream::K, k), (Stream::V, v)] {
            check_finite(stream, data, cfg.kv_heads, cfg.head_dim)?;
        }
        if !self.paged.has_thresholds(layer) {
            return Err(Error::OutliersNotCalibrated { layer });
        }
        if !self.paged.has_codebooks(layer) {
            return Err(Error::CodebooksNotCalibrated { layer });
        }
        if n == 0 {
            return Ok(());
        }
        let mut k = k.to_vec();
        if let Some(rope) = self.rope.as_ref().filter(|_| !cfg.scheme.pre_rope) {
            for (t, token) in k.chunks_exact_mut(width).enumerate() {
                for head in token.chunks_exact_mut(cfg.head_dim) {
                    rope.rotate(head, len + t);
                }
            }
            // Rotation mixes channel pairs: a key within the f16 range may leave it.
            check_finite(Stream::K, &k, cfg.kv_heads, cfg.head_dim)?;
        }
        // So does the Walsh–Hadamard rotation of a `rot` scheme, which the write kernels apply.
        for (stream, data) in [(Stream::K, &k[..]), (Stream::V, v)] {
            if cfg.scheme.rotation.applies(stream) {
                let mut rotated = data.to_vec();
                crate::quant::hadamard_rows(&mut rotated, cfg.head_dim);
                check_finite(stream, &rotated, cfg.kv_heads, cfg.head_dim)?;
            }
        }

        // Blocks for the new positions, taken now and given back if the write fails.
        let g = cfg.scheme.group_tokens;
        let Layer { free, seqs, .. } = &mut self.layers[layer];
        let s = &mut seqs[seq];
        let held = s.blocks.len();
        while s.blocks.len() < (len + n).div_ceil(g) {
            s.blocks.push(
                free.pop()
                    .expect("pool sized for every sequence's capacity"),
            );
        }
        let positions: Vec<i32> = (len..len + n).map(|p| p as i32).collect();
        let slots: Vec<i64> = (len..len + n)
            .map(|p| i64::from(s.blocks[p / g]) * g as i64 + (p % g) as i64)
            .collect();
        let seq_slots = vec![seq as i32; n];
        let result = self.write(layer, n, &k, v, &slots, &seq_slots, &positions);
        let Layer { free, seqs, .. } = &mut self.layers[layer];
        let s = &mut seqs[seq];
        match result {
            Ok(dropped) => {
                s.len += n;
                self.outliers_dropped += dropped;
                Ok(())
            }
            Err(e) => {
                free.extend(s.blocks.drain(held..).rev());
                Err(e)
            }
        }
    }

    /// Stages one write and runs it; returns the outliers dropped.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        layer: usize,
        n: usize,
        k: &[f32],
        v: &[f32],
        slots: &[i64],
        seq_slots: &[i32],
        positions: &[i32],
    ) -> Result<u64> {
        use crate::backend::device::as_bytes;
        let staged = self.stage(
            &[
                as_bytes(k),
                as_bytes(v),
                as_bytes(slots),
                as_bytes(seq_slots),
                as_bytes(positions),
            ],
            0,
        )?;
        let a = &staged.addrs;
        let batch = KvBatch {
            tokens: n,
            dtype: DType::F32,
            k: a[0],
            v: a[1],
            slot_mapping: a[2],
            seq_slots: a[3],
            positions: a[4],
        };
        let stream = StreamHandle::DEFAULT;
        // SAFETY: the staged arrays hold what `batch` says and live until `check` below has
        // waited for the work; the layer's cache is this layer's allocation of `cache_bytes`.
        unsafe {
            self.paged
                .write_kv(layer, self.layers[layer].cache.addr(), &batch, stream)?
        };
        self.paged.check(stream)?;
        self.paged.take_outliers_dropped(stream)
    }

    /// Attends one query chunk of `seq` over layer `layer`: `q` is `q_len × q_heads × head_dim`
    /// for the sequence's last `q_len` tokens (already appended), each attending causally to every
    /// token up to its own position. `out` has the shape of `q`.
    pub fn attend(
        &self,
        layer: usize,
        seq: usize,
        q: &[f32],
        softmax_scale: f32,
        out: &mut [f32],
    ) -> Result<()> {
        self.attend_many(layer, &mut [Query { seq, q, out }], softmax_scale)
    }

    /// Attends several sequences' query chunks of one layer at once, spreading (sequence,
    /// KV head, split) work items over all cores (or over the GPU's compute units).
    pub fn attend_many(
        &self,
        layer: usize,
        queries: &mut [Query<'_>],
        softmax_scale: f32,
    ) -> Result<()> {
        self.attend_inner(layer, queries, softmax_scale, false)
            .map(drop)
    }

    /// [`attend_many`](Self::attend_many), timing the device's work: the seconds from just
    /// before the first attention kernel to just after the last (device events on a GPU, the
    /// wall clock of the emulated launches on `Emu`), without the query upload and output
    /// download. `None` on the CPU backend, where the call itself is the work.
    pub fn attend_many_timed(
        &self,
        layer: usize,
        queries: &mut [Query<'_>],
        softmax_scale: f32,
    ) -> Result<Option<f64>> {
        let timed = self.backend() != Backend::Cpu;
        self.attend_inner(layer, queries, softmax_scale, timed)
    }

    fn attend_inner(
        &self,
        layer: usize,
        queries: &mut [Query<'_>],
        softmax_scale: f32,
        timed: bool,
    ) -> Result<Option<f64>> {
        let cfg = &self.config;
        let width = cfg.q_heads * cfg.head_dim;
        for query in queries.iter() {
            self.check_layer_seq(layer, query.seq)?;
            let q_len = query.q.len() / width;
            if q_len == 0 || query.q.len() != q_len * width {
                return Err(Error::Shape {
                    what: "query chunk (a positive multiple of q_heads × head_dim)",
                    expected: q_len.max(1) * width,
                    got: query.q.len(),
                });
            }
            if query.out.len() != query.q.len() {
                return Err(Error::Shape {
                    what: "attention output (shaped as the query)",
                    expected: query.q.len(),
                    got: query.out.len(),
                });
            }
            let len = self.layers[layer].seqs[query.seq].len;
            if q_len > len {
                return Err(Error::QueryBeyondCache {
                    layer,
                    seq: query.seq,
                    q_len,
                    len,
                });
            }
            if let Some((i, x)) = query.q.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(Error::NonFiniteQuery {
                    token: i / width,
                    head: i % width / cfg.head_dim,
                    channel: i % cfg.head_dim,
                    value: *x,
                });
            }
        }
        if !softmax_scale.is_finite() {
            return Err(Error::BadSoftmaxScale(softmax_scale));
        }
        if queries.is_empty() {
            return Ok(None);
        }

        // The batch, as a server would pass it.
        let lay = &self.layers[layer];
        let seqs: Vec<&Seq> = queries.iter().map(|q| &lay.seqs[q.seq]).collect();
        let widest = seqs
            .iter()
            .map(|s| s.blocks.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut q = Vec::new();
        let mut starts = vec![0i32];
        for (query, s) in queries.iter().zip(&seqs) {
            let first = q.len();
            q.extend_from_slice(query.q);
            let q_len = query.q.len() / width;
            if let Some(rope) = &self.rope {
                for (t, token) in q[first..].chunks_exact_mut(width).enumerate() {
                    for head in token.chunks_exact_mut(cfg.head_dim) {
                        rope.rotate(head, s.len - q_len + t);
                    }
                }
            }
            starts.push((q.len() / width) as i32);
        }
        let tokens = q.len() / width;
        let lens: Vec<i32> = seqs.iter().map(|s| s.len as i32).collect();
        let slots: Vec<i32> = queries.iter().map(|q| q.seq as i32).collect();
        let mut tables = vec![0i32; seqs.len() * widest];
        for (row, s) in tables.chunks_exact_mut(widest).zip(&seqs) {
            row[..s.blocks.len()].copy_from_slice(&s.blocks);
        }
        let mut out = vec![0f32; q.len()];
        let seconds = self.run_attend(
            layer,
            QueryShape {
                tokens,
                max_q_len: (starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)) as usize,
                max_seq_len: seqs.iter().map(|s| s.len).max().unwrap_or(0),
                widest,
                scale: softmax_scale,
            },
            [&q, &starts, &lens, &tables, &slots],
            &mut out,
            timed,
        )?;
        let mut at = 0;
        for query in queries.iter_mut() {
            let n = query.out.len();
            query.out.copy_from_slice(&out[at..at + n]);
            at += n;
        }
        Ok(seconds)
    }

    /// Stages a batch (`[q, query_start_loc, seq_lens, block_tables, seq_slots]`) and runs it.
    fn run_attend(
        &self,
        layer: usize,
        shape: QueryShape,
        [q, starts, lens, tables, slots]: [&dyn AsBytes; 5],
        out: &mut [f32],
        timed: bool,
    ) -> Result<Option<f64>> {
        let limits = BatchLimits {
            max_tokens: shape.tokens,
        };
        let mut ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        if ws.as_ref().is_none_or(|(_, l)| l.max_tokens < shape.tokens) {
            let grown = BatchLimits {
                max_tokens: shape
                    .tokens
                    .max(ws.as_ref().map_or(0, |(_, l)| 2 * l.max_tokens)),
            };
            *ws = None;
            let bytes = self.paged.layout().workspace_bytes(grown);
            *ws = Some((self.paged.alloc(bytes)?, grown));
        }
        let (ws_mem, ws_limits) = ws.as_ref().expect("workspace allocated");
        debug_assert!(ws_limits.max_tokens >= limits.max_tokens);
        let out_bytes = size_of_val(out);
        let staged = self.stage(
            &[
                q.bytes(),
                starts.bytes(),
                lens.bytes(),
                tables.bytes(),
                slots.bytes(),
            ],
            out_bytes,
        )?;
        let a = &staged.addrs;
        let on_gpu = a.len() == 6;
        let out_addr = if on_gpu {
            a[5]
        } else {
            out.as_mut_ptr() as u64
        };
        let batch = QueryBatch {
            num_seqs: lens.bytes().len() / 4,
            tokens: shape.tokens,
            max_q_len: shape.max_q_len,
            max_seq_len: shape.max_seq_len,
            max_blocks_per_seq: shape.widest,
            dtype: DType::F32,
            softmax_scale: shape.scale,
            window: self.layers[layer].window,
            q: a[0],
            out: out_addr,
            query_start_loc: a[1],
            seq_lens: a[2],
            block_tables: a[3],
            seq_slots: a[4],
        };
        let workspace = Workspace {
            addr: ws_mem.addr(),
            limits: *ws_limits,
        };
        let cache = self.layers[layer].cache.addr();
        let stream = StreamHandle::DEFAULT;
        // SAFETY: the staged arrays hold what `batch` says, the output has room for every
        // query row, the workspace is sized for its limits, and all live until `check` below
        // has waited for the work.
        let seconds = unsafe {
            if timed {
                Some(
                    self.paged
                        .attend_timed(layer, cache, &batch, &workspace, stream)?,
                )
            } else {
                self.paged
                    .attend(layer, cache, &batch, &workspace, stream)?;
                None
            }
        };
        self.paged.check(stream)?;
        if on_gpu {
            let mem = staged
                .buffer
                .as_ref()
                .and_then(|g| g.as_ref())
                .expect("staged");
            let mut bytes = vec![0u8; out_bytes];
            self.paged
                .download(mem, (a[5] - mem.addr()) as usize, &mut bytes, stream)?;
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
        }
        Ok(seconds)
    }

    /// Moves the cache to `backend`: its blocks and slot states are copied to the device (or
    /// back) and appends and attention run there from now on. On an error (no such device, out
    /// of memory) the cache stays where it was.
    pub fn set_backend(&mut self, backend: Backend) -> Result<()> {
        if backend == self.backend() {
            return Ok(());
        }
        let mut paged = PagedCache::new(*self.paged.layout(), self.config.layers, backend)?;
        let mut caches = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let mut bytes = vec![0u8; layer.cache.bytes()];
            self.paged
                .download(&layer.cache, 0, &mut bytes, StreamHandle::DEFAULT)?;
            let mem = paged.alloc(bytes.len())?;
            paged.upload(&mem, 0, &bytes, StreamHandle::DEFAULT)?;
            caches.push(mem);
            for slot in 0..self.config.sequences {
                paged.upload_state(l, slot, &self.paged.download_state(l, slot)?)?;
            }
            if let Some((k, v)) = &layer.outliers {
                paged.set_outlier_thresholds(l, k, v.as_ref())?;
            }
            if let Some((k, v)) = &layer.codebooks {
                paged.set_codebooks(l, k.as_ref(), v.as_ref())?;
            }
        }
        for (layer, cache) in self.layers.iter_mut().zip(caches) {
            layer.cache = cache;
        }
        self.paged = paged;
        *self.staging.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        *self.workspace.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    /// The GPU the cache lives on (`Backend::Hip`).
    pub fn device(&self) -> Option<&Device> {
        self.paged.device()
    }

    /// The backend attention runs on.
    pub fn backend(&self) -> Backend {
        self.paged.backend()
    }

    /// The host bytes of one layer's blocks and of one sequence's state.
    fn host_layer(&self, layer: usize, seq: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let mem = &self.layers[layer].cache;
        let mut cache = vec![0u8; mem.bytes()];
        self.paged
            .download(mem, 0, &mut cache, StreamHandle::DEFAULT)?;
        Ok((cache, self.paged.download_state(layer, seq)?))
    }

    /// Dequantizes everything stored for `seq` in `layer`: `(k, v)`, each
    /// `len × kv_heads × head_dim`, keys as attention sees them (rotated). Meant for tests and
    /// measurements; attention itself never makes this copy.
    pub fn read_back(&self, layer: usize, seq: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_layer_seq(layer, seq)?;
        let s = &self.layers[layer].seqs[seq];
        self.paged
            .read_back(layer, &self.layers[layer].cache, &s.blocks, seq, s.len)
    }

    /// Everything stored for `seq` in `layer`, as bytes in a canonical order: its blocks in
    /// block-list order, the sink rows it holds, the residual-window rows that hold tokens
    /// (keys, then values), then the value-window rows of its last positions, oldest first. Two caches that stored the same tokens the same way return the same
    /// bytes, whichever blocks they were given: tests compare backends with it.
    pub fn stored_bytes(&self, layer: usize, seq: usize) -> Result<Vec<u8>> {
        self.check_layer_seq(layer, seq)?;
        let layout = self.paged.layout();
        let (h, row) = (self.config.kv_heads, self.config.head_dim * 2);
        let (sinks, g) = (self.config.scheme.sinks, self.config.scheme.group_tokens);
        let s = &self.layers[layer].seqs[seq];
        let (cache, state) = self.host_layer(layer, seq)?;
        let mut out = Vec::new();
        for &block in &s.blocks {
            out.extend_from_slice(
                &cache[block as usize * layout.block_bytes()..][..layout.block_bytes()],
            );
        }
        let held = s.len.min(sinks);
        for stream in [Stream::K, Stream::V] {
            let at = layout.sinks_offset(stream);
            for head in 0..h {
                out.extend_from_slice(&state[at + head * sinks * row..][..held * row]);
            }
        }
        // The open block's rows past the sinks wait in the residual windows.
        let open = s.len % g;
        let first = sinks.saturating_sub(s.len - open).min(open);
        for stream in [Stream::K, Stream::V] {
            if !layout
                .head_layout()
                .stream(stream)
                .format
                .is_grouped_by_tokens()
            {
                continue;
            }
            let at = layout.residual_offset(stream);
            for head in 0..h {
                out.extend_from_slice(
                    &state[at + (head * g + first) * row..][..(open - first) * row],
                );
            }
        }
        let window = self.config.scheme.value_window;
        if window > 0 {
            // The window's rows of the blocks holding the last R positions.
            let first = (s.len.saturating_sub(window) / g * g).max(sinks);
            for head in 0..h {
                for pos in first..s.len {
                    out.extend_from_slice(&state[layout.window_row_offset(head, pos)..][..row]);
                }
            }
        }
        Ok(out)
    }
}

/// The host-side shape of one attention batch.
struct QueryShape {
    tokens: usize,
    max_q_len: usize,
    max_seq_len: usize,
    widest: usize,
    scale: f32,
}

/// Plain numbers a call stages, as bytes.
trait AsBytes {
    fn bytes(&self) -> &[u8];
}

impl<T: crate::hip::DeviceCopy> AsBytes for Vec<T> {
    fn bytes(&self) -> &[u8] {
        crate::backend::device::as_bytes(self)
    }
}

fn guard_len(guard: &Option<DeviceMemory>) -> usize {
    guard.as_ref().map_or(0, DeviceMemory::bytes)
}

/// Rejects NaN, ±Inf and values beyond the f16 range, naming the first one.
fn check_finite(stream: Stream, x: &[f32], heads: usize, head_dim: usize) -> Result<()> {
    let max = f32::from(half::f16::MAX);
    match x.iter().position(|v| !v.is_finite() || v.abs() > max) {
        None => Ok(()),
        Some(i) => Err(Error::NonFinite {
            stream,
            token: i / (heads * head_dim),
            head: i / head_dim % heads,
            channel: i % head_dim,
            value: x[i],
        }),
    }
}

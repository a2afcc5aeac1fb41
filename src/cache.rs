//! The KV cache: pages of quantized K and V, f16 sinks and residual windows, sparse outlier
//! stores; append new tokens, attend over the stored ones.
//!
//! Positions `[0, sinks)` of a sequence live in its f16 sink buffer. Position `p ≥ sinks` lives in
//! page `(p - sinks) / G`, slot `(p - sinks) % G`, where the page id comes from the sequence's block
//! table. Per-token formats are quantized as tokens arrive; a per-channel format keeps the tokens
//! of the open page in an f16 residual window and quantizes them together when the page fills.

use half::f16;

use crate::backend::device::{DeviceStore, Gpu, SeqBytes};
use crate::backend::{Backend, cpu};
use crate::error::{Error, Result};
use crate::hip::Device;
use crate::quant::{self, OutlierThresholds, put_f16};
use crate::rope::{Rope, RopeTable};
use crate::scheme::{
    Format, HeadLayout, OUTLIER_COUNT_BYTES, OUTLIER_SLOT_BYTES, Scheme, Stream, StreamLayout,
};

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

    fn validate(&self) -> Result<()> {
        let positive = [
            ("layers", self.layers),
            ("sequences", self.sequences),
            ("kv_heads", self.kv_heads),
            ("q_heads", self.q_heads),
            ("capacity", self.capacity),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, n)| *n == 0) {
            return Err(Error::Unsupported(format!("{what} must be positive")));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Unsupported(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.q_heads, self.kv_heads
            )));
        }
        if self.capacity > u32::MAX as usize / 2 {
            return Err(Error::Unsupported(format!("capacity {}", self.capacity)));
        }
        self.scheme.validate(self.head_dim, self.rope.is_some())
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

/// Per-sequence state of one layer.
#[derive(Clone, Debug, Default)]
pub(crate) struct SeqState {
    pub(crate) len: usize,
    /// Page ids, one per started page.
    pub(crate) pages: Vec<u32>,
    /// `kv_heads × sinks × head_dim` f16 (little-endian bytes), for K and V.
    pub(crate) sinks: [Vec<u8>; 2],
    /// `kv_heads × G × head_dim` f16 of the open page, for each per-channel stream.
    pub(crate) residual: [Vec<u8>; 2],
}

/// Outlier thresholds of one layer.
#[derive(Clone, Debug)]
struct LayerOutliers {
    k: OutlierThresholds,
    v: Option<OutlierThresholds>,
}

/// One layer: its host metadata (free pages, sequences' lengths and block tables, outlier
/// thresholds) and, on the CPU backend, its bytes (pool, sinks, residual windows; empty when
/// the bytes live on a device).
#[derive(Clone, Debug)]
struct Layer {
    pool: Vec<u8>,
    free: Vec<u32>,
    seqs: Vec<SeqState>,
    outliers: Option<LayerOutliers>,
}

/// A quantized KV cache, in host memory (the CPU backend) or device memory (`Hip`, and `Emu`
/// which runs the device path on host memory).
#[derive(Debug)]
pub struct KvCache {
    config: CacheConfig,
    layout: HeadLayout,
    page_bytes: usize,
    seq_bytes: SeqBytes,
    layers: Vec<Layer>,
    rope: Option<RopeTable>,
    outliers_dropped: u64,
    backend: Backend,
    /// The bytes, when the backend is a device.
    device: Option<DeviceStore>,
}

fn stream_index(stream: Stream) -> usize {
    match stream {
        Stream::K => 0,
        Stream::V => 1,
    }
}

impl KvCache {
    /// Allocates a cache on the CPU: every page each sequence may need, sinks and residual
    /// windows.
    pub fn new(config: CacheConfig) -> Result<KvCache> {
        let mut cache = KvCache::metadata(config)?;
        for layer in &mut cache.layers {
            alloc_host_bytes(layer, cache.seq_bytes, cache.page_bytes)?;
        }
        Ok(cache)
    }

    /// Allocates a cache on `backend`: for `Hip` and `Emu`, in device memory (zeroed), with
    /// nothing of it in host memory but the block tables.
    pub fn with_backend(config: CacheConfig, backend: Backend) -> Result<KvCache> {
        if backend == Backend::Cpu {
            return KvCache::new(config);
        }
        let mut cache = KvCache::metadata(config)?;
        cache.device = Some(cache.new_store(backend)?);
        cache.backend = backend;
        Ok(cache)
    }

    /// A cache with its metadata and no bytes. Sinks beyond the capacity are clamped to it
    /// (every token is then a sink), so that every sink row of every head has its place.
    fn metadata(mut config: CacheConfig) -> Result<KvCache> {
        config.validate()?;
        config.scheme.sinks = config.scheme.sinks.min(config.capacity);
        let scheme = config.scheme;
        let d = config.head_dim;
        let layout = scheme.head_layout(d);
        let sinks = scheme.sinks.min(config.capacity);
        let pages_per_seq = (config.capacity - sinks).div_ceil(scheme.group_tokens);
        // The whole cache, counted in u128 first: a size no allocator can give is refused here
        // rather than wrapping around in the usize arithmetic below.
        let residual_rows = [scheme.k, scheme.v]
            .iter()
            .filter(|f| f.is_grouped_by_tokens() && pages_per_seq > 0)
            .count()
            * scheme.group_tokens;
        let total = [
            config.kv_heads,
            pages_per_seq * layout.bytes + (2 * sinks + residual_rows) * d * 2,
            config.sequences,
            config.layers,
        ]
        .iter()
        .try_fold(1u128, |acc, &x| acc.checked_mul(x as u128))
        .unwrap_or(u128::MAX);
        if total > isize::MAX as u128 {
            return Err(Error::OutOfMemory {
                bytes: total,
                backend: "any",
            });
        }
        let page_bytes = config.kv_heads * layout.bytes;
        let total_pages = pages_per_seq * config.sequences;
        let f16_block = |tokens: usize| config.kv_heads * tokens * d * 2;
        let residual = |f: Format| {
            if f.is_grouped_by_tokens() && pages_per_seq > 0 {
                f16_block(scheme.group_tokens)
            } else {
                0
            }
        };
        let seq_bytes = SeqBytes {
            pages: pages_per_seq,
            sinks: f16_block(sinks),
            residual: [residual(scheme.k), residual(scheme.v)],
        };

        let seq = SeqState {
            len: 0,
            pages: Vec::with_capacity(pages_per_seq),
            sinks: Default::default(),
            residual: Default::default(),
        };
        let layer = Layer {
            pool: Vec::new(),
            free: (0..total_pages as u32).rev().collect(),
            seqs: vec![seq; config.sequences],
            outliers: None,
        };
        Ok(KvCache {
            rope: config.rope.map(|r| RopeTable::new(r, d, config.capacity)),
            layers: vec![layer; config.layers],
            config,
            layout,
            page_bytes,
            seq_bytes,
            outliers_dropped: 0,
            backend: Backend::Cpu,
            device: None,
        })
    }

    /// An empty device store for this cache on `backend`, with the outlier thresholds set so
    /// far.
    fn new_store(&self, backend: Backend) -> Result<DeviceStore> {
        let gpu = Gpu::open(backend, self.config.head_dim)?;
        let mut store = DeviceStore::new(
            gpu,
            self.config,
            self.layout,
            self.page_bytes,
            self.seq_bytes,
            self.rope.as_ref(),
        )?;
        for (l, layer) in self.layers.iter().enumerate() {
            if let Some(o) = &layer.outliers {
                store.set_thresholds(l, 0, &o.k)?;
                if let Some(v) = &o.v {
                    store.set_thresholds(l, 1, v)?;
                }
            }
        }
        Ok(store)
    }

    /// Every layer with its bytes in host memory: a copy of the CPU cache's, or downloaded from
    /// the device.
    fn host_layers(&self) -> Result<Vec<Layer>> {
        let Some(store) = &self.device else {
            return Ok(self.layers.clone());
        };
        let mut layers = self.layers.clone();
        for (l, layer) in layers.iter_mut().enumerate() {
            alloc_host_bytes(layer, self.seq_bytes, self.page_bytes)?;
            store.download_layer(l, &mut layer.pool, &mut layer.seqs)?;
        }
        Ok(layers)
    }

    /// A copy of this cache on the CPU backend, its bytes downloaded from the device.
    fn host_copy(&self) -> Result<KvCache> {
        Ok(KvCache {
            config: self.config,
            layout: self.layout,
            page_bytes: self.page_bytes,
            seq_bytes: self.seq_bytes,
            layers: self.host_layers()?,
            rope: self.rope.clone(),
            outliers_dropped: self.outliers_dropped,
            backend: Backend::Cpu,
            device: None,
        })
    }

    /// The configuration, with `scheme.sinks` clamped to `capacity`.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Layout of one head's block in a page.
    pub fn head_layout(&self) -> &HeadLayout {
        &self.layout
    }

    /// Tokens stored for `seq` in `layer`.
    pub fn len(&self, layer: usize, seq: usize) -> Result<usize> {
        self.check_layer_seq(layer, seq)?;
        Ok(self.layers[layer].seqs[seq].len)
    }

    /// Bytes the cache allocated for K and V storage (pages, sinks, residual windows), in host
    /// or device memory.
    pub fn allocated_bytes(&self) -> usize {
        if let Some(store) = &self.device {
            return store.allocated_bytes();
        }
        self.layers
            .iter()
            .map(|l| {
                l.pool.len()
                    + l.seqs
                        .iter()
                        .flat_map(|s| s.sinks.iter().chain(&s.residual))
                        .map(Vec::len)
                        .sum::<usize>()
            })
            .sum()
    }

    /// Outliers that did not fit their token's slots and were clipped instead.
    pub fn outliers_dropped(&self) -> u64 {
        self.outliers_dropped
    }

    /// Bytes one attention step over `seq` in `layer` reads: every page it touches (all of them
    /// but the open one are full), sinks and residual windows.
    pub fn bytes_read(&self, layer: usize, seq: usize) -> Result<usize> {
        let len = self.len(layer, seq)?;
        let s = &self.config.scheme;
        let h = self.config.kv_heads;
        let f16_row = self.config.head_dim * 2;
        let sinks = len.min(s.sinks);
        let rest = len - sinks;
        let full = rest / s.group_tokens;
        let open = rest % s.group_tokens;
        let mut bytes = 2 * sinks * f16_row * h + full * self.page_bytes;
        if open > 0 {
            for stream in [Stream::K, Stream::V] {
                let l = self.layout.stream(stream);
                bytes += h * if l.format.is_grouped_by_tokens() {
                    open * f16_row
                } else {
                    (l.end - l.rows) * open / s.group_tokens
                };
            }
        }
        Ok(bytes)
    }

    /// Sets the outlier thresholds of a layer (`v` only when the scheme stores value outliers).
    pub fn set_outlier_thresholds(
        &mut self,
        layer: usize,
        k: OutlierThresholds,
        v: Option<OutlierThresholds>,
    ) -> Result<()> {
        self.check_layer_seq(layer, 0)?;
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        let Some(o) = self.config.scheme.outliers else {
            return Err(Error::Unsupported(format!(
                "scheme {} has no outlier store",
                self.config.scheme
            )));
        };
        for t in std::iter::once(&k).chain(&v) {
            if (t.heads, t.head_dim, t.lo.len(), t.hi.len()) != (h, d, h * d, h * d) {
                return Err(Error::Shape {
                    what: "outlier thresholds (heads × head_dim, lo and hi)",
                    expected: h * d,
                    got: t.lo.len().min(t.hi.len()),
                });
            }
            // A NaN or inverted range would make clipping meaningless (and panic mid-append).
            if let Some(i) = (0..h * d).find(|&i| {
                let (lo, hi) = (t.lo[i], t.hi[i]);
                !(lo.is_finite() && hi.is_finite() && lo <= hi)
            }) {
                return Err(Error::InvalidOutlierThresholds {
                    head: i / d,
                    channel: i % d,
                    lo: t.lo[i],
                    hi: t.hi[i],
                });
            }
        }
        if o.values != v.is_some() {
            return Err(Error::Unsupported(format!(
                "scheme {} {} value thresholds",
                self.config.scheme,
                if o.values { "needs" } else { "takes no" }
            )));
        }
        if let Some(store) = &mut self.device {
            store.set_thresholds(layer, 0, &k)?;
            if let Some(v) = &v {
                store.set_thresholds(layer, 1, v)?;
            }
        }
        self.layers[layer].outliers = Some(LayerOutliers { k, v });
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
        check_finite(Stream::V, v, h, d)?;
        let kt = OutlierThresholds::calibrate(&k, h, d, o.fraction)?;
        let vt = if o.values {
            Some(OutlierThresholds::calibrate(v, h, d, o.fraction)?)
        } else {
            None
        };
        self.set_outlier_thresholds(layer, kt, vt)
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

    /// Empties a sequence in every layer and returns its pages to the pool.
    pub fn clear(&mut self, seq: usize) -> Result<()> {
        self.check_layer_seq(0, seq)?;
        for layer in &mut self.layers {
            let s = &mut layer.seqs[seq];
            s.len = 0;
            layer.free.extend(s.pages.drain(..).rev());
        }
        Ok(())
    }

    /// Appends tokens to a sequence of a layer. `k` and `v` are `n × kv_heads × head_dim`
    /// (unrotated when the cache applies RoPE). Values are rounded to f16 first. On any error
    /// nothing is written.
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
        if cfg.scheme.outliers.is_some() && self.layers[layer].outliers.is_none() {
            return Err(Error::OutliersNotCalibrated { layer });
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
        match self.backend {
            Backend::Cpu => {
                let (k, v) = (quant::round_f16_slice(&k), quant::round_f16_slice(v));
                for t in 0..n {
                    let row = t * width..(t + 1) * width;
                    self.append_token(layer, seq, &k[row.clone()], &v[row]);
                }
                Ok(())
            }
            Backend::Emu | Backend::Hip => {
                self.append_device(layer, seq, &quant::f16_bits(&k), &quant::f16_bits(v))
            }
        }
    }

    /// Stores validated tokens (f16 bits, `n × kv_heads × head_dim` per stream) with the
    /// append kernels on the device. On an error the sequence is left as it was: the kernels
    /// write only past its end, and the pages taken for the new tokens go back to the pool.
    fn append_device(&mut self, layer: usize, seq: usize, k: &[u16], v: &[u16]) -> Result<()> {
        let n = k.len() / (self.config.kv_heads * self.config.head_dim);
        let (sinks, g) = (self.config.scheme.sinks, self.config.scheme.group_tokens);
        let store = self.device.as_ref().expect("a device backend has a store");
        let Layer { free, seqs, .. } = &mut self.layers[layer];
        let s = &mut seqs[seq];
        let first_pos = s.len;
        let pages_before = s.pages.len();
        for pos in first_pos..first_pos + n {
            if pos >= sinks && (pos - sinks).is_multiple_of(g) {
                let page = free
                    .pop()
                    .expect("pool sized for every sequence's capacity");
                s.pages.push(page);
            }
        }
        match store.append(layer, seq, s, pages_before, k, v) {
            Ok(dropped) => {
                s.len += n;
                self.outliers_dropped += dropped;
                Ok(())
            }
            Err(e) => {
                let taken: Vec<u32> = s.pages.drain(pages_before..).collect();
                free.extend(taken.into_iter().rev());
                Err(e)
            }
        }
    }

    /// Stores one validated, f16-rounded token (`kv_heads × head_dim` per stream).
    fn append_token(&mut self, layer: usize, seq: usize, k: &[f32], v: &[f32]) {
        let cfg = self.config;
        let scheme = cfg.scheme;
        let (d, g) = (cfg.head_dim, scheme.group_tokens);
        let layout = self.layout;
        let page_bytes = self.page_bytes;
        let lay = &mut self.layers[layer];
        let s = &mut lay.seqs[seq];
        let pos = s.len;
        s.len += 1;
        if pos < scheme.sinks {
            for (stream, x) in [(Stream::K, k), (Stream::V, v)] {
                let buf = &mut s.sinks[stream_index(stream)];
                for (h, head) in x.chunks_exact(d).enumerate() {
                    write_f16_row(buf, (h * scheme.sinks + pos) * d, head);
                }
            }
            return;
        }
        let slot = (pos - scheme.sinks) % g;
        if slot == 0 {
            let page = lay
                .free
                .pop()
                .expect("pool sized for every sequence's capacity");
            s.pages.push(page);
        }
        let page = *s.pages.last().unwrap() as usize;
        let page_data = &mut lay.pool[page * page_bytes..(page + 1) * page_bytes];
        for (stream, x) in [(Stream::K, k), (Stream::V, v)] {
            let sl = layout.stream(stream);
            let thresholds = lay.outliers.as_ref().and_then(|o| match stream {
                Stream::K => Some(&o.k),
                Stream::V => o.v.as_ref(),
            });
            if sl.format.is_grouped_by_tokens() {
                let resid = &mut s.residual[stream_index(stream)];
                for (h, head) in x.chunks_exact(d).enumerate() {
                    write_f16_row(resid, (h * g + slot) * d, head);
                }
                if slot + 1 == g {
                    for h in 0..cfg.kv_heads {
                        let mut group: Vec<f32> = (0..g * d)
                            .map(|i| quant::get_f16(resid, ((h * g) * d + i) * 2))
                            .collect();
                        let block = &mut page_data[h * layout.bytes..(h + 1) * layout.bytes];
                        for t in 0..g {
                            self.outliers_dropped += store_outliers(
                                block,
                                sl,
                                t,
                                &mut group[t * d..(t + 1) * d],
                                thresholds.map(|th| th.head(h)),
                            );
                        }
                        let Format::Chan { bits } = sl.format else {
                            unreachable!()
                        };
                        let (rows, params) = block.split_at_mut(sl.params);
                        quant::quantize_chan(
                            bits,
                            &group,
                            d,
                            &mut rows[sl.rows..sl.rows + g * sl.row_bytes],
                            &mut params[..d * 4],
                        );
                    }
                }
            } else {
                let pb = sl.format.params_bytes(1, d);
                for (h, head) in x.chunks_exact(d).enumerate() {
                    let block = &mut page_data[h * layout.bytes..(h + 1) * layout.bytes];
                    let mut row = head.to_vec();
                    self.outliers_dropped +=
                        store_outliers(block, sl, slot, &mut row, thresholds.map(|th| th.head(h)));
                    let (rows, params) = block.split_at_mut(sl.params);
                    quant::quantize_row(
                        sl.format,
                        &row,
                        &mut rows[sl.rows + slot * sl.row_bytes..][..sl.row_bytes],
                        &mut params[slot * pb..(slot + 1) * pb],
                    );
                }
            }
        }
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
    /// before the attention kernel to just after the combine kernel (device events on a GPU,
    /// the wall clock of the emulated launches on `Emu`), without the query upload and output
    /// download. `None` on the CPU backend, where the call itself is the work.
    pub fn attend_many_timed(
        &self,
        layer: usize,
        queries: &mut [Query<'_>],
        softmax_scale: f32,
    ) -> Result<Option<f64>> {
        self.attend_inner(layer, queries, softmax_scale, true)
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
        let lay = &self.layers[layer];
        match &self.device {
            None => {
                let seqs: Vec<&SeqState> = queries.iter().map(|q| &lay.seqs[q.seq]).collect();
                cpu::attend(&self.view(layer), &seqs, queries, softmax_scale);
                Ok(None)
            }
            Some(store) => {
                let seqs: Vec<(usize, &SeqState)> =
                    queries.iter().map(|q| (q.seq, &lay.seqs[q.seq])).collect();
                store.attend(
                    layer,
                    self.rope.as_ref(),
                    &seqs,
                    queries,
                    softmax_scale,
                    timed,
                )
            }
        }
    }

    /// Moves the cache to `backend`: its bytes are copied to the device (or back) and appends
    /// and attention run there from now on. On an error (no such device, out of memory) the
    /// cache stays where it was.
    pub fn set_backend(&mut self, backend: Backend) -> Result<()> {
        if backend == self.backend {
            return Ok(());
        }
        let mut layers = self.host_layers()?;
        let store = match backend {
            Backend::Cpu => None,
            _ => {
                let store = self.new_store(backend)?;
                for (l, layer) in layers.iter_mut().enumerate() {
                    store.upload_layer(l, &layer.pool, &layer.seqs)?;
                    free_host_bytes(layer);
                }
                Some(store)
            }
        };
        self.layers = layers;
        self.device = store;
        self.backend = backend;
        Ok(())
    }

    /// The GPU the cache lives on (`Backend::Hip`).
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref().and_then(DeviceStore::device)
    }

    /// The backend attention runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The attention backend's read-only view of one layer.
    fn view(&self, layer: usize) -> cpu::CacheView<'_> {
        cpu::CacheView {
            config: &self.config,
            layout: &self.layout,
            page_bytes: self.page_bytes,
            pool: &self.layers[layer].pool,
            rope: self.rope.as_ref(),
        }
    }

    /// Dequantizes everything stored for `seq` in `layer`: `(k, v)`, each
    /// `len × kv_heads × head_dim`, keys as attention sees them (rotated). Meant for tests and
    /// measurements; attention itself never makes this copy.
    pub fn read_back(&self, layer: usize, seq: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_layer_seq(layer, seq)?;
        if self.device.is_some() {
            return self.host_copy()?.read_back(layer, seq);
        }
        let cfg = &self.config;
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let lay = &self.layers[layer];
        let s = &lay.seqs[seq];
        let view = self.view(layer);
        let mut k = vec![0f32; s.len * h * d];
        let mut v = vec![0f32; s.len * h * d];
        for head in 0..h {
            for block in view.blocks(s, head, 0..usize::MAX) {
                for t in 0..block.tokens {
                    let pos = block.first_pos + t;
                    let at = (pos * h + head) * d;
                    block.k.dequantize(t, &mut k[at..at + d]);
                    block.v.dequantize(t, &mut v[at..at + d]);
                    if let (Some(rope), true) = (self.rope.as_ref(), cfg.scheme.pre_rope) {
                        rope.rotate(&mut k[at..at + d], pos);
                    }
                }
            }
        }
        Ok((k, v))
    }

    /// Everything stored for `seq` in `layer`, as bytes in a canonical order: its pages in
    /// block-table order, the sink rows it holds, then the residual-window rows that hold
    /// tokens (keys, then values). Two caches that stored the same tokens the same way return
    /// the same bytes, whichever pages they were given: tests compare backends with it.
    pub fn stored_bytes(&self, layer: usize, seq: usize) -> Result<Vec<u8>> {
        self.check_layer_seq(layer, seq)?;
        if self.device.is_some() {
            return self.host_copy()?.stored_bytes(layer, seq);
        }
        let (h, row) = (self.config.kv_heads, self.config.head_dim * 2);
        let (sinks, g) = (self.config.scheme.sinks, self.config.scheme.group_tokens);
        let lay = &self.layers[layer];
        let s = &lay.seqs[seq];
        let mut out = Vec::new();
        for &page in &s.pages {
            out.extend_from_slice(&lay.pool[page as usize * self.page_bytes..][..self.page_bytes]);
        }
        let held = s.len.min(sinks);
        for buf in &s.sinks {
            for head in 0..h {
                out.extend_from_slice(&buf[head * sinks * row..][..held * row]);
            }
        }
        let open = s.len.saturating_sub(sinks) % g;
        for buf in s.residual.iter().filter(|b| !b.is_empty()) {
            for head in 0..h {
                out.extend_from_slice(&buf[head * g * row..][..open * row]);
            }
        }
        Ok(out)
    }
}

/// Gives a layer's metadata its host bytes, zeroed: the pool and each sequence's sinks and
/// residual windows.
fn alloc_host_bytes(layer: &mut Layer, sizes: SeqBytes, page_bytes: usize) -> Result<()> {
    layer.pool = zeroed_bytes(sizes.pages * layer.seqs.len() * page_bytes)?;
    for s in &mut layer.seqs {
        s.sinks = [zeroed_bytes(sizes.sinks)?, zeroed_bytes(sizes.sinks)?];
        s.residual = [
            zeroed_bytes(sizes.residual[0])?,
            zeroed_bytes(sizes.residual[1])?,
        ];
    }
    Ok(())
}

/// `n` zeroed bytes, or [`Error::OutOfMemory`] where `vec![0; n]` would abort the process.
fn zeroed_bytes(n: usize) -> Result<Vec<u8>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let oom = Error::OutOfMemory {
        bytes: n as u128,
        backend: "cpu",
    };
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom.clone())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom);
    }
    // SAFETY: `ptr` is a global-allocator allocation of exactly `n` bytes with u8's layout,
    // all initialized (zeroed); the Vec takes ownership of it.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Drops a layer's host bytes, keeping its metadata.
fn free_host_bytes(layer: &mut Layer) {
    layer.pool = Vec::new();
    for s in &mut layer.seqs {
        s.sinks = Default::default();
        s.residual = Default::default();
    }
}

fn write_f16_row(buf: &mut [u8], elem: usize, x: &[f32]) {
    for (j, &v) in x.iter().enumerate() {
        put_f16(buf, (elem + j) * 2, f16::from_f32(v));
    }
}

/// Rejects NaN, ±Inf and values beyond the f16 range, naming the first one.
fn check_finite(stream: Stream, x: &[f32], heads: usize, head_dim: usize) -> Result<()> {
    match x
        .iter()
        .position(|v| !v.is_finite() || v.abs() > f32::from(f16::MAX))
    {
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

/// Moves the outliers of `row` (token `slot` of a head block) into the sparse store, clipping
/// them in `row`. Returns how many were dropped for lack of slots.
fn store_outliers(
    block: &mut [u8],
    sl: &StreamLayout,
    slot: usize,
    row: &mut [f32],
    thresholds: Option<(&[f32], &[f32])>,
) -> u64 {
    let Some((lo, hi)) = thresholds else {
        return 0;
    };
    let (kept, dropped) = quant::split_outliers(row, lo, hi, sl.outlier_slots);
    let count_at = sl.counts + slot * OUTLIER_COUNT_BYTES;
    block[count_at..count_at + 2].copy_from_slice(&(kept.len() as u16).to_le_bytes());
    for (i, o) in kept.iter().enumerate() {
        let at = sl.slots + (slot * sl.outlier_slots + i) * OUTLIER_SLOT_BYTES;
        block[at..at + 2].copy_from_slice(&o.channel.to_le_bytes());
        put_f16(block, at + 2, f16::from_f32(o.value));
    }
    dropped as u64
}

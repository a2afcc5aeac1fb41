//! CPU decode attention: split-K over (query, KV head, page range) work items on all cores,
//! dequantization inside the loop one token row at a time, online softmax in base 2 with f32
//! state, and a combine step, the same algorithm the GPU kernels run.

use std::ops::Range;

use rayon::prelude::*;

use crate::cache::{CacheConfig, Query, SeqState};
use crate::quant::{self, get_f16};
use crate::rope::RopeTable;
use crate::scheme::{
    Format, HeadLayout, OUTLIER_COUNT_BYTES, OUTLIER_SLOT_BYTES, Q8_0_BLOCK, Q8_0_BLOCK_BYTES,
};

use super::simd::{Kernel, KernelFn, dispatch};

/// Read-only view of one layer of a cache.
pub(crate) struct CacheView<'a> {
    pub(crate) config: &'a CacheConfig,
    pub(crate) layout: &'a HeadLayout,
    pub(crate) page_bytes: usize,
    pub(crate) pool: &'a [u8],
    pub(crate) rope: Option<&'a RopeTable>,
}

/// One stream (K or V) of a run of consecutive tokens of one head, in one storage format.
#[derive(Clone, Copy)]
pub(crate) struct StreamBlock<'a> {
    format: Format,
    head_dim: usize,
    /// Packed rows, starting at the block's first token.
    rows: &'a [u8],
    row_bytes: usize,
    /// Quantization parameters of the block's tokens (per-token formats: starting at the first
    /// token; per-channel: the page's pairs).
    params: &'a [u8],
    /// Outlier counts and slots, when the stream has an outlier store.
    outliers: Option<(&'a [u8], &'a [u8], usize)>,
}

impl<'a> StreamBlock<'a> {
    fn f16_rows(rows: &'a [u8], head_dim: usize) -> Self {
        StreamBlock {
            format: Format::F16,
            head_dim,
            rows,
            row_bytes: head_dim * 2,
            params: &[],
            outliers: None,
        }
    }

    fn row(&self, t: usize) -> &'a [u8] {
        &self.rows[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    fn token_params(&self, t: usize) -> &'a [u8] {
        let n = self.format.params_bytes(1, self.head_dim);
        &self.params[t * n..(t + 1) * n]
    }

    /// The outliers of token `t`: `(channel, exact value)`.
    fn outliers(&self, t: usize) -> impl Iterator<Item = (usize, f32)> + 'a {
        let (counts, slots, cap) = self.outliers.unwrap_or((&[], &[], 0));
        let n = if cap == 0 {
            0
        } else {
            let at = t * OUTLIER_COUNT_BYTES;
            u16::from_le_bytes([counts[at], counts[at + 1]]) as usize
        };
        (0..n).map(move |i| {
            let at = (t * cap + i) * OUTLIER_SLOT_BYTES;
            (
                u16::from_le_bytes([slots[at], slots[at + 1]]) as usize,
                get_f16(slots, at + 2),
            )
        })
    }

    /// Reference dequantization of token `t` (dense part, then the exact outliers).
    pub(crate) fn dequantize(&self, t: usize, out: &mut [f32]) {
        match self.format {
            Format::Chan { bits } => {
                quant::dequantize_chan_row(bits, self.row(t), self.params, out)
            }
            f => quant::dequantize_row(f, self.row(t), self.token_params(t), out),
        }
        for (c, x) in self.outliers(t) {
            out[c] = x;
        }
    }
}

/// Consecutive tokens of one head stored alike: the sinks, or one page.
pub(crate) struct Block<'a> {
    pub(crate) first_pos: usize,
    pub(crate) tokens: usize,
    pub(crate) k: StreamBlock<'a>,
    pub(crate) v: StreamBlock<'a>,
}

impl<'a> CacheView<'a> {
    /// Pages a sequence of `len` tokens has started.
    fn pages(&self, len: usize) -> usize {
        let s = &self.config.scheme;
        len.saturating_sub(s.sinks).div_ceil(s.group_tokens)
    }

    /// The blocks of `head` in the given page range; the sinks come with the range that starts
    /// at page 0.
    pub(crate) fn blocks(
        &self,
        seq: &'a SeqState,
        head: usize,
        pages: Range<usize>,
    ) -> Vec<Block<'a>> {
        let s = &self.config.scheme;
        let d = self.config.head_dim;
        let g = s.group_tokens;
        let row = d * 2;
        let mut out = Vec::new();
        let sinks = seq.len.min(s.sinks);
        if pages.start == 0 && sinks > 0 {
            let at = head * s.sinks * row;
            out.push(Block {
                first_pos: 0,
                tokens: sinks,
                k: StreamBlock::f16_rows(&seq.sinks[0][at..at + sinks * row], d),
                v: StreamBlock::f16_rows(&seq.sinks[1][at..at + sinks * row], d),
            });
        }
        for p in pages.start..pages.end.min(self.pages(seq.len)) {
            let first_pos = s.sinks + p * g;
            let tokens = (seq.len - first_pos).min(g);
            let page = seq.pages[p] as usize;
            let block = &self.pool[page * self.page_bytes + head * self.layout.bytes..]
                [..self.layout.bytes];
            let stream = |i: usize, sl: &crate::scheme::StreamLayout| {
                if sl.format.is_grouped_by_tokens() && tokens < g {
                    let at = head * g * row;
                    return StreamBlock::f16_rows(&seq.residual[i][at..at + tokens * row], d);
                }
                StreamBlock {
                    format: sl.format,
                    head_dim: d,
                    rows: &block[sl.rows..sl.rows + tokens * sl.row_bytes],
                    row_bytes: sl.row_bytes,
                    params: &block[sl.params..sl.counts],
                    outliers: (sl.outlier_slots > 0).then(|| {
                        (
                            &block[sl.counts..sl.slots],
                            &block[sl.slots..sl.end],
                            sl.outlier_slots,
                        )
                    }),
                }
            };
            out.push(Block {
                first_pos,
                tokens,
                k: stream(0, &self.layout.k),
                v: stream(1, &self.layout.v),
            });
        }
        out
    }
}

/// Softmax state and output accumulator of every query row of one work item.
struct Partial {
    /// Running maximum of the base-2 logits, per row.
    max: Vec<f32>,
    /// Running sum of `exp2(logit - max)`, per row.
    sum: Vec<f32>,
    /// `rows × head_dim`.
    acc: Vec<f32>,
}

/// The query rows of one (query, KV head): every query head of the GQA group at every chunk
/// position, pre-rotated and pre-scaled by `softmax_scale · log2(e)`.
struct HeadQueries {
    rows: Vec<f32>,
    /// Position of each row's token: it attends to positions `≤` this.
    pos: Vec<usize>,
}

/// Work item: one (query, KV head, page range).
struct Item {
    query: usize,
    head: usize,
    pages: Range<usize>,
}

/// Attends each query's chunk over its sequence and writes `Query::out`.
pub(crate) fn attend(
    view: &CacheView<'_>,
    seqs: &[&SeqState],
    queries: &mut [Query<'_>],
    scale: f32,
) {
    let cfg = view.config;
    let (d, r) = (cfg.head_dim, cfg.gqa());
    let width = cfg.q_heads * d;
    let prepared: Vec<Vec<HeadQueries>> = queries
        .iter()
        .zip(seqs)
        .map(|(query, seq)| {
            let q_len = query.q.len() / width;
            (0..cfg.kv_heads)
                .map(|h| {
                    let mut rows = Vec::with_capacity(q_len * r * d);
                    let mut pos = Vec::with_capacity(q_len * r);
                    for t in 0..q_len {
                        let p = seq.len - q_len + t;
                        for j in 0..r {
                            let at = t * width + (h * r + j) * d;
                            let mut row: Vec<f32> = query.q[at..at + d].to_vec();
                            if let Some(rope) = view.rope {
                                rope.rotate(&mut row, p);
                            }
                            rows.extend(row.iter().map(|x| x * scale * std::f32::consts::LOG2_E));
                            pos.push(p);
                        }
                    }
                    HeadQueries { rows, pos }
                })
                .collect()
        })
        .collect();

    let threads = rayon::current_num_threads();
    let items: Vec<Item> = seqs
        .iter()
        .enumerate()
        .flat_map(|(qi, seq)| {
            let pages = view.pages(seq.len);
            let want = (4 * threads).div_ceil(seqs.len() * cfg.kv_heads);
            let splits = want.min(pages / 4).max(1);
            let per = pages.div_ceil(splits).max(1);
            (0..cfg.kv_heads).flat_map(move |head| {
                (0..splits).map(move |s| Item {
                    query: qi,
                    head,
                    pages: s * per..((s + 1) * per).min(pages.max(1)),
                })
            })
        })
        .collect();

    let partials: Vec<Partial> = items
        .par_iter()
        .map(|item| {
            let hq = &prepared[item.query][item.head];
            let blocks = view.blocks(seqs[item.query], item.head, item.pages.clone());
            dispatch(RunItem {
                view,
                blocks: &blocks,
                hq,
            })
        })
        .collect();

    // Combine the splits of each (query, head) and scatter rows back to the query layout.
    let mut next = 0;
    for (qi, (query, heads)) in queries.iter_mut().zip(&prepared).enumerate() {
        for (h, hq) in heads.iter().enumerate() {
            let group: Vec<&Partial> = items[next..]
                .iter()
                .zip(&partials[next..])
                .take_while(|(it, _)| it.query == qi && it.head == h)
                .map(|(_, p)| p)
                .collect();
            next += group.len();
            for row in 0..hq.pos.len() {
                let (t, j) = (row / r, row % r);
                let out = &mut query.out[t * width + (h * r + j) * d..][..d];
                combine(&group, row, d, out);
            }
        }
    }
}

/// Merges the split partials of one row: `Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s`.
fn combine(parts: &[&Partial], row: usize, d: usize, out: &mut [f32]) {
    let m = parts
        .iter()
        .map(|p| p.max[row])
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut sum = 0.0;
    for p in parts {
        if p.sum[row] == 0.0 {
            continue;
        }
        let w = (p.max[row] - m).exp2();
        sum += w * p.sum[row];
        for (o, a) in out.iter_mut().zip(&p.acc[row * d..(row + 1) * d]) {
            *o += w * a;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

struct RunItem<'v, 'a> {
    view: &'v CacheView<'a>,
    blocks: &'v [Block<'a>],
    hq: &'v HeadQueries,
}

impl KernelFn<Partial> for RunItem<'_, '_> {
    #[inline(always)]
    fn call<K: Kernel>(self, k: K) -> Partial {
        run_item(k, self.view, self.blocks, self.hq)
    }
}

/// One work item: online softmax over the blocks for every query row of the head.
#[inline(always)]
fn run_item<K: Kernel>(
    k: K,
    view: &CacheView<'_>,
    blocks: &[Block<'_>],
    hq: &HeadQueries,
) -> Partial {
    let d = view.config.head_dim;
    let rows = hq.pos.len();
    let pre_rope = view.config.scheme.pre_rope;
    let mut part = Partial {
        max: vec![f32::NEG_INFINITY; rows],
        sum: vec![0.0; rows],
        acc: vec![0.0; rows * d],
    };
    let g = view
        .config
        .scheme
        .group_tokens
        .max(view.config.scheme.sinks);
    let mut scores = vec![0f32; rows * g];
    let mut row_buf = vec![0f32; d];
    let mut decoder = Decoder::new(d);
    for block in blocks {
        let n = block.tokens;
        // Scores of every row against every token of the block.
        decoder.begin(&block.k);
        for t in 0..n {
            decoder.decode(k, &block.k, t, &mut row_buf);
            let pos = block.first_pos + t;
            if pre_rope {
                view.rope
                    .expect("pre_rope needs RoPE")
                    .rotate(&mut row_buf, pos);
            }
            for r in 0..rows {
                scores[r * g + t] = if pos <= hq.pos[r] {
                    k.dot(&hq.rows[r * d..(r + 1) * d], &row_buf)
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        // Online softmax: rescale each row once per block, then turn scores into weights.
        for r in 0..rows {
            let s = &mut scores[r * g..r * g + n];
            let block_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if block_max == f32::NEG_INFINITY {
                s.fill(0.0);
                continue;
            }
            let m = part.max[r].max(block_max);
            let alpha = (part.max[r] - m).exp2();
            part.max[r] = m;
            if alpha != 1.0 {
                part.sum[r] *= alpha;
                part.acc[r * d..(r + 1) * d]
                    .iter_mut()
                    .for_each(|a| *a *= alpha);
            }
            let mut sum = 0.0;
            for x in s.iter_mut() {
                *x = (*x - m).exp2();
                sum += *x;
            }
            part.sum[r] += sum;
        }
        // Weighted values.
        decoder.begin(&block.v);
        for t in 0..n {
            decoder.decode(k, &block.v, t, &mut row_buf);
            for r in 0..rows {
                let p = scores[r * g + t];
                if p != 0.0 {
                    k.axpy(p, &row_buf, &mut part.acc[r * d..(r + 1) * d]);
                }
            }
        }
    }
    part
}

/// Turns stored rows into f32 rows; holds the per-block state of per-channel formats.
struct Decoder {
    /// Per-channel `(scale, min)` of the current block, for `Format::Chan`.
    chan_scale: Vec<f32>,
    chan_min: Vec<f32>,
}

impl Decoder {
    fn new(d: usize) -> Self {
        Decoder {
            chan_scale: vec![0.0; d],
            chan_min: vec![0.0; d],
        }
    }

    fn begin(&mut self, s: &StreamBlock<'_>) {
        if let Format::Chan { .. } = s.format {
            for c in 0..s.head_dim {
                self.chan_scale[c] = get_f16(s.params, 4 * c);
                self.chan_min[c] = get_f16(s.params, 4 * c + 2);
            }
        }
    }

    /// Dequantizes token `t` of `s` into `out`, outliers included.
    #[inline(always)]
    fn decode<K: Kernel>(&self, k: K, s: &StreamBlock<'_>, t: usize, out: &mut [f32]) {
        let row = s.row(t);
        match s.format {
            Format::F16 => k.f16_to_f32(row, out),
            Format::Q8 => {
                let scale = get_f16(s.params, 2 * t);
                k.i8_scaled(row, scale, out);
            }
            Format::Q8_0 => {
                for (b, o) in row
                    .chunks_exact(Q8_0_BLOCK_BYTES)
                    .zip(out.chunks_exact_mut(Q8_0_BLOCK))
                {
                    k.i8_scaled(&b[2..], get_f16(b, 0), o);
                }
            }
            Format::Tok { bits, group } => {
                let g = group.size(s.head_dim);
                let params = s.token_params(t);
                let per = bits.codes_per_byte();
                for (gi, o) in out.chunks_exact_mut(g).enumerate() {
                    let packed = &row[gi * g / per..(gi + 1) * g / per];
                    k.unpack_affine(
                        bits,
                        packed,
                        get_f16(params, 4 * gi),
                        get_f16(params, 4 * gi + 2),
                        o,
                    );
                }
            }
            Format::Chan { bits } => {
                k.unpack_affine(bits, row, 1.0, 0.0, out);
                for ((o, s), m) in out.iter_mut().zip(&self.chan_scale).zip(&self.chan_min) {
                    *o = k.fma(*o, *s, *m);
                }
            }
        }
        for (c, x) in s.outliers(t) {
            out[c] = x;
        }
    }
}

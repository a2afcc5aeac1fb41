//! CPU decode and chunked-prefill attention: split-K over (query, KV head, block range) work
//! items on all cores, dequantization into vector registers inside the score and value loops,
//! online softmax in base 2 with f32 state, and a combine step: the same algorithm the GPU
//! kernels run.

pub(crate) mod paged;

use std::ops::Range;

use rayon::prelude::*;

use crate::cache::Query;
use crate::paged::Layout;
use crate::quant::{self, get_f16};
use crate::rope::RopeTable;
use crate::scheme::{
    Format, LowBits, OUTLIER_COUNT_BYTES, OUTLIER_SLOT_BYTES, Q8_0_BLOCK, Q8_0_BLOCK_BYTES, Stream,
};

use super::simd::{Kernel, KernelFn, dispatch};

/// Read-only view of one layer of a paged cache.
pub(crate) struct CacheView<'a> {
    pub(crate) layout: &'a Layout,
    /// The layer's blocks: `num_blocks × block_bytes`.
    pub(crate) cache: &'a [u8],
    /// The RoPE table `pre_rope` keys are rotated with.
    pub(crate) rope: Option<&'a RopeTable>,
}

/// One sequence as attention reads it: its length, block table and this layer's slot state.
pub(crate) struct PagedSeq<'a> {
    pub(crate) len: usize,
    pub(crate) blocks: &'a [i32],
    pub(crate) state: &'a [u8],
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
    /// Blocks a sequence of `len` tokens has started.
    pub(crate) fn pages(&self, len: usize) -> usize {
        len.div_ceil(self.layout.block_tokens())
    }

    /// The runs of `head` in the given block range: rows of each block from the first position
    /// past the sinks; the sinks come with the range that starts at block 0.
    pub(crate) fn blocks(
        &self,
        seq: &PagedSeq<'a>,
        head: usize,
        pages: Range<usize>,
    ) -> Vec<Block<'a>> {
        let layout = self.layout;
        let s = layout.scheme();
        let d = layout.head_dim();
        let g = layout.block_tokens();
        let row = d * 2;
        let head_layout = layout.head_layout();
        let mut out = Vec::new();
        let sinks = seq.len.min(s.sinks);
        if pages.start == 0 && sinks > 0 {
            let rows = |stream| {
                let at = layout.sinks_offset(stream) + head * s.sinks * row;
                &seq.state[at..at + sinks * row]
            };
            out.push(Block {
                first_pos: 0,
                tokens: sinks,
                k: StreamBlock::f16_rows(rows(Stream::K), d),
                v: StreamBlock::f16_rows(rows(Stream::V), d),
            });
        }
        for p in pages.start..pages.end.min(self.pages(seq.len)) {
            let first_pos = p * g;
            let begin = s.sinks.saturating_sub(first_pos).min(g);
            let end = (seq.len - first_pos).min(g);
            if begin >= end {
                continue;
            }
            let id = seq.blocks[p] as usize;
            let block = &self.cache[id * layout.block_bytes() + head * head_layout.bytes..]
                [..head_layout.bytes];
            let stream = |kind: Stream| {
                let sl = head_layout.stream(kind);
                if sl.format.is_grouped_by_tokens() && end < g {
                    // The open block: its rows wait in the residual window.
                    let at = layout.residual_offset(kind) + (head * g + begin) * row;
                    return StreamBlock::f16_rows(&seq.state[at..at + (end - begin) * row], d);
                }
                let per_token = if sl.format.is_grouped_by_tokens() {
                    0
                } else {
                    sl.format.params_bytes(1, d)
                };
                StreamBlock {
                    format: sl.format,
                    head_dim: d,
                    rows: &block[sl.rows + begin * sl.row_bytes..sl.rows + end * sl.row_bytes],
                    row_bytes: sl.row_bytes,
                    params: &block[sl.params + begin * per_token..sl.counts],
                    outliers: (sl.outlier_slots > 0).then(|| {
                        (
                            &block[sl.counts + begin * OUTLIER_COUNT_BYTES..sl.slots],
                            &block
                                [sl.slots + begin * sl.outlier_slots * OUTLIER_SLOT_BYTES..sl.end],
                            sl.outlier_slots,
                        )
                    }),
                }
            };
            out.push(Block {
                first_pos: first_pos + begin,
                tokens: end - begin,
                k: stream(Stream::K),
                v: stream(Stream::V),
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
pub(crate) struct HeadQueries {
    pub(crate) rows: Vec<f32>,
    /// Position of each row's token: it attends to positions `≤` this.
    pub(crate) pos: Vec<usize>,
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
    seqs: &[PagedSeq<'_>],
    queries: &mut [Query<'_>],
    scale: f32,
) {
    let spec = view.layout.spec();
    let (d, r) = (spec.head_dim, view.layout.gqa());
    let kv_heads = spec.kv_heads;
    let width = spec.q_heads * d;
    let prepared = prepare_queries(view, seqs, queries, scale);

    let threads = rayon::current_num_threads();
    let items: Vec<Item> = seqs
        .iter()
        .enumerate()
        .flat_map(|(qi, seq)| {
            let pages = view.pages(seq.len);
            let want = (4 * threads).div_ceil(seqs.len() * kv_heads);
            let splits = want.min(pages / 4).max(1);
            let per = pages.div_ceil(splits).max(1);
            (0..kv_heads).flat_map(move |head| {
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
            let blocks = view.blocks(&seqs[item.query], item.head, item.pages.clone());
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

/// Every query's rows per KV head (already rotated), scaled by `softmax_scale · log2(e)`: what
/// the score loop takes, with the position each row attends up to.
fn prepare_queries(
    view: &CacheView<'_>,
    seqs: &[PagedSeq<'_>],
    queries: &[Query<'_>],
    scale: f32,
) -> Vec<Vec<HeadQueries>> {
    let spec = view.layout.spec();
    let (d, r) = (spec.head_dim, view.layout.gqa());
    let width = spec.q_heads * d;
    queries
        .iter()
        .zip(seqs)
        .map(|(query, seq)| {
            let q_len = query.q.len() / width;
            (0..spec.kv_heads)
                .map(|h| {
                    let mut rows = Vec::with_capacity(q_len * r * d);
                    let mut pos = Vec::with_capacity(q_len * r);
                    for t in 0..q_len {
                        let p = seq.len - q_len + t;
                        for j in 0..r {
                            let at = t * width + (h * r + j) * d;
                            rows.extend(
                                query.q[at..at + d]
                                    .iter()
                                    .map(|x| x * scale * std::f32::consts::LOG2_E),
                            );
                            pos.push(p);
                        }
                    }
                    HeadQueries { rows, pos }
                })
                .collect()
        })
        .collect()
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

/// Evaluates `$body` with `$d` (a validated head_dim) as the constant `$dc`, one copy per
/// entry of [`crate::scheme::HEAD_DIMS`]: the loops of a block are built once per head_dim, so
/// their channel loops have constant trip counts that the compiler unrolls and folds into
/// addresses.
macro_rules! with_head_dim {
    ($d:expr, |$dc:ident| $body:expr) => {{
        const _: () = assert!(matches!(crate::scheme::HEAD_DIMS, [64, 128, 256]));
        match $d {
            64 => {
                const $dc: usize = 64;
                $body
            }
            128 => {
                const $dc: usize = 128;
                $body
            }
            256 => {
                const $dc: usize = 256;
                $body
            }
            d => unreachable!("head_dim {d} passed CacheConfig's check against HEAD_DIMS"),
        }
    }};
}

struct RunItem<'v, 'a> {
    view: &'v CacheView<'a>,
    blocks: &'v [Block<'a>],
    hq: &'v HeadQueries,
}

impl KernelFn<Partial> for RunItem<'_, '_> {
    #[inline(always)]
    fn call<K: Kernel>(self, k: K) -> Partial {
        with_head_dim!(self.view.layout.head_dim(), |D| run_item(
            k,
            self.view,
            self.blocks,
            self.hq,
            D
        ))
    }
}

/// Binds `$rows` to the [`Rows`] decoder of stream block `$s` (its parameters converted into
/// `$buf`) and evaluates `$body`, monomorphized for each format.
macro_rules! with_rows {
    ($k:expr, $s:expr, $n:expr, $buf:ident, |$rows:ident| $body:expr) => {{
        let s: &StreamBlock<'_> = &$s;
        let d = s.head_dim;
        assert_eq!(s.row_bytes, s.format.row_bytes(d));
        s.params_f32($k, $n, &mut $buf);
        let packed = Packed::new(s.rows, s.row_bytes, $n);
        match s.format {
            Format::F16 => {
                let $rows = F16Rows { packed };
                $body
            }
            Format::Q8 => {
                assert!($buf.len() >= $n);
                let $rows = Q8Rows {
                    packed,
                    scales: &$buf,
                };
                $body
            }
            Format::Q8_0 => {
                let blocks = d / Q8_0_BLOCK;
                assert!($buf.len() >= $n * blocks);
                let $rows = Q80Rows {
                    packed,
                    scales: &$buf,
                    blocks,
                };
                $body
            }
            Format::Tok { bits, group } => {
                let group = group.size(d);
                let (groups, group_shift) = (d / group, group.trailing_zeros());
                assert!(group.is_power_of_two() && $buf.len() >= 2 * groups * $n);
                let params = &$buf;
                assert!(group >= 32 && d.is_multiple_of(32));
                match bits {
                    LowBits::Four => {
                        let $rows = TokRows::<4> {
                            codes: ChanCodes { packed },
                            params,
                            groups,
                            group_shift,
                        };
                        $body
                    }
                    LowBits::Two => {
                        let $rows = TokRows::<2> {
                            codes: ChanCodes { packed },
                            params,
                            groups,
                            group_shift,
                        };
                        $body
                    }
                }
            }
            Format::Chan { bits } => {
                let (scale, min) = $buf.split_at(d);
                assert!(min.len() == d && d.is_multiple_of(32));
                match bits {
                    LowBits::Four => {
                        let codes = ChanCodes::<4> { packed };
                        let $rows = ChanRows { codes, scale, min };
                        $body
                    }
                    LowBits::Two => {
                        let codes = ChanCodes::<2> { packed };
                        let $rows = ChanRows { codes, scale, min };
                        $body
                    }
                }
            }
        }
    }};
}

/// The order in which the attention loops see a stream's channels. A 4-bit or 2-bit code row
/// decodes 16 or 32 channels per 8-byte load only in an interleaved order, so the loops keep
/// the queries (keys) and the output accumulators (values) in the order of the stream's format
/// and put the accumulators back once per work item: dot products and per-channel sums do not
/// care about order. Every chunk of 16 or 32 channels stays in place, and so within one
/// quantization group (groups have at least 32 channels).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    /// Channel `c` at position `c`.
    Natural,
    /// 4-bit codes, 16 channels per 8 bytes: each chunk's even channels (the low nibbles),
    /// then its odd channels (the high nibbles).
    Nibbles,
    /// 2-bit codes, 32 channels per 8 bytes: each chunk's channels `4i` (bits 0..2 of the
    /// bytes), then `4i + 1`, `4i + 2` and `4i + 3`.
    Crumbs,
}

impl Order {
    fn of(format: Format) -> Order {
        match format {
            Format::Tok {
                bits: LowBits::Four,
                ..
            }
            | Format::Chan {
                bits: LowBits::Four,
            } => Order::Nibbles,
            Format::Tok {
                bits: LowBits::Two, ..
            }
            | Format::Chan { bits: LowBits::Two } => Order::Crumbs,
            Format::F16 | Format::Q8 | Format::Q8_0 => Order::Natural,
        }
    }

    /// The channel at position `p`.
    fn channel(self, p: usize) -> usize {
        match self {
            Order::Natural => p,
            Order::Nibbles => (p & !15) + 2 * (p & 7) + ((p >> 3) & 1),
            Order::Crumbs => (p & !31) + 4 * (p & 7) + ((p >> 3) & 3),
        }
    }

    /// The position of channel `c`.
    fn position(self, c: usize) -> usize {
        match self {
            Order::Natural => c,
            Order::Nibbles => (c & !15) + 8 * (c & 1) + ((c & 15) >> 1),
            Order::Crumbs => (c & !31) + 8 * (c & 3) + ((c & 31) >> 2),
        }
    }

    /// Rows of `d` natural-order values put into this order: `out[p] = x[channel(p)]`.
    fn permute(self, x: &[f32], d: usize, out: &mut Vec<f32>) {
        out.clear();
        out.extend(
            x.chunks_exact(d)
                .flat_map(|row| (0..d).map(move |p| row[self.channel(p)])),
        );
    }

    /// Rows of `d` values in this order put back into natural order, in place.
    fn unpermute(self, x: &mut [f32], d: usize) {
        if self == Order::Natural {
            return;
        }
        let mut row = vec![0f32; d];
        for chunk in x.chunks_exact_mut(d) {
            row.copy_from_slice(chunk);
            for (p, &v) in row.iter().enumerate() {
                chunk[self.channel(p)] = v;
            }
        }
    }
}

/// One work item: online softmax over the blocks for every query row of the head. Per block:
/// score every key against every query row, update the softmax state, accumulate the weighted
/// values; rows are decoded into registers inside those loops and never stored dequantized.
#[inline(always)]
fn run_item<K: Kernel>(
    k: K,
    view: &CacheView<'_>,
    blocks: &[Block<'_>],
    hq: &HeadQueries,
    d: usize,
) -> Partial {
    debug_assert_eq!(d, view.layout.head_dim());
    let rows = hq.pos.len();
    let mut part = Partial {
        max: vec![f32::NEG_INFINITY; rows],
        sum: vec![0.0; rows],
        acc: vec![0.0; rows * d],
    };
    // Quantized key pages are scored against the queries in the key format's order; f16 sinks
    // and residual tokens and rotated pre-RoPE keys against the natural-order rows. Values
    // accumulate in the value format's order.
    let (k_order, v_order) = (
        Order::of(view.layout.head_layout().k.format),
        Order::of(view.layout.head_layout().v.format),
    );
    let mut queries = Vec::new();
    k_order.permute(&hq.rows, d, &mut queries);
    let g = blocks.iter().map(|b| b.tokens).max().unwrap_or(0);
    let mut scores = vec![0f32; rows * g];
    let mut params = Vec::new();
    let (mut dense, mut permuted) = (Vec::new(), Vec::new());
    let (mut folded, mut bias) = (Vec::new(), Vec::new());
    for (i, block) in blocks.iter().enumerate() {
        let n = block.tokens;
        let next = blocks.get(i + 1);
        let mut prefetch_k = Prefetch::new(k, next.map(|b| &b.k), n.div_ceil(2));
        let mut prefetch_v = Prefetch::new(k, next.map(|b| &b.v), d / 16);
        let order = Order::of(block.k.format);
        if view.layout.scheme().pre_rope {
            // Keys stored before RoPE: dequantize the block's keys and rotate each to its
            // position (KVQuant), then score the rotated rows.
            dense.resize(n * d, 0.0);
            with_rows!(k, block.k, n, params, |rows| decode_block(
                k, &rows, order, n, d, &mut dense
            ));
            let rope = view
                .rope
                .expect("pre_rope schemes are validated to have RoPE");
            for (t, key) in dense.chunks_exact_mut(d).enumerate() {
                for (c, x) in block.k.outliers(t) {
                    key[c] = x;
                }
                rope.rotate(key, block.first_pos + t);
            }
            let rows = F32Rows::new(&dense, n, d);
            score_block(k, &rows, n, d, &hq.rows, &mut scores, g, &mut prefetch_k);
        } else if let Format::Chan { bits } = block.k.format {
            // Per-channel parameters are the page's: fold the scales into the queries and the
            // minimums into one bias per row, and score the bare codes.
            block.k.params_f32(k, n, &mut params);
            let (scale, min) = params.split_at(d);
            fold_chan_params(k, &queries, scale, min, d, &mut folded, &mut bias);
            let packed = Packed::new(block.k.rows, block.k.row_bytes, n);
            match bits {
                LowBits::Four => {
                    let codes = ChanCodes::<4> { packed };
                    score_block(k, &codes, n, d, &folded, &mut scores, g, &mut prefetch_k);
                    let rows = ChanRows { codes, scale, min };
                    correct_scores(k, &rows, block, order, hq, &mut scores, g);
                }
                LowBits::Two => {
                    let codes = ChanCodes::<2> { packed };
                    score_block(k, &codes, n, d, &folded, &mut scores, g, &mut prefetch_k);
                    let rows = ChanRows { codes, scale, min };
                    correct_scores(k, &rows, block, order, hq, &mut scores, g);
                }
            }
            for (r, b) in bias.iter().enumerate() {
                scores[r * g..r * g + n].iter_mut().for_each(|s| *s += b);
            }
        } else {
            let q = if order == Order::Natural {
                &hq.rows
            } else {
                &queries
            };
            with_rows!(k, block.k, n, params, |rows| {
                score_block(k, &rows, n, d, q, &mut scores, g, &mut prefetch_k);
                correct_scores(k, &rows, block, order, hq, &mut scores, g);
            });
        }
        softmax_block(k, hq, block.first_pos, n, &mut scores, g, d, &mut part);
        let order = Order::of(block.v.format);
        if order == v_order {
            with_rows!(k, block.v, n, params, |rows| {
                accumulate_block(k, &rows, n, d, &scores, g, &mut part.acc, &mut prefetch_v);
                // Sparse outliers: add w·(exact − dense) to the outlier's channel.
                if block.v.outliers.is_some() {
                    for t in 0..n {
                        for (c, x) in block.v.outliers(t) {
                            let delta = x - dense_value(k, &rows, order, t, c);
                            let at = v_order.position(c);
                            for r in 0..hq.pos.len() {
                                part.acc[r * d + at] += scores[r * g + t] * delta;
                            }
                        }
                    }
                }
            });
        } else {
            // f16 sink values while the accumulators are in a low-bit format's order: decode,
            // put the outliers in, reorder, accumulate.
            dense.resize(n * d, 0.0);
            with_rows!(k, block.v, n, params, |rows| decode_block(
                k, &rows, order, n, d, &mut dense
            ));
            for (t, value) in dense.chunks_exact_mut(d).enumerate() {
                for (c, x) in block.v.outliers(t) {
                    value[c] = x;
                }
            }
            v_order.permute(&dense, d, &mut permuted);
            let rows = F32Rows::new(&permuted, n, d);
            accumulate_block(k, &rows, n, d, &scores, g, &mut part.acc, &mut prefetch_v);
        }
    }
    v_order.unpermute(&mut part.acc, d);
    part
}

/// `folded[r][p] = q[r][p] · scale[p]` and `bias[r] = Σ_p q[r][p] · min[p]`, so that
/// `q · (scale ⊙ code + min) = folded · code + bias` (all in the key format's order).
#[inline(always)]
fn fold_chan_params<K: Kernel>(
    k: K,
    q: &[f32],
    scale: &[f32],
    min: &[f32],
    d: usize,
    folded: &mut Vec<f32>,
    bias: &mut Vec<f32>,
) {
    assert!(d.is_multiple_of(8) && scale.len() == d && min.len() == d);
    folded.resize(q.len(), 0.0);
    let mut sums = [k.splat(0.0); 8];
    bias.clear();
    let rows = q.len() / d;
    for (r, (qr, f)) in q
        .chunks_exact(d)
        .zip(folded.chunks_exact_mut(d))
        .enumerate()
    {
        let mut b = k.splat(0.0);
        for c in (0..d).step_by(8) {
            // SAFETY: `c + 8 <= d` and every slice here holds `d` floats.
            unsafe {
                let qv = k.load_ptr(qr.as_ptr().add(c));
                k.store_ptr(
                    k.mul(qv, k.load_ptr(scale.as_ptr().add(c))),
                    f.as_mut_ptr().add(c),
                );
                b = k.fmadd(qv, k.load_ptr(min.as_ptr().add(c)), b);
            }
        }
        sums[r % 8] = b;
        if r % 8 == 7 || r + 1 == rows {
            bias.extend_from_slice(&k.hsum8(sums)[..r % 8 + 1]);
        }
    }
}

/// Sparse key outliers: corrects each score by `q · (exact − dense)`.
#[inline(always)]
fn correct_scores<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    block: &Block<'_>,
    order: Order,
    hq: &HeadQueries,
    scores: &mut [f32],
    g: usize,
) {
    if block.k.outliers.is_none() {
        return;
    }
    let d = block.k.head_dim;
    for t in 0..block.tokens {
        for (c, x) in block.k.outliers(t) {
            let delta = x - dense_value(k, rows, order, t, c);
            for r in 0..hq.pos.len() {
                scores[r * g + t] += hq.rows[r * d + c] * delta;
            }
        }
    }
}

/// The packed rows of a stream of the next block, prefetched a few cache lines per step of a
/// loop over the current block (its few parameter lines at once): pages are scattered in the
/// pool and hardware prefetchers stop at 4 KiB boundaries, and one burst of every line at the
/// start of a block stalls the core on its miss buffers instead.
#[derive(Clone, Copy)]
struct Prefetch<'a> {
    rows: &'a [u8],
    /// Offset of the next line to fetch.
    at: usize,
    /// Lines per step.
    lines: usize,
}

impl<'a> Prefetch<'a> {
    /// Spreads the rows of `stream` over `steps` calls of [`Prefetch::step`].
    fn new<K: Kernel>(k: K, stream: Option<&StreamBlock<'a>>, steps: usize) -> Self {
        let rows = stream.map_or(&[][..], |s| {
            k.prefetch(s.params);
            s.rows
        });
        Prefetch {
            rows,
            at: 0,
            lines: rows.len().div_ceil(64).div_ceil(steps.max(1)),
        }
    }

    /// Fetches the next few lines; a branch-light loop, as it runs inside the hot loops.
    #[inline(always)]
    fn step<K: Kernel>(&mut self, k: K) {
        for _ in 0..self.lines {
            if self.at < self.rows.len() {
                k.prefetch_line(&self.rows[self.at..]);
            }
            self.at += 64;
        }
    }
}

/// Masks tokens past each row's position (causal chunks), then turns the block's scores into
/// softmax weights against each row's running maximum, rescaling the row's state once.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn softmax_block<K: Kernel>(
    k: K,
    hq: &HeadQueries,
    first_pos: usize,
    n: usize,
    scores: &mut [f32],
    g: usize,
    d: usize,
    part: &mut Partial,
) {
    for (r, &pos) in hq.pos.iter().enumerate() {
        let visible = (pos + 1).saturating_sub(first_pos).min(n);
        let s = &mut scores[r * g..r * g + n];
        s[visible..].fill(f32::NEG_INFINITY);
        let block_max = k.max_of(s);
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
        part.sum[r] += k.exp2_shifted_sum(s, m);
    }
}

/// Token rows of one stream, dequantized eight channels at a time into a vector register, in
/// the [`Order`] of the stream's format.
///
/// Each implementation is built for `n` tokens of `d` channels, `d` a multiple of 32, and
/// checks, when built, that its slices hold them; `row8` then reads without further checks.
trait Rows {
    /// Positions decoded from one load (8, 16 or 32); the loops step over positions by a
    /// multiple of it, so that `j` below is a constant in each unrolled copy.
    const CHUNK: usize;

    /// Positions `c0 + 8j .. c0 + 8j + 8` of token `t`.
    ///
    /// # Safety
    /// `t < n`, `c0` is a multiple of `CHUNK` and `c0 + 8j + 8 <= d`.
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V;
}

/// Already dequantized rows (pre-RoPE keys after rotation, reordered sink values).
struct F32Rows<'a> {
    data: &'a [f32],
    d: usize,
}

impl<'a> F32Rows<'a> {
    fn new(data: &'a [f32], n: usize, d: usize) -> Self {
        assert!(data.len() >= n * d);
        F32Rows { data, d }
    }
}

impl Rows for F32Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: `data` holds `n × d` floats (checked in `new`) and the contract of `row8`
        // keeps `t·d + c0 + 8j + 8` within them.
        unsafe { k.load_ptr(self.data.as_ptr().add(t * self.d + c0 + 8 * j)) }
    }
}

/// Packed rows of a block: `n` rows of `row_bytes`, checked to be in the slice.
#[derive(Clone, Copy)]
struct Packed<'a> {
    rows: &'a [u8],
    row_bytes: usize,
}

impl<'a> Packed<'a> {
    fn new(rows: &'a [u8], row_bytes: usize, n: usize) -> Self {
        assert!(rows.len() >= n * row_bytes);
        Packed { rows, row_bytes }
    }

    /// Pointer to byte `offset` of row `t`.
    ///
    /// # Safety
    /// `t < n` and `offset < row_bytes`.
    #[inline(always)]
    unsafe fn at(&self, t: usize, offset: usize) -> *const u8 {
        // SAFETY: within the `n × row_bytes` bytes checked in `new`.
        unsafe { self.rows.as_ptr().add(t * self.row_bytes + offset) }
    }
}

struct F16Rows<'a> {
    packed: Packed<'a>,
}

impl Rows for F16Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: an f16 row has `2d` bytes; `c0 + 8j + 8 <= d` keeps the 16 bytes read
        // inside it.
        unsafe { k.f16x8(self.packed.at(t, 2 * (c0 + 8 * j))) }
    }
}

/// `q8`: `scale[t] · int8`.
struct Q8Rows<'a> {
    packed: Packed<'a>,
    scales: &'a [f32],
}

impl Rows for Q8Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: a q8 row has `d` bytes; `c0 + 8j + 8 <= d` keeps the 8 bytes read inside
        // it; `scales` holds one per token (checked where built).
        unsafe {
            k.mul(
                k.i8x8(self.packed.at(t, c0 + 8 * j)),
                k.splat(*self.scales.get_unchecked(t)),
            )
        }
    }
}

/// `q8_0`: `d[t][block] · int8`, the scale inside each 34-byte block.
struct Q80Rows<'a> {
    packed: Packed<'a>,
    scales: &'a [f32],
    blocks: usize,
}

impl Rows for Q80Rows<'_> {
    const CHUNK: usize = 8;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let c = c0 + 8 * j;
        let (b, i) = (c / Q8_0_BLOCK, c % Q8_0_BLOCK);
        // SAFETY: block `b < d / 32` of the row holds 2 + 32 bytes and `i + 8 <= 32`; `scales`
        // holds `n × blocks` (checked where built).
        unsafe {
            let codes = k.i8x8(self.packed.at(t, b * Q8_0_BLOCK_BYTES + 2 + i));
            k.mul(
                codes,
                k.splat(*self.scales.get_unchecked(t * self.blocks + b)),
            )
        }
    }
}

/// Bare low-bit codes: 16 (4-bit) or 32 (2-bit) positions per 8-byte load, in the
/// [`Order::Nibbles`] or [`Order::Crumbs`] order. Used alone for per-channel keys, whose
/// parameters are folded into the queries.
#[derive(Clone, Copy)]
struct ChanCodes<'a, const BITS: usize> {
    packed: Packed<'a>,
}

impl<const BITS: usize> ChanCodes<'_, BITS> {
    /// `table[code]` for positions `c0 + 8j ..+ 8` of row `t` (`table` is used by 2-bit codes
    /// only; 4-bit codes are converted).
    ///
    /// # Safety
    /// As [`Rows::row8`], for rows of `d · BITS / 8` bytes and `d` a multiple of 32.
    #[inline(always)]
    unsafe fn lookup<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize, table: K::V) -> K::V {
        let chunk = <Self as Rows>::CHUNK;
        let per_load = chunk / 8;
        // The load that holds position `c0 + 8j`, and which of its vectors that is.
        let (base, j) = (c0 + j / per_load * chunk, j % per_load);
        // SAFETY: `d` is a multiple of `CHUNK`, so the chunk at `base` lies within the row,
        // whose `base · BITS / 8 .. + 8` bytes hold it.
        unsafe {
            let p = self.packed.at(t, base * BITS / 8);
            if BITS == 4 {
                k.nib8(p, j == 1)
            } else {
                k.crumb8(p, j as u32, table)
            }
        }
    }
}

impl<const BITS: usize> Rows for ChanCodes<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // SAFETY: forwarded contract.
        unsafe { self.lookup(k, t, c0, j, k.crumb_table(1.0, 0.0)) }
    }
}

/// `q*_tok`: `min[t][group] + scale[t][group] · code`.
struct TokRows<'a, const BITS: usize> {
    codes: ChanCodes<'a, BITS>,
    /// `(scale, min)` per token per group.
    params: &'a [f32],
    groups: usize,
    /// log2 of the channels per group (group sizes are powers of two, at least 32).
    group_shift: u32,
}

impl<const BITS: usize> Rows for TokRows<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        // A chunk lies within one group, so position `c0` names the group.
        let p = 2 * (t * self.groups + (c0 >> self.group_shift));
        // SAFETY: forwarded contract; `params` holds `2 × groups` per token (checked where
        // built) and `c0 >> group_shift < groups`.
        unsafe {
            let (scale, min) = (
                *self.params.get_unchecked(p),
                *self.params.get_unchecked(p + 1),
            );
            if BITS == 4 {
                let codes = self.codes.lookup(k, t, c0, j, k.splat(0.0));
                k.fmadd(codes, k.splat(scale), k.splat(min))
            } else {
                // The table holds the four dequantized values.
                self.codes.lookup(k, t, c0, j, k.crumb_table(scale, min))
            }
        }
    }
}

/// `q*_chan`: `min[c] + scale[c] · code`, parameters shared by the page's tokens (for the
/// outlier corrections and pre-RoPE keys; scores fold the parameters into the queries).
struct ChanRows<'a, const BITS: usize> {
    codes: ChanCodes<'a, BITS>,
    /// Per position, in the codes' order.
    scale: &'a [f32],
    min: &'a [f32],
}

impl<const BITS: usize> Rows for ChanRows<'_, BITS> {
    const CHUNK: usize = 64 / BITS;

    #[inline(always)]
    unsafe fn row8<K: Kernel>(&self, k: K, t: usize, c0: usize, j: usize) -> K::V {
        let c = c0 + 8 * j;
        // SAFETY: forwarded contract; `scale` and `min` hold `d` floats (checked where built).
        unsafe {
            let codes = self.codes.row8(k, t, c0, j);
            let scale = k.load_ptr(self.scale.as_ptr().add(c));
            k.fmadd(codes, scale, k.load_ptr(self.min.as_ptr().add(c)))
        }
    }
}

impl StreamBlock<'_> {
    /// Converts the f16 parameters of the first `n` tokens to f32 in `out`, laid out as the
    /// format's [`Rows`] reads them.
    #[inline(always)]
    fn params_f32<K: Kernel>(&self, k: K, n: usize, out: &mut Vec<f32>) {
        let d = self.head_dim;
        out.clear();
        match self.format {
            Format::F16 => {}
            Format::Q8 | Format::Tok { .. } => {
                let bytes = n * self.format.params_bytes(1, d);
                out.resize(bytes / 2, 0.0);
                k.f16_to_f32(&self.params[..bytes], out);
            }
            Format::Q8_0 => out.extend((0..n).flat_map(|t| {
                (0..d / Q8_0_BLOCK)
                    .map(move |b| get_f16(self.rows, t * self.row_bytes + b * Q8_0_BLOCK_BYTES))
            })),
            Format::Chan { .. } => {
                // Convert the (scale, min) pairs, then de-interleave into the codes' order:
                // scales, then minimums.
                out.resize(4 * d, 0.0);
                let (planar, pairs) = out.split_at_mut(2 * d);
                k.f16_to_f32(&self.params[..4 * d], pairs);
                let (scales, mins) = planar.split_at_mut(d);
                match Order::of(self.format) {
                    Order::Natural => deinterleave::<1>(pairs, scales, mins),
                    Order::Nibbles => deinterleave::<2>(pairs, scales, mins),
                    Order::Crumbs => deinterleave::<4>(pairs, scales, mins),
                }
                out.truncate(2 * d);
            }
        }
    }
}

/// Splits `(scale, min)` pairs in natural channel order into scales and minimums in the order
/// that decodes `LANES` vectors of 8 per load (1: [`Order::Natural`], 2: [`Order::Nibbles`],
/// 4: [`Order::Crumbs`]): in each chunk of `8 · LANES` channels, position `8j + i` holds
/// channel `LANES · i + j`. Straight-line copies, as this runs once per page.
#[inline(always)]
fn deinterleave<const LANES: usize>(pairs: &[f32], scales: &mut [f32], mins: &mut [f32]) {
    let chunk = 8 * LANES;
    for ((src, s), m) in pairs
        .chunks_exact(2 * chunk)
        .zip(scales.chunks_exact_mut(chunk))
        .zip(mins.chunks_exact_mut(chunk))
    {
        for j in 0..LANES {
            for i in 0..8 {
                let c = LANES * i + j;
                (s[8 * j + i], m[8 * j + i]) = (src[2 * c], src[2 * c + 1]);
            }
        }
    }
}

/// Walks `$total` query rows in register-blocked groups of 4, then 2, then 1, binding `$r0` to
/// each group's first row and the constant `$qr` to its size; `$body` handles those rows.
macro_rules! for_row_groups {
    ($total:expr, |$r0:ident, $qr:ident| $body:expr) => {{
        let total = $total;
        let mut $r0 = 0;
        while $r0 < total {
            match total - $r0 {
                1 => {
                    const $qr: usize = 1;
                    $body;
                    $r0 += $qr;
                }
                2 | 3 => {
                    const $qr: usize = 2;
                    $body;
                    $r0 += $qr;
                }
                _ => {
                    const $qr: usize = 4;
                    $body;
                    $r0 += $qr;
                }
            }
        }
    }};
}

/// `scores[r][t] = q[r] · key[t]` for every query row and the block's `n` tokens, up to four
/// rows per pass so each key row is decoded once per four query rows. `q` is in the rows'
/// order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_block<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    q: &[f32],
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    struct Loop<'s, 'p, R, const D: usize> {
        rows: &'s R,
        n: usize,
        q: &'s [f32],
        scores: &'s mut [f32],
        g: usize,
        prefetch: &'s mut Prefetch<'p>,
    }
    impl<R: Rows, const D: usize> KernelFn<()> for Loop<'_, '_, R, D> {
        #[inline(always)]
        fn call<K: Kernel>(self, k: K) {
            // A copy the loops keep in registers, not behind the caller's pointer.
            let mut prefetch = *self.prefetch;
            score_loop(
                k,
                self.rows,
                self.n,
                D,
                self.q,
                self.scores,
                self.g,
                &mut prefetch,
            );
            *self.prefetch = prefetch;
        }
    }
    with_head_dim!(d, |D| k.run(Loop::<R, D> {
        rows,
        n,
        q,
        scores,
        g,
        prefetch
    }));
}

/// [`score_block`]'s loops, for `d` a constant.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_loop<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    q: &[f32],
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    for_row_groups!(q.len() / d, |r0, QR| score_rows::<K, R, QR>(
        k, rows, n, d, q, r0, scores, g, prefetch
    ));
}

/// Scores tokens two at a time so each query load feeds two keys and the `2 × QR` dot
/// products form independent FMA chains (one chain per accumulator stalls on FMA latency).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_rows<K: Kernel, R: Rows, const QR: usize>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    q: &[f32],
    r0: usize,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    assert!(q.len() >= (r0 + QR) * d && d.is_multiple_of(R::CHUNK) && n <= g);
    assert!(scores.len() >= (r0 + QR) * g);
    let mut t = 0;
    while t + 2 <= n {
        prefetch.step(k);
        score_tokens::<K, R, QR, 2>(k, rows, d, q, r0, t, scores, g);
        t += 2;
    }
    if t < n {
        score_tokens::<K, R, QR, 1>(k, rows, d, q, r0, t, scores, g);
    }
}

/// `scores[r][t0 + i] = q[r] · key[t0 + i]` for `QR` rows and `TT` tokens; the caller checks
/// that the rows, tokens and scores are in range and that `d` is a multiple of `R::CHUNK`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_tokens<K: Kernel, R: Rows, const QR: usize, const TT: usize>(
    k: K,
    rows: &R,
    d: usize,
    q: &[f32],
    r0: usize,
    t0: usize,
    scores: &mut [f32],
    g: usize,
) {
    let qp = q.as_ptr();
    let mut acc = [[k.splat(0.0); QR]; TT];
    for c0 in (0..d).step_by(R::CHUNK) {
        for j in 0..R::CHUNK / 8 {
            // SAFETY: `t0 + TT <= n`, `c0` is a multiple of `CHUNK` and `c0 + 8j + 8 <= d`
            // (the rows' contract); query row `r0 + i` lies within `q` (checked by
            // `score_rows`).
            unsafe {
                // A plain loop, not `array::from_fn`: a closure the compiler leaves out of
                // line is compiled without AVX2 and turns every intrinsic into a call.
                let mut keys = [k.splat(0.0); TT];
                for (i, key) in keys.iter_mut().enumerate() {
                    *key = rows.row8(k, t0 + i, c0, j);
                }
                for i in 0..QR {
                    let qv = k.load_ptr(qp.add((r0 + i) * d + c0 + 8 * j));
                    for (acc, key) in acc.iter_mut().zip(keys) {
                        acc[i] = k.fmadd(qv, key, acc[i]);
                    }
                }
            }
        }
    }
    const { assert!(QR * TT <= 8) };
    let mut all = [k.splat(0.0); 8];
    for (i, acc) in acc.iter().enumerate() {
        all[i * QR..(i + 1) * QR].copy_from_slice(acc);
    }
    let sums = k.hsum8(all);
    let sp = scores.as_mut_ptr();
    for i in 0..TT {
        for j in 0..QR {
            // SAFETY: `score_rows` checked `scores.len() >= (r0 + QR)·g`, and
            // `t0 + i < n <= g`.
            unsafe { *sp.add((r0 + j) * g + t0 + i) = sums[i * QR + j] };
        }
    }
}

/// `acc += Σ_t w[t] · value[t]` for up to four query rows, sixteen positions at a time with
/// the rows' accumulators in registers across the block's tokens. `acc` is in the rows' order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn accumulate_block<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    w: &[f32],
    g: usize,
    acc: &mut [f32],
    prefetch: &mut Prefetch<'_>,
) {
    struct Loop<'s, 'p, R, const D: usize> {
        rows: &'s R,
        n: usize,
        w: &'s [f32],
        g: usize,
        acc: &'s mut [f32],
        prefetch: &'s mut Prefetch<'p>,
    }
    impl<R: Rows, const D: usize> KernelFn<()> for Loop<'_, '_, R, D> {
        #[inline(always)]
        fn call<K: Kernel>(self, k: K) {
            let mut prefetch = *self.prefetch;
            accumulate_loop(
                k,
                self.rows,
                self.n,
                D,
                self.w,
                self.g,
                self.acc,
                &mut prefetch,
            );
            *self.prefetch = prefetch;
        }
    }
    with_head_dim!(d, |D| k.run(Loop::<R, D> {
        rows,
        n,
        w,
        g,
        acc,
        prefetch
    }));
}

/// [`accumulate_block`]'s loops, for `d` a constant.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn accumulate_loop<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    w: &[f32],
    g: usize,
    acc: &mut [f32],
    prefetch: &mut Prefetch<'_>,
) {
    for_row_groups!(acc.len() / d, |r0, QR| {
        accumulate_rows::<K, R, QR>(k, rows, n, d, w, g, r0, acc, prefetch)
    });
}

/// Sixteen positions per pass: each weight broadcast feeds two FMAs and the `2 × QR`
/// accumulators are independent chains across the tokens. A 2-bit chunk takes two passes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn accumulate_rows<K: Kernel, R: Rows, const QR: usize>(
    k: K,
    rows: &R,
    n: usize,
    d: usize,
    w: &[f32],
    g: usize,
    r0: usize,
    acc: &mut [f32],
    prefetch: &mut Prefetch<'_>,
) {
    let step = R::CHUNK.max(16);
    assert!(w.len() >= (r0 + QR) * g && n <= g && acc.len() >= (r0 + QR) * d);
    assert!(d.is_multiple_of(step) && step.is_multiple_of(R::CHUNK));
    let (wp, ap) = (w.as_ptr(), acc.as_mut_ptr());
    for c0 in (0..d).step_by(step) {
        for pass in 0..step / 16 {
            prefetch.step(k);
            let c = c0 + 16 * pass;
            // SAFETY: by the asserts above, weight `(r0 + j)·g + t` with `t < n <= g` lies in
            // `w` and accumulator `(r0 + j)·d + c .. + 16` in `acc`; `t < n`, `c0` a multiple
            // of `CHUNK` and `c + 16 <= d` is the rows' contract.
            unsafe {
                let mut a = [[k.splat(0.0); 2]; QR];
                for (j, a) in a.iter_mut().enumerate() {
                    for (h, a) in a.iter_mut().enumerate() {
                        *a = k.load_ptr(ap.add((r0 + j) * d + c + 8 * h));
                    }
                }
                for t in 0..n {
                    let value = [
                        rows.row8(k, t, c0, 2 * pass),
                        rows.row8(k, t, c0, 2 * pass + 1),
                    ];
                    for (j, a) in a.iter_mut().enumerate() {
                        let wt = k.splat(*wp.add((r0 + j) * g + t));
                        for (a, v) in a.iter_mut().zip(value) {
                            *a = k.fmadd(wt, v, *a);
                        }
                    }
                }
                for (j, a) in a.into_iter().enumerate() {
                    for (h, a) in a.into_iter().enumerate() {
                        k.store_ptr(a, ap.add((r0 + j) * d + c + 8 * h));
                    }
                }
            }
        }
    }
}

/// Writes the first `n` dequantized rows into `out` (`n × d`), in natural channel order (the
/// rows' order is `order`).
#[inline(always)]
fn decode_block<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    order: Order,
    n: usize,
    d: usize,
    out: &mut [f32],
) {
    assert!(out.len() >= n * d && d.is_multiple_of(R::CHUNK));
    let mut row = vec![0f32; d];
    for t in 0..n {
        for c0 in (0..d).step_by(R::CHUNK) {
            for j in 0..R::CHUNK / 8 {
                // SAFETY: `t < n`, `c0` a multiple of `CHUNK`, `c0 + 8j + 8 <= d`.
                k.store(unsafe { rows.row8(k, t, c0, j) }, &mut row[c0 + 8 * j..]);
            }
        }
        for (p, &v) in row.iter().enumerate() {
            out[t * d + order.channel(p)] = v;
        }
    }
}

/// The dense (clipped, quantized) value of channel `c` of token `t`, computed exactly as the
/// vector loops compute it, so an outlier correction `exact − dense` restores `exact`.
#[inline(always)]
fn dense_value<K: Kernel, R: Rows>(k: K, rows: &R, order: Order, t: usize, c: usize) -> f32 {
    let p = order.position(c);
    let c0 = p / R::CHUNK * R::CHUNK;
    let mut lanes = [0f32; 8];
    // SAFETY: the outlier store holds channels `c < d` of tokens `t < n`; `d` is a multiple of
    // `CHUNK`, so `c0` is one and `p - p % 8 + 8 <= d`.
    k.store(unsafe { rows.row8(k, t, c0, (p - c0) / 8) }, &mut lanes);
    lanes[p % 8]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deinterleaved_parameters_follow_each_order() {
        let d = 128;
        let pairs: Vec<f32> = (0..2 * d).map(|i| i as f32).collect();
        for (order, split) in [
            (
                Order::Natural,
                deinterleave::<1> as fn(&[f32], &mut [f32], &mut [f32]),
            ),
            (Order::Nibbles, deinterleave::<2>),
            (Order::Crumbs, deinterleave::<4>),
        ] {
            let (mut scales, mut mins) = (vec![0f32; d], vec![0f32; d]);
            split(&pairs, &mut scales, &mut mins);
            for c in 0..d {
                let p = order.position(c);
                assert_eq!(order.channel(p), c);
                assert_eq!(
                    (scales[p], mins[p]),
                    (pairs[2 * c], pairs[2 * c + 1]),
                    "{order:?} {c}"
                );
            }
        }
    }
}

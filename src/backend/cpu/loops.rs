//! The loops of one work item: for each run of rows, score every key against every query row,
//! update the online softmax, accumulate the weighted values; each loop a function of its own
//! per (instruction set, format, head_dim), entered through `Kernel::run`.

use crate::rope::{RopeLayout, RopeTable};
use crate::scheme::{Format, LowBits, Q8_0_BLOCK};

use super::super::simd::{Kernel, KernelFn};
use super::decode::*;
use super::intq::{ChanQuery, KeyOrderQuery, chan_int_score_block, int_score_block};
use super::view::{Block, CacheView, StreamBlock};
use super::{HeadQueries, Partial};

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
pub(super) use with_head_dim;

pub(super) struct RunItem<'v, 'a> {
    pub(super) view: &'v CacheView<'a>,
    pub(super) blocks: &'v [Block<'a>],
    pub(super) hq: &'v HeadQueries,
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

/// One work item: online softmax over the blocks for every query row of the head. Per block:
/// score every key against every query row, update the softmax state, accumulate the weighted
/// values; rows are decoded into registers inside those loops and never stored dequantized.
#[inline(always)]
pub(super) fn run_item<K: Kernel>(
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
        natural_acc: Vec::new(),
    };
    // Quantized key pages are scored against the queries in the key format's order; f16 sinks
    // and residual tokens and rotated pre-RoPE keys against the natural-order rows. Values
    // accumulate in the value format's order.
    let (k_order, v_order) = (
        Order::of(view.layout.head_layout().k.format),
        Order::of(view.layout.head_layout().v.format),
    );
    let mut queries = Vec::new();
    k_order.permute(k, &hq.rows, d, &mut queries);
    // `iq`: the int8 query in the key format's order, for the pages stored in it (f16 sinks
    // and open pages are scored against the rows, which then hold the same rounded query).
    let k_format = view.layout.head_layout().k.format;
    let int_query = hq.int.as_ref().map(|q| KeyOrderQuery::new(q, k_format, d));
    // `iq` with per-channel keys rounds each page's folded query instead.
    let chan_int = view.layout.scheme().int_query && matches!(k_format, Format::Chan { .. });
    let mut chan_query = ChanQuery::default();
    let g = blocks.iter().map(|b| b.tokens).max().unwrap_or(0);
    let mut scores = vec![0f32; rows * g];
    let mut params = Vec::new();
    let mut dense = Vec::new();
    let (mut folded, mut bias) = (Vec::new(), Vec::new());
    // Keys stored before RoPE: `R(p0 + t) = R(p0)·R(t)`, so `q·R(p0 + t)k = (R(−p0)q)·R(t)k`.
    // The query rows are turned back to each block's first position `p0` once per block, and
    // each key turns by its row `t` in the block alone: one of the table's first `g` rows,
    // which stay in cache, where the block's own positions' rows streamed `4·d` table bytes
    // per token beside the KV bytes (as the HIP kernels do: `turn_query_back`).
    let rope = view.rope.filter(|_| view.layout.scheme().pre_rope);
    // 4- and 2-bit keys are rotated as they are decoded (`RotatedRows`, `HalvesRotatedRows`),
    // by the table's first `g` rows put into the codes' order once per item.
    let rotate_decoded = rope.is_some() && k_order != Order::Natural;
    let mut offset_cs = Vec::new();
    if let Some(rope) = rope.filter(|_| rotate_decoded) {
        let first_rows = rope.rows(0, g);
        match rope.layout() {
            RopeLayout::Interleaved => k_order.permute(k, first_rows, d, &mut offset_cs),
            RopeLayout::Halves => {
                // Per row the cosines, then the sines: each half is whole chunks, so the
                // permutation puts each where its pair's first element goes.
                let split: Vec<f32> = first_rows
                    .chunks_exact(d)
                    .flat_map(|row| {
                        let cos = row.iter().step_by(2);
                        cos.chain(row.iter().skip(1).step_by(2)).copied()
                    })
                    .collect();
                k_order.permute(k, &split, d, &mut offset_cs);
            }
        }
    }
    let (mut turned, mut turned_ordered, mut back) = (Vec::new(), Vec::new(), Vec::new());
    for (i, block) in blocks.iter().enumerate() {
        let n = block.tokens;
        let next = blocks.get(i + 1);
        let mut prefetch_k = Prefetch::new(k, next.map(|b| &b.k), n.div_ceil(2));
        let mut prefetch_v = Prefetch::new(k, next.map(|b| &b.v), d / 16);
        let order = Order::of(block.k.format);
        if let Some(rope) = rope {
            turn_back(
                k,
                rope,
                &hq.rows,
                d,
                block.first_pos,
                &mut back,
                &mut turned,
            );
        }
        if let Some(rope) =
            rope.filter(|_| rotate_decoded && order == k_order && block.k.outliers.is_none())
        {
            // Pre-RoPE 4- and 2-bit keys, rotated as they are decoded against the turned-back
            // query in the codes' order.
            order.permute(k, &turned, d, &mut turned_ordered);
            assert!(offset_cs.len() >= n * d);
            let (q, cs) = (&turned_ordered, &offset_cs);
            with_rows!(k, block.k, n, params, |rows| match rope.layout() {
                RopeLayout::Interleaved => {
                    let rows = RotatedRows { rows: &rows, cs, d };
                    score_block(k, &rows, n, d, q, &mut scores, g, &mut prefetch_k);
                }
                RopeLayout::Halves => {
                    let rows = HalvesRotatedRows { rows: &rows, cs, d };
                    score_block(k, &rows, n, d, q, &mut scores, g, &mut prefetch_k);
                }
            });
        } else if let Some(rope) = rope {
            // Keys stored before RoPE otherwise (f16 sinks and open pages, natural-order
            // formats, pages with outliers): dequantize the block's keys, put the outliers in,
            // rotate each key by its row in the block (KVQuant), and score against the
            // turned-back query.
            dense.resize(n * d, 0.0);
            with_rows!(k, block.k, n, params, |rows| decode_block(
                k, &rows, order, n, d, &mut dense
            ));
            for (t, key) in dense.chunks_exact_mut(d).enumerate() {
                for (c, x) in block.k.outliers(t) {
                    key[c] = x;
                }
            }
            rotate_rows(k, rope, &mut dense, d, 0);
            let rows = F32Rows::new(&dense, n, d);
            score_block(k, &rows, n, d, &turned, &mut scores, g, &mut prefetch_k);
        } else if let Format::Chan { bits } = block.k.format {
            // Per-channel parameters are the page's: fold the scales into the queries and the
            // minimums into one bias per row, and score the bare codes (the order a constant
            // in each arm, so the fold's chunk loops unroll).
            let (pairs, q) = (block.k.params, &queries);
            match bits {
                LowBits::Four => {
                    fold_chan_page(k, Order::Nibbles, pairs, q, d, &mut folded, &mut bias)
                }
                LowBits::Two => {
                    fold_chan_page(k, Order::Crumbs, pairs, q, d, &mut folded, &mut bias)
                }
            }
            let packed = Packed::new(block.k.rows, block.k.row_bytes, n);
            let book = block.k.book;
            match bits {
                // `iq`: the folded query rounded to int8, the codes dotted in integers.
                _ if chan_int => {
                    chan_query.round(k, bits, &folded, d);
                    chan_int_score_block(
                        k,
                        &block.k,
                        n,
                        &chan_query,
                        &mut scores,
                        g,
                        &mut prefetch_k,
                    );
                }
                LowBits::Four => {
                    let codes = ChanCodes::<4> { packed, book };
                    score_block(k, &codes, n, d, &folded, &mut scores, g, &mut prefetch_k);
                }
                LowBits::Two => {
                    let codes = ChanCodes::<2> { packed, book };
                    score_block(k, &codes, n, d, &folded, &mut scores, g, &mut prefetch_k);
                }
            }
            correct_unrowed_scores(k, block, order, &hq.rows, &mut params, &mut scores, g);
            for (r, b) in bias.iter().enumerate() {
                scores[r * g..r * g + n].iter_mut().for_each(|s| *s += b);
            }
        } else if let Some(q) = int_query.as_ref().filter(|_| block.k.format == k_format) {
            int_score_block(
                k,
                &block.k,
                n,
                q,
                &mut params,
                &mut scores,
                g,
                &mut prefetch_k,
            );
            correct_unrowed_scores(k, block, order, &hq.rows, &mut params, &mut scores, g);
        } else {
            let q = if order == Order::Natural {
                &hq.rows
            } else {
                &queries
            };
            with_rows!(k, block.k, n, params, |rows| {
                score_block(k, &rows, n, d, q, &mut scores, g, &mut prefetch_k);
                correct_scores(k, &rows, block, order, &hq.rows, &mut scores, g);
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
            // f16 values (the sinks, the value window) while the accumulators are in a low-bit
            // format's order: summed as they are stored, in natural-order accumulators of their
            // own that join the others at the end. Reordering them per block cost a decode, a
            // permutation and a reload of every row: at 1024 tokens the 160 rows of kivi4's
            // window took a sixth of the step.
            debug_assert!(block.v.format == Format::F16 && block.v.outliers.is_none());
            part.natural_acc.resize(rows * d, 0.0);
            with_rows!(k, block.v, n, params, |values| accumulate_block(
                k,
                &values,
                n,
                d,
                &scores,
                g,
                &mut part.natural_acc,
                &mut prefetch_v
            ));
        }
    }
    v_order.unpermute(&mut part.acc, d);
    for (a, x) in part.acc.iter_mut().zip(&part.natural_acc) {
        *a += x;
    }
    part
}

/// Rotates each row of `d` values in `rows` to its position, `first` for the first: what
/// [`RopeTable::rotate`] computes, to the bit, eight channels per step.
#[inline(always)]
pub(super) fn rotate_rows<K: Kernel>(
    k: K,
    rope: &RopeTable,
    rows: &mut [f32],
    d: usize,
    first: usize,
) {
    for (t, row) in rows.chunks_exact_mut(d).enumerate() {
        rotate_row(k, rope.layout(), row, rope.row(first + t));
    }
}

/// The query rows `q` (natural order, `d` channels each) turned back by the angles of
/// position `pos`, `R(−pos)·q`, into `out`; `back` is scratch space for the angles' table row.
#[inline(always)]
pub(super) fn turn_back<K: Kernel>(
    k: K,
    rope: &RopeTable,
    q: &[f32],
    d: usize,
    pos: usize,
    back: &mut Vec<f32>,
    out: &mut Vec<f32>,
) {
    // `R(−φ)` is `R(φ)` with the sines negated.
    back.clear();
    back.extend(rope.row(pos).chunks_exact(2).flat_map(|cs| [cs[0], -cs[1]]));
    out.clear();
    out.extend_from_slice(q);
    for row in out.chunks_exact_mut(d) {
        rotate_row(k, rope.layout(), row, back);
    }
}

/// Rotates `x` by the `[cos, sin]` pairs of a RoPE table row `cs` (`x.len()` floats each) as
/// [`RopeTable::rotate`] does, eight channels per step.
#[inline(always)]
fn rotate_row<K: Kernel>(k: K, layout: RopeLayout, x: &mut [f32], cs: &[f32]) {
    let d = x.len();
    assert!(d.is_multiple_of(16) && cs.len() == d);
    let half = d / 2;
    let (x, cs) = (x.as_mut_ptr(), cs.as_ptr());
    // SAFETY: `x` and `cs` hold `d` floats each, and every access below reads or writes 8 of
    // them at an offset `c + 8 <= d` (or `half + c + 8 <= d`, `2c + 16 <= d`).
    unsafe {
        match layout {
            RopeLayout::Interleaved => {
                for c in (0..d).step_by(8) {
                    let v = k.rotate_pairs(k.load_ptr(x.add(c)), k.load_ptr(cs.add(c)));
                    k.store_ptr(v, x.add(c));
                }
            }
            RopeLayout::Halves => {
                for c in (0..half).step_by(8) {
                    let (lo, hi) = k.rotate_halves(
                        k.load_ptr(x.add(c)),
                        k.load_ptr(x.add(half + c)),
                        k.load_ptr(cs.add(2 * c)),
                        k.load_ptr(cs.add(2 * c + 8)),
                    );
                    k.store_ptr(lo, x.add(c));
                    k.store_ptr(hi, x.add(half + c));
                }
            }
        }
    }
}

/// `folded[r][p] = q[r][p] · scale[p]` and `bias[r] = Σ_p q[r][p] · min[p]` for the f16
/// `(scale, min)` pairs of a per-channel page, so that `q · (scale ⊙ code + min) =
/// folded · code + bias` (all in the key format's `order`). Each chunk's parameters are
/// converted in registers and used by up to eight rows at once, whose sums are independent
/// chains of multiply-adds: one row at a time, the fold waited on one chain of `d / 8` of
/// them per row and page.
#[inline(always)]
pub(super) fn fold_chan_page<K: Kernel>(
    k: K,
    order: Order,
    pairs: &[u8],
    q: &[f32],
    d: usize,
    folded: &mut Vec<f32>,
    bias: &mut Vec<f32>,
) {
    let chunk = order.chunk();
    assert!(d.is_multiple_of(chunk) && pairs.len() >= 4 * d && q.len().is_multiple_of(d));
    folded.resize(q.len(), 0.0);
    bias.clear();
    let rows = q.len() / d;
    for r0 in (0..rows).step_by(8) {
        let group = (rows - r0).min(8);
        let mut sums = [k.splat(0.0); 8];
        for c in (0..d).step_by(chunk) {
            // SAFETY: `c` is a multiple of `chunk` and `c + chunk <= d`, whose pairs `pairs`
            // holds (checked above).
            let (scale, min) = unsafe { planar_chunk(k, order, pairs, c) };
            for (r, sum) in sums.iter_mut().enumerate().take(group) {
                let at = (r0 + r) * d + c;
                for i in 0..chunk / 8 {
                    // SAFETY: row `r0 + r < rows` holds `d` floats in `q` and in `folded`,
                    // and `c + 8i + 8 <= d`.
                    unsafe {
                        let qv = k.load_ptr(q.as_ptr().add(at + 8 * i));
                        k.store_ptr(k.mul(qv, scale[i]), folded.as_mut_ptr().add(at + 8 * i));
                        *sum = k.fmadd(qv, min[i], *sum);
                    }
                }
            }
        }
        bias.extend_from_slice(&k.hsum8(sums)[..group]);
    }
}

/// Sparse key outliers: corrects each score by `q · (exact − dense)`, for the query rows `q`
/// in natural order (the dequantized int8 rows for `iq` scores).
#[inline(always)]
pub(super) fn correct_scores<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    block: &Block<'_>,
    order: Order,
    q: &[f32],
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
            for (r, q) in q.chunks_exact(d).enumerate() {
                scores[r * g + t] += q[c] * delta;
            }
        }
    }
}

/// [`correct_scores`] for keys scored without their [`Rows`] (folded per-channel pages,
/// integer-query scores): the parameters are converted only for a block with outliers.
#[inline(always)]
fn correct_unrowed_scores<K: Kernel>(
    k: K,
    block: &Block<'_>,
    order: Order,
    q: &[f32],
    mut params: &mut Vec<f32>,
    scores: &mut [f32],
    g: usize,
) {
    if block.k.outliers.is_some() {
        with_rows!(k, block.k, block.tokens, params, |rows| correct_scores(
            k, &rows, block, order, q, scores, g
        ));
    }
}

/// The packed rows of a stream of the next block, prefetched a few cache lines per step of a
/// loop over the current block (its few parameter lines at once): pages are scattered in the
/// pool and hardware prefetchers stop at 4 KiB boundaries, and one burst of every line at the
/// start of a block stalls the core on its miss buffers instead.
#[derive(Clone, Copy)]
pub(super) struct Prefetch<'a> {
    pub(super) rows: &'a [u8],
    /// Offset of the next line to fetch.
    pub(super) at: usize,
    /// Lines per step.
    pub(super) lines: usize,
}

impl<'a> Prefetch<'a> {
    /// Spreads the rows of `stream` over `steps` calls of [`Prefetch::step`].
    pub(super) fn new<K: Kernel>(k: K, stream: Option<&StreamBlock<'a>>, steps: usize) -> Self {
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
    pub(super) fn step<K: Kernel>(&mut self, k: K) {
        for _ in 0..self.lines {
            if self.at < self.rows.len() {
                k.prefetch_line(&self.rows[self.at..]);
            }
            self.at += 64;
        }
    }
}

/// Masks tokens past each row's position (causal chunks) and before its sliding window, then
/// turns the block's scores into softmax weights against each row's running maximum, rescaling
/// the row's state once.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn softmax_block<K: Kernel>(
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
        let hidden = hq.first_visible(r).saturating_sub(first_pos).min(visible);
        let s = &mut scores[r * g..r * g + n];
        s[visible..].fill(f32::NEG_INFINITY);
        s[..hidden].fill(f32::NEG_INFINITY);
        let block_max = k.max_of(s);
        if block_max == f32::NEG_INFINITY {
            s.fill(0.0);
            continue;
        }
        let m = part.max[r].max(block_max);
        let alpha = k.exp2(part.max[r] - m);
        part.max[r] = m;
        if alpha != 1.0 {
            part.sum[r] *= alpha;
            part.acc[r * d..(r + 1) * d]
                .iter_mut()
                .for_each(|a| *a *= alpha);
            if let Some(natural) = part.natural_acc.get_mut(r * d..(r + 1) * d) {
                natural.iter_mut().for_each(|a| *a *= alpha);
            }
        }
        part.sum[r] += k.exp2_shifted_sum(s, m);
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
pub(super) use for_row_groups;

/// Walks `$n` tokens two at a time, stepping `$prefetch` before each pair, then the last one
/// alone, binding `$t0` to the first token and the constant `$tt` to how many: each key row
/// decoded once feeds every query row of its pair.
macro_rules! for_token_pairs {
    ($k:expr, $n:expr, $prefetch:expr, |$t0:ident, $tt:ident| $body:expr) => {{
        let n = $n;
        let mut $t0 = 0;
        while $t0 + 2 <= n {
            $prefetch.step($k);
            const $tt: usize = 2;
            $body;
            $t0 += 2;
        }
        if $t0 < n {
            const $tt: usize = 1;
            $body;
        }
    }};
}
pub(super) use for_token_pairs;

/// The lane sums of a `TT × QR` tile of dot-product accumulators (token `i`, row `j` at
/// `i · QR + j`), in one [`Kernel::hsum8`].
#[inline(always)]
pub(super) fn tile_sums<K: Kernel, const QR: usize, const TT: usize>(
    k: K,
    acc: &[[K::V; QR]; TT],
) -> [f32; 8] {
    const { assert!(QR * TT <= 8) };
    let mut all = [k.splat(0.0); 8];
    for (i, acc) in acc.iter().enumerate() {
        all[i * QR..(i + 1) * QR].copy_from_slice(acc);
    }
    k.hsum8(all)
}

/// `scores[r][t] = q[r] · key[t]` for every query row and the block's `n` tokens, up to four
/// rows per pass so each key row is decoded once per four query rows. `q` is in the rows'
/// order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn score_block<K: Kernel, R: Rows>(
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
pub(super) fn score_loop<K: Kernel, R: Rows>(
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
pub(super) fn score_rows<K: Kernel, R: Rows, const QR: usize>(
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
    assert!(q.len() >= (r0 + QR) * d && d.is_multiple_of(R::CHUNK.max(16)) && n <= g);
    assert!(scores.len() >= (r0 + QR) * g);
    for_token_pairs!(k, n, prefetch, |t, TT| score_tokens::<K, R, QR, TT>(
        k, rows, d, q, r0, t, scores, g
    ));
}

/// `scores[r][t0 + i] = q[r] · key[t0 + i]` for `QR` rows and `TT` tokens, sixteen positions
/// per multiply-add; the caller checks that the rows, tokens and scores are in range and that
/// `d` is a multiple of `R::CHUNK` and of 16.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn score_tokens<K: Kernel, R: Rows, const QR: usize, const TT: usize>(
    k: K,
    rows: &R,
    d: usize,
    q: &[f32],
    r0: usize,
    t0: usize,
    scores: &mut [f32],
    g: usize,
) {
    let step = R::CHUNK.max(16);
    let qp = q.as_ptr();
    let mut acc = [[k.wsplat(0.0); QR]; TT];
    for c0 in (0..d).step_by(step) {
        for pass in 0..step / 16 {
            // SAFETY: `t0 + TT <= n`, `c0` is a multiple of `step` and
            // `c0 + 16·pass + 16 <= d` (`Rows::row16`'s contract); query row `r0 + i` lies within
            // `q` (checked by `score_rows`).
            unsafe {
                // A plain loop, not `array::from_fn`: a closure the compiler leaves out of
                // line is compiled without AVX2 and turns every intrinsic into a call.
                let mut keys = [k.wsplat(0.0); TT];
                for (i, key) in keys.iter_mut().enumerate() {
                    *key = rows.row16(k, t0 + i, c0, pass);
                }
                for i in 0..QR {
                    let qv = k.wload_ptr(qp.add((r0 + i) * d + c0 + 16 * pass));
                    for (acc, key) in acc.iter_mut().zip(keys) {
                        acc[i] = k.wfmadd(qv, key, acc[i]);
                    }
                }
            }
        }
    }
    const { assert!(QR * TT <= 8) };
    let mut all = [k.wsplat(0.0); 8];
    for (i, acc) in acc.iter().enumerate() {
        all[i * QR..(i + 1) * QR].copy_from_slice(acc);
    }
    let sums = k.wsum8(all);
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
pub(super) fn accumulate_block<K: Kernel, R: Rows>(
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
pub(super) fn accumulate_loop<K: Kernel, R: Rows>(
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

/// [`Kernel::VALUE_PASS`] positions per pass (16 or 32), one or two [`Kernel::W`] per row:
/// each weight broadcast feeds one or two 16-lane FMAs, and the accumulators are independent
/// chains across the tokens, enough of them to keep the FMA units busy (two 8-lane chains per
/// row with 16 registers, two 16-lane ones with 32).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn accumulate_rows<K: Kernel, R: Rows, const QR: usize>(
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
    const { assert!(K::VALUE_PASS == 16 || K::VALUE_PASS == 32) };
    let halves = K::VALUE_PASS / 16;
    let step = R::CHUNK.max(16);
    assert!(w.len() >= (r0 + QR) * g && n <= g && acc.len() >= (r0 + QR) * d);
    assert!(d.is_multiple_of(step) && d.is_multiple_of(K::VALUE_PASS));
    let (wp, ap) = (w.as_ptr(), acc.as_mut_ptr());
    for c in (0..d).step_by(K::VALUE_PASS) {
        for _ in 0..halves {
            prefetch.step(k);
        }
        // SAFETY: by the asserts above, weight `(r0 + j)·g + t` with `t < n <= g` lies in
        // `w` and accumulator `(r0 + j)·d + c .. + VALUE_PASS` in `acc`; each `row16` reads
        // positions `c + 16h .. + 16 <= d` of token `t < n`, named by a multiple of `step`
        // and its pass, which is `row16`'s contract.
        unsafe {
            let mut a = [[k.wsplat(0.0); 2]; QR];
            for (j, a) in a.iter_mut().enumerate() {
                for (h, a) in a.iter_mut().enumerate().take(halves) {
                    *a = k.wload_ptr(ap.add((r0 + j) * d + c + 16 * h));
                }
            }
            for t in 0..n {
                let mut value = [k.wsplat(0.0); 2];
                for (h, v) in value.iter_mut().enumerate().take(halves) {
                    let at = c + 16 * h;
                    *v = rows.row16(k, t, at - at % step, at % step / 16);
                }
                for (j, a) in a.iter_mut().enumerate() {
                    let wt = k.wsplat(*wp.add((r0 + j) * g + t));
                    for (a, v) in a.iter_mut().zip(value).take(halves) {
                        *a = k.wfmadd(wt, v, *a);
                    }
                }
            }
            for (j, a) in a.into_iter().enumerate() {
                for (h, a) in a.into_iter().enumerate().take(halves) {
                    k.wstore_ptr(a, ap.add((r0 + j) * d + c + 16 * h));
                }
            }
        }
    }
}

/// Writes the first `n` dequantized rows into `out` (`n × d`), in natural channel order (the
/// rows' order is `order`).
#[inline(always)]
pub(super) fn decode_block<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    order: Order,
    n: usize,
    d: usize,
    out: &mut [f32],
) {
    // Positions are regrouped into channels in groups of 8 vectors at most: 16 positions for
    // nibbles (even channels, then odd), 32 for crumbs (channels 4i, 4i + 1, 4i + 2, 4i + 3).
    let group = match order {
        Order::Natural => 8,
        Order::Nibbles => 16,
        Order::Crumbs => 32,
    };
    assert!(out.len() >= n * d && d.is_multiple_of(R::CHUNK));
    assert!(R::CHUNK.is_multiple_of(group));
    let row = |t: usize, c0: usize, j: usize| {
        // SAFETY: `t < n`, `c0` a multiple of `CHUNK`, and `j < CHUNK / 8`, so
        // `c0 + 8j + 8 <= d`.
        unsafe { rows.row8(k, t, c0, j) }
    };
    for (t, out) in out.chunks_exact_mut(d).take(n).enumerate() {
        for c0 in (0..d).step_by(R::CHUNK) {
            for j in (0..R::CHUNK / 8).step_by(group / 8) {
                let at = c0 + 8 * j;
                match order {
                    Order::Natural => k.store(row(t, c0, j), &mut out[at..]),
                    Order::Nibbles => {
                        let (lo, hi) = k.interleave(row(t, c0, j), row(t, c0, j + 1));
                        k.store(lo, &mut out[at..]);
                        k.store(hi, &mut out[at + 8..]);
                    }
                    Order::Crumbs => {
                        // Channels 4i and 4i + 2 alternated, then 4i + 1 and 4i + 3: the two
                        // alternated again are the channels in order.
                        let even = k.interleave(row(t, c0, j), row(t, c0, j + 2));
                        let odd = k.interleave(row(t, c0, j + 1), row(t, c0, j + 3));
                        let (a, b) = k.interleave(even.0, odd.0);
                        let (c, e) = k.interleave(even.1, odd.1);
                        for (i, v) in [a, b, c, e].into_iter().enumerate() {
                            k.store(v, &mut out[at + 8 * i..]);
                        }
                    }
                }
            }
        }
    }
}

/// The dense (clipped, quantized) value of channel `c` of token `t`, computed exactly as the
/// vector loops compute it, so an outlier correction `exact − dense` restores `exact`.
#[inline(always)]
pub(super) fn dense_value<K: Kernel, R: Rows>(
    k: K,
    rows: &R,
    order: Order,
    t: usize,
    c: usize,
) -> f32 {
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
    use super::super::super::simd::{Portable, dispatch};
    use super::*;
    use crate::rope::Rope;
    use crate::synth::Rng;

    struct Rotate<'a> {
        rope: &'a RopeTable,
        rows: Vec<f32>,
        d: usize,
        first: usize,
    }

    impl KernelFn<Vec<f32>> for Rotate<'_> {
        fn call<K: Kernel>(mut self, k: K) -> Vec<f32> {
            rotate_rows(k, self.rope, &mut self.rows, self.d, self.first);
            self.rows
        }
    }

    struct Fold<'a> {
        order: Order,
        pairs: &'a [u8],
        q: &'a [f32],
        d: usize,
    }

    impl KernelFn<(Vec<f32>, Vec<f32>)> for Fold<'_> {
        fn call<K: Kernel>(self, k: K) -> (Vec<f32>, Vec<f32>) {
            let (mut folded, mut bias) = (Vec::new(), Vec::new());
            fold_chan_page(
                k,
                self.order,
                self.pairs,
                self.q,
                self.d,
                &mut folded,
                &mut bias,
            );
            (folded, bias)
        }
    }

    /// The fold of a per-channel page on every instruction set: each folded element is the
    /// query times its channel's scale to the bit, each bias the query's dot product with the
    /// minimums, for 11 rows (a group of eight and a partial one) in both low-bit orders.
    #[test]
    fn pages_fold_into_the_query_rows() {
        let mut rng = Rng::new(11);
        let (d, rows) = (128, 11);
        let pairs: Vec<u8> = (0..2 * d)
            .flat_map(|_| half::f16::from_f32(rng.normal()).to_le_bytes())
            .collect();
        let q: Vec<f32> = (0..rows * d).map(|_| rng.normal()).collect();
        for order in [Order::Nibbles, Order::Crumbs] {
            let mut planar = vec![0.0; 2 * d];
            planar_params(Portable, order, &pairs, &mut planar);
            let (scales, mins) = planar.split_at(d);
            let job = || Fold {
                order,
                pairs: &pairs,
                q: &q,
                d,
            };
            for (folded, bias) in [job().call(Portable), dispatch(job())] {
                assert_eq!(bias.len(), rows);
                for (r, row) in q.chunks_exact(d).enumerate() {
                    for p in 0..d {
                        assert_eq!(folded[r * d + p], row[p] * scales[p], "{order:?} {r} {p}");
                    }
                    let exact: f64 = row
                        .iter()
                        .zip(mins)
                        .map(|(&x, &m)| x as f64 * m as f64)
                        .sum();
                    let magnitude: f64 = row
                        .iter()
                        .zip(mins)
                        .map(|(&x, &m)| (x * m).abs() as f64)
                        .sum();
                    assert!(
                        (bias[r] as f64 - exact).abs() <= 1e-6 * magnitude,
                        "{order:?} {r}: {} against {exact}",
                        bias[r]
                    );
                }
            }
        }
    }

    /// Both instruction sets give `RopeTable::rotate`'s bits, for both layouts and every
    /// head_dim, at positions where the angles are large.
    #[test]
    fn rows_rotate_as_the_table_does() {
        let mut rng = Rng::new(7);
        for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
            for d in [64, 128, 256] {
                let rope = RopeTable::new(
                    Rope {
                        base: 10000.0,
                        layout,
                    },
                    d,
                    5000,
                );
                let (n, first) = (5, 4093);
                let rows: Vec<f32> = (0..n * d).map(|_| 3.0 * rng.normal()).collect();
                let mut expected = rows.clone();
                for (t, row) in expected.chunks_exact_mut(d).enumerate() {
                    rope.rotate(row, first + t);
                }
                let job = |rows: &Vec<f32>| Rotate {
                    rope: &rope,
                    rows: rows.clone(),
                    d,
                    first,
                };
                for got in [job(&rows).call(Portable), dispatch(job(&rows))] {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&expected), "{layout:?} d {d}");
                }
            }
        }
    }
}

//! `iq` key scores: the query rounded to int8 per 32-channel block once per work item
//! (`quant::quantize_query`), and each key block scored as an integer dot product of its codes
//! with the query block, weighted by the product of the two blocks' scales, as llama.cpp's CPU
//! vec-dot kernels do. The key codes are never converted to f32.
//!
//! 8-bit keys (`q8`, `q8_0`) are read a token at a time: each query row takes an integer dot
//! product of 32 codes, its conversion and one FMA with the block's weight. 4- and 2-bit keys
//! (`q*_tok`) are read sixteen tokens at a time in the token-lane layout ([`Kernel::I`]): their
//! packed rows transposed so that each 32-bit lane holds four bytes of one token, the code
//! fields masked out of them once for all query rows, and one `dot4` per four channels and
//! row multiplies sixteen tokens' codes by the same four query bytes, so that each score ends
//! in its token's lane; the weights (the tokens' group scales) are one vector per block.
//!
//! Per-channel keys (`q*_chan`) have no per-token scale: each page's channel scales are folded
//! into the query (`q ∘ s`, [`super::loops::fold_chan_page`]), and it is that folded query
//! which is rounded, once per page and row ([`ChanQuery`]), and dotted with the bare codes in
//! the same token-lane loop, weighted by its block scales alone; the minimums stay an f32 bias
//! per row and page.
//!
//! What is computed is exactly `q̂ · k̂`, the dequantized key against the dequantized query
//! `q̂ = s·c` (the minimum term of the asymmetric formats included), up to f32 summation order;
//! the work item's f32 rows are `q̂` too (sinks, open pages, outlier corrections), so the whole
//! step is the attention of `q̂`. For per-channel keys it is `Σ_b S_b (ĉ_b · codes_b) + q · m`
//! per page, `ĉ_b` and `S_b` the int8 codes and scale of block `b` of the page's `q ∘ s`; the
//! step's f32 rows stay exact.

use crate::quant::QUERY_BLOCK;
use crate::scheme::{Format, LowBits, Q8_0_BLOCK_BYTES};

use super::super::simd::{Kernel, KernelFn};
use super::decode::Packed;
use super::loops::{Prefetch, for_token_pairs, tile_sums};
use super::view::StreamBlock;

/// The query rows of one (query, KV head) rounded to int8 per [`QUERY_BLOCK`] channels, in
/// natural channel order.
pub(crate) struct IntQuery {
    /// `rows × head_dim`.
    pub(crate) codes: Vec<i8>,
    /// `rows × head_dim / 32`, each times the softmax scale and `log2(e)`.
    pub(crate) scales: Vec<f32>,
}

/// A work item's [`IntQuery`] laid out for the key format's loop, with the dequantized query's
/// sum over each key group (the minimum term of `q*_tok` keys).
pub(super) struct KeyOrderQuery<'a> {
    /// 8-bit keys: the codes as bytes, `rows × d`, in channel order.
    codes: Vec<u8>,
    /// 4- and 2-bit keys: per row and 32-channel block, the four query bytes of each of the
    /// block's 8 `dot4`s, `rows × d / 32 × 8` (see [`lane_channel`]).
    dwords: Vec<i32>,
    /// The query's block scales, as rounded.
    scales: &'a [f32],
    /// `rows × groups`: `Σ_{c ∈ group} q̂_c` of the dequantized (scaled) query.
    group_sums: Vec<f32>,
    groups: usize,
}

/// The channel of a 32-channel block of `BITS`-bit codes that byte `i` of the block's `dot4`
/// number `m` multiplies, in the token-lane loop: dot `m` takes field `m / BITS` (bits
/// `BITS · field ..`) of each byte of the block's dword `m % BITS`; byte `b` of a block holds
/// channels `(8 / BITS) · b + field`.
fn lane_channel(bits: usize, m: usize, i: usize) -> usize {
    let (field, word) = (m / bits, m % bits);
    (8 / bits) * (4 * word + i) + field
}

impl<'a> KeyOrderQuery<'a> {
    /// For keys of `format` (one that `Scheme::int_query_applies` accepts) at head_dim `d`.
    pub(super) fn new(q: &'a IntQuery, format: Format, d: usize) -> Self {
        let (blocks, rows) = (d / QUERY_BLOCK, q.codes.len() / d);
        let (codes, dwords, group) = match format {
            Format::Tok { bits, group } => {
                let bits = bits.bits();
                let dwords = (0..rows * blocks)
                    .flat_map(|rb| {
                        let block = &q.codes[rb * QUERY_BLOCK..(rb + 1) * QUERY_BLOCK];
                        (0..8).map(move |m| {
                            i32::from_le_bytes(std::array::from_fn(|i| {
                                block[lane_channel(bits, m, i)] as u8
                            }))
                        })
                    })
                    .collect();
                (Vec::new(), dwords, group.size(d))
            }
            _ => (q.codes.iter().map(|&c| c as u8).collect(), Vec::new(), d),
        };
        let groups = d / group;
        let group_sums = q
            .codes
            .chunks_exact(d)
            .zip(q.scales.chunks_exact(blocks))
            .flat_map(|(row, scales)| {
                (0..groups).map(move |gr| {
                    (gr * group / QUERY_BLOCK..(gr + 1) * group / QUERY_BLOCK)
                        .map(|b| {
                            let c = &row[b * QUERY_BLOCK..(b + 1) * QUERY_BLOCK];
                            scales[b] * c.iter().map(|&x| i32::from(x)).sum::<i32>() as f32
                        })
                        .sum::<f32>()
                })
            })
            .collect();
        KeyOrderQuery {
            codes,
            dwords,
            scales: &q.scales,
            group_sums,
            groups,
        }
    }
}

impl KeyOrderQuery<'_> {
    fn lanes(&self) -> LaneQuery<'_> {
        LaneQuery {
            dwords: &self.dwords,
            scales: self.scales,
            group_sums: &self.group_sums,
        }
    }
}

/// What the token-lane loop reads of an int8 query: per row and 32-channel block, the query
/// bytes of the block's 8 `dot4`s (see [`lane_channel`]) and the block's scale, and per row and
/// key group the dequantized query's sum (per-token keys only).
#[derive(Clone, Copy)]
struct LaneQuery<'a> {
    dwords: &'a [i32],
    scales: &'a [f32],
    group_sums: &'a [f32],
}

/// The rows of one page's folded query `q ∘ s` (per-channel keys, in the codes' order) rounded
/// to int8 per 32-channel block for the token-lane loop: scratch space that each page refills.
#[derive(Default)]
pub(super) struct ChanQuery {
    dwords: Vec<i32>,
    scales: Vec<f32>,
}

impl ChanQuery {
    /// Rounds `folded` (rows of `d` in the [`Order`] of `bits`-bit codes, as
    /// `fold_chan_page` writes them) block by block, as `quant::quantize_query` rounds the same
    /// rows in channel order: a block's channels are the same set in either order.
    #[inline(always)]
    pub(super) fn round<K: Kernel>(&mut self, k: K, bits: LowBits, folded: &[f32], d: usize) {
        assert!(d.is_multiple_of(QUERY_BLOCK) && folded.len().is_multiple_of(d));
        let blocks = folded.len() / QUERY_BLOCK;
        self.dwords.resize(8 * blocks, 0);
        self.scales.resize(blocks, 0.0);
        // The vectors of a block in the `dot4` order of `lane_channel`: 4-bit codes' order
        // holds each 16 channels' even ones, then their odd ones, and the dots want the
        // block's 16 even channels, then its 16 odd ones; 2-bit codes' order is the dots'.
        let vectors = match bits {
            LowBits::Four => [0, 2, 1, 3],
            LowBits::Two => [0, 1, 2, 3],
        };
        for b in 0..blocks {
            // A loop, not `array::map`, whose closure would not take the kernel's target
            // features.
            let mut x = [k.splat(0.0); 4];
            for (x, v) in x.iter_mut().zip(vectors) {
                // SAFETY: block `b < blocks` holds 32 floats of `folded`, 8 per load.
                *x = unsafe { k.load_ptr(folded.as_ptr().add(QUERY_BLOCK * b + 8 * v)) };
            }
            let (scale, dwords) = k.round_query_block(x);
            self.scales[b] = scale;
            self.dwords[8 * b..8 * b + 8].copy_from_slice(&dwords);
        }
    }

    fn lanes(&self) -> LaneQuery<'_> {
        LaneQuery {
            dwords: &self.dwords,
            scales: &self.scales,
            group_sums: &[],
        }
    }
}

/// `scores[r][t] = Σ_b S_b (ĉ_b · codes_b[t])` for the `n` keys of per-channel page `s` and
/// every row of the page's rounded folded query `q` (the rows' biases `q · m` are the
/// caller's).
#[inline(always)]
pub(super) fn chan_int_score_block<K: Kernel>(
    k: K,
    s: &StreamBlock<'_>,
    n: usize,
    q: &ChanQuery,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    let Format::Chan { bits } = s.format else {
        unreachable!("per-channel keys, not {}", s.format)
    };
    assert!(s.book.is_none() && s.row_bytes == s.format.row_bytes(s.head_dim));
    let keys = TokLanes {
        rows: &s.rows[..n * s.row_bytes],
        row_bytes: s.row_bytes,
        n,
        params: &[],
        groups: 0,
        blocks_shift: 0,
    };
    let q = q.lanes();
    match bits {
        LowBits::Four => run_lanes::<K, 4, false>(k, &keys, s.head_dim, q, scores, g, prefetch),
        LowBits::Two => run_lanes::<K, 2, false>(k, &keys, s.head_dim, q, scores, g, prefetch),
    }
}

/// 8-bit key rows as 32-code blocks with one weight per block.
trait IntKeys {
    /// One scale per token (`q8`): applied once to the finished score, not per block.
    const TOKEN_SCALE: bool;

    /// The codes of positions `32b .. 32b + 32` of token `t`.
    ///
    /// # Safety
    /// `t < n` and `32b + 32 <= d`.
    unsafe fn codes<K: Kernel>(&self, k: K, t: usize, b: usize) -> K::B;

    /// The key's scale of block `b` of token `t`.
    ///
    /// # Safety
    /// As [`codes`](Self::codes).
    unsafe fn scale(&self, t: usize, b: usize) -> f32;
}

/// `q8`: int8 codes, one scale per token.
struct Q8Keys<'a> {
    packed: Packed<'a>,
    scales: &'a [f32],
}

impl IntKeys for Q8Keys<'_> {
    const TOKEN_SCALE: bool = true;

    #[inline(always)]
    unsafe fn codes<K: Kernel>(&self, k: K, t: usize, b: usize) -> K::B {
        // SAFETY: a row holds `d` bytes; the caller keeps `32b + 32 <= d`.
        unsafe { k.bytes32(self.packed.at(t, QUERY_BLOCK * b)) }
    }

    #[inline(always)]
    unsafe fn scale(&self, t: usize, _b: usize) -> f32 {
        // SAFETY: one scale per token, checked where built.
        unsafe { *self.scales.get_unchecked(t) }
    }
}

/// `q8_0`: blocks of `{f16 d; i8 qs[32]}`.
struct Q80Keys<'a> {
    packed: Packed<'a>,
    scales: &'a [f32],
    blocks: usize,
}

impl IntKeys for Q80Keys<'_> {
    const TOKEN_SCALE: bool = false;

    #[inline(always)]
    unsafe fn codes<K: Kernel>(&self, k: K, t: usize, b: usize) -> K::B {
        // SAFETY: block `b < d / 32` of the row holds 2 + 32 bytes.
        unsafe { k.bytes32(self.packed.at(t, b * Q8_0_BLOCK_BYTES + 2)) }
    }

    #[inline(always)]
    unsafe fn scale(&self, t: usize, b: usize) -> f32 {
        // SAFETY: `n × blocks` scales, checked where built.
        unsafe { *self.scales.get_unchecked(t * self.blocks + b) }
    }
}

/// `scores[r][t] = q̂[r] · key[t]` for the block's `n` keys of stream block `s` (in the key
/// format of an `iq` scheme) and every query row of `q`; `params` is scratch space.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn int_score_block<K: Kernel>(
    k: K,
    s: &StreamBlock<'_>,
    n: usize,
    q: &KeyOrderQuery<'_>,
    params: &mut Vec<f32>,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    let d = s.head_dim;
    assert!(s.book.is_none() && s.row_bytes == s.format.row_bytes(d));
    assert!(d.is_multiple_of(QUERY_BLOCK) && q.scales.len().is_multiple_of(d / QUERY_BLOCK));
    s.params_f32(k, n, params);
    let packed = Packed::new(s.rows, s.row_bytes, n);
    let blocks = d / QUERY_BLOCK;
    match s.format {
        Format::Q8 => {
            assert!(params.len() >= n);
            let keys = Q8Keys {
                packed,
                scales: params,
            };
            run_loops(k, &keys, n, d, q, scores, g, prefetch);
        }
        Format::Q8_0 => {
            assert!(params.len() >= n * blocks);
            let keys = Q80Keys {
                packed,
                scales: params,
                blocks,
            };
            run_loops(k, &keys, n, d, q, scores, g, prefetch);
        }
        Format::Tok { bits, group } => {
            let group = group.size(d);
            assert!(group.is_power_of_two() && group >= QUERY_BLOCK && d / group == q.groups);
            // Whole runs of 16 tokens: the last run's padding tokens get zero parameters.
            params.resize(2 * q.groups * n.next_multiple_of(LANES), 0.0);
            let keys = TokLanes {
                rows: &s.rows[..n * s.row_bytes],
                row_bytes: s.row_bytes,
                n,
                params,
                groups: q.groups,
                blocks_shift: (group / QUERY_BLOCK).trailing_zeros(),
            };
            let q = q.lanes();
            match bits {
                LowBits::Four => run_lanes::<K, 4, true>(k, &keys, d, q, scores, g, prefetch),
                LowBits::Two => run_lanes::<K, 2, true>(k, &keys, d, q, scores, g, prefetch),
            }
        }
        f => unreachable!("iq schemes are validated to have integer keys, not {f}"),
    }
}

/// The loops of [`int_score_block`] for 8-bit keys, a function of their own per key format
/// and head_dim.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn run_loops<K: Kernel, R: IntKeys>(
    k: K,
    keys: &R,
    n: usize,
    d: usize,
    q: &KeyOrderQuery<'_>,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    struct Loop<'s, 'p, R, const D: usize> {
        keys: &'s R,
        n: usize,
        q: &'s KeyOrderQuery<'s>,
        scores: &'s mut [f32],
        g: usize,
        prefetch: &'s mut Prefetch<'p>,
    }
    impl<R: IntKeys, const D: usize> KernelFn<()> for Loop<'_, '_, R, D> {
        #[inline(always)]
        fn call<K: Kernel>(self, k: K) {
            let mut prefetch = *self.prefetch;
            let rows = self.q.codes.len() / D;
            super::loops::for_row_groups!(rows, |r0, QR| int_score_rows::<K, R, QR>(
                k,
                self.keys,
                self.n,
                D,
                self.q,
                r0,
                self.scores,
                self.g,
                &mut prefetch
            ));
            *self.prefetch = prefetch;
        }
    }
    super::loops::with_head_dim!(d, |D| k.run(Loop::<R, D> {
        keys,
        n,
        q,
        scores,
        g,
        prefetch
    }));
}

/// Tokens two at a time, as the f32 score loop: each query block load feeds two keys.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_score_rows<K: Kernel, R: IntKeys, const QR: usize>(
    k: K,
    keys: &R,
    n: usize,
    d: usize,
    q: &KeyOrderQuery<'_>,
    r0: usize,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    let blocks = d / QUERY_BLOCK;
    assert!(q.codes.len() >= (r0 + QR) * d && q.scales.len() >= (r0 + QR) * blocks);
    assert!(n <= g && scores.len() >= (r0 + QR) * g);
    for_token_pairs!(k, n, prefetch, |t, TT| int_score_tokens::<K, R, QR, TT>(
        k, keys, d, q, r0, t, scores, g
    ));
}

/// `scores[r][t0 + i] = q̂[r] · key[t0 + i]` for `QR` rows and `TT` tokens; the caller checks
/// the ranges.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_score_tokens<K: Kernel, R: IntKeys, const QR: usize, const TT: usize>(
    k: K,
    keys: &R,
    d: usize,
    q: &KeyOrderQuery<'_>,
    r0: usize,
    t0: usize,
    scores: &mut [f32],
    g: usize,
) {
    let blocks = d / QUERY_BLOCK;
    let mut acc = [[k.splat(0.0); QR]; TT];
    for b in 0..blocks {
        // SAFETY: `t0 + TT <= n` and `32b + 32 <= d`; query row `r0 + j` and its block scales
        // lie within `q` (checked by `int_score_rows`).
        unsafe {
            let mut codes = [keys.codes(k, t0, b); TT];
            let mut weight = [keys.scale(t0, b); TT];
            for i in 1..TT {
                codes[i] = keys.codes(k, t0 + i, b);
                weight[i] = keys.scale(t0 + i, b);
            }
            for j in 0..QR {
                let row = r0 + j;
                let qv = k.bytes32(q.codes.as_ptr().add(row * d + QUERY_BLOCK * b));
                let qs = *q.scales.get_unchecked(row * blocks + b);
                for (acc, (&codes, &weight)) in acc.iter_mut().zip(codes.iter().zip(&weight)) {
                    let w = if R::TOKEN_SCALE { qs } else { qs * weight };
                    acc[j] = k.fmadd(k.dot_i8_i8(codes, qv), k.splat(w), acc[j]);
                }
            }
        }
    }
    let sums = tile_sums(k, &acc);
    let sp = scores.as_mut_ptr();
    for i in 0..TT {
        let t = t0 + i;
        // SAFETY: `t < n`; `int_score_rows` checked that `scores` holds the rows' `g` scores,
        // with `t < n <= g`.
        unsafe {
            let token_scale = if R::TOKEN_SCALE {
                keys.scale(t, 0)
            } else {
                1.0
            };
            for j in 0..QR {
                *sp.add((r0 + j) * g + t) = sums[i * QR + j] * token_scale;
            }
        }
    }
}

/// Tokens per run of the token-lane loop: the lanes of [`Kernel::I`] and [`Kernel::W`].
const LANES: usize = 16;

/// The widest packed row of a `q*_tok` key: 4-bit codes at head_dim 256.
const MAX_TOK_ROW: usize = 128;

/// 4- and 2-bit keys for the token-lane loop: `q*_tok` keys with their parameters, or the bare
/// codes of a `q*_chan` page (no parameters, no groups).
struct TokLanes<'a> {
    /// `n` packed rows of `row_bytes`.
    rows: &'a [u8],
    row_bytes: usize,
    n: usize,
    /// `(scale, min)` per token and group, for `n` rounded up to a multiple of [`LANES`]
    /// (`q*_tok` keys).
    params: &'a [f32],
    groups: usize,
    /// log2 of the query blocks per group.
    blocks_shift: u32,
}

/// The token-lane loop of [`int_score_block`] for `BITS`-bit keys (with per-token parameters
/// where `TOKEN_PARAMS`, else the bare codes of a per-channel page), a function of its own per
/// width and head_dim.
#[inline(always)]
fn run_lanes<K: Kernel, const BITS: usize, const TOKEN_PARAMS: bool>(
    k: K,
    keys: &TokLanes<'_>,
    d: usize,
    q: LaneQuery<'_>,
    scores: &mut [f32],
    g: usize,
    prefetch: &mut Prefetch<'_>,
) {
    struct Loop<'s, 'p, const BITS: usize, const D: usize, const TOKEN_PARAMS: bool> {
        keys: &'s TokLanes<'s>,
        q: LaneQuery<'s>,
        scores: &'s mut [f32],
        g: usize,
        prefetch: &'s mut Prefetch<'p>,
    }
    impl<const BITS: usize, const D: usize, const TOKEN_PARAMS: bool> KernelFn<()>
        for Loop<'_, '_, BITS, D, TOKEN_PARAMS>
    {
        #[inline(always)]
        fn call<K: Kernel>(self, k: K) {
            let (keys, q) = (self.keys, self.q);
            let rows = q.scales.len() / (D / QUERY_BLOCK);
            assert!(D * BITS / 8 == keys.row_bytes && D * BITS / 8 <= MAX_TOK_ROW);
            assert!(keys.rows.len() == keys.n * keys.row_bytes);
            assert!(keys.params.len() >= 2 * keys.groups * keys.n.next_multiple_of(LANES));
            assert!(q.dwords.len() == rows * D / QUERY_BLOCK * 8);
            assert!(q.group_sums.len() == rows * keys.groups);
            assert!(keys.n <= self.g && self.scores.len() >= rows * self.g);
            let mut padded = [0u8; LANES * MAX_TOK_ROW];
            for t0 in (0..keys.n).step_by(LANES) {
                // Prefetch at the f32 loop's pace, one step per two tokens.
                for _ in 0..LANES / 2 {
                    self.prefetch.step(k);
                }
                let left = keys.n - t0;
                let runs = if left >= LANES {
                    &keys.rows[t0 * keys.row_bytes..(t0 + LANES) * keys.row_bytes]
                } else {
                    // The last, partial run: its rows, then zero codes.
                    let (rows, rest) = padded.split_at_mut(left * keys.row_bytes);
                    rows.copy_from_slice(&keys.rows[t0 * keys.row_bytes..]);
                    rest.fill(0);
                    &padded[..LANES * keys.row_bytes]
                };
                super::loops::for_row_groups!(rows, |r0, QR| lane_scores::<
                    K,
                    BITS,
                    D,
                    QR,
                    TOKEN_PARAMS,
                >(
                    k,
                    keys,
                    runs,
                    t0,
                    q,
                    r0,
                    self.scores,
                    self.g
                ));
            }
        }
    }
    super::loops::with_head_dim!(d, |D| k.run(Loop::<BITS, D, TOKEN_PARAMS> {
        keys,
        q,
        scores,
        g,
        prefetch
    }));
}

/// `scores[r][t0 + t] = q̂[r] · key[t0 + t]` for `QR` query rows from `r0` and the 16 tokens
/// whose packed rows are `runs` (past `n`, zero codes, whose scores are not stored); without
/// `TOKEN_PARAMS`, the blocks' integer dots weighted by the query's block scales alone.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn lane_scores<
    K: Kernel,
    const BITS: usize,
    const D: usize,
    const QR: usize,
    const TOKEN_PARAMS: bool,
>(
    k: K,
    keys: &TokLanes<'_>,
    runs: &[u8],
    t0: usize,
    q: LaneQuery<'_>,
    r0: usize,
    scores: &mut [f32],
    g: usize,
) {
    let blocks = D / QUERY_BLOCK;
    let (mask, per_run) = ((1u8 << BITS) - 1, 4 / BITS);
    let stride = 2 * keys.groups;
    assert!(runs.len() == LANES * keys.row_bytes && keys.row_bytes == D * BITS / 8);
    assert!(q.dwords.len() >= (r0 + QR) * blocks * 8 && q.scales.len() >= (r0 + QR) * blocks);
    assert!(q.group_sums.len() >= (r0 + QR) * keys.groups);
    assert!(keys.params.len() >= stride * (t0 + LANES));
    let mut score = [k.wsplat(0.0); QR];
    // Each 16-byte run of the rows holds `per_run` blocks of 32 channels.
    for run in 0..D * BITS / 128 {
        // SAFETY: each of the 16 rows of `runs` holds `row_bytes = D·BITS/8` bytes, of which
        // this run is the 16 at `16·run` (checked above).
        let words = unsafe { k.dwords16(runs.as_ptr().add(16 * run), keys.row_bytes) };
        for u in 0..per_run {
            let b = run * per_run + u;
            let fields: [K::I; 8] = std::array::from_fn(|m| {
                let (field, word) = (m / BITS, m % BITS);
                k.byte_field(words[BITS * u + word], (BITS * field) as u32, mask)
            });
            let group = b >> keys.blocks_shift;
            let key_scale = if TOKEN_PARAMS {
                // SAFETY: tokens `t0 .. t0 + 16` have `stride` parameters each (checked above).
                Some(unsafe {
                    k.wgather(keys.params.as_ptr().add(stride * t0 + 2 * group), stride)
                })
            } else {
                None
            };
            for (j, score) in score.iter_mut().enumerate() {
                let row = (r0 + j) * blocks + b;
                let mut acc = k.izero();
                for (m, &field) in fields.iter().enumerate() {
                    // SAFETY: `row · 8 + m < (r0 + QR) · blocks · 8` (checked above).
                    acc = k.dot4(acc, field, unsafe { *q.dwords.get_unchecked(8 * row + m) });
                }
                // SAFETY: `row < (r0 + QR) · blocks` (checked above).
                let weight = k.wsplat(unsafe { *q.scales.get_unchecked(row) });
                let weight = key_scale.map_or(weight, |key| k.wmul(key, weight));
                *score = k.wfmadd(k.i_to_f32(acc), weight, *score);
            }
        }
    }
    for group in 0..keys.groups {
        // SAFETY: as for the scales above.
        let min = unsafe {
            k.wgather(
                keys.params.as_ptr().add(stride * t0 + 2 * group + 1),
                stride,
            )
        };
        for (j, score) in score.iter_mut().enumerate() {
            // SAFETY: `(r0 + j) · groups + group` is below the checked length.
            let sum = unsafe { *q.group_sums.get_unchecked((r0 + j) * keys.groups + group) };
            *score = k.wfmadd(min, k.wsplat(sum), *score);
        }
    }
    let valid = (keys.n - t0).min(LANES);
    let mut lanes = [0f32; LANES];
    for (j, &score) in score.iter().enumerate() {
        let at = (r0 + j) * g + t0;
        if valid == LANES && at + LANES <= scores.len() {
            // SAFETY: 16 floats from `at` lie within `scores`.
            unsafe { k.wstore_ptr(score, scores.as_mut_ptr().add(at)) };
        } else {
            // SAFETY: `lanes` holds 16 floats.
            unsafe { k.wstore_ptr(score, lanes.as_mut_ptr()) };
            scores[at..at + valid].copy_from_slice(&lanes[..valid]);
        }
    }
}

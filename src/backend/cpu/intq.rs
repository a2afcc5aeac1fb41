//! `iq` key scores: the query rounded to int8 per 32-channel block once per work item
//! (`quant::quantize_query`), and each key block scored as an integer dot product of its codes
//! with the query block, weighted by the product of the two blocks' scales, as llama.cpp's CPU
//! vec-dot kernels do. The key codes are never converted to f32: a 32-code block is unpacked
//! once per token (4-bit: a load, a lane permute, a shift and a mask; 2-bit: a broadcast, a
//! shift and a mask), then each query row takes an integer dot product, its conversion and one
//! FMA with the block's weight.
//!
//! What is computed is exactly `q̂ · k̂`, the dequantized key against the dequantized query
//! `q̂ = s·c` (the minimum term of the asymmetric formats included), up to f32 summation order;
//! the work item's f32 rows are `q̂` too (sinks, open pages, outlier corrections), so the whole
//! step is the attention of `q̂`.

use crate::quant::QUERY_BLOCK;
use crate::scheme::{Format, LowBits, Q8_0_BLOCK_BYTES};

use super::super::simd::{Kernel, KernelFn};
use super::decode::{Order, Packed};
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

/// A work item's [`IntQuery`] in the order of the key format's codes, with the dequantized
/// query's sum over each key group (the minimum term of `q*_tok` keys).
pub(super) struct KeyOrderQuery<'a> {
    /// Codes as bytes, `rows × d`.
    codes: Vec<u8>,
    /// The query's block scales, as rounded.
    scales: &'a [f32],
    /// `rows × groups`: `Σ_{c ∈ group} q̂_c` of the dequantized (scaled) query.
    group_sums: Vec<f32>,
    groups: usize,
}

impl<'a> KeyOrderQuery<'a> {
    /// For keys of `format` (one that `Scheme::int_query_applies` accepts) at head_dim `d`.
    pub(super) fn new(q: &'a IntQuery, format: Format, d: usize) -> Self {
        let order = Order::of(format);
        let codes: Vec<u8> = q
            .codes
            .chunks_exact(d)
            .flat_map(|row| (0..d).map(move |p| row[order.channel(p)] as u8))
            .collect();
        let group = match format {
            Format::Tok { group, .. } => group.size(d),
            _ => d,
        };
        let (blocks, groups) = (d / QUERY_BLOCK, d / group);
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
            scales: &q.scales,
            group_sums,
            groups,
        }
    }
}

/// Key rows as 32-code blocks with one weight per block.
trait IntKeys {
    /// int8 codes (`q8`, `q8_0`), else unsigned codes.
    const SIGNED: bool;
    /// One scale per token (`q8`): applied once to the finished score, not per block.
    const TOKEN_SCALE: bool;
    /// Minimums (`q*_tok`): the score has a constant part, [`offset`](Self::offset).
    const OFFSET: bool;

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

    /// The score's constant part, `Σ_g min[t][g] · group_sums[g]`, where [`OFFSET`](Self::OFFSET).
    ///
    /// # Safety
    /// `t < n` and `group_sums` points to this format's groups.
    #[inline(always)]
    unsafe fn offset(&self, t: usize, group_sums: *const f32) -> f32 {
        let _ = (t, group_sums);
        0.0
    }
}

/// `q8`: int8 codes, one scale per token.
struct Q8Keys<'a> {
    packed: Packed<'a>,
    scales: &'a [f32],
}

impl IntKeys for Q8Keys<'_> {
    const SIGNED: bool = true;
    const TOKEN_SCALE: bool = true;
    const OFFSET: bool = false;

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
    const SIGNED: bool = true;
    const TOKEN_SCALE: bool = false;
    const OFFSET: bool = false;

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

/// `q*_tok`: 4- or 2-bit codes, `(scale, min)` per token per group of channels.
struct TokKeys<'a, const BITS: usize> {
    packed: Packed<'a>,
    params: &'a [f32],
    groups: usize,
    /// log2 of the query blocks per group.
    blocks_shift: u32,
}

impl<const BITS: usize> IntKeys for TokKeys<'_, BITS> {
    const SIGNED: bool = false;
    const TOKEN_SCALE: bool = false;
    const OFFSET: bool = true;

    #[inline(always)]
    unsafe fn codes<K: Kernel>(&self, k: K, t: usize, b: usize) -> K::B {
        // SAFETY: a row holds `d · BITS / 8` bytes, of which block `b` is the
        // `4 · BITS` at `4 · BITS · b`.
        unsafe {
            let p = self.packed.at(t, 4 * BITS * b);
            if BITS == 4 { k.nib32(p) } else { k.crumb32(p) }
        }
    }

    #[inline(always)]
    unsafe fn scale(&self, t: usize, b: usize) -> f32 {
        // SAFETY: `2 × groups` parameters per token, checked where built.
        unsafe {
            *self
                .params
                .get_unchecked(2 * (t * self.groups + (b >> self.blocks_shift)))
        }
    }

    #[inline(always)]
    unsafe fn offset(&self, t: usize, group_sums: *const f32) -> f32 {
        let mut sum = 0.0;
        for gr in 0..self.groups {
            // SAFETY: `2 × groups` parameters per token (checked where built); the caller's
            // `groups` sums.
            sum += unsafe {
                *self.params.get_unchecked(2 * (t * self.groups + gr) + 1) * *group_sums.add(gr)
            };
        }
        sum
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
    assert!(d.is_multiple_of(QUERY_BLOCK) && q.codes.len().is_multiple_of(d));
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
            let groups = d / group;
            assert!(group.is_power_of_two() && group >= QUERY_BLOCK && groups == q.groups);
            assert!(params.len() >= 2 * groups * n);
            let blocks_shift = (group / QUERY_BLOCK).trailing_zeros();
            match bits {
                LowBits::Four => {
                    let keys = TokKeys::<4> {
                        packed,
                        params,
                        groups,
                        blocks_shift,
                    };
                    run_loops(k, &keys, n, d, q, scores, g, prefetch);
                }
                LowBits::Two => {
                    let keys = TokKeys::<2> {
                        packed,
                        params,
                        groups,
                        blocks_shift,
                    };
                    run_loops(k, &keys, n, d, q, scores, g, prefetch);
                }
            }
        }
        f => unreachable!("iq schemes are validated to have integer keys, not {f}"),
    }
}

/// The loops of [`int_score_block`] as a function of their own per key format and head_dim.
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
    assert!(q.group_sums.len() >= (r0 + QR) * q.groups);
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
                    let dot = if R::SIGNED {
                        k.dot_i8_i8(codes, qv)
                    } else {
                        k.dot_u8_i8(codes, qv)
                    };
                    let w = if R::TOKEN_SCALE { qs } else { qs * weight };
                    acc[j] = k.fmadd(dot, k.splat(w), acc[j]);
                }
            }
        }
    }
    let sums = tile_sums(k, &acc);
    let sp = scores.as_mut_ptr();
    for i in 0..TT {
        let t = t0 + i;
        // SAFETY: `t < n`; `int_score_rows` checked that `group_sums` holds the rows' groups
        // and `scores` the rows' `g` scores, with `t < n <= g`.
        unsafe {
            let token_scale = if R::TOKEN_SCALE {
                keys.scale(t, 0)
            } else {
                1.0
            };
            for j in 0..QR {
                let row = r0 + j;
                let mut score = sums[i * QR + j] * token_scale;
                if R::OFFSET {
                    score += keys.offset(t, q.group_sums.as_ptr().add(row * q.groups));
                }
                *sp.add(row * g + t) = score;
            }
        }
    }
}

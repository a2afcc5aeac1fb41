//! Reference quantizers: the exact definition of every format's codes, against which the CPU
//! attention and every kernel are checked.
//!
//! Inputs are f16 values (the cache rounds its f32 input to f16 first), computations are f32.
//! Rounding is to nearest with ties away from zero (`f32::round`, C's `roundf`). Scales and
//! minimums are rounded to f16 *before* the codes are computed, so codes are chosen against the
//! parameters that dequantization will use. A constant group of an asymmetric format gets scale
//! 0 and dequantizes exactly to its minimum; an all-zero group of a symmetric format gets scale 0.

mod codebook;
mod fp8;
mod outliers;
mod rotation;

pub use codebook::{Codebook, MAX_LEVELS};
pub use fp8::{E4M3_MAX, e4m3_from_f32, e4m3_to_f32, e4m3_to_f32_scaled};
pub use outliers::{Outlier, OutlierThresholds, split_outliers};
pub use rotation::{hadamard, hadamard_exact, hadamard_rows, hadamard_scale, hadamard_scale_f64};

use half::f16;

use crate::scheme::{Format, LowBits, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};

/// Reads a little-endian f16 at `off`.
#[inline(always)]
pub fn get_f16(bytes: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([bytes[off], bytes[off + 1]]).to_f32()
}

/// Writes a little-endian f16 at `off`.
#[inline(always)]
pub fn put_f16(bytes: &mut [u8], off: usize, v: f16) {
    bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

/// Scale and minimum of an asymmetric group spanning `[lo, hi]`, already rounded to f16.
///
/// Adding `+0.0` turns a `-0.0` bound into `+0.0`: `min`/`max` may return either zero when both
/// occur, and the stored bytes must not depend on which (the GPU kernels do the same).
fn asym_params(lo: f32, hi: f32, bits: LowBits) -> (f32, f32) {
    let (lo, hi) = (lo + 0.0, hi + 0.0);
    let scale = f16::from_f32((hi - lo) / f32::from(bits.max_code())).to_f32();
    (scale, f16::from_f32(lo).to_f32())
}

/// The code of `x` in an asymmetric group: the nearest level of `book`, or without one
/// `round((x − min) / scale)`.
#[inline(always)]
fn asym_code(x: f32, scale: f32, min: f32, bits: LowBits, book: Option<&Codebook>) -> u8 {
    if scale == 0.0 {
        return 0;
    }
    let u = (x - min) / scale;
    match book {
        Some(book) => book.code(u),
        None => u.round().clamp(0.0, f32::from(bits.max_code())) as u8,
    }
}

/// What code `code` of an asymmetric format decodes to, in code units.
#[inline(always)]
fn asym_level(code: u8, book: Option<&Codebook>) -> f32 {
    book.map_or(f32::from(code), |b| b.level(code))
}

/// The code of `x` in a symmetric int8 group.
#[inline(always)]
fn sym_code(x: f32, scale: f32) -> i8 {
    if scale == 0.0 {
        return 0;
    }
    (x / scale).round().clamp(-127.0, 127.0) as i8
}

/// Symmetric int8 scale for a group, rounded to f16.
fn sym_scale(xs: &[f32]) -> f32 {
    let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    f16::from_f32(amax / 127.0).to_f32()
}

/// The fp8 scale of a row: `max|x| / 448`, rounded to f16.
fn fp8_scale(xs: &[f32]) -> f32 {
    let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    f16::from_f32(amax / E4M3_MAX).to_f32()
}

/// The e4m3 code of `x` in a row of `scale` (0 when the scale is).
#[inline(always)]
fn fp8_code(x: f32, scale: f32) -> u8 {
    if scale == 0.0 {
        return 0;
    }
    e4m3_from_f32(x / scale)
}

/// Channels per block of an int8 query (`iq`): llama.cpp's `q8_0`/`q8_1` block, and the
/// kernels' `HIPKV_QUERY_BLOCK`.
pub const QUERY_BLOCK: usize = crate::abi::HIPKV_QUERY_BLOCK as usize;

/// Rounds a query row to int8 per [`QUERY_BLOCK`] channels, as the `iq` attention does once per
/// step: each block's scale is `s = max|x| / 127` in f32 (not rounded to f16: it never leaves
/// the step) and its codes are `x` times the scale's reciprocal, rounded ([`QueryScale`]): one
/// multiply per element, as llama.cpp's `quantize_row_q8_0` rounds, so that a GPU lane divides
/// twice per block and not once per element. So `|x − s·c| ≤ s/2 + |x|·(2^-23 + 2^-46)` and
/// every code lies in `[-127, 127]` (an all-zero block has `s = 0` and zero codes). A block
/// holding a NaN or an infinity gets a NaN scale, so its scores come out NaN as the f32 path's
/// would (`KvCache` refuses such queries first). Writes `x.len()` codes and `x.len() / 32`
/// scales; `x` is a whole number of blocks (checked).
pub fn quantize_query(x: &[f32], codes: &mut [i8], scales: &mut [f32]) {
    assert!(
        x.len().is_multiple_of(QUERY_BLOCK),
        "a query row of whole 32-channel blocks"
    );
    assert!(codes.len() == x.len() && scales.len() == x.len() / QUERY_BLOCK);
    for ((block, c), s) in x
        .chunks_exact(QUERY_BLOCK)
        .zip(codes.chunks_exact_mut(QUERY_BLOCK))
        .zip(scales.iter_mut())
    {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = if block.iter().all(|v| v.is_finite()) {
            QueryScale::new(amax)
        } else {
            QueryScale::new(f32::NAN)
        };
        *s = scale.s;
        for (c, &v) in c.iter_mut().zip(block) {
            *c = scale.code(v);
        }
    }
}

/// How [`quantize_query`] rounds one block, in the arithmetic every kernel repeats to the bit.
#[derive(Clone, Copy, Debug)]
pub struct QueryScale {
    /// The block's scale, `max|x| / 127` (NaN for a block with a NaN or an infinity).
    pub s: f32,
    /// `2^64` where `s < 2^-64`, else 1: the block is scaled up by it, exactly, so that the
    /// reciprocal below stays finite for the smallest scales.
    pub p: f32,
    /// `1 / (s·p)`.
    pub inv: f32,
}

impl QueryScale {
    /// The scale of a block whose largest magnitude is `amax` (NaN: a NaN scale).
    #[inline(always)]
    pub fn new(amax: f32) -> Self {
        let s = amax / 127.0;
        let p = if s < TINY_QUERY_SCALE {
            1.0 / TINY_QUERY_SCALE
        } else {
            1.0
        };
        QueryScale {
            s,
            p,
            inv: 1.0 / (s * p),
        }
    }

    /// The int8 code of `x`: `(x·p)·inv` rounded, halves away from zero; 0 where the scale is 0
    /// or NaN.
    #[inline(always)]
    pub fn code(self, x: f32) -> i8 {
        if self.s.is_nan() || self.s == 0.0 {
            return 0;
        }
        ((x * self.p) * self.inv).round().clamp(-127.0, 127.0) as i8
    }
}

/// `2^-64`: below it a query block's scale is scaled up by `2^64` before its reciprocal is taken
/// (`QueryScale::p`), since `1/s` overflows f32 for `s < 2^-128`.
pub const TINY_QUERY_SCALE: f32 = f32::from_bits(0x1f80_0000);

/// Packs low-bit codes, element `j` at bit `bits * (j % codes_per_byte)` of byte
/// `j / codes_per_byte` (low nibble first).
pub fn pack_codes(codes: &[u8], bits: LowBits, out: &mut [u8]) {
    let per = bits.codes_per_byte();
    for (byte, chunk) in out.iter_mut().zip(codes.chunks(per)) {
        *byte = chunk
            .iter()
            .enumerate()
            .fold(0u8, |b, (i, &c)| b | (c << (i * bits.bits())));
    }
}

/// The code of element `j` in a packed row.
#[inline(always)]
pub fn code_at(row: &[u8], bits: LowBits, j: usize) -> u8 {
    let per = bits.codes_per_byte();
    (row[j / per] >> ((j % per) * bits.bits())) & bits.max_code()
}

/// Unpacks `out.len()` low-bit codes.
pub fn unpack_codes(row: &[u8], bits: LowBits, out: &mut [u8]) {
    for (j, c) in out.iter_mut().enumerate() {
        *c = code_at(row, bits, j);
    }
}

/// Quantizes one token of one head in a per-token format (`F16`, `Q8`, `Q8_0`, `Fp8`, `Tok`).
///
/// `row` receives `format.row_bytes(x.len())` bytes; `params` this token's parameters
/// (`params_bytes(1, head_dim)` bytes). `book`: the stream's codebook (`Tok` formats of `nuq`
/// schemes), else `None`.
pub fn quantize_row(
    format: Format,
    x: &[f32],
    row: &mut [u8],
    params: &mut [u8],
    book: Option<&Codebook>,
) {
    let d = x.len();
    match format {
        Format::F16 => {
            for (j, &v) in x.iter().enumerate() {
                put_f16(row, 2 * j, f16::from_f32(v));
            }
        }
        Format::Q8 => {
            let scale = sym_scale(x);
            put_f16(params, 0, f16::from_f32(scale));
            for (r, &v) in row.iter_mut().zip(x) {
                *r = sym_code(v, scale) as u8;
            }
        }
        Format::Fp8 => {
            let scale = fp8_scale(x);
            put_f16(params, 0, f16::from_f32(scale));
            for (r, &v) in row.iter_mut().zip(x) {
                *r = fp8_code(v, scale);
            }
        }
        Format::Q8_0 => {
            for (block, xs) in row
                .chunks_exact_mut(Q8_0_BLOCK_BYTES)
                .zip(x.chunks_exact(Q8_0_BLOCK))
            {
                let scale = sym_scale(xs);
                put_f16(block, 0, f16::from_f32(scale));
                for (r, &v) in block[2..].iter_mut().zip(xs) {
                    *r = sym_code(v, scale) as u8;
                }
            }
        }
        Format::Tok { bits, group } => {
            let g = group.size(d);
            let mut codes = [0u8; crate::scheme::MAX_HEAD_DIM];
            for (gi, xs) in x.chunks_exact(g).enumerate() {
                let (lo, hi) = min_max(xs);
                let (scale, min) = asym_params(lo, hi, bits);
                put_f16(params, 4 * gi, f16::from_f32(scale));
                put_f16(params, 4 * gi + 2, f16::from_f32(min));
                for (c, &v) in codes[gi * g..].iter_mut().zip(xs) {
                    *c = asym_code(v, scale, min, bits, book);
                }
            }
            pack_codes(&codes[..d], bits, row);
        }
        Format::Chan { .. } => unreachable!("per-channel formats quantize whole groups"),
    }
}

/// Dequantizes one token of one head stored in a per-token format (`book` as for
/// [`quantize_row`]).
pub fn dequantize_row(
    format: Format,
    row: &[u8],
    params: &[u8],
    out: &mut [f32],
    book: Option<&Codebook>,
) {
    let d = out.len();
    match format {
        Format::F16 => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = get_f16(row, 2 * j);
            }
        }
        Format::Q8 => {
            let scale = get_f16(params, 0);
            for (o, &r) in out.iter_mut().zip(row) {
                *o = scale * f32::from(r as i8);
            }
        }
        Format::Fp8 => {
            let scale = get_f16(params, 0);
            for (o, &r) in out.iter_mut().zip(row) {
                *o = scale * e4m3_to_f32(r);
            }
        }
        Format::Q8_0 => {
            for (block, os) in row
                .chunks_exact(Q8_0_BLOCK_BYTES)
                .zip(out.chunks_exact_mut(Q8_0_BLOCK))
            {
                let scale = get_f16(block, 0);
                for (o, &r) in os.iter_mut().zip(&block[2..]) {
                    *o = scale * f32::from(r as i8);
                }
            }
        }
        Format::Tok { bits, group } => {
            let g = group.size(d);
            for (j, o) in out.iter_mut().enumerate() {
                let gi = j / g;
                let scale = get_f16(params, 4 * gi);
                let min = get_f16(params, 4 * gi + 2);
                *o = min + scale * asym_level(code_at(row, bits, j), book);
            }
        }
        Format::Chan { .. } => unreachable!("use dequantize_chan_row"),
    }
}

/// Quantizes a full group of `tokens` tokens of one head per channel (`Format::Chan`).
///
/// `x` is token-major (`tokens × head_dim`); `rows` receives `tokens` packed rows; `params`
/// one `(f16 scale, f16 min)` pair per channel; `book` the stream's codebook (`nuq`).
pub fn quantize_chan(
    bits: LowBits,
    x: &[f32],
    head_dim: usize,
    rows: &mut [u8],
    params: &mut [u8],
    book: Option<&Codebook>,
) {
    let tokens = x.len() / head_dim;
    let row_bytes = head_dim / bits.codes_per_byte();
    let mut scales = vec![(0.0f32, 0.0f32); head_dim];
    for (c, sm) in scales.iter_mut().enumerate() {
        let (lo, hi) = (0..tokens)
            .map(|t| x[t * head_dim + c])
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        *sm = asym_params(lo, hi, bits);
        put_f16(params, 4 * c, f16::from_f32(sm.0));
        put_f16(params, 4 * c + 2, f16::from_f32(sm.1));
    }
    let mut codes = vec![0u8; head_dim];
    for t in 0..tokens {
        for (c, code) in codes.iter_mut().enumerate() {
            let (scale, min) = scales[c];
            *code = asym_code(x[t * head_dim + c], scale, min, bits, book);
        }
        pack_codes(&codes, bits, &mut rows[t * row_bytes..(t + 1) * row_bytes]);
    }
}

/// Dequantizes one token of a per-channel group.
pub fn dequantize_chan_row(
    bits: LowBits,
    row: &[u8],
    params: &[u8],
    out: &mut [f32],
    book: Option<&Codebook>,
) {
    for (c, o) in out.iter_mut().enumerate() {
        let level = asym_level(code_at(row, bits, c), book);
        *o = get_f16(params, 4 * c + 2) + get_f16(params, 4 * c) * level;
    }
}

/// The normalized values `u = (x − min) / scale` that the quantizer of a 4- or 2-bit `format`
/// computes for `x` (`tokens × head_dim` of one head, token-major), appended to `out`: per
/// token and channel group for `Tok`, per channel over each `group_tokens` consecutive tokens
/// for `Chan` (a last partial group too). Constant groups, which every codebook stores exactly,
/// add nothing. What [`Codebook::fit`] is calibrated on.
pub fn normalized_codes(
    format: Format,
    x: &[f32],
    head_dim: usize,
    group_tokens: usize,
    out: &mut Vec<f32>,
) {
    let mut push = |xs: &mut dyn Iterator<Item = f32>, lo: f32, hi: f32, bits: LowBits| {
        let (scale, min) = asym_params(lo, hi, bits);
        if scale != 0.0 {
            out.extend(xs.map(|v| (v - min) / scale));
        }
    };
    match format {
        Format::Tok { bits, group } => {
            for xs in x.chunks_exact(group.size(head_dim)) {
                let (lo, hi) = min_max(xs);
                push(&mut xs.iter().copied(), lo, hi, bits);
            }
        }
        Format::Chan { bits } => {
            for page in x.chunks(group_tokens * head_dim) {
                for c in 0..head_dim {
                    let column = || page.iter().skip(c).step_by(head_dim).copied();
                    let (lo, hi) = column()
                        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), v| {
                            (l.min(v), h.max(v))
                        });
                    push(&mut column(), lo, hi, bits);
                }
            }
        }
        Format::F16 | Format::Q8 | Format::Q8_0 | Format::Fp8 => {}
    }
}

fn min_max(xs: &[f32]) -> (f32, f32) {
    xs.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// Rounds to f16 and back, the first step of every append.
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The f16 bits of each value, rounded to nearest (what the write kernels store).
pub fn f16_bits(x: &[f32]) -> Vec<u16> {
    use half::slice::HalfFloatSliceExt;
    let mut halves = vec![f16::ZERO; x.len()];
    halves.convert_from_f32_slice(x);
    halves.iter().map(|h| h.to_bits()).collect()
}

/// [`round_f16`] over a slice, with the CPU's f16 conversion instructions where it has them.
pub fn round_f16_slice(x: &[f32]) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    let mut halves = vec![f16::ZERO; x.len()];
    halves.convert_from_f32_slice(x);
    let mut out = vec![0f32; x.len()];
    halves.convert_to_f32_slice(&mut out);
    out
}

#[cfg(test)]
mod tests;

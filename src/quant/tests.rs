//! Tests of the reference quantizers, the code packing and the outlier split.
//!
//! # The error bound every quantizer is held to
//!
//! An asymmetric group (`q*_tok` over a channel group, `q*_chan` over the tokens of one channel)
//! spans `[lo, hi]`; `M = 2^bits - 1`. The quantizer stores `s = f16(fl32((hi - lo) / M))` and
//! `m = f16(lo)` and chooses each code against those stored values:
//! `c = clamp(round((x - m) / s), 0, M)`, `x̂ = m + s·c`. Let `s* = (hi - lo) / M` (exact).
//!
//! * No clamp: `|u - c| ≤ 1/2` with `u = (x - m) / s`, so `|x - x̂| ≤ s/2`.
//! * Clamp at the top (`s < s*`, because `s` was rounded down): `x - x̂ = x - m - M·s
//!   ≤ hi - m - M·s = M·(s* - s) + (lo - m)`.
//! * Clamp at the bottom (only when `m > lo`, which f16 inputs never cause): `x̂ - x ≤ m - lo`.
//! * `s` rounded to 0 (the range is below a quarter of the smallest f16 subnormal, or the group
//!   is constant): every code is 0 and `x̂ = m`, covered by the clamp term with `s = 0`.
//!
//! Hence `|x - x̂| ≤ max(s/2, (m - lo)⁺, (M·(s* - s) + lo - m)⁺)`. With f16 inputs `m = lo`, and
//! since `s` is `s*` rounded to nearest f16, `|s* - s| ≤ ulp16(s*)/2`: the clamp costs at most
//! `M·ulp16(s*)/2`, i.e. `M·2^-25` for subnormal scales (`s* < 2^-14`) and `M·2^-11·s*` otherwise.
//!
//! The symmetric int8 formats (`q8`, `q8_0` per 32-element block) store `s = f16(amax / 127)` and
//! `c = clamp(round(x / s), -127, 127)`, `x̂ = s·c`; the same argument gives
//! `|x - x̂| ≤ max(s/2, 127·(s* - s)⁺)` with `s* = amax / 127` (an all-zero block has `s = 0`).
//!
//! f32 arithmetic adds a little: `u` is computed as `fl(fl(x - m) / s)` (relative error below
//! `2^-23`), which can only flip a rounding decision within `|x - m|·2^-23` of a half-way point,
//! costing at most `|x - m|·2^-22`; `x̂ = fl(m + s·c)` is one rounding (`s·c` is exact: 11 by 8
//! bits), `2^-24·|x̂|`. The checks below add exactly these terms and nothing else.
//!
//! With a codebook (`nuq`) of levels `L[0] < … < L[M]` in `[0, M]`, `x̂ = m + s·L[c]` with the
//! nearest level: inside the range the error is at most `s·max(L[i+1] − L[i])/2`; below the
//! first level `(m − lo)⁺ + s·L[0]`, above the last `M·(s* − s) + lo − m + s·(M − L[M])`; and
//! `s·L[c]` is no longer exact in f32, which adds `2^-24·s·M`. The uniform codebook `L[i] = i`
//! gives back the bound above.

use half::f16;
use proptest::collection::vec;
use proptest::prelude::*;

use super::*;
use crate::error::Error;
use crate::scheme::{ChannelGroup, HEAD_DIMS};

/// f32 unit roundoff.
const U32: f64 = 1.0 / (1u64 << 24) as f64;

fn tok(bits: LowBits, group: ChannelGroup) -> Format {
    Format::Tok { bits, group }
}

/// Every per-token format: q8, q8_0, fp8 and q4/q2 over channel groups 32/64/128/head.
fn per_token_formats() -> Vec<Format> {
    let mut f = vec![Format::F16, Format::Q8, Format::Q8_0, Format::Fp8];
    for bits in [LowBits::Four, LowBits::Two] {
        for group in [
            ChannelGroup::Channels(32),
            ChannelGroup::Channels(64),
            ChannelGroup::Channels(128),
            ChannelGroup::Head,
        ] {
            f.push(tok(bits, group));
        }
    }
    f
}

/// The spacing of f16 values around `v > 0`.
fn ulp16(v: f64) -> f64 {
    if v < 2f64.powi(-14) {
        2f64.powi(-24)
    } else {
        2f64.powi(v.log2().floor() as i32 - 10)
    }
}

/// Checks that `s` is the f16 rounding of the exact scale `exact` (to nearest; the f32 division
/// before it may move a tie by one f32 ulp).
fn check_scale(s: f32, exact: f64, what: &str) {
    let s = f64::from(s);
    assert!(
        (s - exact).abs() <= ulp16(exact) / 2.0 + exact * U32,
        "{what}: scale {s} is not the f16 rounding of {exact}"
    );
}

/// Checks one asymmetric group: parameters, nearest-code choice, the dequantization formula and
/// the error bound of the module comment. `codes[j]` and `deq[j]` belong to `xs[j]`.
#[allow(clippy::too_many_arguments)]
fn check_asym_group(
    xs: &[f32],
    codes: &[u8],
    deq: &[f32],
    s: f32,
    m: f32,
    bits: LowBits,
    book: Option<&Codebook>,
    what: &str,
) {
    let (lo, hi) = min_max(xs);
    let (lo, hi) = (f64::from(lo), f64::from(hi));
    let big_m = f64::from(bits.max_code());
    let exact = (hi - lo) / big_m;
    assert_eq!(m, round_f16(lo as f32), "{what}: min");
    check_scale(s, exact, what);
    let (s64, m64) = (f64::from(s), f64::from(m));
    let level = |c: u8| book.map_or(f32::from(c), |b| b.level(c));
    let levels: Vec<f64> = (0..=bits.max_code()).map(|c| f64::from(level(c))).collect();
    let half_gap = levels
        .windows(2)
        .map(|w| (w[1] - w[0]) / 2.0)
        .fold(0.0, f64::max);
    let core = (s64 * half_gap)
        .max(m64 - lo + s64 * levels[0])
        .max(big_m * (exact - s64) + lo - m64 + s64 * (big_m - levels[levels.len() - 1]))
        .max(0.0);
    let product = if book.is_some() {
        s64 * big_m * U32
    } else {
        0.0
    };
    for (j, ((&x, &c), &y)) in xs.iter().zip(codes).zip(deq).enumerate() {
        let x = f64::from(x);
        assert!(c <= bits.max_code(), "{what}[{j}]: code {c}");
        // The stored value is the formula applied to the stored parameters, in f32.
        assert_eq!(y, m + s * level(c), "{what}[{j}]: dequantization");
        if s == 0.0 {
            assert_eq!(c, 0, "{what}[{j}]: zero scale, code {c}");
        } else {
            // Nearest level against the stored (f16) parameters.
            let e = |c: usize| (x - (m64 + s64 * levels[c])).abs();
            let c = usize::from(c);
            let slack = (x - m64).abs() * 2.0 * 2.0 * U32 + product;
            for other in [c.wrapping_sub(1), c + 1] {
                if other < levels.len() {
                    assert!(
                        e(c) <= e(other) + slack,
                        "{what}[{j}]: x={x} code {c} is not the nearest (s={s}, m={m})"
                    );
                }
            }
        }
        let bound = core + (x - m64).abs() * 4.0 * U32 + f64::from(y).abs() * U32 + product;
        let err = (x - f64::from(y)).abs();
        assert!(
            err <= bound,
            "{what}[{j}]: x={x} → {y}, error {err} > bound {bound} (s={s}, m={m}, range [{lo}, {hi}])"
        );
    }
}

/// Checks one symmetric int8 group (a q8 token or a q8_0 block).
fn check_sym_group(xs: &[f32], codes: &[u8], deq: &[f32], s: f32, what: &str) {
    let amax = xs.iter().fold(0f64, |a, &x| a.max(f64::from(x).abs()));
    let exact = amax / 127.0;
    check_scale(s, exact, what);
    let s64 = f64::from(s);
    let core = (s64 / 2.0).max(127.0 * (exact - s64));
    for (j, ((&x, &c), &y)) in xs.iter().zip(codes).zip(deq).enumerate() {
        let (x, c) = (f64::from(x), c as i8);
        assert!(c != -128, "{what}[{j}]: code -128");
        assert_eq!(y, s * f32::from(c), "{what}[{j}]: dequantization");
        if s == 0.0 {
            assert_eq!(c, 0, "{what}[{j}]: zero scale, code {c}");
        } else {
            let e = |c: f64| (x - s64 * c).abs();
            let c = f64::from(c);
            for other in [c - 1.0, c + 1.0] {
                if (-127.0..=127.0).contains(&other) {
                    assert!(
                        e(c) <= e(other) + x.abs() * 2.0 * U32,
                        "{what}[{j}]: x={x} code {c} is not the nearest (s={s})"
                    );
                }
            }
        }
        let bound = core + x.abs() * 2.0 * U32 + f64::from(y).abs() * U32;
        let err = (x - f64::from(y)).abs();
        assert!(
            err <= bound,
            "{what}[{j}]: x={x} → {y}, error {err} > bound {bound} (s={s}, amax {amax})"
        );
    }
}

/// Checks one fp8 row: the scale (`max|x|/448` rounded to f16), no NaN code, the nearest code,
/// the dequantization formula and the error bound: with `t = x/s`, rounding moves `t` by at
/// most half a step, `|t|·2^-4` for normal values and `2^-10` below `2^-6`; a scale rounded
/// down clamps `|t|` at 448, losing at most `448·(s* − s)`.
fn check_fp8_row(xs: &[f32], codes: &[u8], deq: &[f32], s: f32, what: &str) {
    let amax = xs.iter().fold(0f64, |a, &x| a.max(f64::from(x).abs()));
    let exact = amax / f64::from(E4M3_MAX);
    check_scale(s, exact, what);
    let s64 = f64::from(s);
    let clamp = f64::from(E4M3_MAX) * (exact - s64).max(0.0);
    for (j, ((&x, &c), &y)) in xs.iter().zip(codes).zip(deq).enumerate() {
        let x = f64::from(x);
        assert!(c & 0x7f != 0x7f, "{what}[{j}]: NaN code {c:#04x}");
        assert_eq!(y, s * e4m3_to_f32(c), "{what}[{j}]: dequantization");
        if s == 0.0 {
            assert_eq!(c, 0, "{what}[{j}]: zero scale, code {c:#04x}");
            continue;
        }
        // The neighbouring codes of the same sign are no nearer.
        let e = |c: u8| (x - s64 * f64::from(e4m3_to_f32(c))).abs();
        for other in [c.wrapping_sub(1), c + 1] {
            if other & 0x7f != 0x7f && (other & 0x80) == (c & 0x80) {
                assert!(
                    e(c) <= e(other) + x.abs() * 2.0 * U32,
                    "{what}[{j}]: x={x} code {c:#04x} is not the nearest (s={s})"
                );
            }
        }
        let step = (x.abs() * 2f64.powi(-4)).max(s64 * 2f64.powi(-10));
        let bound = step + clamp + x.abs() * 2.0 * U32 + f64::from(y).abs() * U32;
        let err = (x - f64::from(y)).abs();
        assert!(
            err <= bound,
            "{what}[{j}]: x={x} → {y}, error {err} > bound {bound} (s={s}, amax {amax})"
        );
    }
}

/// Quantizes `x` (one token of one head) in a per-token format and checks everything the format
/// promises: only its bytes are written, the layout, the codes and the error bound.
fn check_row(format: Format, x: &[f32], book: Option<&Codebook>) {
    let d = x.len();
    let what = format!("{format} d={d} codebook {:?}", book.map(Codebook::levels));
    let (rb, pb) = (format.row_bytes(d), format.params_bytes(1, d));
    // Sentinel bytes after the row and the parameters must survive.
    let mut row = vec![0xA5u8; rb + 16];
    let mut params = vec![0xA5u8; pb + 16];
    quantize_row(format, x, &mut row[..rb], &mut params[..pb], book);
    assert!(
        row[rb..].iter().all(|&b| b == 0xA5),
        "{what}: wrote past the row"
    );
    assert!(
        params[pb..].iter().all(|&b| b == 0xA5),
        "{what}: wrote past the params"
    );
    let (row, params) = (&row[..rb], &params[..pb]);
    let mut deq = vec![f32::NAN; d];
    dequantize_row(format, row, params, &mut deq, book);
    match format {
        Format::F16 => {
            for (j, (&a, &b)) in x.iter().zip(&deq).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}[{j}]: f16 is exact");
            }
        }
        Format::Q8 => check_sym_group(x, row, &deq, get_f16(params, 0), &what),
        Format::Fp8 => check_fp8_row(x, row, &deq, get_f16(params, 0), &what),
        Format::Q8_0 => {
            for (b, ((block, xs), ys)) in row
                .chunks_exact(Q8_0_BLOCK_BYTES)
                .zip(x.chunks_exact(Q8_0_BLOCK))
                .zip(deq.chunks_exact(Q8_0_BLOCK))
                .enumerate()
            {
                let what = format!("{what} block {b}");
                check_sym_group(xs, &block[2..], ys, get_f16(block, 0), &what);
            }
        }
        Format::Tok { bits, group } => {
            let g = group.size(d);
            let mut codes = vec![0u8; d];
            unpack_codes(row, bits, &mut codes);
            // The row is exactly the packing of its codes: no stray bits.
            let mut repacked = vec![0u8; rb];
            pack_codes(&codes, bits, &mut repacked);
            assert_eq!(repacked, row, "{what}: row is not a clean packing");
            assert_eq!(pb, d / g * 4, "{what}: one (scale, min) pair per group");
            for gi in 0..d / g {
                let r = gi * g..(gi + 1) * g;
                let what = format!("{what} group {gi}");
                let (s, m) = (get_f16(params, 4 * gi), get_f16(params, 4 * gi + 2));
                let (xs, cs) = (&x[r.clone()], &codes[r.clone()]);
                check_asym_group(xs, cs, &deq[r], s, m, bits, book, &what);
            }
        }
        Format::Chan { .. } => unreachable!(),
    }
}

/// Quantizes a `tokens × head_dim` group per channel and checks every channel.
fn check_chan(bits: LowBits, x: &[f32], head_dim: usize, book: Option<&Codebook>) {
    let tokens = x.len() / head_dim;
    let what = format!(
        "q{}_chan d={head_dim} tokens={tokens} codebook {:?}",
        bits.bits(),
        book.map(Codebook::levels)
    );
    let rb = Format::Chan { bits }.row_bytes(head_dim);
    let pb = Format::Chan { bits }.params_bytes(tokens, head_dim);
    assert_eq!(
        pb,
        head_dim * 4,
        "{what}: one (scale, min) pair per channel"
    );
    let mut rows = vec![0xA5u8; tokens * rb + 16];
    let mut params = vec![0xA5u8; pb + 16];
    quantize_chan(
        bits,
        x,
        head_dim,
        &mut rows[..tokens * rb],
        &mut params[..pb],
        book,
    );
    assert!(
        rows[tokens * rb..].iter().all(|&b| b == 0xA5),
        "{what}: wrote past the rows"
    );
    assert!(
        params[pb..].iter().all(|&b| b == 0xA5),
        "{what}: wrote past the params"
    );
    let mut deq = vec![0f32; tokens * head_dim];
    let mut codes = vec![0u8; tokens * head_dim];
    for t in 0..tokens {
        let row = &rows[t * rb..(t + 1) * rb];
        let r = t * head_dim..(t + 1) * head_dim;
        dequantize_chan_row(bits, row, &params, &mut deq[r.clone()], book);
        unpack_codes(row, bits, &mut codes[r]);
        let mut repacked = vec![0u8; rb];
        pack_codes(
            &codes[t * head_dim..(t + 1) * head_dim],
            bits,
            &mut repacked,
        );
        assert_eq!(repacked, row, "{what}: row {t} is not a clean packing");
    }
    let column = |v: &[f32], c: usize| (0..tokens).map(|t| v[t * head_dim + c]).collect::<Vec<_>>();
    for c in 0..head_dim {
        let codes_c: Vec<u8> = (0..tokens).map(|t| codes[t * head_dim + c]).collect();
        check_asym_group(
            &column(x, c),
            &codes_c,
            &column(&deq, c),
            get_f16(&params, 4 * c),
            get_f16(&params, 4 * c + 2),
            bits,
            book,
            &format!("{what} channel {c}"),
        );
    }
}

/// A valid codebook of `bits` from arbitrary numbers in [0, 1): their running sums, spread over
/// a random part of `[0, M]` (so the first and last levels need not be 0 and M).
fn arbitrary_book(bits: LowBits, raw: &[f32]) -> Codebook {
    let n = 1usize << bits.bits();
    let top = f32::from(bits.max_code());
    let steps: Vec<f32> = raw[..n].iter().map(|r| 0.05 + r).collect();
    let total: f32 = steps.iter().sum();
    let mut acc = 0.0;
    let levels: Vec<f32> = steps
        .iter()
        .map(|s| {
            acc += s;
            (acc - steps[0] * raw[n % raw.len()]) / total * top
        })
        .collect();
    Codebook::new(bits, &levels).unwrap()
}

/// A finite f16 from arbitrary bits (Inf/NaN patterns lose their top exponent bit).
fn finite_f16(bits: u16) -> f32 {
    let bits = if bits & 0x7C00 == 0x7C00 {
        bits & !0x4000
    } else {
        bits
    };
    f16::from_bits(bits).to_f32()
}

/// Rounds to f16, saturating at ±65504.
fn sat_f16(x: f32) -> f32 {
    round_f16(x.clamp(-65504.0, 65504.0))
}

/// `n` f16-representable values: any finite f16 (every exponent, subnormals, ±65504); one
/// magnitude `2^e` with an offset, `e` from below the smallest subnormal to the top of the range;
/// or a unit-sized bulk with a few spikes of any magnitude.
fn values(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop_oneof![
        vec(any::<u16>().prop_map(finite_f16), n),
        (-27i32..=16, -1.0f32..1.0, vec(-1.0f32..1.0, n)).prop_map(|(e, off, v)| {
            v.iter()
                .map(|x| sat_f16((x + off) * 2f32.powi(e)))
                .collect()
        }),
        (
            -8i32..=4,
            vec(-1.0f32..1.0, n),
            vec((0..n, any::<u16>()), 1..4)
        )
            .prop_map(|(e, v, spikes)| {
                let mut v: Vec<f32> = v.iter().map(|x| sat_f16(x * 2f32.powi(e))).collect();
                for (i, b) in spikes {
                    v[i] = finite_f16(b);
                }
                v
            }),
    ]
}

/// A head dimension and one token of that many values.
fn row_case() -> impl Strategy<Value = Vec<f32>> {
    prop::sample::select(HEAD_DIMS.to_vec()).prop_flat_map(values)
}

/// `(head_dim, tokens × head_dim values)` for a per-channel group of 32 or 64 tokens; each
/// channel gets its own magnitude and offset, or the values are any finite f16.
fn chan_case() -> impl Strategy<Value = (usize, Vec<f32>)> {
    (
        prop::sample::select(HEAD_DIMS.to_vec()),
        prop::sample::select(vec![32usize, 64]),
    )
        .prop_flat_map(|(d, tokens)| {
            let n = d * tokens;
            let per_channel = (vec((-27i32..=16, -1.0f32..1.0), d), vec(-1.0f32..1.0, n)).prop_map(
                move |(ch, v)| {
                    v.iter()
                        .enumerate()
                        .map(|(i, x)| {
                            let (e, off) = ch[i % d];
                            sat_f16((x + off) * 2f32.powi(e))
                        })
                        .collect::<Vec<f32>>()
                },
            );
            let any_f16 = vec(any::<u16>().prop_map(finite_f16), n);
            (Just(d), prop_oneof![per_channel, any_f16])
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn per_token_formats_meet_the_error_bound(x in row_case()) {
        for format in per_token_formats() {
            check_row(format, &x, None);
        }
    }

    #[test]
    fn per_channel_formats_meet_the_error_bound((d, x) in chan_case()) {
        check_chan(LowBits::Four, &x, d, None);
        check_chan(LowBits::Two, &x, d, None);
    }

    #[test]
    fn codebooks_meet_the_error_bound(
        x in row_case(),
        (d, xc) in chan_case(),
        levels in vec(0.0f32..1.0, 16),
    ) {
        for bits in [LowBits::Four, LowBits::Two] {
            let book = arbitrary_book(bits, &levels);
            for format in per_token_formats() {
                if matches!(format, Format::Tok { bits: b, .. } if b == bits) {
                    check_row(format, &x, Some(&book));
                }
            }
            check_chan(bits, &xc, d, Some(&book));
        }
    }

    #[test]
    fn packing_round_trips(
        codes in vec(any::<u8>(), 1..=256),
        four in any::<bool>(),
    ) {
        let bits = if four { LowBits::Four } else { LowBits::Two };
        let per = bits.codes_per_byte();
        let n = codes.len() / per * per;
        let codes: Vec<u8> = codes[..n].iter().map(|c| c & bits.max_code()).collect();
        let mut packed = vec![0u8; n / per];
        pack_codes(&codes, bits, &mut packed);
        // Low bits first: code j at bit bits·(j % per) of byte j / per.
        for (j, &c) in codes.iter().enumerate() {
            let byte = packed[j / per];
            prop_assert_eq!((byte >> (bits.bits() * (j % per))) & bits.max_code(), c);
            prop_assert_eq!(code_at(&packed, bits, j), c);
        }
        let mut back = vec![0xFFu8; n];
        unpack_codes(&packed, bits, &mut back);
        prop_assert_eq!(&back, &codes);
        let mut again = vec![0u8; n / per];
        pack_codes(&back, bits, &mut again);
        prop_assert_eq!(again, packed);
    }
}

#[test]
fn constant_group_dequantizes_exactly() {
    let x = vec![0.375f32; 64];
    for f in ["q4_tok", "q2_tok@head"] {
        let format: Format = f.parse().unwrap();
        let mut row = vec![0u8; format.row_bytes(64)];
        let mut params = vec![0u8; format.params_bytes(1, 64)];
        quantize_row(format, &x, &mut row, &mut params, None);
        let mut out = vec![0f32; 64];
        dequantize_row(format, &row, &params, &mut out, None);
        assert_eq!(out, x, "{f}");
        assert_eq!(get_f16(&params, 0), 0.0, "{f}: scale");
    }
}

/// Hand-computed packings: 2-bit codes `[1, 2, 3, 0]` are `0b00_11_10_01`, 4-bit `[0xA, 0x5]`
/// is `0x5A` (low nibble first).
#[test]
fn packing_is_low_bits_first() {
    let mut b = [0u8; 1];
    pack_codes(&[1, 2, 3, 0], LowBits::Two, &mut b);
    assert_eq!(b[0], 0b0011_1001);
    pack_codes(&[0xA, 0x5], LowBits::Four, &mut b);
    assert_eq!(b[0], 0x5A);
    assert_eq!(code_at(&[0x5A], LowBits::Four, 1), 5);
    assert_eq!(code_at(&[0b0011_1001], LowBits::Two, 2), 3);
}

/// Ties round half away from zero (C `roundf`), not to even.
#[test]
fn ties_round_away_from_zero() {
    // q8: amax 127 → scale exactly 1.
    let mut x = vec![0f32; 64];
    x[..6].copy_from_slice(&[127.0, 2.5, -2.5, 0.5, -0.5, 1.5]);
    let mut row = vec![0u8; 64];
    let mut params = [0u8; 2];
    quantize_row(Format::Q8, &x, &mut row, &mut params, None);
    assert_eq!(get_f16(&params, 0), 1.0);
    let codes: Vec<i8> = row[..6].iter().map(|&b| b as i8).collect();
    assert_eq!(codes, [127, 3, -3, 1, -1, 2]);
    // q4_tok@head: range [0, 15] → scale 1, min 0; 2.5 → 3, 7.5 → 8.
    let mut x = vec![0f32; 64];
    x[..4].copy_from_slice(&[15.0, 2.5, 7.5, 0.5]);
    let format = tok(LowBits::Four, ChannelGroup::Head);
    let mut row = vec![0u8; 32];
    let mut params = [0u8; 4];
    quantize_row(format, &x, &mut row, &mut params, None);
    assert_eq!((get_f16(&params, 0), get_f16(&params, 2)), (1.0, 0.0));
    assert_eq!(row[..2], [0x3F, 0x18]);
}

/// Edge inputs, every per-token format and both per-channel formats, every head dimension.
#[test]
fn edge_inputs_meet_the_error_bound() {
    let max = 65504.0f32;
    let tiny = 2f32.powi(-24); // smallest f16 subnormal
    for d in HEAD_DIMS {
        let mut cases: Vec<(&str, Vec<f32>)> = vec![
            ("zeros", vec![0.0; d]),
            ("constant", vec![-1234.0; d]),
            ("constant max", vec![max; d]),
            ("constant subnormal", vec![3.0 * tiny; d]),
            (
                "alternating ±max",
                (0..d)
                    .map(|i| if i % 2 == 0 { max } else { -max })
                    .collect(),
            ),
            (
                "tiny subnormals",
                (0..d).map(|i| (i as f32 - 31.0) * tiny).collect(),
            ),
            (
                "two subnormals",
                (0..d).map(|i| (i % 2) as f32 * tiny).collect(),
            ),
            ("ramp", (0..d).map(|i| i as f32 / 8.0 - 3.0).collect()),
        ];
        let mut spike = vec![0.0f32; d];
        spike[7] = max;
        cases.push(("single huge", spike));
        let mut spike = (0..d)
            .map(|i| (i as f32 * 0.37).sin() * 1e-3)
            .map(round_f16)
            .collect::<Vec<_>>();
        spike[d - 1] = -max;
        cases.push(("huge among tiny", spike));
        for (name, x) in &cases {
            for format in per_token_formats() {
                check_row(format, x, None);
                if let Format::Tok { bits, .. } = format {
                    check_row(format, x, Some(&arbitrary_book(bits, &[0.5; 16])));
                }
                let mut row = vec![0u8; format.row_bytes(d)];
                let mut params = vec![0u8; format.params_bytes(1, d)];
                quantize_row(format, x, &mut row, &mut params, None);
                let mut out = vec![0f32; d];
                dequantize_row(format, &row, &params, &mut out, None);
                let constant = x.iter().all(|&v| v == x[0]);
                let exact = match format {
                    Format::F16 => true,
                    Format::Tok { .. } => constant,
                    _ => x.iter().all(|&v| v == 0.0),
                };
                if exact {
                    assert_eq!(&out, x, "{format} d={d} {name}: exact");
                }
                if x.iter().all(|&v| v == 0.0) {
                    assert!(
                        params.iter().all(|&b| b == 0),
                        "{format} {name}: zero params"
                    );
                    if format == Format::Q8_0 {
                        assert!(row.iter().all(|&b| b == 0), "q8_0 zeros: zero blocks");
                    }
                }
            }
            // Per channel: the same row repeated over 32 tokens (constant channels, exact) and
            // the row turned into a column group (every channel sees the same edge values).
            for bits in [LowBits::Four, LowBits::Two] {
                let repeated: Vec<f32> = (0..32).flat_map(|_| x.iter().copied()).collect();
                check_chan(bits, &repeated, d, None);
                check_chan(bits, &repeated, d, Some(&arbitrary_book(bits, &[0.3; 16])));
                let mut rows = vec![0u8; 32 * d / bits.codes_per_byte()];
                let mut params = vec![0u8; d * 4];
                quantize_chan(bits, &repeated, d, &mut rows, &mut params, None);
                for (c, &xc) in x.iter().enumerate() {
                    assert_eq!(
                        get_f16(&params, 4 * c),
                        0.0,
                        "{name}: constant channel scale"
                    );
                    assert_eq!(
                        get_f16(&params, 4 * c + 2),
                        xc,
                        "{name}: constant channel min"
                    );
                }
                let column: Vec<f32> = (0..32 * d).map(|i| x[(i / d + i % d) % d]).collect();
                check_chan(bits, &column, d, None);
                check_chan(bits, &column, d, Some(&arbitrary_book(bits, &[0.7; 16])));
            }
        }
    }
}

/// The cases the bound's subnormal and clamp terms are written for actually occur.
#[test]
fn subnormal_and_clamped_scales_occur() {
    let tiny = 2f32.powi(-24);
    // q8 with amax 2^-10: scale 2^-10/127 is an f16 subnormal.
    let mut x = vec![0f32; 64];
    x[0] = 2f32.powi(-10);
    x[1] = -0.75 * 2f32.powi(-10);
    let mut row = vec![0u8; 64];
    let mut params = [0u8; 2];
    quantize_row(Format::Q8, &x, &mut row, &mut params, None);
    let s = get_f16(&params, 0);
    assert!(s > 0.0 && s < 2f32.powi(-14), "scale {s} is subnormal");
    check_row(Format::Q8, &x, None);
    // q4_tok@head over [0, 21·2^-24]: s* = 1.4·2^-24 rounds down to the subnormal 2^-24, so the
    // top element sits at u = 21 and clamps to code 15: error 6·2^-24 = M·(s* - s) > s/2.
    let mut x = vec![0f32; 64];
    x[5] = 21.0 * tiny;
    let format = tok(LowBits::Four, ChannelGroup::Head);
    let mut row = vec![0u8; 32];
    let mut params = [0u8; 4];
    quantize_row(format, &x, &mut row, &mut params, None);
    assert_eq!(get_f16(&params, 0), tiny);
    let mut out = vec![0f32; 64];
    dequantize_row(format, &row, &params, &mut out, None);
    assert_eq!(out[5], 15.0 * tiny);
    check_row(format, &x, None);
    // Range 2^-24 with q2: s* = 2^-24/3 rounds to 0, every code is 0, error 2^-24 = 3·s*.
    let mut x = vec![0f32; 64];
    x[9] = tiny;
    let format = tok(LowBits::Two, ChannelGroup::Head);
    let mut row = vec![0u8; 16];
    quantize_row(format, &x, &mut row, &mut params, None);
    assert_eq!(get_f16(&params, 0), 0.0);
    dequantize_row(format, &row, &params, &mut out, None);
    assert_eq!(out[9], 0.0);
    check_row(format, &x, None);
}

/// Dequantized values may leave the f16 range: q2 over `[-65504, 65504]` stores the scale
/// `f16(43669.33) = 43680`, and the top code decodes to `-65504 + 3·43680 = 65536 > 65504`.
/// Dequantization is f32 (a kernel doing it in f16 arithmetic would produce +Inf here).
#[test]
fn dequantized_values_can_exceed_the_f16_range() {
    let x: Vec<f32> = (0..64)
        .map(|i| if i % 2 == 0 { 65504.0 } else { -65504.0 })
        .collect();
    let format = tok(LowBits::Two, ChannelGroup::Head);
    let mut row = vec![0u8; 16];
    let mut params = [0u8; 4];
    quantize_row(format, &x, &mut row, &mut params, None);
    assert_eq!(get_f16(&params, 0), 43680.0);
    let mut out = vec![0f32; 64];
    dequantize_row(format, &row, &params, &mut out, None);
    assert_eq!(out[0], 65536.0);
    assert!(f16::from_f32(out[0]).is_infinite());
}

/// `q8_0` rows are llama.cpp `block_q8_0` arrays: `{ggml_half d; int8_t qs[32]}`, 34 bytes, `d`
/// little-endian. Hand-computed: block 0 has amax 127 so `d = 1.0` (0x3C00); block 1 has amax 0.5
/// so `d = f16(0.5/127) = f16(0.0039370) = 2^-8·(1 + 8/1024)` (0x1C08), and 0.25 → 63.50 → 64.
#[test]
fn q8_0_matches_llama_cpp_block_layout() {
    let mut x = vec![0f32; 64];
    x[..6].copy_from_slice(&[127.0, -127.0, 2.5, -2.5, 0.49, 100.0]);
    x[32..35].copy_from_slice(&[0.5, -0.25, 0.25]);
    let mut row = vec![0u8; Format::Q8_0.row_bytes(64)];
    assert_eq!(row.len(), 2 * Q8_0_BLOCK_BYTES);
    quantize_row(Format::Q8_0, &x, &mut row, &mut [], None);
    let mut want = vec![0u8; 68];
    want[..8].copy_from_slice(&[0x00, 0x3C, 0x7F, 0x81, 0x03, 0xFD, 0x00, 100]);
    want[34..39].copy_from_slice(&[0x08, 0x1C, 127, (-64i8) as u8, 64]);
    assert_eq!(row, want);
}

/// ggml's `quantize_row_q8_0_ref` picks codes against the unrounded f32 `d` (`roundf(x * 1/d)`),
/// hipkv against the stored f16 `d`. The stored `d` is the same and codes differ by at most one
/// step, so each decodes the other's blocks with its own error bound unchanged in form.
#[test]
fn q8_0_codes_stay_within_one_of_ggml_reference() {
    let mut rng = crate::synth::Rng::new(7);
    let mut differ = 0;
    for _ in 0..200 {
        let e = rng.below(20) as i32 - 12;
        let x: Vec<f32> = rng
            .normals(128)
            .iter()
            .map(|v| sat_f16(v * 2f32.powi(e)))
            .collect();
        let mut row = vec![0u8; Format::Q8_0.row_bytes(128)];
        quantize_row(Format::Q8_0, &x, &mut row, &mut [], None);
        for (block, xs) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            assert_eq!(block[..2], f16::from_f32(d).to_le_bytes());
            for (&q, &v) in block[2..].iter().zip(xs) {
                let ggml = (v * id).round() as i8;
                let ours = q as i8;
                assert!(
                    (i16::from(ggml) - i16::from(ours)).abs() <= 1,
                    "{v}: {ggml} vs {ours}"
                );
                differ += usize::from(ggml != ours);
            }
        }
    }
    // The two references really differ (for this seed, 480 of 25600 codes, about 2%): q8_0
    // caches are layout-compatible with llama.cpp, not bit-identical to its quantizer.
    assert!(differ > 0);
}

// ---------------------------------------------------------------------------------------------
// Outliers.

/// `(heads, head_dim, n)` and, per column, a permutation of `n` distinct f16 values.
fn distinct_columns() -> impl Strategy<Value = (usize, usize, usize, Vec<f32>)> {
    (1usize..=2, 1usize..=8, 1usize..=600).prop_flat_map(|(heads, d, n)| {
        let width = heads * d;
        let column = Just((0..n).collect::<Vec<usize>>()).prop_shuffle();
        vec(column, width).prop_map(move |cols| {
            // Distinct, exactly representable: k/4 - n/8 needs at most 11 significant bits.
            let mut samples = vec![0f32; n * width];
            for (i, col) in cols.iter().enumerate() {
                for (t, &k) in col.iter().enumerate() {
                    samples[t * width + i] = k as f32 / 4.0 - (n / 8) as f32;
                }
            }
            (heads, d, n, samples)
        })
    })
}

/// The per-side tail the documented rule asks for: `floor(n · fraction / 2)`, with the fraction
/// given in percent so the floor is computed exactly.
fn tail(n: usize, percent: usize) -> usize {
    (n * percent / 200).min((n - 1) / 2)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// With distinct samples exactly `floor(n·fraction/2)` lie above `hi` and as many below `lo`.
    #[test]
    fn calibration_puts_the_tails_outside(
        (heads, d, n, samples) in distinct_columns(),
        percent in prop::sample::select(vec![1usize, 2, 4, 10, 20, 40]),
    ) {
        let t = OutlierThresholds::calibrate(&samples, heads, d, percent as f32 / 100.0).unwrap();
        prop_assert_eq!((t.heads, t.head_dim), (heads, d));
        let width = heads * d;
        let want = tail(n, percent);
        for i in 0..width {
            let col: Vec<f32> = (0..n).map(|k| samples[k * width + i]).collect();
            let (h, c) = (i / d, i % d);
            let (lo, hi) = t.head(h);
            prop_assert!(lo[c] <= hi[c]);
            prop_assert_eq!(col.iter().filter(|&&x| x > hi[c]).count(), want, "above, col {}", i);
            prop_assert_eq!(col.iter().filter(|&&x| x < lo[c]).count(), want, "below, col {}", i);
        }
    }

    /// With ties (few distinct values) at most the tail lies outside and the thresholds are
    /// sample values: more than the tail sits at or beyond each.
    #[test]
    fn calibration_with_ties(
        n in 1usize..400,
        raw in vec(-3i32..=3, 400 * 4),
        percent in prop::sample::select(vec![1usize, 10, 40]),
    ) {
        let samples: Vec<f32> = raw[..n * 4].iter().map(|&k| k as f32 * 0.5).collect();
        let t = OutlierThresholds::calibrate(&samples, 2, 2, percent as f32 / 100.0).unwrap();
        let want = tail(n, percent);
        for i in 0..4 {
            let col: Vec<f32> = (0..n).map(|k| samples[k * 4 + i]).collect();
            let (lo, hi) = (t.lo[i], t.hi[i]);
            prop_assert!(col.contains(&lo) && col.contains(&hi));
            prop_assert!(col.iter().filter(|&&x| x > hi).count() <= want);
            prop_assert!(col.iter().filter(|&&x| x < lo).count() <= want);
            prop_assert!(col.iter().filter(|&&x| x >= hi).count() > want);
            prop_assert!(col.iter().filter(|&&x| x <= lo).count() > want);
        }
    }

    /// `split_outliers`: kept outliers exact, in channel order and clipped in the dense row,
    /// capacity respected by keeping the farthest outside (ties: lower channel), the rest
    /// counted and left in the dense row as they were.
    #[test]
    fn split_outliers_keeps_the_farthest(
        x in row_case(),
        bounds in vec((any::<u16>(), any::<u16>()), 256),
        capacity in 0usize..12,
    ) {
        let d = x.len();
        let (lo, hi): (Vec<f32>, Vec<f32>) = bounds[..d]
            .iter()
            .map(|&(a, b)| {
                // Narrow thresholds so rows have outliers: magnitudes below 2^-4 · 65504.
                let (a, b) = (finite_f16(a) / 16.0, finite_f16(b) / 16.0);
                (round_f16(a.min(b)), round_f16(a.max(b)))
            })
            .unzip();
        let mut dense = x.clone();
        let (kept, dropped) = split_outliers(&mut dense, &lo, &hi, capacity);
        let outside: Vec<usize> = (0..d).filter(|&c| x[c] < lo[c] || x[c] > hi[c]).collect();
        for c in 0..d {
            let stored = kept.iter().any(|o| usize::from(o.channel) == c);
            let want = if stored { x[c].clamp(lo[c], hi[c]) } else { x[c] };
            prop_assert_eq!(dense[c].to_bits(), want.to_bits(), "dense channel {}", c);
        }
        prop_assert_eq!(kept.len(), outside.len().min(capacity));
        prop_assert_eq!(dropped, outside.len() - kept.len());
        for w in kept.windows(2) {
            prop_assert!(w[0].channel < w[1].channel, "channel order");
        }
        let dist = |c: usize| (x[c] - x[c].clamp(lo[c], hi[c])).abs();
        for o in &kept {
            let c = usize::from(o.channel);
            prop_assert!(outside.contains(&c));
            prop_assert_eq!(o.value.to_bits(), x[c].to_bits(), "exact value");
        }
        for &c in &outside {
            if kept.iter().any(|o| usize::from(o.channel) == c) {
                continue;
            }
            for o in &kept {
                let k = usize::from(o.channel);
                prop_assert!(
                    dist(k) > dist(c) || (dist(k) == dist(c) && k < c),
                    "kept {} (dist {}) over dropped {} (dist {})", k, dist(k), c, dist(c)
                );
            }
        }
    }
}

#[test]
fn calibration_of_gaussian_channels() {
    // 1000 tokens, 1% → 5 above and 5 below per channel.
    let mut rng = crate::synth::Rng::new(3);
    let (heads, d, n) = (2, 64, 1000);
    let samples = crate::synth::keys_with_outlier_channels(&mut rng, n, heads, d, 2, 6.0);
    let t = OutlierThresholds::calibrate(&samples, heads, d, 0.01).unwrap();
    for i in 0..heads * d {
        let col: Vec<f32> = (0..n)
            .map(|k| round_f16(samples[k * heads * d + i]))
            .collect();
        assert_eq!(round_f16(t.lo[i]), t.lo[i], "f16-representable");
        assert_eq!(round_f16(t.hi[i]), t.hi[i], "f16-representable");
        let above = col.iter().filter(|&&x| x > t.hi[i]).count();
        let below = col.iter().filter(|&&x| x < t.lo[i]).count();
        assert!(
            above <= 5 && col.iter().filter(|&&x| x >= t.hi[i]).count() > 5,
            "{i}"
        );
        assert!(
            below <= 5 && col.iter().filter(|&&x| x <= t.lo[i]).count() > 5,
            "{i}"
        );
    }
    // A single sample is its own range; a tiny fraction keeps every sample inside.
    let one = OutlierThresholds::calibrate(&[1.5, -2.0], 1, 2, 0.4).unwrap();
    assert_eq!((one.lo, one.hi), (vec![1.5, -2.0], vec![1.5, -2.0]));
}

#[test]
fn calibration_rejects_bad_samples() {
    assert!(matches!(
        OutlierThresholds::calibrate(&[], 1, 4, 0.01),
        Err(Error::Shape {
            expected: 4,
            got: 0,
            ..
        })
    ));
    assert!(matches!(
        OutlierThresholds::calibrate(&[0.0; 6], 1, 4, 0.01),
        Err(Error::Shape {
            expected: 4,
            got: 6,
            ..
        })
    ));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut s = vec![0.0f32; 8];
        s[5] = bad;
        assert!(matches!(
            OutlierThresholds::calibrate(&s, 1, 4, 0.01),
            Err(Error::Unsupported(_))
        ));
    }
}

#[test]
fn split_outliers_capacity_policy_by_hand() {
    let lo = [-1.0f32; 8];
    let hi = [1.0f32; 8];
    let x = [0.5, 3.0, -2.0, 1.0, -4.0, 3.0, -1.0, 0.0];
    // Outside: ch1 (dist 2), ch2 (1), ch4 (3), ch5 (2). Capacity 2 keeps ch4 and, of the tied
    // ch1/ch5, the lower channel ch1; returned in channel order.
    let mut dense = x;
    let (kept, dropped) = split_outliers(&mut dense, &lo, &hi, 2);
    assert_eq!(
        kept,
        [
            Outlier {
                channel: 1,
                value: 3.0
            },
            Outlier {
                channel: 4,
                value: -4.0
            }
        ]
    );
    assert_eq!(dropped, 2);
    // The stored ones clipped, the dropped ones (ch2, ch5) as they were.
    assert_eq!(dense, [0.5, 1.0, -2.0, 1.0, -1.0, 3.0, -1.0, 0.0]);
    let mut dense = x;
    let (kept, dropped) = split_outliers(&mut dense, &lo, &hi, 8);
    assert_eq!(
        kept.iter().map(|o| o.channel).collect::<Vec<_>>(),
        [1, 2, 4, 5]
    );
    assert_eq!(dropped, 0);
    assert_eq!(dense, [0.5, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.0]);
    let mut dense = x;
    assert_eq!(split_outliers(&mut dense, &lo, &hi, 0), (vec![], 4));
    assert_eq!(dense, x, "no slot: the row as it was");
}

/// `normalized_codes` groups the samples as the quantizers group them: rounded and clamped,
/// its values are the codes `quantize_row` and `quantize_chan` store, in its order (per token
/// and group; per page, channel and token), a last partial page included.
#[test]
fn normalized_codes_are_the_stored_codes_before_rounding() {
    let mut rng = crate::synth::Rng::new(23);
    let d = 128;
    let round = |u: f32, bits: LowBits| u.round().clamp(0.0, f32::from(bits.max_code())) as u8;
    for format in [
        tok(LowBits::Four, ChannelGroup::Channels(32)),
        tok(LowBits::Two, ChannelGroup::Channels(64)),
        tok(LowBits::Four, ChannelGroup::Head),
    ] {
        let Format::Tok { bits, .. } = format else {
            unreachable!()
        };
        let tokens = 5;
        let x = rng.normals(tokens * d);
        let mut u = Vec::new();
        normalized_codes(format, &x, d, 32, &mut u);
        assert_eq!(u.len(), tokens * d, "{format}");
        let (rb, pb) = (format.row_bytes(d), format.params_bytes(1, d));
        let (mut row, mut params, mut codes) = (vec![0u8; rb], vec![0u8; pb], vec![0u8; d]);
        for t in 0..tokens {
            quantize_row(format, &x[t * d..(t + 1) * d], &mut row, &mut params, None);
            unpack_codes(&row, bits, &mut codes);
            for (c, &code) in codes.iter().enumerate() {
                assert_eq!(
                    code,
                    round(u[t * d + c], bits),
                    "{format} token {t} channel {c}"
                );
            }
        }
    }
    for bits in [LowBits::Four, LowBits::Two] {
        let (tokens, page) = (40, 32);
        let x = rng.normals(tokens * d);
        let mut u = Vec::new();
        normalized_codes(Format::Chan { bits }, &x, d, page, &mut u);
        assert_eq!(u.len(), tokens * d);
        let mut at = 0;
        for (p, xs) in x.chunks(page * d).enumerate() {
            let n = xs.len() / d;
            let rb = Format::Chan { bits }.row_bytes(d);
            let mut rows = vec![0u8; n * rb];
            let mut params = vec![0u8; 4 * d];
            quantize_chan(bits, xs, d, &mut rows, &mut params, None);
            for c in 0..d {
                for t in 0..n {
                    let code = code_at(&rows[t * rb..(t + 1) * rb], bits, c);
                    assert_eq!(
                        code,
                        round(u[at], bits),
                        "q{bits:?} page {p} channel {c} token {t}"
                    );
                    at += 1;
                }
            }
        }
    }
}

/// Checks [`quantize_query`]'s stated bound on one row: codes in `[-127, 127]`, each block's
/// scale `max|x| / 127`, and `|x − s·c| ≤ s/2 + |x|·(2^-23 + 2^-46)` (the reciprocal's and the
/// product's roundings can move a half-way decision by that much together).
fn check_query(x: &[f32]) {
    let mut codes = vec![0i8; x.len()];
    let mut scales = vec![0f32; x.len() / QUERY_BLOCK];
    quantize_query(x, &mut codes, &mut scales);
    for ((block, c), &s) in x
        .chunks_exact(QUERY_BLOCK)
        .zip(codes.chunks_exact(QUERY_BLOCK))
        .zip(&scales)
    {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(s, amax / 127.0);
        for (&v, &c) in block.iter().zip(c) {
            assert!((-127..=127).contains(&c));
            // In f64: `s·c` of the largest floats overflows f32.
            let err = (f64::from(v) - f64::from(s) * f64::from(c)).abs();
            let bound = f64::from(s) / 2.0 + f64::from(v.abs()) * (2f64.powi(-23) + 2f64.powi(-46));
            assert!(err <= bound, "{v} -> {c} × {s}: error {err}");
        }
    }
}

#[test]
fn query_blocks_of_zeros_constants_and_extremes() {
    let d = 64;
    check_query(&vec![0.0; d]);
    check_query(&vec![-3.5; d]);
    check_query(&vec![f32::MAX; d]);
    check_query(&vec![f32::MIN_POSITIVE / 4.0; d]);
    // Scales whose reciprocal overflows: these blocks divide (`query_code`).
    check_query(
        &(0..d)
            .map(|i| f32::MIN_POSITIVE / 4.0 * (i as f32 - 20.0) / d as f32)
            .collect::<Vec<_>>(),
    );
    let mut one_hot = vec![0.0; d];
    one_hot[37] = -1e30;
    check_query(&one_hot);
    let (mut codes, mut scales) = (vec![0i8; d], vec![0f32; 2]);
    quantize_query(&one_hot, &mut codes, &mut scales);
    assert_eq!((codes[37], scales[0]), (-127, 0.0));
}

#[test]
fn a_query_block_with_a_nan_or_an_infinity_gets_a_nan_scale() {
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = vec![1.0; 64];
        x[40] = bad;
        let (mut codes, mut scales) = (vec![0i8; 64], vec![0f32; 2]);
        quantize_query(&x, &mut codes, &mut scales);
        assert_eq!(scales[0], 1.0 / 127.0);
        assert!(scales[1].is_nan(), "{bad}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn query_rounding_meets_its_bound(x in row_case()) {
        check_query(&x);
    }
}

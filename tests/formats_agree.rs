//! `hip/include/formats.h` (what the kernels decode with) agrees with `src/quant` (the reference):
//! the C++ functions, compiled for the host by `build.rs`, are called here on rows the Rust
//! quantizers produced, for every format, head_dim and channel group.

mod common;

use common::random_codebook;
use half::f16;
use hipkv::quant::{
    self, Codebook, MAX_LEVELS, dequantize_chan_row, dequantize_row, quantize_chan, quantize_row,
};
use hipkv::synth::Rng;
use hipkv::{ChannelGroup, Format, LowBits};

unsafe extern "C" {
    fn hipkv_ffi_half_to_float(h: u16) -> f32;
    fn hipkv_ffi_float_to_half(f: f32) -> u16;
    fn hipkv_ffi_dequant_row(
        format: i32,
        row: *const u8,
        params: *const u8,
        t: u32,
        head_dim: u32,
        group: u32,
        levels: *const f32,
        out: *mut f32,
    );
    fn hipkv_ffi_level_code(bits: u32, levels: *const f32, u: f32) -> u32;
    fn hipkv_ffi_max_levels() -> u32;
    fn hipkv_ffi_fp8_to_float(c: u32) -> f32;
    fn hipkv_ffi_float_to_fp8(x: f32) -> u32;
    fn hipkv_ffi_codes8(format: i32, row: *const u8, c: u32, out: *mut f32);
    fn hipkv_ffi_chunk_codes8(format: i32, chunk: *const u8, j: i32, out: *mut f32);
    fn hipkv_ffi_rows(head_dim: u32) -> u32;
    fn hipkv_ffi_value_tokens(head_dim: u32) -> u32;
    fn hipkv_ffi_hadamard(x: *mut f32, head_dim: u32);
    fn hipkv_ffi_hadamard_scale_f64(head_dim: u32) -> f64;
    fn hipkv_ffi_int_query_applies(format: i32) -> bool;
    fn hipkv_ffi_int_query_dot(bits: u32, key: *const u8, query: *const i8) -> i32;
    fn hipkv_ffi_int_query_slot(bits: u32, c: u32) -> u32;
    fn hipkv_ffi_int_query_word_channel(bits: u32, word: u32, k: u32) -> u32;
    fn hipkv_ffi_round_query_block(x: *const f32, codes: *mut i8, scale: *mut f32);
}

#[test]
fn rotation_agrees_bit_for_bit() {
    let mut rng = Rng::new(41);
    for d in [64usize, 128, 256] {
        for scale in [1e-3f32, 1.0, 3e3] {
            let x: Vec<f32> = (0..d).map(|_| scale * rng.normal()).collect();
            let mut rust = x.clone();
            quant::hadamard(&mut rust);
            let mut cpp = x;
            // SAFETY: `cpp` holds `d` floats, rotated in place.
            unsafe { hipkv_ffi_hadamard(cpp.as_mut_ptr(), d as u32) };
            assert_eq!(
                rust.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                cpp.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "head_dim {d}"
            );
            // The f64 scale of query and output rotations (`quant::hadamard_exact`).
            // SAFETY: a pure function of its argument.
            let scale = unsafe { hipkv_ffi_hadamard_scale_f64(d as u32) };
            assert_eq!(scale, quant::hadamard_scale_f64(d), "head_dim {d}");
        }
    }
}

#[test]
fn rows_and_value_tokens_per_wave_agree_with_the_header() {
    for d in [64, 128, 256] {
        // SAFETY: a pure function of its argument.
        assert_eq!(
            unsafe { hipkv_ffi_rows(d) },
            hipkv::abi::hipkv_rows(d),
            "head_dim {d}"
        );
        // SAFETY: a pure function of its argument.
        assert_eq!(
            unsafe { hipkv_ffi_value_tokens(d) },
            hipkv::abi::hipkv_value_tokens(d),
            "head_dim {d}"
        );
    }
}

#[test]
fn format_numbers_agree_with_the_header() {
    use hipkv::abi::*;
    let tok = |bits| Format::Tok {
        bits,
        group: ChannelGroup::Channels(32),
    };
    for (f, code) in [
        (Format::F16, HIPKV_F16),
        (Format::Q8, HIPKV_Q8),
        (Format::Q8_0, HIPKV_Q8_0),
        (tok(LowBits::Four), HIPKV_Q4_TOK),
        (tok(LowBits::Two), HIPKV_Q2_TOK),
        (
            Format::Chan {
                bits: LowBits::Four,
            },
            HIPKV_Q4_CHAN,
        ),
        (Format::Chan { bits: LowBits::Two }, HIPKV_Q2_CHAN),
    ] {
        assert_eq!(f.abi_code(), code, "{f}");
    }
}

/// The C++ dequantization of token `t`: `row` its packed row, `params` the page's section,
/// `book` the stream's codebook.
fn cpp_dequant(
    f: Format,
    row: &[u8],
    params: &[u8],
    t: usize,
    d: usize,
    book: Option<&Codebook>,
) -> Vec<f32> {
    let group = match f {
        Format::Tok { group, .. } => group.size(d),
        _ => d,
    };
    assert!(row.len() >= f.row_bytes(d) && params.len() >= f.params_bytes(t + 1, d));
    let mut out = vec![0f32; d];
    let levels = book.map_or(std::ptr::null(), |b| b.levels().as_ptr());
    // SAFETY: `row` holds a full row and `params` the parameters of tokens `0..=t` (asserted),
    // `levels` is null or the format's 2^bits levels; the function writes `d` floats into `out`.
    unsafe {
        hipkv_ffi_dequant_row(
            f.abi_code() as i32,
            row.as_ptr(),
            params.as_ptr(),
            t as u32,
            d as u32,
            group as u32,
            levels,
            out.as_mut_ptr(),
        )
    };
    out
}

/// The fp8 conversions of `formats.h` (what the emulator runs) are the reference's: every
/// one of the 256 codes decodes to the same value, and every code's value, every tie between
/// neighbours and the floats beside them, values past ±448 and random quotients encode alike.
#[test]
fn fp8_conversions_agree_for_every_code_and_tie() {
    for c in 0..=255u8 {
        let want = quant::e4m3_to_f32(c);
        // SAFETY: pure functions of their arguments.
        let got = unsafe { hipkv_ffi_fp8_to_float(u32::from(c)) };
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "code {c:#04x}: {got} vs {want}"
        );
    }
    let mut xs = vec![
        0.0f32, -0.0, 448.0, 464.0, -464.0, 500.0, 1e30, -1e30, 1e-30, -1e-30,
    ];
    for c in 0..0x7eu8 {
        let (lo, hi) = (quant::e4m3_to_f32(c), quant::e4m3_to_f32(c + 1));
        let mid = (lo + hi) / 2.0;
        for x in [lo, mid, mid.next_down(), mid.next_up()] {
            xs.extend([x, -x]);
        }
    }
    let mut rng = Rng::new(8);
    xs.extend((0..10_000).map(|_| rng.normal() * 100.0));
    for x in xs {
        // SAFETY: as above.
        let got = unsafe { hipkv_ffi_float_to_fp8(x) };
        assert_eq!(got, u32::from(quant::e4m3_from_f32(x)), "x = {x}");
    }
}

#[test]
fn codebook_capacity_agrees_with_the_header() {
    // SAFETY: a constant.
    assert_eq!(unsafe { hipkv_ffi_max_levels() } as usize, MAX_LEVELS);
}

/// The write kernels' code selection (`Midpoints`) is `Codebook::code`, and without a codebook
/// the uniform one's, at every midpoint, just beside it, outside the range and in between.
#[test]
fn code_selection_agrees_with_the_reference() {
    let mut rng = Rng::new(7);
    for bits in [LowBits::Four, LowBits::Two] {
        let books = [
            (Codebook::uniform(bits), false),
            (Codebook::uniform(bits), true),
            (random_codebook(bits, &mut rng), true),
            (random_codebook(bits, &mut rng), true),
        ];
        for (book, pass_levels) in books {
            let l = book.levels();
            let mut us = vec![-1.0f32, -0.5, -0.0, 0.0, 1e30, -1e30, l[l.len() - 1] + 0.5];
            for w in l.windows(2) {
                let mid = (w[0] + w[1]) * 0.5;
                us.extend([mid, mid.next_down(), mid.next_up(), w[0], w[1]]);
            }
            us.extend((0..200).map(|_| (rng.uniform() * 1.2 - 0.1) * l.len() as f32));
            let levels = if pass_levels {
                l.as_ptr()
            } else {
                std::ptr::null()
            };
            for u in us {
                // SAFETY: `levels` is null or 2^bits floats.
                let got = unsafe { hipkv_ffi_level_code(bits.bits() as u32, levels, u) };
                assert_eq!(got, u32::from(book.code(u)), "{bits:?} {l:?} u={u}");
                if !pass_levels {
                    let max = f32::from(bits.max_code());
                    assert_eq!(got as f32, u.round().clamp(0.0, max), "u={u}");
                }
            }
        }
    }
}

#[test]
fn half_to_float_is_exact_for_every_bit_pattern() {
    for bits in 0..=u16::MAX {
        // SAFETY: a pure function of its argument.
        let got = unsafe { hipkv_ffi_half_to_float(bits) };
        let want = f16::from_bits(bits).to_f32();
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{bits:#06x}: {got} vs {want}"
        );
    }
}

/// The f16 conversion of the emulator and plain host builds (the GPUs have their own) rounds as
/// the `half` crate does: checked on every f16 value, its f32 neighbours, every exact tie
/// between two f16 values and its neighbours, and a million random bit patterns.
#[test]
fn float_to_half_rounds_to_nearest_even() {
    let check = |f: f32| {
        // SAFETY: a pure function of its argument.
        let got = unsafe { hipkv_ffi_float_to_half(f) };
        let want = f16::from_f32(f).to_bits();
        assert!(
            got == want || (f16::from_bits(got).is_nan() && f.is_nan()),
            "{f:e} ({:#010x}): {got:#06x} vs {want:#06x}",
            f.to_bits()
        );
    };
    let around = |f: f32| [f.next_down(), f, f.next_up()];
    for bits in 0..=u16::MAX {
        let h = f16::from_bits(bits);
        around(h.to_f32()).into_iter().for_each(check);
        let next = f16::from_bits(bits.wrapping_add(1));
        if h.is_finite() && next.is_finite() {
            let tie = (f64::from(h.to_f32()) + f64::from(next.to_f32())) / 2.0;
            around(tie as f32).into_iter().for_each(check);
        }
    }
    let mut rng = Rng::new(7);
    for _ in 0..1_000_000 {
        check(f32::from_bits(rng.next_u64() as u32));
    }
}

#[test]
fn per_token_formats_dequantize_as_the_reference() {
    let mut rng = Rng::new(3);
    let tok = |bits, group| Format::Tok { bits, group };
    for d in [64, 128, 256] {
        let mut formats = vec![Format::F16, Format::Q8, Format::Q8_0];
        for bits in [LowBits::Four, LowBits::Two] {
            for g in [
                ChannelGroup::Channels(32),
                ChannelGroup::Channels(64),
                ChannelGroup::Channels(128),
                ChannelGroup::Head,
            ] {
                formats.push(tok(bits, g));
            }
        }
        let cases: Vec<(Format, Option<Codebook>)> = formats
            .into_iter()
            .flat_map(|f| match f {
                Format::Tok { bits, .. } => {
                    vec![(f, None), (f, Some(random_codebook(bits, &mut rng)))]
                }
                _ => vec![(f, None)],
            })
            .collect();
        for (f, book) in cases {
            let book = book.as_ref();
            // Three tokens in one page, so token indexing into the parameters is exercised.
            let tokens = 3;
            let (rb, pb) = (f.row_bytes(d), f.params_bytes(1, d));
            let mut rows = vec![0u8; tokens * rb];
            let mut params = vec![0u8; tokens * pb];
            let x: Vec<f32> = rng
                .normals(tokens * d)
                .iter()
                .map(|v| quant::round_f16(v * 3.0))
                .collect();
            for t in 0..tokens {
                quantize_row(
                    f,
                    &x[t * d..(t + 1) * d],
                    &mut rows[t * rb..(t + 1) * rb],
                    &mut params[t * pb..(t + 1) * pb],
                    book,
                );
            }
            for t in 0..tokens {
                let row = &rows[t * rb..(t + 1) * rb];
                let mut want = vec![0f32; d];
                dequantize_row(f, row, &params[t * pb..(t + 1) * pb], &mut want, book);
                let got = cpp_dequant(f, row, &params, t, d, book);
                assert_eq!(got, want, "{f} d={d} token {t} codebook {book:?}");
            }
        }
    }
}

#[test]
fn per_channel_formats_dequantize_as_the_reference() {
    let mut rng = Rng::new(4);
    for d in [64, 128, 256] {
        for bits in [LowBits::Four, LowBits::Two] {
            for book in [None, Some(random_codebook(bits, &mut rng))] {
                let book = book.as_ref();
                let f = Format::Chan { bits };
                let tokens = 32;
                let x = rng.normals(tokens * d);
                let mut rows = vec![0u8; tokens * f.row_bytes(d)];
                let mut params = vec![0u8; f.params_bytes(tokens, d)];
                quantize_chan(bits, &x, d, &mut rows, &mut params, book);
                for t in [0, 5, 31] {
                    let row = &rows[t * f.row_bytes(d)..(t + 1) * f.row_bytes(d)];
                    let mut want = vec![0f32; d];
                    dequantize_chan_row(bits, row, &params, &mut want, book);
                    let got = cpp_dequant(f, row, &params, t, d, book);
                    assert_eq!(got, want, "{f} d={d} t={t} codebook {book:?}");
                }
            }
        }
    }
}

#[test]
fn eight_channel_decoders_read_codes_in_channel_order() {
    let mut rng = Rng::new(5);
    let row: Vec<u8> = (0..256).map(|_| rng.below(256) as u8).collect();
    let cases = [
        (Format::F16, None),
        (Format::Q8, None),
        (Format::Q8_0, None),
        (
            Format::Chan {
                bits: LowBits::Four,
            },
            Some(LowBits::Four),
        ),
        (Format::Chan { bits: LowBits::Two }, Some(LowBits::Two)),
    ];
    for (f, bits) in cases {
        for c in (0..64).step_by(8) {
            let mut got = [0f32; 8];
            // SAFETY: every format reads at most 16 bytes at `c ≤ 56` within the 256-byte row
            // (q8_0: block `c / 32` of 34 bytes).
            unsafe { hipkv_ffi_codes8(f.abi_code() as i32, row.as_ptr(), c, got.as_mut_ptr()) };
            for (i, g) in got.iter().enumerate() {
                let j = c as usize + i;
                let want = match (f, bits) {
                    (Format::F16, _) => quant::get_f16(&row, 2 * j),
                    (Format::Q8, _) => f32::from(row[j] as i8),
                    (Format::Q8_0, _) => f32::from(row[j / 32 * 34 + 2 + j % 32] as i8),
                    (_, Some(b)) => f32::from(quant::code_at(&row, b, j)),
                    _ => unreachable!(),
                };
                assert_eq!(*g, want, "{f} channel {j}");
            }
        }
    }
}

/// The attention kernels decode keys from 16-byte chunks held in registers: every chunk gives
/// the codes `codes8` reads from memory, for every format but q8_0 (unaligned rows).
#[test]
fn sixteen_byte_chunks_decode_as_rows_do() {
    let mut rng = Rng::new(6);
    for f in [
        Format::F16,
        Format::Q8,
        "q4_chan".parse().unwrap(),
        "q2_tok".parse().unwrap(),
    ] {
        let per_chunk = 128 / f.nominal_bits();
        for _ in 0..64 {
            let chunk: Vec<u8> = (0..16).map(|_| rng.below(256) as u8).collect();
            for j in 0..per_chunk / 8 {
                let (mut got, mut want) = ([0f32; 8], [0f32; 8]);
                // SAFETY: both read within the 16 bytes of `chunk` (channels 8j..8j+8 of it).
                unsafe {
                    hipkv_ffi_chunk_codes8(
                        f.abi_code() as i32,
                        chunk.as_ptr(),
                        j as i32,
                        got.as_mut_ptr(),
                    );
                    hipkv_ffi_codes8(
                        f.abi_code() as i32,
                        chunk.as_ptr(),
                        8 * j as u32,
                        want.as_mut_ptr(),
                    );
                }
                // Bits, not values: random f16 patterns include NaNs.
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "{f} chunk {chunk:?} j {j}"
                );
            }
        }
    }
}

/// Integer-query scores (`iq`) apply in the kernels to the key formats the scheme accepts them
/// for, and one block's dot product there, the query's codes placed in the kernels' order, is
/// exactly `Σ q·code` over the codes the reference unpacks: random blocks and the extremes.
#[test]
fn integer_query_dots_are_exact_in_the_kernels_order() {
    for name in hipkv::scheme::KERNEL_FORMATS {
        let scheme: hipkv::Scheme = format!("k={name},v=f16").parse().unwrap();
        // SAFETY: a pure function of its argument.
        let applies = unsafe { hipkv_ffi_int_query_applies(scheme.k.abi_code() as i32) };
        assert_eq!(applies, scheme.int_query_applies(), "{name}");
    }
    let mut rng = Rng::new(8);
    for bits in [8usize, 4, 2] {
        let low = match bits {
            4 => Some(LowBits::Four),
            2 => Some(LowBits::Two),
            _ => None,
        };
        let mut cases: Vec<(Vec<u8>, Vec<i8>)> = (0..200)
            .map(|_| {
                let key = (0..4 * bits).map(|_| rng.below(256) as u8).collect();
                let query = (0..32)
                    .map(|_| (rng.below(255) as i32 - 127) as i8)
                    .collect();
                (key, query)
            })
            .collect();
        // The largest magnitudes: every code at its extreme against ±127.
        let top = if bits == 8 { 0x81 } else { 0xff }; // -127 as int8, or every code maximal
        cases.push((vec![top; 4 * bits], vec![-127; 32]));
        cases.push((vec![top; 4 * bits], vec![127; 32]));
        for (key, query) in cases {
            let want: i32 = (0..32)
                .map(|c| {
                    let code = match low {
                        Some(b) => i32::from(quant::code_at(&key, b, c)),
                        None => i32::from(key[c] as i8),
                    };
                    i32::from(query[c]) * code
                })
                .sum();
            // SAFETY: `key` holds the block's 4·bits bytes and `query` its 32 codes.
            let got = unsafe { hipkv_ffi_int_query_dot(bits as u32, key.as_ptr(), query.as_ptr()) };
            assert_eq!(got, want, "{bits}-bit key {key:?} query {query:?}");
        }
    }
}

/// The kernels place a query's int8 codes (`int_query_slot`) and fold per-channel keys a word at
/// a time (`int_query_word_channel`) by two maps that are each other's inverse, and 8-bit keys
/// keep the channel order.
#[test]
fn query_slots_and_word_channels_are_inverse() {
    for bits in [8u32, 4, 2] {
        let mut seen = [false; 256];
        for c in 0..256u32 {
            // SAFETY: pure functions of their arguments.
            let slot = unsafe { hipkv_ffi_int_query_slot(bits, c) };
            assert!(
                slot < 256 && !seen[slot as usize],
                "{bits} bits: channel {c}"
            );
            seen[slot as usize] = true;
            assert_eq!(
                slot / 32,
                c / 32,
                "{bits} bits: channel {c} leaves its block"
            );
            // SAFETY: as above.
            let back = unsafe { hipkv_ffi_int_query_word_channel(bits, slot / 4, slot % 4) };
            assert_eq!(back, c, "{bits} bits: slot {slot}");
            if bits == 8 {
                assert_eq!(slot, c);
            }
        }
    }
}

/// The kernels round a query block (formats.h `QueryScale`, from the largest magnitude's bit
/// pattern) to the same codes and scale as `quant::quantize_query`, to the bit: halves, NaN,
/// infinities, subnormals and scales on either side of the `2^-64` switch.
#[test]
fn query_rounding_agrees_bit_for_bit() {
    let blocks = hipkv::synth::query_rounding_blocks();
    let tiny = blocks
        .iter()
        .filter(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            amax > 0.0 && amax / 127.0 < quant::TINY_QUERY_SCALE
        })
        .count();
    assert!(tiny >= 5, "the 2^64 branch is exercised ({tiny} blocks)");
    for (i, block) in blocks.iter().enumerate() {
        let (mut want, mut want_scale) = ([0i8; 32], [0f32]);
        quant::quantize_query(block, &mut want, &mut want_scale);
        let (mut got, mut got_scale) = ([0i8; 32], 0f32);
        // SAFETY: `block` holds 32 floats, `got` room for 32 codes.
        unsafe { hipkv_ffi_round_query_block(block.as_ptr(), got.as_mut_ptr(), &mut got_scale) };
        let same_scale = got_scale.to_bits() == want_scale[0].to_bits()
            || (got_scale.is_nan() && want_scale[0].is_nan());
        assert!(
            same_scale && got == want,
            "block {i} {block:?}: {got:?} × {got_scale} vs {want:?} × {}",
            want_scale[0]
        );
    }
}

// Storage formats of hipkv, for device code and for the host: how a stored element is read
// back. The definitions mirror `src/scheme.rs` (layouts) and `src/quant/` (the reference
// quantizers); `tests/formats_agree.rs` calls these functions from Rust and compares.
//
//   f16      little-endian IEEE binary16 per element
//   q8       int8 per element; one f16 scale per token (params)            x = s·q
//   q8_0     per 32 channels {f16 d; int8 q[32]} inside the row (34 B)     x = d·q
//   fp8      OCP e4m3 per element; one f16 scale per token (params)        x = s·e4m3(q)
//   q4/q2_tok codes packed low bits first; (f16 scale, f16 min) per token
//            per channel group (params)                                   x = min + s·q
//   q4/q2_chan codes as above; (f16 scale, f16 min) per channel, shared by
//            the tokens of a page (params)                                x = min + s·q
//   nuq      a q4/q2 stream with a codebook L of 2^bits levels (code units)  x = min + s·L[q]
#ifndef HIPKV_FORMATS_H
#define HIPKV_FORMATS_H

#include "hipkv_device.h"

namespace hipkv {

// Every storage format the kernels are built for, once, as X(name, enum, ...): the instance
// lists of attention.hip and write.hip are made from it. `scheme::KERNEL_FORMATS` names the
// same formats; tests/resources.rs checks that the built kernels are exactly its pairs.
#define HIPKV_FORMATS(X, ...)           \
    X(f16, HIPKV_F16, __VA_ARGS__)      \
    X(q8, HIPKV_Q8, __VA_ARGS__)        \
    X(q8_0, HIPKV_Q8_0, __VA_ARGS__)    \
    X(q4_tok, HIPKV_Q4_TOK, __VA_ARGS__) \
    X(q2_tok, HIPKV_Q2_TOK, __VA_ARGS__) \
    X(q4_chan, HIPKV_Q4_CHAN, __VA_ARGS__) \
    X(q2_chan, HIPKV_Q2_CHAN, __VA_ARGS__) \
    X(fp8, HIPKV_FP8, __VA_ARGS__)

// The list expanded again inside its own expansion (format pairs): a macro cannot expand within
// itself, so the inner use is deferred (`HIPKV_DEFER`) until an outer `HIPKV_EXPAND` rescans.
#define HIPKV_EMPTY()
#define HIPKV_DEFER(m) m HIPKV_EMPTY()
#define HIPKV_EXPAND(...) __VA_ARGS__
#define HIPKV_FORMATS_AGAIN() HIPKV_FORMATS

// Bytes of one q8_0 block and channels in it.
#define HIPKV_Q8_0_BLOCK 32
#define HIPKV_Q8_0_BLOCK_BYTES 34

// log2 of a power of two: channel groups are powers of two, and a shift costs one instruction
// where a division by a run-time value costs dozens (and registers).
// (nvcc has no __builtin_ctz in device code: `__ffs` is its count of trailing zeros plus one.)
HIPKV_HD uint32_t log2_pow2(uint32_t x) {
#if defined(__CUDA_ARCH__)
    return (uint32_t)(__ffs((int)x) - 1);
#else
    return (uint32_t)__builtin_ctz(x);
#endif
}

HIPKV_LOAD_HD uint16_t load_u16(const uint8_t *p) {
    return (uint16_t)(read_global(p) | (read_global(p + 1) << 8));
}
HIPKV_HD float load_f16(const uint8_t *p) { return half_to_float(load_u16(p)); }

// fp8 e4m3 (OCP: bias 7, no infinities, NaN S.1111.111, largest ±448), as
// `src/quant/fp8.rs`. gfx12 converts in hardware (v_cvt_f32_fp8, v_cvt_pk_fp8_f32, round to
// nearest even); elsewhere (the emulator, other GPUs) the same results in software.
#define HIPKV_FP8_MAX 448.0f

// The value of e4m3 code `c` (its low byte): moved into an f16's fields it is the value times
// 2^-8, subnormals included.
HIPKV_HD float fp8_to_float_soft(uint32_t c) {
    if ((c & 0x7f) == 0x7f) return __builtin_nanf("");
    return half_to_float((uint16_t)(((c & 0x80) << 8) | ((c & 0x7f) << 7))) * 256.0f;
}

// The e4m3 code of finite `x`: round to nearest even, saturated at ±448, sign kept.
HIPKV_HD uint32_t float_to_fp8_soft(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint32_t sign = (bits >> 24) & 0x80;
    const float a = fminf(fabsf(x), HIPKV_FP8_MAX);
    // Subnormal: multiples of 2^-9 (rounding up to 2^-6 gives code 8, the first normal).
    if (a < 0.015625f) return sign | (uint32_t)rintf(a * 512.0f);
    memcpy(&bits, &a, 4);
    // The f32 exponent and mantissa rounded to 3 mantissa bits (ties to even), rebiased.
    const uint32_t rounded = (bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
    return sign | (rounded - (120u << 3));
}

HIPKV_HD uint32_t float_to_fp8(float x) {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__GFX12__)
    // Clamped first, so the code never depends on what the conversion does past ±448.
    const float c = fminf(fmaxf(x, -HIPKV_FP8_MAX), HIPKV_FP8_MAX);
    return (uint32_t)__builtin_amdgcn_cvt_pk_fp8_f32(c, c, 0, false) & 0xffu;
#else
    return float_to_fp8_soft(x);
#endif
}

// The four e4m3 codes of `w`, low byte first, as floats.
HIPKV_HD void fp8x4(uint32_t w, float out[4]) {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__GFX12__)
    out[0] = __builtin_amdgcn_cvt_f32_fp8((int)w, 0);
    out[1] = __builtin_amdgcn_cvt_f32_fp8((int)w, 1);
    out[2] = __builtin_amdgcn_cvt_f32_fp8((int)w, 2);
    out[3] = __builtin_amdgcn_cvt_f32_fp8((int)w, 3);
#else
    for (int i = 0; i < 4; ++i) out[i] = fp8_to_float_soft((w >> (8 * i)) & 0xffu);
#endif
}

// The value of e4m3 code `c` (its low byte).
HIPKV_HD float fp8_to_float(uint32_t c) {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__GFX12__)
    return __builtin_amdgcn_cvt_f32_fp8((int)c, 0);
#else
    return fp8_to_float_soft(c);
#endif
}

HIPKV_HD constexpr int format_bits(int f) {
    return f == HIPKV_F16 ? 16 : (f == HIPKV_Q8 || f == HIPKV_Q8_0 || f == HIPKV_FP8) ? 8
                               : (f == HIPKV_Q4_TOK || f == HIPKV_Q4_CHAN) ? 4 : 2;
}
HIPKV_HD constexpr bool format_is_tok(int f) { return f == HIPKV_Q4_TOK || f == HIPKV_Q2_TOK; }
HIPKV_HD constexpr bool format_is_chan(int f) { return f == HIPKV_Q4_CHAN || f == HIPKV_Q2_CHAN; }
// The formats a codebook may apply to: the asymmetric low-bit ones.
HIPKV_HD constexpr bool format_has_levels(int f) { return format_is_tok(f) || format_is_chan(f); }
// The key formats integer-query scores apply to (`iq`, hipkv_attn_params::int_query): uniform
// integer codes with per-token, per-block or (folded into the query) per-channel parameters
// (`Scheme::int_query_applies`).
HIPKV_HD constexpr bool format_int_query(int f) {
    return f == HIPKV_Q8 || f == HIPKV_Q8_0 || format_is_tok(f) || format_is_chan(f);
}

// Where channel c's code goes among a query row's int8 codes (`hipkv_attn_params::q_codes`)
// for keys of `bits` bits per code (8, 4, 2), so that each 4-byte word of query codes lines up
// with a key word unpacked by one shift and mask. A key word holds the codes of 4P channels
// (P = 8/bits per byte, low bits first); `(word >> bits·j) & mask` keeps code j of each byte,
// channels j + {0, P, 2P, 3P} of the word, which query word j of the key word's holds in that
// order. 8-bit keys keep the natural order.
HIPKV_HD uint32_t int_query_slot(uint32_t bits, uint32_t c) {
    const uint32_t per = 8 / bits, i = c % (4 * per);
    return c - i + (i % per) * 4 + i / per;
}

// The channel whose code sits at slot 4·word + k of a query row (`int_query_slot`'s inverse):
// a key word's channels are word%P + {0, P, 2P, 3P} of its block of 4P.
HIPKV_HD uint32_t int_query_word_channel(uint32_t bits, uint32_t word, uint32_t k) {
    const uint32_t per = 8 / bits;
    return 4 * per * (word / per) + word % per + per * k;
}

// How a HIPKV_QUERY_BLOCK block of the query is rounded to int8, as `quant::QueryScale` rounds
// it, to the bit: `s = max|x| / 127` (NaN for a block with a NaN or an infinity), `p = 2^64`
// where `s < 2^-64` (else 1) so that `inv = 1 / (s·p)` stays finite, and each code `(x·p)·inv`
// rounded halves away from zero, 0 where `s` is 0 or NaN. Built from the largest of the
// block's magnitudes as bit patterns, which NaN and ±inf exceed.
struct QueryScale {
    float s, p, inv;

    // What the constructor takes the largest of: `|x|` as a bit pattern, which orders finite
    // magnitudes as their values and puts every NaN and infinity above them.
    HIPKV_HD static uint32_t magnitude(float x) { return float_bits(x) & 0x7fffffffu; }

    HIPKV_HD explicit QueryScale(uint32_t magnitude_bits) {
        s = magnitude_bits < 0x7f800000u ? bits_float(magnitude_bits) / 127.0f : __builtin_nanf("");
        p = s < 0x1p-64f ? 0x1p64f : 1.0f;
        inv = 1.0f / (s * p);
    }

    // `|(x·p)·inv| < 127.5`, so adding the largest float below ½ with the value's sign and
    // truncating is the rounding, with no clamp (and no conversion of a NaN or an infinity:
    // those come only with a scale that is not positive). Each product is rounded before the
    // sum, as the reference rounds them: never fused.
    HIPKV_HD int32_t code(float x) const {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
        const float y = s > 0.0f ? (x * p) * inv : 0.0f;
        return (int32_t)(y + copysignf(0.49999997f, y));
    }
};

// dot[r] = Σ q_r · k over one HIPKV_QUERY_BLOCK-channel block, exactly, for rows r < rows: the
// key's B words of codes as stored (two's-complement bytes, or unsigned low-bit codes, which
// are < 128 and so the same as signed bytes) against each row's 8 words of query codes in
// `int_query_slot` order, word i of row r being `query(r, i)`. Each key word is unpacked once
// for every row.
template <uint32_t B, int R, class Query>
HIPKV_HD void int_query_dots(const uint32_t key[B], Query query, uint32_t rows, int32_t dot[R]) {
    constexpr uint32_t per = 8 / B;
    constexpr uint32_t mask = (0x01010101u << B) - 0x01010101u;  // B low bits of every byte
    for (int r = 0; r < R; ++r) dot[r] = 0;
    for (uint32_t w = 0; w < B; ++w)
        for (uint32_t j = 0; j < per; ++j) {
            const uint32_t k = (key[w] >> (B * j)) & mask;
            for (int r = 0; r < R; ++r)
                if ((uint32_t)r < rows) dot[r] = dot4_i8(query(r, w * per + j), k, dot[r]);
        }
}

// Bytes of one token row of `head_dim` channels.
HIPKV_HD uint32_t row_bytes(int f, uint32_t head_dim) {
    switch (f) {
        case HIPKV_F16: return 2 * head_dim;
        case HIPKV_Q8: case HIPKV_FP8: return head_dim;
        case HIPKV_Q8_0: return head_dim / HIPKV_Q8_0_BLOCK * HIPKV_Q8_0_BLOCK_BYTES;
        default: return head_dim * format_bits(f) / 8;
    }
}

// Where a format's parameters live, for `x = min + scale · value(code)`.
enum class ParamsAt {
    None,         // f16: the value itself
    TokenScale,   // q8, fp8: one f16 scale per token, in the stream's parameter section
    BlockScale,   // q8_0: one f16 scale per 32 channels, inside the row
    TokenGroups,  // q4/q2_tok: (f16 scale, f16 min) per token and channel group
    Channels,     // q4/q2_chan: (f16 scale, f16 min) per channel, shared by a page's tokens
};

// Per-format traits, one specialization per storage format (as llama.cpp's fattn-common.cuh
// gathers each quant type's decoding): how the bits of one code become the float that the
// parameters scale (`value`; `values4` for the four 8-bit codes of a word, which gfx12 converts
// from fp8 without extracting them), where the parameters live (`params`), and, for the
// symmetric 8-bit formats, the largest code magnitude and the code of `x` at a scale. Where the
// codes sit in a row follows from `format_bits` (and q8_0's blocks), so the readers below branch
// on bit width and leave the rest to these.
template <int F>
struct Format;

// Codes without sign: the low-bit formats (and codebook indices).
template <ParamsAt P>
struct UnsignedCodes {
    static constexpr ParamsAt params = P;
    HIPKV_HD static float value(uint32_t code) { return (float)code; }
};

// Two's-complement int8 codes, |code| ≤ 127.
struct Int8Codes {
    static constexpr float kMaxCode = 127.0f;
    // Through int32: LLVM lowers a direct int8 -> float conversion for AMDGPU as two sign
    // extensions (8 to 16, 16 to 32 bits) before the conversion, one instruction more per code.
    HIPKV_HD static float value(uint32_t code) { return (float)(int32_t)(int8_t)code; }
    HIPKV_HD static void values4(uint32_t w, float out[4]) {
        for (int i = 0; i < 4; ++i) out[i] = value(w >> (8 * i));
    }
    HIPKV_HD static uint8_t encode(float x, float scale) {
        if (scale == 0.0f) return 0;
        return (uint8_t)(int8_t)(int)fminf(fmaxf(roundf(x / scale), -kMaxCode), kMaxCode);
    }
};

template <>
struct Format<HIPKV_F16> {
    static constexpr ParamsAt params = ParamsAt::None;
    HIPKV_HD static float value(uint32_t code) { return half_to_float((uint16_t)code); }
};

template <>
struct Format<HIPKV_Q8> : Int8Codes {
    static constexpr ParamsAt params = ParamsAt::TokenScale;
};

template <>
struct Format<HIPKV_Q8_0> : Int8Codes {
    static constexpr ParamsAt params = ParamsAt::BlockScale;
};

template <>
struct Format<HIPKV_FP8> {
    static constexpr ParamsAt params = ParamsAt::TokenScale;
    static constexpr float kMaxCode = HIPKV_FP8_MAX;
    HIPKV_HD static float value(uint32_t code) { return fp8_to_float(code); }
    HIPKV_HD static void values4(uint32_t w, float out[4]) { fp8x4(w, out); }
    HIPKV_HD static uint8_t encode(float x, float scale) {
        return scale == 0.0f ? 0 : (uint8_t)float_to_fp8(x / scale);
    }
};

template <>
struct Format<HIPKV_Q4_TOK> : UnsignedCodes<ParamsAt::TokenGroups> {};
template <>
struct Format<HIPKV_Q2_TOK> : UnsignedCodes<ParamsAt::TokenGroups> {};
template <>
struct Format<HIPKV_Q4_CHAN> : UnsignedCodes<ParamsAt::Channels> {};
template <>
struct Format<HIPKV_Q2_CHAN> : UnsignedCodes<ParamsAt::Channels> {};

template <int F>
constexpr ParamsAt kParams = Format<F>::params;

// The predicates above, which row_bytes and the host also use at run time, agree with the traits.
#define HIPKV_CHECK_TRAITS(name, F, ...)                                                  \
    static_assert(format_is_tok(F) == (kParams<F> == ParamsAt::TokenGroups) &&            \
                      format_is_chan(F) == (kParams<F> == ParamsAt::Channels) &&          \
                      (format_bits(F) < 8) == format_has_levels(F),                       \
                  #name ": traits and predicates disagree");
HIPKV_FORMATS(HIPKV_CHECK_TRAITS, )
#undef HIPKV_CHECK_TRAITS

// Byte offset of channel c's code in a q8_0 row: past the scales of its block and those before.
HIPKV_HD uint32_t q8_0_code_offset(uint32_t c) {
    return (c / HIPKV_Q8_0_BLOCK) * HIPKV_Q8_0_BLOCK_BYTES + 2 + c % HIPKV_Q8_0_BLOCK;
}

// `x`, which the compiler may not look into: on gfx12 this keeps `nibble_codes8`'s masks apart
// from the byte conversions after them, which LLVM would otherwise fold back into one field
// extract per code. Elsewhere it is `x`.
HIPKV_HD uint32_t opaque_bits(uint32_t x) {
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN__)
    __asm__("" : "+v"(x));
#endif
    return x;
}

// The 8 codes of a little-endian word of 4-bit codes (code i in bits 4i..4i+4), as floats (the
// low-bit formats' `UnsignedCodes::value`). The low nibbles of all four bytes are masked out at
// once, then the high ones, and each byte is converted by its own `v_cvt_f32_ubyteN`: 3 VALU for
// the masks and one per code, where a field extract and a conversion took two per code.
HIPKV_HD void nibble_codes8(uint32_t w, float out[8]) {
    const uint32_t low = opaque_bits(w & 0x0f0f0f0fu);
    const uint32_t high = opaque_bits((w >> 4) & 0x0f0f0f0fu);
    for (int b = 0; b < 4; ++b) {
        out[2 * b] = (float)((low >> (8 * b)) & 0xffu);
        out[2 * b + 1] = (float)((high >> (8 * b)) & 0xffu);
    }
}

// The raw code (or, for f16, the value; for fp8, the e4m3 value) of channels c..c+8 of one
// row, as floats, c % 8 == 0.
// For q8_0 the codes only: the block scale is read by `q8_0_scale`.
template <int F>
HIPKV_HD void codes8(const uint8_t *row, uint32_t c, float out[8]) {
    using Fmt = Format<F>;
    constexpr uint32_t bits = format_bits(F);
    if constexpr (bits == 16) {
        for (int i = 0; i < 8; ++i) out[i] = Fmt::value(load_u16(row + 2 * (c + i)));
    } else if constexpr (bits == 8) {
        const uint8_t *p = kParams<F> == ParamsAt::BlockScale ? row + q8_0_code_offset(c) : row + c;
        for (int i = 0; i < 8; ++i) out[i] = Fmt::value(read_global(p + i));
    } else {
        // Eight codes in 4 bytes (4-bit) or 2 (2-bit).
        const uint8_t *p = row + c * bits / 8;
        uint32_t w = (uint32_t)read_global(p) | ((uint32_t)read_global(p + 1) << 8);
        if constexpr (bits == 4)
            w |= ((uint32_t)read_global(p + 2) << 16) | ((uint32_t)read_global(p + 3) << 24);
        if constexpr (bits == 4) {
            nibble_codes8(w, out);
        } else {
            for (int i = 0; i < 8; ++i) out[i] = Fmt::value((w >> (bits * i)) & ((1u << bits) - 1));
        }
    }
}

// Codebooks (nuq, `src/quant/codebook.rs`): at most 16 levels, strictly increasing, in code
// units. A code decodes to its level; a value takes the code of the nearest level.
#define HIPKV_MAX_LEVELS 16

// Codes (exact small integers as floats, as `codes8` and the like read them) replaced by the
// levels they decode to.
template <int N>
HIPKV_HD void codes_to_levels(const float *levels, float x[N]) {
    for (int i = 0; i < N; ++i) x[i] = levels[(uint32_t)x[i]];
}

// The code of a normalized value `u = (x − min) / scale` in a codebook of 2^B levels: how many
// of the midpoints (L[i] + L[i+1]) · 0.5 lie at or below `u`, with the f32 operations of
// `Codebook::code`. Null levels are the uniform ones, whose midpoints i + 0.5 give exactly
// round(u) (half away from zero) clamped to the codes: one rule for every low-bit stream.
template <int B>
struct Midpoints {
    float at[(1 << B) - 1];

    HIPKV_HD explicit Midpoints(const float *levels) {
        for (int i = 0; i + 1 < (1 << B); ++i)
            at[i] = levels != nullptr ? (levels[i] + levels[i + 1]) * 0.5f : (float)i + 0.5f;
    }
    HIPKV_HD uint32_t code(float u) const {
        uint32_t code = 0;
        for (int i = 0; i + 1 < (1 << B); ++i) code += at[i] <= u ? 1u : 0u;
        return code;
    }
};

// Channels in 16 bytes of a row (f16 8, q8 and fp8 16, q4 32, q2 64); not for q8_0, whose
// 34-byte blocks leave rows unaligned.
template <int F>
constexpr uint32_t kChunkChannels = 128 / format_bits(F);

// The raw codes of channels 8j..8j+8 of a 16-byte chunk of a row already in registers, as
// `codes8` reads them from memory (f16, fp8: the values).
template <int F>
HIPKV_HD void chunk_codes8(const Bytes16 &b, int j, float out[8]) {
    static_assert(kParams<F> != ParamsAt::BlockScale, "q8_0 rows are not 16-byte aligned");
    using Fmt = Format<F>;
    constexpr uint32_t bits = format_bits(F);
    if constexpr (bits == 16) {
        for (int i = 0; i < 8; ++i) out[i] = Fmt::value(b.w[i / 2] >> (16 * (i % 2)));
    } else if constexpr (bits == 8) {
        Fmt::values4(b.w[2 * j], out);
        Fmt::values4(b.w[2 * j + 1], out + 4);
    } else if constexpr (bits == 4) {
        nibble_codes8(b.w[j], out);
    } else {
        const uint32_t half = b.w[j / 2] >> (16 * (j % 2));
        for (int i = 0; i < 8; ++i) out[i] = Fmt::value((half >> (2 * i)) & 3u);
    }
}

#if defined(HIPKV_DEV)
// The raw codes (f16, fp8: values) of channels c0..c0+N of a row, N a power of two, c0 a multiple
// of N, read in one load of N·bits bits (at most 128), or of the aligned 32-bit word holding
// them; not q8_0. Rows are 16-byte aligned (`docs/formats.md`).
template <int F, int N>
HIPKV_DEV void lane_codes(const uint8_t *row, uint32_t c0, float out[N]) {
    static_assert(kParams<F> != ParamsAt::BlockScale, "q8_0 rows are not aligned");
    constexpr uint32_t bits = format_bits(F), total = N * bits;
    static_assert(total <= 128, "at most 16 bytes per lane");
    uint32_t w[4];
    if constexpr (total <= 32) {
        const uint32_t bit = c0 * bits;
        w[0] = load4(row + (bit / 32) * 4) >> (bit % 32);
    } else {
        const Bytes16 b = total == 64 ? load8(row + c0 * bits / 8) : load16(row + c0 * bits / 8);
        for (int i = 0; i < 4; ++i) w[i] = b.w[i];
    }
    constexpr uint32_t mask = bits == 32 ? 0xffffffffu : (1u << bits) - 1u;
    for (int i = 0; i < N; ++i) {
        out[i] = Format<F>::value((w[i * bits / 32] >> (i * bits % 32)) & mask);
    }
}
#endif

// The raw code (f16, fp8: value) of channel c of one row (for outlier corrections).
template <int F>
HIPKV_HD float code1(const uint8_t *row, uint32_t c) {
    constexpr uint32_t bits = format_bits(F);
    if constexpr (bits == 16) {
        return Format<F>::value(load_u16(row + 2 * c));
    } else if constexpr (bits == 8) {
        const uint32_t at = kParams<F> == ParamsAt::BlockScale ? q8_0_code_offset(c) : c;
        return Format<F>::value(read_global(row + at));
    } else {
        constexpr uint32_t per = 8 / bits;
        return Format<F>::value((read_global(row + c / per) >> ((c % per) * bits)) & ((1u << bits) - 1));
    }
}

// Scale of the q8_0 block holding channel c.
HIPKV_HD float q8_0_scale(const uint8_t *row, uint32_t c) {
    return load_f16(row + (c / HIPKV_Q8_0_BLOCK) * HIPKV_Q8_0_BLOCK_BYTES);
}

// Where the f16 scale and minimum of channel c's group of token t lie in a per-token-groups
// stream's parameter section `params` (4 bytes per group, the token's groups in a row).
HIPKV_HD const uint8_t *token_group_params(const uint8_t *params, uint32_t t, uint32_t c,
                                           uint32_t head_dim, uint32_t group) {
    const uint32_t shift = log2_pow2(group);
    return params + 4 * (t * (head_dim >> shift) + (c >> shift));
}

// Parameters of one element, `x = min + scale · code` (min = 0 for f16/q8/q8_0/fp8, scale = 1
// for f16). `params` is the stream's parameter section of the page, `t` the token within the
// page, `group` the channels per group of per-token formats.
template <int F>
HIPKV_HD void element_params(const uint8_t *row, const uint8_t *params, uint32_t t, uint32_t c,
                             uint32_t head_dim, uint32_t group, float *scale, float *min) {
    *min = 0.0f;
    *scale = 1.0f;
    constexpr ParamsAt at = kParams<F>;
    if constexpr (at == ParamsAt::TokenScale) {
        *scale = load_f16(params + 2 * t);
    } else if constexpr (at == ParamsAt::BlockScale) {
        *scale = q8_0_scale(row, c);
    } else if constexpr (at == ParamsAt::TokenGroups) {
        const uint8_t *p = token_group_params(params, t, c, head_dim, group);
        *scale = load_f16(p);
        *min = load_f16(p + 2);
    } else if constexpr (at == ParamsAt::Channels) {
        *scale = load_f16(params + 4 * c);
        *min = load_f16(params + 4 * c + 2);
    }
}

// The dequantized (dense) value of channel c of token t, exactly as `src/quant` computes it.
// `levels`: the stream's codebook (nuq), or null.
template <int F>
HIPKV_HD float dequant1(const uint8_t *row, const uint8_t *params, uint32_t t, uint32_t c,
                        uint32_t head_dim, uint32_t group, const float *levels) {
    float scale, min;
    element_params<F>(row, params, t, c, head_dim, group, &scale, &min);
    float code = code1<F>(row, c);
    if constexpr (kParams<F> == ParamsAt::None) return code;
    if constexpr (!format_has_levels(F)) return scale * code;
    if (levels != nullptr) code = levels[(uint32_t)code];
    return min + scale * code;
}

// The rotation of `rot` schemes (`src/quant/rotation.rs`): H/√d of one head, in stages of
// stride h = 1, 2, …, d/2, each butterfly (a, b) → (a + b, a − b), then one multiplication by
// `hadamard_scale(d)`. The same steps in the same order on every side, so the stored bytes agree.
#define HIPKV_MAX_HEAD_DIM 256

// 1/√d rounded to f32, for head_dim 64, 128 or 256.
HIPKV_HD float hadamard_scale(uint32_t d) {
    return d == 64 ? 0.125f : d == 128 ? 0.0883883476483184405f : 0.0625f;
}

// 1/√d in f64, for the rotations of queries and outputs, which are done in f64: once per query
// row, they cost nothing and add one f32 rounding instead of one per stage.
HIPKV_HD double hadamard_scale_f64(uint32_t d) {
    return d == 64 ? 0.125 : d == 128 ? 0.08838834764831845 : 0.0625;
}

// Butterfly `b` (of d/2) of the stage of stride `h`: elements i (bit h clear) and i + h.
template <class T>
HIPKV_HD void hadamard_butterfly(T *x, uint32_t b, uint32_t h) {
    const uint32_t i = ((b & ~(h - 1)) << 1) | (b & (h - 1));
    const T lo = x[i], hi = x[i + h];
    x[i] = lo + hi;
    x[i + h] = lo - hi;
}

}  // namespace hipkv

#if defined(HIPKV_EMU) || defined(__HIPCC__) || defined(__HIP__) || defined(__CUDACC__)
namespace hipkv {

// Rotates the `d` values at `x`, in LDS, by H/√d, with the lanes of one wave: lane i takes
// butterflies i, i + 32, … of every stage. Every lane must call it; the wave may read `x` after.
// f32 for stored rows (bit for bit as `quant::hadamard`), f64 for queries and outputs.
template <class T>
HIPKV_DEV void hadamard_wave(T *x, uint32_t d) {
    wave_sync();
    for (uint32_t h = 1; h < d; h *= 2) {
        for (uint32_t b = lane_id(); b < d / 2; b += HIPKV_WAVE) hadamard_butterfly(x, b, h);
        wave_sync();
    }
    const T scale = sizeof(T) == sizeof(double) ? (T)hadamard_scale_f64(d) : (T)hadamard_scale(d);
    for (uint32_t c = lane_id(); c < d; c += HIPKV_WAVE) x[c] *= scale;
    wave_sync();
}

}  // namespace hipkv
#endif

#endif

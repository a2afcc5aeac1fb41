// C entry points to the device-side format functions of formats.h, so that Rust tests can check
// them against the reference quantizers in src/quant (tests/formats_agree.rs).
#include "formats.h"

extern "C" float hipkv_ffi_half_to_float(uint16_t h) { return hipkv::half_to_float(h); }
extern "C" uint16_t hipkv_ffi_float_to_half(float f) { return hipkv::float_to_half(f); }

// Dequantizes channels [0, head_dim) of token `t` of a stream stored in `format`: `row` is the
// token's packed row, `params` the stream's parameter section (page-relative, as in a page),
// `levels` its codebook or null.
extern "C" void hipkv_ffi_dequant_row(int format, const uint8_t *row, const uint8_t *params,
                                      uint32_t t, uint32_t head_dim, uint32_t group,
                                      const float *levels, float *out) {
    for (uint32_t c = 0; c < head_dim; ++c) {
        switch (format) {
            case HIPKV_F16: out[c] = hipkv::dequant1<HIPKV_F16>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q8: out[c] = hipkv::dequant1<HIPKV_Q8>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q8_0: out[c] = hipkv::dequant1<HIPKV_Q8_0>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q4_TOK: out[c] = hipkv::dequant1<HIPKV_Q4_TOK>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q2_TOK: out[c] = hipkv::dequant1<HIPKV_Q2_TOK>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q4_CHAN: out[c] = hipkv::dequant1<HIPKV_Q4_CHAN>(row, params, t, c, head_dim, group, levels); break;
            case HIPKV_Q2_CHAN: out[c] = hipkv::dequant1<HIPKV_Q2_CHAN>(row, params, t, c, head_dim, group, levels); break;
            default: out[c] = 0.0f; break;
        }
    }
}

// Eight raw codes of channels c..c+8 as the attention loops decode them.
extern "C" void hipkv_ffi_codes8(int format, const uint8_t *row, uint32_t c, float *out) {
    switch (format) {
        case HIPKV_F16: hipkv::codes8<HIPKV_F16>(row, c, out); break;
        case HIPKV_Q8: hipkv::codes8<HIPKV_Q8>(row, c, out); break;
        case HIPKV_Q8_0: hipkv::codes8<HIPKV_Q8_0>(row, c, out); break;
        case HIPKV_Q4_TOK: case HIPKV_Q4_CHAN: hipkv::codes8<HIPKV_Q4_TOK>(row, c, out); break;
        default: hipkv::codes8<HIPKV_Q2_TOK>(row, c, out); break;
    }
}

// Codes of channels 8j..8j+8 of a 16-byte chunk, as the attention kernels decode key rows.
extern "C" void hipkv_ffi_chunk_codes8(int format, const uint8_t *chunk, int j, float *out) {
    hipkv::Bytes16 b;
    memcpy(&b, chunk, sizeof b);
    switch (format) {
        case HIPKV_F16: hipkv::chunk_codes8<HIPKV_F16>(b, j, out); break;
        case HIPKV_Q8: hipkv::chunk_codes8<HIPKV_Q8>(b, j, out); break;
        case HIPKV_Q4_TOK: case HIPKV_Q4_CHAN: hipkv::chunk_codes8<HIPKV_Q4_TOK>(b, j, out); break;
        default: hipkv::chunk_codes8<HIPKV_Q2_TOK>(b, j, out); break;
    }
}

// The code of normalized value `u` in a codebook of 2^bits levels (null: uniform), as the write
// kernels select it.
extern "C" uint32_t hipkv_ffi_level_code(uint32_t bits, const float *levels, float u) {
    return bits == 4 ? hipkv::Midpoints<4>(levels).code(u) : hipkv::Midpoints<2>(levels).code(u);
}

// The fp8 e4m3 conversions the kernels use off gfx12 (the emulator's).
extern "C" float hipkv_ffi_fp8_to_float(uint32_t c) { return hipkv::fp8_to_float(c); }
extern "C" uint32_t hipkv_ffi_float_to_fp8(float x) { return hipkv::float_to_fp8(x); }

// HIPKV_MAX_LEVELS, for the Rust mirror's test.
extern "C" uint32_t hipkv_ffi_max_levels() { return HIPKV_MAX_LEVELS; }

// HIPKV_ROWS(head_dim), for the Rust mirror's test.
extern "C" uint32_t hipkv_ffi_rows(uint32_t head_dim) { return HIPKV_ROWS(head_dim); }

// HIPKV_VALUE_TOKENS(head_dim), for the Rust mirror's test.
extern "C" uint32_t hipkv_ffi_value_tokens(uint32_t head_dim) { return HIPKV_VALUE_TOKENS(head_dim); }

// 1/√d in f64, with which queries and outputs are rotated.
extern "C" double hipkv_ffi_hadamard_scale_f64(uint32_t d) { return hipkv::hadamard_scale_f64(d); }

// The rotation of `rot` schemes, one butterfly at a time in the kernels' order.
extern "C" void hipkv_ffi_hadamard(float *x, uint32_t d) {
    for (uint32_t h = 1; h < d; h *= 2)
        for (uint32_t b = 0; b < d / 2; ++b) hipkv::hadamard_butterfly(x, b, h);
    for (uint32_t c = 0; c < d; ++c) x[c] *= hipkv::hadamard_scale(d);
}

// Whether integer-query scores (`iq`) apply to keys stored in `format`.
extern "C" bool hipkv_ffi_int_query_applies(int format) { return hipkv::format_int_query(format); }

// Where channel c's query code goes (`int_query_slot`), and which channel slot 4·word + k holds.
extern "C" uint32_t hipkv_ffi_int_query_slot(uint32_t bits, uint32_t c) {
    return hipkv::int_query_slot(bits, c);
}
extern "C" uint32_t hipkv_ffi_int_query_word_channel(uint32_t bits, uint32_t word, uint32_t k) {
    return hipkv::int_query_word_channel(bits, word, k);
}

// One HIPKV_QUERY_BLOCK block of the query rounded as the kernels round it (`QueryScale`, from
// the largest magnitude's bit pattern): its codes in channel order and its scale.
extern "C" void hipkv_ffi_round_query_block(const float *x, int8_t *codes, float *scale) {
    uint32_t magnitude = 0;
    for (uint32_t c = 0; c < HIPKV_QUERY_BLOCK; ++c) {
        const uint32_t m = hipkv::QueryScale::magnitude(x[c]);
        magnitude = m > magnitude ? m : magnitude;
    }
    const hipkv::QueryScale block(magnitude);
    for (uint32_t c = 0; c < HIPKV_QUERY_BLOCK; ++c) codes[c] = (int8_t)block.code(x[c]);
    *scale = block.s;
}

// One HIPKV_QUERY_BLOCK block's integer-query dot product as the attention kernels compute it:
// `key` the block's codes as stored (bits · 4 bytes; q8_0's after its scale), `query` its 32
// int8 codes in channel order, placed at their `int_query_slot` as hipkv_attn_prep places them.
extern "C" int32_t hipkv_ffi_int_query_dot(uint32_t bits, const uint8_t *key, const int8_t *query) {
    uint8_t placed[HIPKV_QUERY_BLOCK];
    for (uint32_t c = 0; c < HIPKV_QUERY_BLOCK; ++c)
        placed[hipkv::int_query_slot(bits, c)] = (uint8_t)query[c];
    uint32_t q[HIPKV_QUERY_BLOCK / 4], k[8];
    memcpy(q, placed, sizeof q);
    memcpy(k, key, 4 * bits);
    const auto word = [&](int, uint32_t i) { return q[i]; };
    int32_t dot[1];
    switch (bits) {
        case 8: hipkv::int_query_dots<8, 1>(k, word, 1, dot); break;
        case 4: hipkv::int_query_dots<4, 1>(k, word, 1, dot); break;
        default: hipkv::int_query_dots<2, 1>(k, word, 1, dot); break;
    }
    return dot[0];
}

// Append kernels: new tokens of one sequence, in f16, written into the cache's storage of one
// stream (keys or values), computing exactly what `src/quant` and `KvCache::append` compute on
// the CPU, byte for byte. `docs/kernels.md` describes them.
//
// Grid (tokens, kv_heads); one wave per (new token, KV head). Lane i owns N consecutive channels
// of a row (N = head_dim / 32, at least one byte of codes), so its codes pack into whole bytes:
//   sinks:          f16 copy into the sequence's sink buffer;
//   per-token:      clip outliers into the sparse store, then the row's scale (and minimum, per
//                   channel group) from a min/max or |max| reduction over the lanes of the group,
//                   then codes;
//   per-channel:    the wave of a page's last token quantizes the whole page: outliers of every
//                   token, per-channel min/max over the page's tokens (older ones come from the
//                   residual window), then every token's codes. `hipkv_append_residual` stores
//                   the tokens of a page left open in the residual window, launched after.
#include "hipkv_device.h"
#include "formats.h"

namespace hipkv {

// Channels of a row each lane owns: head_dim / 32, or more where that would not fill a byte
// with codes (2-bit at head_dim 64: the upper half of the wave has no channels).
template <int F, int D>
constexpr int kLaneChannels =
    (D / HIPKV_WAVE) * format_bits(F) >= 8 ? D / HIPKV_WAVE : 8 / format_bits(F);

constexpr float kInf = __builtin_huge_valf();

HIPKV_DEV void store_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

// Maximum and minimum over aligned segments of `width` lanes (a power of two up to 32).
HIPKV_DEV float segment_max(float x, uint32_t width) {
    for (uint32_t m = width / 2; m > 0; m /= 2) x = fmaxf(x, shfl_xor(x, (int)m));
    return x;
}
HIPKV_DEV float segment_min(float x, uint32_t width) {
    for (uint32_t m = width / 2; m > 0; m /= 2) x = fminf(x, shfl_xor(x, (int)m));
    return x;
}

// `x` rounded to f16 and back.
HIPKV_DEV float round_f16(float x) { return half_to_float(float_to_half(x)); }

// Scale and minimum of an asymmetric group spanning [lo, hi], rounded to f16. Adding +0
// turns a −0 into +0: min/max may return either zero when both occur, and the stored bytes
// must not depend on which (`src/quant` does the same).
template <int F>
HIPKV_DEV void asym_params(float lo, float hi, float *scale, float *min) {
    constexpr float max_code = (float)((1 << format_bits(F)) - 1);
    lo += 0.0f;
    hi += 0.0f;
    *scale = round_f16((hi - lo) / max_code);
    *min = round_f16(lo);
}

// The code of `x` in an asymmetric group: round half away from zero, clamped.
template <int F>
HIPKV_DEV uint32_t asym_code(float x, float scale, float min) {
    constexpr float max_code = (float)((1 << format_bits(F)) - 1);
    if (scale == 0.0f) return 0;
    return (uint32_t)fminf(fmaxf(roundf((x - min) / scale), 0.0f), max_code);
}

// The code of `x` in a symmetric int8 group.
HIPKV_DEV uint8_t sym_code(float x, float scale) {
    if (scale == 0.0f) return 0;
    return (uint8_t)(int8_t)(int)fminf(fmaxf(roundf(x / scale), -127.0f), 127.0f);
}

// Packs the N codes of a lane, low bits first, into N·bits/8 bytes at `out`.
template <int F, int N>
HIPKV_DEV void store_codes(uint8_t *out, const uint32_t codes[N]) {
    constexpr int bits = format_bits(F), per = 8 / bits;
    for (int b = 0; b < N / per; ++b) {
        uint32_t byte = 0;
        for (int i = 0; i < per; ++i) byte |= codes[b * per + i] << (i * bits);
        out[b] = (uint8_t)byte;
    }
}

// The f16 row of position `pos` of `head`: from the new tokens, or from the residual window
// when it was appended before this launch (per-channel formats only).
template <int D>
HIPKV_DEV const uint16_t *token_row(const hipkv_append_params &p, uint32_t pos, uint32_t head) {
    if (pos >= p.first_pos)
        return p.x + ((size_t)(pos - p.first_pos) * p.kv_heads + head) * D;
    const uint32_t slot = (pos - p.sinks) % p.group_tokens;
    return p.residual + ((size_t)head * p.group_tokens + slot) * D;
}

// The lane's channels [c0, c0 + N) of an f16 row, as floats (0 for lanes without channels).
template <int N>
HIPKV_DEV void load_lane(const uint16_t *row, uint32_t c0, bool active, float x[N]) {
    for (int i = 0; i < N; ++i) x[i] = active ? half_to_float(row[c0 + i]) : 0.0f;
}

// Clips the lane's channels to the head's outlier thresholds.
template <int N, int D>
HIPKV_DEV void clip(const hipkv_append_params &p, uint32_t head, uint32_t c0, bool active,
                    float x[N]) {
    if (!active) return;
    const float *lo = p.outlier_lo + (size_t)head * D + c0;
    const float *hi = p.outlier_hi + (size_t)head * D + c0;
    for (int i = 0; i < N; ++i) x[i] = x[i] < lo[i] ? lo[i] : (x[i] > hi[i] ? hi[i] : x[i]);
}

// Moves the outliers of token `t` of a head block into its sparse store and clips them in `x`,
// as `quant::split_outliers` does: all of them when they fit in the token's slots, otherwise
// the ones farthest outside their range (ties: lower channel first); in channel order either
// way. Those left out stay clipped and are counted in `outliers_dropped`.
template <int N, int D>
HIPKV_DEV void store_outliers(const hipkv_append_params &p, uint8_t *block, uint32_t t,
                              uint32_t head, uint32_t c0, bool active, float x[N]) {
    __shared__ float distances[D];
    __shared__ uint32_t kept_by_lane[HIPKV_WAVE];
    const uint32_t cap = p.layout.outlier_slots;
    float exact[N], dist[N];
    for (int i = 0; i < N; ++i) exact[i] = x[i];
    clip<N, D>(p, head, c0, active, x);
    uint32_t found = 0;
    for (int i = 0; i < N; ++i) {
        dist[i] = fabsf(exact[i] - x[i]);
        found += dist[i] != 0.0f;
    }
    // Counts up to head_dim are exact in f32.
    const uint32_t total = (uint32_t)wave_sum((float)found);
    bool keep[N];
    for (int i = 0; i < N; ++i) keep[i] = dist[i] != 0.0f;
    if (total > cap) {
        // Rank each outlier among all of the row's: it stays if fewer than `cap` come first.
        if (active)
            for (int i = 0; i < N; ++i) distances[c0 + i] = dist[i];
        barrier();
        for (int i = 0; i < N; ++i) {
            if (!keep[i]) continue;
            uint32_t ahead = 0;
            for (uint32_t c = 0; c < D; ++c) {
                const float o = distances[c];
                ahead += o > dist[i] || (o == dist[i] && c < c0 + i);
            }
            keep[i] = ahead < cap;
        }
        barrier();
    }
    // Slot index of the lane's first kept outlier: the kept outliers of the lanes before it.
    uint32_t mine = 0;
    for (int i = 0; i < N; ++i) mine += keep[i];
    kept_by_lane[lane_id()] = mine;
    barrier();
    uint32_t at = 0;
    for (uint32_t l = 0; l < lane_id(); ++l) at += kept_by_lane[l];
    barrier();
    uint8_t *slots = block + p.layout.slots + (size_t)t * cap * 4;
    for (int i = 0; i < N; ++i) {
        if (!keep[i]) continue;
        store_u16(slots + 4 * at, (uint16_t)(c0 + i));
        store_u16(slots + 4 * at + 2, float_to_half(exact[i]));
        ++at;
    }
    if (lane_id() == 0) {
        store_u16(block + p.layout.counts + 2 * t, (uint16_t)(total < cap ? total : cap));
        if (total > cap) atomic_add(p.outliers_dropped, total - cap);
    }
}

// Quantizes one token's (clipped) row into slot `t` of a head block, per-token formats.
template <int F, int D>
HIPKV_DEV void quantize_row(const hipkv_append_params &p, uint8_t *block, uint32_t t,
                            uint32_t c0, bool active, const float x[]) {
    constexpr int N = kLaneChannels<F, D>;
    const hipkv_stream_layout &l = p.layout;
    uint8_t *row = block + l.rows + (size_t)t * l.row_bytes;
    if constexpr (F == HIPKV_F16) {
        for (int i = 0; i < N; ++i) store_u16(row + 2 * (c0 + i), float_to_half(x[i]));
    } else if constexpr (F == HIPKV_Q8 || F == HIPKV_Q8_0) {
        // q8: one scale for the row (all lanes); q8_0: one per 32-channel block.
        float amax = 0.0f;
        for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(x[i]));
        amax = segment_max(amax, F == HIPKV_Q8 ? HIPKV_WAVE : HIPKV_Q8_0_BLOCK / N);
        const float scale = round_f16(amax / 127.0f);
        uint8_t *codes = row + c0;
        if constexpr (F == HIPKV_Q8_0) {
            uint8_t *b = row + (c0 / HIPKV_Q8_0_BLOCK) * HIPKV_Q8_0_BLOCK_BYTES;
            if (c0 % HIPKV_Q8_0_BLOCK == 0) store_u16(b, float_to_half(scale));
            codes = b + 2 + c0 % HIPKV_Q8_0_BLOCK;
        } else if (lane_id() == 0) {
            store_u16(block + l.params + 2 * t, float_to_half(scale));
        }
        for (int i = 0; i < N; ++i) codes[i] = sym_code(x[i], scale);
    } else {
        static_assert(format_is_tok(F), "per-channel formats quantize whole pages");
        const uint32_t shift = log2_pow2(l.group);
        float lo = kInf, hi = -kInf;
        if (active)
            for (int i = 0; i < N; ++i) {
                lo = fminf(lo, x[i]);
                hi = fmaxf(hi, x[i]);
            }
        // The lanes of one channel group: group / N of them, aligned.
        lo = segment_min(lo, l.group / N);
        hi = segment_max(hi, l.group / N);
        float scale, min;
        asym_params<F>(lo, hi, &scale, &min);
        uint32_t codes[N];
        for (int i = 0; i < N; ++i) codes[i] = asym_code<F>(x[i], scale, min);
        if (!active) return;
        store_codes<F, N>(row + c0 * format_bits(F) / 8, codes);
        if ((c0 & (l.group - 1)) == 0) {
            uint8_t *gp = block + l.params + 4 * ((size_t)t * (D >> shift) + (c0 >> shift));
            store_u16(gp, float_to_half(scale));
            store_u16(gp + 2, float_to_half(min));
        }
    }
}

// Quantizes the page whose first position is `first` per channel: every token's outliers, the
// channels' scale and minimum over the page, then every token's codes.
template <int F, int D>
HIPKV_DEV void quantize_page(const hipkv_append_params &p, uint8_t *block, uint32_t first,
                             uint32_t head) {
    constexpr int N = kLaneChannels<F, D>;
    const hipkv_stream_layout &l = p.layout;
    const uint32_t c0 = lane_id() * N;
    const bool active = c0 < D;
    float lo[N], hi[N];
    for (int i = 0; i < N; ++i) {
        lo[i] = kInf;
        hi[i] = -kInf;
    }
    HIPKV_ROLLED
    for (uint32_t t = 0; t < p.group_tokens; ++t) {
        float x[N];
        load_lane<N>(token_row<D>(p, first + t, head), c0, active, x);
        if (p.outlier_lo) store_outliers<N, D>(p, block, t, head, c0, active, x);
        for (int i = 0; i < N; ++i) {
            lo[i] = fminf(lo[i], x[i]);
            hi[i] = fmaxf(hi[i], x[i]);
        }
    }
    if (!active) return;
    float scale[N], min[N];
    for (int i = 0; i < N; ++i) {
        asym_params<F>(lo[i], hi[i], &scale[i], &min[i]);
        store_u16(block + l.params + 4 * (c0 + i), float_to_half(scale[i]));
        store_u16(block + l.params + 4 * (c0 + i) + 2, float_to_half(min[i]));
    }
    HIPKV_ROLLED
    for (uint32_t t = 0; t < p.group_tokens; ++t) {
        float x[N];
        load_lane<N>(token_row<D>(p, first + t, head), c0, active, x);
        if (p.outlier_lo) clip<N, D>(p, head, c0, active, x);
        uint32_t codes[N];
        for (int i = 0; i < N; ++i) codes[i] = asym_code<F>(x[i], scale[i], min[i]);
        store_codes<F, N>(block + l.rows + (size_t)t * l.row_bytes + c0 * format_bits(F) / 8,
                          codes);
    }
}

template <int F, int D>
HIPKV_DEV void append(const hipkv_append_params &p) {
    constexpr int N = kLaneChannels<F, D>;
    const uint32_t token = blockIdx.x, head = blockIdx.y;
    if (token >= p.tokens || head >= p.kv_heads) return;
    const uint32_t pos = p.first_pos + token;
    const uint32_t c0 = lane_id() * N;
    const bool active = c0 < D;
    const uint16_t *src = p.x + ((size_t)token * p.kv_heads + head) * D;
    if (pos < p.sinks) {
        uint16_t *dst = p.sink_buf + ((size_t)head * p.sinks + pos) * D;
        if (active)
            for (int i = 0; i < N; ++i) dst[c0 + i] = src[c0 + i];
        return;
    }
    const uint32_t rel = pos - p.sinks;
    const uint32_t slot = rel % p.group_tokens;
    uint8_t *block = p.pool + (size_t)p.block_table[rel / p.group_tokens] * p.page_bytes +
                     (size_t)head * p.head_block_bytes;
    if constexpr (format_is_chan(F)) {
        // The wave of the page's last token quantizes it; the others have nothing to do here.
        if (slot + 1 == p.group_tokens) quantize_page<F, D>(p, block, pos - slot, head);
    } else {
        float x[N];
        load_lane<N>(src, c0, active, x);
        if (p.outlier_lo) store_outliers<N, D>(p, block, slot, head, c0, active, x);
        quantize_row<F, D>(p, block, slot, c0, active, x);
    }
}

}  // namespace hipkv

#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
// Per-channel formats, after hipkv_append_<format>: the new tokens of the page left open (not
// completed by this append) go to the residual window, f16. Lane i copies channels i, i + 32, …
HIPKV_KERNEL(hipkv_append_residual, hipkv_append_params) {
    const uint32_t token = blockIdx.x, head = blockIdx.y;
    if (token >= p.tokens || head >= p.kv_heads) return;
    const uint32_t pos = p.first_pos + token;
    if (pos < p.sinks) return;
    const uint32_t slot = (pos - p.sinks) % p.group_tokens;
    if (pos - slot + p.group_tokens <= p.first_pos + p.tokens) return;
    const uint16_t *src = p.x + ((size_t)token * p.kv_heads + head) * p.head_dim;
    uint16_t *dst = p.residual + ((size_t)head * p.group_tokens + slot) * p.head_dim;
    for (uint32_t c = hipkv::lane_id(); c < p.head_dim; c += HIPKV_WAVE) dst[c] = src[c];
}
#endif

// hipkv_append_<format>_d<head_dim>
#define HIPKV_APPEND(NAME, F, D)                                           \
    HIPKV_KERNEL(hipkv_append_##NAME##_d##D, hipkv_append_params) {         \
        hipkv::append<F, D>(p);                                             \
    }
#define HIPKV_APPEND_ALL(D)                   \
    HIPKV_APPEND(f16, HIPKV_F16, D)           \
    HIPKV_APPEND(q8, HIPKV_Q8, D)             \
    HIPKV_APPEND(q8_0, HIPKV_Q8_0, D)         \
    HIPKV_APPEND(q4_tok, HIPKV_Q4_TOK, D)     \
    HIPKV_APPEND(q2_tok, HIPKV_Q2_TOK, D)     \
    HIPKV_APPEND(q4_chan, HIPKV_Q4_CHAN, D)   \
    HIPKV_APPEND(q2_chan, HIPKV_Q2_CHAN, D)

#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
HIPKV_APPEND_ALL(64)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 128
HIPKV_APPEND_ALL(128)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 256
HIPKV_APPEND_ALL(256)
#endif

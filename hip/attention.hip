// Split-K decode attention over a quantized paged KV cache, dequantizing inside the loop, and the
// combine kernel that merges the splits. One template serves every key format × value format ×
// head_dim; `docs/kernels.md` describes the design.
//
// Grid (splits, kv_heads × row groups, queries); one wave32 per workgroup. The workgroup of
// (query, KV head, row group, split) computes up to 8 query heads of the GQA group, so each
// cached byte is read once for GQA ≤ 8 (twice for GQA 9–16):
//   score:  lane i takes token i of a 32-token run and dots its key with all query rows; the
//           queries are wave-uniform, read through the scalar cache;
//   softmax: online, base 2 (log2 e is folded into q by the host), f32 state per row;
//   values: lane i owns head_dim/32 channels and accumulates every row over the run's tokens,
//           with the weights shared through LDS.
// Per-token scales are applied once per token and group, not per element: q8/q8_0 keys scale the
// dot product, per-token low-bit keys use the host's per-group query sums for the minimum
// (x = min + s·q  =>  q·x = s·(q·codes) + min·Σq); values fold the scale into the weight and sum
// the minimum separately. Sparse outliers are added as corrections `exact − dense`.
#include "hipkv_device.h"
#include "formats.h"

namespace hipkv {

// Query rows one workgroup computes at head_dim D.
template <int D>
constexpr int kRows = HIPKV_ROWS(D);
constexpr float kNegInf = -__builtin_huge_valf();

// One stream (keys or values) of a run of consecutive tokens of one head.
struct StreamView {
    const uint8_t *rows;
    uint32_t row_bytes;
    const uint8_t *params;   // per-token formats: starting at the run's first token's page
    const uint8_t *counts;   // outlier counts (u16 per token), null without a store
    const uint8_t *slots;    // outlier slots {u16 channel, f16 value}
    uint32_t cap;            // slots per token
    uint32_t group;          // channels per parameter group (per-token formats)
};

template <int D>
struct RowState {
    float max[kRows<D>];
    float sum[kRows<D>];
};

template <int D>
struct Acc {
    static constexpr int kPerLane = D / HIPKV_WAVE;
    float v[kRows<D>][kPerLane];
    // Σ weight · minimum of the lane's channel group (per-token value formats).
    float min_sum[kRows<D>];
};

// This workgroup's slices of the partial outputs: `rows × head_dim` accumulators and `rows`
// maxima. They are written at its end; before that they hold the page's folded query of
// per-channel keys (`fold_chan_query`), so the fold needs no buffer of its own.
struct OutputSlices {
    float *acc;
    float *max;
};
template <int D>
HIPKV_DEV OutputSlices output_slices(const hipkv_attn_params &p) {
    const uint32_t groups = (p.gqa + kRows<D> - 1) / kRows<D>;  // row groups per KV head
    const uint32_t split = blockIdx.x, head = blockIdx.y / groups, query = blockIdx.z;
    const uint32_t row0 = (blockIdx.y % groups) * kRows<D>;
    const size_t out = (((size_t)query * p.kv_heads + head) * p.splits + split) * p.gqa + row0;
    return {p.partial_acc + out * D, p.partial_max + out};
}

// Scores of token `t` of the run for every query row: `s[r] = q[r] · key(t)`.
template <int F, int D>
HIPKV_DEV void score_token(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                           const float *q, const float *qsum, uint32_t rows, float s[kRows<D>]) {
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    for (int r = 0; r < kRows<D>; ++r) s[r] = 0.0f;
    // Rows of every format but q8_0 are read 16 bytes at a time (rows and pages are 16-byte
    // aligned; a lane reads its own token's row); per-channel keys 32 channels at a time (8
    // bytes of 2-bit codes), since each channel also needs its own scale and minimum live.
    constexpr uint32_t kChunk =
        F == HIPKV_Q8_0 ? 8 : format_is_chan(F) ? 32 : kChunkChannels<F>;
    constexpr uint32_t kChunkBytes = kChunk * format_bits(F) / 8;
    if constexpr (format_is_tok(F)) {
        // Channel groups are 32+ channels: read 32 channels at a time (16 bytes of 4-bit
        // codes, 8 of 2-bit ones), each within one group.
        constexpr uint32_t kBytes = 32 * format_bits(F) / 8;
        const uint32_t groups = D >> log2_pow2(k.group), gqa = p.gqa;
        HIPKV_ROLLED
        for (uint32_t g = 0; g < groups; ++g) {
            float dot[kRows<D>];
            for (int r = 0; r < kRows<D>; ++r) dot[r] = 0.0f;
            HIPKV_ROLLED
            for (uint32_t c0 = g * k.group; c0 < (g + 1) * k.group; c0 += 32) {
                const uint8_t *at = row + c0 * format_bits(F) / 8;
                const Bytes16 b = kBytes == 16 ? load16(at) : load8(at);
                for (int j = 0; j < 4; ++j) {
                    float x[8];
                    chunk_codes8<F>(b, j, x);
                    for (int r = 0; r < kRows<D>; ++r)
                        if ((uint32_t)r < rows)
                            for (int i = 0; i < 8; ++i)
                                dot[r] += q[r * D + c0 + 8 * j + i] * x[i];
                }
            }
            const uint8_t *gp = k.params + 4 * ((size_t)t * groups + g);
            const float scale = load_f16(gp), min = load_f16(gp + 2);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += scale * dot[r] + min * qsum[g * gqa + r];
        }
    } else if constexpr (F == HIPKV_Q8_0) {
        HIPKV_ROLLED
        for (uint32_t b = 0; b < D / HIPKV_Q8_0_BLOCK; ++b) {
            float dot[kRows<D>];
            for (int r = 0; r < kRows<D>; ++r) dot[r] = 0.0f;
            for (uint32_t c = b * HIPKV_Q8_0_BLOCK; c < (b + 1) * HIPKV_Q8_0_BLOCK; c += 8) {
                float x[8];
                codes8<F>(row, c, x);
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int i = 0; i < 8; ++i) dot[r] += q[r * D + c + i] * x[i];
            }
            const float scale = q8_0_scale(row, b * HIPKV_Q8_0_BLOCK);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += scale * dot[r];
        }
    } else {
        // f16 and q8 (one scale per token), and per-channel formats, whose codes are dotted
        // with the page's folded query `q ∘ s` (then plus the row's `q · m`).
        const float *qk = q;
        if constexpr (format_is_chan(F)) qk = vector_ptr(output_slices<D>(p).acc);
        HIPKV_ROLLED
        for (uint32_t c0 = 0; c0 < D; c0 += kChunk) {
            const uint8_t *at = row + c0 * format_bits(F) / 8;
            const Bytes16 b = kChunkBytes == 16 ? load16(at) : load8(at);
            for (int j = 0; j < (int)kChunk / 8; ++j) {
                const uint32_t c = c0 + 8 * j;
                float x[8];
                chunk_codes8<F>(b, j, x);
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int i = 0; i < 8; ++i) s[r] += qk[r * D + c + i] * x[i];
            }
        }
        if constexpr (format_is_chan(F)) {
            const float *bias = vector_ptr(output_slices<D>(p).max);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += bias[r];
        }
        if constexpr (F == HIPKV_Q8) {
            const float scale = load_f16(k.params + 2 * t);
            for (int r = 0; r < kRows<D>; ++r) s[r] *= scale;
        }
    }
    if (k.cap != 0) {
        const uint32_t n = load_u16(k.counts + 2 * t);
        HIPKV_ROLLED
        for (uint32_t i = 0; i < n; ++i) {
            const uint8_t *slot = k.slots + 4 * ((size_t)t * k.cap + i);
            const uint32_t c = load_u16(slot);
            const float delta = load_f16(slot + 2) - dequant1<F>(row, k.params, t, c, D, k.group);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += q[r * D + c] * delta;
        }
    }
}

// Rotates the pair (x, y) of pair index `i` by the angle of position `pos`.
HIPKV_DEV void rotate(const float *cos_sin, uint32_t pos, uint32_t pairs, uint32_t i, float &x,
                      float &y) {
    const float c = cos_sin[2 * ((size_t)pos * pairs + i)];
    const float s = cos_sin[2 * ((size_t)pos * pairs + i) + 1];
    const float rx = x * c - y * s;
    y = x * s + y * c;
    x = rx;
}

// Scores of a key stored before RoPE (KVQuant): each dequantized element pair is rotated to the
// token's position inside the loop, and outliers are corrected through the same rotation.
template <int F, int D>
HIPKV_DEV void score_token_pre_rope(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                                    uint32_t pos, const float *q, uint32_t rows,
                                    float s[kRows<D>]) {
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    constexpr uint32_t pairs = D / 2;
    for (int r = 0; r < kRows<D>; ++r) s[r] = 0.0f;
    auto dequant8 = [&](uint32_t c, float x[8]) {
        codes8<F>(row, c, x);
        if constexpr (F == HIPKV_F16) return;
        if constexpr (format_is_chan(F)) {
            for (int i = 0; i < 8; ++i) {
                float scale, min;
                element_params<F>(row, k.params, t, c + i, D, k.group, &scale, &min);
                x[i] = min + scale * x[i];
            }
        } else {
            // The eight channels share one group (groups are 32+ aligned channels).
            float scale, min;
            element_params<F>(row, k.params, t, c, D, k.group, &scale, &min);
            for (int i = 0; i < 8; ++i)
                x[i] = (F == HIPKV_Q8 || F == HIPKV_Q8_0) ? scale * x[i] : min + scale * x[i];
        }
    };
    if (p.rope_pairs_interleaved) {
        HIPKV_ROLLED
        for (uint32_t c = 0; c < D; c += 8) {
            float x[8];
            dequant8(c, x);
            for (int i = 0; i < 8; i += 2) rotate(p.rope_cos_sin, pos, pairs, (c + i) / 2, x[i], x[i + 1]);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    for (int i = 0; i < 8; ++i) s[r] += q[r * D + c + i] * x[i];
        }
    } else {
        HIPKV_ROLLED
        for (uint32_t c = 0; c < pairs; c += 8) {
            float x[8], y[8];
            dequant8(c, x);
            dequant8(c + pairs, y);
            for (int i = 0; i < 8; ++i) rotate(p.rope_cos_sin, pos, pairs, c + i, x[i], y[i]);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    for (int i = 0; i < 8; ++i)
                        s[r] += q[r * D + c + i] * x[i] + q[r * D + c + pairs + i] * y[i];
        }
    }
    if (k.cap != 0) {
        const uint32_t n = load_u16(k.counts + 2 * t);
        HIPKV_ROLLED
        for (uint32_t i = 0; i < n; ++i) {
            const uint8_t *slot = k.slots + 4 * ((size_t)t * k.cap + i);
            const uint32_t c = load_u16(slot);
            const float delta = load_f16(slot + 2) - dequant1<F>(row, k.params, t, c, D, k.group);
            // The pair holding c, and whether c is its first element.
            const bool inter = p.rope_pairs_interleaved != 0;
            const uint32_t pair = inter ? c / 2 : c % pairs;
            const bool first = inter ? (c % 2 == 0) : (c < pairs);
            const uint32_t xc = inter ? 2 * pair : pair, yc = inter ? 2 * pair + 1 : pair + pairs;
            float dx = first ? delta : 0.0f, dy = first ? 0.0f : delta;
            rotate(p.rope_cos_sin, pos, pairs, pair, dx, dy);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += q[r * D + xc] * dx + q[r * D + yc] * dy;
        }
    }
}

// Accumulates the values of the run's `n` tokens, weighted by `w[r][t]` (in LDS).
template <int F, int D>
HIPKV_DEV void accumulate_values(const StreamView &v, uint32_t t0, uint32_t n,
                                 const float (*w)[HIPKV_WAVE], uint32_t rows, Acc<D> &acc) {
    constexpr int kPer = Acc<D>::kPerLane;
    const uint32_t c0 = lane_id() * kPer;
    HIPKV_ROLLED
    for (uint32_t j = 0; j < n; ++j) {
        const uint32_t t = t0 + j;
        const uint8_t *row = v.rows + (size_t)t * v.row_bytes;
        float x[kPer];
        if constexpr (F == HIPKV_Q8_0)
            for (int i = 0; i < kPer; ++i) x[i] = code1<F>(row, c0 + i);
        else
            lane_codes<F, kPer>(row, c0, x);
        float scale, min;
        element_params<F>(row, v.params, t, c0, D, v.group, &scale, &min);
        if constexpr (format_is_chan(F)) {
            // Parameters per channel: dequantize each element.
            for (int i = 0; i < kPer; ++i) {
                float s1, m1;
                element_params<F>(row, v.params, t, c0 + i, D, v.group, &s1, &m1);
                x[i] = m1 + s1 * x[i];
            }
            scale = 1.0f;
            min = 0.0f;
        }
        for (int r = 0; r < kRows<D>; ++r) {
            if ((uint32_t)r >= rows) continue;
            const float weight = w[r][j];
            const float ws = weight * scale;
            for (int i = 0; i < kPer; ++i) acc.v[r][i] += ws * x[i];
            if constexpr (format_is_tok(F)) acc.min_sum[r] += weight * min;
        }
        if (v.cap != 0) {
            const uint32_t count = load_u16(v.counts + 2 * t);
            HIPKV_ROLLED
            for (uint32_t i = 0; i < count; ++i) {
                const uint8_t *slot = v.slots + 4 * ((size_t)t * v.cap + i);
                const uint32_t c = load_u16(slot);
                if (c < c0 || c >= c0 + kPer) continue;
                const float delta =
                    load_f16(slot + 2) - dequant1<F>(row, v.params, t, c, D, v.group);
                // A constant index per element keeps the accumulators in registers.
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int e = 0; e < kPer; ++e)
                            if (c == c0 + e) acc.v[r][e] += w[r][j] * delta;
            }
        }
    }
}

// One run of up to 32 consecutive tokens at positions pos0 + t0 ...: score, online softmax,
// values. Sinks and a per-channel stream's open page hold f16 rows (`k_f16`, `v_f16`): the
// branch is uniform across the wave.
template <int KF, int VF, int D>
HIPKV_DEV void attend_run(const hipkv_attn_params &p, const StreamView &k, const StreamView &v,
                          bool k_f16, bool v_f16, uint32_t t0, uint32_t n, uint32_t pos0,
                          const float *q, const float *qsum, uint32_t rows, RowState<D> &st,
                          Acc<D> &acc, float (*w)[HIPKV_WAVE]) {
    const uint32_t lane = lane_id();
    float s[kRows<D>];
    if (lane < n) {
        const uint32_t t = t0 + lane;
        if (p.pre_rope) {
            if (k_f16)
                score_token_pre_rope<HIPKV_F16, D>(p, k, t, pos0 + t, q, rows, s);
            else
                score_token_pre_rope<KF, D>(p, k, t, pos0 + t, q, rows, s);
        } else if (k_f16) {
            score_token<HIPKV_F16, D>(p, k, t, q, qsum, rows, s);
        } else {
            score_token<KF, D>(p, k, t, q, qsum, rows, s);
        }
    } else {
        for (int r = 0; r < kRows<D>; ++r) s[r] = kNegInf;
    }
    barrier();  // the previous run's weights have been read
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= rows) continue;
        const float run_max = wave_max(s[r]);
        const float m = fmaxf(st.max[r], run_max);
        const float alpha = exp2(st.max[r] - m);
        const float e = lane < n ? exp2(s[r] - m) : 0.0f;
        st.sum[r] = st.sum[r] * alpha + wave_sum(e);
        st.max[r] = m;
        for (int i = 0; i < Acc<D>::kPerLane; ++i) acc.v[r][i] *= alpha;
        acc.min_sum[r] *= alpha;
        w[r][lane] = e;
    }
    barrier();  // every weight is in LDS
    if (v_f16)
        accumulate_values<HIPKV_F16, D>(v, t0, n, w, rows, acc);
    else
        accumulate_values<VF, D>(v, t0, n, w, rows, acc);
}

template <int KF, int VF, int D>
HIPKV_DEV void attend_block(const hipkv_attn_params &p, const StreamView &k, const StreamView &v,
                            bool k_f16, bool v_f16, uint32_t tokens, uint32_t pos0,
                            const float *q, const float *qsum, uint32_t rows, RowState<D> &st,
                            Acc<D> &acc, float (*w)[HIPKV_WAVE]) {
    HIPKV_ROLLED
    for (uint32_t t0 = 0; t0 < tokens; t0 += HIPKV_WAVE) {
        const uint32_t n = tokens - t0 < HIPKV_WAVE ? tokens - t0 : HIPKV_WAVE;
        attend_run<KF, VF, D>(p, k, v, k_f16, v_f16, t0, n, pos0, q, qsum, rows, st, acc, w);
    }
}

HIPKV_DEV StreamView f16_stream(const uint16_t *rows, uint32_t head_dim) {
    StreamView s;
    s.rows = reinterpret_cast<const uint8_t *>(rows);
    s.row_bytes = 2 * head_dim;
    s.params = nullptr;
    s.counts = nullptr;
    s.slots = nullptr;
    s.cap = 0;
    s.group = head_dim;
    return s;
}

HIPKV_DEV StreamView page_stream(const uint8_t *block, const hipkv_stream_layout &l) {
    StreamView s;
    s.rows = block + l.rows;
    s.row_bytes = l.row_bytes;
    // Parameters read at uniform addresses would otherwise be scalar loads held in SGPRs.
    s.params = vector_ptr(block + l.params);
    s.counts = block + l.counts;
    s.slots = block + l.slots;
    s.cap = l.outlier_slots;
    s.group = l.group;
    return s;
}

// Per-channel keys, `x = m + s·code` per channel of the page: `q·x = (q ∘ s)·code + q·m`. Folds
// the page's scales into the query rows and its minimums into one term per row, once per page,
// so scoring decodes bare codes (no parameter loads or FMA per element). Written to this
// workgroup's output slices (`output_slices`), which every lane then reads.
template <int D>
HIPKV_DEV void fold_chan_query(const hipkv_attn_params &p, const float *q, const uint8_t *params,
                               uint32_t rows) {
    const OutputSlices fold = output_slices<D>(p);
    barrier();  // every lane has scored the previous page with the previous fold
    float bias[kRows<D>];
    for (int r = 0; r < kRows<D>; ++r) bias[r] = 0.0f;
    HIPKV_ROLLED
    for (uint32_t c = lane_id(); c < D; c += HIPKV_WAVE) {
        const float scale = load_f16(params + 4 * c), min = load_f16(params + 4 * c + 2);
        for (int r = 0; r < kRows<D>; ++r) {
            if ((uint32_t)r >= rows) continue;
            fold.acc[r * D + c] = q[r * D + c] * scale;
            bias[r] += q[r * D + c] * min;
        }
    }
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= rows) continue;
        const float b = wave_sum(bias[r]);
        if (lane_id() == 0) fold.max[r] = b;
    }
    fence_workgroup();
    barrier();
}

template <int KF, int VF, int D>
HIPKV_DEV void attention(const hipkv_attn_params &p) {
    __shared__ float weights[kRows<D>][HIPKV_WAVE];
    const uint32_t groups = (p.gqa + kRows<D> - 1) / kRows<D>;  // row groups per KV head
    const uint32_t split = blockIdx.x, head = blockIdx.y / groups, query = blockIdx.z;
    const uint32_t row0 = (blockIdx.y % groups) * kRows<D>;
    const uint32_t rows = p.gqa - row0 < (uint32_t)kRows<D> ? p.gqa - row0 : kRows<D>;
    const uint32_t lane = lane_id();
    const uint32_t len = p.seq_len[query];
    const size_t qh = (size_t)query * p.kv_heads + head;
    const float *q = vector_ptr(p.q + (qh * p.gqa + row0) * D);
    // Query sums are laid out [group][row] per (query, KV head): one offset per group.
    const float *qsum =
        vector_ptr(p.q_group_sums + qh * p.gqa * (D >> log2_pow2(p.k.group)) + row0);

    RowState<D> st;
    Acc<D> acc;
    for (int r = 0; r < kRows<D>; ++r) {
        st.max[r] = kNegInf;
        st.sum[r] = 0.0f;
        acc.min_sum[r] = 0.0f;
        for (int i = 0; i < Acc<D>::kPerLane; ++i) acc.v[r][i] = 0.0f;
    }

    const uint32_t sinks = len < p.sinks ? len : p.sinks;
    if (split == 0 && sinks > 0) {
        const size_t at = (size_t)head * p.sinks * D;
        attend_block<KF, VF, D>(p, f16_stream(p.sinks_k[query] + at, D),
                                f16_stream(p.sinks_v[query] + at, D), true, true, sinks, 0, q,
                                qsum, rows, st, acc, weights);
    }
    const uint32_t g = p.group_tokens;
    const uint32_t pages = len > p.sinks ? (len - p.sinks + g - 1) / g : 0;
    const uint32_t first = split * p.pages_per_split;
    const uint32_t last = first + p.pages_per_split < pages ? first + p.pages_per_split : pages;
    HIPKV_ROLLED
    for (uint32_t page = first; page < last; ++page) {
        const uint32_t pos0 = p.sinks + page * g;
        const uint32_t tokens = len - pos0 < g ? len - pos0 : g;
        const uint8_t *block = p.pool + (size_t)p.block_table[query][page] * p.page_bytes +
                               (size_t)head * p.head_block_bytes;
        const size_t resid = (size_t)head * g * D;
        const bool k_open = p.k.residual && tokens < g, v_open = p.v.residual && tokens < g;
        if constexpr (format_is_chan(KF))
            if (!k_open && !p.pre_rope) fold_chan_query<D>(p, q, block + p.k.params, rows);
        attend_block<KF, VF, D>(
            p, k_open ? f16_stream(p.residual_k[query] + resid, D) : page_stream(block, p.k),
            v_open ? f16_stream(p.residual_v[query] + resid, D) : page_stream(block, p.v), k_open,
            v_open, tokens, pos0, q, qsum, rows, st, acc, weights);
    }

    // The same slices as `output_slices`.
    const size_t out = (qh * p.splits + split) * p.gqa + row0;
    // Per-channel keys: the last page's folded query, in these slices, has been read.
    if constexpr (format_is_chan(KF)) barrier();
    // Rows in a loop of constant trip count: the state arrays stay in registers.
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= rows) continue;
        if (lane == 0) {
            p.partial_max[out + r] = st.max[r];
            p.partial_sum[out + r] = st.sum[r];
        }
        for (int i = 0; i < Acc<D>::kPerLane; ++i)
            p.partial_acc[(out + r) * D + lane * Acc<D>::kPerLane + i] =
                acc.v[r][i] + acc.min_sum[r];
    }
}

}  // namespace hipkv

#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
// Merges the splits of each output row: Σ 2^(m_s − M) acc_s / Σ 2^(m_s − M) l_s. One workgroup
// per row; lane i takes channels i, i + 32, ...
HIPKV_KERNEL(hipkv_attn_combine, hipkv_combine_params) {
    const uint32_t row = blockIdx.x;
    if (row >= p.rows) return;
    const uint32_t qh = row / p.gqa, r = row % p.gqa;
    float m = -__builtin_huge_valf();
    for (uint32_t s = 0; s < p.splits; ++s)
        m = fmaxf(m, p.partial_max[(qh * p.splits + s) * p.gqa + r]);
    float sum = 0.0f;
    for (uint32_t s = 0; s < p.splits; ++s) {
        const size_t at = (qh * p.splits + s) * p.gqa + r;
        if (p.partial_sum[at] != 0.0f) sum += hipkv::exp2(p.partial_max[at] - m) * p.partial_sum[at];
    }
    const float inv = 1.0f / sum;
    for (uint32_t c = threadIdx.x; c < p.head_dim; c += HIPKV_WAVE) {
        float o = 0.0f;
        for (uint32_t s = 0; s < p.splits; ++s) {
            const size_t at = (qh * p.splits + s) * p.gqa + r;
            if (p.partial_sum[at] != 0.0f)
                o += hipkv::exp2(p.partial_max[at] - m) * p.partial_acc[at * p.head_dim + c];
        }
        p.out[(size_t)row * p.head_dim + c] = o * inv;
    }
}
#endif

// The decode kernels: hipkv_attn_<key format>_<value format>_d<head_dim>.
#define HIPKV_ATTN(KN, KF, VN, VF, D)                                                  \
    HIPKV_KERNEL(hipkv_attn_##KN##_##VN##_d##D, hipkv_attn_params) {                    \
        hipkv::attention<KF, VF, D>(p);                                                 \
    }
#define HIPKV_ATTN_V(KN, KF, D)                      \
    HIPKV_ATTN(KN, KF, f16, HIPKV_F16, D)            \
    HIPKV_ATTN(KN, KF, q8, HIPKV_Q8, D)              \
    HIPKV_ATTN(KN, KF, q8_0, HIPKV_Q8_0, D)          \
    HIPKV_ATTN(KN, KF, q4_tok, HIPKV_Q4_TOK, D)      \
    HIPKV_ATTN(KN, KF, q2_tok, HIPKV_Q2_TOK, D)      \
    HIPKV_ATTN(KN, KF, q4_chan, HIPKV_Q4_CHAN, D)    \
    HIPKV_ATTN(KN, KF, q2_chan, HIPKV_Q2_CHAN, D)
#define HIPKV_ATTN_KV(D)                             \
    HIPKV_ATTN_V(f16, HIPKV_F16, D)                  \
    HIPKV_ATTN_V(q8, HIPKV_Q8, D)                    \
    HIPKV_ATTN_V(q8_0, HIPKV_Q8_0, D)                \
    HIPKV_ATTN_V(q4_tok, HIPKV_Q4_TOK, D)            \
    HIPKV_ATTN_V(q2_tok, HIPKV_Q2_TOK, D)            \
    HIPKV_ATTN_V(q4_chan, HIPKV_Q4_CHAN, D)          \
    HIPKV_ATTN_V(q2_chan, HIPKV_Q2_CHAN, D)

// build.rs compiles one code object per head_dim (HIPKV_HEAD_DIM), in parallel; the emulator
// takes them all.
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
HIPKV_ATTN_KV(64)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 128
HIPKV_ATTN_KV(128)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 256
HIPKV_ATTN_KV(256)
#endif

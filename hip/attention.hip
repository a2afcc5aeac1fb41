// Decode and chunked-prefill attention over a quantized paged KV cache, dequantizing inside the
// loop; the kernel that prepares the queries and the one that merges the splits. One template
// serves every key format × value format × head_dim; `docs/kernels.md` describes the design.
//
// Grid (num_seqs × tiles_per_seq, kv_heads, splits); one to HIPKV_MAX_WAVES waves per
// workgroup. A workgroup takes a tile of query rows (token × GQA head, token-major) of one
// sequence and KV head, and one split of its blocks: wave w computes rows
// [w·HIPKV_ROWS, (w + 1)·HIPKV_ROWS) of the tile, each row attending causally up to its
// token's position. The waves of a tile read the same blocks at about the same time, so a
// cached byte comes from memory once per tile (the siblings' reads hit the CU's caches), and at
// most ⌈q_len·gqa / tile rows⌉ times per chunk. Per wave:
//   score:  lane i takes token i of a 32-token run and dots its key with all the wave's rows;
//   softmax: online, base 2 (log2 e is folded into q by hipkv_attn_prep), f32 state per row;
//   values: lane i owns max(head_dim/32, 4) channels and accumulates every row over the run's
//           tokens (at head_dim 64 over every other token: two per trip, HIPKV_VALUE_TOKENS),
//           with the weights shared through LDS (the wave's own part; waves never wait for
//           each other).
// Per-token scales are applied once per token and group, not per element: q8/q8_0 keys scale the
// dot product, per-token low-bit keys use the prepared per-group query sums for the minimum
// (x = min + s·q  =>  q·x = s·(q·codes) + min·Σq); values fold the scale into the weight and sum
// the minimum separately. Sparse outliers are added as corrections `exact − dense`. With a value
// window (KIVI's residual), the blocks holding any of a sequence's last R positions read their
// values f16 from the slot state's window instead of the block (keys still from the block).
#include "hipkv_device.h"
#include "formats.h"

namespace hipkv {

// The codebooks of the launch's nuq streams (keys, values), copied into LDS once per
// workgroup (`load_levels`): lanes index them with their own codes, which LDS serves in one
// access, and their address is a constant, so holding them costs no register.
__shared__ float stream_levels[2][HIPKV_MAX_LEVELS];

// Copies the codebooks of a launch (if any) into `stream_levels`; pre-RoPE low-bit keys
// without one get the uniform levels, since their decode always reads the table
// (`score_token_pre_rope`). Every thread of the workgroup must call it: it ends with a barrier
// when it writes anything.
template <int KF, int VF>
HIPKV_DEV void load_levels(const hipkv_attn_params &p) {
    const bool keys = format_has_levels(KF) && (p.k_levels != nullptr || p.g.pre_rope);
    const bool values = format_has_levels(VF) && p.v_levels != nullptr;
    if (!keys && !values) return;
    const uint32_t i = threadIdx.x % HIPKV_MAX_LEVELS, stream = threadIdx.x / HIPKV_MAX_LEVELS;
    if (keys && stream == 0 && i < (1u << format_bits(KF)))
        stream_levels[0][i] = p.k_levels != nullptr ? read_global(p.k_levels + i) : (float)i;
    if (values && stream == 1 && i < (1u << format_bits(VF)))
        stream_levels[1][i] = read_global(p.v_levels + i);
    barrier();
}

// What a launch asks of the block loop: bit 0, keys have a codebook; bit 1, values have one;
// bit 2, keys are scored from the int8-rounded query (`kIntQueryFlag`). Held in a vector
// register (`WaveRows::flags`) and made uniform where it is tested: a scalar register held
// through the block loop is what the kernels have none of to spare.
constexpr uint32_t kIntQueryFlag = 4;
HIPKV_DEV uint32_t launch_flags(const hipkv_attn_params &p) {
    return vector_u32((p.k_levels != nullptr ? 1u : 0u) | (p.v_levels != nullptr ? 2u : 0u) |
                      (p.int_query != 0 ? kIntQueryFlag : 0u));
}

// The codebook of `stream` (0: keys, 1: values) in LDS, or null when it has none.
HIPKV_DEV const float *stream_codebook(uint32_t flags, uint32_t stream) {
    return (uniform_u32(flags) >> stream) & 1u ? stream_levels[stream] : nullptr;
}

// The codes `x` of a stream stored in format F replaced by their levels when the stream has a
// codebook.
template <int F, int N>
HIPKV_DEV void decode_levels(uint32_t flags, uint32_t stream, float x[N]) {
    if constexpr (format_has_levels(F))
        if ((uniform_u32(flags) >> stream) & 1u) codes_to_levels<N>(stream_levels[stream], x);
}

// Query rows one wave computes at head_dim D.
template <int D>
constexpr int kRows = HIPKV_ROWS(D);
constexpr float kNegInf = -__builtin_huge_valf();

// One stream (keys or values) of a run of consecutive tokens of one head.
struct StreamView {
    const uint8_t *rows;
    uint32_t row_bytes;
    const uint8_t *params;   // per-token formats: starting at the block's first row
    uint32_t group;          // channels per parameter group (per-token formats)
    // Outlier slots per row (0: no outlier store, as for f16 rows). Where the store is, its
    // counts and slots are found from the kernel's arguments (`outlier_counts`): pointers to
    // them held through the loops would take scalar registers the kernel has none to spare of.
    uint32_t cap;
};

// The outlier counts (u16 per row) and slots ({u16 channel, f16 value}, `cap` per row) of a
// block stream `s` with layout `l`.
HIPKV_DEV const uint8_t *outlier_counts(const StreamView &s, const hipkv_stream_layout &l) {
    return s.rows - l.rows + l.counts;
}
HIPKV_DEV const uint8_t *outlier_slots(const StreamView &s, const hipkv_stream_layout &l) {
    return s.rows - l.rows + l.slots;
}

template <int D>
struct RowState {
    float max[kRows<D>];
    float sum[kRows<D>];
};

// A lane's share of the value accumulation: kPerLane channels of every HIPKV_VALUE_TOKENS-th
// token, the lanes of one part (`value_part`) taking consecutive channels of the same tokens.
template <int D>
struct Acc {
    static constexpr uint32_t kTokens = HIPKV_VALUE_TOKENS(D);
    static constexpr uint32_t kPartLanes = HIPKV_WAVE / kTokens;
    static constexpr int kPerLane = D / kPartLanes;
    float v[kRows<D>][kPerLane];
    // Σ weight · minimum of the lane's channel group (per-token value formats).
    float min_sum[kRows<D>];
};

// Which of a value-loop trip's tokens the lane accumulates, and its first channel.
template <int D>
HIPKV_DEV uint32_t value_part() {
    return lane_id() / Acc<D>::kPartLanes;
}
template <int D>
HIPKV_DEV uint32_t value_channel0() {
    return lane_id() % Acc<D>::kPartLanes * Acc<D>::kPerLane;
}

// Row r's output for the lane's channel value_channel0 + i: its accumulator and minimums,
// summed over the parts (the lanes holding the same channels of the other tokens); part 0's
// lanes hold the sum. Every lane of the wave must call it.
template <int D>
HIPKV_DEV float row_output(const Acc<D> &acc, int r, int i) {
    float o = acc.v[r][i] + acc.min_sum[r];
    for (uint32_t m = HIPKV_WAVE / 2; m >= Acc<D>::kPartLanes; m /= 2) o += shfl_xor(o, (int)m);
    return o;
}

// Writes row r's output as `out`'s row `out_row` (out_row·D onwards): every lane calls it,
// part 0's lanes store. The index keeps the caller's type: widening the probe's int rows to
// size_t changes the code the issue model counts.
template <int D, typename Row>
HIPKV_DEV void store_row_output(const Acc<D> &acc, int r, float *out, Row out_row) {
    for (int i = 0; i < Acc<D>::kPerLane; ++i) {
        const float o = row_output<D>(acc, r, i);
        if (value_part<D>() == 0) out[out_row * D + value_channel0<D>() + i] = o;
    }
}

// Rows that have seen no position: max -inf, sums and accumulators 0.
template <int D>
HIPKV_DEV void start_rows(RowState<D> &st, Acc<D> &acc) {
    for (int r = 0; r < kRows<D>; ++r) {
        st.max[r] = kNegInf;
        st.sum[r] = 0.0f;
        acc.min_sum[r] = 0.0f;
        for (int i = 0; i < Acc<D>::kPerLane; ++i) acc.v[r][i] = 0.0f;
    }
}

// The query rows of one wave: `n` consecutive rows of a sequence's (token, GQA head) rows, and
// where their inputs and this split's partial outputs live (row r at base + r, or + r·D). The
// partial outputs also hold, until the wave's end, a block's folded query of per-channel keys
// (`fold_chan_query`), so the fold needs no buffer of its own.
template <int D>
struct WaveRows {
    uint32_t n;
    // Row r sees positions < first_limit + ((steps >> 3r) & 7): the rows of a wave span at most
    // kRows tokens, so each row's token is its first row's plus a 3-bit step (one register,
    // where an array of limits took kRows of them).
    uint32_t first_limit;
    uint32_t steps;
    const float *q;
    const float *qsum;         // group g, row r: qsum[g · qsum_stride + r]
    uint32_t qsum_stride;
    uint32_t flags;            // `launch_flags`
    size_t out;                // row r's partials: partial_acc[(out + r)·D], partial_max[out + r]
};

// Rounds `x`, this lane's channel of one HIPKV_QUERY_BLOCK block that the wave holds (every
// lane takes part), to int8 as `quant::quantize_query` does: the block's scale, set in every
// lane, is max|x| / 127 (NaN when the block holds a NaN or an infinity); returns the code.
HIPKV_DEV uint8_t round_query_lane(float x, float &scale) {
    const QueryScale block(group_max_u32<HIPKV_WAVE>(QueryScale::magnitude(x)));
    scale = block.s;
    return (uint8_t)block.code(x);
}

// Where `fold_chan_query` leaves a block's folded query rounded to int8 (`iq` of per-channel
// keys): each row in its own partial output (a wave of fewer than kRows rows owns no more),
// its D codes first, in `int_query_slot` order, then its D/32 block scales. Row r's codes are
// at byte kChanCodeStride<D>·r of `chan_query_codes`, its scales at float
// kChanScaleStride<D>·r of `chan_query_scales`.
template <int D>
constexpr uint32_t kChanScaleStride = D;
template <int D>
constexpr uint32_t kChanCodeStride = 4 * D;
template <int D>
HIPKV_DEV uint8_t *chan_query_codes(const hipkv_attn_params &p, const WaveRows<D> &w) {
    return reinterpret_cast<uint8_t *>(p.partial_acc + w.out * D);
}
template <int D>
HIPKV_DEV float *chan_query_scales(const hipkv_attn_params &p, const WaveRows<D> &w) {
    return p.partial_acc + w.out * D + D / 4;
}

// Adds to the scores of token `t` its key outliers' corrections `q · (exact − dense)`.
template <int F, int D>
HIPKV_DEV void add_key_outliers(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                                const WaveRows<D> &w, float s[kRows<D>]) {
    if (k.cap == 0) return;
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    const uint32_t n = load_u16(outlier_counts(k, p.g.k) + 2 * t);
    HIPKV_ROLLED
    for (uint32_t i = 0; i < n; ++i) {
        const uint8_t *slot = outlier_slots(k, p.g.k) + 4 * ((size_t)t * k.cap + i);
        const uint32_t c = load_u16(slot);
        const float delta =
            load_f16(slot + 2) - dequant1<F>(row, k.params, t, c, D, k.group, stream_codebook(w.flags, 0));
        for (int r = 0; r < kRows<D>; ++r)
            if ((uint32_t)r < w.n) s[r] += read_global(w.q + r * D + c) * delta;
    }
}

// The codes of channels c..c+N of a q8_0 row (N even, within one block), in 16-bit loads: the
// codes follow each block's f16 scale, so they are 2-byte aligned and no more.
template <int N>
HIPKV_DEV void q8_0_codes(const uint8_t *row, uint32_t c, float x[N]) {
    const uint8_t *at = row + q8_0_code_offset(c);
    for (int i = 0; i < N; i += 2) {
        const uint32_t pair = load2(at + i);
        x[i] = Int8Codes::value(pair);
        x[i + 1] = Int8Codes::value(pair >> 8);
    }
}

// Scores of token `t` of the run for every query row: `s[r] = q[r] · key(t)`.
template <int F, int D>
HIPKV_DEV void score_token(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                           const WaveRows<D> &w, float s[kRows<D>]) {
    const float *q = w.q, *qsum = w.qsum;
    const uint32_t rows = w.n;
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    for (int r = 0; r < kRows<D>; ++r) s[r] = 0.0f;
    // Rows of every format but q8_0 are read 16 bytes at a time (rows and pages are 16-byte
    // aligned; a lane reads its own token's row); per-channel keys 32 channels at a time (8
    // bytes of 2-bit codes), since each channel also needs its own scale and minimum live.
    constexpr uint32_t kChunk =
        kParams<F> == ParamsAt::BlockScale ? 8 : format_is_chan(F) ? 32 : kChunkChannels<F>;
    constexpr uint32_t kChunkBytes = kChunk * format_bits(F) / 8;
    if constexpr (format_is_tok(F)) {
        // Channel groups are 32+ channels: read 32 channels at a time (16 bytes of 4-bit
        // codes, 8 of 2-bit ones), each within one group.
        constexpr uint32_t kBytes = 32 * format_bits(F) / 8;
        const uint32_t groups = D >> log2_pow2(k.group);
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
                    decode_levels<F, 8>(w.flags, 0, x);
                    for (int r = 0; r < kRows<D>; ++r)
                        if ((uint32_t)r < rows)
                            for (int i = 0; i < 8; ++i)
                                dot[r] += read_global(q + r * D + c0 + 8 * j + i) * x[i];
                }
            }
            const uint8_t *gp = k.params + 4 * ((size_t)t * groups + g);
            const float scale = load_f16(gp), min = load_f16(gp + 2);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    s[r] += scale * dot[r] + min * read_global(qsum + g * w.qsum_stride + r);
        }
    } else if constexpr (kParams<F> == ParamsAt::BlockScale) {
        HIPKV_ROLLED
        for (uint32_t b = 0; b < D / HIPKV_Q8_0_BLOCK; ++b) {
            float dot[kRows<D>];
            for (int r = 0; r < kRows<D>; ++r) dot[r] = 0.0f;
            for (uint32_t c = b * HIPKV_Q8_0_BLOCK; c < (b + 1) * HIPKV_Q8_0_BLOCK; c += 8) {
                float x[8];
                q8_0_codes<8>(row, c, x);
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int i = 0; i < 8; ++i) dot[r] += read_global(q + r * D + c + i) * x[i];
            }
            const float scale = q8_0_scale(row, b * HIPKV_Q8_0_BLOCK);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += scale * dot[r];
        }
    } else {
        // f16, q8 and fp8 (one scale per token), and per-channel formats, whose codes are dotted
        // with the page's folded query `q ∘ s` (then plus the row's `q · m`).
        const float *qk = q;
        if constexpr (format_is_chan(F)) qk = vector_ptr(p.partial_acc + w.out * D);
        HIPKV_ROLLED
        for (uint32_t c0 = 0; c0 < D; c0 += kChunk) {
            const uint8_t *at = row + c0 * format_bits(F) / 8;
            const Bytes16 b = kChunkBytes == 16 ? load16(at) : load8(at);
            for (int j = 0; j < (int)kChunk / 8; ++j) {
                const uint32_t c = c0 + 8 * j;
                float x[8];
                chunk_codes8<F>(b, j, x);
                decode_levels<F, 8>(w.flags, 0, x);
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int i = 0; i < 8; ++i) s[r] += read_global(qk + r * D + c + i) * x[i];
            }
        }
        if constexpr (format_is_chan(F)) {
            const float *bias = vector_ptr(p.partial_max + w.out);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows) s[r] += read_global(bias + r);
        }
        if constexpr (kParams<F> == ParamsAt::TokenScale) {
            const float scale = load_f16(k.params + 2 * t);
            for (int r = 0; r < kRows<D>; ++r) s[r] *= scale;
        }
    }
    add_key_outliers<F, D>(p, k, t, w, s);
}

// The HIPKV_QUERY_BLOCK channels of block `b` of a key row in a format_int_query format, as
// the format's B words of codes: q8 in two 16-byte loads, q4 in one, q2 in 8 bytes; q8_0's
// codes, 2-byte aligned after the block's f16 scale, in 2-byte loads.
template <int F>
HIPKV_DEV void int_key_block(const uint8_t *row, uint32_t b, uint32_t key[format_bits(F)]) {
    constexpr uint32_t B = format_bits(F);
    if constexpr (kParams<F> == ParamsAt::BlockScale) {
        const uint8_t *codes = row + q8_0_code_offset(b * HIPKV_QUERY_BLOCK);
        for (uint32_t i = 0; i < B; ++i) key[i] = load2(codes + 4 * i) | load2(codes + 4 * i + 2) << 16;
    } else {
        const uint8_t *at = row + b * HIPKV_QUERY_BLOCK * B / 8;
        for (uint32_t h = 0; h < (B + 3) / 4; ++h) {
            const Bytes16 x = B == 2 ? load8(at) : load16(at + 16 * h);
            for (uint32_t i = 0; i < 4 && 4 * h + i < B; ++i) key[4 * h + i] = x.w[i];
        }
    }
}

// Scores of token `t` from the int8-rounded query (`int_query`), as `score_token` computes them
// from its f32 rows (which are that query, dequantized): each HIPKV_QUERY_BLOCK block's codes
// dotted exactly in integers (`int_query_dots`), then weighted by the query block's scale (and
// q8_0's key block scale); per-token groups add `min · Σq` as `score_token` does, per-channel
// keys their row's `q · m`, and q8's token scale is applied once.
template <int F, int D>
HIPKV_DEV void score_token_int(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                               const WaveRows<D> &w, float s[kRows<D>]) {
    static_assert(format_int_query(F), "integer-query scores of integer codes only");
    constexpr uint32_t B = format_bits(F), kBlocks = D / HIPKV_QUERY_BLOCK;
    // The rows' codes and scales lie at the index of their f32 rows (`w.q`), scaled down; for
    // per-channel keys, the block's folded query that `fold_chan_query` rounded, in the rows'
    // partial outputs. The codes are read with global loads (`load4`); the scales through a
    // generic pointer, since global loads of them too spill VGPRs at head_dim 256 (the compiler
    // schedules them earlier).
    const size_t first = (size_t)(w.q - p.q_f32);
    const uint8_t *qc = vector_ptr(format_is_chan(F) ? chan_query_codes<D>(p, w)
                                                     : reinterpret_cast<const uint8_t *>(p.q_codes) + first);
    const float *qs = vector_ptr(format_is_chan(F) ? chan_query_scales<D>(p, w)
                                                   : p.q_scales + first / HIPKV_QUERY_BLOCK);
    constexpr uint32_t code_stride = format_is_chan(F) ? kChanCodeStride<D> : D;
    constexpr uint32_t scale_stride = format_is_chan(F) ? kChanScaleStride<D> : kBlocks;
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    for (int r = 0; r < kRows<D>; ++r) s[r] = 0.0f;
    // Blocks per parameter group: a per-token group spans whole blocks; the others have one
    // group (q8_0's block scales are applied per block).
    const uint32_t per_group = format_is_tok(F) ? k.group / HIPKV_QUERY_BLOCK : kBlocks;
    HIPKV_ROLLED
    for (uint32_t g = 0; g < kBlocks / per_group; ++g) {
        float dot[kRows<D>];
        for (int r = 0; r < kRows<D>; ++r) dot[r] = 0.0f;
        HIPKV_ROLLED
        for (uint32_t b = g * per_group; b < (g + 1) * per_group; ++b) {
            uint32_t key[B];
            int_key_block<F>(row, b, key);
            // Each query word is loaded where it is used: the block's 8 words of every row held
            // at once would spill at head_dim 256.
            const uint8_t *block_codes = qc + b * HIPKV_QUERY_BLOCK;
            int32_t idot[kRows<D>];
            int_query_dots<B, kRows<D>>(
                key, [&](int r, uint32_t i) { return load4(block_codes + r * code_stride + 4 * i); }, w.n,
                idot);
            float weight = 1.0f;
            if constexpr (kParams<F> == ParamsAt::BlockScale)
                weight = q8_0_scale(row, b * HIPKV_QUERY_BLOCK);
            for (int r = 0; r < kRows<D>; ++r) {
                if ((uint32_t)r >= w.n) continue;
                dot[r] += weight * read_global(qs + r * scale_stride + b) * (float)idot[r];
            }
        }
        if constexpr (format_is_tok(F)) {
            const uint8_t *gp = k.params + 4 * ((size_t)t * (kBlocks / per_group) + g);
            const float scale = load_f16(gp), min = load_f16(gp + 2);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < w.n)
                    s[r] += scale * dot[r] + min * read_global(w.qsum + g * w.qsum_stride + r);
        } else {
            for (int r = 0; r < kRows<D>; ++r) s[r] += dot[r];
        }
    }
    if constexpr (format_is_chan(F)) {
        const float *bias = vector_ptr(p.partial_max + w.out);
        for (int r = 0; r < kRows<D>; ++r)
            if ((uint32_t)r < w.n) s[r] += read_global(bias + r);
    }
    if constexpr (kParams<F> == ParamsAt::TokenScale) {
        const float scale = load_f16(k.params + 2 * t);
        for (int r = 0; r < kRows<D>; ++r) s[r] *= scale;
    }
    add_key_outliers<F, D>(p, k, t, w, s);
}

// The scores of token `t` of a block stream in format F: from the int8-rounded query when the
// launch asks for it and F has integer codes, else from the f32 rows.
template <int F, int D>
HIPKV_DEV void score_block_token(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                                 const WaveRows<D> &w, float s[kRows<D>]) {
    if constexpr (format_int_query(F))
        if (uniform_u32(w.flags) & kIntQueryFlag) return score_token_int<F, D>(p, k, t, w, s);
    score_token<F, D>(p, k, t, w, s);
}

// Rotates the pair (x, y) of pair index `i` by the angle of the table's row `row`.
HIPKV_DEV void rotate(const float *cos_sin, uint32_t row, uint32_t pairs, uint32_t i, float &x,
                      float &y) {
    const float c = read_global(cos_sin + 2 * ((size_t)row * pairs + i));
    const float s = read_global(cos_sin + 2 * ((size_t)row * pairs + i) + 1);
    const float rx = x * c - y * s;
    y = x * s + y * c;
    x = rx;
}

// Scores of a key stored before RoPE (KVQuant) against the query rows turned back to the
// block's first position (`turn_query_back`): each dequantized element pair is rotated by the
// angle of its row `t` in the block inside the loop, and outliers are corrected through the same
// rotation.
template <int F, int D>
HIPKV_DEV void score_token_pre_rope(const hipkv_attn_params &p, const StreamView &k, uint32_t t,
                                    const WaveRows<D> &w, float s[kRows<D>]) {
    const float *q = vector_ptr(p.partial_acc + w.out * D);
    const uint32_t rows = w.n;
    const uint8_t *row = k.rows + (size_t)t * k.row_bytes;
    constexpr uint32_t pairs = D / 2;
    for (int r = 0; r < kRows<D>; ++r) s[r] = 0.0f;
    auto dequant8 = [&](uint32_t c, float x[8]) {
        codes8<F>(row, c, x);
        // Through the table whether or not it is a codebook (`load_levels`): a branch here,
        // among sixteen elements' parameters, costs the d256 kernels registers they lack.
        if constexpr (format_has_levels(F)) codes_to_levels<8>(stream_levels[0], x);
        if constexpr (kParams<F> == ParamsAt::None) return;
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
                x[i] = format_has_levels(F) ? min + scale * x[i] : scale * x[i];
        }
    };
    if (p.g.rope_pairs_interleaved) {
        HIPKV_ROLLED
        for (uint32_t c = 0; c < D; c += 8) {
            float x[8];
            dequant8(c, x);
            for (int i = 0; i < 8; i += 2) rotate(p.rope_cos_sin, t, pairs, (c + i) / 2, x[i], x[i + 1]);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    for (int i = 0; i < 8; ++i) s[r] += read_global(q + r * D + c + i) * x[i];
        }
    } else {
        HIPKV_ROLLED
        for (uint32_t c = 0; c < pairs; c += 8) {
            float x[8], y[8];
            dequant8(c, x);
            dequant8(c + pairs, y);
            for (int i = 0; i < 8; ++i) rotate(p.rope_cos_sin, t, pairs, c + i, x[i], y[i]);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    for (int i = 0; i < 8; ++i)
                        s[r] += read_global(q + r * D + c + i) * x[i] +
                                read_global(q + r * D + c + pairs + i) * y[i];
        }
    }
    if (k.cap != 0) {
        const uint32_t n = load_u16(outlier_counts(k, p.g.k) + 2 * t);
        HIPKV_ROLLED
        for (uint32_t i = 0; i < n; ++i) {
            const uint8_t *slot = outlier_slots(k, p.g.k) + 4 * ((size_t)t * k.cap + i);
            const uint32_t c = load_u16(slot);
            const float delta =
                load_f16(slot + 2) - dequant1<F>(row, k.params, t, c, D, k.group, stream_codebook(w.flags, 0));
            // The pair holding c, and whether c is its first element.
            const bool inter = p.g.rope_pairs_interleaved != 0;
            const uint32_t pair = inter ? c / 2 : c % pairs;
            const bool first = inter ? (c % 2 == 0) : (c < pairs);
            const uint32_t xc = inter ? 2 * pair : pair, yc = inter ? 2 * pair + 1 : pair + pairs;
            float dx = first ? delta : 0.0f, dy = first ? 0.0f : delta;
            rotate(p.rope_cos_sin, t, pairs, pair, dx, dy);
            for (int r = 0; r < kRows<D>; ++r)
                if ((uint32_t)r < rows)
                    s[r] += read_global(q + r * D + xc) * dx + read_global(q + r * D + yc) * dy;
        }
    }
}

// The parameters of the value channels c0.. of token t of `v` (`element_params`) in the
// value loop, where each trip reads them: a per-token group's f16 scale and minimum in one
// 32-bit load (the section is 16-aligned, a pair 4 bytes), where `load_f16` reads a byte at a
// time. 16-bit loads of the other formats' single f16 scale made the issue model's count no
// better (the compiler paired fewer multiply-adds into dual issue), so they keep
// `element_params`.
template <int F, int D>
HIPKV_DEV void value_params(const uint8_t *row, const StreamView &v, uint32_t t, uint32_t c0,
                            float *scale, float *min) {
    if constexpr (kParams<F> == ParamsAt::TokenGroups) {
        const uint32_t pair = load4(token_group_params(v.params, t, c0, D, v.group));
        *scale = half_to_float((uint16_t)pair);
        *min = half_to_float((uint16_t)(pair >> 16));
    } else {
        element_params<F>(row, v.params, t, c0, D, v.group, scale, min);
    }
}

// Accumulates the values of the run's `n` tokens, weighted by `w[r][t]` (in LDS); `flags` as
// `WaveRows::flags`.
template <int F, int D>
HIPKV_DEV void accumulate_values(const hipkv_attn_params &p, const StreamView &v, uint32_t t0,
                                 uint32_t n, const float (*w)[HIPKV_WAVE], uint32_t rows,
                                 uint32_t flags, Acc<D> &acc) {
    constexpr int kPer = Acc<D>::kPerLane;
    const uint32_t c0 = value_channel0<D>(), part = value_part<D>();
    HIPKV_ROLLED_TOKENS
    for (uint32_t trip = 0; trip < n; trip += Acc<D>::kTokens) {
        // The lane's token is `j`. Past the run's end a lane reads the trip's first row again
        // (rows past it may not exist), with the weight of `j`, which `attend_run` left 0.
        const uint32_t j = trip + part;
        const uint32_t t = t0 + (j < n ? j : trip);
        const uint8_t *row = v.rows + (size_t)t * v.row_bytes;
        float x[kPer];
        if constexpr (kParams<F> == ParamsAt::BlockScale)
            q8_0_codes<kPer>(row, c0, x);
        else
            lane_codes<F, kPer>(row, c0, x);
        decode_levels<F, kPer>(flags, 1, x);
        float scale, min;
        value_params<F, D>(row, v, t, c0, &scale, &min);
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
            const uint32_t count = load_u16(outlier_counts(v, p.g.v) + 2 * t);
            HIPKV_ROLLED
            for (uint32_t i = 0; i < count; ++i) {
                const uint8_t *slot = outlier_slots(v, p.g.v) + 4 * ((size_t)t * v.cap + i);
                const uint32_t c = load_u16(slot);
                if (c < c0 || c >= c0 + kPer) continue;
                const float delta =
                    load_f16(slot + 2) - dequant1<F>(row, v.params, t, c, D, v.group, stream_codebook(flags, 1));
                // A constant index per element keeps the accumulators in registers.
                for (int r = 0; r < kRows<D>; ++r)
                    if ((uint32_t)r < rows)
                        for (int e = 0; e < kPer; ++e)
                            if (c == c0 + e) acc.v[r][e] += w[r][j] * delta;
            }
        }
    }
}

// One run of up to 32 consecutive tokens, rows t0.. of a block whose row 0 is at position
// pos0: score, online softmax, values. Sinks and a per-channel stream's open block hold f16
// rows (`k_f16`, `v_f16`): the branch is uniform across the wave.
template <int KF, int VF, int D>
HIPKV_DEV void attend_run(const hipkv_attn_params &p, const StreamView &k, const StreamView &v,
                          bool k_f16, bool v_f16, uint32_t t0, uint32_t n, uint32_t pos0,
                          const WaveRows<D> &w, RowState<D> &st, Acc<D> &acc,
                          float (*weights)[HIPKV_WAVE]) {
    const uint32_t lane = lane_id();
    const uint32_t run_pos = pos0 + t0;  // the position of the run's first token
    float s[kRows<D>];
    if (lane < n) {
        const uint32_t t = t0 + lane;
        if (p.g.pre_rope) {
            if (k_f16)
                score_token_pre_rope<HIPKV_F16, D>(p, k, t, w, s);
            else
                score_token_pre_rope<KF, D>(p, k, t, w, s);
        } else if (k_f16) {
            score_token<HIPKV_F16, D>(p, k, t, w, s);
        } else {
            score_block_token<KF, D>(p, k, t, w, s);
        }
    } else {
        for (int r = 0; r < kRows<D>; ++r) s[r] = kNegInf;
    }
    // Row r's first visible position, minus the run's: window_base + its step (far below 0
    // without a window; the host passes a window below max_positions, so nothing wraps).
    const int32_t window_base =
        p.window == 0 ? INT32_MIN / 2 : (int32_t)(w.first_limit - p.window - run_pos);
    wave_sync();  // the previous run's weights have been read
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= w.n) continue;
        // Causal: a row sees the positions up to its own token's, the run's first `cut` lanes
        // (a wave-uniform count, so the mask costs a compare with the lane id).
        const uint32_t step = (w.steps >> (3 * r)) & 7u;
        const uint32_t limit = w.first_limit + step;
        const uint32_t seen = limit > run_pos ? limit - run_pos : 0;
        const uint32_t cut = seen < n ? seen : n;
        // A sliding window hides the positions below limit - window, the run's first `skip`
        // lanes: a row sees lanes [skip, cut), tested with one unsigned compare.
        const int32_t low = window_base + (int32_t)step;
        const uint32_t skip = low > 0 ? (uint32_t)low : 0;
        const uint32_t span = cut > skip ? cut - skip : 0;
        const bool visible = lane - skip < span;
        const float sr = visible ? s[r] : kNegInf;
        const float m = fmaxf(st.max[r], uniform(wave_max(sr)));
        // A row that has seen no position yet keeps max -inf: 2^(-inf - -inf) would be NaN.
        const float alpha = st.max[r] == m ? 1.0f : exp2(st.max[r] - m);
        const float e = visible ? exp2(sr - m) : 0.0f;
        st.sum[r] = st.sum[r] * alpha + uniform(wave_sum(e));
        st.max[r] = m;
        for (int i = 0; i < Acc<D>::kPerLane; ++i) acc.v[r][i] *= alpha;
        acc.min_sum[r] *= alpha;
        weights[r][lane] = e;
    }
    wave_sync();  // every weight is in LDS
    if (v_f16)
        accumulate_values<HIPKV_F16, D>(p, v, t0, n, weights, w.n, w.flags, acc);
    else
        accumulate_values<VF, D>(p, v, t0, n, weights, w.n, w.flags, acc);
}

// Rows [t_begin, t_end) of a block whose row 0 is at position pos0, in runs of 32.
template <int KF, int VF, int D>
HIPKV_DEV void attend_block(const hipkv_attn_params &p, const StreamView &k, const StreamView &v,
                            bool k_f16, bool v_f16, uint32_t t_begin, uint32_t t_end,
                            uint32_t pos0, const WaveRows<D> &w, RowState<D> &st, Acc<D> &acc,
                            float (*weights)[HIPKV_WAVE]) {
    HIPKV_ROLLED
    for (uint32_t t0 = t_begin; t0 < t_end; t0 += HIPKV_WAVE) {
        const uint32_t n = t_end - t0 < HIPKV_WAVE ? t_end - t0 : HIPKV_WAVE;
        attend_run<KF, VF, D>(p, k, v, k_f16, v_f16, t0, n, pos0, w, st, acc, weights);
    }
}

HIPKV_DEV StreamView f16_stream(const uint16_t *rows, uint32_t head_dim) {
    StreamView s;
    s.rows = reinterpret_cast<const uint8_t *>(rows);
    s.row_bytes = 2 * head_dim;
    s.params = nullptr;
    s.cap = 0;
    s.group = head_dim;
    return s;
}

HIPKV_DEV StreamView block_stream(const uint8_t *block, const hipkv_stream_layout &l) {
    StreamView s;
    s.rows = block + l.rows;
    s.row_bytes = l.row_bytes;
    // Parameters read at uniform addresses would otherwise be scalar loads held in SGPRs.
    s.params = vector_ptr(block + l.params);
    s.cap = l.outlier_slots;
    s.group = l.group;
    return s;
}

// `fold_chan_query` (below) with `iq`: the folded rows `q ∘ s` rounded to int8 per HIPKV_QUERY_BLOCK
// channels (`quant::quantize_query`), all rows at once. Lane l rounds one word of four codes
// of one row (slots 4w..4w+3, channels `int_query_word_channel(bits, w, k)`), so a block is 8
// neighbouring lanes: its maximum takes 3 exchanges, each lane divides twice per block (the
// scale and its reciprocal) rather than once per element, and writes its codes in one store.
template <int F, int D>
HIPKV_DEV void fold_chan_query_int(const hipkv_attn_params &p, const WaveRows<D> &w,
                                   const uint8_t *params) {
    constexpr uint32_t kWords = D / 4;  // words of codes per row
    constexpr uint32_t kRowLanes = kWords < HIPKV_WAVE ? kWords : HIPKV_WAVE;
    constexpr uint32_t kRowsPerTrip = HIPKV_WAVE / kRowLanes, kTripsPerRow = kWords / kRowLanes;
    constexpr uint32_t kBlockWords = HIPKV_QUERY_BLOCK / 4;
    static_assert(kRows<D> % kRowsPerTrip == 0, "whole rows per trip");
    float *fold_bias = p.partial_max + w.out;
    const uint32_t lane = lane_id();
    wave_sync();  // every lane has scored the previous block with the previous fold
    HIPKV_ROLLED
    for (uint32_t first = 0; first < (uint32_t)kRows<D>; first += kRowsPerTrip) {
        const uint32_t r = first + lane / kRowLanes;
        const bool live = r < w.n;
        float bias = 0.0f;
        HIPKV_ROLLED
        for (uint32_t trip = 0; trip < kTripsPerRow; ++trip) {
            const uint32_t word = trip * kRowLanes + lane % kRowLanes;
            float x[4];
            uint32_t magnitude = 0;
            for (uint32_t k = 0; k < 4; ++k) {
                const uint32_t c = int_query_word_channel(format_bits(F), word, k);
                const float scale = load_f16(params + 4 * c), min = load_f16(params + 4 * c + 2);
                const float q = live ? read_global(w.q + r * D + c) : 0.0f;
                x[k] = q * scale;
                bias += q * min;
                const uint32_t m = QueryScale::magnitude(x[k]);
                magnitude = m > magnitude ? m : magnitude;
            }
            const QueryScale block(group_max_u32<kBlockWords>(magnitude));
            uint32_t codes = 0;
            for (uint32_t k = 0; k < 4; ++k) codes |= ((uint32_t)block.code(x[k]) & 0xffu) << (8 * k);
            if (live) {
                uint8_t *row_codes = chan_query_codes<D>(p, w) + r * kChanCodeStride<D>;
                *reinterpret_cast<uint32_t *>(row_codes + 4 * word) = codes;
                if (word % kBlockWords == 0)
                    chan_query_scales<D>(p, w)[r * kChanScaleStride<D> + word / kBlockWords] = block.s;
            }
        }
        bias = group_sum<kRowLanes>(bias);
        if (live && lane % kRowLanes == 0) fold_bias[r] = bias;
    }
    fence_workgroup();
    wave_sync();
}

// Per-channel keys, `x = m + s·code` per channel of the block: `q·x = (q ∘ s)·code + q·m`.
// Folds the block's scales into the query rows and its minimums into one term per row, once
// per block, so scoring decodes bare codes (no parameter loads or FMA per element). Written to
// the wave's partial outputs (`WaveRows`), which every lane of the wave then reads: as f32
// rows, or with `iq` rounded to int8 per HIPKV_QUERY_BLOCK channels (`chan_query_codes`), as
// `quant::quantize_query` rounds them (`fold_chan_query_int`).
template <int F, int D>
HIPKV_DEV void fold_chan_query(const hipkv_attn_params &p, const WaveRows<D> &w,
                               const uint8_t *params) {
    if (uniform_u32(w.flags) & kIntQueryFlag) return fold_chan_query_int<F, D>(p, w, params);
    float *fold = p.partial_acc + w.out * D, *fold_bias = p.partial_max + w.out;
    wave_sync();  // every lane has scored the previous block with the previous fold
    float bias[kRows<D>];
    for (int r = 0; r < kRows<D>; ++r) bias[r] = 0.0f;
    HIPKV_ROLLED
    for (uint32_t c = lane_id(); c < D; c += HIPKV_WAVE) {
        const float scale = load_f16(params + 4 * c), min = load_f16(params + 4 * c + 2);
        for (int r = 0; r < kRows<D>; ++r) {
            if ((uint32_t)r >= w.n) continue;
            const float q = read_global(w.q + r * D + c);
            fold[r * D + c] = q * scale;
            bias[r] += q * min;
        }
    }
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= w.n) continue;
        const float b = wave_sum(bias[r]);
        if (lane_id() == 0) fold_bias[r] = b;
    }
    fence_workgroup();
    wave_sync();
}

// Pre-RoPE keys: `R(pos0 + t) = R(pos0)·R(t)`, so `q·R(pos0 + t)x = (R(−pos0)q)·R(t)x`. Turns
// the wave's query rows back by the block's first position `pos0`, once per block, into its
// partial outputs (as `fold_chan_query` folds), so that each key turns by its row `t` in the
// block alone: one of the table's first rows, which every wave shares and keeps in cache. Its
// own position's row would stream 4·head_dim table bytes per token and wave beside the KV bytes
// (docs/performance.md, "The RoPE table of pre-RoPE steps").
template <int D>
HIPKV_DEV void turn_query_back(const hipkv_attn_params &p, const WaveRows<D> &w, uint32_t pos0) {
    constexpr uint32_t pairs = D / 2;
    float *turned = p.partial_acc + w.out * D;
    const float *cos_sin = p.rope_cos_sin + 2 * (size_t)pos0 * pairs;
    const bool interleaved = p.g.rope_pairs_interleaved != 0;
    wave_sync();  // every lane has scored the previous block with the previous turn
    // Both loops rolled: unrolled, the pass held values live beside the block loop's
    // accumulators, and kernels at the 192-VGPR cap spilled.
    HIPKV_ROLLED
    for (uint32_t r = 0; r < w.n; ++r) {
        HIPKV_ROLLED
        for (uint32_t i = lane_id(); i < pairs; i += HIPKV_WAVE) {
            const float c = read_global(cos_sin + 2 * i), s = read_global(cos_sin + 2 * i + 1);
            const uint32_t xc = interleaved ? 2 * i : i, yc = interleaved ? 2 * i + 1 : i + pairs;
            const float x = read_global(w.q + r * D + xc), y = read_global(w.q + r * D + yc);
            turned[r * D + xc] = x * c + y * s;  // by −pos0: the sine's sign flips
            turned[r * D + yc] = y * c - x * s;
        }
    }
    fence_workgroup();
    wave_sync();
}

// The sequence a workgroup serves, after checking what the server passed for it.
struct Sequence {
    uint32_t start;    // its first query token in the batch
    uint32_t q_len;
    uint32_t len;      // tokens it holds, the query's included
    const int32_t *blocks;
    const uint8_t *state;
};

// False (after reporting, from one workgroup of the sequence) when the sequence must be skipped.
HIPKV_DEV bool check_sequence(const hipkv_attn_params &p, uint32_t seq, bool report,
                              Sequence *out) {
    const hipkv_paged_geometry &g = p.g;
    const int64_t start = read_global(p.query_start_loc + seq);
    const int64_t end = read_global(p.query_start_loc + seq + 1);
    const int64_t len = read_global(p.seq_lens + seq), slot = read_global(p.seq_slots + seq);
    // The longest sequence the call may hold: its promise, its block table, the layout.
    int64_t longest = (int64_t)p.max_blocks_per_seq * g.block_tokens;
    if ((int64_t)p.max_seq_len < longest) longest = p.max_seq_len;
    if ((int64_t)g.max_positions < longest) longest = g.max_positions;
    uint32_t what = HIPKV_BAD_NONE;
    int64_t index = 0, limit = 0;
    if (start < 0 || end < start || end > (int64_t)p.tokens) {
        what = HIPKV_BAD_QUERY_RANGE, index = start < 0 || end < start ? start : end;
        limit = p.tokens + 1;
    } else if (end - start > (int64_t)p.max_q_len || end - start > len) {
        what = HIPKV_BAD_QUERY_LEN, index = end - start;
        limit = (int64_t)p.max_q_len < len ? p.max_q_len + 1 : len + 1;
    } else if (len > longest) {
        what = HIPKV_BAD_SEQ_LEN, index = len, limit = longest + 1;
    } else if (slot < 0 || slot >= (int64_t)g.max_seqs) {
        what = HIPKV_BAD_SEQ_SLOT, index = slot, limit = g.max_seqs;
    }
    if (what != HIPKV_BAD_NONE) {
        if (report && lane_id() == 0)
            report_bad_index(p.error, what, HIPKV_CHECK_ATTEND, seq, index, limit);
        return false;
    }
    out->start = (uint32_t)start;
    out->q_len = (uint32_t)(end - start);
    out->len = (uint32_t)len;
    out->blocks = p.block_tables + (size_t)seq * p.max_blocks_per_seq;
    out->state = p.state + (size_t)slot * p.slot_state_bytes + p.layer_state;
    return true;
}

// The residual window at byte `at` of the sequence's state, for `head`.
HIPKV_DEV const uint16_t *residual_rows(const hipkv_paged_geometry &g, const Sequence &sq,
                                        uint32_t head, uint32_t at) {
    return reinterpret_cast<const uint16_t *>(sq.state + at) +
           (size_t)head * g.block_tokens * g.head_dim;
}

// The f16 value rows of a block at position `pos0` that are not in the block: in the value
// window, whose W = R + block_tokens rows hold a block's positions in consecutive rows (both
// are multiples of the block), or else the residual window of the open block.
HIPKV_DEV const uint16_t *value_rows_f16(const hipkv_paged_geometry &g, const Sequence &sq,
                                         uint32_t head, uint32_t pos0, bool window) {
    const uint32_t rows = g.value_window + g.block_tokens;
    const uint32_t at = window ? g.window_v + (head * rows + pos0 % rows) * g.head_dim * 2
                               : g.residual_v + head * g.block_tokens * g.head_dim * 2;
    return reinterpret_cast<const uint16_t *>(sq.state + at);
}

template <int KF, int VF, int D>
HIPKV_DEV void attention(const hipkv_attn_params &p) {
    __shared__ float weights[HIPKV_MAX_WAVES][kRows<D>][HIPKV_WAVE];
    const hipkv_paged_geometry &g = p.g;
    const uint32_t seq = blockIdx.x / p.tiles_per_seq, tile = blockIdx.x % p.tiles_per_seq;
    const uint32_t head = blockIdx.y, split = blockIdx.z;
    const uint32_t wave = wave_id(), waves = blockDim.x / HIPKV_WAVE;
    load_levels<KF, VF>(p);
    if (seq >= p.num_seqs) return;
    Sequence sq;
    if (!check_sequence(p, seq, tile == 0 && head == 0 && split == 0 && wave == 0, &sq)) return;

    // This wave's rows of the sequence's q_len × gqa rows.
    const uint32_t gqa = g.gqa;
    const uint32_t row0 = (tile * waves + wave) * kRows<D>;
    if (row0 >= sq.q_len * gqa) return;
    WaveRows<D> w;
    w.n = sq.q_len * gqa - row0 < (uint32_t)kRows<D> ? sq.q_len * gqa - row0 : kRows<D>;
    // Token t of the chunk is at position len - q_len + t and sees everything up to it.
    const uint32_t t0 = row0 / gqa;
    w.first_limit = sq.len - sq.q_len + t0 + 1;
    w.steps = 0;
    w.flags = launch_flags(p);
    for (int r = 0; r < kRows<D>; ++r) w.steps |= ((row0 + (uint32_t)r) / gqa - t0) << (3 * r);
    const uint32_t max_limit = w.first_limit + (row0 + w.n - 1) / gqa - t0;
    // Rows of one KV head are contiguous in the prepared queries and in the partials.
    const size_t first = ((size_t)head * p.tokens + sq.start) * gqa + row0;
    w.q = vector_ptr(p.q_f32 + first * D);
    const uint32_t groups = D >> log2_pow2(g.k.group);
    w.qsum_stride = p.tokens * gqa;
    w.qsum = vector_ptr(p.q_group_sums + (size_t)head * groups * w.qsum_stride + first -
                        (size_t)head * p.tokens * gqa);
    w.out = ((size_t)head * p.splits + split) * p.tokens * gqa + first -
            (size_t)head * p.tokens * gqa;
#if defined(__HIP_DEVICE_COMPILE__)
    // In vector registers: every address made from it is a lane's own, and kept in scalar ones
    // through the block loop it would take two the loop cannot spare.
    asm volatile("" : "+v"(w.out));
#endif

    RowState<D> st;
    Acc<D> acc;
    start_rows<D>(st, acc);
    // This wave's part of the LDS at a scalar offset, which its accesses take as a constant.
    float(*wave_weights)[HIPKV_WAVE] = weights[(uint32_t)uniform_u32(wave)];

    // The first position the wave's first row sees (its rows' lowest), within a window.
    const uint32_t first_seen =
        p.window != 0 && w.first_limit > p.window ? w.first_limit - p.window : 0;
    const uint32_t sinks = sq.len < g.sinks ? sq.len : g.sinks;
    if (split == 0 && sinks > first_seen) {
        if (g.pre_rope) turn_query_back<D>(p, w, 0);
        const size_t at = (size_t)head * g.sinks * D;
        const uint16_t *sk = reinterpret_cast<const uint16_t *>(sq.state + g.sinks_k) + at;
        const uint16_t *sv = reinterpret_cast<const uint16_t *>(sq.state + g.sinks_v) + at;
        attend_block<KF, VF, D>(p, f16_stream(sk, D), f16_stream(sv, D), true, true, 0, sinks,
                                0, w, st, acc, wave_weights);
    }
    const uint32_t bt = g.block_tokens;
    // Blocks this wave's rows see, within this split's: the splits share out the blocks from
    // the one holding the lowest row's first visible position (the plan makes them enough).
    const uint32_t seen = (max_limit + bt - 1) / bt;
    const uint32_t begin = first_seen / bt + split * p.blocks_per_split;
    const uint32_t end = begin + p.blocks_per_split < seen ? begin + p.blocks_per_split : seen;
    // The block ids this wave reads, checked up front with a lane per id, so that the loop
    // below holds no check (scalar registers are the kernel's scarcest resource there).
    bool lane_bad = false;
    for (uint32_t b = begin + lane_id(); b < end; b += HIPKV_WAVE)
        lane_bad |= (uint32_t)read_global(sq.blocks + b) >= g.num_blocks;  // negative ids too
    const bool bad = wave_max(lane_bad ? 1.0f : 0.0f) > 0.0f;
    if (bad && lane_id() == 0) {
        uint32_t b = begin;
        while ((uint32_t)read_global(sq.blocks + b) < g.num_blocks) ++b;
        report_bad_index(p.error, HIPKV_BAD_BLOCK, HIPKV_CHECK_ATTEND, seq,
                         read_global(sq.blocks + b), g.num_blocks);
    }
    // The slot state's address in vector registers from here on: the block loop reads it only
    // for the residual and value windows, and has no scalar registers to spare.
    sq.state = vector_ptr(sq.state);
    // The blocks holding any of the last R positions are in the value window (R + block_tokens
    // rows, so they all fit): from this position on.
    const uint32_t window_from =
        g.value_window == 0 ? ~0u
        : sq.len > g.value_window ? (sq.len - g.value_window) / bt * bt
                                  : 0;
    const uint8_t *head_blocks = p.cache + (size_t)head * g.head_block_bytes;
    const uint32_t stop = bad ? begin : end;
    HIPKV_ROLLED
    for (uint32_t b = begin; b < stop; ++b) {
        const uint32_t pos0 = b * bt;
        const uint32_t t_end = sq.len - pos0 < bt ? sq.len - pos0 : bt;
        const uint32_t t_begin = g.sinks > pos0 ? (g.sinks - pos0 < bt ? g.sinks - pos0 : bt) : 0;
        if (t_begin >= t_end) continue;
        const uint8_t *block =
            head_blocks + (size_t)(uint32_t)read_global(sq.blocks + b) * g.block_bytes;
        // The sequence's last block is open when it is not full: per-channel streams keep its
        // rows in the residual window.
        const bool open = t_end < bt;
        const bool k_open = g.k.residual && open, v_open = g.v.residual && open;
        if (g.pre_rope) {
            turn_query_back<D>(p, w, pos0);
        } else if constexpr (format_is_chan(KF)) {
            if (!k_open) fold_chan_query<KF, D>(p, w, block + g.k.params);
        }
        const bool v_window = pos0 >= window_from;
        attend_block<KF, VF, D>(
            p, k_open ? f16_stream(residual_rows(g, sq, head, g.residual_k), D)
                      : block_stream(block, g.k),
            v_window || v_open ? f16_stream(value_rows_f16(g, sq, head, pos0, v_window), D)
                               : block_stream(block, g.v),
            k_open, v_open || v_window, t_begin, t_end, pos0, w, st, acc, wave_weights);
    }

    // Per-channel or pre-RoPE keys: the last block's folded or turned query, in these slots,
    // has been read.
    if (format_is_chan(KF) || g.pre_rope) wave_sync();
    const uint32_t lane = lane_id();
    // Rows in a loop of constant trip count: the state arrays stay in registers.
    for (int r = 0; r < kRows<D>; ++r) {
        if ((uint32_t)r >= w.n) continue;
        if (lane == 0) {
            p.partial_max[w.out + r] = bad ? kNegInf : st.max[r];
            p.partial_sum[w.out + r] = bad ? 0.0f : st.sum[r];
        }
        store_row_output<D>(acc, r, p.partial_acc, w.out + r);
    }
}

}  // namespace hipkv

// In every head_dim's code object, since the HIP backend loads only the one of its cache's
// head_dim; not in the issue model's probe objects (HIPKV_PROBE), which hold only `probe_block`.
#if !defined(HIPKV_PROBE)
namespace hipkv {

// Rounds channel c of query row `row` to int8, as `quant::quantize_query` does, for a wave whose
// lanes hold one HIPKV_QUERY_BLOCK block (every lane takes part): the block's scale is
// max|x| / 127 (NaN when the block holds a NaN or an infinity). Writes the code at its
// `int_query_slot` and (lane 0) the scale times `factor`, and returns the rounded value times
// `factor`: the f32 row the scores then read.
HIPKV_DEV float round_query(const hipkv_attn_params &p, size_t row, uint32_t c, float x,
                            float factor) {
    float scale;
    const uint8_t code = round_query_lane(x, scale);
    const size_t d = p.g.head_dim;
    reinterpret_cast<uint8_t *>(p.q_codes)[row * d + int_query_slot(p.int_query, c)] = code;
    const float s = scale * factor;
    if (lane_id() == 0) p.q_scales[(row * d + c) / HIPKV_QUERY_BLOCK] = s;
    return s * Int8Codes::value(code);
}

}  // namespace hipkv

// hipkv_attn_prep: grid (tokens, kv_heads), one wave. The query rows of one token and KV head
// converted to f32 (rotated by H/√d when keys are) and scaled by softmax_scale · log2(e), laid
// out [KV head][token][GQA row][channel]; with `int_query`, rounded to int8 first (and the codes
// and scales written); their sums over each key parameter group, [KV head][group][token][GQA
// row]; and the partial sums of every split cleared, so a row no workgroup reaches reads as
// empty.
HIPKV_KERNEL(hipkv_attn_prep, hipkv_attn_params) {
    const hipkv_paged_geometry &g = p.g;
    const uint32_t token = blockIdx.x, head = blockIdx.y, lane = hipkv::lane_id();
    if (token >= p.tokens || head >= g.kv_heads) return;
    const uint32_t d = g.head_dim, gqa = g.gqa, group = g.k.group;
    const uint32_t groups = d / group;
    const float factor = p.softmax_scale * 1.4426950408889634f;
    // Per-channel keys round each block's folded query instead (`fold_chan_query`). Unrounded
    // rows are scaled in two products, as the CPU backend scales them, so that both round the
    // same folded values.
    const bool round = p.int_query != 0 && !(p.int_query & HIPKV_INT_QUERY_PER_BLOCK);
    const size_t elem_bytes = p.dtype == HIPKV_DTYPE_F32 ? 4 : 2;
    // Rotated keys: the query is rotated the same way, (Hq)·(Hk) = q·k (in f64: formats.h).
    const bool rotate = g.rotate & 1u;
    __shared__ double rotated[HIPKV_MAX_HEAD_DIM];
    for (uint32_t j = 0; j < gqa; ++j) {
        const size_t in = ((size_t)token * g.kv_heads * gqa + head * gqa + j) * d;
        const size_t row = ((size_t)head * p.tokens + token) * gqa + j;
        const uint8_t *src = static_cast<const uint8_t *>(p.q) + in * elem_bytes;
        const auto load = [&](uint32_t c) {
            if (p.dtype == HIPKV_DTYPE_F16)
                return hipkv::half_to_float(reinterpret_cast<const uint16_t *>(src)[c]);
            if (p.dtype == HIPKV_DTYPE_BF16)
                return hipkv::bf16_to_float(reinterpret_cast<const uint16_t *>(src)[c]);
            return reinterpret_cast<const float *>(src)[c];
        };
        if (rotate) {
            hipkv::wave_sync();  // the lanes are done reading the previous row
            for (uint32_t c = lane; c < d; c += HIPKV_WAVE) rotated[c] = load(c);
            hipkv::hadamard_wave(rotated, d);
        }
        for (uint32_t gi = 0; gi < groups; ++gi) {
            float sum = 0.0f;
            for (uint32_t c = gi * group + lane; c < (gi + 1) * group; c += HIPKV_WAVE) {
                const float in = rotate ? (float)rotated[c] : load(c);
                // Groups are whole query blocks: the wave holds one block here.
                const float x = round ? hipkv::round_query(p, row, c, in, factor)
                                      : in * p.softmax_scale * 1.4426950408889634f;
                p.q_f32[row * d + c] = x;
                sum += x;
            }
            sum = hipkv::wave_sum(sum);
            if (lane == 0)
                p.q_group_sums[((size_t)head * groups + gi) * p.tokens * gqa +
                               (size_t)token * gqa + j] = sum;
        }
        for (uint32_t s = lane; s < p.splits; s += HIPKV_WAVE) {
            const size_t at = ((size_t)head * p.splits + s) * p.tokens * gqa +
                              (size_t)token * gqa + j;
            p.partial_sum[at] = 0.0f;
            p.partial_max[at] = -__builtin_huge_valf();
        }
    }
}

// hipkv_attn_combine: grid (tokens × q_heads), one wave per output row:
// `Σ 2^(m_s − M)·acc_s / Σ 2^(m_s − M)·l_s` over the splits with `l_s > 0` (0 when none has
// any: a skipped sequence), rotated back by H/√d when values are stored rotated, written in the
// output dtype. Lanes run over the splits for M and the denominator, then over the channels,
// with the splits' weights in LDS a chunk at a time: each split's partial row is then a
// coalesced load that no other load waits for, where a lane walking the splits' max and sum
// one by one waited on memory once per split (290 µs of a 340 µs step on an H200 at 16k,
// docs/performance.md).
namespace hipkv {

constexpr uint32_t kCombineChunk = 8 * HIPKV_WAVE;
constexpr int kCombineLaneChannels = HIPKV_MAX_HEAD_DIM / HIPKV_WAVE;

// Σ_s w_s·acc_s for one output row of head_dim L·32, lane l holding channels l + 32·i: the
// weights `2^(m_s − M)` (0 for a split without tokens) go to LDS a chunk at a time, and every
// trip of the unrolled split loop loads its partial row with no branch between the loads.
template <int L>
HIPKV_DEV void combine_channels(const hipkv_attn_params &p, size_t base, size_t stride,
                                float m, float weights[kCombineChunk],
                                float out[kCombineLaneChannels]) {
    constexpr uint32_t d = L * HIPKV_WAVE;
    const uint32_t lane = lane_id();
    for (int i = 0; i < L; ++i) out[i] = 0.0f;
    for (uint32_t s0 = 0; s0 < p.splits; s0 += kCombineChunk) {
        const uint32_t n = p.splits - s0 < kCombineChunk ? p.splits - s0 : kCombineChunk;
        wave_sync();  // the last chunk's weights have been read
        for (uint32_t k = lane; k < n; k += HIPKV_WAVE) {
            const size_t at = base + (s0 + k) * stride;
            weights[k] = p.partial_sum[at] > 0.0f ? exp2(p.partial_max[at] - m) : 0.0f;
        }
        wave_sync();
        // An empty split's row was never written: its zero weight selects it out (0·NaN is
        // NaN).
        HIPKV_UNROLL(8)
        for (uint32_t k = 0; k < n; ++k) {
            const float w = weights[k];
            const float *acc = p.partial_acc + (base + (s0 + k) * stride) * d;
            for (int i = 0; i < L; ++i) {
                const float a = acc[lane + (uint32_t)i * HIPKV_WAVE];
                out[i] += w != 0.0f ? w * a : 0.0f;
            }
        }
    }
}

}  // namespace hipkv

HIPKV_KERNEL(hipkv_attn_combine, hipkv_attn_params) {
    const hipkv_paged_geometry &g = p.g;
    const uint32_t q_heads = g.kv_heads * g.gqa;
    const uint32_t row = blockIdx.x;
    if (row >= p.tokens * q_heads) return;
    const uint32_t token = row / q_heads, qh = row % q_heads;
    const uint32_t head = qh / g.gqa, j = qh % g.gqa, d = g.head_dim;
    const uint32_t lane = hipkv::lane_id();
    const size_t stride = (size_t)p.tokens * g.gqa;
    const size_t base = (size_t)head * p.splits * stride + (size_t)token * g.gqa + j;
    float m = -__builtin_huge_valf();
    for (uint32_t s = lane; s < p.splits; s += HIPKV_WAVE)
        if (p.partial_sum[base + s * stride] > 0.0f) m = fmaxf(m, p.partial_max[base + s * stride]);
    m = hipkv::wave_max(m);
    float total = 0.0f;
    for (uint32_t s = lane; s < p.splits; s += HIPKV_WAVE) {
        const size_t at = base + s * stride;
        if (p.partial_sum[at] > 0.0f) total += hipkv::exp2(p.partial_max[at] - m) * p.partial_sum[at];
    }
    total = hipkv::wave_sum(total);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    __shared__ float weights[hipkv::kCombineChunk];
    float o[hipkv::kCombineLaneChannels];
    if (d == 64)
        hipkv::combine_channels<64 / HIPKV_WAVE>(p, base, stride, m, weights, o);
    else if (d == 128)
        hipkv::combine_channels<128 / HIPKV_WAVE>(p, base, stride, m, weights, o);
    else
        hipkv::combine_channels<256 / HIPKV_WAVE>(p, base, stride, m, weights, o);
    const auto store = [&](uint32_t c, float v) {
        const size_t out = (size_t)row * d + c;
        if (p.dtype == HIPKV_DTYPE_F16)
            static_cast<uint16_t *>(p.out)[out] = hipkv::float_to_half(v);
        else if (p.dtype == HIPKV_DTYPE_BF16)
            static_cast<uint16_t *>(p.out)[out] = hipkv::float_to_bf16(v);
        else
            static_cast<float *>(p.out)[out] = v;
    };
    // Rotated values: the output is rotated back, H·Σ p·(Hv) = Σ p·v (in f64: formats.h).
    const bool rotate = g.rotate & 2u;
    __shared__ double rotated[HIPKV_MAX_HEAD_DIM];
    for (int i = 0; i < hipkv::kCombineLaneChannels; ++i) {
        if ((uint32_t)i * HIPKV_WAVE >= d) break;
        const uint32_t c = lane + (uint32_t)i * HIPKV_WAVE;
        if (rotate)
            rotated[c] = o[i] * inv;
        else
            store(c, o[i] * inv);
    }
    if (rotate) {
        hipkv::hadamard_wave(rotated, d);
        for (uint32_t c = lane; c < d; c += HIPKV_WAVE) store(c, (float)rotated[c]);
    }
}
#endif

#if defined(HIPKV_PROBE)
namespace hipkv {

// What one wave executes for one block in the steady state of a long decode, for the issue model
// of `hipkv info --kernels` (src/bin/hipkv/issue.rs): a closed block of HIPKV_WAVE tokens (the
// default page, so one run) stored quantized, with 32-channel groups, no sinks, outliers,
// windows or codebooks, keys scored from the f32 query rows or, with `kIntQuery`, the int8
// ones (`iq`), and a full wave of query rows. Only build.rs's probe objects hold it: they
// unroll every loop but the token loop of the values (HIPKV_PROBE), so what the wave executes
// is a straight line and that loop's 32 trips.
template <int KF, int VF, int D, bool kIntQuery>
HIPKV_DEV void probe_block(const hipkv_attn_params &args) {
    __shared__ float weights[kRows<D>][HIPKV_WAVE];
    hipkv_attn_params p = args;
    p.g.pre_rope = 0;
    p.window = 0;
    for (hipkv_stream_layout *l : {&p.g.k, &p.g.v}) {
        l->group = HIPKV_WAVE;
        l->outlier_slots = 0;
    }
    WaveRows<D> w;
    w.n = kRows<D>;
    w.first_limit = ~0u;
    w.steps = 0;
    w.flags = kIntQuery ? kIntQueryFlag : 0;
    w.q = vector_ptr(p.q_f32);
    w.qsum = vector_ptr(p.q_group_sums);
    w.qsum_stride = p.tokens;
    w.out = 0;
    RowState<D> st;
    Acc<D> acc;
    start_rows<D>(st, acc);
    const uint8_t *block = p.cache;
    if constexpr (format_is_chan(KF)) fold_chan_query<KF, D>(p, w, block + p.g.k.params);
    attend_run<KF, VF, D>(p, block_stream(block, p.g.k), block_stream(block, p.g.v), false, false,
                          0, HIPKV_WAVE, 0, w, st, acc, weights);
    for (int r = 0; r < kRows<D>; ++r) {
        if (lane_id() == 0) p.partial_max[r] = st.max[r] + st.sum[r];
        store_row_output<D>(acc, r, p.partial_acc, r);
    }
}

}  // namespace hipkv

// The probes, never launched: hipkv_probe_<key format>_<value format>_d<head_dim>, and
// hipkv_probe_iq_… for `iq` (empty where the key format has no integer-query scores).
#define HIPKV_ATTN(KN, KF, VN, VF, D)                                                  \
    HIPKV_ATTN_KERNEL(hipkv_probe_##KN##_##VN##_d##D, hipkv_attn_params) {              \
        hipkv::probe_block<KF, VF, D, false>(p);                                        \
    }                                                                                   \
    HIPKV_ATTN_KERNEL(hipkv_probe_iq_##KN##_##VN##_d##D, hipkv_attn_params) {           \
        if constexpr (hipkv::format_int_query(KF)) hipkv::probe_block<KF, VF, D, true>(p); \
    }
#else
// The attention kernels: hipkv_attn_<key format>_<value format>_d<head_dim>.
#define HIPKV_ATTN(KN, KF, VN, VF, D)                                                  \
    HIPKV_ATTN_KERNEL(hipkv_attn_##KN##_##VN##_d##D, hipkv_attn_params) {               \
        hipkv::attention<KF, VF, D>(p);                                                 \
    }
#endif
// Every key format × value format at head_dim D (`HIPKV_FORMATS`).
#define HIPKV_ATTN_PAIR(VN, VF, KN, KF, D) HIPKV_ATTN(KN, KF, VN, VF, D)
#define HIPKV_ATTN_K(KN, KF, D) HIPKV_DEFER(HIPKV_FORMATS_AGAIN)()(HIPKV_ATTN_PAIR, KN, KF, D)
#define HIPKV_ATTN_KV(D) HIPKV_EXPAND(HIPKV_FORMATS(HIPKV_ATTN_K, D))

// build.rs compiles one code object per head_dim (HIPKV_HEAD_DIM), in parallel; the emulator
// likewise.
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
HIPKV_ATTN_KV(64)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 128
HIPKV_ATTN_KV(128)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 256
HIPKV_ATTN_KV(256)
#endif

// write_kv kernels: a batch's new tokens (each with its sequence slot, position and cache slot)
// written into one stream's storage (keys or values), computing exactly what `src/quant` and
// the CPU backend compute, byte for byte; and copy_blocks. `docs/kernels.md` describes them.
//
// Grid (tokens, kv_heads); one wave per (new token, KV head). Lane i owns N consecutive channels
// of a row (N = head_dim / 32, at least one byte of codes), so its codes pack into whole bytes:
//   sinks:          f16 copy into the slot state's sink rows (never written to blocks);
//   per-token:      outliers into the sparse store (clipped in the row), then the row's scale
//                   (and minimum, per channel group) from a min/max or |max| reduction over the
//                   lanes of the group, then codes, into the token's slot of its block;
//   per-channel:    the wave of a block's last position quantizes the whole block: outliers of
//                   every row, per-channel min/max over its rows (sink positions left out; older
//                   rows from the residual window, this batch's from the input), then codes.
//                   `hipkv_write_residual_d<D>` stores the rows of blocks left open in the
//                   residual window, launched after;
//   value window:   values also go f16 to the slot state's window row `pos % W` (W = R +
//                   block_tokens), unless the batch holds position pos + W of the sequence
//                   (whose row takes the slot);
//   rotation:       a stream the scheme rotates (`rot`) has each input row rotated by H/√d in
//                   LDS as it is read, before any of the above.
// Every index a server passed is checked before anything is written: a token that fails
// writes nothing and is reported in the sticky error word.
#include "hipkv_device.h"
#include "formats.h"

namespace hipkv {

// Channels of a row each lane owns: head_dim / 32, or more where that would not fill a byte
// with codes (2-bit at head_dim 64: the upper half of the wave has no channels).
template <int F, int D>
constexpr int kLaneChannels =
    (D / HIPKV_WAVE) * format_bits(F) >= 8 ? D / HIPKV_WAVE : 8 / format_bits(F);

constexpr float kInf = __builtin_huge_valf();

// The two bytes of `v` at `p` (any alignment), low byte first.
HIPKV_DEV void store_u16(uint8_t *p, uint16_t v) {
    uint32_t w = v;
#if defined(__CUDA_ARCH__)
    // ptxas (CUDA 12.6 and 13.0, sm_90) turns the byte store of a register that holds a
    // `cvt.rn.f16.f32` result into a numeric f16 -> u8 conversion (F2I.U8.F16.TRUNC), which
    // stored 0 for the low byte of every scale below 1. A 32-bit integer register keeps the
    // bits (scripts/cuda/device-check.sh found it; tests/device_cache.rs compares the bytes).
    asm volatile("" : "+r"(w));
#endif
    p[0] = (uint8_t)w;
    p[1] = (uint8_t)(w >> 8);
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

// Element `i` of an input array of `dtype`, as f32.
HIPKV_DEV float load_input(const void *x, uint32_t dtype, size_t i) {
    if (dtype == HIPKV_DTYPE_F16) return half_to_float(static_cast<const uint16_t *>(x)[i]);
    if (dtype == HIPKV_DTYPE_BF16) return bf16_to_float(static_cast<const uint16_t *>(x)[i]);
    return static_cast<const float *>(x)[i];
}

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

// The code of `x` in an asymmetric group: the nearest level of the stream's codebook, which
// for uniform levels is round half away from zero, clamped (`Midpoints`).
template <int B>
HIPKV_DEV uint32_t asym_code(float x, float scale, float min, const Midpoints<B> &levels) {
    if (scale == 0.0f) return 0;
    return levels.code((x - min) / scale);
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

// The stream a launch writes: its layout and state offsets.
HIPKV_DEV const hipkv_stream_layout &stream_layout(const hipkv_write_params &p) {
    return p.stream == 0 ? p.g.k : p.g.v;
}

// Where a checked token goes.
struct Target {
    uint32_t seq_slot;
    uint32_t pos;
    uint32_t block;
    uint32_t offset;  // pos % block_tokens
    uint8_t *state;   // this layer's state of the token's slot
};

// Checks the indices a server gave for `token`; false (after reporting the first bad one) when
// the token must be skipped. Every lane computes the same answer.
HIPKV_DEV bool locate(const hipkv_write_params &p, uint32_t token, bool report, Target *t) {
    const hipkv_paged_geometry &g = p.g;
    const int64_t seq = p.seq_slots[token], slot = p.slot_mapping[token],
                  pos = p.positions[token];
    const int64_t slots = (int64_t)g.num_blocks * g.block_tokens;
    uint32_t what = HIPKV_BAD_NONE;
    int64_t index = 0, limit = 0;
    if (seq < 0 || seq >= (int64_t)g.max_seqs) {
        what = HIPKV_BAD_SEQ_SLOT, index = seq, limit = g.max_seqs;
    } else if (slot < 0 || slot >= slots) {
        what = HIPKV_BAD_SLOT, index = slot, limit = slots;
    } else if (pos < 0 || pos >= (int64_t)g.max_positions) {
        what = HIPKV_BAD_POSITION, index = pos, limit = g.max_positions;
    } else if (slot % g.block_tokens != pos % g.block_tokens) {
        what = HIPKV_BAD_SLOT_OFFSET, index = slot, limit = pos % g.block_tokens;
    }
    if (what != HIPKV_BAD_NONE) {
        if (report && lane_id() == 0)
            report_bad_index(p.error, what, HIPKV_CHECK_WRITE, token, index, limit);
        return false;
    }
    t->seq_slot = (uint32_t)seq;
    t->pos = (uint32_t)pos;
    t->block = (uint32_t)(slot / g.block_tokens);
    t->offset = (uint32_t)(slot % g.block_tokens);
    t->state = p.state + (size_t)seq * p.slot_state_bytes + p.layer_state;
    return true;
}

// A source of one f16-rounded row of `head_dim` channels: a row of the batch's input (converted
// from its dtype and rounded to f16, as stored) or a row of the residual window.
struct Row {
    const void *x;         // the input row; null: `f16`
    uint32_t dtype;
    const uint16_t *f16;
};

// A stream the scheme rotates (`g.rotate`) is read whole into LDS and rotated there first, so
// every path (sinks, windows, blocks) stores rotated rows. Every lane must call it.
template <int D>
HIPKV_DEV Row input_row(const hipkv_write_params &p, uint32_t token, uint32_t head) {
    __shared__ float rotated[D];
    Row r;
    const size_t elem = ((size_t)token * p.g.kv_heads + head) * D;
    const size_t size = p.dtype == HIPKV_DTYPE_F32 ? 4 : 2;
    r.x = static_cast<const uint8_t *>(p.x) + elem * size;
    r.dtype = p.dtype;
    r.f16 = nullptr;
    if (p.g.rotate & (1u << p.stream)) {
        wave_sync();  // the lanes are done reading the previous row
        for (uint32_t c = lane_id(); c < D; c += HIPKV_WAVE)
            rotated[c] = load_input(r.x, r.dtype, c);
        hadamard_wave(rotated, D);
        r.x = rotated;
        r.dtype = HIPKV_DTYPE_F32;
    }
    return r;
}

// The lane's channels [c0, c0 + N) of a row, as floats (0 for lanes without channels).
template <int N>
HIPKV_DEV void load_lane(const Row &row, uint32_t c0, bool active, float x[N]) {
    for (int i = 0; i < N; ++i) {
        if (!active)
            x[i] = 0.0f;
        else if (row.x)
            x[i] = round_f16(load_input(row.x, row.dtype, c0 + i));
        else
            x[i] = half_to_float(row.f16[c0 + i]);
    }
}

// The residual window of the stream, for `head`, in a slot's layer state.
HIPKV_DEV uint16_t *residual_rows(const hipkv_write_params &p, uint8_t *state, uint32_t head) {
    const uint32_t at = p.stream == 0 ? p.g.residual_k : p.g.residual_v;
    return reinterpret_cast<uint16_t *>(state + at) +
           (size_t)head * p.g.block_tokens * p.g.head_dim;
}

// Row `t` of the block whose last position `last` the wave of batch token `token` writes: from
// this batch when a token of the same slot holds that position (the batch lists a sequence's
// tokens in order), from the residual window otherwise.
template <int D>
HIPKV_DEV Row block_row(const hipkv_write_params &p, const Target &target, uint32_t token,
                        uint32_t head, uint32_t t) {
    const uint32_t back = p.g.block_tokens - 1 - t;
    const uint32_t pos = target.pos - back;
    if (back <= token) {
        const uint32_t j = token - back;
        if ((uint32_t)p.seq_slots[j] == target.seq_slot && (uint32_t)p.positions[j] == pos)
            return input_row<D>(p, j, head);
    }
    Row r;
    r.x = nullptr;
    r.dtype = HIPKV_DTYPE_F16;
    r.f16 = residual_rows(p, target.state, head) + (size_t)t * p.g.head_dim;
    return r;
}

// The value window (KIVI's residual of R = value_window positions): W = R + block_tokens rows,
// enough for every position of the blocks that hold the last R. The row of batch token `token`
// goes f16 to window row pos % W, unless the token W places later in the batch holds position
// pos + W of the same slot and so takes that row (the batch lists a sequence's tokens in
// order): no two waves of a launch write one window row.
template <int D>
HIPKV_DEV void write_window(const hipkv_write_params &p, const Target &target, uint32_t token,
                            uint32_t head, const Row &src) {
    const uint32_t rows = p.g.value_window + p.g.block_tokens;
    const uint32_t j = token + rows;
    if (j < p.tokens && (uint32_t)p.seq_slots[j] == target.seq_slot &&
        (uint32_t)p.positions[j] == target.pos + rows)
        return;
    uint16_t *dst = reinterpret_cast<uint16_t *>(target.state + p.g.window_v) +
                    ((size_t)head * rows + target.pos % rows) * D;
    for (uint32_t c = lane_id(); c < D; c += HIPKV_WAVE)
        dst[c] = float_to_half(load_input(src.x, src.dtype, c));
}

// Clips the lane's channels to the head's outlier thresholds.
template <int N, int D>
HIPKV_DEV void clip(const hipkv_write_params &p, uint32_t head, uint32_t c0, bool active,
                    float x[N]) {
    if (!active) return;
    const float *lo = p.outlier_lo + (size_t)head * D + c0;
    const float *hi = p.outlier_hi + (size_t)head * D + c0;
    for (int i = 0; i < N; ++i) x[i] = x[i] < lo[i] ? lo[i] : (x[i] > hi[i] ? hi[i] : x[i]);
}

// Selects the outliers of a row as `quant::split_outliers` does: all of them when they fit in
// the row's slots, otherwise the ones farthest outside their range (ties: lower channel first).
// The selected ones are clipped in `x` and flagged in `keep`; the others stay as they are.
// Returns the row's number of outliers. Every lane must call it.
template <int N, int D>
HIPKV_DEV uint32_t select_outliers(const hipkv_write_params &p, uint32_t head, uint32_t c0,
                                   bool active, float x[N], bool keep[N]) {
    __shared__ float distances[D];
    const uint32_t cap = stream_layout(p).outlier_slots;
    float clipped[N], dist[N];
    for (int i = 0; i < N; ++i) clipped[i] = x[i];
    clip<N, D>(p, head, c0, active, clipped);
    uint32_t found = 0;
    for (int i = 0; i < N; ++i) {
        dist[i] = fabsf(x[i] - clipped[i]);
        found += dist[i] != 0.0f;
        keep[i] = dist[i] != 0.0f;
    }
    // Counts up to head_dim are exact in f32.
    const uint32_t total = (uint32_t)wave_sum((float)found);
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
    for (int i = 0; i < N; ++i)
        if (keep[i]) x[i] = clipped[i];
    return total;
}

// Moves the selected outliers of row `t` of a head block (`select_outliers`) into its sparse
// store, in channel order, clipping them in `x`. Those left out for lack of slots stay in the
// dense row and are counted in `outliers_dropped`.
template <int N, int D>
HIPKV_DEV void store_outliers(const hipkv_write_params &p, uint8_t *block, uint32_t t,
                              uint32_t head, uint32_t c0, bool active, float x[N]) {
    __shared__ uint32_t kept_by_lane[HIPKV_WAVE];
    const hipkv_stream_layout &l = stream_layout(p);
    const uint32_t cap = l.outlier_slots;
    float exact[N];
    for (int i = 0; i < N; ++i) exact[i] = x[i];
    bool keep[N];
    const uint32_t total = select_outliers<N, D>(p, head, c0, active, x, keep);
    // Slot index of the lane's first kept outlier: the kept outliers of the lanes before it.
    uint32_t mine = 0;
    for (int i = 0; i < N; ++i) mine += keep[i];
    kept_by_lane[lane_id()] = mine;
    barrier();
    uint32_t at = 0;
    for (uint32_t lane = 0; lane < lane_id(); ++lane) at += kept_by_lane[lane];
    barrier();
    uint8_t *slots = block + l.slots + (size_t)t * cap * 4;
    for (int i = 0; i < N; ++i) {
        if (!keep[i]) continue;
        store_u16(slots + 4 * at, (uint16_t)(c0 + i));
        store_u16(slots + 4 * at + 2, float_to_half(exact[i]));
        ++at;
    }
    if (lane_id() == 0) {
        store_u16(block + l.counts + 2 * t, (uint16_t)(total < cap ? total : cap));
        if (total > cap) atomic_add(p.outliers_dropped, total - cap);
    }
}

// Quantizes one token's (clipped) row into row `t` of a head block, per-token formats.
template <int F, int D>
HIPKV_DEV void quantize_row(const hipkv_write_params &p, uint8_t *block, uint32_t t,
                            uint32_t c0, bool active, const float x[]) {
    constexpr int N = kLaneChannels<F, D>;
    const hipkv_stream_layout &l = stream_layout(p);
    uint8_t *row = block + l.rows + (size_t)t * l.row_bytes;
    constexpr ParamsAt at = kParams<F>;
    if constexpr (at == ParamsAt::None) {
        for (int i = 0; i < N; ++i) store_u16(row + 2 * (c0 + i), float_to_half(x[i]));
    } else if constexpr (at == ParamsAt::TokenScale || at == ParamsAt::BlockScale) {
        // Symmetric 8-bit codes: one scale for the row (all lanes) or per 32-channel block,
        // max|x| over the largest code magnitude (q8 127, fp8 448).
        using Fmt = Format<F>;
        float amax = 0.0f;
        for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(x[i]));
        amax = segment_max(amax, at == ParamsAt::TokenScale ? HIPKV_WAVE : HIPKV_Q8_0_BLOCK / N);
        const float scale = round_f16(amax / Fmt::kMaxCode);
        uint8_t *codes = row + c0;
        if constexpr (at == ParamsAt::BlockScale) {
            uint8_t *b = row + (c0 / HIPKV_Q8_0_BLOCK) * HIPKV_Q8_0_BLOCK_BYTES;
            if (c0 % HIPKV_Q8_0_BLOCK == 0) store_u16(b, float_to_half(scale));
            codes = b + 2 + c0 % HIPKV_Q8_0_BLOCK;
        } else if (lane_id() == 0) {
            store_u16(block + l.params + 2 * t, float_to_half(scale));
        }
        for (int i = 0; i < N; ++i) codes[i] = Fmt::encode(x[i], scale);
    } else {
        static_assert(format_is_tok(F), "per-channel formats quantize whole blocks");
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
        const Midpoints<format_bits(F)> levels(p.levels);
        uint32_t codes[N];
        for (int i = 0; i < N; ++i) codes[i] = asym_code(x[i], scale, min, levels);
        if (!active) return;
        store_codes<F, N>(row + c0 * format_bits(F) / 8, codes);
        if ((c0 & (l.group - 1)) == 0) {
            uint8_t *gp = block + l.params + 4 * ((size_t)t * (D >> shift) + (c0 >> shift));
            store_u16(gp, float_to_half(scale));
            store_u16(gp + 2, float_to_half(min));
        }
    }
}

// Quantizes, per channel, the block whose last position the wave of `token` writes: every row's
// outliers, the channels' scale and minimum over the block, then every row's codes. Rows at
// sink positions (the first `skip`) are left out and not written.
template <int F, int D>
HIPKV_DEV void quantize_block(const hipkv_write_params &p, const Target &target, uint32_t token,
                              uint8_t *block, uint32_t head) {
    constexpr int N = kLaneChannels<F, D>;
    const hipkv_stream_layout &l = stream_layout(p);
    const uint32_t c0 = lane_id() * N;
    const bool active = c0 < D;
    const uint32_t first = target.pos - target.offset;
    const uint32_t skip = p.g.sinks > first ? p.g.sinks - first : 0;
    if (skip >= p.g.block_tokens) return;  // every position is a sink: nothing to store
    float lo[N], hi[N];
    for (int i = 0; i < N; ++i) {
        lo[i] = kInf;
        hi[i] = -kInf;
    }
    HIPKV_ROLLED
    for (uint32_t t = skip; t < p.g.block_tokens; ++t) {
        float x[N];
        load_lane<N>(block_row<D>(p, target, token, head, t), c0, active, x);
        if (p.outlier_lo) store_outliers<N, D>(p, block, t, head, c0, active, x);
        for (int i = 0; i < N; ++i) {
            lo[i] = fminf(lo[i], x[i]);
            hi[i] = fmaxf(hi[i], x[i]);
        }
    }
    // Lanes without channels stay to the end: reading a rotated row takes the whole wave.
    float scale[N], min[N];
    for (int i = 0; i < N; ++i) {
        asym_params<F>(lo[i], hi[i], &scale[i], &min[i]);
        if (!active) continue;
        store_u16(block + l.params + 4 * (c0 + i), float_to_half(scale[i]));
        store_u16(block + l.params + 4 * (c0 + i) + 2, float_to_half(min[i]));
    }
    const Midpoints<format_bits(F)> levels(p.levels);
    HIPKV_ROLLED
    for (uint32_t t = skip; t < p.g.block_tokens; ++t) {
        float x[N];
        load_lane<N>(block_row<D>(p, target, token, head, t), c0, active, x);
        if (p.outlier_lo) {
            // The outliers the first pass stored, clipped again (the same selection).
            bool keep[N];
            select_outliers<N, D>(p, head, c0, active, x, keep);
        }
        if (!active) continue;
        uint32_t codes[N];
        for (int i = 0; i < N; ++i) codes[i] = asym_code(x[i], scale[i], min[i], levels);
        store_codes<F, N>(block + l.rows + (size_t)t * l.row_bytes + c0 * format_bits(F) / 8,
                          codes);
    }
}

template <int F, int D>
HIPKV_DEV void write(const hipkv_write_params &p) {
    constexpr int N = kLaneChannels<F, D>;
    const uint32_t token = blockIdx.x, head = blockIdx.y;
    if (token >= p.tokens || head >= p.g.kv_heads) return;
    Target target;
    if (!locate(p, token, head == 0, &target)) return;
    const uint32_t c0 = lane_id() * N;
    const bool active = c0 < D;
    if (target.pos < p.g.sinks) {
        const uint32_t at = p.stream == 0 ? p.g.sinks_k : p.g.sinks_v;
        uint16_t *dst = reinterpret_cast<uint16_t *>(target.state + at) +
                        ((size_t)head * p.g.sinks + target.pos) * D;
        float x[N];
        load_lane<N>(input_row<D>(p, token, head), c0, active, x);
        if (active)
            for (int i = 0; i < N; ++i) dst[c0 + i] = float_to_half(x[i]);
        return;
    }
    // The token's own row, read (and, for a rotated stream, rotated) once for the value window
    // and a per-token format; a per-channel block reads its rows in quantize_block.
    const bool window = p.stream == 1 && p.g.value_window != 0;
    Row row{};
    if (window || !format_is_chan(F)) row = input_row<D>(p, token, head);
    if (window) write_window<D>(p, target, token, head, row);
    uint8_t *block = p.cache + (size_t)target.block * p.g.block_bytes +
                     (size_t)head * p.g.head_block_bytes;
    if constexpr (format_is_chan(F)) {
        // The wave of the block's last position quantizes it; the others have nothing to do.
        if (target.offset + 1 == p.g.block_tokens)
            quantize_block<F, D>(p, target, token, block, head);
    } else {
        float x[N];
        load_lane<N>(row, c0, active, x);
        if (p.outlier_lo) store_outliers<N, D>(p, block, target.offset, head, c0, active, x);
        quantize_row<F, D>(p, block, target.offset, c0, active, x);
    }
}

// Per-channel formats, after hipkv_write_<format>: rows of blocks this batch leaves open go to
// the residual window, f16.
template <int D>
HIPKV_DEV void write_residual(const hipkv_write_params &p) {
    const uint32_t token = blockIdx.x, head = blockIdx.y;
    if (token >= p.tokens || head >= p.g.kv_heads) return;
    Target target;
    if (!locate(p, token, false, &target) || target.pos < p.g.sinks) return;
    // Written here only if no token of this batch completes the block.
    const uint32_t ahead = p.g.block_tokens - 1 - target.offset;
    const uint32_t j = token + ahead;
    if (j < p.tokens && (uint32_t)p.seq_slots[j] == target.seq_slot &&
        (uint32_t)p.positions[j] == target.pos + ahead)
        return;
    const Row src = input_row<D>(p, token, head);
    uint16_t *dst = residual_rows(p, target.state, head) + (size_t)target.offset * D;
    for (uint32_t c = lane_id(); c < D; c += HIPKV_WAVE)
        dst[c] = float_to_half(load_input(src.x, src.dtype, c));
}

}  // namespace hipkv

// copy_blocks (in every head_dim's code object, since the HIP backend loads only the one of its
// cache's head_dim): lane i of workgroup (pair, chunk) copies 16-byte words i, i + 32, ... of the
// chunk's 4 KiB (blocks are 16-byte multiples). A pair naming a block outside the layout copies
// nothing.
HIPKV_KERNEL(hipkv_copy_blocks, hipkv_copy_params) {
    const uint32_t pair = blockIdx.x;
    if (pair >= p.pairs) return;
    const int64_t src = p.block_pairs[2 * pair], dst = p.block_pairs[2 * pair + 1];
    const int64_t bad = src < 0 || src >= p.num_blocks ? src : dst;
    if (bad < 0 || bad >= p.num_blocks) {
        if (blockIdx.y == 0 && hipkv::lane_id() == 0)
            hipkv::report_bad_index(p.error, HIPKV_BAD_BLOCK, HIPKV_CHECK_COPY_BLOCKS, pair, bad,
                                    p.num_blocks);
        return;
    }
    const uint64_t chunk = 4096, begin = (uint64_t)blockIdx.y * chunk;
    const uint64_t end = begin + chunk < p.block_bytes ? begin + chunk : p.block_bytes;
    const uint8_t *from = p.cache + (uint64_t)src * p.block_bytes;
    uint8_t *to = p.cache + (uint64_t)dst * p.block_bytes;
    for (uint64_t at = begin + 16 * hipkv::lane_id(); at < end; at += 16 * HIPKV_WAVE)
        memcpy(to + at, from + at, 16);
}

// hipkv_write_<format>_d<head_dim>, hipkv_write_residual_d<head_dim>
#define HIPKV_WRITE(NAME, F, D)                                        \
    HIPKV_KERNEL(hipkv_write_##NAME##_d##D, hipkv_write_params) {      \
        hipkv::write<F, D>(p);                                          \
    }
#define HIPKV_WRITE_ALL(D)                                              \
    HIPKV_FORMATS(HIPKV_WRITE, D)                                       \
    HIPKV_KERNEL(hipkv_write_residual_d##D, hipkv_write_params) {       \
        hipkv::write_residual<D>(p);                                    \
    }

#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 64
HIPKV_WRITE_ALL(64)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 128
HIPKV_WRITE_ALL(128)
#endif
#if !defined(HIPKV_HEAD_DIM) || HIPKV_HEAD_DIM == 256
HIPKV_WRITE_ALL(256)
#endif

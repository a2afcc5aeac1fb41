// The device ABI of hipkv: the one params struct each kernel family takes, and the format
// constants, shared by the kernels (HIP on a GPU, or the host emulator) and by Rust.
// Plain C, fixed-width fields, no padding surprises: the Rust side (src/abi/generated.rs) is
// generated from this header by bindgen, and tests/abi.rs fails when it is stale.
#ifndef HIPKV_ABI_H
#define HIPKV_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Storage formats of one stream (keys or values); equal to `hipkv::scheme::Format::abi_code`.
enum hipkv_format {
    HIPKV_F16 = 0,
    HIPKV_Q8 = 1,
    HIPKV_Q8_0 = 2,
    HIPKV_Q4_TOK = 3,
    HIPKV_Q2_TOK = 4,
    HIPKV_Q4_CHAN = 5,
    HIPKV_Q2_CHAN = 6,
    HIPKV_FP8 = 7,
};

// Channels per block of the int8-rounded query (`int_query`), each with its own scale.
#define HIPKV_QUERY_BLOCK 32
// `int_query` of per-channel keys (q*_chan), whose scales differ per channel and block: the
// attention kernel rounds each block's folded query `q ∘ s` (in f32, the rows prep wrote times
// the block's channel scales) instead, once per block and wave, and prep leaves the query f32.
#define HIPKV_INT_QUERY_PER_BLOCK 0x100u

// Query heads per KV head the attention kernels handle at most.
#define HIPKV_MAX_GQA 16
// Query rows (token × GQA head) one attention wave computes. Four keep every row's softmax state
// and accumulator in registers with room to spare at 8 waves per SIMD, with no spills, at every
// head_dim; a GQA group of more heads takes several waves of one workgroup, which read the same
// blocks at the same time, so a cached byte still comes from memory once per workgroup.
#define HIPKV_ROWS(head_dim) 4
// Tokens one trip of an attention wave's value loop accumulates: a lane takes 4 channels of a
// token at least, so at head_dim 64 the wave takes two tokens per trip, 16 lanes each. A trip's
// fixed costs (the row's address, its parameters, the weights from LDS) then buy each lane 4
// channels' multiply-adds, not 2.
#define HIPKV_VALUE_TOKENS(head_dim) ((head_dim) < 4 * HIPKV_WAVE ? 4 * HIPKV_WAVE / (head_dim) : 1)
// Lanes of a wave (wave32 on gfx1201; a warp on CUDA).
#define HIPKV_WAVE 32
// Work-items per workgroup of every kernel but attention: one wave.
#define HIPKV_THREADS 32
// Waves per attention workgroup, at most: a decode-only batch launches one per HIPKV_ROWS heads
// of the GQA group (its wave scores 32 tokens at once, one per lane; splits fill the GPU), a
// batch with prefill chunks this many, each wave taking HIPKV_ROWS query rows of the tile over
// the same blocks.
#define HIPKV_MAX_WAVES 4

// Where one stream (K or V) lives inside the block of one head in a page.
typedef struct hipkv_stream_layout {
    uint32_t rows;          // byte offset of the packed rows, token-major
    uint32_t row_bytes;     // bytes per token row
    uint32_t params;        // byte offset of the quantization parameters
    uint32_t counts;        // byte offset of the u16 outlier counts per token
    uint32_t slots;         // byte offset of the outlier slots {u16 channel, f16 value}
    uint32_t outlier_slots; // slots per token; 0: no outlier store
    uint32_t group;         // channels per parameter group (per-token formats)
    uint32_t residual;      // 1: the open page's tokens stay f16 in the residual window
} hipkv_stream_layout;

// Input and output element types of the paged calls.
enum hipkv_dtype {
    HIPKV_DTYPE_F16 = 0,
    HIPKV_DTYPE_BF16 = 1,
    HIPKV_DTYPE_F32 = 2,
};

// What a server passed that the kernels found out of range (`hipkv_device_error::what`).
enum hipkv_bad_index {
    HIPKV_BAD_NONE = 0,
    HIPKV_BAD_SEQ_SLOT = 1,     // a sequence slot >= the layout's max_seqs
    HIPKV_BAD_SLOT = 2,         // a slot outside the layout's blocks
    HIPKV_BAD_POSITION = 3,     // a position beyond max_positions
    HIPKV_BAD_SLOT_OFFSET = 4,  // slot % block_tokens != position % block_tokens
    HIPKV_BAD_QUERY_RANGE = 5,  // query_start_loc not increasing within the batch's tokens
    HIPKV_BAD_QUERY_LEN = 6,    // more query tokens than the sequence holds, or than max_q_len
    HIPKV_BAD_SEQ_LEN = 7,      // a length beyond max_seq_len, the block table or max_positions
    HIPKV_BAD_BLOCK = 8,        // a block id outside the layout's blocks
};

// Which kernel found it (`hipkv_device_error::kernel`).
enum hipkv_checked_kernel {
    HIPKV_CHECK_WRITE = 1,
    HIPKV_CHECK_ATTEND = 2,
    HIPKV_CHECK_COPY_BLOCKS = 3,
};

// The sticky error word: the first out-of-range index any kernel met since the last check.
// A kernel sets it with an atomic compare-and-swap on `what` (0 -> code), then fills the rest.
typedef struct hipkv_device_error {
    uint32_t what;      // hipkv_bad_index; 0: nothing found
    uint32_t kernel;    // hipkv_checked_kernel
    uint32_t item;      // the token (write) or batch sequence (attend) or pair (copy)
    uint32_t reserved;
    int64_t index;      // the value found
    int64_t limit;      // the bound it broke (exclusive; for SLOT_OFFSET, the expected offset)
} hipkv_device_error;

// The geometry every paged kernel shares: one layer's blocks and one slot's state.
typedef struct hipkv_paged_geometry {
    uint64_t block_bytes;       // bytes of one block (all KV heads)
    uint32_t head_block_bytes;  // bytes of one head's part of a block
    uint32_t kv_heads;
    uint32_t gqa;               // query heads per KV head (<= HIPKV_MAX_GQA)
    uint32_t head_dim;
    uint32_t block_tokens;      // tokens per block (the scheme's page: 32 or 64)
    uint32_t sinks;             // positions kept f16 in the slot state (never read from blocks)
    uint32_t num_blocks;
    uint32_t max_seqs;          // sequence slots
    uint32_t max_positions;     // tokens a sequence may hold
    uint32_t pre_rope;          // 1: keys are stored unrotated; attention rotates them
    uint32_t rope_pairs_interleaved; // 1: pairs (2i, 2i+1); 0: halves (i, i + head_dim/2)
    // Streams stored rotated by the orthonormal Walsh–Hadamard transform of each head (bit 0:
    // keys, bit 1: values): write rotates the rows before storing anything, prep rotates the
    // queries (keys), combine the outputs (values).
    uint32_t rotate;
    // Per slot, per layer: `state_bytes`; within it, byte offsets of the f16 sink rows of K and
    // V (kv_heads × sinks × head_dim each), of the residual windows of per-channel streams
    // (kv_heads × block_tokens × head_dim each; unused for per-token streams) and of the value
    // window (kv_heads × W × head_dim, W = value_window + block_tokens: position p's f16 value
    // row at p % W; a block holding any of the last value_window positions is read from it).
    uint64_t state_bytes;
    uint32_t sinks_k;
    uint32_t sinks_v;
    uint32_t residual_k;
    uint32_t residual_v;
    uint32_t value_window;      // KIVI's R: the last R positions' values are read f16 (0: none)
    uint32_t window_v;
    hipkv_stream_layout k;
    hipkv_stream_layout v;
} hipkv_paged_geometry;

// write_kv, one stream (K or V) of the batch's new tokens. Two launches per stream, grid
// (tokens, kv_heads), one wave per (token, KV head):
//   hipkv_write_<format>_d<head_dim>: a sink position's row to the slot's sinks; a per-token
//     format's row quantized into its slot's block; a per-channel format's block quantized when
//     its last position is written (older rows from the residual window, this batch's from x);
//   hipkv_write_residual_d<head_dim>: per-channel formats only, after the first: the rows of
//     blocks this batch leaves open go to the slot's residual window (after, since the first
//     launch may read the window slots they replace).
// Positions below `sinks` are never written to blocks. Outliers beyond the thresholds go to
// the block's sparse store, as `src/quant` does. With a value window, the first launch also
// copies each value row f16 into its window row unless the batch holds the position W later
// (the batch lists a sequence's tokens in order).
typedef struct hipkv_write_params {
    hipkv_paged_geometry g;
    uint32_t stream;            // 0: keys, 1: values (selects the layout and state offsets)
    uint32_t dtype;             // hipkv_dtype of x
    uint32_t tokens;
    uint32_t layer_state;       // byte offset of this layer's state within a slot's
    uint8_t *cache;             // the layer's blocks: num_blocks × block_bytes
    uint8_t *state;             // the state pool: max_seqs slots × layers × state_bytes
    uint64_t slot_state_bytes;  // bytes of one slot in the pool (all layers)
    const void *x;              // tokens × kv_heads × head_dim
    const int64_t *slot_mapping; // per token: block × block_tokens + offset
    const int32_t *seq_slots;   // per token
    const int32_t *positions;   // per token
    const float *outlier_lo;    // kv_heads × head_dim thresholds; null: no outlier store
    const float *outlier_hi;
    uint64_t *outliers_dropped; // outliers left in the dense row for lack of slots (atomic)
    // The stream's codebook (nuq schemes): 2^bits strictly increasing levels in code units; a
    // code decodes to min + scale · levels[code], and an element takes the nearest level (by
    // the midpoints (levels[i] + levels[i+1]) · 0.5, the upper on a tie). Null: uniform.
    const float *levels;
    hipkv_device_error *error;
} hipkv_write_params;

// attend: queries of a varlen batch (sequence s has query tokens
// query_start_loc[s] .. query_start_loc[s + 1], the last ones of its seq_lens[s] tokens, each
// attending causally). Three launches:
//   hipkv_attn_prep: grid (tokens, kv_heads): converts q to f32 (rotated for rotated keys)
//     scaled by softmax_scale · log2(e), the per-group query sums, and clears the partial sums;
//   hipkv_attn_<kf>_<vf>_d<head_dim>: grid (num_seqs × tiles_per_seq, kv_heads, splits),
//     `waves` waves per workgroup; a workgroup computes a tile of waves × HIPKV_ROWS(head_dim)
//     query rows (token × GQA head) of one KV head over one split of the pages;
//   hipkv_attn_combine: grid (tokens × q_heads): merges the splits into `out` (dtype), rotated
//     back for rotated values.
typedef struct hipkv_attn_params {
    hipkv_paged_geometry g;
    uint32_t dtype;             // hipkv_dtype of q and out
    uint32_t num_seqs;
    uint32_t tokens;            // query tokens of the batch
    uint32_t max_q_len;         // bounds the server promised (checked)
    uint32_t max_seq_len;
    uint32_t max_blocks_per_seq; // width of block_tables
    uint32_t tiles_per_seq;     // grid.x / num_seqs
    uint32_t splits;
    uint32_t blocks_per_split;
    uint32_t layer_state;
    uint64_t slot_state_bytes;
    float softmax_scale;
    // Sliding window: a query token attends to its own position and the window - 1 before it
    // (the blocks below are not read, so a server may have reused them); 0: to every position.
    uint32_t window;
    // Key scores from the query rounded to int8 per HIPKV_QUERY_BLOCK channels (`iq`; q8, q8_0,
    // q*_tok and q*_chan keys): the bits of a key code (8, 4, 2), which order the query's codes;
    // 0: f32 scores. Prep writes the codes and scales below, and every f32 row it writes is the
    // rounded query, so the step is exactly the attention of the rounded query. For q*_chan
    // keys, or'ed with HIPKV_INT_QUERY_PER_BLOCK.
    uint32_t int_query;
    const uint8_t *cache;
    const uint8_t *state;
    const void *q;              // tokens × q_heads × head_dim
    void *out;                  // same shape and dtype
    const int32_t *query_start_loc; // num_seqs + 1
    const int32_t *seq_lens;    // num_seqs
    const int32_t *block_tables; // num_seqs × max_blocks_per_seq
    const int32_t *seq_slots;   // num_seqs
    const float *rope_cos_sin;  // max_positions × head_dim/2 × {cos, sin} (pre_rope only)
    // Workspace (the server's, sized by the layout):
    float *q_f32;               // tokens × q_heads × head_dim, scaled
    float *q_group_sums;        // tokens × kv_heads × (head_dim / k.group) × gqa
    float *partial_acc;         // per (query row, split): head_dim floats, unnormalized
    float *partial_max;         // running maximum of the base-2 logits
    float *partial_sum;         // sum of 2^(logit - max); 0: the split saw no token
    // `int_query` only (else null): laid out as q_f32, one int8 code per channel in the key
    // format's dot order (`int_query_slot`), and one scale per block, scaled as q_f32.
    uint32_t *q_codes;          // tokens × q_heads × head_dim / 4 words
    float *q_scales;            // tokens × q_heads × head_dim / HIPKV_QUERY_BLOCK
    const float *k_levels;      // the codebooks of nuq streams (as hipkv_write_params::levels)
    const float *v_levels;
    hipkv_device_error *error;
} hipkv_attn_params;

// copy_blocks: grid (pairs, chunks of the block): block pairs[2i] is copied over pairs[2i+1].
typedef struct hipkv_copy_params {
    uint8_t *cache;
    uint64_t block_bytes;
    uint32_t num_blocks;
    uint32_t pairs;
    const int32_t *block_pairs;
    hipkv_device_error *error;
} hipkv_copy_params;

#ifdef __cplusplus
}
#endif

#endif

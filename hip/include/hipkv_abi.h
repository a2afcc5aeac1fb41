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
};

// Query heads per KV head the attention kernels handle at most.
#define HIPKV_MAX_GQA 16
// Query heads one attention workgroup computes, by head_dim: a GQA group of up to this many
// reads each cached byte once; larger groups take several workgroups per KV head (whose repeat
// reads usually hit L2). The per-lane state of these rows stays in registers at 8+ waves/SIMD.
#define HIPKV_ROWS(head_dim) ((head_dim) <= 128 ? 8 : 4)
// Lanes of a wave (wave32 on gfx1201; a warp on CUDA).
#define HIPKV_WAVE 32
// Work-items per workgroup of every kernel: one wave. A decode workgroup needs no more: its
// wave scores 32 tokens at once (one per lane), and more parallelism comes from splits.
#define HIPKV_THREADS 32

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

// Split-K decode attention: one workgroup per (query, KV head × row group, split); every query
// head of the row group (HIPKV_ROWS of the GQA group) is computed by that workgroup.
typedef struct hipkv_attn_params {
    const uint8_t *pool;          // page pool of the layer
    uint64_t page_bytes;          // bytes of one page (all KV heads)
    uint32_t head_block_bytes;    // bytes of one head's block in a page
    uint32_t kv_heads;
    uint32_t gqa;                 // query heads per KV head (<= HIPKV_MAX_GQA)
    uint32_t head_dim;
    uint32_t group_tokens;        // tokens per page
    uint32_t sinks;               // f16 sink tokens per sequence
    uint32_t splits;              // splits per (query, KV head)
    uint32_t pages_per_split;
    uint32_t pre_rope;            // 1: rotate each dequantized key by its position
    uint32_t rope_pairs_interleaved; // 1: pairs (2i, 2i+1); 0: halves (i, i + head_dim/2)
    hipkv_stream_layout k;
    hipkv_stream_layout v;
    // Per query (one decode token of one sequence):
    const uint32_t *seq_len;      // tokens in the sequence, the new one included
    const uint32_t *const *block_table; // page ids of the sequence
    const uint16_t *const *sinks_k;     // kv_heads × sinks × head_dim f16
    const uint16_t *const *sinks_v;
    const uint16_t *const *residual_k;  // kv_heads × group_tokens × head_dim f16
    const uint16_t *const *residual_v;
    const float *q;               // queries × kv_heads × gqa × head_dim, rotated and scaled
                                  // by softmax_scale · log2(e)
    const float *q_group_sums;    // queries × kv_heads × (head_dim / k.group) × gqa: the sum
                                  // of q over each key parameter group (per-token key formats)
    const float *rope_cos_sin;    // positions × head_dim/2 × {cos, sin} (pre_rope only)
    // Outputs, per (query, KV head, split, query row):
    float *partial_acc;           // unnormalized output, head_dim floats
    float *partial_max;           // running maximum of the base-2 logits
    float *partial_sum;           // sum of 2^(logit - max)
} hipkv_attn_params;

// Append: new tokens of one sequence, already in f16 (and rotated, unless keys are stored before
// RoPE), written into one stream's storage. One launch per stream; grid (tokens, kv_heads), one
// wave per (token, head):
//   hipkv_append_<format>_d<head_dim>: sink tokens to the sink buffer; per-token formats quantize
//     their row into its page; per-channel formats quantize every page this append completes,
//     reading its older tokens from the residual window;
//   hipkv_append_residual: per-channel formats only, launched after the first: the tokens of the
//     page left open go to the residual window (after, because the first reads what they replace).
// Outliers beyond the thresholds go to the page's sparse store, as `src/quant` does.
typedef struct hipkv_append_params {
    uint8_t *pool;                // page pool of the layer
    uint64_t page_bytes;          // bytes of one page (all KV heads)
    uint32_t head_block_bytes;    // bytes of one head's block in a page
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t group_tokens;        // tokens per page
    uint32_t sinks;               // f16 sink tokens per sequence
    uint32_t first_pos;           // position of the first new token (tokens stored before)
    uint32_t tokens;              // new tokens
    hipkv_stream_layout layout;   // the stream appended to
    const uint32_t *block_table;  // page ids of the sequence, new pages included
    const uint16_t *x;            // tokens × kv_heads × head_dim f16
    uint16_t *sink_buf;           // kv_heads × sinks × head_dim f16
    uint16_t *residual;           // kv_heads × group_tokens × head_dim f16 (per-channel formats)
    const float *outlier_lo;      // kv_heads × head_dim thresholds; null: no outlier store
    const float *outlier_hi;
    uint64_t *outliers_dropped;   // outliers clipped for lack of slots, added atomically
} hipkv_append_params;

// Merges the splits of every (query, KV head, query row) into the output.
typedef struct hipkv_combine_params {
    const float *partial_acc;
    const float *partial_max;
    const float *partial_sum;
    float *out;                   // queries × kv_heads × gqa × head_dim
    uint32_t rows;                // queries × kv_heads × gqa
    uint32_t gqa;
    uint32_t splits;
    uint32_t head_dim;
} hipkv_combine_params;

#ifdef __cplusplus
}
#endif

#endif

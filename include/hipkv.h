/*
 * hipkv: quantized KV-cache attention for ROCm servers, the C ABI.
 *
 * One handle per model: the layout (scheme and heads) and the per-sequence state pool of every
 * layer. The server owns the blocks of each layer (hipkv_cache_bytes() of device memory), its
 * block allocator, its sequence slots, workspace and stream. The per-step calls (write_kv,
 * attend, copy_blocks, fork) take device pointers and a hipStream_t and only queue work on it:
 * no allocation, no copy, no synchronization, so a step can be captured in a HIP graph.
 * hipkv_check() is the one call that waits: it reports the first out-of-range index any kernel
 * met (a skipped token or sequence) since the last check.
 *
 * Every call returns a status; on failure hipkv_last_error() has the message (per thread).
 * Nothing panics or throws across this boundary. The Rust side is hipkv::paged; docs/serving.md
 * has the contract, and tests/c/server_step.c a complete step.
 */
#ifndef HIPKV_H
#define HIPKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An opaque handle: a layout, its state pool and the backend it runs on. */
typedef struct hipkv_cache hipkv_cache;

typedef enum hipkv_status {
    HIPKV_OK = 0,
    /* A null pointer, a shape that disagrees with the layout, an unknown dtype or scheme. */
    HIPKV_ERROR_INVALID_ARGUMENT = 1,
    /* A count or index beyond what the layout or the workspace allows (checked on the host). */
    HIPKV_ERROR_OUT_OF_RANGE = 2,
    HIPKV_ERROR_OUT_OF_MEMORY = 3,
    /* The backend asked for cannot run here (no GPU, no HIP runtime, an arch not built). */
    HIPKV_ERROR_BACKEND_UNAVAILABLE = 4,
    /* hipkv_check(): a kernel met an out-of-range index and skipped its item. */
    HIPKV_ERROR_DEVICE_INDEX = 5,
    /* The HIP runtime failed. */
    HIPKV_ERROR_RUNTIME = 6,
    /* An internal error (a bug in hipkv): caught at the boundary, never unwound through it. */
    HIPKV_ERROR_INTERNAL = 7
} hipkv_status;

typedef enum hipkv_backend {
    /* Host memory, Rust kernels on every core. */
    HIPKV_BACKEND_CPU = 0,
    /* Host memory, the HIP kernels run by hipkv's SIMT emulator (slow; for tests). */
    HIPKV_BACKEND_EMU = 1,
    /* Device memory on the first usable AMD GPU. */
    HIPKV_BACKEND_HIP = 2
} hipkv_backend;

typedef enum hipkv_dtype {
    HIPKV_DTYPE_F16 = 0,
    HIPKV_DTYPE_BF16 = 1,
    HIPKV_DTYPE_F32 = 2
} hipkv_dtype;

/* The layout of a model's cache. */
typedef struct hipkv_layout_desc {
    /* The scheme, as hipkv's CLI spells it: "q8", "kivi2,sinks=4", "k=q4_tok,v=q8_0,g=64". Its
     * g (32 or 64) is the tokens per block. */
    const char *scheme;
    uint32_t kv_heads;
    uint32_t q_heads;
    uint32_t head_dim;
    /* Blocks of one layer's cache. */
    uint32_t num_blocks;
    /* Sequence slots: sequences that may hold state at once. */
    uint32_t max_seqs;
    /* Tokens one sequence may hold. */
    uint32_t max_positions;
    /* RoPE base; 0 for none. Only schemes that store keys before RoPE (pre_rope) use it:
     * queries and other keys arrive rotated. */
    float rope_base;
    /* 1: RoPE rotates pairs (2i, 2i+1); 0: halves (i, i + head_dim/2). */
    uint32_t rope_interleaved;
} hipkv_layout_desc;

/* write_kv: a batch's new keys and values. Device pointers. */
typedef struct hipkv_kv_batch {
    uint32_t tokens;
    hipkv_dtype dtype;
    /* tokens x kv_heads x head_dim each (keys rotated unless the scheme is pre_rope). */
    const void *k;
    const void *v;
    /* tokens: block x block_tokens + position % block_tokens. */
    const int64_t *slot_mapping;
    /* tokens: the sequence slot of each token. */
    const int32_t *seq_slots;
    /* tokens: each token's position; a sequence's tokens are listed in order. */
    const int32_t *positions;
} hipkv_kv_batch;

/* attend: a varlen batch of decode tokens and prefill chunks. Device pointers, host counts. */
typedef struct hipkv_query_batch {
    uint32_t num_seqs;
    /* Query tokens in all (query_start_loc[num_seqs]). */
    uint32_t tokens;
    /* Bounds the device values keep to (checked there); they size the launch. */
    uint32_t max_q_len;
    uint32_t max_seq_len;
    /* Columns of block_tables. */
    uint32_t max_blocks_per_seq;
    hipkv_dtype dtype;
    float softmax_scale;
    /* Sliding window: each query token attends to its own position and the window - 1 before
     * it, and the blocks wholly below are not read (nor their ids checked). 0: every position. */
    uint32_t window;
    /* tokens x q_heads x head_dim, rotated. */
    const void *q;
    /* Same shape and dtype as q. */
    void *out;
    /* num_seqs + 1: sequence s has query tokens query_start_loc[s] .. query_start_loc[s+1],
     * the last of its seq_lens[s] tokens (all written), each attending causally. */
    const int32_t *query_start_loc;
    const int32_t *seq_lens;
    /* num_seqs x max_blocks_per_seq block ids. */
    const int32_t *block_tables;
    const int32_t *seq_slots;
} hipkv_query_batch;

/* The message of this thread's last failed call ("" if none). Valid until its next call. */
const char *hipkv_last_error(void);

hipkv_status hipkv_cache_create(const hipkv_layout_desc *desc, uint32_t layers,
                                hipkv_backend backend, hipkv_cache **out);
void hipkv_cache_destroy(hipkv_cache *cache);

/* Sizes, in bytes unless stated: a block (one layer, every KV head), one layer's cache
 * (num_blocks blocks), one slot's state of one layer, the workspace of an attend call of up to
 * max_tokens query tokens; and the tokens per block. */
size_t hipkv_block_bytes(const hipkv_cache *cache);
size_t hipkv_cache_bytes(const hipkv_cache *cache);
size_t hipkv_state_bytes(const hipkv_cache *cache);
size_t hipkv_workspace_bytes(const hipkv_cache *cache, uint32_t max_tokens);
uint32_t hipkv_block_tokens(const hipkv_cache *cache);

/* Setup: a layer's outlier thresholds (kv_heads x head_dim lo and hi each, host memory;
 * v_lo/v_hi null unless the scheme stores value outliers). */
hipkv_status hipkv_set_outlier_thresholds(hipkv_cache *cache, uint32_t layer, const float *k_lo,
                                          const float *k_hi, const float *v_lo,
                                          const float *v_hi);

/* Setup: a layer's codebooks (nuq schemes; host memory): for each stream the scheme's nuq
 * names, 2^bits strictly increasing levels within [0, 2^bits - 1] (bits: the stream's code
 * width), a code decoding to min + scale * levels[code]; null for the other streams. */
hipkv_status hipkv_set_codebooks(hipkv_cache *cache, uint32_t layer, const float *k_levels,
                                 const float *v_levels);

/* Setup: every layer's outlier thresholds and codebooks from the text of a calibration file
 * (written by `hipkv calibrate`) made for this cache's scheme and shape. Everything is checked
 * before anything is set. */
hipkv_status hipkv_apply_calibration(hipkv_cache *cache, const char *text);

/* Memory of the handle's backend (device memory on HIP), zeroed; freed with hipkv_free or
 * with the handle. Setup-time calls: they allocate, copy and wait. */
hipkv_status hipkv_alloc(hipkv_cache *cache, size_t bytes, void **out);
void hipkv_free(hipkv_cache *cache, void *memory);
hipkv_status hipkv_upload(hipkv_cache *cache, void *memory, size_t offset, const void *src,
                          size_t bytes);
hipkv_status hipkv_download(hipkv_cache *cache, const void *memory, size_t offset, void *dst,
                            size_t bytes);

/* The per-step calls: they queue work on stream (a hipStream_t; null is the default stream;
 * ignored by CPU and EMU, whose calls are done when they return). */
hipkv_status hipkv_write_kv(hipkv_cache *cache, uint32_t layer, void *layer_cache,
                            const hipkv_kv_batch *batch, void *stream);
hipkv_status hipkv_attend(hipkv_cache *cache, uint32_t layer, const void *layer_cache,
                          const hipkv_query_batch *batch, void *workspace,
                          uint32_t workspace_max_tokens, void *stream);
/* pairs: n (source, destination) block ids, device memory. */
hipkv_status hipkv_copy_blocks(hipkv_cache *cache, void *layer_cache, const int32_t *pairs,
                               uint32_t n, void *stream);
/* The state of sequence slot src, every layer's, copied to slot dst. */
hipkv_status hipkv_fork(hipkv_cache *cache, uint32_t src_slot, uint32_t dst_slot, void *stream);
/* Waits for stream; HIPKV_ERROR_DEVICE_INDEX (and the message) if a kernel skipped an item. */
hipkv_status hipkv_check(hipkv_cache *cache, void *stream);

#ifdef __cplusplus
}
#endif

#endif

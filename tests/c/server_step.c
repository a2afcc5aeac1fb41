/*
 * A C server's step through hipkv's C ABI, compiled and linked against the static library by
 * tests/capi.rs: a batch that prefills one sequence and decodes another, written and attended
 * with f16 inputs and outputs, on the emulated device (the HIP kernels' own code) and on the
 * CPU backend. Checked against a naive attention (scheme f16, exact up to f16 rounding) and
 * the emulated device against the CPU (kivi2 with sinks, and kivi2 with codebooks: set from a
 * calibration text on one, level by level on the other); then a bad block id comes back from
 * hipkv_check as HIPKV_ERROR_DEVICE_INDEX with its message, and the handle still serves.
 */
#include "hipkv.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        hipkv_status status_ = (call);                                                   \
        if (status_ != HIPKV_OK) {                                                       \
            fprintf(stderr, "%s:%d: %s: status %d: %s\n", __FILE__, __LINE__, #call,     \
                    (int)status_, hipkv_last_error());                                   \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

enum { KV_HEADS = 2, Q_HEADS = 8, HEAD_DIM = 64, NUM_BLOCKS = 16, MAX_SEQS = 4 };
enum { A_LEN = 40, B_LEN = 9, TOKENS = A_LEN + B_LEN, Q_TOKENS = A_LEN + 1 };
#define KV_ROW (KV_HEADS * HEAD_DIM)
#define Q_ROW (Q_HEADS * HEAD_DIM)

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float uniform(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static uint16_t to_f16(float x) {
    _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}
static float from_f16(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}

/* The step's inputs, on the host. */
static uint16_t k[TOKENS * KV_ROW], v[TOKENS * KV_ROW], q[Q_TOKENS * Q_ROW];
/* Sequence A (slot 2): positions 0..39 in blocks 5, 3. B (slot 0): positions 0..8 in block 7. */
static const int32_t A_BLOCKS[2] = {5, 3}, B_BLOCKS[1] = {7};

static void *upload(hipkv_cache *c, const void *host, size_t bytes) {
    void *mem;
    CHECK(hipkv_alloc(c, bytes, &mem));
    CHECK(hipkv_upload(c, mem, 0, host, bytes));
    return mem;
}

/* Codebooks of a kivi2,nuq cache, as levels and as the calibration file `hipkv calibrate`
 * writes. */
static const float K_LEVELS[4] = {0.0f, 0.75f, 2.25f, 3.0f}, V_LEVELS[4] = {0.25f, 1.0f, 2.0f, 2.75f};
static const char *NUQ_CALIBRATION = "hipkv-calibration 1\n"
                                     "scheme kivi2,nuq\n"
                                     "shape layers=1 kv_heads=2 head_dim=64\n"
                                     "layer 0 k_levels 0 0.75 2.25 3\n"
                                     "layer 0 v_levels 0.25 1 2 2.75\n";

/* A nuq cache's codebooks: from the calibration text on the emulated device, level by level on
 * the CPU, after checking that bad ones are refused. */
static void set_codebooks(hipkv_cache *c, hipkv_backend backend) {
    const float unordered[4] = {0.0f, 2.0f, 1.0f, 3.0f};
    if (hipkv_set_codebooks(c, 0, unordered, V_LEVELS) != HIPKV_ERROR_INVALID_ARGUMENT ||
        hipkv_apply_calibration(c, "hipkv-calibration 1\nscheme kivi4,nuq\n") !=
            HIPKV_ERROR_INVALID_ARGUMENT) {
        fprintf(stderr, "bad codebooks were not refused: %s\n", hipkv_last_error());
        exit(1);
    }
    if (backend == HIPKV_BACKEND_EMU)
        CHECK(hipkv_apply_calibration(c, NUQ_CALIBRATION));
    else
        CHECK(hipkv_set_codebooks(c, 0, K_LEVELS, V_LEVELS));
}

/* Runs the step on `backend` and returns the attention output (Q_TOKENS × Q_ROW floats). */
static void step(hipkv_backend backend, const char *scheme, uint32_t window, float *out) {
    hipkv_layout_desc desc = {scheme, KV_HEADS, Q_HEADS, HEAD_DIM, NUM_BLOCKS, MAX_SEQS, 256,
                              0.0f, 1};
    hipkv_cache *c;
    CHECK(hipkv_cache_create(&desc, 1, backend, &c));
    if (strstr(scheme, "nuq")) set_codebooks(c, backend);
    const uint32_t bt = hipkv_block_tokens(c);
    void *layer;
    CHECK(hipkv_alloc(c, hipkv_cache_bytes(c), &layer));
    void *workspace;
    CHECK(hipkv_alloc(c, hipkv_workspace_bytes(c, Q_TOKENS), &workspace));

    /* write_kv: A's 40 tokens, then B's 9, in one batch. */
    int64_t slots[TOKENS];
    int32_t seqs[TOKENS], positions[TOKENS];
    for (int t = 0; t < TOKENS; ++t) {
        const int a = t < A_LEN, p = a ? t : t - A_LEN;
        const int32_t block = a ? A_BLOCKS[p / bt] : B_BLOCKS[p / bt];
        slots[t] = (int64_t)block * bt + p % bt;
        seqs[t] = a ? 2 : 0;
        positions[t] = p;
    }
    hipkv_kv_batch kv = {TOKENS,
                         HIPKV_DTYPE_F16,
                         upload(c, k, sizeof k),
                         upload(c, v, sizeof v),
                         upload(c, slots, sizeof slots),
                         upload(c, seqs, sizeof seqs),
                         upload(c, positions, sizeof positions)};
    CHECK(hipkv_write_kv(c, 0, layer, &kv, NULL));

    /* attend: A's 40 tokens as a prefill chunk, B's last token as a decode. */
    const int32_t starts[3] = {0, A_LEN, A_LEN + 1}, lens[2] = {A_LEN, B_LEN};
    int32_t tables[2 * 2] = {A_BLOCKS[0], A_BLOCKS[1], B_BLOCKS[0], 0};
    const int32_t seq_slots[2] = {2, 0};
    void *out_mem = upload(c, q, sizeof q); /* room for the output, as big as q */
    hipkv_query_batch qb = {2,
                            Q_TOKENS,
                            A_LEN,
                            A_LEN,
                            2,
                            HIPKV_DTYPE_F16,
                            0.125f,
                            window, /* 0: no sliding window */
                            upload(c, q, sizeof q),
                            out_mem,
                            upload(c, starts, sizeof starts),
                            upload(c, lens, sizeof lens),
                            upload(c, tables, sizeof tables),
                            upload(c, seq_slots, sizeof seq_slots)};
    CHECK(hipkv_attend(c, 0, layer, &qb, workspace, Q_TOKENS, NULL));
    CHECK(hipkv_check(c, NULL));
    static uint16_t out16[Q_TOKENS * Q_ROW];
    CHECK(hipkv_download(c, out_mem, 0, out16, sizeof out16));
    for (int i = 0; i < Q_TOKENS * Q_ROW; ++i) out[i] = from_f16(out16[i]);

    /* A bad block id in B's table: B is skipped, the error comes back from hipkv_check. */
    tables[2] = 999;
    CHECK(hipkv_upload(c, (void *)qb.block_tables, 0, tables, sizeof tables));
    CHECK(hipkv_attend(c, 0, layer, &qb, workspace, Q_TOKENS, NULL));
    hipkv_status s = hipkv_check(c, NULL);
    if (s != HIPKV_ERROR_DEVICE_INDEX || !strstr(hipkv_last_error(), "block id 999")) {
        fprintf(stderr, "expected a device index error, got %d: %s\n", (int)s, hipkv_last_error());
        exit(1);
    }
    /* Bad arguments are refused with a status and a message, not a crash. */
    if (hipkv_attend(c, 0, layer, NULL, workspace, Q_TOKENS, NULL) != HIPKV_ERROR_INVALID_ARGUMENT ||
        hipkv_fork(c, 0, MAX_SEQS, NULL) != HIPKV_ERROR_OUT_OF_RANGE) {
        fprintf(stderr, "bad arguments were not refused: %s\n", hipkv_last_error());
        exit(1);
    }
    CHECK(hipkv_fork(c, 2, 3, NULL));
    CHECK(hipkv_check(c, NULL));
    hipkv_cache_destroy(c);
}

/* Naive causal attention over the (f16) inputs: query row t of sequence (`first`, `len`),
 * within a sliding window of `window` positions (0: none). */
static void reference(int window, float *want) {
    for (int t = 0; t < Q_TOKENS; ++t) {
        const int a = t < A_LEN, first = a ? 0 : A_LEN, pos = a ? t : B_LEN - 1;
        const int lo = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        for (int h = 0; h < Q_HEADS; ++h) {
            const int kh = h / (Q_HEADS / KV_HEADS);
            double w[A_LEN], m = -INFINITY, sum = 0.0;
            for (int p = lo; p <= pos; ++p) {
                double dot = 0.0;
                for (int c = 0; c < HEAD_DIM; ++c)
                    dot += (double)from_f16(q[t * Q_ROW + h * HEAD_DIM + c]) *
                           from_f16(k[(first + p) * KV_ROW + kh * HEAD_DIM + c]);
                w[p] = 0.125 * dot;
                if (w[p] > m) m = w[p];
            }
            for (int p = lo; p <= pos; ++p) sum += (w[p] = exp(w[p] - m));
            for (int c = 0; c < HEAD_DIM; ++c) {
                double acc = 0.0;
                for (int p = lo; p <= pos; ++p)
                    acc += w[p] * from_f16(v[(first + p) * KV_ROW + kh * HEAD_DIM + c]);
                want[t * Q_ROW + h * HEAD_DIM + c] = (float)(acc / sum);
            }
        }
    }
}

/* Largest difference per head row, relative to the row's largest element. */
static float rows_err(const float *got, const float *want) {
    float worst = 0.0f;
    for (int r = 0; r < Q_TOKENS * Q_HEADS; ++r) {
        float scale = 1e-30f, diff = 0.0f;
        for (int c = 0; c < HEAD_DIM; ++c) {
            scale = fmaxf(scale, fabsf(want[r * HEAD_DIM + c]));
            diff = fmaxf(diff, fabsf(got[r * HEAD_DIM + c] - want[r * HEAD_DIM + c]));
        }
        worst = fmaxf(worst, diff / scale);
    }
    return worst;
}

int main(void) {
    for (int i = 0; i < TOKENS * KV_ROW; ++i) {
        k[i] = to_f16(uniform() * 2.0f);
        v[i] = to_f16(uniform());
    }
    for (int i = 0; i < Q_TOKENS * Q_ROW; ++i) q[i] = to_f16(uniform());
    static float want[Q_TOKENS * Q_ROW], emu[Q_TOKENS * Q_ROW], cpu[Q_TOKENS * Q_ROW];
    reference(0, want);
    step(HIPKV_BACKEND_EMU, "f16", 0, emu);
    step(HIPKV_BACKEND_CPU, "f16", 0, cpu);
    const float e_emu = rows_err(emu, want), e_cpu = rows_err(cpu, want);
    step(HIPKV_BACKEND_EMU, "kivi2,sinks=4", 0, emu);
    step(HIPKV_BACKEND_CPU, "kivi2,sinks=4", 0, cpu);
    const float e_kivi = rows_err(emu, cpu);
    step(HIPKV_BACKEND_EMU, "kivi2,nuq", 0, emu);
    step(HIPKV_BACKEND_CPU, "kivi2,nuq", 0, cpu);
    const float e_nuq = rows_err(emu, cpu);
    /* A sliding window of 7 positions, through the C struct's field. */
    reference(7, want);
    step(HIPKV_BACKEND_EMU, "f16", 7, emu);
    step(HIPKV_BACKEND_CPU, "f16", 7, cpu);
    const float e_window = fmaxf(rows_err(emu, want), rows_err(cpu, want));
    printf("server_step: f16 vs reference: emu %.2e cpu %.2e; emu vs cpu: kivi2 %.2e, "
           "kivi2,nuq %.2e; window 7 %.2e\n",
           e_emu, e_cpu, e_kivi, e_nuq, e_window);
    /* f16 outputs: within their own rounding (2^-11) and the kernels' 1e-5. */
    if (e_emu > 2e-3f || e_cpu > 2e-3f || e_kivi > 2e-3f || e_nuq > 2e-3f || e_window > 2e-3f) {
        fprintf(stderr, "server_step: outputs out of tolerance\n");
        return 1;
    }
    printf("server_step: ok\n");
    return 0;
}

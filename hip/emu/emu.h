// The SIMT emulator: runs hipkv's HIP kernel sources on the CPU so that tests can check the
// kernels' own code against the Rust reference on machines without a GPU.
//
// Work-items are fibers (a few instructions to switch, see emu.cpp); a workgroup's fibers run on
// one OS thread, so `__shared__` (a function-local `thread_local static`) is per workgroup and
// workgroups may run in parallel on other threads. `__syncthreads` suspends the work-item until
// every work-item of the workgroup reaches a barrier; lane exchanges (`shfl_xor`) suspend it until
// the 32 lanes of its wave arrive, which is the lockstep a wave32 executes in. A work-item that
// exits, or waits at a different kind of synchronization, while others wait is an error reported
// to the launcher (divergence), never a hang.
#ifndef HIPKV_EMU_H
#define HIPKV_EMU_H

#include <math.h>
#include <stdint.h>

struct dim3 {
    uint32_t x, y, z;
};

namespace hipkv_emu {

// The work-item the current OS thread is running.
struct WorkItem {
    dim3 thread_idx;
};
struct Workgroup {
    dim3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

extern thread_local WorkItem *current_item;
extern thread_local Workgroup *current_group;

// Suspends the current work-item at a workgroup barrier.
void barrier();
// Lockstep exchange within the wave: returns `x` of lane `lane ^ mask`.
float shfl_xor(float x, int mask);

// The memory trace (a launch given a `hipkv_emu_trace`): every global load the kernels make
// through the load helpers of hipkv_device.h is recorded with its address and width. Loads are
// grouped into the wave-level instructions a GPU would issue by wave, by the lane-exchange
// epoch (lanes meet at every exchange and barrier, so their epochs agree), by call site (the
// helpers are inlined, so a site is an instruction address of the emulator's code) and by
// occurrence within the epoch: exact for code the lanes run alike, approximate in loops whose
// trip counts differ between lanes (outlier corrections).
struct LoadTracer;
extern thread_local LoadTracer *load_tracer;
__attribute__((noinline)) void record_load(const void *p, uint32_t bytes);
inline __attribute__((always_inline)) void note_load(const void *p, uint32_t bytes) {
    if (load_tracer != nullptr) record_load(p, bytes);
}

// A kernel as the launcher sees it: the entry point takes the params struct by pointer.
typedef void (*Entry)(const void *params);
struct Registrar {
    Registrar(const char *name, Entry entry, uint32_t params_size);
};

}  // namespace hipkv_emu

extern "C" {
// What a traced launch loaded from one region of memory (or from everywhere else).
typedef struct hipkv_emu_load_counts {
    uint64_t lane_loads;    // loads by single work-items
    uint64_t wave_loads;    // wave-level load instructions (the lanes' loads grouped)
    uint64_t bytes;         // bytes requested, summed over work-items
    uint64_t line_reads;    // distinct 128-byte lines per wave-level load, summed
    uint64_t lines;         // distinct 128-byte lines over the launch
    uint64_t unique_bytes;  // distinct bytes over the launch
    // The most distinct lines one wave loads between two of its lane exchanges or barriers:
    // what its caches must hold for its loads to reuse lines (a wave's working set).
    uint64_t span_lines;
} hipkv_emu_load_counts;

// A launch's trace request: regions [begin, end) as `2 · num_regions` addresses, and where to
// write the counts, one per region and a last one for every other address.
typedef struct hipkv_emu_trace {
    const uint64_t *regions;
    uint32_t num_regions;
    hipkv_emu_load_counts *counts;
} hipkv_emu_trace;
}

#define threadIdx (hipkv_emu::current_item->thread_idx)
#define blockIdx (hipkv_emu::current_group->block_idx)
#define blockDim (hipkv_emu::current_group->block_dim)
#define gridDim (hipkv_emu::current_group->grid_dim)
#define __syncthreads() hipkv_emu::barrier()
#define __shared__ static thread_local
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)

// Defines kernel NAME(PARAMS p) { BODY } for the GPU and registers it with the emulator.
#define HIPKV_KERNEL(NAME, PARAMS)                                                    \
    static void NAME(PARAMS p);                                                       \
    static void NAME##_emu_entry(const void *params) {                                \
        NAME(*static_cast<const PARAMS *>(params));                                   \
    }                                                                                 \
    static hipkv_emu::Registrar NAME##_emu_registrar(#NAME, NAME##_emu_entry,         \
                                                     (uint32_t)sizeof(PARAMS));       \
    static void NAME(PARAMS p)

// Each emulated kernel source defines an anchor named after its unit (build.rs passes
// HIPKV_EMU_UNIT, such as attention_d64), which the Rust side refers to: a program that links
// the static library pulls only the objects something refers to, and the kernels register
// themselves from static initializers nothing else refers to.
#define HIPKV_EMU_CAT2(a, b) a##b
#define HIPKV_EMU_CAT(a, b) HIPKV_EMU_CAT2(a, b)
#ifdef HIPKV_EMU_UNIT
extern "C" void HIPKV_EMU_CAT(hipkv_emu_unit_, HIPKV_EMU_UNIT)(void) {}
#endif

#endif

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

// A kernel as the launcher sees it: the entry point takes the params struct by pointer.
typedef void (*Entry)(const void *params);
struct Registrar {
    Registrar(const char *name, Entry entry, uint32_t params_size);
};

}  // namespace hipkv_emu

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

// Portability layer of the hipkv kernels. The kernels are written once against these names and
// compile three ways:
//   - HIP for AMD GPUs (clang -x hip, __HIP_DEVICE_COMPILE__ or __HIPCC__): wave32 intrinsics;
//   - the host SIMT emulator (HIPKV_EMU, hip/emu/emu.h): work-items as fibers;
//   - CUDA (__CUDACC__), where a warp is the same 32 lanes as an RDNA wave32.
// Plain host C++ (neither of the above) gets the __host__ __device__ helpers only, for the
// formats agreement test.
#ifndef HIPKV_DEVICE_H
#define HIPKV_DEVICE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hipkv_abi.h"

#if defined(HIPKV_EMU)
#include "../emu/emu.h"
#define HIPKV_HD inline
#define HIPKV_DEV inline
#define HIPKV_ATTN_KERNEL HIPKV_KERNEL
#elif defined(__HIPCC__) || defined(__HIP__)
#include <hip/hip_runtime.h>
#define HIPKV_HD __host__ __device__ __forceinline__
#define HIPKV_DEV __device__ __forceinline__
// A kernel entry point taking its params struct by value (hipModuleLaunchKernel passes it).
// The register allocator is asked for 8 waves per SIMD (≤ 192 VGPRs in wave32 on gfx12): the
// decode kernels are memory-bound and need the waves in flight to hide DRAM latency.
#define HIPKV_KERNEL(NAME, PARAMS)                                            \
    extern "C" __global__ __launch_bounds__(HIPKV_THREADS)                   \
        __attribute__((amdgpu_waves_per_eu(8))) void NAME(PARAMS p)
// An attention entry point: workgroups of up to HIPKV_MAX_WAVES waves.
#define HIPKV_ATTN_KERNEL(NAME, PARAMS)                                                   \
    extern "C" __global__ __launch_bounds__(HIPKV_WAVE * HIPKV_MAX_WAVES)                \
        __attribute__((amdgpu_waves_per_eu(8))) void NAME(PARAMS p)
#elif defined(__CUDACC__)
#include <cuda_fp16.h>
#define HIPKV_HD __host__ __device__ __forceinline__
#define HIPKV_DEV __device__ __forceinline__
#define HIPKV_KERNEL(NAME, PARAMS) \
    extern "C" __global__ __launch_bounds__(HIPKV_THREADS) void NAME(PARAMS p)
#define HIPKV_ATTN_KERNEL(NAME, PARAMS) \
    extern "C" __global__ __launch_bounds__(HIPKV_WAVE * HIPKV_MAX_WAVES) void NAME(PARAMS p)
#else
#define HIPKV_HD inline
#endif

// The load helpers (`load16`, `read_global`, …): inlined at every call site in the emulator
// too, since a call site is what its memory trace groups the lanes' loads by; and the trace's
// record of one load (emu.h), which compiles to nothing on a GPU.
#if defined(HIPKV_EMU)
#define HIPKV_LOAD_HD inline __attribute__((always_inline))
#define HIPKV_LOAD_DEV inline __attribute__((always_inline))
#define HIPKV_TRACE_LOAD(p, bytes) hipkv_emu::note_load((p), (bytes))
#else
#define HIPKV_LOAD_HD HIPKV_HD
#define HIPKV_LOAD_DEV HIPKV_DEV
#define HIPKV_TRACE_LOAD(p, bytes) ((void)0)
#endif

// Keeps a loop rolled: the row loops inside are unrolled (their state lives in registers), and
// unrolling the channel and token loops around them too would multiply code size and compile
// time for nothing on a memory-bound kernel.
// The token loop of the values stays rolled in the issue model's probes too (attention.hip's
// `probe_block`), whose other loops are unrolled so that each instruction executes once.
#if defined(__clang__) || defined(__CUDA_ARCH__)
#define HIPKV_ROLLED_TOKENS _Pragma("unroll 1")
#if defined(HIPKV_PROBE)
#define HIPKV_ROLLED _Pragma("unroll")
#else
#define HIPKV_ROLLED _Pragma("unroll 1")
#endif
#else
#define HIPKV_ROLLED _Pragma("GCC unroll 1")
#define HIPKV_ROLLED_TOKENS HIPKV_ROLLED
#endif

// Unrolls a loop of independent loads N times, so that N of them are in flight at once.
#define HIPKV_PRAGMA(x) _Pragma(#x)
#if defined(__clang__) || defined(__CUDA_ARCH__)
#define HIPKV_UNROLL(N) HIPKV_PRAGMA(unroll N)
#else
#define HIPKV_UNROLL(N) HIPKV_PRAGMA(GCC unroll N)
#endif

namespace hipkv {

// An f32's bit pattern, and back (through a union, which every compiler here allows).
HIPKV_HD uint32_t float_bits(float f) {
    union {
        float f;
        uint32_t u;
    } v;
    v.f = f;
    return v.u;
}
HIPKV_HD float bits_float(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = u;
    return v.f;
}

// IEEE binary16 bits to float, exact for every input (subnormals, infinities, NaN).
HIPKV_HD float half_to_float(uint16_t h) {
#if defined(__HIP_DEVICE_COMPILE__)
    return (float)__builtin_bit_cast(_Float16, h);
#elif defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: value = man · 2^-24, normalized by hand.
        uint32_t e = 113;
        uint32_t m = man;
        while ((m & 0x400u) == 0) {
            m <<= 1;
            --e;
        }
        bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
    return bits_float(bits);
#endif
}

// bfloat16 bits to float (exact: bf16 is the upper half of an f32).
HIPKV_HD float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

// Float to bfloat16 bits, rounded to nearest with ties to even; NaN stays a quiet NaN.
HIPKV_HD uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    const uint32_t round = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + round) >> 16);
}

// `acc` plus the dot product of the four signed bytes of `a` with those of `b`, exact in 32 bits
// (the integer-query key scores): one v_dot4_i32_iu8 on gfx11 and gfx12, dp4a on CUDA.
HIPKV_HD int32_t dot4_i8(uint32_t a, uint32_t b, int32_t acc) {
#if defined(__HIP_DEVICE_COMPILE__) && (defined(__GFX11__) || defined(__GFX12__))
    return __builtin_amdgcn_sudot4(true, (int)a, true, (int)b, acc, false);
#elif defined(__CUDA_ARCH__)
    return __dp4a((int)a, (int)b, acc);
#else
    for (int i = 0; i < 4; ++i) acc += (int32_t)(int8_t)(a >> (8 * i)) * (int8_t)(b >> (8 * i));
    return acc;
#endif
}

// 16 bytes of a row as four little-endian words (see `load16`).
struct alignas(16) Bytes16 {
    uint32_t w[4];
};

// `*p` from global memory, in whatever width the compiler gives it (query rows, parameters,
// single codes): the same code as `*p` on a GPU, and one load in the emulator's trace.
template <class T>
HIPKV_LOAD_HD T read_global(const T *p) {
    HIPKV_TRACE_LOAD(p, sizeof(T));
    return *p;
}

// Float to IEEE binary16 bits, rounded to nearest with ties to even (as the `half` crate and
// the GPU's conversion round): overflow gives infinity, NaN stays a (quiet) NaN.
HIPKV_HD uint16_t float_to_half(float f) {
#if defined(__HIP_DEVICE_COMPILE__)
    return __builtin_bit_cast(uint16_t, (_Float16)f);
#elif defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(f));
#else
    const uint32_t u = float_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
    // 65520 and above round to infinity (65504 is the largest finite half).
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    uint32_t kept, rest, halfway;
    if (mag >= 0x38800000u) {
        // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits.
        const uint32_t r = mag - 0x38000000u;
        kept = r >> 13;
        rest = r & 0x1fffu;
        halfway = 0x1000u;
    } else if (mag >= 0x33000000u) {
        // Subnormal half: the value in units of 2^-24, from the full 24-bit significand.
        const uint32_t shift = 126u - (mag >> 23);
        const uint32_t m = (mag & 0x7fffffu) | 0x800000u;
        kept = m >> shift;
        rest = m & ((1u << shift) - 1u);
        halfway = 1u << (shift - 1u);
    } else {
        return sign;  // below half the smallest subnormal (2^-25 itself ties to even, 0)
    }
    // A carry out of the mantissa moves to the next binade (or to infinity), as it should.
    if (rest > halfway || (rest == halfway && (kept & 1u))) ++kept;
    return (uint16_t)(sign | kept);
#endif
}

}  // namespace hipkv

#if defined(HIPKV_EMU) || defined(__HIPCC__) || defined(__HIP__) || defined(__CUDACC__)

namespace hipkv {

// Lane index within the wave (wave32 on gfx1201; a warp on CUDA).
HIPKV_DEV uint32_t lane_id() { return threadIdx.x % HIPKV_WAVE; }
HIPKV_DEV uint32_t wave_id() { return threadIdx.x / HIPKV_WAVE; }

// The value of `x` in lane `lane ^ mask`; every lane of the wave must take part.
HIPKV_DEV float shfl_xor(float x, int mask) {
#if defined(HIPKV_EMU)
    return hipkv_emu::shfl_xor(x, mask);
#elif defined(__CUDACC__)
    return __shfl_xor_sync(0xffffffffu, x, mask, HIPKV_WAVE);
#else
    return __shfl_xor(x, mask, HIPKV_WAVE);
#endif
}

// `x`, known to be equal in every lane, as a wave-uniform value: the compiler keeps it in one
// scalar register instead of a vector register of 32 copies.
HIPKV_DEV float uniform(float x) {
#if defined(__HIP_DEVICE_COMPILE__)
    return __builtin_bit_cast(float, __builtin_amdgcn_readfirstlane(__builtin_bit_cast(int, x)));
#else
    return x;
#endif
}

HIPKV_DEV uint32_t uniform_u32(uint32_t x) {
#if defined(__HIP_DEVICE_COMPILE__)
    return (uint32_t)__builtin_amdgcn_readfirstlane((int)x);
#else
    return x;
#endif
}

// The maximum of `x` over each aligned group of W lanes, as unsigned integers (W a power of two
// up to the wave; every lane takes part).
template <int W>
HIPKV_DEV uint32_t group_max_u32(uint32_t x) {
    for (int m = W / 2; m > 0; m /= 2) {
        const uint32_t y = float_bits(shfl_xor(bits_float(x), m));
        x = x > y ? x : y;
    }
    return x;
}

// The sum of `x` over each aligned group of W lanes (W a power of two up to the wave).
template <int W>
HIPKV_DEV float group_sum(float x) {
    for (int m = W / 2; m > 0; m /= 2) x += shfl_xor(x, m);
    return x;
}

// The maximum of `x` over each aligned group of W lanes (W a power of two up to the wave).
template <int W>
HIPKV_DEV float group_max(float x) {
    for (int m = W / 2; m > 0; m /= 2) x = fmaxf(x, shfl_xor(x, m));
    return x;
}

HIPKV_DEV float wave_max(float x) { return group_max<HIPKV_WAVE>(x); }
HIPKV_DEV float wave_sum(float x) { return group_sum<HIPKV_WAVE>(x); }

// 2^x; exact enough for softmax weights (1 ulp on the GPU's v_exp_f32).
HIPKV_DEV float exp2(float x) {
#if defined(__HIP_DEVICE_COMPILE__)
    return __builtin_amdgcn_exp2f(x);
#else
    return exp2f(x);
#endif
}

// `p`, with its uniformity hidden from the compiler so that loads through it are per-lane
// (vector) loads of one address, which the cache broadcasts. Query rows loaded as uniform
// (scalar) data would take dozens of SGPRs per channel chunk and spill.
template <class T>
HIPKV_DEV const T *vector_ptr(const T *p) {
#if defined(__HIP_DEVICE_COMPILE__)
    uintptr_t v = reinterpret_cast<uintptr_t>(p);
    asm volatile("" : "+v"(v));
    return reinterpret_cast<const T *>(v);
#else
    return p;
#endif
}

// `x` in a vector register, its uniformity hidden from the compiler: for a value a loop tests
// now and then, where a scalar register held through the loop would cost one the loop needs.
HIPKV_DEV uint32_t vector_u32(uint32_t x) {
#if defined(__HIP_DEVICE_COMPILE__)
    asm volatile("" : "+v"(x));
#endif
    return x;
}

// Workgroup barrier: every work-item of the workgroup must reach the same one.
HIPKV_DEV void barrier() { __syncthreads(); }

// Wave barrier: the lanes of this wave only. A wave executes in lockstep, so this orders its
// LDS writes before its later LDS reads (waves of a workgroup that never meet need nothing
// more); the emulator makes the 32 lanes meet here.
HIPKV_DEV void wave_sync() {
#if defined(HIPKV_EMU)
    (void)hipkv_emu::shfl_xor(0.0f, 0);
#elif defined(__CUDACC__)
    __syncwarp();
#else
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#endif
}

// Orders this work-item's global memory writes before its later ones as the rest of the
// workgroup sees them (then `barrier` to let it read them).
HIPKV_DEV void fence_workgroup() {
#if defined(HIPKV_EMU)
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#else
    __threadfence_block();
#endif
}

// `*p = desired` if it held `expected`, atomically on device memory; returns what it held.
HIPKV_DEV uint32_t atomic_cas(uint32_t *p, uint32_t expected, uint32_t desired) {
#if defined(HIPKV_EMU)
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
    return expected;
#else
    return atomicCAS(p, expected, desired);
#endif
}

// Records an out-of-range index a server passed in the sticky error word, unless an earlier
// one is there: the first wins, and a check call reads it.
HIPKV_DEV void report_bad_index(hipkv_device_error *e, uint32_t what, uint32_t kernel,
                                uint32_t item, int64_t index, int64_t limit) {
    if (atomic_cas(&e->what, 0u, what) != 0u) return;
    e->kernel = kernel;
    e->item = item;
    e->index = index;
    e->limit = limit;
}

// `*p += x` as one atomic operation on device memory (other workgroups may add at once).
HIPKV_DEV void atomic_add(uint64_t *p, uint64_t x) {
#if defined(HIPKV_EMU)
    __atomic_fetch_add(p, x, __ATOMIC_RELAXED);
#else
    atomicAdd(reinterpret_cast<unsigned long long *>(p), (unsigned long long)x);
#endif
}

// 16 bytes of global memory, 16-aligned, in one load: `global_load_b128` on gfx1201 (the
// address space is stated: a generic pointer would give a flat load, which also waits on the
// LDS counter). The emulator copies, since host buffers promise no alignment.
HIPKV_LOAD_DEV Bytes16 load16(const uint8_t *p) {
    HIPKV_TRACE_LOAD(p, 16);
#if defined(__HIP_DEVICE_COMPILE__)
    typedef uint32_t U32x4 __attribute__((ext_vector_type(4)));
    const U32x4 v = *(const __attribute__((address_space(1))) U32x4 *)p;
    return Bytes16{{v.x, v.y, v.z, v.w}};
#elif defined(__CUDA_ARCH__)
    return *reinterpret_cast<const Bytes16 *>(p);
#else
    Bytes16 b;
    memcpy(&b, p, sizeof b);
    return b;
#endif
}

// 4 bytes of global memory, 4-aligned, in one load (`global_load_b32`).
HIPKV_LOAD_DEV uint32_t load4(const uint8_t *p) {
    HIPKV_TRACE_LOAD(p, 4);
#if defined(__HIP_DEVICE_COMPILE__)
    return *(const __attribute__((address_space(1))) uint32_t *)p;
#else
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
#endif
}

// 2 bytes of global memory, 2-aligned, in one load (`global_load_u16`).
HIPKV_LOAD_DEV uint32_t load2(const uint8_t *p) {
    HIPKV_TRACE_LOAD(p, 2);
#if defined(__HIP_DEVICE_COMPILE__)
    return *(const __attribute__((address_space(1))) uint16_t *)p;
#else
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
#endif
}

// 8 bytes of global memory, 8-aligned, in one load (`global_load_b64`), as the first half of a
// Bytes16 (the second half zero).
HIPKV_LOAD_DEV Bytes16 load8(const uint8_t *p) {
    HIPKV_TRACE_LOAD(p, 8);
#if defined(__HIP_DEVICE_COMPILE__)
    typedef uint32_t U32x2 __attribute__((ext_vector_type(2)));
    const U32x2 v = *(const __attribute__((address_space(1))) U32x2 *)p;
    return Bytes16{{v.x, v.y, 0u, 0u}};
#else
    Bytes16 b{{0u, 0u, 0u, 0u}};
    memcpy(&b, p, 8);
    return b;
#endif
}

}  // namespace hipkv

#endif
#endif

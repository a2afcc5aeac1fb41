// Kernels with known resource usage, compiled by scripts/make-codeobj-fixture.sh into
// codeobj-fixture.gfx1201.hsaco, the code object the parser tests of src/codeobj.rs read.
// Register usage is set with inline-asm clobbers: clobbering vN makes a kernel use N + 1 VGPRs.

#include <hip/hip_runtime.h>

// "p0", "p1", ..., "p9" (with p = v1: "v10" ... "v19").
#define TEN(p) #p "0", #p "1", #p "2", #p "3", #p "4", #p "5", #p "6", #p "7", #p "8", #p "9"

// VGPR pressure around the occupancy steps of gfx1201 wave32 (1536 VGPRs, granule 24).
extern "C" __global__ __launch_bounds__(32) void fx_v24(float *p) {
    asm volatile("" ::: "v23");
    p[threadIdx.x] = 1.0f;
}
extern "C" __global__ __launch_bounds__(32) void fx_v97(float *p) {
    asm volatile("" ::: "v96");
    p[threadIdx.x] = 1.0f;
}
extern "C" __global__ __launch_bounds__(64) void fx_v169(float *p) {
    asm volatile("" ::: "v168");
    p[threadIdx.x] = 1.0f;
}
extern "C" __global__ __launch_bounds__(32) void fx_v256(float *p) {
    asm volatile("" ::: "v255");
    p[threadIdx.x] = 1.0f;
}

// LDS: 16 KiB for a one-wave workgroup, 20000 bytes for a 256-thread workgroup.
extern "C" __global__ __launch_bounds__(32) void fx_lds16k_wg32(float *p) {
    __shared__ float s[4096];
    s[threadIdx.x * 128] = p[threadIdx.x];
    __syncthreads();
    p[threadIdx.x] = s[(threadIdx.x * 7 + 1) % 4096];
}
extern "C" __global__ __launch_bounds__(256) void fx_lds20000_wg256(float *p) {
    __shared__ float s[5000];
    s[threadIdx.x] = p[threadIdx.x];
    __syncthreads();
    p[threadIdx.x] = s[(threadIdx.x * 7 + 1) % 5000];
}

// Scratch without spills: a private array indexed at run time (default workgroup size, 1024).
extern "C" __global__ void fx_scratch(float *p, int i) {
    float a[64];
    for (int j = 0; j < 64; ++j) a[j] = p[j * 32 + threadIdx.x];
    p[threadIdx.x] = a[i & 63];
}

// VGPR spills: two values live across asm that clobbers every VGPR.
extern "C" __global__ __launch_bounds__(32) void fx_vspill(float *p) {
    float x = p[threadIdx.x], y = p[threadIdx.x + 32];
    asm volatile("" ::: TEN(v), TEN(v1), TEN(v2), TEN(v3), TEN(v4), TEN(v5), TEN(v6), TEN(v7),
                 TEN(v8), TEN(v9), TEN(v10), TEN(v11), TEN(v12), TEN(v13), TEN(v14), TEN(v15),
                 TEN(v16), TEN(v17), TEN(v18), TEN(v19), TEN(v20), TEN(v21), TEN(v22), TEN(v23),
                 TEN(v24), "v250", "v251", "v252", "v253", "v254", "v255");
    p[threadIdx.x] = x * y;
}

// SGPR spills: a scalar-loaded pointer and index live across asm that clobbers every SGPR
// (they go to VGPR lanes).
extern "C" __global__ __launch_bounds__(32) void fx_sspill(const int *__restrict__ q,
                                                            int *__restrict__ p) {
    int a = q[0];
    asm volatile("" ::: TEN(s), TEN(s1), TEN(s2), TEN(s3), TEN(s4), TEN(s5), TEN(s6), TEN(s7),
                 TEN(s8), TEN(s9), "s100", "s101", "s102", "s103", "s104", "s105");
    p[threadIdx.x] = q[a];
}

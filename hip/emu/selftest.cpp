// Kernels that exercise the emulator itself (compiled for the host only): lane exchanges in
// lockstep, per-workgroup shared memory and barriers, and the divergence it must report.
// src/backend/emu.rs runs them in its unit tests.
#include "hipkv_device.h"

struct hipkv_emu_selftest_params {
    float *out;        // one float per work-item of the grid
    uint32_t mode;     // which behaviour to exercise
    const float *in;   // mode 5: 1024 floats, the first 128-byte aligned
};

// mode 0: out = value of lane ^ 1, then a wave sum of lane ids (496 in every lane)
// mode 1: out = per-workgroup sum of work-item ids through __shared__ memory and a barrier
// mode 2: half the work-items skip a barrier (divergence: must be reported)
// mode 3: a lane exchange by 8 lanes of the wave (not lockstep: must be reported)
// mode 4: two different barriers (divergence: must be reported)
// mode 5: loads for the memory trace: per wave, one of 32 consecutive floats (one line), one of
//         a float per line (32 lines), and a loop of lane % 4 iterations, iteration i reading
//         line i (3 wave-level loads, of 24, 16 and 8 lanes)
HIPKV_KERNEL(hipkv_emu_selftest, hipkv_emu_selftest_params) {
    const uint32_t id = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t lane = hipkv::lane_id();
    __shared__ float total;
    switch (p.mode) {
        case 0:
            p.out[id] = hipkv::shfl_xor((float)lane, 1) + 1000.0f * hipkv::wave_sum((float)lane);
            break;
        case 1:
            if (threadIdx.x == 0) total = 0.0f;
            __syncthreads();
            for (uint32_t i = 0; i < blockDim.x; ++i) {
                if (threadIdx.x == i) total += (float)threadIdx.x;
                __syncthreads();
            }
            p.out[id] = total;
            break;
        case 2:
            if (threadIdx.x < 16) __syncthreads();
            p.out[id] = 1.0f;
            break;
        case 3:
            if (lane < 8) p.out[id] = hipkv::shfl_xor(1.0f, 1);
            break;
        case 5: {
            float x = hipkv::read_global(p.in + lane) + hipkv::read_global(p.in + 32 * lane);
            for (uint32_t i = 0; i < lane % 4; ++i) x += hipkv::read_global(p.in + 32 * i);
            p.out[id] = x;
            break;
        }
        default:
            if (threadIdx.x % 2 == 0) {
                p.out[id] = 2.0f;
                __syncthreads();
            } else {
                __syncthreads();
                p.out[id] = 3.0f;
            }
            break;
    }
}

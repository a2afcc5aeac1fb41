// The part of the HIP runtime that hipkv calls (src/hip/sys.rs), over the CUDA driver API: a
// `libamdhip64` stand-in that lets the crate's own HIP backend (`Backend::Hip`) and its tests run
// the kernels on an NVIDIA GPU, where a warp is the same 32 lanes as a gfx1201 wave32.
//
// The crate hands `hipModuleLoadData` its embedded gfx1201 code objects. This library reads the
// kernel names in that object to tell which source and head_dim it holds, and loads the CUDA
// build of the same source instead: `$HIPKV_CUDA_MODULES/<source>.d<head_dim>.cubin`, compiled
// from the same `.hip` file through hipkv_device.h (scripts/cuda/device-check.sh builds them).
// The device reports itself as `$HIPKV_CUDA_ARCH` (default gfx1201), so the crate picks those
// code objects. It is a test harness for the kernels' parallel behaviour, not a HIP runtime.
//
// Built against the HIP headers (for hipDeviceProp_t's layout and the error codes, exactly as
// the crate's bindings see them) and CUDA's cuda.h; linked to libcuda.

#include <hip/hip_runtime_api.h>

#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

// HIP's code for a CUDA result; the CUDA name goes to stderr, since HIP has no slot for it.
hipError_t to_hip(CUresult r, const char *call) {
    if (r == CUDA_SUCCESS) return hipSuccess;
    const char *name = "?";
    cuGetErrorName(r, &name);
    if (r != CUDA_ERROR_OUT_OF_MEMORY) std::fprintf(stderr, "hip_on_cuda: %s: %s\n", call, name);
    switch (r) {
        case CUDA_ERROR_INVALID_VALUE: return hipErrorInvalidValue;
        case CUDA_ERROR_OUT_OF_MEMORY: return hipErrorOutOfMemory;
        case CUDA_ERROR_NOT_INITIALIZED: return hipErrorNotInitialized;
        case CUDA_ERROR_NO_DEVICE: return hipErrorNoDevice;
        case CUDA_ERROR_INVALID_DEVICE: return hipErrorInvalidDevice;
        case CUDA_ERROR_INVALID_IMAGE: return hipErrorInvalidImage;
        case CUDA_ERROR_INVALID_HANDLE: return hipErrorInvalidHandle;
        case CUDA_ERROR_NOT_FOUND: return hipErrorNotFound;
        case CUDA_ERROR_NOT_READY: return hipErrorNotReady;
        case CUDA_ERROR_ILLEGAL_ADDRESS: return hipErrorIllegalAddress;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return hipErrorLaunchOutOfResources;
        case CUDA_ERROR_LAUNCH_FAILED: return hipErrorLaunchFailure;
        default: return hipErrorUnknown;
    }
}

#define CU(call)                                        \
    do {                                                \
        const hipError_t e_ = to_hip((call), #call);    \
        if (e_ != hipSuccess) return e_;                \
    } while (0)

thread_local int current_device = 0;
thread_local CUcontext bound = nullptr;

// Initializes the driver and makes the current device's primary context current on this
// thread: HIP has no explicit contexts, and the crate calls from any thread.
hipError_t bind() {
    static const CUresult init = cuInit(0);
    if (init != CUDA_SUCCESS) return to_hip(init, "cuInit");
    if (bound != nullptr) return hipSuccess;
    CUdevice dev;
    CU(cuDeviceGet(&dev, current_device));
    CUcontext ctx;
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    bound = ctx;
    return hipSuccess;
}

#define BIND()                                 \
    do {                                       \
        const hipError_t b_ = bind();          \
        if (b_ != hipSuccess) return b_;       \
    } while (0)

// The size of an ELF64 image: its section headers come last in the files clang writes, so the
// image ends where they do (or at the program headers, whichever is further).
size_t elf_size(const unsigned char *image) {
    if (std::memcmp(image, "\x7f" "ELF", 4) != 0 || image[4] != 2) return 0;
    uint64_t phoff, shoff;
    uint16_t phentsize, phnum, shentsize, shnum;
    std::memcpy(&phoff, image + 0x20, 8);
    std::memcpy(&shoff, image + 0x28, 8);
    std::memcpy(&phentsize, image + 0x36, 2);
    std::memcpy(&phnum, image + 0x38, 2);
    std::memcpy(&shentsize, image + 0x3a, 2);
    std::memcpy(&shnum, image + 0x3c, 2);
    const uint64_t sections = shoff + uint64_t(shentsize) * shnum;
    const uint64_t programs = phoff + uint64_t(phentsize) * phnum;
    return size_t(sections > programs ? sections : programs);
}

// The CUDA module file that stands for a gfx1201 code object: its source and head_dim, read off
// a kernel name that each source defines at every head_dim (`<prefix><head_dim>`, NUL-ended in
// the symbol names, beside `<name>.kd` and others).
std::string cuda_module_for(const unsigned char *image) {
    const size_t n = elf_size(image);
    if (n == 0) return {};
    const std::string bytes(reinterpret_cast<const char *>(image), n);
    const char *const sources[][2] = {{"write", "hipkv_write_residual_d"},
                                      {"attention", "hipkv_attn_q8_q8_d"}};
    for (const auto &[source, name] : sources) {
        const std::string prefix = name;
        for (size_t at = bytes.find(prefix); at != std::string::npos;
             at = bytes.find(prefix, at + 1)) {
            const size_t digits = at + prefix.size();
            const size_t end = bytes.find_first_not_of("0123456789", digits);
            if (end == digits || end == std::string::npos || bytes[end] != '\0') continue;
            const char *dir = std::getenv("HIPKV_CUDA_MODULES");
            return std::string(dir ? dir : ".") + "/" + source + ".d" +
                   bytes.substr(digits, end - digits) + ".cubin";
        }
    }
    return {};
}

// HIP's opaque handles are CUDA's, carried in the same pointer.
CUstream cu(hipStream_t s) { return reinterpret_cast<CUstream>(s); }
CUevent cu(hipEvent_t e) { return reinterpret_cast<CUevent>(e); }

void copy_text(char *field, size_t size, const char *text) {
    std::strncpy(field, text, size - 1);
    field[size - 1] = '\0';
}

}  // namespace

extern "C" {

hipError_t hipDriverGetVersion(int *version) {
    *version = HIP_VERSION;
    return hipSuccess;
}

hipError_t hipRuntimeGetVersion(int *version) {
    *version = HIP_VERSION;
    return hipSuccess;
}

hipError_t hipGetDeviceCount(int *count) {
    *count = 0;
    static const CUresult init = cuInit(0);
    if (init != CUDA_SUCCESS) return to_hip(init, "cuInit");
    CU(cuDeviceGetCount(count));
    return *count == 0 ? hipErrorNoDevice : hipSuccess;
}

hipError_t hipSetDevice(int device) {
    if (device != current_device) bound = nullptr;
    current_device = device;
    return bind();
}

hipError_t hipGetDeviceProperties(hipDeviceProp_t *prop, int device) {
    BIND();
    CUdevice dev;
    CU(cuDeviceGet(&dev, device));
    std::memset(prop, 0, sizeof *prop);
    char name[200];
    CU(cuDeviceGetName(name, sizeof name, dev));
    const std::string shown = std::string(name) + " (through hip_on_cuda)";
    copy_text(prop->name, sizeof prop->name, shown.c_str());
    const char *arch = std::getenv("HIPKV_CUDA_ARCH");
    copy_text(prop->gcnArchName, sizeof prop->gcnArchName, arch ? arch : "gfx1201");
    size_t total = 0;
    CU(cuDeviceTotalMem(&total, dev));
    prop->totalGlobalMem = total;
    const auto attr = [&](CUdevice_attribute a) {
        int v = 0;
        cuDeviceGetAttribute(&v, a, dev);
        return v;
    };
    prop->multiProcessorCount = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    prop->clockRate = attr(CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
    prop->memoryClockRate = attr(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
    prop->memoryBusWidth = attr(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
    prop->warpSize = attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE);
    prop->maxThreadsPerBlock = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
    prop->sharedMemPerBlock = size_t(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK));
    prop->major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    prop->minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    return hipSuccess;
}

const char *hipGetErrorName(hipError_t e) {
    switch (e) {
        case hipSuccess: return "hipSuccess";
        case hipErrorInvalidValue: return "hipErrorInvalidValue";
        case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
        case hipErrorNotInitialized: return "hipErrorNotInitialized";
        case hipErrorNoDevice: return "hipErrorNoDevice";
        case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
        case hipErrorInvalidImage: return "hipErrorInvalidImage";
        case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
        case hipErrorNotFound: return "hipErrorNotFound";
        case hipErrorNotReady: return "hipErrorNotReady";
        case hipErrorIllegalAddress: return "hipErrorIllegalAddress";
        case hipErrorLaunchOutOfResources: return "hipErrorLaunchOutOfResources";
        case hipErrorLaunchFailure: return "hipErrorLaunchFailure";
        default: return "hipErrorUnknown";
    }
}

const char *hipGetErrorString(hipError_t e) {
    return e == hipSuccess ? "no error" : "see hip_on_cuda's line on stderr for the CUDA error";
}

hipError_t hipStreamCreate(hipStream_t *stream) {
    BIND();
    CUstream s;
    CU(cuStreamCreate(&s, CU_STREAM_DEFAULT));
    *stream = reinterpret_cast<hipStream_t>(s);
    return hipSuccess;
}

hipError_t hipStreamDestroy(hipStream_t stream) {
    BIND();
    CU(cuStreamDestroy(cu(stream)));
    return hipSuccess;
}

hipError_t hipStreamSynchronize(hipStream_t stream) {
    BIND();
    CU(cuStreamSynchronize(cu(stream)));
    return hipSuccess;
}

hipError_t hipEventCreate(hipEvent_t *event) {
    BIND();
    CUevent e;
    CU(cuEventCreate(&e, CU_EVENT_DEFAULT));
    *event = reinterpret_cast<hipEvent_t>(e);
    return hipSuccess;
}

hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
    BIND();
    CU(cuEventRecord(cu(event), cu(stream)));
    return hipSuccess;
}

hipError_t hipEventDestroy(hipEvent_t event) {
    BIND();
    CU(cuEventDestroy(cu(event)));
    return hipSuccess;
}

hipError_t hipEventSynchronize(hipEvent_t event) {
    BIND();
    CU(cuEventSynchronize(cu(event)));
    return hipSuccess;
}

hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop) {
    BIND();
    CU(cuEventElapsedTime(ms, cu(start), cu(stop)));
    return hipSuccess;
}

hipError_t hipMalloc(void **ptr, size_t size) {
    BIND();
    *ptr = nullptr;
    if (size == 0) return hipSuccess;
    CUdeviceptr p;
    CU(cuMemAlloc(&p, size));
    *ptr = reinterpret_cast<void *>(p);
    return hipSuccess;
}

hipError_t hipFree(void *ptr) {
    BIND();
    if (ptr != nullptr) CU(cuMemFree(reinterpret_cast<CUdeviceptr>(ptr)));
    return hipSuccess;
}

hipError_t hipMemcpy(void *dst, const void *src, size_t n, hipMemcpyKind kind) {
    BIND();
    if (n == 0) return hipSuccess;
    const auto d = reinterpret_cast<CUdeviceptr>(dst);
    const auto s = reinterpret_cast<CUdeviceptr>(src);
    switch (kind) {
        case hipMemcpyHostToDevice: CU(cuMemcpyHtoD(d, src, n)); break;
        case hipMemcpyDeviceToHost: CU(cuMemcpyDtoH(dst, s, n)); break;
        case hipMemcpyDeviceToDevice: CU(cuMemcpyDtoD(d, s, n)); break;
        case hipMemcpyHostToHost: std::memcpy(dst, src, n); break;
        default: CU(cuMemcpy(d, s, n)); break;
    }
    return hipSuccess;
}

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, hipMemcpyKind kind,
                          hipStream_t stream) {
    BIND();
    if (n == 0) return hipSuccess;
    const auto d = reinterpret_cast<CUdeviceptr>(dst);
    const auto s = reinterpret_cast<CUdeviceptr>(src);
    const auto q = cu(stream);
    switch (kind) {
        case hipMemcpyHostToDevice: CU(cuMemcpyHtoDAsync(d, src, n, q)); break;
        case hipMemcpyDeviceToHost: CU(cuMemcpyDtoHAsync(dst, s, n, q)); break;
        case hipMemcpyDeviceToDevice: CU(cuMemcpyDtoDAsync(d, s, n, q)); break;
        default: CU(cuMemcpyAsync(d, s, n, q)); break;
    }
    return hipSuccess;
}

hipError_t hipMemset(void *dst, int value, size_t n) {
    BIND();
    if (n == 0) return hipSuccess;
    CU(cuMemsetD8(reinterpret_cast<CUdeviceptr>(dst), (unsigned char)value, n));
    return hipSuccess;
}

hipError_t hipMemsetAsync(void *dst, int value, size_t n, hipStream_t stream) {
    BIND();
    if (n == 0) return hipSuccess;
    CU(cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), (unsigned char)value, n,
                       cu(stream)));
    return hipSuccess;
}

hipError_t hipMemGetInfo(size_t *free, size_t *total) {
    BIND();
    CU(cuMemGetInfo(free, total));
    return hipSuccess;
}

hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
    BIND();
    const std::string path = cuda_module_for(static_cast<const unsigned char *>(image));
    if (path.empty()) {
        std::fprintf(stderr, "hip_on_cuda: a code object without hipkv's kernel names\n");
        return hipErrorInvalidImage;
    }
    CUmodule m;
    const CUresult r = cuModuleLoad(&m, path.c_str());
    if (r != CUDA_SUCCESS) std::fprintf(stderr, "hip_on_cuda: loading %s\n", path.c_str());
    CU(r);
    *module = reinterpret_cast<hipModule_t>(m);
    return hipSuccess;
}

hipError_t hipModuleUnload(hipModule_t module) {
    BIND();
    CU(cuModuleUnload(reinterpret_cast<CUmodule>(module)));
    return hipSuccess;
}

hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *name) {
    BIND();
    CUfunction f;
    CU(cuModuleGetFunction(&f, reinterpret_cast<CUmodule>(module), name));
    *function = reinterpret_cast<hipFunction_t>(f);
    return hipSuccess;
}

hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gx, unsigned int gy,
                                 unsigned int gz, unsigned int bx, unsigned int by,
                                 unsigned int bz, unsigned int shared, hipStream_t stream,
                                 void **params, void **extra) {
    BIND();
    CU(cuLaunchKernel(reinterpret_cast<CUfunction>(f), gx, gy, gz, bx, by, bz, shared,
                      cu(stream), params, extra));
    // A kernel that faults reports it here in a checked build (HIPKV_CUDA_SYNC=1), at the
    // launch that did it, rather than at a later copy.
    static const bool sync = std::getenv("HIPKV_CUDA_SYNC") != nullptr;
    if (sync) CU(cuStreamSynchronize(cu(stream)));
    return hipSuccess;
}

}  // extern "C"

// What every CUDA kernel header shares: failures turned into the project's Error (so tests and main() report
// them like any other), bf16 storage with fp32 arithmetic, warp reductions, and the one cuBLASLt handle with
// its workspace. Kernels and device helpers are `static` because every header is included by several
// translation units that are linked together.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "llmc/utils.h"

typedef __nv_bfloat16 bf16;

inline void cuda_check_impl(cudaError_t err, const char* file, int line) {
    if (err != cudaSuccess) fail("%s:%d: CUDA error: %s", file, line, cudaGetErrorString(err));
}
#define cuda_check(call) cuda_check_impl((call), __FILE__, __LINE__)

inline void cublas_check_impl(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) fail("%s:%d: cuBLAS error %d", file, line, (int)status);
}
#define cublas_check(call) cublas_check_impl((call), __FILE__, __LINE__)

// true when at least one CUDA device is usable; a machine without a driver answers false, not an error
inline bool cuda_device_available() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

inline int cuda_sm_count() {
    static int count = [] {
        int dev = 0, n = 0;
        cuda_check(cudaGetDevice(&dev));
        cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
        return n;
    }();
    return count;
}

inline unsigned int cuda_blocks(long work, int per_block) { return (unsigned int)((work + per_block - 1) / per_block); }

// kernels that move 16 bytes per access refuse a pointer they cannot read that way, rather than fault or misread
inline void require_aligned_16(const char* what, const void* p) {
    if ((uintptr_t)p % 16) fail("%s: pointer %p is not 16-byte aligned", what, p);
}

// ----------------------------------------------------------------------------------------------------------
// device helpers

static __device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Σ over the block in a fixed tree order (so the result is bit-reproducible); every thread gets the sum.
// blockDim.x must be a multiple of 32 and at most 1024; the block must not be using `shared` for anything else.
static __device__ float block_sum(float v, float* shared /* 32 floats */) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading `shared`
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}

// 16 bytes of bf16: the widest load a thread can issue, which memory-bound kernels use to keep few
// instructions in flight per byte
struct alignas(16) bf16x8 {
    __nv_bfloat162 h[4];
};

static __device__ __forceinline__ void unpack_bf16x8(const bf16x8& v, float f[8]) {
    for (int j = 0; j < 4; j++) {
        float2 p = __bfloat1622float2(v.h[j]);
        f[2 * j] = p.x;
        f[2 * j + 1] = p.y;
    }
}

static __device__ __forceinline__ bf16x8 pack_bf16x8(const float f[8]) {
    bf16x8 v;
    for (int j = 0; j < 4; j++) v.h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    return v;
}

// ----------------------------------------------------------------------------------------------------------
// cuBLASLt: one handle and one workspace per process, created on first use and never freed (freeing at exit
// would race the CUDA runtime's own teardown). Matmuls sharing the workspace must be on one stream at a time.

constexpr size_t CUBLASLT_WORKSPACE_BYTES = (size_t)32 << 20;  // what Hopper's split-K and stream-K kernels ask for
// what the CUDA context itself holds on an H100 with CUDA 12-13 (driver, module images, cuBLAS's kernels),
// roughly; --plan prints it beside the totals, which do not include it
constexpr double CUDA_CONTEXT_MIB = 500.0;

struct CublasLtContext {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = CUBLASLT_WORKSPACE_BYTES;
    CublasLtContext() {
        cublas_check(cublasLtCreate(&handle));
        cuda_check(cudaMalloc(&workspace, workspace_bytes));
    }
};

inline CublasLtContext& cublaslt() {
    static CublasLtContext* ctx = new CublasLtContext();
    return *ctx;
}

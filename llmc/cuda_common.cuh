// What every CUDA kernel header shares: failures turned into the project's Error (so tests and main() report
// them like any other), bf16 storage with fp32 arithmetic, warp reductions, and cuBLASLt (opened on first use) with
// its one handle and workspace. Kernels and device helpers are `static` because every header is included by several
// translation units that are linked together.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <type_traits>

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
// cuBLASLt is opened when the first GPU matmul needs it, not linked: its library's start-up touches about 90 MB
// (0.1 s of CPU, 0.2 s before main() on two busy cores) in every process linked to it, which a CPU run would pay
// for nothing, as would each of the hundreds of train_gpt processes the test suite starts. The functions used,
// looked up by their names in the library of the cuBLAS the code was compiled against.
struct CublasLtApi {
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtMatmul) matmul;
    decltype(&cublasLtMatmulDescCreate) matmul_desc_create;
    decltype(&cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute;
    decltype(&cublasLtMatrixLayoutCreate) matrix_layout_create;
    decltype(&cublasLtMatmulPreferenceCreate) preference_create;
    decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set_attribute;
    decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy;
    decltype(&cublasLtMatmulAlgoGetHeuristic) algo_get_heuristic;
    decltype(&cublasLtMatmulAlgoCheck) algo_check;
};

// A library of the cuBLAS the toolkit ships (`base`: libcublasLt or libcublas), of its major version, opened on
// first use so that the binary links neither; soname says which file. Null where it cannot be opened.
inline void* open_cublas_library(const char* base, std::string& soname) {
    soname = strfmt("%s.so.%d", base, CUBLAS_VER_MAJOR);
    return dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
}
// function <- the library's symbol `name`; whether it has one
template <typename F>
inline bool find_symbol(void* lib, F& function, const char* name) {
    function = reinterpret_cast<F>(dlsym(lib, name));
    return function != nullptr;
}

inline CublasLtApi open_cublaslt() {
    std::string soname;
    void* lib = open_cublas_library("libcublasLt", soname);
    if (!lib) fail("cuBLASLt: cannot open %s: %s", soname.c_str(), dlerror());
    CublasLtApi api;
    auto find = [&](auto& function, const char* name) {
        if (!find_symbol(lib, function, name)) fail("cuBLASLt: %s has no %s", soname.c_str(), name);
    };
    find(api.create, "cublasLtCreate");
    find(api.matmul, "cublasLtMatmul");
    find(api.matmul_desc_create, "cublasLtMatmulDescCreate");
    find(api.matmul_desc_set_attribute, "cublasLtMatmulDescSetAttribute");
    find(api.matrix_layout_create, "cublasLtMatrixLayoutCreate");
    find(api.preference_create, "cublasLtMatmulPreferenceCreate");
    find(api.preference_set_attribute, "cublasLtMatmulPreferenceSetAttribute");
    find(api.preference_destroy, "cublasLtMatmulPreferenceDestroy");
    find(api.algo_get_heuristic, "cublasLtMatmulAlgoGetHeuristic");
    find(api.algo_check, "cublasLtMatmulAlgoCheck");
    return api;
}

// One handle and one workspace per process (as PyTorch keeps cuBLAS's per process and device, not per model): they
// are the library's state, not a model's, costly to create, and every model and tool of the process can share
// them, as their matmuls all run on main_stream(), one at a time (matmuls sharing the workspace must be on one
// stream at a time). Created on first use and never freed (freeing at exit would race the CUDA runtime's own
// teardown).

constexpr size_t CUBLASLT_WORKSPACE_BYTES = (size_t)32 << 20;  // what Hopper's split-K and stream-K kernels ask for
// what the CUDA context itself holds on an H100 with CUDA 12-13 (driver, module images, cuBLAS's kernels),
// roughly; --plan prints it beside the totals, which do not include it
constexpr double CUDA_CONTEXT_MIB = 500.0;

struct CublasLtContext {
    CublasLtApi api = open_cublaslt();
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = CUBLASLT_WORKSPACE_BYTES;
    CublasLtContext() {
        cublas_check(api.create(&handle));
        cuda_check(cudaMalloc(&workspace, workspace_bytes));
    }
};

inline CublasLtContext& cublaslt() {
    static CublasLtContext* ctx = new CublasLtContext();
    return *ctx;
}

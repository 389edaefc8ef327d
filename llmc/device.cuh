// The two devices, and the few memory operations the model and the parallel runtimes need on either. A device
// is named by the element type its model stores: float on the CPU (fp32 everywhere), bf16 on CUDA (bf16
// parameters, gradients and activations; fp32 master weights, optimizer moments and statistics). So the model
// code is one template over that type, and overload resolution on the pointer types is what sends each layer
// call to its CPU loop or its CUDA kernel: gpt_forward/gpt_backward never ask which device they are on.
// Buffers of fp32 elements exist on both devices; the helpers that touch them take the storage type too, to
// know where they live. Beside the copies are the moves of rows by an index and the sums of rank pieces that the
// parallel runtimes make around the layers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/utils.h"

enum class Device { CPU, CUDA };

template <typename T>
constexpr Device device_of = std::is_same_v<T, bf16> ? Device::CUDA : Device::CPU;

// The one stream every kernel of a step runs on, in order; communication gets streams of its own
// (llmc/comm.cuh) and is ordered after it by events. Created on first use, never destroyed (as cuBLASLt's
// handle, for the same reason).
inline cudaStream_t main_stream() {
    static cudaStream_t stream = [] {
        cudaStream_t s;
        cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        return s;
    }();
    return stream;
}

// ----------------------------------------------------------------------------------------------------------
// memory on the device of T: zeroing and copying, in stream order on CUDA

template <typename T, typename E>
inline void device_zero(E* p, size_t count) {
    if constexpr (device_of<T> == Device::CUDA) cuda_check(cudaMemsetAsync(p, 0, count * sizeof(E), main_stream()));
    else memset(p, 0, count * sizeof(E));
}

template <typename T, typename E>
inline void device_copy(E* dst, const E* src, size_t count) {
    if constexpr (device_of<T> == Device::CUDA)
        cuda_check(cudaMemcpyAsync(dst, src, count * sizeof(E), cudaMemcpyDeviceToDevice, main_stream()));
    else memmove(dst, src, count * sizeof(E));
}

// fp32 host values into a buffer on the device of T, and back; the device work is finished when these return
template <typename T, typename E>
inline void device_upload(E* dst, const E* host, size_t count) {
    if constexpr (device_of<T> == Device::CUDA) {
        cuda_check(cudaMemcpyAsync(dst, host, count * sizeof(E), cudaMemcpyHostToDevice, main_stream()));
        cuda_check(cudaStreamSynchronize(main_stream()));
    } else if (dst != host) {
        memcpy(dst, host, count * sizeof(E));
    }
}
template <typename T, typename E>
inline void device_download(E* host, const E* src, size_t count) {
    if constexpr (device_of<T> == Device::CUDA) {
        cuda_check(cudaMemcpyAsync(host, src, count * sizeof(E), cudaMemcpyDeviceToHost, main_stream()));
        cuda_check(cudaStreamSynchronize(main_stream()));
    } else if (host != src) {
        memcpy(host, src, count * sizeof(E));
    }
}

// Small host tables (a layer's routing counts and the like) uploaded without waiting for the device: each is
// copied into pinned memory that the transfer reads when its turn on the stream comes. The pinned ring waits for
// the stream only when it wraps around, once every RING_BYTES uploaded. On the CPU an upload is a copy.
template <typename T>
struct AsyncUploads {
    static constexpr size_t RING_BYTES = 4 << 20;
    std::shared_ptr<char> ring;  // shared by copies of the owner, freed with the last
    size_t size = 0, at = 0;
    template <typename E>
    void upload(E* dst, const E* host, size_t count) {
        size_t bytes = count * sizeof(E);
        if constexpr (device_of<T> == Device::CPU) {
            if (dst != host) memcpy(dst, host, bytes);
        } else {
            size_t need = (bytes + 255) / 256 * 256;
            if (!ring || need > size || at + need > size) cuda_check(cudaStreamSynchronize(main_stream()));
            if (!ring || need > size) {
                char* p = nullptr;
                size = std::max(need, RING_BYTES);
                cuda_check(cudaMallocHost(&p, size));
                ring.reset(p, [](char* q) { cudaFreeHost(q); });
                at = 0;
            }
            if (at + need > size) at = 0;
            memcpy(ring.get() + at, host, bytes);
            cuda_check(cudaMemcpyAsync(dst, ring.get() + at, bytes, cudaMemcpyHostToDevice, main_stream()));
            at += need;
        }
    }
};

// ----------------------------------------------------------------------------------------------------------
// conversions between the fp32 the files hold and the storage type: round to nearest even into bf16, exact
// back. On the CPU they are copies.

static __global__ void float_to_bf16_kernel(bf16* dst, const float* src, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}
static __global__ void bf16_to_float_kernel(float* dst, const bf16* src, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

inline unsigned int grid_stride_blocks(long n) { return (unsigned int)std::min<long>(cuda_blocks(n, 256), 65535L * 8); }

// waits for the work queued on the compute stream of T's device (on the CPU it is done already)
template <typename T>
inline void device_synchronize() {
    if constexpr (device_of<T> == Device::CUDA) cuda_check(cudaStreamSynchronize(main_stream()));
}

// an element-wise kernel over n elements (one thread per element, grid-stride), on the compute stream
template <typename... Params, typename... Args>
inline void launch_elementwise(void (*kernel)(Params...), long n, Args... args) {
    if (n <= 0) return;
    kernel<<<grid_stride_blocks(n), 256, 0, main_stream()>>>(args...);
    cuda_check(cudaGetLastError());
}

// dst += src, n elements of the storage type: a gradient of one micro-step (or a reduced piece of one) into the
// gradients accumulated so far, one add per element, the sum in fp32 rounded once on the GPU
inline void accumulate(float* dst, const float* src, size_t n) {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
}
static __global__ void accumulate_kernel(bf16* dst, const bf16* src, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(__bfloat162float(dst[i]) + __bfloat162float(src[i]));
}
inline void accumulate(bf16* dst, const bf16* src, size_t n) { launch_elementwise(accumulate_kernel, (long)n, dst, src, (long)n); }

// ... fp32 values on the device of the storage type floatX (the fp32 accumulators of ring attention's gradients)
static __global__ void accumulate_floats_kernel(float* acc, const float* x, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) acc[i] += x[i];
}
template <typename floatX>
inline void accumulate_floats(float* acc, const float* x, long n) {
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(accumulate_floats_kernel, n, acc, x, n);
    } else {
#pragma omp parallel for
        for (long i = 0; i < n; i++) acc[i] += x[i];
    }
}

// x[0..n) = value, fp32 on the device of the storage type floatX
static __global__ void device_fill_kernel(float* x, long n, float value) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] = value;
}
template <typename floatX>
inline void device_fill(float* x, long n, float value) {
    if constexpr (device_of<floatX> == Device::CUDA) launch_elementwise(device_fill_kernel, n, x, n, value);
    else std::fill(x, x + n, value);
}

// ----------------------------------------------------------------------------------------------------------
// Rows moved by an index, and the pieces a collective gathered from every rank summed in rank order: the copies
// and sums the parallel runtimes make around the layers (a cp rank's positions, the experts' dispatch, a tp
// group's sums that leave every rank with the same bits), each a CPU loop and its CUDA kernel.

// dst[i, :] = src[index[i], :] for n rows of C
inline void gather_rows(float* dst, const float* src, const int* index, long n, int C) {
#pragma omp parallel for
    for (long i = 0; i < n; i++) memcpy(dst + i * C, src + (long)index[i] * C, C * sizeof(float));
}
static __global__ void gather_rows_kernel(bf16* dst, const bf16* src, const int* index, long n, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n * C; i += (long)gridDim.x * blockDim.x)
        dst[i] = src[(long)index[i / C] * C + i % C];
}
inline void gather_rows(bf16* dst, const bf16* src, const int* index, long n, int C) {
    launch_elementwise(gather_rows_kernel, n * C, dst, src, index, n, C);
}

// dst[index[i], :] += src[i, :] for n rows of C; the indices are distinct
inline void add_rows_at(float* dst, const float* src, const int* index, int n, int C) {
#pragma omp parallel for
    for (int i = 0; i < n; i++)
        for (int c = 0; c < C; c++) dst[(size_t)index[i] * C + c] += src[(size_t)i * C + c];
}
static __global__ void add_rows_at_kernel(bf16* dst, const bf16* src, const int* index, int n, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)n * C; i += (long)gridDim.x * blockDim.x) {
        bf16* d = dst + (long)index[i / C] * C + i % C;
        *d = __float2bfloat16(__bfloat162float(*d) + __bfloat162float(src[i]));
    }
}
inline void add_rows_at(bf16* dst, const bf16* src, const int* index, int n, int C) {
    launch_elementwise(add_rows_at_kernel, (long)n * C, dst, src, index, n, C);
}

// x[i] = Σ over ranks of all[r·n + i], added in rank order in fp32
inline void sum_ranks(float* x, const float* all, long n, int ranks) {
#pragma omp parallel for
    for (long i = 0; i < n; i++) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += all[r * n + i];
        x[i] = s;
    }
}
static __global__ void sum_ranks_kernel(bf16* x, const bf16* all, long n, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += __bfloat162float(all[r * n + i]);
        x[i] = __float2bfloat16(s);
    }
}
inline void sum_ranks(bf16* x, const bf16* all, long n, int ranks) { launch_elementwise(sum_ranks_kernel, n, x, all, n, ranks); }
// ... fp32 values on the device of the storage type floatX
static __global__ void sum_float_ranks_kernel(float* x, const float* all, long n, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += all[r * n + i];
        x[i] = s;
    }
}
template <typename floatX>
inline void sum_float_ranks(float* x, const float* all, long n, int ranks) {
    if constexpr (device_of<floatX> == Device::CPU) sum_ranks(x, all, n, ranks);
    else launch_elementwise(sum_float_ranks_kernel, n, x, all, n, ranks);
}

// dst (storage type, on its device) = src (fp32, on the same device)
inline void convert_on_device(float* dst, const float* src, long n) { device_copy<float>(dst, src, (size_t)n); }
inline void convert_on_device(bf16* dst, const float* src, long n) {
    if (n == 0) return;
    float_to_bf16_kernel<<<grid_stride_blocks(n), 256, 0, main_stream()>>>(dst, src, n);
    cuda_check(cudaGetLastError());
}

// The fp32 staging of a bf16 conversion goes in pieces of at most STAGING_FLOATS: a whole model's fp32 copy
// (12.8 GB for a 3B model) beside its training state does not fit the GPU.
constexpr size_t STAGING_FLOATS = size_t(1) << 25;  // 128 MiB

// host fp32 <- n elements of storage type T on their device, converted exactly to fp32
inline void download_as_float(float* host, const float* src, size_t n) { device_download<float>(host, src, n); }
inline void download_as_float(float* host, const bf16* src, size_t n) {
    if (n == 0) return;
    float* staging;
    cuda_check(cudaMallocAsync(&staging, std::min(n, STAGING_FLOATS) * sizeof(float), main_stream()));
    for (size_t at = 0; at < n; at += STAGING_FLOATS) {
        size_t piece = std::min(STAGING_FLOATS, n - at);
        bf16_to_float_kernel<<<grid_stride_blocks((long)piece), 256, 0, main_stream()>>>(staging, src + at, (long)piece);
        cuda_check(cudaGetLastError());
        device_download<bf16>(host + at, staging, piece);
    }
    cuda_check(cudaFreeAsync(staging, main_stream()));
}

// n elements of storage type T on their device <- host fp32, rounded to T
inline void upload_from_float(float* dst, const float* host, size_t n) { device_upload<float>(dst, host, n); }
inline void upload_from_float(bf16* dst, const float* host, size_t n) {
    if (n == 0) return;
    float* staging;
    cuda_check(cudaMallocAsync(&staging, std::min(n, STAGING_FLOATS) * sizeof(float), main_stream()));
    for (size_t at = 0; at < n; at += STAGING_FLOATS) {
        size_t piece = std::min(STAGING_FLOATS, n - at);
        // the stream orders each piece's copy after the previous piece's conversion
        cuda_check(cudaMemcpyAsync(staging, host + at, piece * sizeof(float), cudaMemcpyHostToDevice, main_stream()));
        convert_on_device(dst + at, staging, (long)piece);
    }
    cuda_check(cudaFreeAsync(staging, main_stream()));
    cuda_check(cudaStreamSynchronize(main_stream()));
}

// ----------------------------------------------------------------------------------------------------------
// the GPU this process uses

// Under a launcher every rank of a node sees every GPU: rank r of the node takes GPU r mod count (the local
// rank comes from the launcher's environment: OpenMPI, Slurm, or torchrun-style LOCAL_RANK).
inline int local_rank_from_launcher() {
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "LOCAL_RANK"})
        if (const char* v = getenv(var)) return atoi(v);
    return 0;
}

inline int select_gpu() {
    int count = 0;
    cuda_check(cudaGetDeviceCount(&count));
    int gpu = local_rank_from_launcher() % count;
    cuda_check(cudaSetDevice(gpu));
    return gpu;
}

// "cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB, compute capability 9.0"
inline std::string gpu_description(int gpu) {
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, gpu));
    return strfmt("cuda:%d %s, %.1f GiB, compute capability %d.%d", gpu, prop.name,
                  prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor);
}

// device memory in use right now, by everything on this GPU (cudaMemGetInfo)
inline size_t gpu_memory_used() {
    size_t free_bytes = 0, total_bytes = 0;
    cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes));
    return total_bytes - free_bytes;
}

// ----------------------------------------------------------------------------------------------------------
// The fp32 workspace of the kernels that need one, which the model owns: allocated through its ledger, sized for the
// largest call it makes, and passed to each layer call that needs it. On the CPU it is the GEMM's packing panels
// (llmc/matmul.cuh), on the GPU the kernels' partial sums, sort buffers and row statistics. One buffer serves
// every call of a pass, because the calls run one after another (on the GPU in order on main_stream()).
struct Workspace {
    float* floats = nullptr;
    size_t count = 0;
    // the first n floats, or one line naming the call that needs more
    float* take(size_t n, const char* who) const {
        if (n > count)
            fail("%s: needs %zu floats of workspace, %zu allocated (the model sizes it for its batch)", who, n, count);
        return floats;
    }
};

// Σ x² over a buffer, for gradient-norm clipping. Partial sums are taken over fixed blocks and added in block
// order, so the result does not depend on the thread count; doubles keep a 1.5B-element sum accurate.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "llmc/device.cuh"
#include "llmc/profile.h"

// (offset, count) ranges of one buffer, in order
using BufferRanges = std::vector<std::pair<long, long>>;
// (start, count) spans of values of type E, anywhere
template <typename E>
using Spans = std::vector<std::pair<const E*, long>>;

// The model's entry points (each with its bf16 overload below; the workspace is the GPU's, the CPU needs none):
// Σ x² over ranges of x taken as one sequence (a model's whole gradient): the blocks are the sequence's, so a gap
// between ranges (the padding rows of a Llama's vocab, which its files lack) leaves the bits those elements give
// back to back in one buffer
inline double sum_of_squares(const float* x, const BufferRanges& ranges, Workspace) {
    ProfileScope op("gradient norm", OpKind::Optimizer);
    constexpr long BLOCK = 1 << 16;
    std::vector<long> starts;  // where each range starts in the sequence
    long n = 0;
    for (const auto& r : ranges) starts.push_back(n), n += r.second;
    long blocks = (n + BLOCK - 1) / BLOCK;
    std::vector<double> partial(blocks);
#pragma omp parallel for
    for (long b = 0; b < blocks; b++) {
        long i = b * BLOCK, end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        size_t k = std::upper_bound(starts.begin(), starts.end(), i) - starts.begin() - 1;  // the range holding i
        double s = 0.0;
        for (; i < end; k++) {
            long stop = std::min(end, starts[k] + ranges[k].second);
            const float* p = x + ranges[k].first + (i - starts[k]);  // element i of the sequence
            for (long j = 0; j < stop - i; j++) s += (double)p[j] * p[j];
            i = stop;
        }
        partial[b] = s;
    }
    double total = 0.0;
    for (double p : partial) total += p;
    return total;
}
inline double sum_of_squares(const float* x, long n) { return sum_of_squares(x, BufferRanges{{0, n}}, Workspace{}); }

// ... and over spans of a gradient buffer, each summed on its own, added in span order in double (a ZeRO rank's
// pieces, llmc/zero.cuh): the same sums on every rank and stage
inline double sum_of_squares_spans(const Spans<float>& spans, Workspace) {
    ProfileScope op("gradient norm", OpKind::Optimizer);
    double total = 0.0;
    for (const auto& [x, n] : spans) total += sum_of_squares(x, n);
    return total;
}

// the factor that brings the gradient norm down to max_norm when it is above (1 otherwise)
inline float clip_scale(double norm, float max_norm) { return norm > max_norm ? (float)(max_norm / norm) : 1.0f; }

// ==========================================================================================================
// CUDA. Memory-bound: two bytes read per element, one FMA. A fixed number of blocks (independent of the
// device) sweep the buffer with a fixed stride, each reduces in a fixed tree order, and a second one-block pass
// adds the partial sums in order, so the result is the same bits on every run and every GPU. Threads accumulate
// in fp32: each sums only n / (blocks · threads) elements before the tree takes over.

#include "llmc/cuda_common.cuh"

constexpr int GLOBAL_NORM_BLOCKS = 1024, GLOBAL_NORM_THREADS = 512;

static __global__ void __launch_bounds__(GLOBAL_NORM_THREADS)
    sum_of_squares_partial_kernel(float* partial, const bf16* x, long n) {
    __shared__ float shared[32];
    float s = 0.0f;
    long stride = (long)GLOBAL_NORM_BLOCKS * GLOBAL_NORM_THREADS;
    long groups = n / 8;  // whole 16-byte groups; the tail is summed below
    for (long g = (long)blockIdx.x * GLOBAL_NORM_THREADS + threadIdx.x; g < groups; g += stride) {
        bf16x8 v = reinterpret_cast<const bf16x8*>(x)[g];
        for (int j = 0; j < 4; j++) {
            float2 f = __bfloat1622float2(v.h[j]);
            s += f.x * f.x + f.y * f.y;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x < n - 8 * groups) {
        float f = __bfloat162float(x[8 * groups + threadIdx.x]);
        s += f * f;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

static __global__ void __launch_bounds__(GLOBAL_NORM_BLOCKS) sum_of_squares_final_kernel(float* out, const float* partial) {
    __shared__ float shared[32];
    float s = block_sum(partial[threadIdx.x], shared);
    if (threadIdx.x == 0) *out = s;
}

// *out = Σ x² (device float); x must be 16-byte aligned; partial holds GLOBAL_NORM_BLOCKS floats
inline void sum_of_squares_cuda(float* out, const bf16* x, long n, float* partial, cudaStream_t stream) {
    sum_of_squares_partial_kernel<<<GLOBAL_NORM_BLOCKS, GLOBAL_NORM_THREADS, 0, stream>>>(partial, x, n);
    cuda_check(cudaGetLastError());
    sum_of_squares_final_kernel<<<1, GLOBAL_NORM_BLOCKS, 0, stream>>>(out, partial);
    cuda_check(cudaGetLastError());
}

// Σ x² of bf16 values that may start at any element (a ZeRO shard's segment does), into *out on the device, in
// stream order: the 16-byte aligned body through the kernels above, then the up to 7 elements before it added
// by one thread, so the result is as reproducible as the aligned sum. partial holds GLOBAL_NORM_BLOCKS floats.
static __global__ void sum_of_squares_add_head_kernel(float* out, const bf16* head, int count) {
    float s = *out;
    for (int i = 0; i < count; i++) {
        float f = __bfloat162float(head[i]);
        s += f * f;
    }
    *out = s;
}

inline void sum_of_squares_cuda_any_offset(float* out, const bf16* x, long n, float* partial, cudaStream_t stream) {
    long misaligned = (long)((reinterpret_cast<uintptr_t>(x) % 16) / sizeof(bf16));
    long head = std::min(n, misaligned ? 8 - misaligned : 0L);
    sum_of_squares_cuda(out, x + head, n - head, partial, stream);
    if (head == 0) return;
    sum_of_squares_add_head_kernel<<<1, 1, 0, stream>>>(out, x, (int)head);
    cuda_check(cudaGetLastError());
}

// the model's entry points on the GPU: each span's (or range's) Σ x² a float on the device, read back together (the
// step's one read of the gradient norm) and added in order in double. The workspace holds the partial sums; the
// spans' floats are stream-ordered memory of their own, as there may be many.
inline double sum_of_squares_spans(const Spans<bf16>& spans, Workspace workspace) {
    ProfileScope op("gradient norm", OpKind::Optimizer);
    if (spans.empty()) return 0.0;
    float* partial = workspace.take(GLOBAL_NORM_BLOCKS, "sum_of_squares");
    float* each;
    cuda_check(cudaMallocAsync(&each, spans.size() * sizeof(float), main_stream()));
    for (size_t k = 0; k < spans.size(); k++)
        sum_of_squares_cuda_any_offset(each + k, spans[k].first, spans[k].second, partial, main_stream());
    std::vector<float> host(spans.size());
    device_download<bf16>(host.data(), each, spans.size());
    cuda_check(cudaFreeAsync(each, main_stream()));
    double total = 0.0;
    for (float v : host) total += v;
    return total;
}
inline double sum_of_squares(const bf16* x, const BufferRanges& ranges, Workspace workspace) {
    Spans<bf16> spans;
    for (const auto& [at, n] : ranges) spans.push_back({x + at, n});
    return sum_of_squares_spans(spans, workspace);
}

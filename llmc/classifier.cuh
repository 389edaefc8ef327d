// Softmax + cross-entropy over the logits (B*T rows of Vp columns, of which the first V are real tokens; the
// padding columns never enter the softmax and get zero gradient). The backward turns the logits into their
// gradient in place, so the probabilities are never stored. At the end, the pieces of the same loss over logit
// columns split across a tensor-parallel group (llmc/tp.cuh), whose full rows exist nowhere.
#pragma once

#include <cmath>

#include "llmc/device.cuh"
#include "llmc/profile.h"

// the log of Σ exp over the first V entries, computed around the row's maximum for stability
inline float logsumexp_row(const float* row, int V) {
    float maxv = -INFINITY;
    for (int v = 0; v < V; v++) maxv = row[v] > maxv ? row[v] : maxv;
    float sum = 0.0f;
    for (int v = 0; v < V; v++) sum += expf(row[v] - maxv);
    return maxv + logf(sum);
}

inline float mean_loss(const float* losses, long N) {
    double total = 0.0;
    for (long n = 0; n < N; n++) total += losses[n];
    return (float)(total / N);
}

// losses[n] = -log softmax(logits[n])[targets[n]]; returns their mean. The workspace is the GPU's, for the mean
// (the CPU needs none).
inline float crossentropy_forward(float* losses, const float* logits, const int* targets, long N, int V, int Vp,
                                  Workspace) {
    ProfileScope op("cross-entropy");
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* row = logits + n * Vp;
        losses[n] = logsumexp_row(row, V) - row[targets[n]];
    }
    return mean_loss(losses, N);
}

// logits become dloss/dlogits: (softmax - onehot(target)) * dloss, where dloss is each token's weight in the
// loss (1 / number of tokens averaged over); losses (may be null) receives the forward's losses from the same pass
inline void crossentropy_backward_inplace(float* logits, float* losses, const int* targets, long N, int V, int Vp,
                                          float dloss) {
    ProfileScope op("cross-entropy");
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        float* row = logits + n * Vp;
        float lse = logsumexp_row(row, V);
        if (losses) losses[n] = lse - row[targets[n]];
        for (int v = 0; v < V; v++) row[v] = expf(row[v] - lse) * dloss;
        row[targets[n]] -= dloss;
        for (int v = V; v < Vp; v++) row[v] = 0.0f;
    }
}

// training's forward and backward in one pass: the losses and their mean as crossentropy_forward's, the logits
// overwritten with their gradient as crossentropy_backward_inplace's
inline float crossentropy_fused(float* losses, float* logits, const int* targets, long N, int V, int Vp, float dloss,
                                Workspace) {
    ProfileScope op("cross-entropy");
    crossentropy_backward_inplace(logits, losses, targets, N, V, Vp, dloss);
    return mean_loss(losses, N);
}

// ==========================================================================================================
// CUDA. The logits are the largest activation (N·Vp bf16, 6.6 GB for GPT-2 at B·T = 64K), so the kernel is
// built around bytes: a block owns a row and reads it 16 bytes at a time, finds its log-sum-exp in one pass,
// writes the loss and, in the fused backward, reads the row again and overwrites it with its gradient, never
// storing probabilities. A thread keeps a running maximum and a sum of exponentials relative to it: per
// vector it takes the 8 values' maximum, rescales the sum only when that raises the running maximum, and adds
// 8 exponentials, so each element costs one exponential per pass (the rescales are one per 8 elements at
// most, and rare after the first few vectors). The block merges the threads' (max, sum) pairs in a fixed
// order. The first pass leaves the row in L2 (a block's row is 100 KB, and the blocks in flight hold a few
// tens of MB), so the second pass reads it from there and DRAM sees the row read once and written once; the
// second pass marks its reads and writes as streaming so they do not evict rows still to be read.
// Each thread reads and writes the same vectors in both passes, so the in-place write cannot race another
// thread's read, and the target's logit is read before the block's first barrier, before any write.
// Vp must be a multiple of 8 and the logits 16-byte aligned (checked); V may be anything up to Vp.

#include "llmc/cuda_common.cuh"

// merges a running (max, Σ exp(x - max)) pair into another; an empty pair has max -inf and sum 0
static __device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

constexpr int CLASSIFIER_THREADS = 1024;

template <bool WRITE_GRAD>
static __global__ void __launch_bounds__(CLASSIFIER_THREADS)
    crossentropy_kernel(bf16* logits, float* losses, const int* targets, int V, int Vp, float dloss) {
    __shared__ float shared_m[32], shared_s[32];
    long n = blockIdx.x;
    bf16* row = logits + n * Vp;
    int target = targets[n];
    float target_logit = __bfloat162float(row[target]);
    int vectors = Vp / 8;
    float m = -INFINITY, s = 0.0f;
#pragma unroll 4  // several loads in flight per thread; this pass only reads
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
        float x[8];
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(row + 8 * i), x);
        float vmax = -INFINITY;
        for (int j = 0; j < 8; j++) {
            if (8 * i + j >= V) x[j] = -INFINITY;  // padding columns take no part
            vmax = fmaxf(vmax, x[j]);
        }
        if (vmax == -INFINITY) continue;  // all padding: exp(-inf - -inf) would be NaN
        if (vmax > m) {
            s *= __expf(m - vmax);  // exp(-inf) = 0 on the first vector
            m = vmax;
        }
        for (int j = 0; j < 8; j++) s += __expf(x[j] - m);
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        softmax_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        shared_m[warp] = m;
        shared_s[warp] = s;
    }
    __syncthreads();
    m = lane < blockDim.x / 32 ? shared_m[lane] : -INFINITY;
    s = lane < blockDim.x / 32 ? shared_s[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1)
        softmax_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    float lse = m + logf(s);
    if (losses && threadIdx.x == 0) losses[n] = lse - target_logit;
    if constexpr (WRITE_GRAD) {
        for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
            int4* p = reinterpret_cast<int4*>(row + 8 * i);
            int4 raw = __ldcs(p);
            float x[8];
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(&raw), x);
            for (int j = 0; j < 8; j++) {
                int col = 8 * i + j;
                x[j] = col < V ? __expf(x[j] - lse) * dloss - (col == target ? dloss : 0.0f) : 0.0f;
            }
            bf16x8 grad = pack_bf16x8(x);
            __stcs(p, *reinterpret_cast<const int4*>(&grad));
        }
    }
}

inline void crossentropy_check_shape(const char* what, const bf16* logits, int V, int Vp) {
    if (V <= 0 || V > Vp || Vp % 8 != 0) fail("%s: V = %d, Vp = %d: need 0 < V <= Vp and Vp a multiple of 8", what, V, Vp);
    require_aligned_16(what, logits);
}

// losses[n] = -log softmax(logits[n])[targets[n]]; the mean is left to the caller (returning it would
// synchronize the stream)
inline void crossentropy_forward_cuda(float* losses, const bf16* logits, const int* targets, long N, int V, int Vp,
                                      cudaStream_t stream) {
    crossentropy_check_shape("crossentropy_forward_cuda", logits, V, Vp);
    if (N == 0) return;
    crossentropy_kernel<false><<<(unsigned int)N, CLASSIFIER_THREADS, 0, stream>>>(const_cast<bf16*>(logits), losses,
                                                                                  targets, V, Vp, 0.0f);
    cuda_check(cudaGetLastError());
}

// logits become dloss/dlogits in place, padding columns 0; losses (may be null) receives the forward's losses
// from the same pass
inline void crossentropy_backward_inplace_cuda(bf16* logits, float* losses, const int* targets, long N, int V, int Vp,
                                               float dloss, cudaStream_t stream) {
    crossentropy_check_shape("crossentropy_backward_inplace_cuda", logits, V, Vp);
    if (N == 0) return;
    crossentropy_kernel<true><<<(unsigned int)N, CLASSIFIER_THREADS, 0, stream>>>(logits, losses, targets, V, Vp, dloss);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 logits, targets in device memory.
// The forward returns the mean loss, so it waits for the GPU: the one read of a forward pass.

// *mean = Σ losses / N, summed by one block in a fixed order
static __global__ void mean_loss_kernel(float* mean, const float* losses, long N) {
    __shared__ float shared[32];
    float s = 0.0f;
    for (long i = threadIdx.x; i < N; i += blockDim.x) s += losses[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) *mean = s / (float)N;
}

// the mean of N per-token losses on the GPU, read back (the one wait of the forward pass)
inline float mean_loss_from_device(const float* losses, long N, Workspace workspace) {
    float* mean = workspace.take(1, "crossentropy_forward");
    mean_loss_kernel<<<1, 1024, 0, main_stream()>>>(mean, losses, N);
    cuda_check(cudaGetLastError());
    float host;
    device_download<bf16>(&host, mean, 1);
    return host;
}
inline float crossentropy_forward(float* losses, const bf16* logits, const int* targets, long N, int V, int Vp,
                                  Workspace workspace) {
    ProfileScope op("cross-entropy");
    crossentropy_forward_cuda(losses, logits, targets, N, V, Vp, main_stream());
    return mean_loss_from_device(losses, N, workspace);
}
inline void crossentropy_backward_inplace(bf16* logits, float* losses, const int* targets, long N, int V, int Vp,
                                          float dloss) {
    ProfileScope op("cross-entropy");
    crossentropy_backward_inplace_cuda(logits, losses, targets, N, V, Vp, dloss, main_stream());
}
// training's forward and backward in one pass (as llm.c's fused classifier): the losses and their mean as the
// forward's, the logits overwritten with their gradient as the backward's; the row is read once and written once
inline float crossentropy_fused(float* losses, bf16* logits, const int* targets, long N, int V, int Vp, float dloss,
                                Workspace workspace) {
    ProfileScope op("cross-entropy");
    crossentropy_backward_inplace_cuda(logits, losses, targets, N, V, Vp, dloss, main_stream());
    return mean_loss_from_device(losses, N, workspace);
}

// ----------------------------------------------------------------------------------------------------------
// The vocab-parallel cross-entropy's pieces (llmc/tp.cuh), each a CPU loop and its CUDA kernel: every rank
// reduces its own logit columns to a row's max, Σ exp and target logit; the group's statistics, gathered, combine
// into the row's log-sum-exp and loss; and each rank turns its columns into their gradient from that log-sum-exp.

// Per row of this rank's logits (BT×Vl, `real` columns of real tokens), stats[3i..3i+2] = the max, Σ exp(x -
// max) and the target logit (0 where another rank holds the target; max -inf and sum 0 with no real column)
inline void vocab_row_stats(float* stats, const float* logits, const int* targets, long BT, int Vl, int real, long vlo) {
    ProfileScope op("cross-entropy");
#pragma omp parallel for
    for (long i = 0; i < BT; i++) {
        const float* x = logits + i * Vl;
        float mx = -INFINITY;
        for (int j = 0; j < real; j++) mx = fmaxf(mx, x[j]);
        double s = 0.0;
        for (int j = 0; j < real; j++) s += exp((double)x[j] - mx);
        long t = targets[i] - vlo;
        stats[i * 3] = mx;
        stats[i * 3 + 1] = (float)s;
        stats[i * 3 + 2] = t >= 0 && t < Vl ? (float)x[t] : 0.0f;
    }
}
// a block per row, in two sweeps (the max, then the sum), each reduced over the block in a fixed order
static __global__ void vocab_row_stats_kernel(float* stats, const bf16* logits, const int* targets, int Vl, int real,
                                              long vlo) {
    __shared__ float shared[32];
    long i = blockIdx.x;
    const bf16* x = logits + i * Vl;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < real; j += blockDim.x) mx = fmaxf(mx, __bfloat162float(x[j]));
    mx = warp_max(mx);
    __syncthreads();
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = mx;
    __syncthreads();
    mx = threadIdx.x % 32 < blockDim.x / 32 ? shared[threadIdx.x % 32] : -INFINITY;
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < real; j += blockDim.x) s += expf(__bfloat162float(x[j]) - mx);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        long t = targets[i] - vlo;
        stats[i * 3] = mx;
        stats[i * 3 + 1] = s;
        stats[i * 3 + 2] = t >= 0 && t < Vl ? __bfloat162float(x[t]) : 0.0f;
    }
}
inline void vocab_row_stats(float* stats, const bf16* logits, const int* targets, long BT, int Vl, int real, long vlo) {
    ProfileScope op("cross-entropy");
    vocab_row_stats_kernel<<<(unsigned int)BT, 256, 0, main_stream()>>>(stats, logits, targets, Vl, real, vlo);
    cuda_check(cudaGetLastError());
}

// every rank's row statistics (all: ranks × BT × 3, rank-major) combined in rank order into each row's log-sum-exp
// and loss
static __host__ __device__ inline void combine_row(float* losses, float* lse, const float* all, long BT, int ranks, long i) {
    float mx = -INFINITY, target = 0.0f;
    for (int r = 0; r < ranks; r++) mx = fmaxf(mx, all[(r * BT + i) * 3]);
    double s = 0.0;
    for (int r = 0; r < ranks; r++) {
        const float* p = &all[(r * BT + i) * 3];
        if (p[1] > 0) s += (double)p[1] * exp((double)p[0] - mx);
        target += p[2];
    }
    lse[i] = (float)(log(s) + mx);
    losses[i] = lse[i] - target;
}
static __global__ void combine_rows_kernel(float* losses, float* lse, const float* all, long BT, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT; i += (long)gridDim.x * blockDim.x)
        combine_row(losses, lse, all, BT, ranks, i);
}
// the combined rows and the mean loss (on the GPU reading it waits for the forward: the pass's one read; the
// workspace holds the mean there)
template <typename floatX>
inline float combine_rows(float* losses, float* lse, const float* all, long BT, int ranks, Workspace workspace) {
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(combine_rows_kernel, BT, losses, lse, all, BT, ranks);
        return mean_loss_from_device(losses, BT, workspace);
    } else {
        double total = 0.0;
        for (long i = 0; i < BT; i++) {
            combine_row(losses, lse, all, BT, ranks, i);
            total += losses[i];
        }
        return (float)(total / BT);
    }
}

// logits (BT×Vl, global column vlo + j) become (softmax - onehot)·dloss on real columns, 0 on padding
inline void vocab_crossentropy_grad(float* logits, const float* lse, const int* targets, long BT, int V, int Vl, long vlo,
                                    float dloss) {
    ProfileScope op("cross-entropy");
#pragma omp parallel for
    for (long i = 0; i < BT; i++) {
        float* x = logits + i * Vl;
        for (int j = 0; j < Vl; j++) {
            long v = vlo + j;
            x[j] = v < V ? (expf(x[j] - lse[i]) - (v == targets[i] ? 1.0f : 0.0f)) * dloss : 0.0f;
        }
    }
}
static __global__ void vocab_crossentropy_grad_kernel(bf16* logits, const float* lse, const int* targets, long BT, int V,
                                                      int Vl, long vlo, float dloss) {
    for (long k = (long)blockIdx.x * blockDim.x + threadIdx.x; k < BT * Vl; k += (long)gridDim.x * blockDim.x) {
        long i = k / Vl, v = vlo + k % Vl;
        float g = v < V ? (expf(__bfloat162float(logits[k]) - lse[i]) - (v == targets[i] ? 1.0f : 0.0f)) * dloss : 0.0f;
        logits[k] = __float2bfloat16(g);
    }
}
inline void vocab_crossentropy_grad(bf16* logits, const float* lse, const int* targets, long BT, int V, int Vl, long vlo,
                                    float dloss) {
    ProfileScope op("cross-entropy");
    launch_elementwise(vocab_crossentropy_grad_kernel, BT * Vl, logits, lse, targets, BT, V, Vl, vlo, dloss);
}

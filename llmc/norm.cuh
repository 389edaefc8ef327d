// The norms, one family: GPT-2's LayerNorm (x centred on its mean, scaled by 1/std, a weight and a bias; eps
// 1e-5), Llama's RMSNorm (x scaled by rstd = 1/sqrt(mean(x²) + eps), a weight, no mean and no bias: Meta's
// reference model, llm.c's llama3 branch) and Qwen3's QK-norm (an RMSNorm on each query and each key head before
// RoPE, one hd-weight for all query heads and one for all key heads: Hugging Face's Qwen3RMSNorm on q_proj's and
// k_proj's outputs seen as heads; it steadies the attention logits, the values are left alone). eps comes from
// the model (norm_eps), so every call takes it.
//
// Two things vary, and each is a parameter: the kind (Norm, llmc/model_table.h: LayerNorm keeps each group's mean
// and has a bias, RMSNorm neither), and the layout of the groups normed together (NormLayout below: a row of C
// channels, or the heads of hd values within a row of the packed qkv of llmc/attention.cuh). The forward keeps
// each group's rstd (and LayerNorm's mean) so the backward need not recompute the statistics. The row norms add
// the input's gradient into dinp (the residual stream's gradient); the QK-norm writes it (dinp may be dout: in
// place) and passes v's through. The weights' gradients accumulate (+=).
//
// Each direction is written once for the CPU (fp32 loops, the oracle) and once per layout for the GPU (bf16
// storage, fp32 statistics), and the entry points at the end are overloaded on the storage type. GPT-2 and Llama
// add the residual stream right before every norm but the first, so both devices offer that pair as one call.
#pragma once

#include <cmath>
#include <type_traits>

#include "llmc/model_table.h"
#include "llmc/profile.h"
#include "llmc/utils.h"

// What is normed: `rows` rows of `width` values; in each, `groups` groups of C contiguous values are normed, the
// first `first` of them with the first weight, the others with the second, and the values after them are copied.
// A row norm is one group of C channels a row; the QK-norm's groups are the NH query heads (qweight) and KV key
// heads (kweight) of hd values, followed by the KV value heads, copied. The statistics are one per group, in row
// order.
struct NormLayout {
    long rows, width;
    int C, groups, first;
    bool dinp_accumulates;  // the row norms add into the residual stream's gradient; the QK-norm writes (in place)

    static NormLayout row(long N, int C) { return {N, C, C, 1, 1, true}; }
    static NormLayout heads(long N, int NH, int KV, int hd) {
        return {N, (long)(NH + 2 * KV) * hd, hd, NH + KV, NH, false};
    }
    long at(long n, int g) const { return n * width + (long)g * C; }
    long normed_width() const { return (long)groups * C; }
};

inline void qk_norm_check_shape(const char* what, int NH, int KV, int hd) {
    if (NH < 1 || KV < 1 || hd < 2 || hd % 2 != 0 || hd > 1024)
        fail("%s: NH = %d, KV = %d, hd = %d: need heads >= 1 and an even head size of at most 1024", what, NH, KV, hd);
}

// ==========================================================================================================
// The CPU reference

// out = norm(inp) for every group; mean (LayerNorm's, else null) and rstd one per group. weight2 is the second
// groups' weight (the QK-norm's kweight), bias LayerNorm's.
template <Norm kind>
inline void norm_forward_cpu(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                             const float* weight2, const float* bias, const NormLayout& L, float eps) {
    int C = L.C;
#pragma omp parallel for
    for (long n = 0; n < L.rows; n++) {
        for (int g = 0; g < L.groups; g++) {
            const float* x = inp + L.at(n, g);
            const float* w = g < L.first ? weight : weight2;
            // LayerNorm takes the mean and then the variance around it; RMSNorm's centre is 0, and x - 0 is x bit
            // for bit, so the same loop is its Σ x²
            float m = 0.0f;
            if constexpr (kind == Norm::LayerNorm) {
                for (int c = 0; c < C; c++) m += x[c];
                m /= C;
            }
            float v = 0.0f;
            for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
            float s = 1.0f / sqrtf(v / C + eps);
            float* o = out + L.at(n, g);
            if constexpr (kind == Norm::LayerNorm) {
                for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + bias[c];
                mean[n * L.groups + g] = m;
            } else {
                for (int c = 0; c < C; c++) o[c] = x[c] * s * w[c];
            }
            rstd[n * L.groups + g] = s;
        }
        for (long c = L.normed_width(); c < L.width; c++) out[n * L.width + c] = inp[n * L.width + c];
    }
}

// dweight, dweight2 and dbias accumulate (+=); dinp accumulates or is written as the layout says
template <Norm kind>
inline void norm_backward_cpu(float* dinp, float* dweight, float* dweight2, float* dbias, const float* dout,
                              const float* inp, const float* weight, const float* weight2, const float* mean,
                              const float* rstd, const NormLayout& L) {
    int C = L.C;
    // the parameter gradients first, while dout is whole (dinp may overwrite it). They sum over rows and groups:
    // split by channel so each sum has one owner and a fixed order (rows, then groups). Each sum is taken whole
    // and then added to the gradient once, as the kernels add their partial sums: a micro-step's gradient
    // reaches the accumulated one in one add, so that one rank accumulating micro-steps adds what dp's ranks
    // reduce (llmc/zero.cuh). The heads' sums run a channel at a time with one accumulator per weight, the row
    // norms' 32 channels at a time: the host compiler contracts the two loops' multiply-adds differently (FMA), so
    // each keeps the shape its bits come from.
    if (L.groups > 1) {
#pragma omp parallel for
        for (int c = 0; c < C; c++) {
            float q = 0.0f, k = 0.0f;
            for (long n = 0; n < L.rows; n++)
                for (int g = 0; g < L.groups; g++) {
                    long at = L.at(n, g) + c;
                    (g < L.first ? q : k) += dout[at] * inp[at] * rstd[n * L.groups + g];
                }
            dweight[c] += q, dweight2[c] += k;
        }
    } else {
        constexpr int CHUNK = 32;
#pragma omp parallel for
        for (int c0 = 0; c0 < C; c0 += CHUNK) {
            int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
            float sum_w[CHUNK] = {}, sum_w2[CHUNK] = {}, sum_b[CHUNK] = {};
            for (long n = 0; n < L.rows; n++) {
                for (int g = 0; g < L.groups; g++) {
                    const float* x = inp + L.at(n, g);
                    const float* d = dout + L.at(n, g);
                    float m = kind == Norm::LayerNorm ? mean[n * L.groups + g] : 0.0f, s = rstd[n * L.groups + g];
                    float* sum = g < L.first ? sum_w : sum_w2;
                    for (int c = c0; c < c1; c++) {
                        sum[c - c0] += d[c] * (x[c] - m) * s;
                        if constexpr (kind == Norm::LayerNorm) sum_b[c - c0] += d[c];
                    }
                }
            }
            for (int c = c0; c < c1; c++) {
                dweight[c] += sum_w[c - c0];
                if (L.groups > L.first) dweight2[c] += sum_w2[c - c0];
                if constexpr (kind == Norm::LayerNorm) dbias[c] += sum_b[c - c0];
            }
        }
    }
#pragma omp parallel for
    for (long n = 0; n < L.rows; n++) {
        for (int g = 0; g < L.groups; g++) {
            const float* x = inp + L.at(n, g);
            const float* d = dout + L.at(n, g);
            const float* w = g < L.first ? weight : weight2;
            float s = rstd[n * L.groups + g];
            float* dx = dinp + L.at(n, g);
            if constexpr (kind == Norm::LayerNorm) {
                float m = mean[n * L.groups + g];
                // dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), with dnorm = dout * weight
                float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
                for (int c = 0; c < C; c++) {
                    float dnorm = d[c] * w[c];
                    dnorm_mean += dnorm;
                    dnorm_norm_mean += dnorm * (x[c] - m) * s;
                }
                dnorm_mean /= C;
                dnorm_norm_mean /= C;
                for (int c = 0; c < C; c++) {
                    float norm = (x[c] - m) * s;
                    dx[c] += s * (d[c] * w[c] - dnorm_mean - norm * dnorm_norm_mean);
                }
            } else {
                // dx = s · (g - x · s² · mean(g·x)), with g = dout · weight: the second term is rstd's own
                // dependence on x
                float gx_mean = 0.0f;
                for (int c = 0; c < C; c++) gx_mean += d[c] * w[c] * x[c];
                gx_mean /= C;
                if (L.dinp_accumulates)
                    for (int c = 0; c < C; c++) dx[c] += s * (d[c] * w[c] - x[c] * s * s * gx_mean);
                else
                    for (int c = 0; c < C; c++) dx[c] = s * (d[c] * w[c] - x[c] * s * s * gx_mean);
            }
        }
        if (dinp != dout)
            for (long c = L.normed_width(); c < L.width; c++) dinp[n * L.width + c] = dout[n * L.width + c];
    }
}

// ==========================================================================================================
// CUDA. Both directions are memory-bound (a few FLOPs per byte), so each moves every byte once. Every sum has a
// fixed order, so the bits are reproducible.
//
// The row layout: 16 bytes per access, the row held in registers as K bf16x8 vectors per thread. A row belongs to
// a group of W warps: LayerNorm (GPT-2's widths, at most LAYERNORM_MAX_C) always one warp of up to 16 vectors a
// lane; RMSNorm (Llama's widths, 2048 to 16384 channels, more than one warp holds without spilling) W = 1 up to
// 2048 channels, then 2, 4, 8, at most 8 vectors a thread. Thread t of a group holds the vectors t, t + 32·W,
// t + 64·W, ..., so a warp's accesses are 512 contiguous bytes. The forward reads the row (and adds the residual)
// once, takes LayerNorm's mean and then the variance around it from registers (no E[x²] - mean² cancellation), and
// writes; the backward reads x, dout and dinp once and writes dinp. A row statistic is a warp sum and then, for
// W > 1, the group's warps added in warp order through shared memory; that needs a block barrier, so no thread of
// a block leaves before it. A thread writes only the elements it has already read into registers, so an output
// may alias an input (residual == inp1, out == inp, dinp == dout all work). C must be a multiple of 8, the
// pointers 16-byte aligned; the entry points check.
//
// The head layout (the QK-norm): a head is one warp's, hd ≤ 1024 values, two bf16 per lane per access (a warp
// reads 128 contiguous bytes), the head's statistic a warp sum, so no block barrier; the forward gives a warp each
// head of a row in turn, v's heads copied. hd must be even and the pointers 4-byte aligned.
//
// The parameter gradients are sums over all rows (and heads). Each block of the backward takes a fixed range of
// rows; each of its row groups (a head's warp) adds its rows' terms into its own slice of shared memory (a thread
// into its own channels: no atomics), and the block adds its groups' slices in group order into one partial sum
// per block. A second kernel adds the blocks' partials in block order, spread over column groups and row phases
// so that it does not run on a handful of threads.

#include "llmc/cuda_common.cuh"

constexpr int LAYERNORM_MAX_C = 4096;
constexpr int RMSNORM_MAX_C = 16384;  // Llama 3.1 405B's width
// warps per block: the forwards' (8 / W rows at a time), RMSNorm's backward and the QK-norm's
constexpr int NORM_WARPS = 8;
// LayerNorm's backward block, each warp with its own 2·C floats of shared memory
constexpr int LAYERNORM_BWD_WARPS = 4;

constexpr int norm_max_channels(Norm kind) { return kind == Norm::LayerNorm ? LAYERNORM_MAX_C : RMSNORM_MAX_C; }
__host__ __device__ constexpr int norm_backward_warps(Norm kind) {
    return kind == Norm::LayerNorm ? LAYERNORM_BWD_WARPS : NORM_WARPS;
}
// the parameter-gradient sums a channel has: Σ dout·norm, and LayerNorm's Σ dout (the bias)
__host__ __device__ constexpr int norm_param_sums(Norm kind) { return kind == Norm::LayerNorm ? 2 : 1; }

// calls launch(std::integral_constant<Norm, kind>) for the kind given at run time
template <typename Launch>
inline void with_norm_kind(Norm kind, Launch&& launch) {
    if (kind == Norm::LayerNorm) launch(std::integral_constant<Norm, Norm::LayerNorm>{});
    else launch(std::integral_constant<Norm, Norm::RMSNorm>{});
}

// calls launch(std::integral_constant<int, K>, std::integral_constant<int, W>) with the row layout for C channels:
// W warps of K vectors per thread, K · W · 256 ≥ C
template <Norm kind, typename Launch>
inline void norm_with_row_layout(int C, Launch&& launch) {
    using I1 = std::integral_constant<int, 1>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    if (C <= 1024) launch(I4{}, I1{});
    else if (C <= 2048) launch(I8{}, I1{});
    else if constexpr (kind == Norm::LayerNorm) launch(std::integral_constant<int, 16>{}, I1{});
    else if (C <= 4096) launch(I8{}, std::integral_constant<int, 2>{});
    else if (C <= 8192) launch(I8{}, I4{});
    else launch(I8{}, I8{});
}

inline void norm_check_shape(const char* what, Norm kind, int C, std::initializer_list<const void*> pointers) {
    if (C <= 0 || C % 8 != 0 || C > norm_max_channels(kind))
        fail("%s: C = %d must be a positive multiple of 8, at most %d", what, C, norm_max_channels(kind));
    for (const void* p : pointers) require_aligned_16(what, p);
}

inline void qk_norm_check_pointers(const char* what, std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (reinterpret_cast<uintptr_t>(p) % 4 != 0) fail("%s: a pointer is not 4-byte aligned", what);
}

// Σ v over the W warps of this thread's row group, the same bits in every thread of the group. For W > 1 every
// thread of the block must call it (it holds a block barrier), and the next call must not write `slots` (one
// float per warp of the block) while a slow thread may still read them: callers alternate two, so that the
// barrier of the call in between keeps each write after the reads of the same slots.
template <int W>
static __device__ __forceinline__ float norm_row_sum(float v, float* slots) {
    v = warp_sum(v);
    if constexpr (W == 1) {
        return v;
    } else {
        int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 == 0) slots[warp] = v;
        __syncthreads();
        int first = warp / W * W;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < W; w++) total += slots[first + w];
        return total;
    }
}

// ----------------------------------------------------------------------------------------------------------
// forward

// a row layout's forward; inp2 may be null (a plain norm), and residual is written only when it is given. mean
// and bias are LayerNorm's (null for RMSNorm)
template <Norm kind, int K, int W>
static __global__ void __launch_bounds__(NORM_WARPS * 32)
    norm_forward_kernel(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1, const bf16* inp2,
                        const bf16* weight, const bf16* bias, long N, int C, float eps) {
    __shared__ float slots[2][NORM_WARPS];
    int t = threadIdx.x % (32 * W);
    long n = (long)blockIdx.x * (NORM_WARPS / W) + threadIdx.x / (32 * W);
    bool active = n < N;  // the last block's spare groups still join the row sums' barriers
    long row = n * C;
    bf16x8 x[K];
    if (active) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 * W + t) * 8;
            if (c < C) x[k] = *reinterpret_cast<const bf16x8*>(inp1 + row + c);
        }
        if (inp2) {
            bf16x8 y[K];
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c < C) y[k] = *reinterpret_cast<const bf16x8*>(inp2 + row + c);
            }
            // the residual stream stores bf16(inp1 + inp2), and that stored value is what the norm normalizes
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                float a[8], b[8];
                unpack_bf16x8(x[k], a);
                unpack_bf16x8(y[k], b);
                for (int j = 0; j < 8; j++) a[j] += b[j];
                x[k] = pack_bf16x8(a);
                *reinterpret_cast<bf16x8*>(residual + row + c) = x[k];
            }
        }
    }
    // this thread's Σ term(x) over its values of the row, in the same order for both sums
    auto thread_sum = [&](auto term) {
        float sum = 0.0f;
        if (active) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                if ((k * 32 * W + t) * 8 >= C) continue;
                float f[8];
                unpack_bf16x8(x[k], f);
                for (int j = 0; j < 8; j++) sum += term(f[j]);
            }
        }
        return sum;
    };
    // as on the CPU: RMSNorm's centre is 0, and its Σ x² the variance's loop
    float m = 0.0f;
    if constexpr (kind == Norm::LayerNorm) m = norm_row_sum<W>(thread_sum([](float v) { return v; }), slots[0]) / C;
    float var = thread_sum([m](float v) { return (v - m) * (v - m); });
    float s = rsqrtf(norm_row_sum<W>(var, slots[1]) / C + eps);
    if (!active) return;
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 * W + t) * 8;
        if (c >= C) continue;
        float f[8], w[8];
        unpack_bf16x8(x[k], f);
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), w);
        if constexpr (kind == Norm::LayerNorm) {
            float b[8];
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(bias + c), b);
            for (int j = 0; j < 8; j++) f[j] = (f[j] - m) * s * w[j] + b[j];
        } else {
            for (int j = 0; j < 8; j++) f[j] = f[j] * s * w[j];
        }
        *reinterpret_cast<bf16x8*>(out + row + c) = pack_bf16x8(f);
    }
    if (t == 0) {
        if constexpr (kind == Norm::LayerNorm) mean[n] = m;
        rstd[n] = s;
    }
}

// the head layout's forward: one warp per (row, head) of all NH + 2·KV heads, q and k heads normed (RMSNorm), v
// heads copied
static __global__ void __launch_bounds__(NORM_WARPS * 32)
    qk_norm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight, long N,
                           int NH, int KV, int hd, float eps) {
    int lane = threadIdx.x % 32, all = NH + 2 * KV, heads = NH + KV;
    long item = (long)blockIdx.x * NORM_WARPS + threadIdx.x / 32;
    if (item >= N * all) return;
    long n = item / all;
    int h = (int)(item % all);
    const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(inp + item * hd);
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + item * hd);
    int pairs = hd / 2;
    if (h >= heads) {
        for (int p = lane; p < pairs; p += 32) o[p] = x[p];
        return;
    }
    float sum_sq = 0.0f;
    for (int p = lane; p < pairs; p += 32) {
        float2 v = __bfloat1622float2(x[p]);
        sum_sq += v.x * v.x + v.y * v.y;
    }
    float s = 1.0f / sqrtf(warp_sum(sum_sq) / hd + eps);
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(h < NH ? qweight : kweight);
    for (int p = lane; p < pairs; p += 32) {
        float2 v = __bfloat1622float2(x[p]), g = __bfloat1622float2(w[p]);
        o[p] = __floats2bfloat162_rn(v.x * s * g.x, v.y * s * g.y);
    }
    if (lane == 0) rstd[n * heads + h] = s;
}

// residual = inp1 + inp2 and out = norm(residual) when inp2 is given, else out = norm(inp1)
inline void norm_forward_launch(Norm kind, bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C, float eps,
                                cudaStream_t stream) {
    if (N == 0) return;
    with_norm_kind(kind, [&](auto kd) {
        constexpr Norm KIND = decltype(kd)::value;
        norm_with_row_layout<KIND>(C, [&](auto k, auto w) {
            constexpr int K = decltype(k)::value, W = decltype(w)::value;
            norm_forward_kernel<KIND, K, W><<<cuda_blocks(N, NORM_WARPS / W), NORM_WARPS * 32, 0, stream>>>(
                residual, out, mean, rstd, inp1, inp2, weight, bias, N, C, eps);
        });
    });
    cuda_check(cudaGetLastError());
}

// mean and bias are LayerNorm's (null for RMSNorm)
inline void norm_forward_cuda(Norm kind, bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                              const bf16* bias, long N, int C, float eps, cudaStream_t stream) {
    norm_check_shape("norm_forward_cuda", kind, C, {out, inp, weight, bias});
    norm_forward_launch(kind, nullptr, out, mean, rstd, inp, nullptr, weight, bias, N, C, eps, stream);
}

// residual = inp1 + inp2, then out = norm(residual): the residual connection and the next norm. residual may be
// inp1 or inp2 (the stream updated in place), and out may alias either input, but not residual.
inline void fused_residual_norm_forward_cuda(Norm kind, bf16* residual, bf16* out, float* mean, float* rstd,
                                             const bf16* inp1, const bf16* inp2, const bf16* weight, const bf16* bias,
                                             long N, int C, float eps, cudaStream_t stream) {
    norm_check_shape("fused_residual_norm_forward_cuda", kind, C, {residual, out, inp1, inp2, weight, bias});
    if (!residual || !inp2) fail("fused_residual_norm_forward_cuda: residual and inp2 are required");
    norm_forward_launch(kind, residual, out, mean, rstd, inp1, inp2, weight, bias, N, C, eps, stream);
}

inline void qk_norm_forward_cuda(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight,
                                 long N, int NH, int KV, int hd, float eps, cudaStream_t stream) {
    qk_norm_check_shape("qk_norm_forward_cuda", NH, KV, hd);
    qk_norm_check_pointers("qk_norm_forward_cuda", {out, inp, qweight, kweight});
    long items = N * (NH + 2 * KV);
    if (items == 0) return;
    qk_norm_forward_kernel<<<cuda_blocks(items, NORM_WARPS), NORM_WARPS * 32, 0, stream>>>(
        out, rstd, inp, qweight, kweight, N, NH, KV, hd, eps);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// backward

// rows per backward block, a function of N alone (so the summation order, and the bits, do not depend on the
// GPU): about 1024 blocks to fill any GPU, and at least 16 rows each so the partial sums stay a small fraction
// of the traffic
inline int norm_backward_rows_per_block(long N) {
    int rows = 16;
    while (rows < 64 && (long)rows * 1024 < N) rows *= 2;
    return rows;
}
inline long norm_backward_blocks(long N) {
    long rows = norm_backward_rows_per_block(N);
    return (N + rows - 1) / rows;
}

// the backward's partial sums: a block's sums of every channel, norm_param_sums(kind)·C floats for a row norm and
// 2·hd (qweight's, kweight's) for the QK-norm
inline long norm_backward_scratch_floats(Norm kind, long N, int C) {
    return norm_backward_blocks(N) * norm_param_sums(kind) * (long)C;
}
inline long qk_norm_backward_scratch_floats(long N, int hd) { return norm_backward_blocks(N) * 2 * (long)hd; }

// the dynamic shared memory of a row layout's backward block: each row group's sums, at most 128 KiB
// (LayerNorm's 4 warps of 2 · 4096 floats) and 64 KiB for RMSNorm (K = 8 vectors of 8 channels for each of the
// group's 32 · W threads, 8 / W groups)
template <Norm kind, int K, int W>
constexpr int norm_backward_max_shared_bytes() {
    return norm_backward_warps(kind) / W * norm_param_sums(kind) * (K * 8 * 32 * W) * (int)sizeof(float);
}

// a row layout's backward: partial[block] = the block's rows' Σ dout·norm (and LayerNorm's Σ dout),
// norm_param_sums(kind)·C floats; dinp += the input gradient
template <Norm kind, int K, int W>
static __global__ void __launch_bounds__(norm_backward_warps(kind) * 32)
    norm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                         const float* mean, const float* rstd, long N, int C, int rows_per_block) {
    constexpr int WARPS = norm_backward_warps(kind), GROUPS = WARPS / W, SUMS = norm_param_sums(kind);
    extern __shared__ float4 group_sums_storage[];  // float4: the 16-byte alignment the vector accesses need
    float* group_sums = reinterpret_cast<float*>(group_sums_storage);  // [group][SUMS·C]: Σ dout·norm, Σ dout
    __shared__ float slots[2][WARPS];
    int t = threadIdx.x % (32 * W), group = threadIdx.x / (32 * W);
    float* my_sums = group_sums + (long)group * SUMS * C;
    // each thread zeroes and then adds into exactly the channels it holds, so no barrier is needed before the end
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 * W + t) * 8;
        if (c >= C) continue;
        for (int i = 0; i < SUMS; i++) {
            float4* acc = reinterpret_cast<float4*>(my_sums + i * C + c);
            acc[0] = acc[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    long r0 = (long)blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, N);
    // every group takes the same number of steps, active or not, because a row sum may hold a block barrier
    for (int step = 0; step * GROUPS < rows_per_block; step++) {
        long n = r0 + (long)step * GROUPS + group;
        bool active = n < r1;
        long row = n * C;
        float m = kind == Norm::LayerNorm && active ? mean[n] : 0.0f, s = active ? rstd[n] : 0.0f;
        bf16x8 x[K], d[K], g[K];
        // LayerNorm: Σ dnorm and Σ dnorm·norm over this thread's channels, with dnorm = dout·weight; RMSNorm:
        // Σ dout·weight·x
        float sum1 = 0.0f, sum2 = 0.0f;
        if (active) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                x[k] = *reinterpret_cast<const bf16x8*>(inp + row + c);
                d[k] = *reinterpret_cast<const bf16x8*>(dout + row + c);
                g[k] = *reinterpret_cast<const bf16x8*>(dinp + row + c);
            }
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                float xf[8], df[8], wf[8];
                unpack_bf16x8(x[k], xf);
                unpack_bf16x8(d[k], df);
                unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
                float4* dw = reinterpret_cast<float4*>(my_sums + c);
                float4 dw0 = dw[0], dw1 = dw[1];
                if constexpr (kind == Norm::LayerNorm) {
                    float4* db = reinterpret_cast<float4*>(my_sums + C + c);
                    float4 db0 = db[0], db1 = db[1];
                    float norm[8];
                    for (int j = 0; j < 8; j++) {
                        norm[j] = (xf[j] - m) * s;
                        float dnorm = df[j] * wf[j];
                        sum1 += dnorm;
                        sum2 += dnorm * norm[j];
                    }
                    dw0.x += df[0] * norm[0], dw0.y += df[1] * norm[1], dw0.z += df[2] * norm[2];
                    dw0.w += df[3] * norm[3], dw1.x += df[4] * norm[4], dw1.y += df[5] * norm[5];
                    dw1.z += df[6] * norm[6], dw1.w += df[7] * norm[7];
                    db0.x += df[0], db0.y += df[1], db0.z += df[2], db0.w += df[3];
                    db1.x += df[4], db1.y += df[5], db1.z += df[6], db1.w += df[7];
                    db[0] = db0, db[1] = db1;
                } else {
                    for (int j = 0; j < 8; j++) sum1 += df[j] * wf[j] * xf[j];
                    dw0.x += df[0] * xf[0] * s, dw0.y += df[1] * xf[1] * s, dw0.z += df[2] * xf[2] * s;
                    dw0.w += df[3] * xf[3] * s, dw1.x += df[4] * xf[4] * s, dw1.y += df[5] * xf[5] * s;
                    dw1.z += df[6] * xf[6] * s, dw1.w += df[7] * xf[7] * s;
                }
                dw[0] = dw0, dw[1] = dw1;
            }
        }
        // LayerNorm: dx = s · (dnorm - mean(dnorm) - norm · mean(dnorm·norm)); RMSNorm:
        // dx = s · (dnorm - x · s² · mean(dnorm·x)). LayerNorm's two row sums take the two slot sets, RMSNorm's one
        // alternates them by step.
        float mean1, mean2 = 0.0f;
        if constexpr (kind == Norm::LayerNorm) {
            mean1 = norm_row_sum<W>(sum1, slots[0]) / C;
            mean2 = norm_row_sum<W>(sum2, slots[1]) / C;
        } else {
            mean1 = norm_row_sum<W>(sum1, slots[step % 2]) / C;
        }
        if (!active) continue;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 * W + t) * 8;
            if (c >= C) continue;
            float xf[8], df[8], wf[8], gf[8];
            unpack_bf16x8(x[k], xf);
            unpack_bf16x8(d[k], df);
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
            unpack_bf16x8(g[k], gf);
            if constexpr (kind == Norm::LayerNorm)
                for (int j = 0; j < 8; j++) gf[j] += s * (df[j] * wf[j] - mean1 - (xf[j] - m) * s * mean2);
            else
                for (int j = 0; j < 8; j++) gf[j] += s * (df[j] * wf[j] - xf[j] * s * s * mean1);
            *reinterpret_cast<bf16x8*>(dinp + row + c) = pack_bf16x8(gf);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < SUMS * C; c += blockDim.x) {
        float total = 0.0f;
        for (int gi = 0; gi < GROUPS; gi++) total += group_sums[(long)gi * SUMS * C + c];
        partial[(long)blockIdx.x * SUMS * C + c] = total;
    }
}

// the head layout's backward: partial[block] = (Σ dout·x·rstd over the block's rows' query heads, ... key heads),
// 2·hd floats; dinp = the input gradient (v's heads: dout's)
static __global__ void __launch_bounds__(NORM_WARPS * 32)
    qk_norm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* qweight,
                            const bf16* kweight, const float* rstd, long N, int NH, int KV, int hd,
                            int rows_per_block) {
    extern __shared__ float warp_sums[];  // [warp][2·hd]: query channels, then key channels
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, all = NH + 2 * KV, heads = NH + KV, pairs = hd / 2;
    float* mine = warp_sums + (long)warp * 2 * hd;
    for (int c = lane; c < 2 * hd; c += 32) mine[c] = 0.0f;
    long r0 = (long)blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, N);
    for (long item = r0 * all + warp; item < r1 * all; item += NORM_WARPS) {
        long n = item / all;
        int h = (int)(item % all);
        const __nv_bfloat162* d = reinterpret_cast<const __nv_bfloat162*>(dout + item * hd);
        __nv_bfloat162* dx = reinterpret_cast<__nv_bfloat162*>(dinp + item * hd);
        if (h >= heads) {
            if (dinp != dout)
                for (int p = lane; p < pairs; p += 32) dx[p] = d[p];
            continue;
        }
        const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(inp + item * hd);
        const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(h < NH ? qweight : kweight);
        float* sums = mine + (h < NH ? 0 : hd);
        float s = rstd[n * heads + h], gx = 0.0f;
        for (int p = lane; p < pairs; p += 32) {
            float2 xv = __bfloat1622float2(x[p]), dv = __bfloat1622float2(d[p]), wv = __bfloat1622float2(w[p]);
            gx += dv.x * wv.x * xv.x + dv.y * wv.y * xv.y;
            sums[2 * p] += dv.x * xv.x * s, sums[2 * p + 1] += dv.y * xv.y * s;
        }
        float gx_mean = warp_sum(gx) / hd;
        // dx = s · (g - x · s² · mean(g·x)), with g = dout · weight; each lane writes only what it has read
        for (int p = lane; p < pairs; p += 32) {
            float2 xv = __bfloat1622float2(x[p]), dv = __bfloat1622float2(d[p]), wv = __bfloat1622float2(w[p]);
            dx[p] = __floats2bfloat162_rn(s * (dv.x * wv.x - xv.x * s * s * gx_mean),
                                          s * (dv.y * wv.y - xv.y * s * s * gx_mean));
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * hd; c += blockDim.x) {
        float total = 0.0f;
        for (int w = 0; w < NORM_WARPS; w++) total += warp_sums[(long)w * 2 * hd + c];
        partial[(long)blockIdx.x * 2 * hd + c] = total;
    }
}

// The parameter gradients from the blocks' partials of `cols` columns: first += Σ over blocks of columns [0, C),
// second += Σ of [C, cols) (LayerNorm's bias, the QK-norm's kweight; RMSNorm has C columns alone), in block order
// split in a fixed way: a block takes 32 columns (a warp reads them as one 128-byte line), warp w of PHASES sums
// the partial rows w, w + PHASES, ... in order, and warp 0 adds the warp sums in warp order. The row norms take 32
// phases; the QK-norm one, each column's partials added in block order end to end.
template <int PHASES>
static __global__ void __launch_bounds__(PHASES * 32)
    norm_param_grad_kernel(bf16* first, bf16* second, const float* partial, long blocks, int C, int cols) {
    __shared__ float warp_sums[PHASES][33];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int col = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (col < cols) {
#pragma unroll 8  // eight loads in flight before the adds that wait on them
        for (long b = warp; b < blocks; b += PHASES) s += partial[b * cols + col];
    }
    warp_sums[warp][lane] = s;
    __syncthreads();
    if (warp != 0 || col >= cols) return;
    float total = 0.0f;
    for (int w = 0; w < PHASES; w++) total += warp_sums[w][lane];
    bf16* dst = col < C ? first + col : second + (col - C);
    *dst = __float2bfloat16(__bfloat162float(*dst) + total);
}

constexpr int NORM_PARAM_GRAD_PHASES = 32;

// the row layout's backward kernel for C channels, into the blocks' partial sums
template <Norm kind>
inline void norm_backward_launch(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                                 const float* mean, const float* rstd, long N, int C, cudaStream_t stream) {
    norm_with_row_layout<kind>(C, [&](auto k, auto w) {
        constexpr int K = decltype(k)::value, W = decltype(w)::value;
        // above 48 KiB a kernel must ask for its shared memory; ask once for the most this layout can need
        static bool raised = [] {
            cuda_check(cudaFuncSetAttribute(norm_backward_kernel<kind, K, W>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            norm_backward_max_shared_bytes<kind, K, W>()));
            return true;
        }();
        (void)raised;
        size_t shared_bytes = (size_t)(norm_backward_warps(kind) / W) * norm_param_sums(kind) * C * sizeof(float);
        norm_backward_kernel<kind, K, W>
            <<<(unsigned int)norm_backward_blocks(N), norm_backward_warps(kind) * 32, shared_bytes, stream>>>(
                dinp, partial, dout, inp, weight, mean, rstd, N, C, norm_backward_rows_per_block(N));
    });
    cuda_check(cudaGetLastError());
}

// dinp, dweight and dbias (LayerNorm's; null for RMSNorm) accumulate (+=), as on the CPU; scratch holds
// norm_backward_scratch_floats(kind, N, C)
inline void norm_backward_cuda(Norm kind, bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                               const bf16* weight, const float* mean, const float* rstd, long N, int C,
                               float* scratch, cudaStream_t stream) {
    norm_check_shape("norm_backward_cuda", kind, C, {dinp, dout, inp, weight});
    if (N == 0) return;
    with_norm_kind(kind, [&](auto kd) {
        norm_backward_launch<decltype(kd)::value>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, stream);
    });
    int cols = norm_param_sums(kind) * C;
    norm_param_grad_kernel<NORM_PARAM_GRAD_PHASES><<<cuda_blocks(cols, 32), NORM_PARAM_GRAD_PHASES * 32, 0, stream>>>(
        dweight, dbias, scratch, norm_backward_blocks(N), C, cols);
    cuda_check(cudaGetLastError());
}

// dinp = the input gradient (dinp may be dout), dqweight and dkweight accumulate (+=), as on the CPU; scratch
// holds qk_norm_backward_scratch_floats(N, hd)
inline void qk_norm_backward_cuda(bf16* dinp, bf16* dqweight, bf16* dkweight, const bf16* dout, const bf16* inp,
                                  const bf16* qweight, const bf16* kweight, const float* rstd, long N, int NH, int KV,
                                  int hd, float* scratch, cudaStream_t stream) {
    qk_norm_check_shape("qk_norm_backward_cuda", NH, KV, hd);
    qk_norm_check_pointers("qk_norm_backward_cuda", {dinp, dqweight, dkweight, dout, inp, qweight, kweight});
    if (N == 0) return;
    int rows = norm_backward_rows_per_block(N);
    long blocks = norm_backward_blocks(N);
    size_t shared_bytes = (size_t)NORM_WARPS * 2 * hd * sizeof(float);  // at most 64 KiB (hd 1024)
    static bool raised = [] {
        cuda_check(cudaFuncSetAttribute(qk_norm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        NORM_WARPS * 2 * 1024 * (int)sizeof(float)));
        return true;
    }();
    (void)raised;
    qk_norm_backward_kernel<<<(unsigned int)blocks, NORM_WARPS * 32, shared_bytes, stream>>>(
        dinp, scratch, dout, inp, qweight, kweight, rstd, N, NH, KV, hd, rows);
    cuda_check(cudaGetLastError());
    norm_param_grad_kernel<1><<<cuda_blocks(2 * hd, 32), 32, 0, stream>>>(dqweight, dkweight, scratch, blocks, hd,
                                                                          2 * hd);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU loops above for float and, for bf16, the kernels. mean and bias are
// LayerNorm's (null for RMSNorm). The backwards take the model's workspace for the kernels' partial sums (the CPU
// needs none).

#include "llmc/device.cuh"
#include "llmc/residual.cuh"

inline void norm_forward(Norm kind, float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, long N, int C, float eps) {
    ProfileScope op("norm forward");
    NormLayout rows = NormLayout::row(N, C);
    if (kind == Norm::LayerNorm)
        norm_forward_cpu<Norm::LayerNorm>(out, mean, rstd, inp, weight, nullptr, bias, rows, eps);
    else norm_forward_cpu<Norm::RMSNorm>(out, mean, rstd, inp, weight, nullptr, bias, rows, eps);
}
// residual = inp1 + inp2, out = norm(residual); residual may be inp1 or inp2, out a buffer of its own
inline void fused_residual_norm_forward(Norm kind, float* residual, float* out, float* mean, float* rstd,
                                        const float* inp1, const float* inp2, const float* weight, const float* bias,
                                        long N, int C, float eps) {
    ProfileScope op("norm forward");
    residual_forward(residual, inp1, inp2, N * C);
    norm_forward(kind, out, mean, rstd, residual, weight, bias, N, C, eps);
}
// dinp, dweight and dbias accumulate (+=): dinp is the residual stream's gradient, which the norm adds to
inline void norm_backward(Norm kind, float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, long N, int C, Workspace) {
    ProfileScope op("norm backward");
    NormLayout rows = NormLayout::row(N, C);
    if (kind == Norm::LayerNorm)
        norm_backward_cpu<Norm::LayerNorm>(dinp, dweight, nullptr, dbias, dout, inp, weight, nullptr, mean, rstd, rows);
    else norm_backward_cpu<Norm::RMSNorm>(dinp, dweight, nullptr, dbias, dout, inp, weight, nullptr, mean, rstd, rows);
}
// the QK-norm on the packed qkv: out (a buffer of its own: backward needs the input) gets q and k normed, v copied
inline void qk_norm_forward(float* out, float* rstd, const float* inp, const float* qweight, const float* kweight,
                            long N, int NH, int KV, int hd, float eps) {
    ProfileScope op("norm forward");
    qk_norm_check_shape("qk_norm_forward", NH, KV, hd);
    norm_forward_cpu<Norm::RMSNorm>(out, nullptr, rstd, inp, qweight, kweight, nullptr,
                                    NormLayout::heads(N, NH, KV, hd), eps);
}
// dinp = the input gradient (dinp may be dout: in place), v's passed through; dqweight and dkweight accumulate
inline void qk_norm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout, const float* inp,
                             const float* qweight, const float* kweight, const float* rstd, long N, int NH, int KV,
                             int hd, Workspace) {
    ProfileScope op("norm backward");
    qk_norm_check_shape("qk_norm_backward", NH, KV, hd);
    norm_backward_cpu<Norm::RMSNorm>(dinp, dqweight, dkweight, nullptr, dout, inp, qweight, kweight, nullptr, rstd,
                                     NormLayout::heads(N, NH, KV, hd));
}

inline void norm_forward(Norm kind, bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                         const bf16* bias, long N, int C, float eps) {
    ProfileScope op("norm forward");
    norm_forward_cuda(kind, out, mean, rstd, inp, weight, bias, N, C, eps, main_stream());
}
inline void fused_residual_norm_forward(Norm kind, bf16* residual, bf16* out, float* mean, float* rstd,
                                        const bf16* inp1, const bf16* inp2, const bf16* weight, const bf16* bias,
                                        long N, int C, float eps) {
    ProfileScope op("norm forward");
    fused_residual_norm_forward_cuda(kind, residual, out, mean, rstd, inp1, inp2, weight, bias, N, C, eps,
                                     main_stream());
}
inline void norm_backward(Norm kind, bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                          const bf16* weight, const float* mean, const float* rstd, long N, int C,
                          Workspace workspace) {
    ProfileScope op("norm backward");
    float* scratch = workspace.take((size_t)norm_backward_scratch_floats(kind, N, C), "norm_backward");
    norm_backward_cuda(kind, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch, main_stream());
}
inline void qk_norm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight, long N,
                            int NH, int KV, int hd, float eps) {
    ProfileScope op("norm forward");
    qk_norm_forward_cuda(out, rstd, inp, qweight, kweight, N, NH, KV, hd, eps, main_stream());
}
inline void qk_norm_backward(bf16* dinp, bf16* dqweight, bf16* dkweight, const bf16* dout, const bf16* inp,
                             const bf16* qweight, const bf16* kweight, const float* rstd, long N, int NH, int KV,
                             int hd, Workspace workspace) {
    ProfileScope op("norm backward");
    float* scratch = workspace.take((size_t)qk_norm_backward_scratch_floats(N, hd), "qk_norm_backward");
    qk_norm_backward_cuda(dinp, dqweight, dkweight, dout, inp, qweight, kweight, rstd, N, NH, KV, hd, scratch,
                          main_stream());
}

// QK-norm, Qwen3's: before RoPE, every query head and every key head goes through an RMSNorm over its hd
// values, q = x · rstd · qweight and k = x · rstd · kweight with rstd = 1/sqrt(mean(x²) + eps), one hd-weight for
// all query heads and one for all key heads (Hugging Face's Qwen3RMSNorm on q_proj's and k_proj's outputs seen
// as heads). It steadies the attention logits; the values are left alone.
//
// It works on the packed qkv of llmc/attention.cuh: N rows of (NH + 2·KV)·hd values, NH query heads, KV key
// heads, then KV value heads, each head hd contiguous values. The forward reads the matmul's output and writes
// attention's input (a buffer of its own: backward needs the input), q and k normed, v copied, and keeps each
// q and k head's rstd (N × (NH + KV) floats). The backward writes the input's gradient (dinp may be dout: in
// place), v's passed through, and adds the weights' gradients (+=).
//
// The same shape as llmc/rmsnorm.cuh: a CPU reference in fp32 loops, CUDA kernels on bf16 with fp32 statistics,
// and entry points overloaded on the storage type.
#pragma once

#include <cmath>

#include "llmc/utils.h"

inline void qk_norm_check_shape(const char* what, int NH, int KV, int hd) {
    if (NH < 1 || KV < 1 || hd < 2 || hd % 2 != 0 || hd > 1024)
        fail("%s: NH = %d, KV = %d, hd = %d: need heads >= 1 and an even head size of at most 1024", what, NH, KV, hd);
}

inline void qk_norm_forward(float* out, float* rstd, const float* inp, const float* qweight, const float* kweight,
                            long N, int NH, int KV, int hd, float eps) {
    qk_norm_check_shape("qk_norm_forward", NH, KV, hd);
    int heads = NH + KV;  // normed; the KV value heads after them are copied
    long width = (long)(NH + 2 * KV) * hd;
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        for (int h = 0; h < heads; h++) {
            const float* x = inp + n * width + (long)h * hd;
            const float* w = h < NH ? qweight : kweight;
            float sum_sq = 0.0f;
            for (int c = 0; c < hd; c++) sum_sq += x[c] * x[c];
            float s = 1.0f / sqrtf(sum_sq / hd + eps);
            float* o = out + n * width + (long)h * hd;
            for (int c = 0; c < hd; c++) o[c] = x[c] * s * w[c];
            rstd[n * heads + h] = s;
        }
        for (long c = (long)heads * hd; c < width; c++) out[n * width + c] = inp[n * width + c];
    }
}

inline void qk_norm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout, const float* inp,
                             const float* qweight, const float* kweight, const float* rstd, long N, int NH, int KV,
                             int hd) {
    qk_norm_check_shape("qk_norm_backward", NH, KV, hd);
    int heads = NH + KV;
    long width = (long)(NH + 2 * KV) * hd;
    // the weights' gradients first, while dout is whole (dinp may overwrite it): Σ over rows and heads of
    // dout·x·rstd, split by channel so each sum has one owner and a fixed order
#pragma omp parallel for
    for (int c = 0; c < hd; c++) {
        float q = 0.0f, k = 0.0f;
        for (long n = 0; n < N; n++)
            for (int h = 0; h < heads; h++) {
                long at = n * width + (long)h * hd + c;
                (h < NH ? q : k) += dout[at] * inp[at] * rstd[n * heads + h];
            }
        dqweight[c] += q, dkweight[c] += k;
    }
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        for (int h = 0; h < heads; h++) {
            const float* x = inp + n * width + (long)h * hd;
            const float* d = dout + n * width + (long)h * hd;
            const float* w = h < NH ? qweight : kweight;
            float s = rstd[n * heads + h];
            // dx = s · (g - x · s² · mean(g·x)), with g = dout · weight, as RMSNorm's
            float gx_mean = 0.0f;
            for (int c = 0; c < hd; c++) gx_mean += d[c] * w[c] * x[c];
            gx_mean /= hd;
            float* dx = dinp + n * width + (long)h * hd;
            for (int c = 0; c < hd; c++) dx[c] = s * (d[c] * w[c] - x[c] * s * s * gx_mean);
        }
        if (dinp != dout)
            for (long c = (long)heads * hd; c < width; c++) dinp[n * width + c] = dout[n * width + c];
    }
}

// ==========================================================================================================
// CUDA. A head is one warp's: hd ≤ 1024 values, two bf16 per lane per access (a warp reads 128 contiguous
// bytes), the head's statistic a warp sum, so no block barrier. The forward gives a warp each head of a row in
// turn, v's heads copied. The backward's weight gradients sum over every row and head: each block takes a fixed
// range of rows, each warp adds its heads' dout·x·rstd into its own 2·hd floats of shared memory (a lane into
// its own channels: no atomics), and the block adds its warps' sums in warp order into one partial sum per block;
// a second kernel adds the blocks' partials in block order. Every sum has a fixed order, so the bits are
// reproducible. hd must be even and the pointers 4-byte aligned; the entry points check.

#include "llmc/cuda_common.cuh"
#include "llmc/layernorm.cuh"

constexpr int QK_NORM_WARPS = 8;

static __device__ __forceinline__ float qk_norm_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// one warp per (row, head) of all NH + 2·KV heads: q and k heads normed, v heads copied
static __global__ void __launch_bounds__(QK_NORM_WARPS * 32)
    qk_norm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight, long N,
                           int NH, int KV, int hd, float eps) {
    int lane = threadIdx.x % 32, all = NH + 2 * KV, heads = NH + KV;
    long item = (long)blockIdx.x * QK_NORM_WARPS + threadIdx.x / 32;
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
    float s = 1.0f / sqrtf(qk_norm_warp_sum(sum_sq) / hd + eps);
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(h < NH ? qweight : kweight);
    for (int p = lane; p < pairs; p += 32) {
        float2 v = __bfloat1622float2(x[p]), g = __bfloat1622float2(w[p]);
        o[p] = __floats2bfloat162_rn(v.x * s * g.x, v.y * s * g.y);
    }
    if (lane == 0) rstd[n * heads + h] = s;
}

// partial[block] = (Σ dout·x·rstd over the block's rows' query heads, ... key heads), 2·hd floats; dinp = the
// input gradient (v's heads: dout's)
static __global__ void __launch_bounds__(QK_NORM_WARPS * 32)
    qk_norm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* qweight,
                            const bf16* kweight, const float* rstd, long N, int NH, int KV, int hd,
                            int rows_per_block) {
    extern __shared__ float warp_sums[];  // [warp][2·hd]: query channels, then key channels
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, all = NH + 2 * KV, heads = NH + KV, pairs = hd / 2;
    float* mine = warp_sums + (long)warp * 2 * hd;
    for (int c = lane; c < 2 * hd; c += 32) mine[c] = 0.0f;
    long r0 = (long)blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, N);
    for (long item = r0 * all + warp; item < r1 * all; item += QK_NORM_WARPS) {
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
        float gx_mean = qk_norm_warp_sum(gx) / hd;
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
        for (int w = 0; w < QK_NORM_WARPS; w++) total += warp_sums[(long)w * 2 * hd + c];
        partial[(long)blockIdx.x * 2 * hd + c] = total;
    }
}

// dqweight and dkweight += Σ over blocks of partial[.][0:hd] and [hd:2·hd], in block order: a thread a column
static __global__ void qk_norm_param_grad_kernel(bf16* dqweight, bf16* dkweight, const float* partial, long blocks,
                                                 int hd) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= 2 * hd) return;
    float total = 0.0f;
    for (long b = 0; b < blocks; b++) total += partial[b * 2 * hd + col];
    bf16* dw = col < hd ? dqweight + col : dkweight + (col - hd);
    *dw = __float2bfloat16(__bfloat162float(*dw) + total);
}

inline void qk_norm_check_pointers(const char* what, std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (reinterpret_cast<uintptr_t>(p) % 4 != 0) fail("%s: a pointer is not 4-byte aligned", what);
}

inline void qk_norm_forward_cuda(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight,
                                 long N, int NH, int KV, int hd, float eps, cudaStream_t stream) {
    qk_norm_check_shape("qk_norm_forward_cuda", NH, KV, hd);
    qk_norm_check_pointers("qk_norm_forward_cuda", {out, inp, qweight, kweight});
    long items = N * (NH + 2 * KV);
    if (items == 0) return;
    qk_norm_forward_kernel<<<cuda_blocks(items, QK_NORM_WARPS), QK_NORM_WARPS * 32, 0, stream>>>(
        out, rstd, inp, qweight, kweight, N, NH, KV, hd, eps);
    cuda_check(cudaGetLastError());
}

// the backward's partial sums: 2·hd floats for each block of norm_backward_rows_per_block rows
inline long qk_norm_backward_scratch_floats(long N, int hd) {
    long rows = norm_backward_rows_per_block(N);
    return (N + rows - 1) / rows * 2 * (long)hd;
}

inline void qk_norm_backward_cuda(bf16* dinp, bf16* dqweight, bf16* dkweight, const bf16* dout, const bf16* inp,
                                  const bf16* qweight, const bf16* kweight, const float* rstd, long N, int NH, int KV,
                                  int hd, float* scratch, cudaStream_t stream) {
    qk_norm_check_shape("qk_norm_backward_cuda", NH, KV, hd);
    qk_norm_check_pointers("qk_norm_backward_cuda", {dinp, dqweight, dkweight, dout, inp, qweight, kweight});
    if (N == 0) return;
    int rows = norm_backward_rows_per_block(N);
    long blocks = (N + rows - 1) / rows;
    size_t shared_bytes = (size_t)QK_NORM_WARPS * 2 * hd * sizeof(float);  // at most 64 KiB (hd 1024)
    static bool raised = [] {
        cuda_check(cudaFuncSetAttribute(qk_norm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        QK_NORM_WARPS * 2 * 1024 * (int)sizeof(float)));
        return true;
    }();
    (void)raised;
    qk_norm_backward_kernel<<<(unsigned int)blocks, QK_NORM_WARPS * 32, shared_bytes, stream>>>(
        dinp, scratch, dout, inp, qweight, kweight, rstd, N, NH, KV, hd, rows);
    cuda_check(cudaGetLastError());
    qk_norm_param_grad_kernel<<<cuda_blocks(2 * hd, 128), 128, 0, stream>>>(dqweight, dkweight, scratch, blocks, hd);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU functions above and, for bf16, the kernels

#include "llmc/device.cuh"

inline void qk_norm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* qweight, const bf16* kweight, long N,
                            int NH, int KV, int hd, float eps) {
    qk_norm_forward_cuda(out, rstd, inp, qweight, kweight, N, NH, KV, hd, eps, main_stream());
}
inline void qk_norm_backward(bf16* dinp, bf16* dqweight, bf16* dkweight, const bf16* dout, const bf16* inp,
                             const bf16* qweight, const bf16* kweight, const float* rstd, long N, int NH, int KV,
                             int hd) {
    float* scratch = gpu_scratch((size_t)qk_norm_backward_scratch_floats(N, hd), "qk_norm_backward");
    qk_norm_backward_cuda(dinp, dqweight, dkweight, dout, inp, qweight, kweight, rstd, N, NH, KV, hd, scratch,
                          main_stream());
}

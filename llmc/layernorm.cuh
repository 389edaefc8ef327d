// LayerNorm over the channel dimension (eps 1e-5, as GPT-2), forward and backward.
// The forward keeps each row's mean and 1/std so the backward need not recompute the statistics.
#pragma once

#include <cmath>

inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, long N, int C) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        float m = 0.0f;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        float* o = out + n * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * weight[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

// dinp, dweight and dbias accumulate (+=): dinp is the residual stream's gradient, which the layernorm adds to
inline void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, long N, int C) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        const float* d = dout + n * C;
        float m = mean[n], s = rstd[n];
        // dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), with dnorm = dout * weight
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int c = 0; c < C; c++) {
            float dnorm = d[c] * weight[c];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * (x[c] - m) * s;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        float* dx = dinp + n * C;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - m) * s;
            dx[c] += s * (d[c] * weight[c] - dnorm_mean - norm * dnorm_norm_mean);
        }
    }
    // parameter gradients sum over rows: split by channel so each sum has one owner and a fixed order
    constexpr int CHUNK = 32;
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
        int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
        for (long n = 0; n < N; n++) {
            const float* x = inp + n * C;
            const float* d = dout + n * C;
            for (int c = c0; c < c1; c++) {
                dweight[c] += d[c] * (x[c] - mean[n]) * rstd[n];
                dbias[c] += d[c];
            }
        }
    }
}

// ==========================================================================================================
// CUDA. Both directions are memory-bound (a few FLOPs per byte). The forward fuses the residual add that
// precedes every layernorm in GPT-2, so the residual stream is read twice and written once instead of being
// written by one kernel and re-read by the next. A warp owns a row (C ≤ a few thousand: the row stays in L1
// between its passes, so the second and third reads cost no DRAM traffic). The backward's weight and bias
// gradients are sums over all rows: each block sums a fixed range of rows in order and a second pass adds the
// blocks' partial sums in block order, so the result is bit-reproducible without atomics. C must be even.

#include "llmc/cuda_common.cuh"

// x = inp1 + inp2 rounded to bf16 (the value the residual stream stores, which the backward will see), or inp1
static __device__ __forceinline__ float2 layernorm_input(const bf16* inp1, const bf16* inp2, long i) {
    float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp1 + i));
    if (!inp2) return a;
    float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp2 + i));
    return __bfloat1622float2(__floats2bfloat162_rn(a.x + b.x, a.y + b.y));
}

static __global__ void layernorm_forward_kernel(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                                const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C) {
    long n = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (n >= N) return;
    const bf16* a = inp1 + n * C;
    const bf16* b = inp2 ? inp2 + n * C : nullptr;
    float sum = 0.0f;
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input(a, b, c);
        if (residual) *reinterpret_cast<__nv_bfloat162*>(residual + n * C + c) = __floats2bfloat162_rn(x.x, x.y);
        sum += x.x + x.y;
    }
    float m = warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input(a, b, c);
        var += (x.x - m) * (x.x - m) + (x.y - m) * (x.y - m);
    }
    float s = rsqrtf(warp_sum(var) / C + 1e-5f);
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input(a, b, c);
        float2 w = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
        float2 bi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + c));
        *reinterpret_cast<__nv_bfloat162*>(out + n * C + c) =
            __floats2bfloat162_rn((x.x - m) * s * w.x + bi.x, (x.y - m) * s * w.y + bi.y);
    }
    if (lane == 0) {
        mean[n] = m;
        rstd[n] = s;
    }
}

inline void layernorm_forward_cuda(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                                   const bf16* bias, long N, int C, cudaStream_t stream) {
    layernorm_forward_kernel<<<cuda_blocks(N, 8), 256, 0, stream>>>(nullptr, out, mean, rstd, inp, nullptr, weight,
                                                                   bias, N, C);
    cuda_check(cudaGetLastError());
}

// residual = inp1 + inp2, then out = layernorm(residual): the residual connection and the next layernorm
inline void fused_residual_layernorm_forward_cuda(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                                  const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C,
                                                  cudaStream_t stream) {
    layernorm_forward_kernel<<<cuda_blocks(N, 8), 256, 0, stream>>>(residual, out, mean, rstd, inp1, inp2, weight,
                                                                   bias, N, C);
    cuda_check(cudaGetLastError());
}

constexpr int LAYERNORM_BWD_ROWS = 64;  // rows per block: the granularity of the parameter-gradient partial sums

inline long layernorm_backward_scratch_floats(long N, int C) {
    return (N + LAYERNORM_BWD_ROWS - 1) / LAYERNORM_BWD_ROWS * 2 * (long)C;
}

// 256 threads. First each warp takes rows and adds their input gradient into dinp; then the block turns to
// channels, each thread summing its channel pairs over the block's rows in row order into `partial`.
static __global__ void layernorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp,
                                                 const bf16* weight, const float* mean, const float* rstd, long N,
                                                 int C) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    long r0 = (long)blockIdx.x * LAYERNORM_BWD_ROWS, r1 = min(r0 + LAYERNORM_BWD_ROWS, N);
    for (long n = r0 + warp; n < r1; n += warps) {
        const bf16* x = inp + n * C;
        const bf16* d = dout + n * C;
        float m = mean[n], s = rstd[n];
        float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + c));
            float2 wv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
            dnorm_sum += dv.x * wv.x + dv.y * wv.y;
            dnorm_norm_sum += dv.x * wv.x * (xv.x - m) * s + dv.y * wv.y * (xv.y - m) * s;
        }
        float dnorm_mean = warp_sum(dnorm_sum) / C, dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + c));
            float2 wv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
            __nv_bfloat162* dx = reinterpret_cast<__nv_bfloat162*>(dinp + n * C + c);
            float2 old = __bfloat1622float2(*dx);
            float gx = s * (dv.x * wv.x - dnorm_mean - (xv.x - m) * s * dnorm_norm_mean);
            float gy = s * (dv.y * wv.y - dnorm_mean - (xv.y - m) * s * dnorm_norm_mean);
            *dx = __floats2bfloat162_rn(old.x + gx, old.y + gy);
        }
    }
    float* dw_partial = partial + (long)blockIdx.x * 2 * C;
    float* db_partial = dw_partial + C;
    for (int c = 2 * threadIdx.x; c < C; c += 2 * blockDim.x) {
        float dw0 = 0.0f, dw1 = 0.0f, db0 = 0.0f, db1 = 0.0f;
        for (long n = r0; n < r1; n++) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp + n * C + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + n * C + c));
            float m = mean[n], s = rstd[n];
            dw0 += dv.x * (xv.x - m) * s;
            dw1 += dv.y * (xv.y - m) * s;
            db0 += dv.x;
            db1 += dv.y;
        }
        dw_partial[c] = dw0;
        dw_partial[c + 1] = dw1;
        db_partial[c] = db0;
        db_partial[c + 1] = db1;
    }
}

static __global__ void layernorm_param_grad_kernel(bf16* dweight, bf16* dbias, const float* partial, long blocks,
                                                   int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (long b = 0; b < blocks; b++) {
        dw += partial[b * 2 * C + c];
        db += partial[b * 2 * C + C + c];
    }
    dweight[c] = __float2bfloat16(__bfloat162float(dweight[c]) + dw);
    dbias[c] = __float2bfloat16(__bfloat162float(dbias[c]) + db);
}

// dinp, dweight and dbias accumulate (+=), as on the CPU; scratch holds layernorm_backward_scratch_floats(N, C)
inline void layernorm_backward_cuda(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                    const bf16* weight, const float* mean, const float* rstd, long N, int C,
                                    float* scratch, cudaStream_t stream) {
    long blocks = (N + LAYERNORM_BWD_ROWS - 1) / LAYERNORM_BWD_ROWS;
    layernorm_backward_kernel<<<(unsigned int)blocks, 256, 0, stream>>>(dinp, scratch, dout, inp, weight, mean, rstd,
                                                                       N, C);
    cuda_check(cudaGetLastError());
    layernorm_param_grad_kernel<<<cuda_blocks(C, 256), 256, 0, stream>>>(dweight, dbias, scratch, blocks, C);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU functions above and, for bf16, the kernels. GPT-2 adds the residual
// stream right before every layernorm but the first, so both devices offer that pair as one call.

#include "llmc/device.cuh"
#include "llmc/residual.cuh"

// residual = inp1 + inp2, out = layernorm(residual); no output may alias an input
inline void fused_residual_layernorm_forward(float* residual, float* out, float* mean, float* rstd, const float* inp1,
                                             const float* inp2, const float* weight, const float* bias, long N, int C) {
    residual_forward(residual, inp1, inp2, N * C);
    layernorm_forward(out, mean, rstd, residual, weight, bias, N, C);
}

inline void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                              const bf16* bias, long N, int C) {
    layernorm_forward_cuda(out, mean, rstd, inp, weight, bias, N, C, main_stream());
}
inline void fused_residual_layernorm_forward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                             const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C) {
    fused_residual_layernorm_forward_cuda(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C, main_stream());
}
inline void layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                               const bf16* weight, const float* mean, const float* rstd, long N, int C) {
    float* scratch = gpu_scratch((size_t)layernorm_backward_scratch_floats(N, C), "layernorm_backward");
    layernorm_backward_cuda(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch, main_stream());
}

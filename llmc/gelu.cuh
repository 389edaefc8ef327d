// GELU with GPT-2's tanh approximation, forward and backward.
#pragma once

#include <cmath>

#include "llmc/profile.h"

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2/pi)

inline void gelu_forward(float* out, const float* inp, long N) {
    ProfileScope op("gelu forward");
#pragma omp parallel for
    for (long i = 0; i < N; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
    }
}

// dinp = dout * gelu'(inp), overwritten; dinp may alias dout
inline void gelu_backward(float* dinp, const float* inp, const float* dout, long N) {
    ProfileScope op("gelu backward");
#pragma omp parallel for
    for (long i = 0; i < N; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        float th = tanhf(u);
        float sech2 = 1.0f - th * th;
        float grad = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = grad * dout[i];
    }
}

// ==========================================================================================================
// CUDA: elementwise and memory-bound (4 bytes moved per element forward, 6 backward, a few dozen FLOPs), so a
// thread moves 16 bytes per access. Any N: the thread whose 8 elements run past the end takes them one by one.
// The pointers must be 16-byte aligned (checked), which every activation in the model is.

#include "llmc/cuda_common.cuh"

static __device__ __forceinline__ float gelu_value(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}

static __device__ __forceinline__ float gelu_derivative(float x) {
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}

static __global__ void gelu_forward_kernel(bf16* out, const bf16* inp, long N) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 8 <= N) {
        bf16x8 x = *reinterpret_cast<const bf16x8*>(inp + i), y;
        for (int j = 0; j < 4; j++) {
            float2 v = __bfloat1622float2(x.h[j]);
            y.h[j] = __floats2bfloat162_rn(gelu_value(v.x), gelu_value(v.y));
        }
        *reinterpret_cast<bf16x8*>(out + i) = y;
    } else {
        for (; i < N; i++) out[i] = __float2bfloat16(gelu_value(__bfloat162float(inp[i])));
    }
}

static __global__ void gelu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, long N) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 8 <= N) {
        bf16x8 x = *reinterpret_cast<const bf16x8*>(inp + i), d = *reinterpret_cast<const bf16x8*>(dout + i), g;
        for (int j = 0; j < 4; j++) {
            float2 xv = __bfloat1622float2(x.h[j]), dv = __bfloat1622float2(d.h[j]);
            g.h[j] = __floats2bfloat162_rn(gelu_derivative(xv.x) * dv.x, gelu_derivative(xv.y) * dv.y);
        }
        *reinterpret_cast<bf16x8*>(dinp + i) = g;
    } else {
        for (; i < N; i++)
            dinp[i] = __float2bfloat16(gelu_derivative(__bfloat162float(inp[i])) * __bfloat162float(dout[i]));
    }
}

inline void gelu_forward_cuda(bf16* out, const bf16* inp, long N, cudaStream_t stream) {
    require_aligned_16("gelu_forward_cuda out", out);
    require_aligned_16("gelu_forward_cuda inp", inp);
    if (N == 0) return;
    gelu_forward_kernel<<<cuda_blocks((N + 7) / 8, 256), 256, 0, stream>>>(out, inp, N);
    cuda_check(cudaGetLastError());
}

// dinp = dout * gelu'(inp), overwritten; dinp may alias dout
inline void gelu_backward_cuda(bf16* dinp, const bf16* inp, const bf16* dout, long N, cudaStream_t stream) {
    require_aligned_16("gelu_backward_cuda dinp", dinp);
    require_aligned_16("gelu_backward_cuda inp", inp);
    require_aligned_16("gelu_backward_cuda dout", dout);
    if (N == 0) return;
    gelu_backward_kernel<<<cuda_blocks((N + 7) / 8, 256), 256, 0, stream>>>(dinp, inp, dout, N);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 storage

#include "llmc/device.cuh"

inline void gelu_forward(bf16* out, const bf16* inp, long N) {
    ProfileScope op("gelu forward");
    gelu_forward_cuda(out, inp, N, main_stream());
}
inline void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, long N) {
    ProfileScope op("gelu backward");
    gelu_backward_cuda(dinp, inp, dout, N, main_stream());
}

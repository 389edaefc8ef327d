// AdamW as llm.c and PyTorch define it: β1 0.9, β2 0.95, eps 1e-8, bias-corrected moments, and weight decay
// decoupled from the gradient (applied to the parameter directly). The caller passes weight_decay 0 for the
// tensors that are not decayed (biases and the norms' weights). grad_scale folds in gradient clipping.
#pragma once

#include <cmath>

#include "llmc/profile.h"

struct AdamWConfig {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
};

inline void adamw_update(float* params, const float* grads, float* m, float* v, long n, float lr, float weight_decay,
                         float grad_scale, int t, AdamWConfig cfg = {}) {
    ProfileScope op("adamw", OpKind::Optimizer);
    float m_correction = 1.0f - powf(cfg.beta1, (float)t);
    float v_correction = 1.0f - powf(cfg.beta2, (float)t);
#pragma omp parallel for
    for (long i = 0; i < n; i++) {
        float g = grads[i] * grad_scale;
        float mi = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * g;
        float vi = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float update = (mi / m_correction) / (sqrtf(vi / v_correction) + cfg.eps);
        params[i] -= lr * (update + weight_decay * params[i]);
    }
}

// ==========================================================================================================
// CUDA. Memory-bound: per parameter it reads a bf16 gradient and three fp32 words (master, m, v) and writes
// them plus the bf16 parameter, 28 bytes for ~20 FLOPs. The fp32 master weights carry the update exactly; the
// bf16 copy the forward uses is stochastically rounded (rounded up with probability equal to the dropped
// fraction), so it is unbiased and small updates are not systematically lost. The random bits of an element
// are a hash of (seed, step, the element's index in the whole parameter buffer): each tensor draws its own
// bits, a ZeRO shard draws exactly the bits the unsharded run draws for the same elements, and every step
// draws new ones.

#include <algorithm>

#include "llmc/cuda_common.cuh"

// splitmix64's finalizer: every input bit flips about half the output bits
static __host__ __device__ __forceinline__ uint64_t mix_u64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// adds 16 random bits below bf16's last mantissa bit, then truncates: a carry (rounding the magnitude up) happens
// with probability equal to the truncated fraction. Infinities and NaNs pass through unchanged.
static __device__ __forceinline__ bf16 stochastic_round_bf16(float x, uint32_t random) {
    uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16(x);
    bits = (bits + (random & 0xffffu)) & 0xffff0000u;
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}

// step_key = mix(seed, step); element i of the call is element global_offset + i of the parameter buffer
static __global__ void adamw_kernel(bf16* params, float* master, const bf16* grads, float* m, float* v, long n, float lr,
                                    float weight_decay, float grad_scale, float m_correction, float v_correction,
                                    uint64_t step_key, long global_offset, AdamWConfig cfg) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = __bfloat162float(grads[i]) * grad_scale;
        float mi = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * g;
        float vi = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i];
        float update = (mi / m_correction) / (sqrtf(vi / v_correction) + cfg.eps);
        p -= lr * (update + weight_decay * p);
        master[i] = p;
        // splitmix64's stream: the element's index times the golden-ratio increment, offset by the step's key
        uint64_t random = mix_u64(step_key + (uint64_t)(global_offset + i) * 0x9E3779B97F4A7C15ull);
        params[i] = stochastic_round_bf16(p, (uint32_t)(random >> 32));
    }
}

// the CPU update on the fp32 master weights, then params = stochastic_round(master). The rounding bits of
// element i depend only on (seed, t, global_offset + i), where global_offset is the index of params[0] in the
// whole (unsharded) parameter buffer.
inline void adamw_update_cuda(bf16* params, float* master, const bf16* grads, float* m, float* v, long n, float lr,
                              float weight_decay, float grad_scale, int t, uint64_t seed, long global_offset,
                              AdamWConfig cfg, cudaStream_t stream) {
    if (n == 0) return;
    float m_correction = 1.0f - powf(cfg.beta1, (float)t);
    float v_correction = 1.0f - powf(cfg.beta2, (float)t);
    uint64_t step_key = mix_u64(mix_u64(seed) ^ (uint64_t)(uint32_t)t);
    unsigned int blocks = (unsigned int)std::min<long>(cuda_blocks(n, 512), (long)cuda_sm_count() * 4);
    adamw_kernel<<<blocks, 512, 0, stream>>>(params, master, grads, m, v, n, lr, weight_decay, grad_scale, m_correction,
                                             v_correction, step_key, global_offset, cfg);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's update on either device. On the CPU the parameters are fp32 and are their own master copy
// (master is null, and there is no rounding to draw bits for); on the GPU the fp32 master weights take the
// step and the bf16 parameters are rounded from them with bits chosen by (seed, t, global_offset + i), the
// element's place in the whole model, so a shard rounds an element exactly as the unsharded run does.

#include "llmc/device.cuh"

inline void adamw_update(float* params, float*, const float* grads, float* m, float* v, long n, float lr,
                         float weight_decay, float grad_scale, int t, uint64_t, long) {
    ProfileScope op("adamw", OpKind::Optimizer);
    adamw_update(params, grads, m, v, n, lr, weight_decay, grad_scale, t);
}
inline void adamw_update(bf16* params, float* master, const bf16* grads, float* m, float* v, long n, float lr,
                         float weight_decay, float grad_scale, int t, uint64_t seed, long global_offset) {
    ProfileScope op("adamw", OpKind::Optimizer);
    adamw_update_cuda(params, master, grads, m, v, n, lr, weight_decay, grad_scale, t, seed, global_offset, AdamWConfig{},
                      main_stream());
}

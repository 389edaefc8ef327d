// Causal multi-head self-attention on a packed qkv tensor (B, T, 3C): q, k, v each C wide, heads contiguous
// slices of hs = C/NH channels. The forward keeps the softmax probabilities att (B, NH, T, T) for the backward;
// entries above the diagonal are zero.
#pragma once

#include <cmath>
#include <cstring>

#include <omp.h>

inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* row = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    s *= scale;
                    row[t2] = s;
                    maxv = s > maxv ? s : maxv;
                }
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    row[t2] = expf(row[t2] - maxv);
                    sum += row[t2];
                }
                float inv = 1.0f / sum;
                for (int t2 = 0; t2 <= t; t2++) row[t2] *= inv;
                for (int t2 = t + 1; t2 < T; t2++) row[t2] = 0.0f;
                float* o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += row[t2] * v[i];
                }
            }
}

// dqkv (B, T, 3C) is overwritten. Keys and values receive gradient from every later query, so one thread owns
// each (batch, head) pair and sums in query order. scratch holds T floats per thread.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                               int NH, float* scratch) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            float* dpre = scratch + (size_t)omp_get_thread_num() * T;
            for (int t = 0; t < T; t++) {
                float* base = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                memset(base, 0, hs * sizeof(float));
                memset(base + C, 0, hs * sizeof(float));
                memset(base + 2 * C, 0, hs * sizeof(float));
            }
            for (int t = 0; t < T; t++) {
                const float* row = att + (((size_t)b * NH + h) * T + t) * T;
                const float* d = dout + ((size_t)b * T + t) * C + h * hs;
                // datt[t2] = d · v[t2]; dpre = att * (datt - Σ att·datt), the softmax backward
                float dot = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += d[i] * v[i];
                    dpre[t2] = s;
                    dot += row[t2] * s;
                }
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* dq = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                for (int t2 = 0; t2 <= t; t2++) {
                    float g = row[t2] * (dpre[t2] - dot) * scale;
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dk = dqkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dv = dqkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        dq[i] += g * k[i];
                        dk[i] += g * q[i];
                        dv[i] += row[t2] * d[i];
                    }
                }
            }
        }
}

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

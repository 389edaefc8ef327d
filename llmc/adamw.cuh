// AdamW as llm.c and PyTorch define it: β1 0.9, β2 0.95, eps 1e-8, bias-corrected moments, and weight decay
// decoupled from the gradient (applied to the parameter directly). The caller passes weight_decay 0 for the
// tensors that are not decayed (biases and layernorm parameters). grad_scale folds in gradient clipping.
#pragma once

#include <cmath>

struct AdamWConfig {
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
};

inline void adamw_update(float* params, const float* grads, float* m, float* v, long n, float lr, float weight_decay,
                         float grad_scale, int t, AdamWConfig cfg = {}) {
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

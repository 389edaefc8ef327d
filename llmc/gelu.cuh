// GELU with GPT-2's tanh approximation, forward and backward.
#pragma once

#include <cmath>

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2/pi)

inline void gelu_forward(float* out, const float* inp, long N) {
#pragma omp parallel for
    for (long i = 0; i < N; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
    }
}

// dinp = dout * gelu'(inp), overwritten; dinp may alias dout
inline void gelu_backward(float* dinp, const float* inp, const float* dout, long N) {
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

// Token + position embedding: out[b,t,:] = wte[token[b,t],:] + wpe[t,:], and its backward.
// The backward scatters into the embedding tables; it is split across threads by channel ranges so that every
// table entry is summed in token order by one thread, which keeps the result bit-reproducible.
#pragma once

#include <omp.h>

inline void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float* o = out + ((size_t)b * T + t) * C;
            const float* tok = wte + (size_t)tokens[b * T + t] * C;
            const float* pos = wpe + (size_t)t * C;
            for (int c = 0; c < C; c++) o[c] = tok[c] + pos[c];
        }
}

// dwte and dwpe accumulate (+=)
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C) {
    constexpr int CHUNK = 64;
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
        int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float* d = dout + ((size_t)b * T + t) * C;
                float* tok = dwte + (size_t)tokens[b * T + t] * C;
                float* pos = dwpe + (size_t)t * C;
                for (int c = c0; c < c1; c++) {
                    tok[c] += d[c];
                    pos[c] += d[c];
                }
            }
    }
}

// Σ x² over a buffer, for gradient-norm clipping. Partial sums are taken over fixed blocks and added in block
// order, so the result does not depend on the thread count; doubles keep a 1.5B-element sum accurate.
#pragma once

#include <vector>

inline double sum_of_squares(const float* x, long n) {
    constexpr long BLOCK = 1 << 16;
    long blocks = (n + BLOCK - 1) / BLOCK;
    std::vector<double> partial(blocks);
#pragma omp parallel for
    for (long b = 0; b < blocks; b++) {
        long end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        double s = 0.0;
        for (long i = b * BLOCK; i < end; i++) s += (double)x[i] * x[i];
        partial[b] = s;
    }
    double total = 0.0;
    for (double p : partial) total += p;
    return total;
}

// the factor that brings the gradient norm down to max_norm when it is above (1 otherwise)
inline float clip_scale(double norm, float max_norm) { return norm > max_norm ? (float)(max_norm / norm) : 1.0f; }

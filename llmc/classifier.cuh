// Softmax + cross-entropy over the logits (B*T rows of Vp columns, of which the first V are real tokens; the
// padding columns never enter the softmax and get zero gradient). The backward turns the logits into their
// gradient in place, so the probabilities are never stored.
#pragma once

#include <cmath>

// the log of Σ exp over the first V entries, computed around the row's maximum for stability
inline float logsumexp_row(const float* row, int V) {
    float maxv = -INFINITY;
    for (int v = 0; v < V; v++) maxv = row[v] > maxv ? row[v] : maxv;
    float sum = 0.0f;
    for (int v = 0; v < V; v++) sum += expf(row[v] - maxv);
    return maxv + logf(sum);
}

// losses[n] = -log softmax(logits[n])[targets[n]]; returns their mean
inline float crossentropy_forward(float* losses, const float* logits, const int* targets, long N, int V, int Vp) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* row = logits + n * Vp;
        losses[n] = logsumexp_row(row, V) - row[targets[n]];
    }
    double total = 0.0;
    for (long n = 0; n < N; n++) total += losses[n];
    return (float)(total / N);
}

// logits become dloss/dlogits: (softmax - onehot(target)) * dloss, where dloss is each token's weight in the
// loss (1 / number of tokens averaged over)
inline void crossentropy_backward_inplace(float* logits, const int* targets, long N, int V, int Vp, float dloss) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        float* row = logits + n * Vp;
        float lse = logsumexp_row(row, V);
        for (int v = 0; v < V; v++) row[v] = expf(row[v] - lse) * dloss;
        row[targets[n]] -= dloss;
        for (int v = V; v < Vp; v++) row[v] = 0.0f;
    }
}

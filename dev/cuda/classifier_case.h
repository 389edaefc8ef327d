// The check case of llmc/classifier.cuh (dev/cuda/README.md says what a case holds): dev/cuda/classifier.cu runs it at
// GPT-2 sizes, test/test_cuda_kernels.cu at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/classifier.cuh"

// crossentropy_forward and the fused crossentropy_backward_inplace (losses again, and the logits overwritten
// by their gradient, dloss = 1/N), V real columns padded to Vp.
struct ClassifierCase {
    long N;
    int V, Vp;
    float dloss;
    std::vector<float> logits;  // input
    std::vector<int> targets;
    std::vector<float> losses, grad;  // CPU reference
    DeviceArray<bf16> d_logits;
    DeviceArray<int> d_targets;
    DeviceArray<float> d_losses;

    ClassifierCase(long N_, int V_, int Vp_, uint64_t seed)
        : N(N_), V(V_), Vp(Vp_), dloss(1.0f / N_), targets(N), losses(N), d_logits(N * Vp), d_targets(N),
          d_losses(N) {
        Rng rng(seed);
        logits = random_bf16_values(N * Vp, rng, 2.0f);
        for (auto& t : targets) t = (int)rng.below(V);
        reset_logits();
        upload(d_targets, targets);
        crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp, Workspace{});
        grad = logits;
        crossentropy_backward_inplace(grad.data(), nullptr, targets.data(), N, V, Vp, dloss);
    }
    void reset_logits() { upload(d_logits, logits); }
    void gpu_forward() { crossentropy_forward_cuda(d_losses.ptr, d_logits.ptr, d_targets.ptr, N, V, Vp, 0); }
    void gpu_backward_inplace() {
        crossentropy_backward_inplace_cuda(d_logits.ptr, d_losses.ptr, d_targets.ptr, N, V, Vp, dloss, 0);
    }
    // whether every padding column (V..Vp) of a downloaded gradient is exactly 0
    bool padding_zero(const std::vector<float>& gpu_grad) const {
        for (long n = 0; n < N; n++)
            for (int v = V; v < Vp; v++)
                if (gpu_grad[n * Vp + v] != 0.0f) return false;
        return true;
    }
};

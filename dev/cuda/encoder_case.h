// The check case of llmc/encoder.cuh (dev/cuda/README.md says what a case holds): dev/cuda/encoder.cu runs it at GPT-2
// sizes, test/test_cuda_kernels.cu at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/encoder.cuh"

// encoder_forward and the deterministic encoder_backward. Half the positions draw their token from the first
// hot_vocab of the vocabulary: long runs of one token are the backward's hard case. The accumulated gradients
// start from N(0, grad_scale²).
struct EncoderCase {
    int B, T, C, V;
    long BT;
    std::vector<int> tokens;
    std::vector<float> wte, wpe, dout, dwte0, dwpe0;  // inputs
    std::vector<float> out, dwte, dwpe;               // CPU reference: forward out, dwte0/dwpe0 after backward
    DeviceArray<int> d_tokens;
    DeviceArray<bf16> d_wte, d_wpe, d_out, d_dout, d_dwte, d_dwpe;
    DeviceArray<char> scratch;

    EncoderCase(int B_, int T_, int C_, int V_, uint64_t seed, int hot_vocab, float grad_scale)
        : B(B_), T(T_), C(C_), V(V_), BT((long)B_ * T_), tokens(BT), d_tokens(BT), d_wte((size_t)V * C),
          d_wpe((size_t)T * C), d_out(BT * C), d_dout(BT * C), d_dwte((size_t)V * C), d_dwpe((size_t)T * C),
          scratch(have_gpu() ? encoder_backward_scratch_bytes(B, T, V) : 0) {  // cub sizes it on the device
        Rng rng(seed);
        for (auto& t : tokens) t = (int)rng.below(rng.uniform() < 0.5f ? hot_vocab : V);
        wte = random_bf16_values((size_t)V * C, rng);
        wpe = random_bf16_values((size_t)T * C, rng);
        dout = random_bf16_values(BT * C, rng);
        dwte0 = random_bf16_values((size_t)V * C, rng, grad_scale);
        dwpe0 = random_bf16_values((size_t)T * C, rng, grad_scale);
        upload(d_tokens, tokens);
        upload(d_wte, wte);
        upload(d_wpe, wpe);
        upload(d_dout, dout);
        reset_grads();
        out.resize(BT * C);
        encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
        dwte = dwte0;
        dwpe = dwpe0;
        encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, V, Workspace{});
    }
    void reset_grads() {
        upload(d_dwte, dwte0);
        upload(d_dwpe, dwpe0);
    }
    void gpu_forward() { encoder_forward_cuda(d_out.ptr, d_tokens.ptr, d_wte.ptr, d_wpe.ptr, B, T, C, 0); }
    void gpu_backward() {
        encoder_backward_cuda(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tokens.ptr, B, T, C, V, scratch.ptr, 0);
    }
};

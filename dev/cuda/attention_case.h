// The check case of llmc/attention.cuh (dev/cuda/README.md says what a case holds): dev/cuda/attention.cu runs it at
// GPT-2 and Llama 3 sizes, test/test_cuda_kernels.cu at small odd ones. NH query heads over KV key/value heads
// (KV = NH: GPT-2's multi-head attention); qkv rows are (NH + 2·KV)·hs wide.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/attention.cuh"

// ln Σ_{t2 ≤ t} exp(q_t·k_t2 / √hs) for each (b, h, t), in double: the log-sum-exp the GPU forward saves
inline std::vector<float> attention_lse_reference(const std::vector<float>& qkv, int B, int T, int C, int NH, int KV) {
    int hs = C / NH;
    long W = attention_qkv_width(C, NH, KV);
    std::vector<float> lse((size_t)B * NH * T);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float* q = &qkv[((size_t)b * T + t) * W + h * hs];
                std::vector<double> s(t + 1);
                double mx = -INFINITY, sum = 0.0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = &qkv[((size_t)b * T + t2) * W + C + h / (NH / KV) * hs];
                    double dot = 0.0;
                    for (int i = 0; i < hs; i++) dot += (double)q[i] * k[i];
                    s[t2] = dot / sqrt((double)hs);
                    mx = fmax(mx, s[t2]);
                }
                for (int t2 = 0; t2 <= t; t2++) sum += exp(s[t2] - mx);
                lse[((size_t)b * NH + h) * T + t] = (float)(mx + log(sum));
            }
    return lse;
}

// attention_forward (which materializes the T×T probabilities) and attention_backward, causal, NH query heads of
// C / NH over KV key/value heads; the GPU's flash attention keeps the log-sum-exp (d_lse, checked against
// attention_lse_reference) for its backward and takes its D = rowsum(dO∘O) scratch from d_scratch.
// with_reference = false skips the CPU runs (shapes that are only timed).
struct AttentionCase {
    int B, T, C, NH, KV;
    long BT, W;  // W: the width of a qkv row
    std::vector<float> qkv, dout;            // inputs
    std::vector<float> out, lse, dqkv, att;  // CPU reference
    // Tolerances (compare_rms) for out and dqkv. The tensor-core kernels feed bf16 P and dS to their products, as
    // FlashAttention-2 does. On an H100 (2026-11-23), on these inputs, the worst |error| / (RMS + |reference|)
    // of PyTorch's flash SDPA came to 0.012-0.017 forward and 0.046-0.068 backward (dev/cuda/attention_sdpa.py),
    // of the mma.sync kernels to 0.006-0.020 and 0.018-0.055: the tolerances sit above SDPA's error.
    static constexpr double OUT_TOL = 3e-2, DQKV_TOL = 7.5e-2;
    DeviceArray<bf16> d_qkv, d_out, d_dout, d_dqkv;
    DeviceArray<float> d_lse, d_scratch;

    AttentionCase(int B_, int T_, int C_, int NH_, int KV_, uint64_t seed, bool with_reference = true)
        : B(B_), T(T_), C(C_), NH(NH_), KV(KV_), BT((long)B_ * T_), W(attention_qkv_width(C_, NH_, KV_)),
          d_qkv(BT * W), d_out(BT * C), d_dout(BT * C), d_dqkv(BT * W), d_lse((long)B * NH * T),
          d_scratch(attention_backward_scratch_floats(B, T, C, NH)) {
        Rng rng(seed);
        qkv = random_bf16_values(BT * W, rng);
        dout = random_bf16_values(BT * C, rng);
        upload(d_qkv, qkv);
        upload(d_dout, dout);
        if (!with_reference) return;
        out.resize(BT * C);
        dqkv.resize(BT * W);
        att.resize((size_t)B * NH * T * T);
        std::vector<float> scratch((size_t)T * omp_get_max_threads());
        attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, KV);
        attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, KV, scratch.data());
        lse = attention_lse_reference(qkv, B, T, C, NH, KV);
    }
    // The reference gradient for a backward given o_used as the forward's output. Its D = rowsum(dO∘O) then
    // comes from that bf16 O, not the exact one, as in every flash attention (PyTorch's too): dS = P∘(dP - D)
    // moves by -P·δD, so dQ_i by -scale·δD_i·Σ_j P_ij K_j and dK_j by -scale·Σ_i P_ij δD_i Q_i (summed over the
    // query heads of K's group); dV is untouched. A thread per (b, key/value head) owns its keys' corrections.
    std::vector<float> dqkv_for_out(const std::vector<float>& o_used) const {
        std::vector<float> ref = dqkv;
        int hs = C / NH, group = NH / KV;
        double scale = 1.0 / sqrt((double)hs);
#pragma omp parallel for collapse(2)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < KV; kh++)
                for (int h = kh * group; h < (kh + 1) * group; h++) {
                    std::vector<double> dD(T);
                    for (int i = 0; i < T; i++) {
                        size_t o = ((size_t)b * T + i) * C + h * hs;
                        double sum = 0.0;
                        for (int e = 0; e < hs; e++) sum += (double)dout[o + e] * ((double)o_used[o + e] - out[o + e]);
                        dD[i] = sum;
                    }
                    for (int i = 0; i < T; i++) {
                        const float* p = &att[(((size_t)b * NH + h) * T + i) * T];
                        size_t qi = ((size_t)b * T + i) * W + h * hs;
                        for (int j = 0; j <= i; j++) {
                            size_t kj = ((size_t)b * T + j) * W + C + kh * hs;
                            double w = scale * p[j] * dD[i];
                            for (int e = 0; e < hs; e++) {
                                ref[qi + e] -= (float)(w * qkv[kj + e]);
                                ref[kj + e] -= (float)(w * qkv[qi + e]);
                            }
                        }
                    }
                }
        return ref;
    }
    void gpu_forward() { attention_forward_cuda(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, KV, 0); }
    void gpu_backward() {
        attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_scratch.ptr, B, T, C, NH,
                                KV, 0);
    }
    // the wgmma kernels (attention_hopper_available must hold)
    void gpu_forward_hopper() { attention_forward_hopper(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, KV, 0); }
    void gpu_backward_hopper() {
        attention_backward_hopper(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_scratch.ptr, B, T, C, NH,
                                  KV, 0);
    }
};

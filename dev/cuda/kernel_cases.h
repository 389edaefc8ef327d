// One case per CUDA kernel, shared by the dev/cuda checks (GPT-2-sized shapes, timed, one line per check) and
// test/test_cuda_kernels.cu (small odd shapes, Catch2): the random bf16 inputs, the CPU reference run on them
// (the same llmc header's CPU function), and device buffers holding the inputs, outputs poisoned. Each case's
// gpu_* calls launch the kernels on its buffers; reset_* puts accumulated (+=) or in-place buffers back to
// their inputs. What a caller does with the results (tolerances, reporting, timing) stays with the caller.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/residual.cuh"

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
          scratch(encoder_backward_scratch_bytes(B, T, V)) {
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
        encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, V);
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

// residual_forward + layernorm_forward (fused on the GPU, and layernorm_forward alone on the stored residual),
// and layernorm_backward accumulating into random dinp/dweight/dbias. The residual stream is stored in bf16 and
// the layernorm sees the stored value; the backward runs from the CPU's statistics (use_cpu_stats), so both
// sides differentiate the same function.
struct LayernormCase {
    long N;
    int C;
    std::vector<float> a, b, weight, bias, dout, dinp0, dweight0, dbias0;  // inputs
    std::vector<float> res, out, mean, rstd, dinp, dweight, dbias;         // CPU reference
    DeviceArray<bf16> d_a, d_b, d_w, d_bias, d_res, d_out, d_dout, d_dinp, d_dw, d_db;
    DeviceArray<float> d_mean, d_rstd, scratch;

    LayernormCase(long N_, int C_, uint64_t seed)
        : N(N_), C(C_), res(N * C), out(N * C), mean(N), rstd(N), d_a(N * C), d_b(N * C), d_w(C), d_bias(C),
          d_res(N * C), d_out(N * C), d_dout(N * C), d_dinp(N * C), d_dw(C), d_db(C), d_mean(N), d_rstd(N),
          scratch(layernorm_backward_scratch_floats(N, C)) {
        Rng rng(seed);
        a = random_bf16_values(N * C, rng);
        b = random_bf16_values(N * C, rng);
        weight = random_bf16_values(C, rng);
        bias = random_bf16_values(C, rng);
        dout = random_bf16_values(N * C, rng);
        dinp0 = random_bf16_values(N * C, rng);
        dweight0 = random_bf16_values(C, rng);
        dbias0 = random_bf16_values(C, rng);
        upload(d_a, a);
        upload(d_b, b);
        upload(d_w, weight);
        upload(d_bias, bias);
        upload(d_dout, dout);
        reset_grads();
        residual_forward(res.data(), a.data(), b.data(), N * C);
        res = round_to_bf16(res);
        layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), weight.data(), bias.data(), N, C);
        dinp = dinp0;
        dweight = dweight0;
        dbias = dbias0;
        layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), res.data(), weight.data(),
                           mean.data(), rstd.data(), N, C);
    }
    void reset_grads() {
        upload(d_dinp, dinp0);
        upload(d_dw, dweight0);
        upload(d_db, dbias0);
    }
    void use_cpu_stats() {
        upload(d_mean, mean);
        upload(d_rstd, rstd);
    }
    void gpu_fused_forward() {
        fused_residual_layernorm_forward_cuda(d_res.ptr, d_out.ptr, d_mean.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr,
                                              d_w.ptr, d_bias.ptr, N, C, 0);
    }
    // the residual stream updated in place (residual and inp1 one buffer, starting as a copy of a)
    void gpu_fused_forward_in_place() {
        cuda_check(cudaMemcpy(d_res.ptr, d_a.ptr, d_a.bytes(), cudaMemcpyDeviceToDevice));
        fused_residual_layernorm_forward_cuda(d_res.ptr, d_out.ptr, d_mean.ptr, d_rstd.ptr, d_res.ptr, d_b.ptr,
                                              d_w.ptr, d_bias.ptr, N, C, 0);
    }
    void gpu_forward() {
        layernorm_forward_cuda(d_out.ptr, d_mean.ptr, d_rstd.ptr, d_res.ptr, d_w.ptr, d_bias.ptr, N, C, 0);
    }
    void gpu_backward() {
        layernorm_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_res.ptr, d_w.ptr, d_mean.ptr,
                                d_rstd.ptr, N, C, scratch.ptr, 0);
    }
};

// matmul_forward with bias, the same with GELU fused (act = GELU of the bf16-stored pre-activation), and
// matmul_backward (dweight, dbias accumulated into random values). Weights and dout are drawn at scale, the
// bias at 10·scale.
struct MatmulCase {
    long N, C, OC;
    std::vector<float> inp, weight, bias, dout, dweight0, dbias0;  // inputs
    std::vector<float> out, act, dinp, dweight, dbias;             // CPU reference
    DeviceArray<bf16> d_inp, d_w, d_b, d_out, d_pre, d_dout, d_dinp, d_dw, d_db;
    DeviceArray<float> scratch;

    MatmulCase(long N_, long C_, long OC_, uint64_t seed, float scale)
        : N(N_), C(C_), OC(OC_), out(N * OC), act(N * OC), dinp(N * C), d_inp(N * C), d_w(OC * C), d_b(OC),
          d_out(N * OC), d_pre(N * OC), d_dout(N * OC), d_dinp(N * C), d_dw(OC * C), d_db(OC),
          scratch(matmul_backward_scratch_floats(N, OC)) {
        Rng rng(seed);
        inp = random_bf16_values(N * C, rng);
        weight = random_bf16_values(OC * C, rng, scale);
        bias = random_bf16_values(OC, rng, 10.0f * scale);
        dout = random_bf16_values(N * OC, rng, scale);
        dweight0 = random_bf16_values(OC * C, rng);
        dbias0 = random_bf16_values(OC, rng);
        upload(d_inp, inp);
        upload(d_w, weight);
        upload(d_b, bias);
        upload(d_dout, dout);
        reset_grads();
        std::vector<float> workspace(gemm_workspace_floats(omp_get_max_threads()));
        matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC, workspace.data());
        std::vector<float> pre = round_to_bf16(out);
        gelu_forward(act.data(), pre.data(), N * OC);
        dweight = dweight0;
        dbias = dbias0;
        matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, C, OC,
                        workspace.data());
    }
    void reset_grads() {
        upload(d_dw, dweight0);
        upload(d_db, dbias0);
    }
    void gpu_forward() { matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, nullptr, 0); }
    void gpu_forward_gelu() { matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, d_pre.ptr, 0); }
    void gpu_backward() {
        matmul_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_w.ptr, N, C, OC, scratch.ptr, 0);
    }
};

// ln Σ_{t2 ≤ t} exp(q_t·k_t2 / √hs) for each (b, h, t), in double: the log-sum-exp the GPU forward saves
inline std::vector<float> attention_lse_reference(const std::vector<float>& qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    std::vector<float> lse((size_t)B * NH * T);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float* q = &qkv[((size_t)b * T + t) * 3 * C + h * hs];
                std::vector<double> s(t + 1);
                double mx = -INFINITY, sum = 0.0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = &qkv[((size_t)b * T + t2) * 3 * C + C + h * hs];
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

// attention_forward (which materializes the T×T probabilities) and attention_backward, causal, NH heads of
// C / NH; the GPU's flash attention keeps the log-sum-exp (d_lse, checked against attention_lse_reference) for
// its backward and takes its D = rowsum(dO∘O) scratch from d_scratch. with_reference = false skips the CPU runs
// (shapes that are only timed).
struct AttentionCase {
    int B, T, C, NH;
    long BT;
    std::vector<float> qkv, dout;            // inputs
    std::vector<float> out, lse, dqkv, att;  // CPU reference
    // Tolerances (compare_rms) for out and dqkv. The tensor-core kernels feed bf16 P and dS to their products, as
    // FlashAttention-2 does. On an H100 (2026-11-23), on these inputs, the worst |error| / (RMS + |reference|)
    // of PyTorch's flash SDPA came to 0.012-0.017 forward and 0.046-0.068 backward (dev/cuda/attention_sdpa.py),
    // of the mma.sync kernels to 0.006-0.020 and 0.018-0.055: the tolerances sit above SDPA's error.
    static constexpr double OUT_TOL = 3e-2, DQKV_TOL = 7.5e-2;
    DeviceArray<bf16> d_qkv, d_out, d_dout, d_dqkv;
    DeviceArray<float> d_lse, d_scratch;

    AttentionCase(int B_, int T_, int C_, int NH_, uint64_t seed, bool with_reference = true)
        : B(B_), T(T_), C(C_), NH(NH_), BT((long)B_ * T_), d_qkv(BT * 3 * C), d_out(BT * C), d_dout(BT * C),
          d_dqkv(BT * 3 * C), d_lse((long)B * NH * T), d_scratch(attention_backward_scratch_floats(B, T, C, NH)) {
        Rng rng(seed);
        qkv = random_bf16_values(BT * 3 * C, rng);
        dout = random_bf16_values(BT * C, rng);
        upload(d_qkv, qkv);
        upload(d_dout, dout);
        if (!with_reference) return;
        out.resize(BT * C);
        dqkv.resize(BT * 3 * C);
        att.resize((size_t)B * NH * T * T);
        std::vector<float> scratch((size_t)T * omp_get_max_threads());
        attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
        attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, scratch.data());
        lse = attention_lse_reference(qkv, B, T, C, NH);
    }
    // The reference gradient for a backward given o_used as the forward's output. Its D = rowsum(dO∘O) then
    // comes from that bf16 O, not the exact one, as in every flash attention (PyTorch's too): dS = P∘(dP - D)
    // moves by -P·δD, so dQ_i by -scale·δD_i·Σ_j P_ij K_j and dK_j by -scale·Σ_i P_ij δD_i Q_i; dV is untouched.
    std::vector<float> dqkv_for_out(const std::vector<float>& o_used) const {
        std::vector<float> ref = dqkv;
        int hs = C / NH;
        double scale = 1.0 / sqrt((double)hs);
#pragma omp parallel for collapse(2)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < NH; h++) {
                std::vector<double> dD(T);
                for (int i = 0; i < T; i++) {
                    size_t o = ((size_t)b * T + i) * C + h * hs;
                    double sum = 0.0;
                    for (int e = 0; e < hs; e++) sum += (double)dout[o + e] * ((double)o_used[o + e] - out[o + e]);
                    dD[i] = sum;
                }
                for (int i = 0; i < T; i++) {
                    const float* p = &att[(((size_t)b * NH + h) * T + i) * T];
                    size_t qi = ((size_t)b * T + i) * 3 * C + h * hs;
                    for (int j = 0; j <= i; j++) {
                        size_t kj = ((size_t)b * T + j) * 3 * C + C + h * hs;
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
    void gpu_forward() { attention_forward_cuda(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, 0); }
    void gpu_backward() {
        attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_scratch.ptr, B, T, C, NH,
                                0);
    }
    // the wgmma kernels (attention_hopper_available must hold)
    void gpu_forward_hopper() { attention_forward_hopper(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, 0); }
    void gpu_backward_hopper() {
        attention_backward_hopper(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_scratch.ptr, B, T, C, NH,
                                  0);
    }
};

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
        crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
        grad = logits;
        crossentropy_backward_inplace(grad.data(), targets.data(), N, V, Vp, dloss);
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

// the bf16 neighbours of x: truncation toward zero, and the next value away from zero
inline void bf16_neighbours(float x, float& lo, float& hi) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t down = bits & 0xffff0000u, up = down + 0x10000u;
    memcpy(&lo, &down, 4);
    memcpy(&hi, &up, 4);
}

// one adamw_update step on the fp32 master weights and moments (lr 1e-3, weight decay 0.1, gradient scale 0.7,
// step t), the bf16 parameters rounded stochastically from the master weights on the GPU. The master weights
// are scaled off the bf16 grid so the rounding has something to decide.
struct AdamWCase {
    long n;
    int t;
    float lr = 1e-3f, wd = 0.1f, grad_scale = 0.7f;
    std::vector<float> master0, grads, m0, v0;  // inputs
    std::vector<float> master, m, v;            // CPU reference
    DeviceArray<bf16> d_params, d_grads;
    DeviceArray<float> d_master, d_m, d_v;

    AdamWCase(long n_, uint64_t seed, int t_)
        : n(n_), t(t_), d_params(n), d_grads(n), d_master(n), d_m(n), d_v(n) {
        Rng rng(seed);
        master0 = random_bf16_values(n, rng, 0.1f);
        grads = random_bf16_values(n, rng, 0.01f);
        m0 = random_bf16_values(n, rng, 0.01f);
        v0 = random_bf16_values(n, rng, 1e-3f);
        for (auto& x : v0) x = x * x;
        for (auto& x : master0) x *= 1.0f + 1e-3f * rng.uniform();
        master = master0;
        m = m0;
        v = v0;
        adamw_update(master.data(), grads.data(), m.data(), v.data(), n, lr, wd, grad_scale, t);
    }
    // from the inputs, parameters poisoned: one update with this rounding seed, as one call or cut into `shards`
    // contiguous calls (a ZeRO shard's view: each call's global_offset is its first element's index)
    void gpu_run(uint64_t seed, int shards = 1) {
        upload(d_master, master0);
        upload(d_m, m0);
        upload(d_v, v0);
        upload(d_grads, grads);
        d_params.poison();
        for (int s = 0; s < shards; s++) {
            long begin = n * s / shards, end = n * (s + 1) / shards;
            gpu_update(seed, begin, end - begin);
        }
    }
    void gpu_update(uint64_t seed, long begin, long count) {
        adamw_update_cuda(d_params.ptr + begin, d_master.ptr + begin, d_grads.ptr + begin, d_m.ptr + begin,
                          d_v.ptr + begin, count, lr, wd, grad_scale, t, seed, begin, AdamWConfig{}, 0);
    }
};

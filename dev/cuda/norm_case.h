// The check case of llmc/norm.cuh's row norms (dev/cuda/README.md says what a case holds), LayerNorm or RMSNorm:
// dev/cuda/layernorm.cu runs it at GPT-2 sizes, dev/cuda/rmsnorm.cu at Llama 3's, test/test_cuda_kernels.cu and
// test/test_rmsnorm.cu at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/norm.cuh"
#include "llmc/residual.cuh"

// residual_forward + norm_forward (fused on the GPU, and norm_forward alone on the stored residual), and
// norm_backward accumulating into random dinp/dweight (and LayerNorm's dbias). The residual stream is stored in
// bf16 and the norm sees the stored value; the backward runs from the CPU's statistics (use_cpu_stats), so both
// sides differentiate the same function. eps is the case's, so a kernel that ignored it would miss the CPU's
// rstd. The mean, the bias and its gradient are LayerNorm's: an RMSNorm case draws none and passes null.
struct NormCase {
    Norm kind;
    long N;
    int C;
    float eps;
    std::vector<float> a, b, weight, bias, dout, dinp0, dweight0, dbias0;  // inputs
    std::vector<float> res, out, mean, rstd, dinp, dweight, dbias;         // CPU reference
    DeviceArray<bf16> d_a, d_b, d_w, d_bias, d_res, d_out, d_dout, d_dinp, d_dw, d_db;
    DeviceArray<float> d_mean, d_rstd, scratch;

    NormCase(Norm kind_, long N_, int C_, float eps_, uint64_t seed)
        : kind(kind_), N(N_), C(C_), eps(eps_), res(N * C), out(N * C), mean(centred() ? N : 0), rstd(N),
          d_a(N * C), d_b(N * C), d_w(C), d_bias(centred() ? C : 0), d_res(N * C), d_out(N * C), d_dout(N * C),
          d_dinp(N * C), d_dw(C), d_db(centred() ? C : 0), d_mean(centred() ? N : 0), d_rstd(N),
          scratch(norm_backward_scratch_floats(kind, N, C)) {
        Rng rng(seed);
        a = random_bf16_values(N * C, rng);
        b = random_bf16_values(N * C, rng);
        weight = random_bf16_values(C, rng);
        if (centred()) bias = random_bf16_values(C, rng);
        dout = random_bf16_values(N * C, rng);
        dinp0 = random_bf16_values(N * C, rng);
        dweight0 = random_bf16_values(C, rng);
        if (centred()) dbias0 = random_bf16_values(C, rng);
        upload(d_a, a);
        upload(d_b, b);
        upload(d_w, weight);
        upload(d_bias, bias);
        upload(d_dout, dout);
        reset_grads();
        residual_forward(res.data(), a.data(), b.data(), N * C);
        res = round_to_bf16(res);
        norm_forward(kind, out.data(), or_null(mean), rstd.data(), res.data(), weight.data(), or_null(bias), N, C, eps);
        dinp = dinp0;
        dweight = dweight0;
        dbias = dbias0;
        norm_backward(kind, dinp.data(), dweight.data(), or_null(dbias), dout.data(), res.data(), weight.data(),
                      or_null(mean), rstd.data(), N, C, Workspace{});
    }
    bool centred() const { return kind == Norm::LayerNorm; }
    template <typename T>
    static T* or_null(std::vector<T>& v) { return v.empty() ? nullptr : v.data(); }
    template <typename T>
    T* or_null(DeviceArray<T>& v) const { return centred() ? v.ptr : nullptr; }

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
        fused_residual_norm_forward_cuda(kind, d_res.ptr, d_out.ptr, or_null(d_mean), d_rstd.ptr, d_a.ptr, d_b.ptr,
                                         d_w.ptr, or_null(d_bias), N, C, eps, 0);
    }
    // the residual stream updated in place (residual and inp1 one buffer, starting as a copy of a)
    void gpu_fused_forward_in_place() {
        cuda_check(cudaMemcpy(d_res.ptr, d_a.ptr, d_a.bytes(), cudaMemcpyDeviceToDevice));
        fused_residual_norm_forward_cuda(kind, d_res.ptr, d_out.ptr, or_null(d_mean), d_rstd.ptr, d_res.ptr, d_b.ptr,
                                         d_w.ptr, or_null(d_bias), N, C, eps, 0);
    }
    void gpu_forward() {
        norm_forward_cuda(kind, d_out.ptr, or_null(d_mean), d_rstd.ptr, d_res.ptr, d_w.ptr, or_null(d_bias), N, C, eps,
                          0);
    }
    void gpu_backward() {
        norm_backward_cuda(kind, d_dinp.ptr, d_dw.ptr, or_null(d_db), d_dout.ptr, d_res.ptr, d_w.ptr, or_null(d_mean),
                           d_rstd.ptr, N, C, scratch.ptr, 0);
    }
};

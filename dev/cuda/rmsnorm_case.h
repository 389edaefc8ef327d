// The check case of llmc/rmsnorm.cuh (dev/cuda/README.md says what a case holds): dev/cuda/rmsnorm.cu runs it at
// Llama 3 sizes, test/test_rmsnorm.cu at small odd ones.
#pragma once

#include <cstdint>

#include "dev/cuda/common.h"
#include "llmc/residual.cuh"
#include "llmc/rmsnorm.cuh"

// residual_forward + rmsnorm_forward (fused on the GPU, and rmsnorm_forward alone on the stored residual), and
// rmsnorm_backward accumulating into random dinp/dweight. The residual stream is stored in bf16 and the norm
// sees the stored value; the backward runs from the CPU's rstd (use_cpu_stats), so both sides differentiate the
// same function. eps is the case's, so a kernel that ignored it would miss the CPU's rstd.
struct RmsnormCase {
    long N;
    int C;
    float eps;
    std::vector<float> a, b, weight, dout, dinp0, dweight0;  // inputs
    std::vector<float> res, out, rstd, dinp, dweight;        // CPU reference
    DeviceArray<bf16> d_a, d_b, d_w, d_res, d_out, d_dout, d_dinp, d_dw;
    DeviceArray<float> d_rstd, scratch;

    RmsnormCase(long N_, int C_, float eps_, uint64_t seed)
        : N(N_), C(C_), eps(eps_), res(N * C), out(N * C), rstd(N), d_a(N * C), d_b(N * C), d_w(C), d_res(N * C),
          d_out(N * C), d_dout(N * C), d_dinp(N * C), d_dw(C), d_rstd(N),
          scratch(rmsnorm_backward_scratch_floats(N, C)) {
        Rng rng(seed);
        a = random_bf16_values(N * C, rng);
        b = random_bf16_values(N * C, rng);
        weight = random_bf16_values(C, rng);
        dout = random_bf16_values(N * C, rng);
        dinp0 = random_bf16_values(N * C, rng);
        dweight0 = random_bf16_values(C, rng);
        upload(d_a, a);
        upload(d_b, b);
        upload(d_w, weight);
        upload(d_dout, dout);
        reset_grads();
        residual_forward(res.data(), a.data(), b.data(), N * C);
        res = round_to_bf16(res);
        rmsnorm_forward(out.data(), rstd.data(), res.data(), weight.data(), N, C, eps);
        dinp = dinp0;
        dweight = dweight0;
        rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), res.data(), weight.data(), rstd.data(), N, C);
    }
    void reset_grads() {
        upload(d_dinp, dinp0);
        upload(d_dw, dweight0);
    }
    void use_cpu_stats() { upload(d_rstd, rstd); }
    void gpu_fused_forward() {
        fused_residual_rmsnorm_forward_cuda(d_res.ptr, d_out.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr, N, C, eps, 0);
    }
    // the residual stream updated in place (residual and inp1 one buffer, starting as a copy of a)
    void gpu_fused_forward_in_place() {
        cuda_check(cudaMemcpy(d_res.ptr, d_a.ptr, d_a.bytes(), cudaMemcpyDeviceToDevice));
        fused_residual_rmsnorm_forward_cuda(d_res.ptr, d_out.ptr, d_rstd.ptr, d_res.ptr, d_b.ptr, d_w.ptr, N, C, eps,
                                            0);
    }
    void gpu_forward() { rmsnorm_forward_cuda(d_out.ptr, d_rstd.ptr, d_res.ptr, d_w.ptr, N, C, eps, 0); }
    void gpu_backward() {
        rmsnorm_backward_cuda(d_dinp.ptr, d_dw.ptr, d_dout.ptr, d_res.ptr, d_w.ptr, d_rstd.ptr, N, C, scratch.ptr, 0);
    }
};

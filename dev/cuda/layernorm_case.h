// The check case of llmc/layernorm.cuh (dev/cuda/README.md says what a case holds): dev/cuda/layernorm.cu runs it at
// GPT-2 sizes, test/test_cuda_kernels.cu at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/layernorm.cuh"
#include "llmc/residual.cuh"

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

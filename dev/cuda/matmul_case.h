// The check cases of llmc/matmul.cuh (dev/cuda/README.md says what a case holds): dev/cuda/matmul.cu runs
// MatmulCase at GPT-2 sizes, test/test_cuda_kernels.cu both at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/matmul.cuh"

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
        matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC, {workspace.data(), workspace.size()});
        std::vector<float> pre = round_to_bf16(out);
        gelu_forward(act.data(), pre.data(), N * OC);
        dweight = dweight0;
        dbias = dbias0;
        matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, C, OC,
                        {workspace.data(), workspace.size()});
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

// The MLP projection's backward through GELU (gelu_matmul_backward) over two micro-steps, each with its own dout:
// the input GELU's output as forward keeps it (bf16 values of GELU(pre)), dpre overwritten, and dweight, dbias
// and the bias gradient of GELU's input, dpre_bias, accumulated into random values. pre is drawn at scale 2, so
// GELU's derivative spans its curve.
struct GeluMatmulCase {
    long N, C, OC;
    std::vector<float> pre, act, weight, dout0, dout1, dweight0, dbias0, dpre_bias0;  // inputs
    std::vector<float> dpre, dweight, dbias, dpre_bias;  // CPU reference after both micro-steps
    DeviceArray<bf16> d_pre, d_act, d_w, d_dout0, d_dout1, d_dpre, d_dw, d_db, d_dpb;
    DeviceArray<float> scratch;

    GeluMatmulCase(long N_, long C_, long OC_, uint64_t seed, float scale)
        : N(N_), C(C_), OC(OC_), act(N * C), dpre(N * C), d_pre(N * C), d_act(N * C), d_w(OC * C), d_dout0(N * OC),
          d_dout1(N * OC), d_dpre(N * C), d_dw(OC * C), d_db(OC), d_dpb(C),
          scratch(matmul_backward_scratch_floats(N, std::max(OC, C))) {
        Rng rng(seed);
        pre = random_bf16_values(N * C, rng, 2.0f);
        weight = random_bf16_values(OC * C, rng, scale);
        dout0 = random_bf16_values(N * OC, rng, scale);
        dout1 = random_bf16_values(N * OC, rng, scale);
        dweight0 = random_bf16_values(OC * C, rng);
        dbias0 = random_bf16_values(OC, rng);
        dpre_bias0 = random_bf16_values(C, rng);
        gelu_forward(act.data(), pre.data(), N * C);
        act = round_to_bf16(act);
        upload(d_pre, pre);
        upload(d_act, act);
        upload(d_w, weight);
        upload(d_dout0, dout0);
        upload(d_dout1, dout1);
        reset_grads();
        std::vector<float> workspace(gemm_workspace_floats(omp_get_max_threads()));
        dweight = dweight0;
        dbias = dbias0;
        dpre_bias = dpre_bias0;
        for (const std::vector<float>* dout : {&dout0, &dout1})
            gelu_matmul_backward(dpre.data(), dweight.data(), dbias.data(), dpre_bias.data(), dout->data(), act.data(),
                                 pre.data(), weight.data(), N, C, OC, {workspace.data(), workspace.size()});
    }
    void reset_grads() {
        upload(d_dw, dweight0);
        upload(d_db, dbias0);
        upload(d_dpb, dpre_bias0);
    }
    // both micro-steps, dpre poisoned before each
    void gpu_backward() {
        for (const bf16* dout : {d_dout0.ptr, d_dout1.ptr}) {
            d_dpre.poison();
            matmul_backward_cuda(d_dpre.ptr, d_dw.ptr, d_db.ptr, dout, d_act.ptr, d_w.ptr, N, C, OC, scratch.ptr, 0,
                                 d_pre.ptr, d_dpb.ptr);
        }
    }
    // whether this case's shape and buffers take cuBLASLt's BGRADB epilogue (llmc/matmul.cuh)
    bool takes_epilogues() const {
        return matmul_epilogues_fit(N, C, OC, {d_dw.ptr, d_dout0.ptr, d_dout1.ptr, d_act.ptr});
    }
};

// attention_forward_cuda and attention_backward_cuda (flash attention) against the CPU reference
// (llmc/attention.cuh), which materializes the T×T probabilities: head sizes 64 and 128, and a T that is not a
// multiple of the 32-row tile. The backward must be bit-reproducible. Timed against the 8192³ GEMM.
#include <omp.h>

#include "dev/cuda/common.h"
#include "llmc/attention.cuh"

static void check_shape(Checks& checks, int B, int T, int C, int NH) {
    long BT = (long)B * T;
    Rng rng(6 + T);
    std::vector<float> qkv = random_bf16_values(BT * 3 * C, rng), dout = random_bf16_values(BT * C, rng);
    DeviceArray<bf16> d_qkv(BT * 3 * C), d_out(BT * C), d_dout(BT * C), d_dqkv(BT * 3 * C);
    DeviceArray<float> d_lse((long)B * NH * T), d_delta((long)B * NH * T);
    upload(d_qkv, qkv);
    upload(d_dout, dout);
    char what[128];

    std::vector<float> out(BT * C), att((size_t)B * NH * T * T), dqkv(BT * 3 * C),
        scratch((size_t)T * omp_get_max_threads());
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, scratch.data());

    attention_forward_cuda(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, 0);
    snprintf(what, sizeof(what), "forward B=%d T=%d C=%d NH=%d (hs %d)", B, T, C, NH, C / NH);
    checks.check(what, download(d_out), out, 2e-2);
    attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_delta.ptr, B, T, C, NH, 0);
    std::vector<float> gpu_dqkv = download(d_dqkv);
    snprintf(what, sizeof(what), "backward dqkv T=%d hs=%d", T, C / NH);
    checks.check(what, gpu_dqkv, dqkv, 3e-2);
    d_dqkv.poison();
    attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_delta.ptr, B, T, C, NH, 0);
    snprintf(what, sizeof(what), "backward bit-reproducible T=%d hs=%d", T, C / NH);
    checks.require(what, download(d_dqkv) == gpu_dqkv);

    // useful FLOPs: QKᵀ and PV over the causal half; the backward does 2.5 times the forward's (FlashAttention's
    // convention, which leaves out this backward's recomputation of P in both of its kernels)
    double flops = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
    snprintf(what, sizeof(what), "forward B=%d T=%d hs=%d", B, T, C / NH);
    report_compute_bound(what, time_ms([&] { attention_forward_cuda(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, 0); }),
                         flops);
    snprintf(what, sizeof(what), "backward B=%d T=%d hs=%d", B, T, C / NH);
    report_compute_bound(what, time_ms([&] {
                             attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr,
                                                     d_delta.ptr, B, T, C, NH, 0);
                         }),
                         2.5 * flops);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    check_shape(checks, 4, 1024, 768, 12);  // GPT-2 124M, hs 64
    check_shape(checks, 2, 1000, 1024, 8);  // hs 128, ragged last tile
    return checks.exit_code();
}

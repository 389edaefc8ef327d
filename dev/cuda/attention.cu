// attention_forward_cuda and attention_backward_cuda (flash attention) against the CPU reference
// (llmc/attention.cuh), which materializes the T×T probabilities: head sizes 64 and 128, and a T that is not a
// multiple of the 32-row tile. The backward must be bit-reproducible. Timed against the 8192³ GEMM. Inputs and
// the CPU reference: AttentionCase in kernel_cases.h.
#include "dev/cuda/kernel_cases.h"

static void check_shape(Checks& checks, int B, int T, int C, int NH) {
    AttentionCase k(B, T, C, NH, 6 + T);
    k.gpu_forward();
    checks.check(strfmt("forward B=%d T=%d C=%d NH=%d (hs %d)", B, T, C, NH, C / NH), download(k.d_out), k.out, 2e-2);
    k.gpu_backward();
    std::vector<float> gpu_dqkv = download(k.d_dqkv);
    checks.check(strfmt("backward dqkv T=%d hs=%d", T, C / NH), gpu_dqkv, k.dqkv, 3e-2);
    k.d_dqkv.poison();
    k.gpu_backward();
    checks.require(strfmt("backward bit-reproducible T=%d hs=%d", T, C / NH), download(k.d_dqkv) == gpu_dqkv);

    // useful FLOPs: QKᵀ and PV over the causal half; the backward does 2.5 times the forward's (FlashAttention's
    // convention, which leaves out this backward's recomputation of P in both of its kernels)
    double flops = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
    report_compute_bound(strfmt("forward B=%d T=%d hs=%d", B, T, C / NH), time_ms([&] { k.gpu_forward(); }), flops);
    report_compute_bound(strfmt("backward B=%d T=%d hs=%d", B, T, C / NH), time_ms([&] { k.gpu_backward(); }),
                         2.5 * flops);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    check_shape(checks, 4, 1024, 768, 12);  // GPT-2 124M, hs 64
    check_shape(checks, 2, 1000, 1024, 8);  // hs 128, ragged last tile
    return checks.exit_code();
}

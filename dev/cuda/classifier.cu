// crossentropy_forward_cuda and the fused crossentropy_backward_inplace_cuda against the CPU reference
// (llmc/classifier.cuh): GPT-2's padded vocabulary (50257 of 50304) and a small one not a multiple of 128;
// the padding columns' gradient must be exactly 0. Timed against the copy bandwidth. Inputs and the CPU
// reference: ClassifierCase in kernel_cases.h.
#include "dev/cuda/kernel_cases.h"

static void check_shape(Checks& checks, long N, int V, int Vp) {
    ClassifierCase k(N, V, Vp, 7 + V);
    k.gpu_forward();
    checks.check(strfmt("forward losses N=%ld V=%d Vp=%d", N, V, Vp), download(k.d_losses), k.losses, 1e-3);
    k.d_losses.poison();
    k.gpu_backward_inplace();
    checks.check(strfmt("fused losses V=%d", V), download(k.d_losses), k.losses, 1e-3);
    std::vector<float> gpu_grad = download(k.d_logits);
    checks.check(strfmt("fused dlogits V=%d", V), gpu_grad, k.grad, 2e-2);
    checks.require(strfmt("fused dlogits padding exactly 0 V=%d", V), k.padding_zero(gpu_grad));

    k.reset_logits();
    report_memory_bound(strfmt("forward N=%ld Vp=%d", N, Vp), time_ms([&] { k.gpu_forward(); }), 2.0 * N * Vp);
    // repeated in place on its own output: the values change, the work does not
    report_memory_bound(strfmt("fused forward+backward N=%ld Vp=%d", N, Vp), time_ms([&] { k.gpu_backward_inplace(); }),
                        3.0 * 2.0 * N * Vp);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    check_shape(checks, 4096, 50257, 50304);
    check_shape(checks, 333, 1000, 1024);
    return checks.exit_code();
}

// crossentropy_forward_cuda and the fused crossentropy_backward_inplace_cuda against the CPU reference
// (llmc/classifier.cuh): GPT-2's padded vocabulary (50257 of 50304) and a small one not a multiple of 128;
// the padding columns' gradient must be exactly 0. Timed against the copy bandwidth.
#include "dev/cuda/common.h"
#include "llmc/classifier.cuh"

static void check_shape(Checks& checks, long N, int V, int Vp) {
    Rng rng(7 + V);
    std::vector<float> logits = random_bf16_values(N * Vp, rng, 2.0f);
    std::vector<int> targets(N);
    for (auto& t : targets) t = (int)rng.below(V);
    DeviceArray<bf16> d_logits(N * Vp);
    DeviceArray<int> d_targets(N);
    DeviceArray<float> d_losses(N);
    upload(d_logits, logits);
    upload(d_targets, targets);
    float dloss = 1.0f / N;
    char what[128];

    std::vector<float> losses(N), grad = logits;
    crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
    crossentropy_backward_inplace(grad.data(), targets.data(), N, V, Vp, dloss);

    crossentropy_forward_cuda(d_losses.ptr, d_logits.ptr, d_targets.ptr, N, V, Vp, 0);
    snprintf(what, sizeof(what), "forward losses N=%ld V=%d Vp=%d", N, V, Vp);
    checks.check(what, download(d_losses), losses, 1e-3);
    d_losses.poison();
    crossentropy_backward_inplace_cuda(d_logits.ptr, d_losses.ptr, d_targets.ptr, N, V, Vp, dloss, 0);
    snprintf(what, sizeof(what), "fused losses V=%d", V);
    checks.check(what, download(d_losses), losses, 1e-3);
    std::vector<float> gpu_grad = download(d_logits);
    snprintf(what, sizeof(what), "fused dlogits V=%d", V);
    checks.check(what, gpu_grad, grad, 2e-2);
    bool padding_zero = true;
    for (long n = 0; n < N; n++)
        for (int v = V; v < Vp; v++) padding_zero = padding_zero && gpu_grad[n * Vp + v] == 0.0f;
    snprintf(what, sizeof(what), "fused dlogits padding exactly 0 V=%d", V);
    checks.require(what, padding_zero);

    upload(d_logits, logits);
    snprintf(what, sizeof(what), "forward N=%ld Vp=%d", N, Vp);
    report_memory_bound(what, time_ms([&] { crossentropy_forward_cuda(d_losses.ptr, d_logits.ptr, d_targets.ptr, N, V, Vp, 0); }),
                        2.0 * N * Vp);
    // repeated in place on its own output: the values change, the work does not
    snprintf(what, sizeof(what), "fused forward+backward N=%ld Vp=%d", N, Vp);
    report_memory_bound(what, time_ms([&] {
                            crossentropy_backward_inplace_cuda(d_logits.ptr, d_losses.ptr, d_targets.ptr, N, V, Vp,
                                                               dloss, 0);
                        }),
                        3.0 * 2.0 * N * Vp);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    check_shape(checks, 4096, 50257, 50304);
    check_shape(checks, 333, 1000, 1024);
    return checks.exit_code();
}

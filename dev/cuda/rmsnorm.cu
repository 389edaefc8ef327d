// rmsnorm: the RMSNorm kernels of llmc/norm.cuh, checked against the CPU reference (outputs poisoned first) and timed
// against the copy bandwidth on Llama 3's widths (2048: 3.2 1B, 4096: 3.1 8B, 8192: 70B, 16384: 405B; N·C = 32M,
// each activation 64 MiB, more than an H100's L2), one per row layout (1, 2, 4 and 8 warps a row), and on GPT-2's
// 768 (4 vectors a thread) beside dev/cuda/layernorm's figure. An odd shape (C not a multiple of a group's
// vectors, a ragged last backward block) with a large eps is checked but not timed.
// Checks: fused residual + rmsnorm (residual, out, rstd), the same with the residual stream updated in place,
// plain forward, backward (dinp, dweight accumulated into random values), the backward's bits reproducible.
// Inputs and the CPU reference: NormCase in norm_case.h.
#include "dev/cuda/norm_case.h"

static void check(Checks& checks, NormCase& k) {
    if (!have_gpu()) return;
    std::string v = strfmt("N=%ld C=%d eps=%g ", k.N, k.C, k.eps);
    for (auto* buffer : {&k.d_res, &k.d_out}) buffer->poison();
    k.d_rstd.poison();
    k.gpu_fused_forward();
    checks.check(v + "fused: residual", download(k.d_res), k.res, 1e-2);
    checks.check(v + "fused: out", download(k.d_out), k.out, 2e-2);
    checks.check(v + "fused: rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.d_rstd.poison();
    k.gpu_fused_forward_in_place();
    checks.check(v + "fused in place: residual", download(k.d_res), k.res, 1e-2);
    checks.check(v + "fused in place: out", download(k.d_out), k.out, 2e-2);
    checks.check(v + "fused in place: rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.d_rstd.poison();
    k.gpu_forward();
    checks.check(v + "forward: out", download(k.d_out), k.out, 2e-2);
    checks.check(v + "forward: rstd", download(k.d_rstd), k.rstd, 1e-3);

    k.use_cpu_stats();
    k.reset_grads();
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dinp), dw = download(k.d_dw);
    checks.check(v + "backward: dinp (+=)", dinp, k.dinp, 2e-2);
    checks.check(v + "backward: dweight (+=)", dw, k.dweight, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    checks.require(v + "backward bit-reproducible", download(k.d_dinp) == dinp && download(k.d_dw) == dw);
}

// each timed call cycles through its own copies of the activations; weight and rstd are shared
static void time_kernels(NormCase& k) {
    if (!have_gpu()) return;
    long N = k.N;
    int C = k.C;
    double forward_bytes = 8.0 * N * C, backward_bytes = 8.0 * N * C;  // 2-byte elements: 2 read + 2 written, 3 + 1
    int sets = timing_sets(forward_bytes);
    TimingCopies<bf16> a(k.d_a, sets), b(k.d_b, sets), res(k.d_res, sets), out(k.d_out, sets), dout(k.d_dout, sets),
        dinp(k.d_dinp, sets);
    float fused_ms = median_ms(
        [&](int s) {
            fused_residual_norm_forward_cuda(Norm::RMSNorm, res[s], out[s], nullptr, k.d_rstd.ptr, a[s], b[s],
                                             k.d_w.ptr, nullptr, N, C, k.eps, 0);
        },
        sets);
    float backward_ms = median_ms(
        [&](int s) {
            norm_backward_cuda(Norm::RMSNorm, dinp[s], k.d_dw.ptr, nullptr, dout[s], res[s], k.d_w.ptr, nullptr,
                               k.d_rstd.ptr, N, C, k.scratch.ptr, 0);
        },
        sets);
    report_memory_bound(strfmt("fused residual+rmsnorm N=%ld C=%d", N, C), fused_ms, forward_bytes);
    report_memory_bound(strfmt("rmsnorm backward N=%ld C=%d", N, C), backward_ms, backward_bytes);
}

int main() {
    Program program(
        "rmsnorm: fused residual + RMSNorm forward and backward against the CPU, C = 768 to 16384; timed");
    Checks checks;
    const long timed[][2] = {{16L * 1024, 2048}, {8L * 1024, 4096}, {4L * 1024, 8192}, {2L * 1024, 16384},
                             {64L * 1024, 768}};
    for (auto& shape : timed) {
        NormCase k(Norm::RMSNorm, shape[0], (int)shape[1], 1e-5f, 3);  // Llama 3's norm_eps
        check(checks, k);
        time_kernels(k);
    }
    NormCase odd(Norm::RMSNorm, 1001, 12296, 0.5f, 4);
    check(checks, odd);
    return program.finish(checks);
}

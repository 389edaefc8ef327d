// matmul_forward_cuda (bias, bias + fused GELU) and matmul_backward_cuda against the CPU reference
// (llmc/matmul.cuh), on GPT-2's four matmul shapes' worth of sizes, then timed against the 8192³ GEMM.
#include <omp.h>

#include "dev/cuda/common.h"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"

static void check_shape(Checks& checks, long N, long C, long OC) {
    Rng rng(4 + OC);
    std::vector<float> inp = random_bf16_values(N * C, rng), weight = random_bf16_values(OC * C, rng, 0.05f),
                       bias = random_bf16_values(OC, rng, 0.5f), dout = random_bf16_values(N * OC, rng, 0.05f),
                       dweight0 = random_bf16_values(OC * C, rng), dbias0 = random_bf16_values(OC, rng);
    DeviceArray<bf16> d_inp(N * C), d_w(OC * C), d_b(OC), d_out(N * OC), d_pre(N * OC), d_dout(N * OC),
        d_dinp(N * C), d_dw(OC * C), d_db(OC);
    DeviceArray<float> scratch(matmul_backward_scratch_floats(N, OC));
    upload(d_inp, inp);
    upload(d_w, weight);
    upload(d_b, bias);
    upload(d_dout, dout);
    std::vector<float> workspace(gemm_workspace_floats(omp_get_max_threads()));
    char what[128];

    std::vector<float> out(N * OC), act(N * OC);
    matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC, workspace.data());
    matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, nullptr, 0);
    snprintf(what, sizeof(what), "forward+bias N=%ld C=%ld OC=%ld", N, C, OC);
    checks.check(what, download(d_out), out, 2e-2);
    std::vector<float> pre = round_to_bf16(out);
    gelu_forward(act.data(), pre.data(), N * OC);
    d_out.poison();
    matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, d_pre.ptr, 0);
    snprintf(what, sizeof(what), "forward+bias+GELU pre-GELU N=%ld", N);
    checks.check(what, download(d_pre), out, 2e-2);
    snprintf(what, sizeof(what), "forward+bias+GELU out N=%ld", N);
    checks.check(what, download(d_out), act, 3e-2);

    std::vector<float> dinp(N * C), dweight = dweight0, dbias = dbias0;
    matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, C, OC,
                    workspace.data());
    upload(d_dw, dweight0);
    upload(d_db, dbias0);
    matmul_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_w.ptr, N, C, OC, scratch.ptr, 0);
    snprintf(what, sizeof(what), "backward dinp N=%ld C=%ld OC=%ld", N, C, OC);
    checks.check(what, download(d_dinp), dinp, 2e-2);
    snprintf(what, sizeof(what), "backward dweight (+=) N=%ld", N);
    checks.check(what, download(d_dw), dweight, 2e-2);
    snprintf(what, sizeof(what), "backward dbias (+=) N=%ld", N);
    checks.check(what, download(d_db), dbias, 2e-2);

    double flops = 2.0 * N * C * OC;
    snprintf(what, sizeof(what), "forward+bias+GELU N=%ld C=%ld OC=%ld", N, C, OC);
    report_compute_bound(what, time_ms([&] { matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, d_pre.ptr, 0); }),
                         flops);
    snprintf(what, sizeof(what), "backward N=%ld C=%ld OC=%ld", N, C, OC);
    report_compute_bound(what, time_ms([&] {
                             matmul_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_w.ptr, N, C,
                                                  OC, scratch.ptr, 0);
                         }),
                         2.0 * flops);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    check_shape(checks, 8192, 768, 2304);  // qkv
    check_shape(checks, 8192, 768, 3072);  // MLP up
    check_shape(checks, 8192, 3072, 768);  // MLP down
    check_shape(checks, 1000, 200, 72);    // small, N not a multiple of any tile
    return checks.exit_code();
}

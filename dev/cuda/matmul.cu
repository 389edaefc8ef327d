// matmul_forward_cuda (bias, bias + fused GELU) and matmul_backward_cuda against the CPU reference
// (llmc/matmul.cuh), on GPT-2's four matmul shapes' worth of sizes, then timed against the 8192³ GEMM.
// Inputs and the CPU reference: MatmulCase in matmul_case.h.
#include "dev/cuda/matmul_case.h"

static void check_shape(Checks& checks, long N, long C, long OC) {
    MatmulCase k(N, C, OC, 4 + OC, 0.05f);
    if (!have_gpu()) return;  // without a GPU: the inputs and CPU reference alone
    k.gpu_forward();
    checks.check(strfmt("forward+bias N=%ld C=%ld OC=%ld", N, C, OC), download(k.d_out), k.out, 2e-2);
    k.d_out.poison();
    k.gpu_forward_gelu();
    checks.check(strfmt("forward+bias+GELU pre-GELU N=%ld", N), download(k.d_pre), k.out, 2e-2);
    checks.check(strfmt("forward+bias+GELU out N=%ld", N), download(k.d_out), k.act, 3e-2);

    k.gpu_backward();
    checks.check(strfmt("backward dinp N=%ld C=%ld OC=%ld", N, C, OC), download(k.d_dinp), k.dinp, 2e-2);
    checks.check(strfmt("backward dweight (+=) N=%ld", N), download(k.d_dw), k.dweight, 2e-2);
    checks.check(strfmt("backward dbias (+=) N=%ld", N), download(k.d_db), k.dbias, 2e-2);

    double flops = 2.0 * N * C * OC;
    report_compute_bound(strfmt("forward+bias+GELU N=%ld C=%ld OC=%ld", N, C, OC),
                         time_ms([&] { k.gpu_forward_gelu(); }), flops);
    report_compute_bound(strfmt("backward N=%ld C=%ld OC=%ld", N, C, OC), time_ms([&] { k.gpu_backward(); }),
                         2.0 * flops);
}

int main() {
    Program program(
        "matmul: cuBLASLt forward (bias, GELU) and backward (dinp, dweight, dbias) against the CPU on GPT-2's shapes");
    Checks checks;
    check_shape(checks, 8192, 768, 2304);  // qkv
    check_shape(checks, 8192, 768, 3072);  // MLP up
    check_shape(checks, 8192, 3072, 768);  // MLP down
    check_shape(checks, 1000, 200, 72);    // small, N not a multiple of any tile
    return program.finish(checks);
}

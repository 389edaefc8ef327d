// fused_residual_layernorm_forward_cuda, layernorm_forward_cuda and layernorm_backward_cuda against the CPU
// reference (llmc/layernorm.cuh), then timed. The backward accumulates into random dinp/dweight/dbias (it is
// +=) and must be bit-reproducible. Inputs and the CPU reference: LayernormCase in kernel_cases.h.
#include "dev/cuda/kernel_cases.h"

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const long N = 8L * 1024;
    const int C = 768;
    LayernormCase k(N, C, 3);

    k.gpu_fused_forward();
    checks.check("fused residual: residual", download(k.d_res), k.res, 1e-2);
    checks.check("fused residual: layernorm out", download(k.d_out), k.out, 2e-2);
    checks.check("fused residual: mean", download(k.d_mean), k.mean, 1e-3);
    checks.check("fused residual: rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.gpu_forward();
    checks.check("layernorm_forward out", download(k.d_out), k.out, 2e-2);

    k.use_cpu_stats();
    k.gpu_backward();
    std::vector<float> gpu_dw = download(k.d_dw);
    checks.check("layernorm_backward dinp (+=)", download(k.d_dinp), k.dinp, 2e-2);
    checks.check("layernorm_backward dweight (+=)", gpu_dw, k.dweight, 2e-2);
    checks.check("layernorm_backward dbias (+=)", download(k.d_db), k.dbias, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    checks.require("layernorm_backward dweight bit-reproducible", download(k.d_dw) == gpu_dw);

    report_memory_bound("fused residual+layernorm N=8192 C=768", time_ms([&] { k.gpu_fused_forward(); }),
                        4.0 * N * C * 2);
    report_memory_bound("layernorm_backward N=8192 C=768", time_ms([&] { k.gpu_backward(); }), 4.0 * N * C * 2);
    return checks.exit_code();
}

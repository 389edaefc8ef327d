// fused_residual_layernorm_forward_cuda, layernorm_forward_cuda and layernorm_backward_cuda against the CPU
// reference (llmc/layernorm.cuh), then timed. The backward accumulates into random dinp/dweight/dbias (it is
// +=) and must be bit-reproducible.
#include "dev/cuda/common.h"
#include "llmc/layernorm.cuh"
#include "llmc/residual.cuh"

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const long N = 8L * 1024;
    const int C = 768;
    Rng rng(3);
    std::vector<float> a = random_bf16_values(N * C, rng), b = random_bf16_values(N * C, rng),
                       weight = random_bf16_values(C, rng), bias = random_bf16_values(C, rng),
                       dout = random_bf16_values(N * C, rng), dinp0 = random_bf16_values(N * C, rng),
                       dweight0 = random_bf16_values(C, rng), dbias0 = random_bf16_values(C, rng);
    DeviceArray<bf16> d_a(N * C), d_b(N * C), d_w(C), d_bias(C), d_res(N * C), d_out(N * C), d_dout(N * C),
        d_dinp(N * C), d_dw(C), d_db(C);
    DeviceArray<float> d_mean(N), d_rstd(N), scratch(layernorm_backward_scratch_floats(N, C));
    upload(d_a, a);
    upload(d_b, b);
    upload(d_w, weight);
    upload(d_bias, bias);
    upload(d_dout, dout);

    // the residual stream is stored in bf16, and the layernorm sees the stored value
    std::vector<float> res(N * C), out(N * C), mean(N), rstd(N);
    residual_forward(res.data(), a.data(), b.data(), N * C);
    res = round_to_bf16(res);
    layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), weight.data(), bias.data(), N, C);
    fused_residual_layernorm_forward_cuda(d_res.ptr, d_out.ptr, d_mean.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr,
                                          d_bias.ptr, N, C, 0);
    checks.check("fused residual: residual", download(d_res), res, 1e-2);
    checks.check("fused residual: layernorm out", download(d_out), out, 2e-2);
    checks.check("fused residual: mean", download(d_mean), mean, 1e-3);
    checks.check("fused residual: rstd", download(d_rstd), rstd, 1e-3);
    d_out.poison();
    layernorm_forward_cuda(d_out.ptr, d_mean.ptr, d_rstd.ptr, d_res.ptr, d_w.ptr, d_bias.ptr, N, C, 0);
    checks.check("layernorm_forward out", download(d_out), out, 2e-2);

    // backward from the CPU's statistics, so both sides differentiate the same function
    upload(d_mean, mean);
    upload(d_rstd, rstd);
    std::vector<float> dinp = dinp0, dweight = dweight0, dbias = dbias0;
    layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), res.data(), weight.data(), mean.data(),
                       rstd.data(), N, C);
    auto run_backward = [&] {
        upload(d_dinp, dinp0);
        upload(d_dw, dweight0);
        upload(d_db, dbias0);
        layernorm_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_res.ptr, d_w.ptr, d_mean.ptr, d_rstd.ptr,
                                N, C, scratch.ptr, 0);
    };
    run_backward();
    std::vector<float> gpu_dw = download(d_dw);
    checks.check("layernorm_backward dinp (+=)", download(d_dinp), dinp, 2e-2);
    checks.check("layernorm_backward dweight (+=)", gpu_dw, dweight, 2e-2);
    checks.check("layernorm_backward dbias (+=)", download(d_db), dbias, 2e-2);
    run_backward();
    checks.require("layernorm_backward dweight bit-reproducible", download(d_dw) == gpu_dw);

    report_memory_bound("fused residual+layernorm N=8192 C=768", time_ms([&] {
                            fused_residual_layernorm_forward_cuda(d_res.ptr, d_out.ptr, d_mean.ptr, d_rstd.ptr, d_a.ptr,
                                                                  d_b.ptr, d_w.ptr, d_bias.ptr, N, C, 0);
                        }),
                        4.0 * N * C * 2);
    report_memory_bound("layernorm_backward N=8192 C=768", time_ms([&] {
                            layernorm_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_res.ptr, d_w.ptr,
                                                    d_mean.ptr, d_rstd.ptr, N, C, scratch.ptr, 0);
                        }),
                        4.0 * N * C * 2);
    return checks.exit_code();
}

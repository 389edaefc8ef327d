// Each CUDA kernel against the CPU reference in the same llmc header, on random bf16 inputs with the outputs
// poisoned (NaN bytes) beforehand, for two shapes each: small and odd, so that rows, tiles and vector widths
// do not line up. Tolerances are bf16's. Without a GPU every case says "skipped: no GPU" and passes.
// dev/cuda/ runs the same checks on GPT-2-sized shapes and times them.
#include <omp.h>

#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/residual.cuh"
#include "test/test_helpers.h"

namespace {

#define SKIP_WITHOUT_GPU_CASE()                \
    do {                                       \
        if (!cuda_device_available()) {        \
            WARN("skipped: no GPU");           \
            return;                            \
        }                                      \
    } while (0)

void require_close(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    Comparison c = compare_rms(gpu, cpu, tol);
    INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    REQUIRE(c.pass());
}

void check_encoder(int B, int T, int C, int V) {
    Rng rng(11);
    long BT = (long)B * T;
    std::vector<int> tokens(BT);
    for (auto& t : tokens) t = (int)rng.below(rng.uniform() < 0.5f ? 3 : V);  // repeats
    std::vector<float> wte = random_bf16_values((size_t)V * C, rng), wpe = random_bf16_values((size_t)T * C, rng),
                       dout = random_bf16_values(BT * C, rng), dwte = random_bf16_values((size_t)V * C, rng),
                       dwpe = random_bf16_values((size_t)T * C, rng);
    DeviceArray<int> d_tokens(BT);
    DeviceArray<bf16> d_wte(wte.size()), d_wpe(wpe.size()), d_out(BT * C), d_dout(BT * C), d_dwte(wte.size()),
        d_dwpe(wpe.size());
    DeviceArray<char> scratch(encoder_backward_scratch_bytes(B, T));
    upload(d_tokens, tokens);
    upload(d_wte, wte);
    upload(d_wpe, wpe);
    upload(d_dout, dout);
    upload(d_dwte, dwte);
    upload(d_dwpe, dwpe);
    std::vector<float> out(BT * C);
    encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    encoder_forward_cuda(d_out.ptr, d_tokens.ptr, d_wte.ptr, d_wpe.ptr, B, T, C, 0);
    require_close("encoder out", download(d_out), out, 1e-2);
    encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    encoder_backward_cuda(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tokens.ptr, B, T, C, scratch.ptr, 0);
    require_close("encoder dwte", download(d_dwte), dwte, 2e-2);
    require_close("encoder dwpe", download(d_dwpe), dwpe, 2e-2);
}

void check_layernorm(long N, int C) {
    Rng rng(12);
    std::vector<float> a = random_bf16_values(N * C, rng), b = random_bf16_values(N * C, rng),
                       w = random_bf16_values(C, rng), bias = random_bf16_values(C, rng),
                       dout = random_bf16_values(N * C, rng), dinp = random_bf16_values(N * C, rng),
                       dw = random_bf16_values(C, rng), db = random_bf16_values(C, rng);
    DeviceArray<bf16> d_a(N * C), d_b(N * C), d_w(C), d_bias(C), d_res(N * C), d_out(N * C), d_dout(N * C),
        d_dinp(N * C), d_dw(C), d_db(C);
    DeviceArray<float> d_mean(N), d_rstd(N), scratch(layernorm_backward_scratch_floats(N, C));
    upload(d_a, a);
    upload(d_b, b);
    upload(d_w, w);
    upload(d_bias, bias);
    upload(d_dout, dout);
    upload(d_dinp, dinp);
    upload(d_dw, dw);
    upload(d_db, db);
    std::vector<float> res(N * C), out(N * C), mean(N), rstd(N);
    residual_forward(res.data(), a.data(), b.data(), N * C);
    res = round_to_bf16(res);
    layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), w.data(), bias.data(), N, C);
    fused_residual_layernorm_forward_cuda(d_res.ptr, d_out.ptr, d_mean.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr,
                                          d_bias.ptr, N, C, 0);
    require_close("residual", download(d_res), res, 1e-2);
    require_close("layernorm out", download(d_out), out, 2e-2);
    require_close("mean", download(d_mean), mean, 1e-3);
    require_close("rstd", download(d_rstd), rstd, 1e-3);
    upload(d_mean, mean);
    upload(d_rstd, rstd);
    layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), res.data(), w.data(), mean.data(), rstd.data(),
                       N, C);
    layernorm_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_res.ptr, d_w.ptr, d_mean.ptr, d_rstd.ptr, N,
                            C, scratch.ptr, 0);
    require_close("layernorm dinp", download(d_dinp), dinp, 2e-2);
    require_close("layernorm dweight", download(d_dw), dw, 2e-2);
    require_close("layernorm dbias", download(d_db), db, 2e-2);
}

void check_matmul(long N, long C, long OC) {
    Rng rng(13);
    std::vector<float> inp = random_bf16_values(N * C, rng), w = random_bf16_values(OC * C, rng, 0.1f),
                       bias = random_bf16_values(OC, rng), dout = random_bf16_values(N * OC, rng, 0.1f),
                       dw = random_bf16_values(OC * C, rng), db = random_bf16_values(OC, rng);
    DeviceArray<bf16> d_inp(N * C), d_w(OC * C), d_b(OC), d_out(N * OC), d_pre(N * OC), d_dout(N * OC),
        d_dinp(N * C), d_dw(OC * C), d_db(OC);
    DeviceArray<float> scratch(matmul_backward_scratch_floats(N, OC));
    upload(d_inp, inp);
    upload(d_w, w);
    upload(d_b, bias);
    upload(d_dout, dout);
    upload(d_dw, dw);
    upload(d_db, db);
    std::vector<float> workspace(gemm_workspace_floats(omp_get_max_threads())), out(N * OC), act(N * OC), dinp(N * C);
    matmul_forward(out.data(), inp.data(), w.data(), bias.data(), N, C, OC, workspace.data());
    matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, nullptr, 0);
    require_close("matmul out", download(d_out), out, 2e-2);
    std::vector<float> pre = round_to_bf16(out);
    gelu_forward(act.data(), pre.data(), N * OC);
    d_out.poison();
    matmul_forward_cuda(d_out.ptr, d_inp.ptr, d_w.ptr, d_b.ptr, N, C, OC, d_pre.ptr, 0);
    require_close("matmul pre-GELU", download(d_pre), out, 2e-2);
    require_close("matmul GELU out", download(d_out), act, 3e-2);
    matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C, OC, workspace.data());
    matmul_backward_cuda(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_w.ptr, N, C, OC, scratch.ptr, 0);
    require_close("matmul dinp", download(d_dinp), dinp, 2e-2);
    require_close("matmul dweight", download(d_dw), dw, 2e-2);
    require_close("matmul dbias", download(d_db), db, 2e-2);
}

void check_attention(int B, int T, int C, int NH) {
    Rng rng(14);
    long BT = (long)B * T;
    std::vector<float> qkv = random_bf16_values(BT * 3 * C, rng), dout = random_bf16_values(BT * C, rng);
    DeviceArray<bf16> d_qkv(BT * 3 * C), d_out(BT * C), d_dout(BT * C), d_dqkv(BT * 3 * C);
    DeviceArray<float> d_lse((long)B * NH * T), d_delta((long)B * NH * T);
    upload(d_qkv, qkv);
    upload(d_dout, dout);
    std::vector<float> out(BT * C), att((size_t)B * NH * T * T), dqkv(BT * 3 * C),
        scratch((size_t)T * omp_get_max_threads());
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, scratch.data());
    attention_forward_cuda(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, C, NH, 0);
    require_close("attention out", download(d_out), out, 2e-2);
    attention_backward_cuda(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, d_delta.ptr, B, T, C, NH, 0);
    require_close("attention dqkv", download(d_dqkv), dqkv, 3e-2);
}

void check_gelu(long N) {
    Rng rng(15);
    std::vector<float> inp = random_bf16_values(N, rng, 2.0f), dout = random_bf16_values(N, rng), out(N), dinp(N);
    DeviceArray<bf16> d_inp(N), d_out(N), d_dout(N);
    upload(d_inp, inp);
    upload(d_dout, dout);
    gelu_forward(out.data(), inp.data(), N);
    gelu_backward(dinp.data(), inp.data(), dout.data(), N);
    gelu_forward_cuda(d_out.ptr, d_inp.ptr, N, 0);
    require_close("gelu out", download(d_out), out, 1e-2);
    gelu_backward_cuda(d_dout.ptr, d_inp.ptr, d_dout.ptr, N, 0);  // in place
    require_close("gelu dinp", download(d_dout), dinp, 1e-2);
}

void check_classifier(long N, int V, int Vp) {
    Rng rng(16);
    std::vector<float> logits = random_bf16_values(N * Vp, rng, 2.0f), losses(N);
    std::vector<int> targets(N);
    for (auto& t : targets) t = (int)rng.below(V);
    DeviceArray<bf16> d_logits(N * Vp);
    DeviceArray<int> d_targets(N);
    DeviceArray<float> d_losses(N);
    upload(d_logits, logits);
    upload(d_targets, targets);
    crossentropy_forward(losses.data(), logits.data(), targets.data(), N, V, Vp);
    crossentropy_forward_cuda(d_losses.ptr, d_logits.ptr, d_targets.ptr, N, V, Vp, 0);
    require_close("losses", download(d_losses), losses, 1e-3);
    d_losses.poison();
    crossentropy_backward_inplace(logits.data(), targets.data(), N, V, Vp, 1.0f / N);
    crossentropy_backward_inplace_cuda(d_logits.ptr, d_losses.ptr, d_targets.ptr, N, V, Vp, 1.0f / N, 0);
    require_close("fused losses", download(d_losses), losses, 1e-3);
    std::vector<float> grad = download(d_logits);
    require_close("dlogits", grad, logits, 2e-2);
    for (long n = 0; n < N; n++)
        for (int v = V; v < Vp; v++) REQUIRE(grad[n * Vp + v] == 0.0f);
}

void check_adamw(long n) {
    Rng rng(17);
    std::vector<float> master = random_bf16_values(n, rng, 0.1f), grads = random_bf16_values(n, rng, 0.01f),
                       m = random_bf16_values(n, rng, 0.01f), v = random_bf16_values(n, rng, 1e-3f);
    for (auto& x : v) x = x * x;
    for (auto& x : master) x *= 1.0f + 1e-3f * rng.uniform();
    DeviceArray<bf16> d_params(n), d_grads(n);
    DeviceArray<float> d_master(n), d_m(n), d_v(n);
    upload(d_master, master);
    upload(d_m, m);
    upload(d_v, v);
    upload(d_grads, grads);
    adamw_update(master.data(), grads.data(), m.data(), v.data(), n, 1e-3f, 0.1f, 0.7f, 3);
    adamw_update_cuda(d_params.ptr, d_master.ptr, d_grads.ptr, d_m.ptr, d_v.ptr, n, 1e-3f, 0.1f, 0.7f, 3, 99,
                      AdamWConfig{}, 0);
    std::vector<float> gpu_master = download(d_master), params = download(d_params);
    require_close("master", gpu_master, master, 1e-5);
    require_close("m", download(d_m), m, 1e-5);
    require_close("v", download(d_v), v, 1e-5);
    for (long i = 0; i < n; i++) {
        // the parameter is the master weight truncated to bf16, or one bf16 step further from zero
        uint32_t bits, p;
        memcpy(&bits, &gpu_master[i], 4);
        memcpy(&p, &params[i], 4);
        uint32_t down = bits & 0xffff0000u;
        INFO("element " << i);
        REQUIRE((p == down || p == down + 0x10000u));
    }
}

void check_global_norm(long n) {
    Rng rng(18);
    std::vector<float> x = random_bf16_values(n, rng, 0.1f);
    DeviceArray<bf16> d_x(n);
    DeviceArray<float> d_out(1), partial(GLOBAL_NORM_BLOCKS);
    upload(d_x, x);
    sum_of_squares_cuda(d_out.ptr, d_x.ptr, n, partial.ptr, 0);
    require_close("sum of squares", download(d_out), {(float)sum_of_squares(x.data(), n)}, 1e-4);
}

}  // namespace

TEST_CASE("CUDA encoder forward and deterministic backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_encoder(2, 64, 64, 100);
    check_encoder(3, 33, 200, 1000);
}

TEST_CASE("CUDA fused residual + layernorm and layernorm backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_layernorm(64, 64);
    check_layernorm(130, 200);
}

TEST_CASE("CUDA cuBLASLt matmul forward (bias, GELU) and backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_matmul(64, 64, 96);
    check_matmul(100, 72, 40);
}

TEST_CASE("CUDA flash attention forward and backward match the CPU for head sizes 64 and 128", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_attention(2, 64, 128, 2);  // hs 64
    check_attention(1, 77, 256, 2);  // hs 128, T not a multiple of the tile
}

TEST_CASE("CUDA GELU forward and backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_gelu(1024);
    check_gelu(8 * 1001);
}

TEST_CASE("CUDA fused classifier matches the CPU and zeroes the padding columns", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_classifier(8, 1000, 1024);
    check_classifier(5, 77, 128);  // V not a multiple of 128
}

TEST_CASE("CUDA AdamW matches the CPU and rounds parameters to a bf16 neighbour", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_adamw(1000);
    check_adamw(4099);
}

TEST_CASE("CUDA sum of squares matches the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_global_norm(1000);
    check_global_norm(100003);
}

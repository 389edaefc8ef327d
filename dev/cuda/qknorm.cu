// qknorm: the QK-norm kernels of llmc/norm.cuh (Qwen3's RMSNorm on each query and key head before RoPE), checked
// against the CPU reference (outputs poisoned first) and timed against the copy bandwidth at Qwen3's shapes
// (heads of 128: 0.6B's 16 query and 8 key/value heads, 8B's 32 and 8; N = 16K rows, B·T of a 4×4096 batch). An
// odd shape (one warp-pass short of a head: hd 12; a ragged last backward block) is checked but not timed.
// Checks: forward (out, rstd), backward in place (dinp = dout) with the weights' gradients accumulated into
// random values, the backward's bits reproducible.
#include "dev/cuda/common.h"
#include "llmc/norm.cuh"

struct QkNormCase {
    long N;
    int NH, KV, hd;
    float eps = 1e-6f;
    std::vector<float> x, qw, kw, dout, dqw0, dkw0;       // inputs
    std::vector<float> out, rstd, dinp, dqw, dkw;         // CPU reference
    DeviceArray<bf16> d_x, d_out, d_qw, d_kw, d_dinp, d_dqw, d_dkw;
    DeviceArray<float> d_rstd, scratch;

    QkNormCase(long N_, int NH_, int KV_, int hd_, uint64_t seed)
        : N(N_), NH(NH_), KV(KV_), hd(hd_), d_x(width()), d_out(width()), d_qw(hd), d_kw(hd), d_dinp(width()),
          d_dqw(hd), d_dkw(hd), d_rstd(N * (NH + KV)), scratch(qk_norm_backward_scratch_floats(N, hd)) {
        Rng rng(seed);
        x = random_bf16_values(width(), rng);
        qw = random_bf16_values(hd, rng);
        kw = random_bf16_values(hd, rng);
        dout = random_bf16_values(width(), rng);
        dqw0 = random_bf16_values(hd, rng);
        dkw0 = random_bf16_values(hd, rng);
        upload(d_x, x);
        upload(d_qw, qw);
        upload(d_kw, kw);
        out.resize(width()), rstd.resize(N * (NH + KV)), dinp.resize(width());
        qk_norm_forward(out.data(), rstd.data(), x.data(), qw.data(), kw.data(), N, NH, KV, hd, eps);
        dqw = dqw0, dkw = dkw0;
        qk_norm_backward(dinp.data(), dqw.data(), dkw.data(), dout.data(), x.data(), qw.data(), kw.data(), rstd.data(), N,
                         NH, KV, hd, Workspace{});
    }
    size_t width() const { return (size_t)N * (NH + 2 * KV) * hd; }
    void reset_grads() {
        upload(d_dinp, dout);
        upload(d_dqw, dqw0);
        upload(d_dkw, dkw0);
        upload(d_rstd, rstd);  // the backward runs from the CPU's statistics: both sides differentiate one function
    }
    void gpu_forward() { qk_norm_forward_cuda(d_out.ptr, d_rstd.ptr, d_x.ptr, d_qw.ptr, d_kw.ptr, N, NH, KV, hd, eps, 0); }
    void gpu_backward() {
        qk_norm_backward_cuda(d_dinp.ptr, d_dqw.ptr, d_dkw.ptr, d_dinp.ptr, d_x.ptr, d_qw.ptr, d_kw.ptr, d_rstd.ptr, N, NH,
                              KV, hd, scratch.ptr, 0);
    }
};

static void check(Checks& checks, QkNormCase& k) {
    if (!have_gpu()) return;
    std::string v = strfmt("N=%ld NH=%d KV=%d hd=%d ", k.N, k.NH, k.KV, k.hd);
    k.d_out.poison();
    k.d_rstd.poison();
    k.gpu_forward();
    checks.check(v + "forward: out", download(k.d_out), k.out, 2e-2);
    checks.check(v + "forward: rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.reset_grads();
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dinp), dq = download(k.d_dqw), dk = download(k.d_dkw);
    checks.check(v + "backward in place: dinp", dinp, k.dinp, 3e-2);
    checks.check(v + "backward: dqweight (+=)", dq, k.dqw, 2e-2);
    checks.check(v + "backward: dkweight (+=)", dk, k.dkw, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    checks.require(v + "backward bit-reproducible",
                   download(k.d_dinp) == dinp && download(k.d_dqw) == dq && download(k.d_dkw) == dk);
}

static void time_kernels(QkNormCase& k) {
    if (!have_gpu()) return;
    double bytes = 4.0 * k.width();  // 2-byte elements: read once, written once (the backward reads x too: 6)
    float forward_ms = median_ms([&](int) { k.gpu_forward(); }, 1);
    float backward_ms = median_ms([&](int) { k.gpu_backward(); }, 1);
    report_memory_bound(strfmt("qk-norm forward N=%ld NH=%d KV=%d hd=%d", k.N, k.NH, k.KV, k.hd), forward_ms, bytes);
    report_memory_bound(strfmt("qk-norm backward N=%ld NH=%d KV=%d hd=%d", k.N, k.NH, k.KV, k.hd), backward_ms,
                        1.5 * bytes);
}

int main() {
    Program program("qknorm: QK-norm forward and backward against the CPU, Qwen3's heads of 128; timed");
    Checks checks;
    for (auto [NH, KV] : {std::pair{16, 8}, {32, 8}}) {
        QkNormCase k(16L * 1024, NH, KV, 128, 3);
        check(checks, k);
        time_kernels(k);
    }
    QkNormCase odd(1001, 3, 1, 12, 4);
    check(checks, odd);
    return program.finish(checks);
}

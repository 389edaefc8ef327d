// The CPU layer ops one by one: every backward against central finite differences of its forward, the GEMM
// against a naive loop on awkward sizes, and the optimizer, norm and schedule helpers against their formulas.
// Shapes are small and odd so that no loop happens to line up with a tile, a head or a chunk.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/norm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/residual.cuh"
#include "llmc/schedule.h"
#include "test_helpers.h"

namespace test_layers {

// the shapes shared by the layer tests
constexpr int B = 2, T = 5, C = 12, NH = 3, OC = 7, V = 11, Vp = 16;
constexpr long BT = (long)B * T;

const float NaN = std::numeric_limits<float>::quiet_NaN();

// sets the OpenMP thread count for a scope and restores it after
struct ThreadCount {
    int saved;
    explicit ThreadCount(int n) : saved(omp_get_max_threads()) { omp_set_num_threads(n); }
    ~ThreadCount() { omp_set_num_threads(saved); }
};

// Σ w ⊙ y in double: the scalar objective whose gradient with respect to y is w
double weighted_sum(const std::vector<float>& w, const std::vector<float>& y) {
    REQUIRE(w.size() == y.size());
    double s = 0.0;
    for (size_t i = 0; i < w.size(); i++) s += (double)w[i] * (double)y[i];
    return s;
}

// (f(x + h e_i) - f(x - h e_i)) / (the step fp32 actually took); x[i] is restored
template <typename F>
double central_difference(std::vector<float>& x, size_t i, float h, F&& f) {
    float orig = x[i];
    float xp = orig + h, xm = orig - h;
    x[i] = xp;
    double fp = f();
    x[i] = xm;
    double fm = f();
    x[i] = orig;
    return (fp - fm) / ((double)xp - (double)xm);
}

// The worst |analytic - numeric| / max(|numeric|, floor) over every element of x, where floor is
// floor_fraction of the largest numeric derivative (so entries whose true gradient is ~0 are compared on the
// scale of the tensor's gradient, not on their own). f must read x.
template <typename F>
double gradient_error(std::vector<float>& x, const std::vector<float>& analytic, float h, F&& f,
                      double floor_fraction = 1e-2) {
    REQUIRE(x.size() == analytic.size());
    std::vector<double> numeric(x.size());
    double largest = 0.0;
    {
        // thousands of tiny forwards: one thread spares them a barrier each (the ops are deterministic anyway)
        ThreadCount one(1);
        for (size_t i = 0; i < x.size(); i++) {
            numeric[i] = central_difference(x, i, h, f);
            largest = std::max(largest, fabs(numeric[i]));
        }
    }
    REQUIRE(largest > 0.0);
    double floor = floor_fraction * largest, worst = 0.0;
    for (size_t i = 0; i < x.size(); i++) {
        double e = fabs((double)analytic[i] - numeric[i]) / std::max(fabs(numeric[i]), floor);
        if (!(e <= worst)) worst = e;  // a NaN becomes the worst error
    }
    return worst;
}

bool all_finite(const std::vector<float>& v) {
    for (float x : v)
        if (!std::isfinite(x)) return false;
    return true;
}

std::vector<float> gemm_workspace(int threads) { return std::vector<float>(gemm_workspace_floats(threads)); }

std::vector<int> random_token_ids(size_t n, int vocab, Rng& rng) {
    std::vector<int> t(n);
    for (auto& x : t) x = (int)rng.below(vocab);
    return t;
}

// ----------------------------------------------------------------------------------------------------------
// GEMM

// a dense row-major matrix and a view of it that reads it as stored or transposed
struct GemmOperand {
    std::vector<float> data;
    long rows, cols;  // of the logical operand
    bool transposed;  // stored as cols×rows
    MatView view() const {
        return transposed ? MatView{data.data(), 1, rows} : MatView{data.data(), cols, 1};
    }
};

GemmOperand random_operand(long rows, long cols, bool transposed, Rng& rng) {
    return GemmOperand{random_vector((size_t)rows * cols, rng), rows, cols, transposed};
}

// Runs gemm on C[M×N] (leading dimension ldc ≥ N, the gap filled with a sentinel) and returns the worst error
// against a double-precision triple loop, each element's error taken relative to Σ_k |a_ik b_kj| (+ |c_ij| when
// accumulating): the scale fp32 rounding of that dot product is proportional to. Also checks the sentinels.
double gemm_error(long M, long N, long K, bool a_transposed, bool b_transposed, bool accumulate, long ldc,
                  uint64_t seed) {
    Rng rng(seed);
    GemmOperand a = random_operand(M, K, a_transposed, rng), b = random_operand(K, N, b_transposed, rng);
    MatView av = a.view(), bv = b.view();
    const float sentinel = 12345.0f;
    std::vector<float> c0(M * ldc, sentinel);
    for (long i = 0; i < M; i++)
        for (long j = 0; j < N; j++) c0[i * ldc + j] = accumulate ? rng.normal(0.0f, 3.0f) : NaN;
    std::vector<float> c = c0;
    std::vector<float> ws = gemm_workspace(omp_get_max_threads());
    gemm(M, N, K, av, bv, c.data(), ldc, accumulate, ws.data());
    double worst = 0.0;
    bool sentinels_intact = true;
    for (long i = 0; i < M; i++) {
        for (long j = 0; j < N; j++) {
            double ref = accumulate ? c0[i * ldc + j] : 0.0;
            double scale = accumulate ? fabs(c0[i * ldc + j]) : 0.0;
            for (long k = 0; k < K; k++) {
                double p = (double)av.at(i, k) * (double)bv.at(k, j);
                ref += p;
                scale += fabs(p);
            }
            double e = fabs((double)c[i * ldc + j] - ref) / std::max(scale, 1e-30);
            if (!(e <= worst)) worst = e;
        }
        for (long j = N; j < ldc; j++) sentinels_intact = sentinels_intact && c[i * ldc + j] == sentinel;
    }
    CHECK(sentinels_intact);
    return worst;
}

TEST_CASE("gemm matches a naive triple loop on sizes that are not multiples of the tiles", "[layers]") {
    struct Shape {
        long M, N, K;
    };
    // one tile with a partial K block; then several M and N tiles, with K crossing a block boundary too
    const Shape shapes[] = {{37, 53, 300}, {GEMM_MC + 29, GEMM_NC + 37, GEMM_KC + 45}, {5, 3, 1}};
    // the three access patterns of the linear layers: A·Bᵀ (forward), A·B (dinp), Aᵀ·B (dweight)
    struct Pattern {
        bool a_transposed, b_transposed;
        const char* name;
    };
    const Pattern patterns[] = {{false, true, "inp * weight^T"}, {false, false, "dout * weight"},
                                {true, false, "dout^T * inp"}};
    uint64_t seed = 100;
    for (const Shape& s : shapes)
        for (const Pattern& p : patterns)
            for (bool accumulate : {false, true})
                for (long pad : {0L, 3L}) {
                    INFO("M=" << s.M << " N=" << s.N << " K=" << s.K << " " << p.name << " accumulate=" << accumulate
                              << " ldc=N+" << pad);
                    double err = gemm_error(s.M, s.N, s.K, p.a_transposed, p.b_transposed, accumulate, s.N + pad,
                                            seed++);
                    CHECK(err < 1e-5);
                }
}

TEST_CASE("gemm with K = 0 gives zeros, or leaves C alone when accumulating", "[layers]") {
    std::vector<float> ws = gemm_workspace(omp_get_max_threads());
    float a = 1.0f, b = 1.0f;
    std::vector<float> c(6, NaN);
    gemm(2, 3, 0, MatView{&a, 0, 0}, MatView{&b, 0, 0}, c.data(), 3, false, ws.data());
    for (float x : c) CHECK(x == 0.0f);
    std::vector<float> d(6, 2.5f);
    gemm(2, 3, 0, MatView{&a, 0, 0}, MatView{&b, 0, 0}, d.data(), 3, true, ws.data());
    for (float x : d) CHECK(x == 2.5f);
}

TEST_CASE("matmul results are bit-identical with 1 and 2 threads", "[layers]") {
    const long N = 2 * GEMM_MC + 5, IC = GEMM_KC + 44, O = GEMM_NC + 37;
    Rng rng(7);
    std::vector<float> inp = random_vector(N * IC, rng), weight = random_vector(O * IC, rng, 0.1f),
                       bias = random_vector(O, rng), dout = random_vector(N * O, rng);
    std::vector<float> panels = gemm_workspace(std::max(omp_get_max_threads(), 2));
    Workspace ws{panels.data(), panels.size()};
    struct Result {
        std::vector<float> out, dinp, dweight, dbias;
    };
    auto run = [&](int threads) {
        ThreadCount scope(threads);
        Result r{std::vector<float>(N * O), std::vector<float>(N * IC), std::vector<float>(O * IC, 0.0f),
                 std::vector<float>(O, 0.0f)};
        matmul_forward(r.out.data(), inp.data(), weight.data(), bias.data(), N, IC, O, ws);
        matmul_backward(r.dinp.data(), r.dweight.data(), r.dbias.data(), dout.data(), inp.data(), weight.data(), N,
                        IC, O, ws);
        return r;
    };
    int threads_before = omp_get_max_threads();
    Result one = run(1), two = run(2);
    CHECK(omp_get_max_threads() == threads_before);
    CHECK(memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(float)) == 0);
    CHECK(memcmp(one.dinp.data(), two.dinp.data(), one.dinp.size() * sizeof(float)) == 0);
    CHECK(memcmp(one.dweight.data(), two.dweight.data(), one.dweight.size() * sizeof(float)) == 0);
    CHECK(memcmp(one.dbias.data(), two.dbias.data(), one.dbias.size() * sizeof(float)) == 0);
    CHECK(all_finite(one.out));
}

// ----------------------------------------------------------------------------------------------------------
// layers: backward against finite differences of the forward

TEST_CASE("matmul backward matches finite differences, overwrites dinp and accumulates dweight and dbias",
          "[layers]") {
    Rng rng(11);
    std::vector<float> inp = random_vector(BT * C, rng), weight = random_vector(OC * C, rng, 0.5f),
                       bias = random_vector(OC, rng), w = random_vector(BT * OC, rng);
    std::vector<float> panels = gemm_workspace(omp_get_max_threads());
    Workspace ws{panels.data(), panels.size()};
    std::vector<float> out(BT * OC);
    auto f = [&]() {
        matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), BT, C, OC, ws);
        return weighted_sum(w, out);
    };

    // the forward itself, with and without bias
    f();
    std::vector<float> out_nobias(BT * OC);
    matmul_forward(out_nobias.data(), inp.data(), weight.data(), nullptr, BT, C, OC, ws);
    double fwd_err = 0.0;
    for (long n = 0; n < BT; n++)
        for (int o = 0; o < OC; o++) {
            double s = 0.0;
            for (int c = 0; c < C; c++) s += (double)inp[n * C + c] * weight[o * C + c];
            fwd_err = std::max(fwd_err, fabs(out_nobias[n * OC + o] - s));
            fwd_err = std::max(fwd_err, fabs(out[n * OC + o] - (s + bias[o])));
        }
    CHECK(fwd_err < 1e-5);

    // analytic gradients: dinp starts as NaN (it is overwritten), dweight and dbias as zero
    std::vector<float> dinp(BT * C, NaN), dweight(OC * C, 0.0f), dbias(OC, 0.0f);
    matmul_backward(dinp.data(), dweight.data(), dbias.data(), w.data(), inp.data(), weight.data(), BT, C, OC,
                    ws);
    const float h = 0.1f;  // f is linear in each input: a large step only shrinks the rounding
    double e_inp = gradient_error(inp, dinp, h, f);
    double e_weight = gradient_error(weight, dweight, h, f);
    double e_bias = gradient_error(bias, dbias, h, f);
    CHECK(e_inp < 1e-3);
    CHECK(e_weight < 1e-3);
    CHECK(e_bias < 1e-3);

    // again onto random gradient buffers: dinp is replaced, dweight and dbias are added to
    std::vector<float> dinp0 = random_vector(BT * C, rng), dweight0 = random_vector(OC * C, rng),
                       dbias0 = random_vector(OC, rng);
    std::vector<float> dinp2 = dinp0, dweight2 = dweight0, dbias2 = dbias0;
    matmul_backward(dinp2.data(), dweight2.data(), dbias2.data(), w.data(), inp.data(), weight.data(), BT, C, OC,
                    ws);
    CHECK(memcmp(dinp2.data(), dinp.data(), dinp.size() * sizeof(float)) == 0);
    CHECK(accumulation_error(dweight2, dweight0, dweight) < 1e-6);
    CHECK(accumulation_error(dbias2, dbias0, dbias) < 1e-6);

    // without a bias the other two gradients are unchanged
    std::vector<float> dinp3(BT * C, NaN), dweight3(OC * C, 0.0f);
    matmul_backward(dinp3.data(), dweight3.data(), nullptr, w.data(), inp.data(), weight.data(), BT, C, OC,
                    ws);
    CHECK(memcmp(dinp3.data(), dinp.data(), dinp.size() * sizeof(float)) == 0);
    CHECK(memcmp(dweight3.data(), dweight.data(), dweight.size() * sizeof(float)) == 0);
}

TEST_CASE("encoder backward matches finite differences and accumulates into wte and wpe", "[layers]") {
    Rng rng(12);
    std::vector<float> wte = random_vector((size_t)V * C, rng), wpe = random_vector((size_t)T * C, rng),
                       w = random_vector(BT * C, rng);
    std::vector<int> tokens = random_token_ids(BT, V, rng);
    // repeated tokens, in one sequence and across the batch, must add up in the same wte row
    tokens[1] = tokens[3] = tokens[T + 4] = 6;
    std::vector<float> out(BT * C);
    auto f = [&]() {
        encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
        return weighted_sum(w, out);
    };
    f();
    bool forward_exact = true;
    for (long n = 0; n < BT; n++)
        for (int c = 0; c < C; c++)
            forward_exact = forward_exact && out[n * C + c] == wte[tokens[n] * C + c] + wpe[(n % T) * C + c];
    CHECK(forward_exact);

    std::vector<float> dwte((size_t)V * C, 0.0f), dwpe((size_t)T * C, 0.0f);
    encoder_backward(dwte.data(), dwpe.data(), w.data(), tokens.data(), B, T, C, V, Workspace{});
    const float h = 0.1f;  // linear, as above
    double e_wte = gradient_error(wte, dwte, h, f);
    double e_wpe = gradient_error(wpe, dwpe, h, f);
    CHECK(e_wte < 1e-3);
    CHECK(e_wpe < 1e-3);
    // rows of tokens that do not occur get exactly nothing
    for (int v = 0; v < V; v++)
        if (std::find(tokens.begin(), tokens.end(), v) == tokens.end())
            for (int c = 0; c < C; c++) CHECK(dwte[v * C + c] == 0.0f);

    std::vector<float> dwte0 = random_vector(dwte.size(), rng), dwpe0 = random_vector(dwpe.size(), rng);
    std::vector<float> dwte2 = dwte0, dwpe2 = dwpe0;
    encoder_backward(dwte2.data(), dwpe2.data(), w.data(), tokens.data(), B, T, C, V, Workspace{});
    CHECK(accumulation_error(dwte2, dwte0, dwte) < 1e-6);
    CHECK(accumulation_error(dwpe2, dwpe0, dwpe) < 1e-6);
}

TEST_CASE("layernorm backward matches finite differences and accumulates into all three gradients", "[layers]") {
    Rng rng(13);
    std::vector<float> inp = random_vector(BT * C, rng, 2.0f);
    for (long n = 0; n < BT; n++)  // a different offset per row, so that the mean matters
        for (int c = 0; c < C; c++) inp[n * C + c] += 0.3f * (float)(n - 4);
    std::vector<float> weight = random_vector(C, rng, 0.5f), bias = random_vector(C, rng),
                       w = random_vector(BT * C, rng);
    for (auto& x : weight) x += 1.0f;
    std::vector<float> out(BT * C), mean(BT), rstd(BT);
    auto f = [&]() {
        norm_forward(Norm::LayerNorm, out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), BT,
                     C, 1e-5f);
        return weighted_sum(w, out);
    };

    // the forward and its saved statistics against a double computation
    f();
    double fwd_err = 0.0;
    for (long n = 0; n < BT; n++) {
        double m = 0.0, var = 0.0;
        for (int c = 0; c < C; c++) m += inp[n * C + c];
        m /= C;
        for (int c = 0; c < C; c++) var += (inp[n * C + c] - m) * (inp[n * C + c] - m);
        var /= C;
        double s = 1.0 / sqrt(var + 1e-5);
        fwd_err = std::max(fwd_err, fabs(mean[n] - m) / std::max(fabs(m), 1.0));
        fwd_err = std::max(fwd_err, fabs(rstd[n] - s) / s);
        for (int c = 0; c < C; c++) {
            double y = (inp[n * C + c] - m) * s * weight[c] + bias[c];
            fwd_err = std::max(fwd_err, fabs(out[n * C + c] - y) / std::max(fabs(y), 1.0));
        }
    }
    CHECK(fwd_err < 1e-5);

    std::vector<float> dinp(BT * C, 0.0f), dweight(C, 0.0f), dbias(C, 0.0f);
    norm_backward(Norm::LayerNorm, dinp.data(), dweight.data(), dbias.data(), w.data(), inp.data(), weight.data(),
                  mean.data(), rstd.data(), BT, C, Workspace{});
    const float h = 3e-2f;
    double e_inp = gradient_error(inp, dinp, h, f);
    double e_weight = gradient_error(weight, dweight, h, f);
    double e_bias = gradient_error(bias, dbias, h, f);
    CHECK(e_inp < 5e-3);
    CHECK(e_weight < 5e-3);
    CHECK(e_bias < 5e-3);

    f();  // restores mean and rstd for the unperturbed input
    std::vector<float> dinp0 = random_vector(dinp.size(), rng), dweight0 = random_vector(C, rng),
                       dbias0 = random_vector(C, rng);
    std::vector<float> dinp2 = dinp0, dweight2 = dweight0, dbias2 = dbias0;
    norm_backward(Norm::LayerNorm, dinp2.data(), dweight2.data(), dbias2.data(), w.data(), inp.data(), weight.data(),
                  mean.data(), rstd.data(), BT, C, Workspace{});
    CHECK(accumulation_error(dinp2, dinp0, dinp) < 1e-6);
    CHECK(accumulation_error(dweight2, dweight0, dweight) < 1e-5);
    CHECK(accumulation_error(dbias2, dbias0, dbias) < 1e-5);
}

TEST_CASE("gelu forward matches the tanh formula and its backward matches finite differences", "[layers]") {
    Rng rng(14);
    const long N = BT * 4 * C;
    std::vector<float> inp = random_vector(N, rng, 2.0f), w = random_vector(N, rng);
    inp[0] = 0.0f, inp[1] = 9.0f, inp[2] = -9.0f, inp[3] = 1.0f;
    std::vector<float> out(N);
    gelu_forward(out.data(), inp.data(), N);
    double fwd_err = 0.0;
    for (long i = 0; i < N; i++) {
        double x = inp[i];
        double y = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
        // relative, but absolute below 1: for negative x, 1 + tanh cancels and fp32 keeps only absolute accuracy
        fwd_err = std::max(fwd_err, fabs(out[i] - y) / std::max(fabs(y), 1.0));
    }
    CHECK(fwd_err < 1e-6);
    CHECK(out[0] == 0.0f);
    CHECK(out[1] == Approx(9.0f));
    CHECK(fabs(out[2]) < 1e-6f);
    CHECK(out[3] == Approx(0.8411920).epsilon(1e-6));

    auto f = [&]() {
        gelu_forward(out.data(), inp.data(), N);
        return weighted_sum(w, out);
    };
    std::vector<float> dinp(N, NaN);  // overwritten
    gelu_backward(dinp.data(), inp.data(), w.data(), N);
    double e_inp = gradient_error(inp, dinp, 1e-2f, f);
    CHECK(e_inp < 5e-3);

    // in place: the gradient may overwrite the upstream gradient it reads
    std::vector<float> inplace = w;
    gelu_backward(inplace.data(), inp.data(), inplace.data(), N);
    CHECK(memcmp(inplace.data(), dinp.data(), N * sizeof(float)) == 0);
}

TEST_CASE("attention backward matches finite differences and overwrites dqkv", "[layers]") {
    Rng rng(15);
    std::vector<float> qkv = random_vector(BT * 3 * C, rng), w = random_vector(BT * C, rng);
    std::vector<float> out(BT * C), att((size_t)B * NH * T * T, NaN);
    auto f = [&]() {
        attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, NH);
        return weighted_sum(w, out);
    };

    // the forward against a direct double computation: causal softmax(q·k / sqrt(hs)) · v per head
    f();
    const int hs = C / NH;
    double fwd_err = 0.0, att_err = 0.0;
    for (int b = 0; b < B; b++)
        for (int hd = 0; hd < NH; hd++)
            for (int t = 0; t < T; t++) {
                // element i of head hd of part (0 q, 1 k, 2 v) at position tt
                auto at = [&](int tt, int part, int i) {
                    return (double)qkv[((b * T + tt) * 3 + part) * C + hd * hs + i];
                };
                std::vector<double> p(t + 1);
                double maxv = -INFINITY, sum = 0.0;
                for (int t2 = 0; t2 <= t; t2++) {
                    double s = 0.0;
                    for (int i = 0; i < hs; i++) s += at(t, 0, i) * at(t2, 1, i);
                    p[t2] = s / sqrt((double)hs);
                    maxv = std::max(maxv, p[t2]);
                }
                for (auto& x : p) sum += (x = exp(x - maxv));
                const float* row = att.data() + (((size_t)b * NH + hd) * T + t) * T;
                for (int t2 = 0; t2 < T; t2++) {
                    double ref = t2 <= t ? p[t2] / sum : 0.0;
                    att_err = std::max(att_err, fabs(row[t2] - ref));
                }
                for (int i = 0; i < hs; i++) {
                    double o = 0.0;
                    for (int t2 = 0; t2 <= t; t2++) o += p[t2] / sum * at(t2, 2, i);
                    fwd_err = std::max(fwd_err, fabs(out[(b * T + t) * C + hd * hs + i] - o));
                }
            }
    CHECK(att_err < 1e-6);
    CHECK(fwd_err < 1e-5);

    std::vector<float> scratch((size_t)omp_get_max_threads() * T);
    std::vector<float> dqkv(qkv.size(), NaN);  // overwritten
    attention_backward(dqkv.data(), w.data(), qkv.data(), att.data(), B, T, C, NH, NH, scratch.data());
    double e_qkv = gradient_error(qkv, dqkv, 1e-2f, f);
    CHECK(e_qkv < 5e-3);
    // the first query attends only to itself, so its q gets no gradient
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++) CHECK(dqkv[(size_t)b * T * 3 * C + c] == 0.0f);

    std::vector<float> dqkv2 = random_vector(qkv.size(), rng);
    f();
    attention_backward(dqkv2.data(), w.data(), qkv.data(), att.data(), B, T, C, NH, NH, scratch.data());
    CHECK(memcmp(dqkv2.data(), dqkv.data(), dqkv.size() * sizeof(float)) == 0);
}

// Grouped-query attention (NH query heads over KV key/value heads, qkv rows (NH + 2·KV)·hs wide) against
// multi-head attention on a qkv whose key and value slots of query head h hold copies of key/value head
// h / (NH/KV). The forward (out and att) and dQ must be the same bits: the same float operations in the same order.
// dK and dV of a key/value head must equal the sum of its repeated heads' dK and dV to fp32 rounding (GQA adds
// the group's heads in one running sum, the reference per head and then in double): within 1e-5 of the largest.
// With KV = NH the two runs are one, to the bit.
TEST_CASE("grouped-query attention equals multi-head attention on explicitly repeated keys and values", "[layers]") {
    const int B = 2, T = 7, NH = 6, hs = 8, C = NH * hs;
    const long BT = (long)B * T;
    for (int KV : {2, 1, NH}) {
        INFO("NH=" << NH << " KV=" << KV);
        const int group = NH / KV;
        const long W = attention_qkv_width(C, NH, KV);
        REQUIRE(W == (NH + 2 * KV) * hs);
        Rng rng(20 + KV);
        std::vector<float> qkv = random_vector(BT * W, rng), dout = random_vector(BT * C, rng);
        // where element i of query head h's k (part 1) or v (part 2) lies among the 2·KV·hs key and value
        // channels after the C query channels of a GQA row
        auto kv_offset = [&](int part, int h, int i) { return ((part - 1) * KV + h / group) * hs + i; };
        std::vector<float> repeated(BT * 3 * C);
        for (long n = 0; n < BT; n++)
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < hs; i++) {
                    repeated[n * 3 * C + h * hs + i] = qkv[n * W + h * hs + i];
                    for (int part = 1; part < 3; part++)
                        repeated[(n * 3 + part) * C + h * hs + i] = qkv[n * W + C + kv_offset(part, h, i)];
                }

        std::vector<float> out(BT * C, NaN), att((size_t)B * NH * T * T, NaN), out_mha = out, att_mha = att;
        attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, KV);
        attention_forward(out_mha.data(), att_mha.data(), repeated.data(), B, T, C, NH, NH);
        CHECK(memcmp(out.data(), out_mha.data(), out.size() * sizeof(float)) == 0);
        CHECK(memcmp(att.data(), att_mha.data(), att.size() * sizeof(float)) == 0);

        std::vector<float> scratch((size_t)omp_get_max_threads() * T);
        std::vector<float> dqkv(qkv.size(), NaN), dqkv_mha(repeated.size(), NaN);  // overwritten
        attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, KV, scratch.data());
        attention_backward(dqkv_mha.data(), dout.data(), repeated.data(), att_mha.data(), B, T, C, NH, NH,
                           scratch.data());
        bool dq_same = true;
        double largest = 0.0, worst = 0.0;
        for (long n = 0; n < BT; n++) {
            std::vector<double> summed(2 * KV * hs, 0.0);  // row n's repeated dK and dV, summed per group
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < hs; i++) {
                    dq_same = dq_same && dqkv[n * W + h * hs + i] == dqkv_mha[n * 3 * C + h * hs + i];
                    for (int part = 1; part < 3; part++)
                        summed[kv_offset(part, h, i)] += dqkv_mha[(n * 3 + part) * C + h * hs + i];
                }
            for (int j = 0; j < 2 * KV * hs; j++) {
                largest = std::max(largest, fabs(summed[j]));
                double e = fabs(dqkv[n * W + C + j] - summed[j]);
                if (!(e <= worst)) worst = e;  // a NaN (an element left unwritten) becomes the worst error
            }
        }
        CHECK(dq_same);
        REQUIRE(largest > 0.0);
        CHECK(worst / largest < 1e-5);
        if (KV == NH) CHECK(memcmp(dqkv.data(), dqkv_mha.data(), dqkv.size() * sizeof(float)) == 0);
    }
    std::vector<float> any(1);
    REQUIRE_THROWS_WITH(attention_forward(any.data(), any.data(), any.data(), B, T, C, NH, 4),
                        Catch::Contains("NH % KV != 0"));
}

// The GQA backward against central differences (step 1e-2) of the double objective Σ w ⊙ out, on a shape small
// enough to perturb every input: within 5e-3 relative, as the multi-head test above. A key/value element's
// gradient there is the whole group's, so a head left out of the sum or counted twice shows.
TEST_CASE("grouped-query attention backward matches finite differences", "[layers]") {
    const int B = 2, T = 5, NH = 4, hs = 3, C = NH * hs;
    const long BT = (long)B * T;
    for (int KV : {2, 1}) {
        INFO("NH=" << NH << " KV=" << KV);
        Rng rng(30 + KV);
        std::vector<float> qkv = random_vector(BT * attention_qkv_width(C, NH, KV), rng);
        std::vector<float> w = random_vector(BT * C, rng);
        std::vector<float> out(BT * C), att((size_t)B * NH * T * T);
        auto f = [&]() {
            attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, KV);
            return weighted_sum(w, out);
        };
        f();
        std::vector<float> scratch((size_t)omp_get_max_threads() * T), dqkv(qkv.size(), NaN);  // overwritten
        attention_backward(dqkv.data(), w.data(), qkv.data(), att.data(), B, T, C, NH, KV, scratch.data());
        CHECK(gradient_error(qkv, dqkv, 1e-2f, f) < 5e-3);
    }
}

TEST_CASE("cross-entropy backward matches finite differences of the mean loss and ignores padded columns",
          "[layers]") {
    Rng rng(16);
    std::vector<float> logits = random_vector(BT * Vp, rng, 2.0f);
    for (long n = 0; n < BT; n++)  // padded columns hold large values that must not enter the softmax
        for (int v = V; v < Vp; v++) logits[n * Vp + v] = 50.0f + (float)v;
    std::vector<int> targets = random_token_ids(BT, V, rng);
    targets[0] = 0, targets[1] = V - 1;
    std::vector<float> losses(BT);
    auto f = [&]() {
        crossentropy_forward(losses.data(), logits.data(), targets.data(), BT, V, Vp, Workspace{});
        double s = 0.0;
        for (float l : losses) s += l;
        return s / BT;
    };

    // the forward against a double computation over the first V columns
    float mean_loss = crossentropy_forward(losses.data(), logits.data(), targets.data(), BT, V, Vp, Workspace{});
    double total = 0.0, fwd_err = 0.0;
    for (long n = 0; n < BT; n++) {
        double sum = 0.0;
        for (int v = 0; v < V; v++) sum += exp((double)logits[n * Vp + v]);
        double l = log(sum) - logits[n * Vp + targets[n]];
        fwd_err = std::max(fwd_err, fabs(losses[n] - l) / l);
        total += l;
    }
    CHECK(fwd_err < 1e-5);
    CHECK(fabs(mean_loss - total / BT) < 1e-5 * total / BT);

    // training's fused pass: the forward's losses and mean, and the gradient in place of the logits
    std::vector<float> grad = logits, fused_losses(BT);
    float fused_mean = crossentropy_fused(fused_losses.data(), grad.data(), targets.data(), BT, V, Vp, 1.0f / BT, Workspace{});
    CHECK(fused_losses == losses);
    CHECK(fused_mean == mean_loss);
    double e_logits = gradient_error(logits, grad, 5e-2f, f);
    CHECK(e_logits < 5e-3);
    bool padding_zero = true;
    double worst_row_sum = 0.0;
    for (long n = 0; n < BT; n++) {
        double s = 0.0;
        for (int v = 0; v < V; v++) s += grad[n * Vp + v];
        worst_row_sum = std::max(worst_row_sum, fabs(s));
        for (int v = V; v < Vp; v++) padding_zero = padding_zero && grad[n * Vp + v] == 0.0f;
    }
    CHECK(padding_zero);
    CHECK(worst_row_sum < 1e-6);  // softmax sums to one, the target takes one away
}

// ----------------------------------------------------------------------------------------------------------
// optimizer, gradient norm, schedule, residual

TEST_CASE("adamw matches a hand computation of the update", "[layers]") {
    struct Case {
        int t;
        float lr, weight_decay, grad_scale;
    };
    const Case cases[] = {{1, 0.05f, 0.1f, 0.5f}, {3, 0.05f, 0.1f, 0.7f}, {3, 0.02f, 0.0f, 1.0f}};
    Rng rng(17);
    const long n = 257;
    for (const Case& k : cases) {
        INFO("t=" << k.t << " lr=" << k.lr << " weight_decay=" << k.weight_decay << " grad_scale=" << k.grad_scale);
        std::vector<float> params = random_vector(n, rng), grads = random_vector(n, rng, 0.3f), m(n, 0.0f),
                           v(n, 0.0f);
        if (k.t > 1)  // moments from earlier steps
            for (long i = 0; i < n; i++) {
                m[i] = rng.normal(0.0f, 0.05f);
                v[i] = 0.01f * rng.uniform() + 1e-4f;
            }
        std::vector<float> p0 = params, m0 = m, v0 = v;
        adamw_update(params.data(), grads.data(), m.data(), v.data(), n, k.lr, k.weight_decay, k.grad_scale, k.t);
        // errors: the parameter's relative to lr (an Adam step moves a parameter by about lr, weight decay by
        // lr * weight_decay * |p|) after allowing the one unavoidable rounding of p; the first moment's relative
        // to the size of its two terms, which can cancel; the second moment's plainly relative
        double worst_p = 0.0, worst_m = 0.0, worst_v = 0.0;
        for (long i = 0; i < n; i++) {
            const double b1 = 0.9, b2 = 0.95, eps = 1e-8;
            double g = (double)grads[i] * k.grad_scale;
            double mi = b1 * m0[i] + (1 - b1) * g, vi = b2 * v0[i] + (1 - b2) * g * g;
            double mhat = mi / (1 - pow(b1, k.t)), vhat = vi / (1 - pow(b2, k.t));
            double p = p0[i] - (double)k.lr * (mhat / (sqrt(vhat) + eps) + k.weight_decay * (double)p0[i]);
            double rounding = fabs(p) * 6e-8;
            worst_p = std::max(worst_p, std::max(fabs(params[i] - p) - rounding, 0.0) / k.lr);
            worst_m = std::max(worst_m, fabs(m[i] - mi) / (b1 * fabs(m0[i]) + (1 - b1) * fabs(g)));
            worst_v = std::max(worst_v, fabs(v[i] - vi) / vi);
        }
        CHECK(worst_p < 1e-5);
        CHECK(worst_m < 1e-6);
        CHECK(worst_v < 1e-5);
    }
}

TEST_CASE("sum_of_squares matches a double loop and clip_scale clips only above the limit", "[layers]") {
    Rng rng(18);
    for (long n : {0L, 1L, 1000L, 3L * 65536 + 123}) {
        std::vector<float> x = random_vector(n, rng, 3.0f);
        double ref = 0.0;
        for (float a : x) ref += (double)a * a;
        double got = sum_of_squares(x.data(), n);
        INFO("n=" << n);
        CHECK(fabs(got - ref) <= 1e-12 * ref);
        if (n > 65536) {  // several blocks: the same bits whatever the thread count
            double one, two;
            {
                ThreadCount scope(1);
                one = sum_of_squares(x.data(), n);
            }
            {
                ThreadCount scope(2);
                two = sum_of_squares(x.data(), n);
            }
            CHECK(memcmp(&one, &two, sizeof(double)) == 0);
        }
    }
    CHECK(clip_scale(4.0, 1.0f) == 0.25f);
    CHECK(clip_scale(0.5, 1.0f) == 1.0f);
    CHECK(clip_scale(1.0, 1.0f) == 1.0f);
    CHECK(clip_scale(0.0, 1.0f) == 1.0f);
    CHECK(clip_scale(10.0, 2.5f) == Approx(0.25f));
}

TEST_CASE("learning-rate schedules: warmup, cosine, linear and constant", "[layers]") {
    LRSchedule s;
    s.lr = 1e-3f;
    s.warmup = 10;
    s.total_steps = 110;
    s.final_fraction = 0.1f;
    const float min_lr = 1e-4f, mid = 0.5f * (1e-3f + 1e-4f);
    for (const char* kind : {"cosine", "linear", "constant"}) {
        INFO(kind);
        s.kind = kind;
        CHECK(LRSchedule::known(kind));
        // warmup rises linearly to lr, the same for every kind
        CHECK(s.at(0) == Approx(1e-4f));
        CHECK(s.at(4) == Approx(5e-4f));
        CHECK(s.at(9) == Approx(1e-3f));
        CHECK(s.at(10) == Approx(1e-3f));
    }
    s.kind = "cosine";
    CHECK(s.at(60) == Approx(mid));
    CHECK(s.at(35) == Approx(min_lr + 0.5f * (1.0f + cosf((float)M_PI * 0.25f)) * (1e-3f - min_lr)));
    CHECK(s.at(110) == Approx(min_lr));
    CHECK(s.at(500) == Approx(min_lr));
    for (int step = 11; step <= 110; step++) CHECK(s.at(step) <= s.at(step - 1));
    s.kind = "linear";
    CHECK(s.at(60) == Approx(mid));
    CHECK(s.at(35) == Approx(1e-3f - 0.25f * (1e-3f - min_lr)));
    CHECK(s.at(110) == Approx(min_lr));
    s.kind = "constant";
    CHECK(s.at(60) == 1e-3f);
    CHECK(s.at(110) == 1e-3f);
    CHECK_FALSE(LRSchedule::known("exponential"));

    // no warmup: the first step is at full lr
    LRSchedule plain;
    plain.lr = 2e-3f;
    plain.total_steps = 50;
    plain.final_fraction = 0.0f;
    CHECK(plain.at(0) == Approx(2e-3f));
    CHECK(plain.at(50) == Approx(0.0f).margin(1e-9));
}

TEST_CASE("residual_forward adds its inputs", "[layers]") {
    Rng rng(19);
    const long N = BT * C + 3;
    std::vector<float> a = random_vector(N, rng), b = random_vector(N, rng), out(N, NaN);
    residual_forward(out.data(), a.data(), b.data(), N);
    bool exact = true;
    for (long i = 0; i < N; i++) exact = exact && out[i] == a[i] + b[i];
    CHECK(exact);
    // in place onto the residual stream
    std::vector<float> r = a;
    residual_forward(r.data(), r.data(), b.data(), N);
    CHECK(memcmp(r.data(), out.data(), N * sizeof(float)) == 0);
}

}  // namespace test_layers

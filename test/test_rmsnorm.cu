// RMSNorm (llmc/norm.cuh), Llama 3's norm. On the CPU: the forward against a double computation, the backward
// against central finite differences of a double forward, on small odd shapes whose rows have different scales
// (so rstd is not ~1 and its own gradient term shows); the backward accumulating; the fused residual variant
// being the add and then the norm; eps taken from the argument. On the GPU ([cuda], skipped without one): the
// kernels against the CPU on bf16 inputs (NormCase, dev/cuda/norm_case.h), one shape per row layout, and
// the host-side precondition checks, which run anywhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dev/cuda/norm_case.h"
#include "llmc/norm.cuh"
#include "test/test_helpers.h"

namespace test_rmsnorm {

// x drawn from N(0, 1) with row n scaled by 0.3 + 0.4·n, so the rows' rstd differ from each other and from 1;
// weight around 1 with a spread, dout from N(0, 1)
struct Inputs {
    std::vector<float> x, weight, dout;
};

Inputs random_inputs(long N, int C, Rng& rng, float scale = 1.0f) {
    Inputs in{random_vector(N * C, rng, scale), random_vector(C, rng, 0.5f), random_vector(N * C, rng)};
    for (long n = 0; n < N; n++)
        for (int c = 0; c < C; c++) in.x[n * C + c] *= 0.3f + 0.4f * (float)n;
    for (auto& w : in.weight) w += 1.0f;
    return in;
}

// rmsnorm in double: out = x / sqrt(mean(x²) + eps) · weight, and each row's rstd
void rmsnorm_double(std::vector<double>& out, std::vector<double>& rstd, const std::vector<double>& x,
                    const std::vector<double>& weight, long N, int C, double eps) {
    for (long n = 0; n < N; n++) {
        double sum_sq = 0.0;
        for (int c = 0; c < C; c++) sum_sq += x[n * C + c] * x[n * C + c];
        rstd[n] = 1.0 / sqrt(sum_sq / C + eps);
        for (int c = 0; c < C; c++) out[n * C + c] = x[n * C + c] * rstd[n] * weight[c];
    }
}

std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// the largest |a - b| / max(|b|, floor · the largest |b|) over the arrays
double relative_error(const std::vector<float>& a, const std::vector<double>& b, double floor = 1e-2) {
    REQUIRE(a.size() == b.size());
    double largest = 0.0, worst = 0.0;
    for (double v : b) largest = std::max(largest, fabs(v));
    for (size_t i = 0; i < a.size(); i++) {
        double e = fabs((double)a[i] - b[i]) / std::max(fabs(b[i]), floor * largest);
        if (!(e <= worst)) worst = e;  // a NaN becomes the worst error
    }
    return worst;
}

// The fp32 forward against rmsnorm_double, then the fp32 backward (into zeros, from the forward's rstd) against
// central differences, in double, of Σ dout ⊙ rmsnorm_double(x, weight) with respect to every x and weight.
// Returns the worst relative errors: forward out, rstd, dinp, dweight.
struct Errors {
    double out, rstd, dinp, dweight;
};

Errors check_against_double(long N, int C, float eps, float scale, uint64_t seed) {
    Rng rng(seed);
    Inputs in = random_inputs(N, C, rng, scale);
    std::vector<float> out(N * C), rstd(N);
    norm_forward(Norm::RMSNorm, out.data(), nullptr, rstd.data(), in.x.data(), in.weight.data(), nullptr, N, C, eps);
    std::vector<double> x = to_double(in.x), weight = to_double(in.weight), dout = to_double(in.dout);
    std::vector<double> out_ref(N * C), rstd_ref(N);
    rmsnorm_double(out_ref, rstd_ref, x, weight, N, C, eps);

    std::vector<float> dinp(N * C, 0.0f), dweight(C, 0.0f);
    norm_backward(Norm::RMSNorm, dinp.data(), dweight.data(), nullptr, in.dout.data(), in.x.data(), in.weight.data(),
                  nullptr, rstd.data(), N, C, Workspace{});

    std::vector<double> scratch_out(N * C), scratch_rstd(N);
    auto objective = [&] {
        rmsnorm_double(scratch_out, scratch_rstd, x, weight, N, C, eps);
        double s = 0.0;
        for (long i = 0; i < N * C; i++) s += dout[i] * scratch_out[i];
        return s;
    };
    auto numeric_gradient = [&](std::vector<double>& v) {
        const double h = 1e-5;  // truncation ~h², cancellation ~1e-16 / h: both far below fp32's 1e-7
        std::vector<double> grad(v.size());
        for (size_t i = 0; i < v.size(); i++) {
            double orig = v[i];
            v[i] = orig + h;
            double fp = objective();
            v[i] = orig - h;
            double fm = objective();
            v[i] = orig;
            grad[i] = (fp - fm) / (2 * h);
        }
        return grad;
    };
    return Errors{relative_error(out, out_ref), relative_error(rstd, rstd_ref),
                  relative_error(dinp, numeric_gradient(x)), relative_error(dweight, numeric_gradient(weight))};
}

// fp32 against double: the forward rounds a handful of times per element (1e-6 leaves room for C = 37 terms of
// Σx²); the backward's error is fp32's, the finite differences' ~1e-10, so 1e-4 is loose for a right formula and
// far too tight for a wrong one (a missing s² term is off by tens of percent at these row scales)
TEST_CASE("rmsnorm forward matches a double computation and its backward matches finite differences in double",
          "[layers][rmsnorm]") {
    SECTION("N = 7, C = 37, Llama 3's eps") {
        Errors e = check_against_double(7, 37, 1e-5f, 1.0f, 21);
        CHECK(e.out < 1e-6);
        CHECK(e.rstd < 1e-6);
        CHECK(e.dinp < 1e-4);
        CHECK(e.dweight < 1e-4);
    }
    SECTION("N = 5, C = 19, eps as large as mean(x²), so its place in rstd's gradient matters") {
        Errors e = check_against_double(5, 19, 0.3f, 0.5f, 22);
        CHECK(e.out < 1e-6);
        CHECK(e.rstd < 1e-6);
        CHECK(e.dinp < 1e-4);
        CHECK(e.dweight < 1e-4);
    }
}

TEST_CASE("rmsnorm backward accumulates into dinp and dweight", "[layers][rmsnorm]") {
    const long N = 7;
    const int C = 37;
    Rng rng(23);
    Inputs in = random_inputs(N, C, rng);
    std::vector<float> out(N * C), rstd(N);
    norm_forward(Norm::RMSNorm, out.data(), nullptr, rstd.data(), in.x.data(), in.weight.data(), nullptr, N, C, 1e-5f);
    std::vector<float> dinp(N * C, 0.0f), dweight(C, 0.0f);
    norm_backward(Norm::RMSNorm, dinp.data(), dweight.data(), nullptr, in.dout.data(), in.x.data(), in.weight.data(),
                  nullptr, rstd.data(), N, C, Workspace{});
    std::vector<float> dinp0 = random_vector(N * C, rng), dweight0 = random_vector(C, rng);
    std::vector<float> dinp2 = dinp0, dweight2 = dweight0;
    norm_backward(Norm::RMSNorm, dinp2.data(), dweight2.data(), nullptr, in.dout.data(), in.x.data(), in.weight.data(),
                  nullptr, rstd.data(), N, C, Workspace{});
    CHECK(accumulation_error(dinp2, dinp0, dinp) < 1e-6);      // one add per element
    CHECK(accumulation_error(dweight2, dweight0, dweight) < 1e-5);  // N adds, in another order than into zero
}

TEST_CASE("fused residual + rmsnorm is the add and then the norm, also with the residual updated in place",
          "[layers][rmsnorm]") {
    const long N = 7;
    const int C = 37;
    const float eps = 1e-5f;
    Rng rng(24);
    Inputs in = random_inputs(N, C, rng);
    std::vector<float> inp2 = random_vector(N * C, rng);
    std::vector<float> residual_ref(N * C), out_ref(N * C), rstd_ref(N);
    for (long i = 0; i < N * C; i++) residual_ref[i] = in.x[i] + inp2[i];
    norm_forward(Norm::RMSNorm, out_ref.data(), nullptr, rstd_ref.data(), residual_ref.data(), in.weight.data(),
                 nullptr, N, C, eps);

    std::vector<float> residual(N * C), out(N * C), rstd(N);
    fused_residual_norm_forward(Norm::RMSNorm, residual.data(), out.data(), nullptr, rstd.data(), in.x.data(),
                                inp2.data(), in.weight.data(), nullptr, N, C, eps);
    CHECK(residual == residual_ref);
    CHECK(out == out_ref);
    CHECK(rstd == rstd_ref);

    std::vector<float> stream = in.x, out2(N * C), rstd2(N);  // residual aliasing inp1
    fused_residual_norm_forward(Norm::RMSNorm, stream.data(), out2.data(), nullptr, rstd2.data(), stream.data(),
                                inp2.data(), in.weight.data(), nullptr, N, C, eps);
    CHECK(stream == residual_ref);
    CHECK(out2 == out_ref);
    CHECK(rstd2 == rstd_ref);
}

// inputs of RMS ~0.05, so mean(x²) ~ 2.5e-3 and each eps moves rstd far more than rounding: an eps other than
// the argument's, hard-coded or defaulted, misses the double reference by percents
TEST_CASE("rmsnorm uses the eps it is given", "[layers][rmsnorm]") {
    const long N = 5;
    const int C = 24;
    Rng rng(25);
    Inputs in = random_inputs(N, C, rng, 0.05f);
    std::vector<double> x = to_double(in.x), weight = to_double(in.weight);
    std::vector<float> first_rstd;
    for (float eps : {1e-6f, 1e-5f, 1e-3f, 0.1f}) {
        INFO("eps " << eps);
        std::vector<float> out(N * C), rstd(N), residual(N * C), fused_out(N * C), fused_rstd(N);
        std::vector<double> out_ref(N * C), rstd_ref(N);
        norm_forward(Norm::RMSNorm, out.data(), nullptr, rstd.data(), in.x.data(), in.weight.data(), nullptr, N, C,
                     eps);
        rmsnorm_double(out_ref, rstd_ref, x, weight, N, C, eps);
        CHECK(relative_error(rstd, rstd_ref) < 1e-6);
        CHECK(relative_error(out, out_ref) < 1e-6);
        std::vector<float> zeros(N * C, 0.0f);  // the fused path must pass eps on too
        fused_residual_norm_forward(Norm::RMSNorm, residual.data(), fused_out.data(), nullptr, fused_rstd.data(),
                                    in.x.data(), zeros.data(), in.weight.data(), nullptr, N, C, eps);
        CHECK(relative_error(fused_rstd, rstd_ref) < 1e-6);
        if (first_rstd.empty()) first_rstd = rstd;
        else CHECK(rstd != first_rstd);
    }
}

// The preconditions are checked on the host before anything reaches the device, so this runs without a GPU; the
// pointers are never dereferenced.
TEST_CASE("CUDA rmsnorm entry points refuse shapes and pointers their 16-byte accesses cannot serve",
          "[cuda][rmsnorm]") {
    bf16* aligned = reinterpret_cast<bf16*>(uintptr_t{0x1000});
    bf16* misaligned = reinterpret_cast<bf16*>(uintptr_t{0x1002});
    float* stats = reinterpret_cast<float*>(uintptr_t{0x2000});
    REQUIRE_THROWS_WITH(norm_forward_cuda(Norm::RMSNorm, aligned, nullptr, stats, aligned, aligned, nullptr, 4, 100,
                                          1e-5f, 0),
                        Catch::Contains("C = 100"));
    REQUIRE_THROWS_WITH(norm_forward_cuda(Norm::RMSNorm, aligned, nullptr, stats, aligned, aligned, nullptr, 4, 16392,
                                          1e-5f, 0),
                        Catch::Contains("at most 16384"));
    REQUIRE_THROWS_WITH(norm_forward_cuda(Norm::RMSNorm, aligned, nullptr, stats, aligned, misaligned, nullptr, 4, 64,
                                          1e-5f, 0),
                        Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(fused_residual_norm_forward_cuda(Norm::RMSNorm, aligned, aligned, nullptr, stats, misaligned,
                                                         aligned, aligned, nullptr, 4, 64, 1e-5f, 0),
                        Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(fused_residual_norm_forward_cuda(Norm::RMSNorm, aligned, aligned, nullptr, stats, aligned,
                                                         nullptr, aligned, nullptr, 4, 64, 1e-5f, 0),
                        Catch::Contains("residual and inp2 are required"));
    REQUIRE_THROWS_WITH(norm_backward_cuda(Norm::RMSNorm, aligned, aligned, nullptr, aligned, aligned, aligned, nullptr,
                                           stats, 4, 36, stats, 0),
                        Catch::Contains("C = 36"));
    REQUIRE_THROWS_WITH(norm_backward_cuda(Norm::RMSNorm, misaligned, aligned, nullptr, aligned, aligned, aligned,
                                           nullptr, stats, 4, 64, stats, 0),
                        Catch::Contains("not 16-byte aligned"));
}

void require_close(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    Comparison c = compare_rms(gpu, cpu, tol);
    INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    REQUIRE(c.pass());
}

// bf16 tolerances, as the layernorm's: the residual rounds once, out twice, rstd is fp32 from the same inputs
void check_rmsnorm(long N, int C, float eps) {
    INFO("N " << N << ", C " << C << ", eps " << eps);
    NormCase k(Norm::RMSNorm, N, C, eps, 26);
    k.gpu_fused_forward();
    require_close("residual", download(k.d_res), k.res, 1e-2);
    require_close("rmsnorm out", download(k.d_out), k.out, 2e-2);
    require_close("rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.d_rstd.poison();
    k.gpu_fused_forward_in_place();
    require_close("residual updated in place", download(k.d_res), k.res, 1e-2);
    require_close("rmsnorm out, residual in place", download(k.d_out), k.out, 2e-2);
    require_close("rstd, residual in place", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.d_rstd.poison();
    k.gpu_forward();
    require_close("plain rmsnorm out", download(k.d_out), k.out, 2e-2);
    require_close("plain rmsnorm rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.use_cpu_stats();
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dinp), dw = download(k.d_dw);
    require_close("rmsnorm dinp", dinp, k.dinp, 2e-2);
    require_close("rmsnorm dweight", dw, k.dweight, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    REQUIRE(download(k.d_dinp) == dinp);  // bit-reproducible
    REQUIRE(download(k.d_dw) == dw);
}

TEST_CASE("CUDA fused residual + rmsnorm and rmsnorm backward match the CPU", "[cuda][rmsnorm]") {
    SKIP_WITHOUT_GPU_CASE();
    check_rmsnorm(64, 64, 1e-5f);       // 4 vectors a thread, most of them past the row
    check_rmsnorm(130, 200, 0.5f);      // a row of 25 vectors; an eps that moves rstd by tens of percent
    check_rmsnorm(37, 1000, 1e-5f);     // 4 vectors a thread, the last three lanes' fourth past the row
    check_rmsnorm(37, 1600, 1e-5f);     // 8 vectors a thread, one warp a row
    check_rmsnorm(9, 4096, 1e-5f);      // two warps a row, full; the last forward block has three spare groups
    check_rmsnorm(11, 6152, 1e-5f);     // four warps a row, the last vectors past the row; a spare forward group
    check_rmsnorm(5, 12296, 0.5f);      // eight warps a row, ragged
    check_rmsnorm(3, 16384, 1e-5f);     // the widest row
    check_rmsnorm(2000, 2040, 1e-5f);   // many backward blocks; one warp a row, the last lane's 8th vector past it
    check_rmsnorm(20001, 64, 1e-5f);    // 32 rows per backward block, the last block ragged
}

}  // namespace test_rmsnorm

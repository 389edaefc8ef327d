// SwiGLU (llmc/swiglu.cuh): the CPU forward against silu(gate)·up evaluated in double, the CPU backward against
// central finite differences of the CPU forward, on an odd shape (N = 5, H = 13) with gates of ±20 where the
// sigmoid saturates, and the CUDA kernels against the CPU on random bf16 inputs with poisoned outputs. The
// preconditions (H a multiple of 8, aligned pointers, no output overlapping an input) are checked on the host,
// so their test runs without a GPU.
#include <cmath>
#include <limits>
#include <vector>

#include "dev/cuda/common.h"
#include "llmc/swiglu.cuh"
#include "test/test_helpers.h"

namespace test_swiglu {

constexpr long N = 5;
constexpr int H = 13;

// row n's up and gate values (inp is N × 2H, [up | gate] per row)
size_t up_index(long n, int j, int h = H) { return (size_t)(n * 2 * h + j); }
size_t gate_index(long n, int j, int h = H) { return (size_t)(n * 2 * h + h + j); }

// gates of ±20, where the sigmoid saturates (silu(20) = 20, silu(-20) = -4e-8), one of them beside an up of 20
struct Saturated {
    long n;
    int j;
    float gate;
};
const Saturated SATURATED[] = {{0, 0, 20.0f},  {1, 1, -20.0f}, {2, 2, 20.0f},
                               {3, 3, -20.0f}, {4, 4, 20.0f},  {0, 12, -20.0f}};

// N(0, 2²) values, the saturated gates, and ups of ±20 on a diagonal (row n, column 12 - n)
std::vector<float> random_inputs(Rng& rng) {
    std::vector<float> inp = random_vector(2 * N * H, rng, 2.0f);
    for (const Saturated& s : SATURATED) inp[gate_index(s.n, s.j)] = s.gate;
    for (long n = 0; n < N; n++) inp[up_index(n, 12 - (int)n)] = n % 2 ? -20.0f : 20.0f;
    return inp;
}

// d/dx_i Σ_k w_k y_k by central differences of the CPU forward, with the step fp32 actually took; the outputs are
// differenced before they are summed (in double), so the outputs x_i does not reach contribute exactly zero and
// the tiny derivatives at a gate of -20 keep their relative accuracy
std::vector<double> numeric_gradient(std::vector<float>& inp, const std::vector<float>& w, float h) {
    std::vector<double> numeric(inp.size());
    std::vector<float> yp(N * H), ym(N * H);
    for (size_t i = 0; i < inp.size(); i++) {
        float orig = inp[i], xp = orig + h, xm = orig - h;
        inp[i] = xp;
        swiglu_forward(yp.data(), inp.data(), N, H);
        inp[i] = xm;
        swiglu_forward(ym.data(), inp.data(), N, H);
        inp[i] = orig;
        double diff = 0.0;
        for (long k = 0; k < N * H; k++) diff += (double)w[k] * ((double)yp[k] - (double)ym[k]);
        numeric[i] = diff / ((double)xp - (double)xm);
    }
    return numeric;
}

TEST_CASE("swiglu forward matches silu(gate) * up in double and its backward matches finite differences",
          "[layers]") {
    Rng rng(21);
    std::vector<float> inp = random_inputs(rng), w = random_vector(N * H, rng);
    std::vector<float> out(N * H, std::numeric_limits<float>::quiet_NaN());
    swiglu_forward(out.data(), inp.data(), N, H);

    // every output relative to its own magnitude: the forward multiplies and divides, never cancels, so fp32
    // keeps a few ulps even where silu(-20) is 4e-8
    double fwd_err = 0.0;
    for (long n = 0; n < N; n++)
        for (int j = 0; j < H; j++) {
            double up = inp[up_index(n, j)], gate = inp[gate_index(n, j)];
            double y = gate / (1.0 + exp(-gate)) * up;
            double e = fabs(out[n * H + j] - y) / fabs(y);
            if (!(e <= fwd_err)) fwd_err = e;  // a NaN becomes the worst error
        }
    CHECK(fwd_err < 1e-6);
    CHECK(out[0] == Approx(20.0f * inp[up_index(0, 0)]).epsilon(1e-6));                     // silu(20) = 20
    CHECK(out[H + 1] == Approx(-20.0 * 2.0611536e-9 * inp[up_index(1, 1)]).epsilon(1e-5));  // silu(-20)

    std::vector<float> dinp(2 * N * H, std::numeric_limits<float>::quiet_NaN());  // overwritten
    swiglu_backward(dinp.data(), inp.data(), w.data(), N, H);
    std::vector<double> numeric = numeric_gradient(inp, w, 1e-2f);

    // every element, relative to max(|numeric|, 1% of the largest), as the other layers' tests do
    double largest = 0.0, worst = 0.0;
    for (double g : numeric) largest = std::max(largest, fabs(g));
    REQUIRE(largest > 0.0);
    for (size_t i = 0; i < dinp.size(); i++) {
        double e = fabs(dinp[i] - numeric[i]) / std::max(fabs(numeric[i]), 1e-2 * largest);
        if (!(e <= worst)) worst = e;
    }
    CHECK(worst < 5e-3);

    // the saturated gates against their own magnitude (down to 4e-8), which the floor above would not look at
    for (const Saturated& s : SATURATED)
        for (size_t i : {up_index(s.n, s.j), gate_index(s.n, s.j)}) {
            INFO("row " << s.n << ", column " << s.j << ", gate " << inp[gate_index(s.n, s.j)] << ", index " << i
                        << ": analytic " << dinp[i] << ", numeric " << numeric[i]);
            CHECK(fabs(dinp[i] - numeric[i]) < 1e-3 * fabs(numeric[i]));
        }
}

TEST_CASE("swiglu refuses an output that overlaps an input", "[layers]") {
    std::vector<float> inp(2 * N * H, 1.0f), dout(N * H, 1.0f), out(N * H);
    REQUIRE_THROWS_WITH(swiglu_forward(inp.data() + N * H, inp.data(), N, H), Catch::Contains("overlaps"));
    REQUIRE_THROWS_WITH(swiglu_backward(inp.data(), inp.data(), dout.data(), N, H), Catch::Contains("overlaps"));
    std::vector<float> big(3 * N * H);  // dout starting on dinp's last element
    REQUIRE_THROWS_WITH(swiglu_backward(big.data(), inp.data(), big.data() + 2 * N * H - 1, N, H),
                        Catch::Contains("overlaps"));
    swiglu_forward(out.data(), inp.data(), N, H);  // adjacent but disjoint is fine
    swiglu_backward(big.data(), inp.data(), big.data() + 2 * N * H, N, H);
}

void require_close(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    Comparison c = compare_rms(gpu, cpu, tol);
    INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    REQUIRE(c.pass());
}

// the _cuda functions on the default stream, then the model's entry points on main_stream() for the same bits
void check_swiglu_cuda(long n, int h) {
    INFO("N = " << n << ", H = " << h);
    Rng rng(22);
    std::vector<float> inp = random_bf16_values(2 * n * h, rng, 2.0f), dout = random_bf16_values(n * h, rng);
    inp[gate_index(0, 0, h)] = 20.0f, inp[gate_index(n - 1, h - 1, h)] = -20.0f;
    std::vector<float> out(n * h), dinp(2 * n * h);
    swiglu_forward(out.data(), inp.data(), n, h);
    swiglu_backward(dinp.data(), inp.data(), dout.data(), n, h);

    DeviceArray<bf16> d_inp(2 * n * h), d_dout(n * h), d_out(n * h), d_dinp(2 * n * h);  // poisoned
    upload(d_inp, inp);
    upload(d_dout, dout);
    swiglu_forward_cuda(d_out.ptr, d_inp.ptr, n, h, 0);
    std::vector<float> gpu_out = download(d_out);
    require_close("swiglu out", gpu_out, out, 1e-2);
    swiglu_backward_cuda(d_dinp.ptr, d_inp.ptr, d_dout.ptr, n, h, 0);
    std::vector<float> gpu_dinp = download(d_dinp);
    require_close("swiglu dinp", gpu_dinp, dinp, 1e-2);

    d_out.poison();
    d_dinp.poison();
    cuda_check(cudaDeviceSynchronize());  // main_stream() does not wait for the legacy stream's memsets
    swiglu_forward(d_out.ptr, d_inp.ptr, n, h);
    swiglu_backward(d_dinp.ptr, d_inp.ptr, d_dout.ptr, n, h);
    cuda_check(cudaStreamSynchronize(main_stream()));  // a non-blocking stream: download() would not wait for it
    REQUIRE(download(d_out) == gpu_out);
    REQUIRE(download(d_dinp) == gpu_dinp);
}

TEST_CASE("CUDA SwiGLU forward and backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_swiglu_cuda(1, 8);       // one thread
    check_swiglu_cuda(7, 136);     // 17 groups of 8 per row: rows end mid-block
    check_swiglu_cuda(300, 1024);  // several blocks
    check_swiglu_cuda(3, 14336);   // Llama 3 8B's H
}

// the pointers are never dereferenced: every refusal happens on the host, so this runs without a GPU
TEST_CASE("CUDA SwiGLU refuses H not a multiple of 8, misaligned pointers and overlapping outputs", "[cuda]") {
    bf16* a = reinterpret_cast<bf16*>(uintptr_t{0x10000});
    bf16* b = reinterpret_cast<bf16*>(uintptr_t{0x20000});
    bf16* c = reinterpret_cast<bf16*>(uintptr_t{0x30000});
    bf16* misaligned = reinterpret_cast<bf16*>(uintptr_t{0x40002});
    REQUIRE_THROWS_WITH(swiglu_forward_cuda(a, b, 4, 12, 0), Catch::Contains("H = 12"));
    REQUIRE_THROWS_WITH(swiglu_backward_cuda(a, b, c, 4, 13, 0), Catch::Contains("H = 13"));
    REQUIRE_THROWS_WITH(swiglu_forward_cuda(a, b, 4, 0, 0), Catch::Contains("H = 0"));
    REQUIRE_THROWS_WITH(swiglu_forward_cuda(misaligned, b, 4, 16, 0), Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(swiglu_backward_cuda(a, misaligned, c, 4, 16, 0), Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(swiglu_backward_cuda(a, b, misaligned, 4, 16, 0), Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(swiglu_forward_cuda(a, a + 56, 4, 16, 0), Catch::Contains("overlaps"));
    REQUIRE_THROWS_WITH(swiglu_backward_cuda(a, a, c, 4, 16, 0), Catch::Contains("overlaps"));
    REQUIRE_THROWS_WITH(swiglu_backward_cuda(a, b, a + 120, 4, 16, 0), Catch::Contains("overlaps"));
}

}  // namespace test_swiglu

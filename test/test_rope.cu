// Rotary position embeddings (llmc/rope.cuh): the backward against finite differences of the forward (it is the
// forward's adjoint), explicit positions against the table's rows at those positions, the rotation against a
// double computation of Llama 3's formula (norms kept, angles pos·freq, values untouched), the frequencies with
// and without Llama 3.1's scaling against the formula in double, and the CUDA kernels against the CPU. Shapes
// are small and odd (6 query heads sharing 2 key/value heads, hd = 8 or 24) so that no loop lines up with a
// head or a vector.
#include <cmath>
#include <cstring>
#include <vector>

#include "dev/cuda/rope_case.h"
#include "llmc/rope.cuh"
#include "test/test_helpers.h"

namespace test_rope {

// Llama 3's frequency i of hd, in double, written from the formula (not from llmc/rope.cuh): 1 / theta^(2i/hd),
// and with Llama 3's scaling by a factor s (Llama 3.1: 8, Llama 3.2: 32; low_freq_factor 1, high_freq_factor
// 4, original context 8192) a wavelength 2π/freq below 8192/4 keeps it, above 8192/1 divides it by s, and
// between blends the two; s = 0: no scaling
double formula_freq(int i, int hd, double theta, double s) {
    double freq = 1.0 / pow(theta, 2.0 * i / hd);
    if (s == 0) return freq;
    double wavelen = 2.0 * M_PI / freq;
    if (wavelen < 8192.0 / 4.0) return freq;
    if (wavelen > 8192.0 / 1.0) return freq / s;
    double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
    return (1.0 - smooth) * freq / s + smooth * freq;
}

// the shape of the layer tests: B=2 sequences of T=5 tokens, 6 query heads over 2 key/value heads of hd=8
constexpr int B = 2, T = 5, NH = 6, KV = 2, hd = 8;
constexpr long ROW = (NH + 2 * KV) * hd, N_VALUES = B * T * ROW;
const std::vector<int> POSITIONS = {3, 17, 4, 1000, 9};  // out of order and far apart, as under context parallelism

// theta 500000 with scaling puts hd=8's four frequencies in all three regimes: kept (i = 0, 1), blended (i = 2,
// wavelength 4443), divided by 8 (i = 3, wavelength 118000)
std::vector<float> make_table(int maxT, int head_size, float theta = 500000.0f, float scaling = 8.0f) {
    std::vector<float> table((size_t)maxT * head_size);
    rope_table(table.data(), maxT, head_size, theta, scaling);
    return table;
}

// Σ w ⊙ y in double: the linear functional whose gradient with respect to y is w
double weighted_sum(const std::vector<float>& w, const std::vector<float>& y) {
    double s = 0.0;
    for (size_t i = 0; i < w.size(); i++) s += (double)w[i] * (double)y[i];
    return s;
}

// the worst |analytic - (f(x + h e_i) - f(x - h e_i)) / (the step fp32 took)| over every element of x, relative to
// the largest numeric derivative; x is restored. The forward is linear, so the difference quotient has no
// truncation error: what remains is fp32's rounding of the two outputs that element i moves.
template <typename F>
double gradient_error(std::vector<float>& x, const std::vector<float>& analytic, float h, F&& f) {
    std::vector<double> numeric(x.size());
    double largest = 0.0, worst = 0.0;
    for (size_t i = 0; i < x.size(); i++) {
        float orig = x[i], xp = orig + h, xm = orig - h;
        x[i] = xp;
        double fp = f();
        x[i] = xm;
        double fm = f();
        x[i] = orig;
        numeric[i] = (fp - fm) / ((double)xp - (double)xm);
        largest = std::max(largest, fabs(numeric[i]));
    }
    for (size_t i = 0; i < x.size(); i++) {
        double e = fabs((double)analytic[i] - numeric[i]) / largest;
        if (!(e <= worst)) worst = e;  // a NaN becomes the worst error
    }
    return worst;
}

// the values (the last 2·KV heads of each row) of a and b, bit for bit
bool same_values(const std::vector<float>& a, const std::vector<float>& b, long rows, long row, long first_value) {
    for (long r = 0; r < rows; r++)
        if (memcmp(&a[r * row + first_value], &b[r * row + first_value], (row - first_value) * sizeof(float)) != 0)
            return false;
    return true;
}

TEST_CASE("rope backward is the adjoint of the forward: finite differences of a random linear functional",
          "[layers][rope]") {
    std::vector<float> table = make_table(1001, hd);
    for (const int* positions : {(const int*)nullptr, POSITIONS.data()}) {
        INFO((positions ? "positions {3, 17, 4, 1000, 9}" : "positions 0..T-1"));
        Rng rng(31);
        std::vector<float> x = random_vector(N_VALUES, rng), w = random_vector(N_VALUES, rng);
        auto f = [&]() {
            std::vector<float> y = x;
            rope_forward(y.data(), table.data(), positions, B, T, NH, KV, hd);
            return weighted_sum(w, y);
        };
        std::vector<float> grad = w;  // the functional's gradient with respect to the output, turned back in place
        rope_backward(grad.data(), table.data(), positions, B, T, NH, KV, hd);
        // fp32 rounds each output to 2^-24 of its size; over a step of 2·0.25 that is ~1e-7 of a unit gradient
        CHECK(gradient_error(x, grad, 0.25f, f) < 1e-5);
    }
}

TEST_CASE("rope at explicit positions equals the table's rows at those positions", "[layers][rope]") {
    std::vector<float> table = make_table(1001, hd);
    std::vector<float> gathered((size_t)T * hd);  // row t: the table's row at POSITIONS[t]
    for (int t = 0; t < T; t++)
        memcpy(&gathered[(size_t)t * hd], &table[(size_t)POSITIONS[t] * hd], hd * sizeof(float));
    Rng rng(32);
    std::vector<float> x = random_vector(N_VALUES, rng);
    std::vector<float> at_positions = x, at_rows = x;
    rope_forward(at_positions.data(), table.data(), POSITIONS.data(), B, T, NH, KV, hd);
    rope_forward(at_rows.data(), gathered.data(), nullptr, B, T, NH, KV, hd);
    CHECK(memcmp(at_positions.data(), at_rows.data(), N_VALUES * sizeof(float)) == 0);
    CHECK(at_positions != x);
    rope_backward(at_positions.data(), table.data(), POSITIONS.data(), B, T, NH, KV, hd);
    rope_backward(at_rows.data(), gathered.data(), nullptr, B, T, NH, KV, hd);
    CHECK(memcmp(at_positions.data(), at_rows.data(), N_VALUES * sizeof(float)) == 0);

    // null is 0..T-1
    const std::vector<int> first = {0, 1, 2, 3, 4};
    std::vector<float> implicit = x, explicit_ = x;
    rope_forward(implicit.data(), table.data(), nullptr, B, T, NH, KV, hd);
    rope_forward(explicit_.data(), table.data(), first.data(), B, T, NH, KV, hd);
    CHECK(memcmp(implicit.data(), explicit_.data(), N_VALUES * sizeof(float)) == 0);
}

TEST_CASE("rope turns q and k pairs by pos·freq (double, 1e-5), keeps their norms and leaves the values untouched",
          "[layers][rope]") {
    // positions 0..63: past them the fp32 angle pos·freq, which PyTorch's reference also rounds, drifts from the
    // double one by more than 1e-5 (64·2^-24 here)
    const int Tl = 64, Bl = 2, head = 16;
    const long row = (NH + 2 * KV) * head, n = (long)Bl * Tl * row;
    for (float scaling : {0.0f, 8.0f, 32.0f}) {
        INFO((scaling > 0 ? "theta 500000, scaled by " : "theta 10000, scaling ") << scaling);
        double theta = scaling > 0 ? 500000.0 : 10000.0;
        std::vector<float> table = make_table(Tl, head, (float)theta, scaling);
        Rng rng(33);
        std::vector<float> x = random_vector(n, rng), y = x;
        rope_forward(y.data(), table.data(), nullptr, Bl, Tl, NH, KV, head);
        double angle_err = 0.0, norm_err = 0.0;
        for (long r = 0; r < (long)Bl * Tl; r++) {
            int pos = (int)(r % Tl);
            for (int h = 0; h < NH + KV; h++)
                for (int i = 0; i < head / 2; i++) {
                    long k = r * row + h * head + 2 * i;
                    double a = x[k], b = x[k + 1], angle = pos * formula_freq(i, head, theta, scaling);
                    double c = a * cos(angle) - b * sin(angle), d = a * sin(angle) + b * cos(angle);
                    double size = sqrt(a * a + b * b);
                    angle_err = std::max(angle_err, hypot(y[k] - c, y[k + 1] - d) / std::max(size, 1.0));
                    double out_size = hypot((double)y[k], (double)y[k + 1]);
                    norm_err = std::max(norm_err, fabs(out_size - size) / size);
                }
        }
        CHECK(angle_err < 1e-5);
        CHECK(norm_err < 1e-6);  // a few fp32 roundings
        CHECK(same_values(y, x, (long)Bl * Tl, row, (NH + KV) * head));
        std::vector<float> back = y;
        rope_backward(back.data(), table.data(), nullptr, Bl, Tl, NH, KV, head);
        CHECK(same_values(back, x, (long)Bl * Tl, row, (NH + KV) * head));
        CHECK(max_rel_error(back.data(), x.data(), n, 1.0) < 1e-6);  // turned back where it started
    }
}

TEST_CASE("rope frequencies with and without Llama 3's scaling (3.1's and 3.2's factors) match the formula in double, "
          "in all three regimes",
          "[layers][rope]") {
    struct Setting {
        int hd;
        float theta;
    };
    for (Setting s : {Setting{128, 500000.0f}, Setting{64, 10000.0f}, Setting{96, 10000.0f}, Setting{8, 500000.0f}}) {
        for (float scaling : {0.0f, 8.0f, 32.0f}) {
            INFO("hd " << s.hd << ", theta " << s.theta << ", scaling " << scaling);
            std::vector<float> freq(s.hd / 2);
            rope_frequencies(freq.data(), s.hd, s.theta, scaling);
            double worst = 0.0;
            for (int i = 0; i < s.hd / 2; i++) {
                double ref = formula_freq(i, s.hd, s.theta, scaling);
                worst = std::max(worst, fabs(freq[i] - ref) / ref);
            }
            CHECK(worst < 1e-6);
        }
    }

    // hd=128, theta 500000 (Llama 3.1): frequency i has wavelength 2π·500000^(i/64), below 2048 up to i = 28,
    // above 8192 from i = 35; one of each regime, the regime decided here in double
    std::vector<float> plain(64), scaled(64), scaled32(64);
    rope_frequencies(plain.data(), 128, 500000.0f, 0.0f);
    rope_frequencies(scaled.data(), 128, 500000.0f, 8.0f);
    rope_frequencies(scaled32.data(), 128, 500000.0f, 32.0f);
    auto wavelen = [](int i) { return 2.0 * M_PI * pow(500000.0, i / 64.0); };
    REQUIRE(wavelen(0) < 2048.0);
    REQUIRE((wavelen(31) > 2048.0 && wavelen(31) < 8192.0));
    REQUIRE(wavelen(63) > 8192.0);
    CHECK(scaled[0] == plain[0]);  // kept: 1, exactly
    CHECK(scaled[0] == 1.0f);
    CHECK(scaled[28] == plain[28]);
    CHECK((scaled[31] < plain[31] && scaled[31] > plain[31] / 8.0f));  // blended
    CHECK(scaled[31] == Approx(formula_freq(31, 128, 500000.0, 8.0)).epsilon(1e-6));
    CHECK(scaled[35] == plain[35] / 8.0f);  // divided by 8, exactly
    CHECK(scaled[63] == plain[63] / 8.0f);
    CHECK(scaled32[28] == plain[28]);  // Llama 3.2's factor: the same regimes, the low frequencies divided by 32
    CHECK((scaled32[31] < scaled[31] && scaled32[31] > plain[31] / 32.0f));
    CHECK(scaled32[63] == plain[63] / 32.0f);

    // the table: (cos, sin) of the fp32 angle pos·freq[i] at (pos·hd/2 + i)·2, as precompute_freqs_cis lays it out
    const int maxT = 4100;
    std::vector<float> table = make_table(maxT, 128);
    for (int pos : {0, 1, 7, 4099})
        for (int i : {0, 1, 31, 63}) {
            INFO("position " << pos << ", frequency " << i);
            const float* cs = &table[((size_t)pos * 64 + i) * 2];
            double angle = (double)((float)pos * scaled[i]);
            CHECK(fabs(cs[0] - cos(angle)) <= 6e-8);  // half an fp32 ulp of values below 1
            CHECK(fabs(cs[1] - sin(angle)) <= 6e-8);
            if (pos <= 7) CHECK(fabs(angle - pos * formula_freq(i, 128, 500000.0, 8.0)) < 1e-6);
        }
    CHECK(table[0] == 1.0f);
    CHECK(table[1] == 0.0f);
}

TEST_CASE("rope refuses head sizes and pointers its kernels cannot serve", "[cuda][rope]") {
    // checked on the host before anything reaches the device: runs without a GPU, the pointers never dereferenced
    bf16* aligned = reinterpret_cast<bf16*>(uintptr_t{0x1000});
    bf16* misaligned = reinterpret_cast<bf16*>(uintptr_t{0x1002});
    float* table = reinterpret_cast<float*>(uintptr_t{0x2000});
    float* misaligned_table = reinterpret_cast<float*>(uintptr_t{0x2008});
    REQUIRE_THROWS_WITH(rope_forward_cuda(aligned, table, nullptr, 2, 5, 6, 2, 12, 0),
                        Catch::Contains("multiple of 8"));
    REQUIRE_THROWS_WITH(rope_backward_cuda(misaligned, table, nullptr, 2, 5, 6, 2, 8, 0),
                        Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(rope_forward_cuda(aligned, misaligned_table, nullptr, 2, 5, 6, 2, 8, 0),
                        Catch::Contains("not 16-byte aligned"));
    std::vector<float> x(100), t(100);
    REQUIRE_THROWS_WITH(rope_forward(x.data(), t.data(), nullptr, 1, 1, 1, 1, 7), Catch::Contains("even"));
    REQUIRE_THROWS_WITH(rope_backward(x.data(), t.data(), nullptr, 1, 1, 0, 1, 8), Catch::Contains("NH = 0"));
    REQUIRE_THROWS_WITH(rope_table(t.data(), 1, 0, 10000.0f, false), Catch::Contains("hd = 0"));
}

void check_rope(RopeCase& k) {
    INFO("B " << k.B << ", T " << k.T << ", NH " << k.NH << ", KV " << k.KV << ", hd " << k.hd);
    k.gpu_forward();
    std::vector<float> out = download(k.d_qkv);
    Comparison c = compare_rms(out, k.out, RopeCase::TOL);
    INFO("forward: max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    CHECK(c.pass());
    CHECK(k.values_untouched(out, k.qkv));
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dqkv);
    Comparison d = compare_rms(dinp, k.dinp, RopeCase::TOL);
    INFO("backward: max error " << d.max_abs << ", " << d.worst_ratio << " of tolerance");
    CHECK(d.pass());
    CHECK(k.values_untouched(dinp, k.dqkv));
}

TEST_CASE("CUDA RoPE forward and backward match the CPU and leave the values untouched", "[cuda][rope]") {
    SKIP_WITHOUT_GPU_CASE();
    {
        RopeCase k(B, T, NH, KV, hd, 1001, 500000.0f, 8.0f, POSITIONS, 41);
        check_rope(k);
    }
    {
        RopeCase k(3, 7, 3, 3, 24, 7, 10000.0f, 0.0f, {}, 42);  // 3 vectors a head: vectors cross no head
        check_rope(k);
    }
    {
        RopeCase k(1, 77, 32, 8, 128, 8192, 500000.0f, 32.0f, {}, 43);  // Llama 3 8B's heads
        check_rope(k);
    }
}

}  // namespace test_rope

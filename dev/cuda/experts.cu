// experts: llmc/experts.cuh's grouped expert GEMMs (one cuBLAS grouped GEMM per matmul of the MLP for all of a
// rank's experts, the biases, GELU and the bias gradients as kernels over every row) against the loop of mlp_* calls
// they replace (one cuBLASLt GEMM per expert), forward (out, fch, act) and backward (din, with din == dout as
// llmc/moe.cuh calls it; dfch, SwiGLU's dact, and every weight and bias gradient, accumulated into random values),
// and the split backward (the input gradient, then experts_weight_grads) against the loop's whole one:
//   small, against the CPU too (the float overloads: the loop of mlp_* calls on fp32): GELU experts with biases
//     (C = 64, H = 96, rows 37, 0, 64, 1, 129) and SwiGLU experts without (C = 128, H = 48, rows 0, 13, 5, 41, 0)
//   Qwen3-30B-A3B's experts: C = 2048, H = 768 SwiGLU, top 8 of 128 over B·T = 16384 tokens, 131072 rows on a rank's
//     experts: all 128 (ep 1), and the 32, 16 and 8 of ep 4, 8 and 16 (each rank's share of the rows the same on
//     average: every rank's tokens send their rows to every rank)
//   Mixtral 8x7B's: C = 4096, H = 14336 SwiGLU, top 2 of 8 over B·T = 4096 tokens, 8192 rows on 8 experts (the whole
//     of it fits: 2.8 GB of expert weights, and as much again in each of the two runs' gradients)
// The rows spread over the experts as a router's do: a multinomial over softmax(z), z ~ N(0, 0.35²) per expert
// (seeded): at 128 experts the busiest takes 2.1 times the mean (2176 rows) and the idlest 0.38 of it (392), at 8
// of Qwen's 1.3 and 0.77 times, Mixtral's 2.4 and 0.44 (each shape prints its own).
// Each shape is timed both ways, forward and backward (the weight gradients included), one cuBLAS handle and the
// same inputs; TFLOP/s counts 2·rows·C·(FC + H) forward and twice that backward, against a large cuBLASLt GEMM.
// Reproduce: make -C dev/cuda experts && dev/cuda/experts
//
// Tolerances (compare_rms: relative to each element, with the reference's RMS as the absolute floor):
//   grouped against the loop, forward 1e-2: both multiply the same bf16 values with fp32 sums, in another order
//     (other kernels, tiles and splits: ~1e-6 relative), and add the bias after the GEMM's rounding to bf16 rather
//     than in its epilogue before it (GELU then takes that rounded value); so they are one or two bf16 roundings
//     apart, ≤ 2⁻⁸ (0.4%) of an element. Gradients 2e-2: two or three more rounded stages (dact, dfch, din) each a
//     rounding apart, ≤ about 5 of 2⁻⁹ on an element; the weight gradients sum those over an expert's rows, where
//     the differences average down. A row given to the wrong expert, an expert missed or an increment lost or
//     doubled is an O(1) error.
//   against the CPU, 2e-2 forward and 3e-2 backward, as llmc/matmul.cuh's checks: the GPU rounds each stage to bf16
//     (fch, act, out; dact, dfch, din) where the CPU keeps fp32.
// The big shapes compare on the device (sums of squares and worst ratios by kernels; host copies of Qwen's 128
// experts' tensors would be 12 GB), the small ones on the host.
//
// The header's calls run on main_stream() (llmc/device.cuh), a non-blocking stream that the legacy stream
// (DeviceArray's poisoning and copies) does not order against: the checks bracket every launch with device
// synchronizations, and the timings record their events on main_stream().
#include <algorithm>
#include <string>

#include "dev/cuda/experts_case.h"

// ------------------------------------------------------------------------------------------------------------
// comparisons on the device: compare_rms's verdict (common.h) without bringing the tensors to the host

static __global__ void experts_sum_squares_kernel(double* total, const bf16* ref, long n) {
    __shared__ float shared[32];
    float s = 0.0f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = __bfloat162float(ref[i]);
        s += v * v;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) atomicAdd(total, (double)s);
}

// worst[0] the largest |got - ref|, worst[1] the largest |got - ref| / (atol + rtol·|ref|), as float bits (non-negative
// floats order as their bits do); NaN counts as infinite
static __global__ void experts_worst_kernel(unsigned* worst, const bf16* got, const bf16* ref, long n, float atol,
                                            float rtol) {
    float most = 0.0f, ratio = 0.0f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = __bfloat162float(got[i]), r = __bfloat162float(ref[i]);
        float err = fabsf(g - r), q = err / (atol + rtol * fabsf(r));
        if (isnan(err) || isnan(q)) err = q = INFINITY;
        most = fmaxf(most, err), ratio = fmaxf(ratio, q);
    }
    most = warp_max(most), ratio = warp_max(ratio);
    if (threadIdx.x % 32 == 0) {
        atomicMax(&worst[0], __float_as_uint(most));
        atomicMax(&worst[1], __float_as_uint(ratio));
    }
}

static Comparison compare_rms_on_device(const DeviceArray<bf16>& got, const DeviceArray<bf16>& ref, double tol) {
    DeviceArray<double> total(1);
    DeviceArray<unsigned> worst(2);
    cuda_check(cudaMemset(total.ptr, 0, sizeof(double)));
    cuda_check(cudaMemset(worst.ptr, 0, 2 * sizeof(unsigned)));
    long n = (long)ref.n;
    experts_sum_squares_kernel<<<grid_stride_blocks(n), 256>>>(total.ptr, ref.ptr, n);
    cuda_check(cudaGetLastError());
    double rms = n ? sqrt(download(total)[0] / n) : 0.0;
    experts_worst_kernel<<<grid_stride_blocks(n), 256>>>(worst.ptr, got.ptr, ref.ptr, n, (float)(tol * rms + 1e-30),
                                                         (float)tol);
    cuda_check(cudaGetLastError());
    std::vector<unsigned> w = download(worst);
    Comparison c;
    float most, ratio;
    memcpy(&most, &w[0], sizeof(float));
    memcpy(&ratio, &w[1], sizeof(float));
    c.max_abs = most, c.worst_ratio = got.n == ref.n ? ratio : INFINITY;
    return c;
}

// Checks::check's line and count for a comparison made on the device
static void check_on_device(Checks& checks, const std::string& what, const DeviceArray<bf16>& got,
                            const DeviceArray<bf16>& ref, double tol) {
    Comparison c = compare_rms_on_device(got, ref, tol);
    checks.total++;
    if (!c.pass()) checks.failed++;
    printf("%-44s max error %.3e (%.2f of tolerance) %s\n", what.c_str(), c.max_abs, c.worst_ratio,
           c.pass() ? "PASS" : "FAIL");
}

// ------------------------------------------------------------------------------------------------------------
// the checks

constexpr double FORWARD_TOL = 1e-2, BACKWARD_TOL = 2e-2, CPU_FORWARD_TOL = 2e-2, CPU_BACKWARD_TOL = 3e-2;

// an output or gradient by name: the grouped run's, the loop's, the CPU's (empty without host values), and whether
// it comes from the backward
struct ExpertsOutput {
    const char* name;
    const DeviceArray<bf16>*grouped, *loop;
    const std::vector<float>* cpu;
    bool backward;
};
static std::vector<ExpertsOutput> experts_outputs(const ExpertsCase& k, bool forward, bool backward) {
    const ExpertsCase::Run &g = k.grouped, &l = k.loop;
    std::vector<ExpertsOutput> all;
    if (forward)
        all.insert(all.end(), {{"out", &g.out, &l.out, &k.cpu.out, false},
                               {"fch", &g.fch, &l.fch, &k.cpu.fch, false},
                               {"act", &g.act, &l.act, &k.cpu.act, false}});
    if (!backward) return all;
    all.insert(all.end(), {{"din", &g.din, &l.din, &k.cpu.din, true},
                           {"dfch", &g.dfch, &l.dfch, &k.cpu.dfch, true},
                           {"dfcw (+=)", &g.dfcw, &l.dfcw, &k.cpu.dfcw, true},
                           {"dfcprojw (+=)", &g.dfcprojw, &l.dfcprojw, &k.cpu.dfcprojw, true}});
    if (k.swiglu()) all.push_back({"dact", &g.dact, &l.dact, &k.cpu.dact, true});
    if (k.bias)
        all.insert(all.end(), {{"dfcb (+=)", &g.dfcb, &l.dfcb, &k.cpu.dfcb, true},
                               {"dfcprojb (+=)", &g.dfcprojb, &l.dfcprojb, &k.cpu.dfcprojb, true}});
    return all;
}

// grouped against the loop (on the device), and with the CPU reference both against it (on the host)
static void compare_runs(Checks& checks, ExpertsCase& k, const std::string& v, bool forward, bool backward,
                         bool with_cpu, const char* what) {
    for (const ExpertsOutput& o : experts_outputs(k, forward, backward)) {
        double tol = o.backward ? BACKWARD_TOL : FORWARD_TOL, cpu_tol = o.backward ? CPU_BACKWARD_TOL : CPU_FORWARD_TOL;
        check_on_device(checks, v + what + o.name + ": grouped = loop", *o.grouped, *o.loop, tol);
        if (!with_cpu) continue;
        checks.check(v + what + o.name + ": grouped = CPU", download(*o.grouped), *o.cpu, cpu_tol);
        checks.check(v + what + o.name + ": loop = CPU", download(*o.loop), *o.cpu, cpu_tol);
    }
}

static void check_case(Checks& checks, ExpertsCase& k, const std::string& v, bool with_cpu) {
    std::string missing = experts_grouped_missing();
    checks.require(v + "cuBLAS's grouped GEMM runs" + (missing.empty() ? "" : ": " + missing), missing.empty());
    on_main_stream([&] { k.forward(k.loop, false); });
    on_main_stream([&] { k.forward(k.grouped, true); });
    compare_runs(checks, k, v, true, false, with_cpu, "forward ");
    // the loop with din a buffer of its own, the grouped path with din == dout
    on_main_stream([&] { k.backward(k.loop, false, false); });
    on_main_stream([&] { k.backward(k.grouped, true, true); });
    compare_runs(checks, k, v, false, true, with_cpu, "backward ");
    // the split backward, from the gradients' starting values, against the loop's whole backward
    k.grouped.din.poison(), k.grouped.dfch.poison();
    on_main_stream([&] { k.reset_grads(k.grouped); });
    on_main_stream([&] { k.split_backward(k.grouped, true); });
    compare_runs(checks, k, v, false, true, false, "split backward ");
    checks.require(v + "the grouped GEMM ran throughout", experts_grouped_missing().empty());
}

// the spread of a case's rows: "rows per expert min 512, mean 1024, max 2107, 0 without rows"
static std::string spread(const std::vector<int>& first) {
    int X = (int)first.size() - 1, least = INT32_MAX, most = 0, none = 0;
    for (int x = 0; x < X; x++) {
        int n = first[x + 1] - first[x];
        least = std::min(least, n), most = std::max(most, n), none += n == 0;
    }
    return strfmt("rows per expert min %d, mean %.0f, max %d, %d without rows", least, (double)first[X] / X, most, none);
}

// ------------------------------------------------------------------------------------------------------------
// the timings: one buffer set (the GEMMs are compute-bound), the loop and the grouped path on the same inputs

static void time_case(ExpertsCase& k, const std::string& v) {
    auto ms = [&](auto&& launch) {
        cuda_check(cudaDeviceSynchronize());
        return median_ms([&](int) { launch(); }, 1, 30, main_stream());
    };
    double flops = k.forward_flops();
    float forward_loop = ms([&] { k.forward(k.loop, false); });
    float forward_grouped = ms([&] { k.forward(k.grouped, true); });
    float backward_loop = ms([&] { k.backward(k.loop, false, false); });
    float backward_grouped = ms([&] { k.backward(k.grouped, true, false); });
    report_compute_bound(v + "forward, loop", forward_loop, flops);
    report_compute_bound(v + "forward, grouped", forward_grouped, flops);
    report_compute_bound(v + "backward, loop", backward_loop, 2.0 * flops);
    report_compute_bound(v + "backward, grouped", backward_grouped, 2.0 * flops);
    printf("%-44s forward %.3f, backward %.3f\n", (v + "time grouped / loop").c_str(), forward_grouped / forward_loop,
           backward_grouped / backward_loop);
}

// one of the named shapes: its rows drawn as a router spreads them, checked and timed
static void run_shape(Checks& checks, const char* name, int C, int H, int X, long rows, uint64_t seed) {
    MlpShape s{C, H, Activation::SwiGLU};
    std::vector<int> first = experts_first(experts_routed_counts(X, rows, 0.35f, seed));
    std::string v = strfmt("%s X=%d ", name, X);
    printf("%s X=%d: C=%d H=%d SwiGLU, %ld rows, %s\n", name, X, C, H, rows, spread(first).c_str());
    ExpertsCase k(s, false, first, seed, false);
    check_case(checks, k, v, false);
    time_case(k, v);
}

int main() {
    Program program("experts: llmc/experts.cuh's grouped expert GEMMs against the per-expert loop (and the CPU on "
                    "small shapes), at Qwen3-30B-A3B's and Mixtral 8x7B's experts; timed both ways");
    Checks checks;
    ExpertsCase gelu(MlpShape{64, 96, Activation::GELU}, true, experts_first({37, 0, 64, 1, 129}), 21, true);
    ExpertsCase swiglu(MlpShape{128, 48, Activation::SwiGLU}, false, experts_first({0, 13, 5, 41, 0}), 22, true);
    if (!program.gpu) return program.finish(checks);
    cuda_check(cudaDeviceSynchronize());
    gemm_tflops();  // measured first, on the legacy stream, while nothing else runs
    check_case(checks, gelu, "GELU+bias C=64 H=96 X=5 ", true);
    check_case(checks, swiglu, "SwiGLU C=128 H=48 X=5 ", true);
    for (int X : {128, 32, 16, 8}) run_shape(checks, "qwen3-30b-a3b", 2048, 768, X, 8L * 16384, 31);
    run_shape(checks, "mixtral-8x7b", 4096, 14336, 8, 2L * 4096, 32);
    return program.finish(checks);
}

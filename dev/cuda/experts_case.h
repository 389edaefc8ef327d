// The check case of llmc/experts.cuh (dev/cuda/README.md says what a case holds): dev/cuda/experts.cu runs it at
// Qwen3-30B-A3B's and Mixtral 8x7B's expert shapes, test/test_cuda_kernels.cu at small odd ones with the CPU
// reference beside them.
#pragma once

#include <omp.h>

#include <cstdint>
#include <utility>

#include "dev/cuda/common.h"
#include "llmc/experts.cuh"

// The inputs are drawn from a hash of (seed, index), the same bf16 values on the host and on the device: four 16-bit
// uniforms summed (Irwin-Hall, variance 1/3 before the scale), integer and float additions and one product, which
// round alike on both, so a large case draws on the GPU alone and a small one on the host too, for the CPU.
__host__ __device__ inline float experts_case_value(uint64_t seed, uint64_t i, float scale) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float sum = 0.0f;
    for (int k = 0; k < 4; k++) sum += ((float)((z >> (16 * k)) & 0xFFFF) + 0.5f) * (1.0f / 65536.0f);
    return (sum - 2.0f) * (1.7320508f * scale);
}
static __global__ void experts_case_fill_kernel(bf16* p, long n, uint64_t seed, float scale) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(experts_case_value(seed, i, scale));
}
inline std::vector<float> experts_case_values(size_t n, uint64_t seed, float scale) {
    std::vector<float> v(n);
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(__float2bfloat16(experts_case_value(seed, i, scale)));
    return v;
}

// first (X + 1 entries) from each expert's row count
inline std::vector<int> experts_first(const std::vector<int>& counts) {
    std::vector<int> first(counts.size() + 1, 0);
    for (size_t x = 0; x < counts.size(); x++) first[x + 1] = first[x] + counts[x];
    return first;
}

// `rows` rows over X experts as a router spreads them: each row's expert drawn from probabilities p = softmax(z),
// z ~ N(0, sigma²) per expert (a multinomial), so some experts take a few times the mean and some a fraction of it
inline std::vector<int> experts_routed_counts(int X, long rows, float sigma, uint64_t seed) {
    Rng rng(seed);
    std::vector<double> cumulative(X);
    double total = 0.0;
    for (int x = 0; x < X; x++) cumulative[x] = total += exp(rng.normal(0.0f, sigma));
    std::vector<int> counts(X, 0);
    for (long r = 0; r < rows; r++) {
        double u = rng.uniform() * total;
        counts[std::min<long>(std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin(), X - 1)]++;
    }
    return counts;
}

// The X experts' MLP (shape s; biases or none) over rows first[0] .. first[X]-1: one set of inputs (the rows, the
// stacked weights, the output gradient) and two runs of outputs, each with its own gradients, which start from the
// same random values (accumulated: a lost or doubled increment shows), for the grouped path and the loop; with
// `host`, the inputs on the host too and the CPU reference (the float overloads, which are the loop of mlp_* calls).
// Weights are drawn at 1/√(fan-in) so that fch and the outputs are of unit scale, biases at 0.5, the rows and the
// output gradient at 1, the gradients' starting values at the scale of their increments (√(rows per expert)·0.5).
struct ExpertsCase {
    MlpShape s;
    int X;
    bool bias;
    std::vector<int> first;
    long rows, C, H, FC;
    uint64_t seed;
    // the tensors, in the order of their seeds: inputs, then the gradients' starting values
    enum Tensor { IN, FCW, FCB, FCPROJW, FCPROJB, DOUT, DFCW, DFCB, DFCPROJW, DFCPROJB, TENSORS };
    struct Run {
        DeviceArray<bf16> out, fch, act, din, dfch, dact, dfcw, dfcb, dfcprojw, dfcprojb;
        Run(long rows, long C, long H, long FC, int X, bool swiglu)
            : out(rows * C), fch(rows * FC), act(rows * H), din(rows * C), dfch(rows * FC), dact(swiglu ? rows * H : 0),
              dfcw((size_t)X * FC * C), dfcb((size_t)X * FC), dfcprojw((size_t)X * C * H), dfcprojb((size_t)X * C) {}
    };
    DeviceArray<bf16> d_in, d_fcw, d_fcb, d_fcprojw, d_fcprojb, d_dout;
    Run grouped, loop;
    DeviceArray<float> scratch;  // the loop's bias gradients' (llmc/matmul.cuh's column sums)
    // with host: the inputs, and the CPU's outputs and gradients after forward and backward (the entry points: the
    // mlp_* loop)
    std::vector<float> in, fcw, fcb, fcprojw, fcprojb, dout;
    struct HostRun {
        std::vector<float> out, fch, act, din, dfch, dact, dfcw, dfcb, dfcprojw, dfcprojb;
    };
    HostRun cpu;

    ExpertsCase(const MlpShape& s_, bool bias_, std::vector<int> first_, uint64_t seed_, bool host)
        : s(s_), X((int)first_.size() - 1), bias(bias_), first(std::move(first_)), rows(first.back() - first[0]),
          C(s_.C), H(s_.H), FC(s_.FC()), seed(seed_), d_in(count(IN)), d_fcw(count(FCW)), d_fcb(count(FCB)),
          d_fcprojw(count(FCPROJW)), d_fcprojb(count(FCPROJB)), d_dout(count(DOUT)),
          grouped(rows, C, H, FC, X, swiglu()), loop(rows, C, H, FC, X, swiglu()),
          scratch(bias ? matmul_backward_scratch_floats(max_expert_rows(), std::max(C, FC)) : 0) {
        if (first[0] != 0) fail("ExpertsCase: rows start at 0");
        if (have_gpu()) {
            cuda_check(cudaDeviceSynchronize());  // the poisoning (legacy stream) before the fills (main_stream)
            std::pair<DeviceArray<bf16>*, Tensor> inputs[] = {{&d_in, IN},         {&d_fcw, FCW},
                                                              {&d_fcb, FCB},       {&d_fcprojw, FCPROJW},
                                                              {&d_fcprojb, FCPROJB}, {&d_dout, DOUT}};
            for (auto [d, t] : inputs) fill(*d, t);
            reset_grads(grouped);
            reset_grads(loop);
            cuda_check(cudaDeviceSynchronize());
        }
        if (host) cpu_reference();
    }

    ExpertsCase(const ExpertsCase&) = delete;
    ExpertsCase& operator=(const ExpertsCase&) = delete;

    bool swiglu() const { return s.activation == Activation::SwiGLU; }
    long max_expert_rows() const {
        long most = 0;
        for (int x = 0; x < X; x++) most = std::max<long>(most, first[x + 1] - first[x]);
        return most;
    }
    size_t count(Tensor t) const {
        switch (t) {
            case IN: case DOUT: return rows * C;
            case FCW: case DFCW: return (size_t)X * FC * C;
            case FCB: case DFCB: return bias ? (size_t)X * FC : 0;
            case FCPROJW: case DFCPROJW: return (size_t)X * C * H;
            case FCPROJB: case DFCPROJB: return bias ? (size_t)X * C : 0;
            default: return 0;
        }
    }
    float scale(Tensor t) const {
        float increments = 0.5f * sqrtf((float)rows / X);
        switch (t) {
            case FCW: return 1.0f / sqrtf((float)C);
            case FCPROJW: return 1.0f / sqrtf((float)H);
            case FCB: case FCPROJB: return 0.5f;
            case DFCW: case DFCB: case DFCPROJW: case DFCPROJB: return increments;
            default: return 1.0f;
        }
    }
    uint64_t seed_of(Tensor t) const { return seed * TENSORS + t; }
    Workspace workspace() const { return {scratch.ptr, scratch.n}; }  // the loop's, for its bias gradients
    void fill(DeviceArray<bf16>& d, Tensor t) {
        if (!d.ptr || d.n == 0) return;
        experts_case_fill_kernel<<<grid_stride_blocks((long)d.n), 256, 0, main_stream()>>>(d.ptr, (long)d.n, seed_of(t),
                                                                                        scale(t));
        cuda_check(cudaGetLastError());
    }
    std::vector<float> values(Tensor t) const { return experts_case_values(count(t), seed_of(t), scale(t)); }

    // the gradients back to their starting values (on main_stream)
    void reset_grads(Run& r) {
        fill(r.dfcw, DFCW), fill(r.dfcb, DFCB), fill(r.dfcprojw, DFCPROJW), fill(r.dfcprojb, DFCPROJB);
    }
    MlpTensorViews<bf16> weights() const {
        return {d_fcw.ptr, bias ? d_fcb.ptr : nullptr, d_fcprojw.ptr, bias ? d_fcprojb.ptr : nullptr};
    }
    // SwiGLU's activation gradient (GELU's backward runs in place in dfch: none, as the model passes it)
    bf16* dact_of(Run& r) const { return swiglu() ? r.dact.ptr : nullptr; }
    static MlpTensorViews<bf16> grads(Run& r, bool bias) {
        return {r.dfcw.ptr, bias ? r.dfcb.ptr : nullptr, r.dfcprojw.ptr, bias ? r.dfcprojb.ptr : nullptr};
    }

    // the launches, on main_stream() (the caller synchronizes where it reads back)
    void forward(Run& r, bool grouped_gemms) {
        experts_forward(r.out.ptr, r.fch.ptr, r.act.ptr, d_in.ptr, weights(), first, s, workspace(),
                        (const Fp8Scaling<bf16>*)nullptr, grouped_gemms);
    }
    // din == dout when `alias` (dout copied into din first), as llmc/moe.cuh calls it
    void backward(Run& r, bool grouped_gemms, bool alias) {
        const bf16* g = d_dout.ptr;
        if (alias) {
            cuda_check(cudaMemcpyAsync(r.din.ptr, d_dout.ptr, d_dout.bytes(), cudaMemcpyDeviceToDevice, main_stream()));
            g = r.din.ptr;
        }
        experts_backward(r.din.ptr, grads(r, bias), g, r.dfch.ptr, dact_of(r), r.fch.ptr, r.act.ptr, d_in.ptr, weights(),
                         first, s, workspace(), (const Fp8Scaling<bf16>*)nullptr, grouped_gemms);
    }
    // the split backward: the input gradient with no weight gradients, then experts_weight_grads
    void split_backward(Run& r, bool grouped_gemms) {
        experts_backward(r.din.ptr, MlpTensorViews<bf16>{}, d_dout.ptr, r.dfch.ptr, dact_of(r), r.fch.ptr, r.act.ptr,
                         d_in.ptr, weights(), first, s, workspace(), (const Fp8Scaling<bf16>*)nullptr, grouped_gemms);
        experts_weight_grads(grads(r, bias), d_dout.ptr, r.dfch.ptr, r.act.ptr, d_in.ptr, weights(), first, s, workspace(),
                             (const Fp8Scaling<bf16>*)nullptr, grouped_gemms);
    }

    // the CPU's forward and backward on the same bf16 values: the entry points (the mlp_* loop, din a buffer of its
    // own), or the grouped passes in their CPU loops with din == dout (split: the input gradient, then the weights')
    HostRun run_on_cpu(bool grouped_passes, bool split) const {
        HostRun r;
        r.dfcw = values(DFCW), r.dfcb = values(DFCB), r.dfcprojw = values(DFCPROJW), r.dfcprojb = values(DFCPROJB);
        r.out.resize(rows * C), r.fch.resize(rows * FC), r.act.resize(rows * H), r.dfch.resize(rows * FC);
        r.dact.resize(swiglu() ? rows * H : 0);
        std::vector<float> panels(gemm_workspace_floats(omp_get_max_threads()));
        Workspace ws{panels.data(), panels.size()};
        auto weights = [&](const std::vector<float>& w, const std::vector<float>& b, const std::vector<float>& pw,
                           const std::vector<float>& pb) {
            return MlpTensorViews<float>{(float*)w.data(), bias ? (float*)b.data() : nullptr, (float*)pw.data(),
                                         bias ? (float*)pb.data() : nullptr};
        };
        MlpTensorViews<float> w = weights(fcw, fcb, fcprojw, fcprojb), dw = weights(r.dfcw, r.dfcb, r.dfcprojw, r.dfcprojb);
        float* dact = swiglu() ? r.dact.data() : nullptr;
        const Fp8Scaling<float>* none = nullptr;
        if (!grouped_passes) {
            r.din.resize(rows * C);
            experts_forward(r.out.data(), r.fch.data(), r.act.data(), in.data(), w, first, s, ws, none);
            experts_backward(r.din.data(), dw, dout.data(), r.dfch.data(), dact, r.fch.data(), r.act.data(), in.data(), w,
                             first, s, ws, none);
            return r;
        }
        r.din = dout;
        experts_forward_grouped(r.out.data(), r.fch.data(), r.act.data(), in.data(), w, first, s);
        if (!split) {
            experts_backward_grouped(r.din.data(), dw, r.din.data(), r.dfch.data(), dact, r.fch.data(), r.act.data(),
                                     in.data(), w, first, s, true);
            return r;
        }
        experts_backward_grouped(r.din.data(), MlpTensorViews<float>{}, dout.data(), r.dfch.data(), dact, r.fch.data(),
                                 r.act.data(), in.data(), w, first, s, true);
        experts_backward_grouped((float*)nullptr, dw, dout.data(), r.dfch.data(), (float*)nullptr, (const float*)nullptr,
                                 r.act.data(), in.data(), w, first, s, false);
        return r;
    }
    void cpu_reference() {
        in = values(IN), fcw = values(FCW), fcb = values(FCB), fcprojw = values(FCPROJW), fcprojb = values(FCPROJB);
        dout = values(DOUT);
        cpu = run_on_cpu(false, false);
    }

    // 2·rows·C·(FC + H) forward, twice that backward (the input gradients' GEMMs and the weights')
    double forward_flops() const { return 2.0 * rows * C * (FC + H); }
};

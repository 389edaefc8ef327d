// Shared by the dev/cuda kernel checks (and test/test_cuda_kernels.cu): the first line every program prints and
// its end (Program: line-buffered output, the GPU's absence a skip after the CPU side has run), device buffers
// filled from host vectors, bf16 rounding so the CPU reference sees exactly the GPU's inputs, tolerance checks, timing with CUDA
// events (medians, cycling through buffer copies that outsize the L2), and the two ceilings a kernel's speed is quoted against: device-to-device copy bandwidth for
// memory-bound kernels, a large cuBLASLt bf16 GEMM for compute-bound ones.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/device.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

// ------------------------------------------------------------------------------------------------------------
// inputs and buffers

// values drawn from N(0, scale²) and rounded to bf16, so the fp32 CPU reference and the bf16 GPU kernel start
// from identical numbers. Large draws come in blocks of RANDOM_BLOCK values, each from its own generator seeded
// by one draw of rng and the block's index, filled on every core: the same values whatever the thread count.
// One thread drawing them was most of the CPU side of the GPT-2-size checks (Box-Muller at tens of ns a value,
// 700 million values in rope's). Draws below RANDOM_BLOCK (the tests' shapes) stay one sequence from rng.
constexpr size_t RANDOM_BLOCK = (size_t)1 << 20;

inline std::vector<float> random_bf16_values(size_t n, Rng& rng, float scale = 1.0f) {
    std::vector<float> v(n);
    if (n < RANDOM_BLOCK) {
        for (auto& x : v) x = __bfloat162float(__float2bfloat16(rng.normal(0.0f, scale)));
        return v;
    }
    const uint64_t seed = rng.next_u64();
    const long blocks = (long)((n + RANDOM_BLOCK - 1) / RANDOM_BLOCK);
#pragma omp parallel for schedule(dynamic)
    for (long b = 0; b < blocks; b++) {
        Rng block_rng(seed + (uint64_t)b);  // reseed's splitmix makes neighbouring seeds unrelated streams
        for (size_t i = b * RANDOM_BLOCK; i < std::min(n, (b + 1) * RANDOM_BLOCK); i++)
            v[i] = __bfloat162float(__float2bfloat16(block_rng.normal(0.0f, scale)));
    }
    return v;
}

inline std::vector<float> round_to_bf16(std::vector<float> v) {
#pragma omp parallel for
    for (size_t i = 0; i < v.size(); i++) v[i] = __bfloat162float(__float2bfloat16(v[i]));
    return v;
}

// whether a GPU is there, asked once
inline bool have_gpu() {
    static bool gpu = cuda_device_available();
    return gpu;
}

// a device allocation that frees itself; poisoned with 0xFF bytes (NaN in bf16 and fp32) until written. Without a
// GPU it holds nothing (ptr null; upload and poison do nothing), so that a program's cases still build their
// inputs and CPU references there: the CPU side of every program runs, and is timed, on a machine without a GPU.
template <typename T>
struct DeviceArray {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceArray(size_t count) : n(count) {
        if (!have_gpu()) return;
        cuda_check(cudaMalloc(&ptr, n * sizeof(T) + 16));
        poison();
    }
    ~DeviceArray() {
        if (ptr) cudaFree(ptr);
    }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    void poison() {
        if (ptr) cuda_check(cudaMemset(ptr, 0xFF, n * sizeof(T)));
    }
    size_t bytes() const { return n * sizeof(T); }
};

inline void upload(DeviceArray<bf16>& dst, const std::vector<float>& src) {
    if (!dst.ptr) return;
    std::vector<bf16> tmp(src.size());
#pragma omp parallel for
    for (size_t i = 0; i < src.size(); i++) tmp[i] = __float2bfloat16(src[i]);
    cuda_check(cudaMemcpy(dst.ptr, tmp.data(), tmp.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}

template <typename T>
inline void upload(DeviceArray<T>& dst, const std::vector<T>& src) {
    if (!dst.ptr) return;
    cuda_check(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

inline std::vector<float> download(const DeviceArray<bf16>& src) {
    std::vector<bf16> tmp(src.n);
    cuda_check(cudaMemcpy(tmp.data(), src.ptr, src.bytes(), cudaMemcpyDeviceToHost));
    std::vector<float> out(src.n);
#pragma omp parallel for
    for (size_t i = 0; i < src.n; i++) out[i] = __bfloat162float(tmp[i]);
    return out;
}

template <typename T>
inline std::vector<T> download(const DeviceArray<T>& src) {
    std::vector<T> out(src.n);
    cuda_check(cudaMemcpy(out.data(), src.ptr, src.bytes(), cudaMemcpyDeviceToHost));
    return out;
}

// ------------------------------------------------------------------------------------------------------------
// checks

// passes when every |gpu - cpu| <= atol + rtol·|cpu| (NaN never passes); returns the worst |gpu - cpu| and
// the worst ratio of error to allowance (≤ 1 passes)
struct Comparison {
    double max_abs = 0.0, worst_ratio = 0.0;
    bool pass() const { return worst_ratio <= 1.0; }
};

inline Comparison compare(const std::vector<float>& gpu, const std::vector<float>& cpu, double atol, double rtol) {
    Comparison c;
    if (gpu.size() != cpu.size()) {
        c.worst_ratio = INFINITY;
        return c;
    }
    double max_abs = 0.0, worst_ratio = 0.0;
#pragma omp parallel for reduction(max : max_abs, worst_ratio)
    for (size_t i = 0; i < gpu.size(); i++) {
        double err = fabs((double)gpu[i] - (double)cpu[i]);
        double ratio = err / (atol + rtol * fabs((double)cpu[i]));
        if (std::isnan(err)) err = ratio = INFINITY;
        max_abs = fmax(max_abs, err);
        worst_ratio = fmax(worst_ratio, ratio);
    }
    c.max_abs = max_abs, c.worst_ratio = worst_ratio;
    return c;
}

// tol is relative, to each element and (as the absolute floor) to the reference's RMS, so sums that cancel to
// near zero are judged on the scale of their terms
inline Comparison compare_rms(const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    double sq = 0.0;
#pragma omp parallel for reduction(+ : sq)
    for (size_t i = 0; i < cpu.size(); i++) sq += (double)cpu[i] * cpu[i];
    double rms = cpu.empty() ? 0.0 : sqrt(sq / cpu.size());
    return compare(gpu, cpu, tol * rms + 1e-30, tol);
}

// counts failures over a program's checks and prints one line per check (names with parameters: strfmt)
struct Checks {
    int failed = 0, total = 0;
    bool check(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
        Comparison c = compare_rms(gpu, cpu, tol);
        total++;
        if (!c.pass()) failed++;
        printf("%-44s max error %.3e (%.2f of tolerance) %s\n", what.c_str(), c.max_abs, c.worst_ratio,
               c.pass() ? "PASS" : "FAIL");
        return c.pass();
    }
    bool require(const std::string& what, bool ok) {
        total++;
        if (!ok) failed++;
        printf("%-44s %s\n", what.c_str(), ok ? "PASS" : "FAIL");
        return ok;
    }
    int exit_code() const {
        printf("%d of %d checks passed\n", total - failed, total);
        return failed ? 1 : 0;
    }
};

// ------------------------------------------------------------------------------------------------------------
// timing

// Timings quote the median of single calls, each bracketed by its own pair of events, so one slow call (a clock
// ramp, another process) does not move the figure. Memory-bound kernels are timed on inputs that do not sit in
// the L2 (50 MB on an H100): a program keeps several copies of a call's buffers and the calls cycle through
// them (timing_sets says how many), so each call finds its inputs in DRAM, as in training.

// Each timing stays within TIMING_BUDGET_MS of calls (after its warm-up): a call slower than expected, a large
// shape or a slow GPU lowers the repetitions (to 5 at the least) rather than the program's time growing with them.
constexpr float TIMING_BUDGET_MS = 250.0f;

// f's launches on llmc's main_stream(), a non-blocking stream that the legacy default stream (the uploads,
// downloads and poisoning here) does not order against: the device synchronized before and after
template <typename F>
inline void on_main_stream(F&& f) {
    cuda_check(cudaDeviceSynchronize());
    f();
    cuda_check(cudaGetLastError());
    cuda_check(cudaDeviceSynchronize());
}

// median milliseconds per call of f(set), set = 0, 1, ..., sets - 1, 0, 1, ... over reps calls (fewer where
// reps calls would outlast TIMING_BUDGET_MS, judged from one call timed after one warm-up pass over every set);
// the events go on `stream`, where f's kernels run
template <typename F>
inline float median_ms(F&& f, int sets, int reps = 30, cudaStream_t stream = 0) {
    for (int s = 0; s < sets; s++) f(s);
    {
        cudaEvent_t a, b;
        cuda_check(cudaEventCreate(&a));
        cuda_check(cudaEventCreate(&b));
        cuda_check(cudaEventRecord(a, stream));
        f(0);
        cuda_check(cudaEventRecord(b, stream));
        cuda_check(cudaEventSynchronize(b));
        float one = 0.0f;
        cuda_check(cudaEventElapsedTime(&one, a, b));
        cuda_check(cudaEventDestroy(a));
        cuda_check(cudaEventDestroy(b));
        if (one * reps > TIMING_BUDGET_MS) reps = std::max(5, (int)(TIMING_BUDGET_MS / std::max(one, 1e-3f)));
    }
    std::vector<cudaEvent_t> events(2 * reps);
    for (auto& e : events) cuda_check(cudaEventCreate(&e));
    for (int r = 0; r < reps; r++) {
        cuda_check(cudaEventRecord(events[2 * r], stream));
        f(r % sets);
        cuda_check(cudaEventRecord(events[2 * r + 1], stream));
    }
    cuda_check(cudaEventSynchronize(events.back()));
    std::vector<float> ms(reps);
    for (int r = 0; r < reps; r++) cuda_check(cudaEventElapsedTime(&ms[r], events[2 * r], events[2 * r + 1]));
    for (auto& e : events) cuda_check(cudaEventDestroy(e));
    std::sort(ms.begin(), ms.end());
    return reps % 2 ? ms[reps / 2] : 0.5f * (ms[reps / 2 - 1] + ms[reps / 2]);
}

// median milliseconds per call of f() (one buffer set: for compute-bound kernels, whose inputs L2 cannot hold
// a meaningful share of anyway)
template <typename F>
inline float time_ms(F&& f, int reps = 20) {
    return median_ms([&](int) { f(); }, 1, reps);
}

inline size_t l2_cache_bytes() {
    int dev = 0, bytes = 0;
    cuda_check(cudaGetDevice(&dev));
    cuda_check(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev));
    return (size_t)bytes;
}

// how many copies of a call's buffers (bytes_per_call: what one call reads and writes) the timing cycles through:
// together at least four times the L2, and never fewer than two, so no call starts on what the previous left
inline int timing_sets(double bytes_per_call) {
    double sets = ceil(4.0 * (double)l2_cache_bytes() / bytes_per_call);
    return (int)std::min(64.0, std::max(2.0, sets));
}

// `sets` device copies of one buffer, for timings that cycle through their inputs and outputs
template <typename T>
struct TimingCopies {
    std::vector<std::unique_ptr<DeviceArray<T>>> copies;
    TimingCopies(const DeviceArray<T>& src, int sets) {
        for (int s = 0; s < sets; s++) {
            copies.emplace_back(new DeviceArray<T>(src.n));
            cuda_check(cudaMemcpy(copies.back()->ptr, src.ptr, src.bytes(), cudaMemcpyDeviceToDevice));
        }
    }
    T* operator[](int s) const { return copies[s]->ptr; }
};

// GB/s of a 1 GiB device-to-device copy, counting its read and its write
inline double copy_bandwidth_gbs() {
    static double gbs = [] {
        size_t bytes = (size_t)1 << 30;
        DeviceArray<char> a(bytes), b(bytes);
        float ms = time_ms([&] { cuda_check(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); }, 11);
        return 2.0 * bytes / (ms * 1e-3) / 1e9;
    }();
    return gbs;
}

// TFLOP/s of an 8192³ bf16 GEMM through the same cuBLASLt path as the model's matmuls
inline double gemm_tflops() {
    static double tflops = [] {
        long n = 8192;
        DeviceArray<bf16> a(n * n), b(n * n), c(n * n);
        Rng rng(7);
        std::vector<float> values = random_bf16_values(n * n, rng);  // random, as in training: zeros draw less power
        upload(a, values);
        upload(b, values);
        float ms = time_ms([&] { matmul_forward_cuda(c.ptr, a.ptr, b.ptr, nullptr, n, n, n, nullptr, 0); }, 11);
        return 2.0 * n * n * n / (ms * 1e-3) / 1e12;
    }();
    return tflops;
}

// one timing line: memory-bound kernels are quoted against the copy bandwidth, compute-bound ones against the GEMM
inline void report_memory_bound(const std::string& what, float ms, double bytes) {
    double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-44s %9.4f ms %8.1f GB/s  %5.1f%% of copy bandwidth (%.0f GB/s)\n", what.c_str(), ms, gbs,
           100.0 * gbs / copy_bandwidth_gbs(), copy_bandwidth_gbs());
}

inline void report_compute_bound(const std::string& what, float ms, double flops) {
    double tflops = flops / (ms * 1e-3) / 1e12;
    printf("%-44s %9.4f ms %8.1f TFLOP/s %5.1f%% of bf16 GEMM (%.0f TFLOP/s)\n", what.c_str(), ms, tflops,
           100.0 * tflops / gemm_tflops(), gemm_tflops());
}

// Every program starts with one. Its first line says what the program checks, printed at once, and stdout is
// line-buffered from there: into a file or a pipe (verify.sh's logs) it would otherwise be fully buffered, and a
// slow or stuck program would show nothing at all until it ended. Without a GPU the program still builds its
// inputs and CPU references (DeviceArray holds nothing there) but makes no device check or timing (gpu is
// false), and ends with "skipped: no GPU" and the seconds its CPU side took: not a failure, so CI without a GPU
// stays green, and the CPU side's share of the program's time bound (docs/tests.md) is measured there.
struct Program {
    bool gpu = false;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    explicit Program(const std::string& what) {
        setvbuf(stdout, nullptr, _IOLBF, 0);
        printf("%s\n", what.c_str());
        fflush(stdout);
        gpu = have_gpu();
        if (!gpu) printf("no GPU: the inputs and CPU references alone\n");
    }
    double seconds() const {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    // the exit status: 0 without a GPU, else the checks'
    int finish(const Checks& checks) const {
        if (!gpu) {
            printf("skipped: no GPU (the CPU side took %.1f s)\n", seconds());
            return 0;
        }
        printf("%.1f s in all\n", seconds());
        return checks.exit_code();
    }
};

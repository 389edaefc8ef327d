// Shared by the dev/cuda kernel checks (and test/test_cuda_kernels.cu): device buffers filled from host
// vectors, bf16 rounding so the CPU reference sees exactly the GPU's inputs, tolerance checks, timing with CUDA
// events, and the two ceilings a kernel's speed is quoted against: device-to-device copy bandwidth for
// memory-bound kernels, a large cuBLASLt bf16 GEMM for compute-bound ones.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

// ------------------------------------------------------------------------------------------------------------
// inputs and buffers

// values drawn from N(0, scale²) and rounded to bf16, so the fp32 CPU reference and the bf16 GPU kernel start
// from identical numbers
inline std::vector<float> random_bf16_values(size_t n, Rng& rng, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = __bfloat162float(__float2bfloat16(rng.normal(0.0f, scale)));
    return v;
}

inline std::vector<float> round_to_bf16(std::vector<float> v) {
    for (auto& x : v) x = __bfloat162float(__float2bfloat16(x));
    return v;
}

// a device allocation that frees itself; poisoned with 0xFF bytes (NaN in bf16 and fp32) until written
template <typename T>
struct DeviceArray {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceArray(size_t count) : n(count) {
        cuda_check(cudaMalloc(&ptr, n * sizeof(T) + 16));
        poison();
    }
    ~DeviceArray() { cudaFree(ptr); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    void poison() { cuda_check(cudaMemset(ptr, 0xFF, n * sizeof(T))); }
    size_t bytes() const { return n * sizeof(T); }
};

inline void upload(DeviceArray<bf16>& dst, const std::vector<float>& src) {
    std::vector<bf16> tmp(src.size());
    for (size_t i = 0; i < src.size(); i++) tmp[i] = __float2bfloat16(src[i]);
    cuda_check(cudaMemcpy(dst.ptr, tmp.data(), tmp.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}

template <typename T>
inline void upload(DeviceArray<T>& dst, const std::vector<T>& src) {
    cuda_check(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

inline std::vector<float> download(const DeviceArray<bf16>& src) {
    std::vector<bf16> tmp(src.n);
    cuda_check(cudaMemcpy(tmp.data(), src.ptr, src.bytes(), cudaMemcpyDeviceToHost));
    std::vector<float> out(src.n);
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
    for (size_t i = 0; i < gpu.size(); i++) {
        double err = fabs((double)gpu[i] - (double)cpu[i]);
        double ratio = err / (atol + rtol * fabs((double)cpu[i]));
        if (std::isnan(err)) err = ratio = INFINITY;
        c.max_abs = fmax(c.max_abs, err);
        c.worst_ratio = fmax(c.worst_ratio, ratio);
    }
    return c;
}

// tol is relative, to each element and (as the absolute floor) to the reference's RMS, so sums that cancel to
// near zero are judged on the scale of their terms
inline Comparison compare_rms(const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    double sq = 0.0;
    for (float x : cpu) sq += (double)x * x;
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

// mean milliseconds per call of f over reps calls, after warmup calls
template <typename F>
inline float time_ms(F&& f, int reps = 20, int warmup = 3) {
    for (int i = 0; i < warmup; i++) f();
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start));
    cuda_check(cudaEventCreate(&stop));
    cuda_check(cudaEventRecord(start));
    for (int i = 0; i < reps; i++) f();
    cuda_check(cudaEventRecord(stop));
    cuda_check(cudaEventSynchronize(stop));
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, start, stop));
    cuda_check(cudaEventDestroy(start));
    cuda_check(cudaEventDestroy(stop));
    return ms / reps;
}

// GB/s of a 1 GiB device-to-device copy, counting its read and its write
inline double copy_bandwidth_gbs() {
    static double gbs = [] {
        size_t bytes = (size_t)1 << 30;
        DeviceArray<char> a(bytes), b(bytes);
        float ms = time_ms([&] { cuda_check(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); }, 10);
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
        float ms = time_ms([&] { matmul_forward_cuda(c.ptr, a.ptr, b.ptr, nullptr, n, n, n, nullptr, 0); }, 10);
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

// every program starts with this: no GPU is not a failure, so CI without one stays green
#define SKIP_WITHOUT_GPU()                 \
    do {                                   \
        if (!cuda_device_available()) {    \
            printf("skipped: no GPU\n");   \
            return 0;                      \
        }                                  \
    } while (0)

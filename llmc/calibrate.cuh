// --calibrate FILE: measures the figures of a hardware profile (llmc/hardware.h) on the machine it runs on, with
// the trainer's own layer entry points on the run's device, so that the step-time model prices a layout with
// what this build achieves here rather than with data-sheet numbers:
//   matmul_tflops     matmul_forward, M rows by n by n, at each size n of the base profile's list
//   fp8_matmul_tflops on a GPU with FP8 tensor cores, cuBLASLt's E4M3 GEMM of the same shapes (the casts that
//                     precede it in a run are priced as memory passes)
//   fp8_blockwise_matmul_tflops, mxfp8_matmul_tflops  the block recipes' GEMMs of the same shapes (those whose sum
//                     is whole tiles) with the forward's scale modes, where the GPU runs the recipe
//   fp8_recipes       the recipes the GPU runs (fp8_gpu_problem)
//   attention_tflops  causal attention forward and backward (B sequences of T tokens, 12 heads of 64)
//   memory_gbps       a residual sum and AdamW over buffers far larger than the caches
//   transcendental_gbps  GELU forward and backward, over the same buffers
//   launch_us         a residual sum of 256 elements: what a call costs when it has almost nothing to do
//   intra_gbps ...    under mpirun, an all-reduce's bus bandwidth (2(n-1)/n of the bytes per second) and the
//                     time of a one-element all-reduce; across nodes these are the inter-node figures
// Every rank measures at once, as the ranks of a run compute at once; rank 0's figures are written. The rest
// (memory, peak, per-node devices, overlap, the other link) come from the base profile. calibrate() is the
// command train_gpt runs for the flag: it measures and writes the profile file, and trains nothing.
//
// With --from-profile P (a --profile file, llmc/profile_report.h) it measures nothing: it fits the profile P's
// prediction was priced with to what P measured, one ratio per kind of rate: the compute rates (matmuls,
// attention, the transcendental kernels) by predicted over measured compute, memory_gbps by the optimizer's
// (AdamW and the norm stream memory), the node's link by the communication's exposed time (dp, tp, cp and ep
// together: a profile of one node's run, whose groups cross no other link). One pass, not a solve: the element-wise
// kernels inside compute are priced at memory_gbps, so the fitted compute moves a little with the memory rate.
#pragma once

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/checksum.h"
#include "llmc/comm.cuh"
#include "llmc/device.cuh"
#include "llmc/fp8.cuh"
#include "llmc/gelu.cuh"
#include "llmc/hardware.h"
#include "llmc/json.h"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/options.h"
#include "llmc/planner.h"
#include "llmc/residual.cuh"
#include "llmc/tp.cuh"

// seconds per call of f on the device's clock: after a call that warms it up, groups of 1, 2, 4, ... calls
// (synchronized at their ends only) until a group lasts half a second; or exactly `calls` calls, which
// collectives need, since every rank must make as many
template <typename floatX, typename F>
inline double seconds_per_call(F f, long calls = 0) {
    f();
    device_synchronize<floatX>();
    const bool fixed = calls > 0;
    for (long n = fixed ? calls : 1;; n *= 2) {
        double start = now_seconds();
        for (long i = 0; i < n; i++) f();
        device_synchronize<floatX>();
        double elapsed = now_seconds() - start;
        if (fixed || elapsed >= 0.5) return elapsed / n;
    }
}

template <typename floatX>
inline void fill_random(floatX* p, size_t n, uint64_t seed) {
    Rng rng(seed);
    std::vector<float> host(n);
    for (float& x : host) x = rng.uniform() * 2.0f - 1.0f;
    upload_from_float(p, host.data(), n);
}

// attention: the GPU's kernels that the model would run (--attention)
template <typename floatX>
inline HardwareProfile calibrate_hardware(const HardwareProfile& base, Comm& world, bool one_node,
                                          AttentionKernels attention) {
    constexpr bool gpu = device_of<floatX> == Device::CUDA;
    HardwareProfile h = base;
    Ledger led;
    const int threads = omp_get_max_threads();
    // matmul: rows enough to keep every core or SM busy, and at least the largest size, so that n is the smallest
    // dimension of every GEMM measured (the sizes are sorted)
    const long largest = (long)base.matmul_tflops.back().first, rows = std::max(gpu ? 16384L : 2048L, largest);
    floatX* a = led.alloc<floatX, floatX>(MEM_SCRATCH, rows * largest);
    floatX* w = led.alloc<floatX, floatX>(MEM_SCRATCH, largest * largest);
    floatX* out = led.alloc<floatX, floatX>(MEM_SCRATCH, rows * largest);
    fill_random(a, rows * largest, 1), fill_random(w, largest * largest, 2);
    size_t panels = gpu ? 0 : gemm_workspace_floats(threads);  // the CPU's packing panels (cuBLASLt keeps its own)
    Workspace workspace{panels ? led.alloc<floatX, float>(MEM_SCRATCH, panels) : nullptr, panels};
    for (auto& [size, rate] : h.matmul_tflops) {
        long n = (long)size;
        double s = seconds_per_call<floatX>([&] { matmul_forward(out, a, w, nullptr, rows, n, n, workspace); });
        rate = 2.0 * rows * n * n / s / 1e12;
    }
    if constexpr (gpu) {
        h.fp8_matmul_tflops.clear(), h.fp8_blockwise_matmul_tflops.clear(), h.mxfp8_matmul_tflops.clear();
        h.fp8_recipes.clear();
        for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8})
            if (fp8_gpu_problem(r).empty()) h.fp8_recipes.push_back(fp8_recipe_name(r));
        if (fp8_gpu_problem().empty()) {
            uint8_t* a8 = led.alloc<floatX, uint8_t>(MEM_SCRATCH, rows * largest);
            uint8_t* w8 = led.alloc<floatX, uint8_t>(MEM_SCRATCH, largest * largest);
            float* ones = led.alloc<floatX, float>(MEM_SCRATCH, 2);  // a scale and its inverse, both 1: the GEMM reads the first, 256-byte aligned
            const float one_one[2] = {1.0f, 1.0f};
            device_upload<floatX>(ones, one_one, 2);
            fp8_quantize(a8, nullptr, a, rows, largest, 0, ones, Fp8Format::E4M3);
            fp8_quantize(w8, nullptr, w, largest, largest, 0, ones, Fp8Format::E4M3);
            for (auto [size, rate] : h.matmul_tflops) {
                long n = (long)size;
                double s = seconds_per_call<floatX>([&] {
                    fp8_gemm(out, {w8, Fp8Format::E4M3, ones}, {a8, Fp8Format::E4M3, ones}, n, rows, n, 0.0f,
                             CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Forward);
                });
                h.fp8_matmul_tflops.push_back({size, 2.0 * rows * n * n / s / 1e12});
            }
            // The block recipes' GEMMs, as the forward runs them: the weight's codes (blockwise: in 128x128 blocks) and
            // the input's (tiles along the sum), cast once per size so that their scales are laid out for it; sizes
            // whose sum is no whole tile have no such GEMM. A recipe cuBLASLt refuses at some shape here keeps no rates
            // (its GEMMs are then priced at the FP8 rate) and is said so.
            for (Fp8Recipe r : {Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8}) {
                if (!fp8_gpu_problem(r).empty()) continue;
                auto& points = r == Fp8Recipe::Blockwise ? h.fp8_blockwise_matmul_tflops : h.mxfp8_matmul_tflops;
                const bool blocks = r == Fp8Recipe::Blockwise;
                const int mode_w = blocks ? FP8_SCALE_BLK128 : FP8_SCALE_VEC32_E8M0;
                const int mode_a = blocks ? FP8_SCALE_VEC128 : FP8_SCALE_VEC32_E8M0;
                void* w_scales = led.alloc<floatX, uint8_t>(MEM_SCRATCH, fp8_scale_bytes(r, blocks, largest, largest));
                void* a_scales = led.alloc<floatX, uint8_t>(MEM_SCRATCH, fp8_scale_bytes(r, false, rows, largest));
                try {
                    for (auto [size, rate] : h.matmul_tflops) {
                        long n = (long)size;
                        if (n % fp8_tile(r) != 0) continue;
                        fp8_quantize_tiled(w8, w_scales, w, n, n, 0, false, blocks, r);
                        fp8_quantize_tiled(a8, a_scales, a, rows, n, 0, false, false, r);
                        Fp8Matrix weight{w8, Fp8Format::E4M3, w_scales, mode_w};
                        Fp8Matrix input{a8, Fp8Format::E4M3, a_scales, mode_a};
                        double s = seconds_per_call<floatX>([&] {
                            fp8_gemm(out, weight, input, n, rows, n, 0.0f, CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Forward);
                        });
                        points.push_back({size, 2.0 * rows * n * n / s / 1e12});
                    }
                } catch (const Error& e) {
                    printf("calibrate: no %s rates (%s)\n", fp8_recipe_name(r), e.what());
                    points.clear();
                }
            }
        }
    }
    // attention: the FLOPs step_time.h counts, 2·B·T·T·C forward and 2.5 times that backward
    {
        const int B = gpu ? 16 : 2, T = gpu ? 1024 : 256, C = 768, NH = 12;
        size_t BT = (size_t)B * T;
        floatX* qkv = led.alloc<floatX, floatX>(MEM_SCRATCH, BT * 3 * C);
        floatX* att_out = led.alloc<floatX, floatX>(MEM_SCRATCH, BT * C);
        floatX* dout = led.alloc<floatX, floatX>(MEM_SCRATCH, BT * C);
        floatX* dqkv = led.alloc<floatX, floatX>(MEM_SCRATCH, BT * 3 * C);
        float* kept = led.alloc<floatX, float>(MEM_SCRATCH, (size_t)B * NH * T * (gpu ? 1 : T));
        // the CPU's rows, or the GPU's workspace (D)
        size_t scratch_floats = gpu ? attention_backward_scratch_floats(B, T, C, NH) : (size_t)threads * T;
        float* scratch = led.alloc<floatX, float>(MEM_SCRATCH, scratch_floats);
        fill_random(qkv, BT * 3 * C, 3), fill_random(dout, BT * C, 4);
        double s = seconds_per_call<floatX>([&] {
            attention_forward(att_out, kept, qkv, B, T, C, NH, NH, attention);
            attention_backward(dqkv, dout, qkv, att_out, kept, B, T, C, NH, NH, scratch, {scratch, scratch_floats},
                               attention);
        });
        h.attention_tflops = 3.5 * 2.0 * B * T * (double)T * C / s / 1e12;
    }
    // the element-wise kernels. Streaming: a residual sum reads two values and writes one; AdamW reads a
    // parameter, its gradient and two moments and writes three, 28 bytes (on the GPU with the master weight
    // beside the bf16 parameter, also 28). Transcendental: GELU forward reads one value and writes one, its
    // backward reads two and writes one.
    {
        const long N = gpu ? (256L << 20) : (16L << 20);
        floatX* x = led.alloc<floatX, floatX>(MEM_SCRATCH, N);
        floatX* y = led.alloc<floatX, floatX>(MEM_SCRATCH, N);
        floatX* dy = led.alloc<floatX, floatX>(MEM_SCRATCH, N);
        float* master = gpu ? led.alloc<floatX, float>(MEM_SCRATCH, N) : nullptr;
        float* moment1 = led.alloc<floatX, float>(MEM_SCRATCH, N);
        float* moment2 = led.alloc<floatX, float>(MEM_SCRATCH, N);
        fill_random(x, N, 5), fill_random(dy, N, 6);
        double residual = seconds_per_call<floatX>([&] { residual_forward(y, x, dy, N); });
        double adamw = seconds_per_call<floatX>(
            [&] { adamw_update(y, master, dy, moment1, moment2, N, 1e-4f, 0.0f, 1.0f, 1, 1337, 0); });
        h.memory_gbps = (3.0 * N * sizeof(floatX) + 28.0 * N) / (residual + adamw) / 1e9;
        double gelu = seconds_per_call<floatX>([&] {
            gelu_forward(y, x, N);
            gelu_backward(dy, x, y, N);
        });
        h.transcendental_gbps = 5.0 * N * sizeof(floatX) / gelu / 1e9;
        h.launch_us = seconds_per_call<floatX>([&] { residual_forward(y, x, dy, 256); }) * 1e6;
    }
    // the collectives, when there are other ranks to talk to
    if (world.size > 1) {
        const size_t count = gpu ? (64u << 20) : (4u << 20);
        floatX* buf = led.alloc<floatX, floatX>(MEM_COMM, count);
        fill_random(buf, count, 7);
        auto all_reduce = [&](size_t n) { world.wait(world.all_reduce(buf, buf, n, dtype_of<floatX>())); };
        double s = seconds_per_call<floatX>([&] { all_reduce(count); }, 10);
        double bus = 2.0 * (world.size - 1) / world.size * count * sizeof(floatX) / s / 1e9;
        double latency = seconds_per_call<floatX>([&] { all_reduce(1); }, 1000) * 1e6;
        (one_node ? h.intra_gbps : h.inter_gbps) = bus;
        (one_node ? h.intra_latency_us : h.inter_latency_us) = latency;
    }
    return h;
}

// the profile's text written whole (a failed run leaves no half file), and printed
inline void write_calibrated(const std::string& path, const std::string& text) {
    write_file_whole(path, text);
    printf("%s", text.c_str());
}

// the ratios --from-profile scales a profile's rates by: predicted over measured, 1 where either is none
struct ProfileFit {
    double compute = 1.0, memory = 1.0, link = 1.0;
};
inline ProfileFit profile_fit(const JsonValue& measured, const JsonValue& predicted) {
    auto ratio = [](double p, double m) { return p > 0.0 && m > 0.0 ? p / m : 1.0; };
    double comm_p = 0.0, comm_m = 0.0;
    for (const char* kind : {"dp", "tp", "cp", "ep"})
        comm_p += predicted.at(kind).as_double(), comm_m += measured.at(kind).as_double();
    return {ratio(predicted.at("compute").as_double(), measured.at("compute").as_double()),
            ratio(predicted.at("optimizer").as_double(), measured.at("optimizer").as_double()), ratio(comm_p, comm_m)};
}
inline HardwareProfile fitted_hardware(HardwareProfile h, const ProfileFit& fit) {
    for (HardwareProfile::Points* points : {&h.matmul_tflops, &h.fp8_matmul_tflops, &h.fp8_blockwise_matmul_tflops,
                                            &h.mxfp8_matmul_tflops})
        for (auto& point : *points) point.second *= fit.compute;
    h.attention_tflops *= fit.compute;
    h.transcendental_gbps *= fit.compute;
    h.memory_gbps *= fit.memory;
    h.intra_gbps *= fit.link;
    return h;
}

// --calibrate FILE --from-profile P: the profile P was predicted with (--hardware's, else the one P names), fitted to
// what P measured, written to FILE
inline int calibrate_from_profile(const Options& o) {
    JsonDoc doc = JsonDoc::from_file(o.from_profile);
    const JsonValue& components = doc.root.at("components");
    if (components.at("predicted").is_null())
        fail("--from-profile %s: holds no prediction (its run found no hardware profile: give it --hardware FILE)",
             o.from_profile.c_str());
    std::string base_path = !o.hardware.empty() ? o.hardware : components.at("hardware").as_string();
    HardwareProfile base = load_hardware(base_path);
    ProfileFit fit = profile_fit(components.at("measured"), components.at("predicted"));
    HardwareProfile h = fitted_hardware(base, fit);
    h.name = base.name.substr(0, base.name.find(" (fitted to ")) + " (fitted to " + o.from_profile + ")";
    write_calibrated(o.calibrate, strfmt("# fitted by train_gpt --calibrate --from-profile %s to %s: compute rates x%.4f, "
                                         "memory x%.4f, the node's link x%.4f\n", o.from_profile.c_str(),
                                         base_path.c_str(), fit.compute, fit.memory, fit.link) + format_hardware(h));
    return 0;
}

// --calibrate FILE: this machine's hardware profile, measured (calibrate_hardware) on top of the --hardware
// profile's figures, the GPU's attention on the kernels --attention chose (`attention`); rank 0 writes it under a
// temporary name and renames it, so a failed run leaves no half file
inline int calibrate(const Options& o, Device dev, const CommSettings& comm, AttentionKernels attention) {
    HardwareProfile base;
    std::string base_path;
    if (!plan_hardware(o, dev, base, base_path))
        fail("--calibrate %s: no base profile at %s (give --hardware FILE, e.g. one of dev/hardware/)", o.calibrate.c_str(),
             base_path.c_str());
    if (dev == Device::CUDA) select_gpu();
    Comm world = comm_world(comm);
    if (dev == Device::CUDA) world.compute_stream = main_stream();
    // the collectives' figures are the node's links when every rank runs on this rank's host
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    Fnv1a64 hash;
    hash.update(host, strlen(host));
    double mine;  // the hash's bits, as the one 8-byte type the communicators move
    memcpy(&mine, &hash.value, sizeof(mine));
    std::vector<double> hosts(world.size);
    world.wait(world.all_gather(&mine, hosts.data(), 1, DType::F64));
    bool one_node = std::all_of(hosts.begin(), hosts.end(), [&](double h) { return memcmp(&h, &mine, 8) == 0; });
    HardwareProfile h = dev == Device::CUDA ? calibrate_hardware<bf16>(base, world, one_node, attention)
                                            : calibrate_hardware<float>(base, world, one_node, attention);
    comm_finalize(world);
    if (world.rank != 0) return 0;
    // a profile calibrated before names the host it was measured on: the new measurement replaces that note
    std::string name = base.name.substr(0, base.name.find(" (calibrated on "));
    h.name = name + strfmt(" (calibrated on %s, %d rank%s)", host, world.size, world.size == 1 ? "" : "s");
    write_calibrated(o.calibrate, "# measured by train_gpt --calibrate from " + base_path + "\n" + format_hardware(h));
    return 0;
}

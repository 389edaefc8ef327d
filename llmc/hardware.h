// A hardware profile: the figures the step-time model (llmc/step_time.h) prices a layout with. One small text
// file per machine (dev/hardware/), public figures by default, remeasured where it runs by --calibrate.
//
// The file holds one "key value" line per figure; '#' starts a comment. Rates are what kernels achieve, not the
// data sheet's peaks (those only enter MFU): a matmul's rate depends on its smallest dimension, so the profile
// lists it at a few sizes and the model interpolates between them in log2 of the size.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "llmc/utils.h"

struct HardwareProfile {
    std::string name;
    std::string device = "cuda";  // the precision its figures are for: cuda (bf16) or cpu (fp32)
    double memory_gib = 0;        // per device (per rank on a CPU)
    double reserved_mib = 0;      // per device, outside the ledger: the CUDA context, NCCL's buffers, fragmentation
    int devices_per_node = 1;     // GPUs per node (cores per node on a CPU, one rank per core)
    double peak_tflops = 0;       // the data sheet's dense peak, for MFU
    std::vector<std::pair<double, double>> matmul_tflops;  // (smallest dimension, achieved TFLOP/s), ascending
    // the same for FP8 GEMMs (--fp8 1, llmc/fp8.cuh); optional: without it FP8 matmuls are priced as bf16's
    std::vector<std::pair<double, double>> fp8_matmul_tflops;
    double attention_tflops = 0;  // causal attention, forward and backward, over the FLOPs they do
    double memory_gbps = 0;       // streaming kernels (residual, layernorm, AdamW): bytes read and written per second
    // the kernels that take a tanh or exp per element (GELU, the cross-entropy's softmax): bound by memory on a
    // GPU, by arithmetic on a CPU
    double transcendental_gbps = 0;
    double launch_us = 0;                         // fixed cost of each kernel or layer op
    double intra_gbps = 0, intra_latency_us = 0;  // a collective within a node: bus bandwidth, latency per call
    double inter_gbps = 0, inter_latency_us = 0;  // ... across nodes
    double overlap = 1.0;  // the share of overlappable communication the backend hides behind compute

    // achieved matmul TFLOP/s for a GEMM whose smallest dimension is n, bf16 or FP8
    double matmul_rate(double n, bool fp8 = false) const {
        const auto& pts = fp8 && !fp8_matmul_tflops.empty() ? fp8_matmul_tflops : matmul_tflops;
        if (n <= pts.front().first) return pts.front().second;
        if (n >= pts.back().first) return pts.back().second;
        size_t i = 1;
        while (pts[i].first < n) i++;
        double x0 = std::log2(pts[i - 1].first), x1 = std::log2(pts[i].first), x = std::log2(n);
        return pts[i - 1].second + (pts[i].second - pts[i - 1].second) * (x - x0) / (x1 - x0);
    }
};

// The keys of a profile file and where each goes; every one is required, matmul_tflops at least once,
// fp8_matmul_tflops as often as wanted.
inline HardwareProfile parse_hardware(const std::string& text, const std::string& path) {
    HardwareProfile h;
    std::map<std::string, double*> reals = {
        {"memory_gib", &h.memory_gib},
        {"reserved_mib", &h.reserved_mib},
        {"peak_tflops", &h.peak_tflops},
        {"attention_tflops", &h.attention_tflops},
        {"memory_gbps", &h.memory_gbps},
        {"transcendental_gbps", &h.transcendental_gbps},
        {"launch_us", &h.launch_us},
        {"intra_gbps", &h.intra_gbps},
        {"intra_latency_us", &h.intra_latency_us},
        {"inter_gbps", &h.inter_gbps},
        {"inter_latency_us", &h.inter_latency_us},
        {"overlap", &h.overlap},
    };
    std::map<std::string, int> seen;
    double devices = 0;
    size_t start = 0;
    for (int line_no = 1; start <= text.size(); line_no++) {
        size_t end = text.find('\n', start);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(start, end - start);
        start = end + 1;
        line = line.substr(0, line.find('#'));
        size_t a = line.find_first_not_of(" \t\r");
        if (a == std::string::npos) continue;
        size_t b = line.find_first_of(" \t", a);
        std::string key = line.substr(a, b == std::string::npos ? std::string::npos : b - a);
        std::string value = b == std::string::npos ? "" : line.substr(b);
        value.erase(0, value.find_first_not_of(" \t"));
        value.erase(value.find_last_not_of(" \t\r") + 1);
        auto number = [&](const std::string& s) {
            char* stop;
            double v = strtod(s.c_str(), &stop);
            if (s.empty() || *stop != '\0' || !std::isfinite(v) || v < 0)
                fail("%s:%d: %s: expected a non-negative number, got '%s'", path.c_str(), line_no, key.c_str(),
                     s.c_str());
            return v;
        };
        bool list = key == "matmul_tflops" || key == "fp8_matmul_tflops";
        if (++seen[key] > 1 && !list)
            fail("%s:%d: %s given twice", path.c_str(), line_no, key.c_str());
        if (key == "name") {
            h.name = value;
        } else if (key == "device") {
            if (value != "cuda" && value != "cpu") fail("%s:%d: device: expected cuda or cpu", path.c_str(), line_no);
            h.device = value;
        } else if (key == "devices_per_node") {
            devices = number(value);
        } else if (list) {
            size_t gap = value.find_first_of(" \t");
            if (gap == std::string::npos) fail("%s:%d: %s: expected SIZE TFLOPS", path.c_str(), line_no, key.c_str());
            std::string rest = value.substr(gap);
            rest.erase(0, rest.find_first_not_of(" \t"));
            auto& points = key == "matmul_tflops" ? h.matmul_tflops : h.fp8_matmul_tflops;
            points.push_back({number(value.substr(0, gap)), number(rest)});
        } else if (reals.count(key)) {
            *reals[key] = number(value);
        } else {
            fail("%s:%d: unknown key '%s'", path.c_str(), line_no, key.c_str());
        }
    }
    for (const char* key : {"name", "device", "devices_per_node"})
        if (!seen.count(key)) fail("%s: missing '%s'", path.c_str(), key);
    for (auto& [key, field] : reals)
        if (!seen.count(key)) fail("%s: missing '%s'", path.c_str(), key.c_str());
    if (h.matmul_tflops.empty()) fail("%s: missing 'matmul_tflops SIZE TFLOPS'", path.c_str());
    std::sort(h.matmul_tflops.begin(), h.matmul_tflops.end());
    std::sort(h.fp8_matmul_tflops.begin(), h.fp8_matmul_tflops.end());
    h.devices_per_node = (int)devices;
    if (h.devices_per_node < 1 || devices != h.devices_per_node)
        fail("%s: devices_per_node: expected a whole number of at least 1", path.c_str());
    std::vector<std::pair<double, double>> points = h.matmul_tflops;
    points.insert(points.end(), h.fp8_matmul_tflops.begin(), h.fp8_matmul_tflops.end());
    for (auto [size, rate] : points)
        if (size < 1 || rate <= 0)
            fail("%s: matmul_tflops %g %g: sizes and rates must be positive", path.c_str(), size, rate);
    for (double rate : {h.attention_tflops, h.memory_gbps, h.transcendental_gbps, h.intra_gbps, h.inter_gbps,
                        h.peak_tflops, h.memory_gib})
        if (rate <= 0) fail("%s: every rate, bandwidth, peak and memory must be positive", path.c_str());
    if (h.overlap > 1) fail("%s: overlap %g: a share, at most 1", path.c_str(), h.overlap);
    return h;
}

inline HardwareProfile load_hardware(const std::string& path) {
    File f(path, "rb");
    return parse_hardware(f.read_all(), path);
}

// the profile as a file parse_hardware reads back
inline std::string format_hardware(const HardwareProfile& h) {
    std::string s =
        strfmt("name %s\ndevice %s\nmemory_gib %g\nreserved_mib %g\ndevices_per_node %d\npeak_tflops %g\n",
               h.name.c_str(), h.device.c_str(), h.memory_gib, h.reserved_mib, h.devices_per_node, h.peak_tflops);
    for (auto [size, rate] : h.matmul_tflops) s += strfmt("matmul_tflops %g %.4g\n", size, rate);
    for (auto [size, rate] : h.fp8_matmul_tflops) s += strfmt("fp8_matmul_tflops %g %.4g\n", size, rate);
    s += strfmt("attention_tflops %.4g\nmemory_gbps %.4g\ntranscendental_gbps %.4g\nlaunch_us %.3g\n",
                h.attention_tflops, h.memory_gbps, h.transcendental_gbps, h.launch_us);
    s += strfmt("intra_gbps %.4g\nintra_latency_us %.3g\ninter_gbps %.4g\ninter_latency_us %.3g\noverlap %g\n",
                h.intra_gbps, h.intra_latency_us, h.inter_gbps, h.inter_latency_us, h.overlap);
    return s;
}

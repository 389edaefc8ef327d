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
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "llmc/utils.h"

// the FP8 recipes (--fp8-recipe) by name, in llmc/fp8_blocks.cuh's order
inline const std::vector<std::string>& fp8_recipe_names() {
    static const std::vector<std::string> names = {"tensorwise", "blockwise", "mxfp8"};
    return names;
}

struct HardwareProfile {
    using Points = std::vector<std::pair<double, double>>;  // (smallest dimension, achieved TFLOP/s), ascending
    std::string name;
    std::string device = "cuda";  // the precision its figures are for: cuda (bf16) or cpu (fp32)
    double memory_gib = 0;        // per device (per rank on a CPU)
    double reserved_mib = 0;      // per device, outside the ledger: the CUDA context, NCCL's buffers, fragmentation
    int devices_per_node = 1;     // GPUs per node (cores per node on a CPU, one rank per core)
    double peak_tflops = 0;       // the data sheet's dense peak, for MFU
    Points matmul_tflops;
    // the same for FP8 GEMMs (--fp8 1, llmc/fp8.cuh): tensorwise's, one scale per operand; optional: without it FP8
    // matmuls are priced as bf16's
    Points fp8_matmul_tflops;
    // the block-scaled recipes' GEMMs (llmc/fp8_blocks.cuh), where they run at a rate of their own: blockwise's on
    // Hopper (cuBLASLt's 1x128 and 128x128 scales, applied in the main loop, fp32 accumulation throughout) and mxfp8's
    // on Blackwell (scales in the tensor cores); optional: without them a recipe's GEMMs are priced at the FP8 rate
    Points fp8_blockwise_matmul_tflops, mxfp8_matmul_tflops;
    // the recipes this GPU runs (fp8_gpu_problem in llmc/fp8.cuh says which); without the key, tensorwise where the
    // profile gives FP8 rates and none elsewhere. A CPU profile runs every recipe: the CPU emulates each.
    std::vector<std::string> fp8_recipes;
    double attention_tflops = 0;  // causal attention, forward and backward, over the FLOPs they do
    double memory_gbps = 0;       // streaming kernels (residual, layernorm, AdamW): bytes read and written per second
    // the kernels that take a tanh or exp per element (GELU, the cross-entropy's softmax): bound by memory on a
    // GPU, by arithmetic on a CPU
    double transcendental_gbps = 0;
    double launch_us = 0;                         // fixed cost of each kernel or layer op
    double intra_gbps = 0, intra_latency_us = 0;  // a collective within a node: bus bandwidth, latency per call
    double inter_gbps = 0, inter_latency_us = 0;  // ... across nodes
    double overlap = 1.0;  // the share of overlappable communication the backend hides behind compute

    // the points of a recipe's GEMMs: its own where the profile gives them, else the FP8 rate's, else bf16's
    const Points& fp8_points(const std::string& recipe = "tensorwise") const {
        if (recipe == "blockwise" && !fp8_blockwise_matmul_tflops.empty()) return fp8_blockwise_matmul_tflops;
        if (recipe == "mxfp8" && !mxfp8_matmul_tflops.empty()) return mxfp8_matmul_tflops;
        return fp8_matmul_tflops.empty() ? matmul_tflops : fp8_matmul_tflops;
    }
    // whether the device runs a recipe
    bool runs(const std::string& recipe) const {
        return device == "cpu" || std::find(fp8_recipes.begin(), fp8_recipes.end(), recipe) != fp8_recipes.end();
    }
    // the recipes the device runs, in fp8_recipe_names' order
    std::vector<std::string> recipes_run() const {
        std::vector<std::string> r;
        for (const std::string& name : fp8_recipe_names())
            if (runs(name)) r.push_back(name);
        return r;
    }

    // achieved matmul TFLOP/s for a GEMM whose smallest dimension is n: bf16's, or an FP8 recipe's
    double matmul_rate(double n, bool fp8 = false, const std::string& recipe = "tensorwise") const {
        const Points& pts = fp8 ? fp8_points(recipe) : matmul_tflops;
        if (n <= pts.front().first) return pts.front().second;
        if (n >= pts.back().first) return pts.back().second;
        size_t i = 1;
        while (pts[i].first < n) i++;
        double x0 = std::log2(pts[i - 1].first), x1 = std::log2(pts[i].first), x = std::log2(n);
        return pts[i - 1].second + (pts[i].second - pts[i - 1].second) * (x - x0) / (x1 - x0);
    }
};

// The keys of a profile file and where each goes; every one is required, matmul_tflops at least once,
// fp8_matmul_tflops, fp8_blockwise_matmul_tflops and mxfp8_matmul_tflops as often as wanted, fp8_recipes (the recipes'
// names, on one line) at most once, naming every recipe whose rates the profile gives.
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
        std::map<std::string, std::vector<std::pair<double, double>>*> lists = {
            {"matmul_tflops", &h.matmul_tflops},
            {"fp8_matmul_tflops", &h.fp8_matmul_tflops},
            {"fp8_blockwise_matmul_tflops", &h.fp8_blockwise_matmul_tflops},
            {"mxfp8_matmul_tflops", &h.mxfp8_matmul_tflops},
        };
        bool list = lists.count(key) > 0;
        if (++seen[key] > 1 && !list)
            fail("%s:%d: %s given twice", path.c_str(), line_no, key.c_str());
        if (key == "name") {
            h.name = value;
        } else if (key == "device") {
            if (value != "cuda" && value != "cpu") fail("%s:%d: device: expected cuda or cpu", path.c_str(), line_no);
            h.device = value;
        } else if (key == "devices_per_node") {
            devices = number(value);
        } else if (key == "fp8_recipes") {
            std::istringstream words(value);
            for (std::string w; words >> w;) {
                const std::vector<std::string>& names = fp8_recipe_names();
                if (std::find(names.begin(), names.end(), w) == names.end())
                    fail("%s:%d: fp8_recipes: '%s' is no recipe (tensorwise, blockwise, mxfp8)", path.c_str(), line_no,
                         w.c_str());
                h.fp8_recipes.push_back(w);
            }
        } else if (list) {
            size_t gap = value.find_first_of(" \t");
            if (gap == std::string::npos) fail("%s:%d: %s: expected SIZE TFLOPS", path.c_str(), line_no, key.c_str());
            std::string rest = value.substr(gap);
            rest.erase(0, rest.find_first_not_of(" \t"));
            lists[key]->push_back({number(value.substr(0, gap)), number(rest)});
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
    const std::vector<HardwareProfile::Points*> fp8_lists = {&h.fp8_matmul_tflops, &h.fp8_blockwise_matmul_tflops,
                                                             &h.mxfp8_matmul_tflops};
    std::sort(h.matmul_tflops.begin(), h.matmul_tflops.end());
    for (auto* points : fp8_lists) std::sort(points->begin(), points->end());
    if (!seen.count("fp8_recipes") && !h.fp8_matmul_tflops.empty()) h.fp8_recipes = {"tensorwise"};
    if (h.device == "cuda" && !h.fp8_blockwise_matmul_tflops.empty() && !h.runs("blockwise"))
        fail("%s: fp8_blockwise_matmul_tflops: the rates of a recipe that fp8_recipes does not list", path.c_str());
    if (h.device == "cuda" && !h.mxfp8_matmul_tflops.empty() && !h.runs("mxfp8"))
        fail("%s: mxfp8_matmul_tflops: the rates of a recipe that fp8_recipes does not list", path.c_str());
    h.devices_per_node = (int)devices;
    if (h.devices_per_node < 1 || devices != h.devices_per_node)
        fail("%s: devices_per_node: expected a whole number of at least 1", path.c_str());
    std::vector<std::pair<double, double>> points = h.matmul_tflops;
    for (auto* more : fp8_lists) points.insert(points.end(), more->begin(), more->end());
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
    for (auto [size, rate] : h.fp8_blockwise_matmul_tflops)
        s += strfmt("fp8_blockwise_matmul_tflops %g %.4g\n", size, rate);
    for (auto [size, rate] : h.mxfp8_matmul_tflops) s += strfmt("mxfp8_matmul_tflops %g %.4g\n", size, rate);
    if (h.device == "cuda") {  // (a CPU runs every recipe)
        s += "fp8_recipes";
        for (const std::string& r : h.fp8_recipes) s += " " + r;
        s += "\n";
    }
    s += strfmt("attention_tflops %.4g\nmemory_gbps %.4g\ntranscendental_gbps %.4g\nlaunch_us %.3g\n",
                h.attention_tflops, h.memory_gbps, h.transcendental_gbps, h.launch_us);
    s += strfmt("intra_gbps %.4g\nintra_latency_us %.3g\ninter_gbps %.4g\ninter_latency_us %.3g\noverlap %g\n",
                h.intra_gbps, h.intra_latency_us, h.inter_gbps, h.inter_latency_us, h.overlap);
    return s;
}

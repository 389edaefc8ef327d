// Tests of the planner's time model and search: predict_step against step times counted by hand from the
// model's shapes and a profile of round figures (one rank; tp 2 × dp 2); the profile file's parser; --plan's
// predicted line; and --search, whose every layout --plan must say fits, while some it dropped do not, and
// which, given layout flags, finds exactly the full search's layouts that have their values.
#include <functional>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>

#include "llmc/gpt.cuh"
#include "llmc/hardware.h"
#include "llmc/planner.h"
#include "llmc/step_time.h"
#include "mpi_helpers.h"
#include "test_helpers.h"

namespace test_planner {

// round figures, each a different number, so that a term priced at the wrong rate shows
HardwareProfile round_profile() {
    HardwareProfile h;
    h.name = "round figures";
    h.device = "cpu";
    h.memory_gib = 1;
    h.devices_per_node = 8;
    h.peak_tflops = 1;
    h.matmul_tflops = {{1, 2.0}};  // 2 TFLOP/s at every size
    h.attention_tflops = 0.5;
    h.memory_gbps = 10;
    h.transcendental_gbps = 4;
    h.intra_gbps = 1, h.inter_gbps = 0.5;
    h.overlap = 0;
    return h;
}

const char* ROUND_PROFILE_FILE =
    "# a test profile\n"
    "name round figures\n"
    "device cpu\n"
    "memory_gib MEMORY\n"
    "reserved_mib 0\n"
    "devices_per_node 8\n"
    "peak_tflops 1\n"
    "matmul_tflops 1 2   # at every size\n"
    "attention_tflops 0.5\n"
    "memory_gbps 10\n"
    "transcendental_gbps 4\n"
    "launch_us 0\n"
    "intra_gbps 1\n"
    "intra_latency_us 0\n"
    "inter_gbps 0.5\n"
    "inter_latency_us 0\n"
    "overlap 0\n";

std::string round_profile_file(double memory_gib) {
    return std::regex_replace(ROUND_PROFILE_FILE, std::regex("MEMORY"), strfmt("%g", memory_gib));
}

// the model of both hand counts: L=2, C=64, two heads, maxT=16, V=Vp=128; B=2 sequences of T=16
const char* MODEL = "d2c64h2t16v128";
constexpr double L = 2, C = 64, maxT = 16, Vp = 128, B = 2, T = 16, X = 4;  // X: fp32 on the CPU

// one layer's and the ends' seconds per micro-batch on a rank with tp t (sp on when t > 1): matmuls at 2 TFLOP/s,
// attention at 0.5, streaming bytes at 10 GB/s, GELU and the cross-entropy at 4
struct HandCount {
    double forward, backward;  // the whole pass, weight gradients included in backward
};
HandCount hand_count(double t) {
    double BT = B * T, R = BT / t, Cl = C / t, Hl = 4 * C / t, Vl = Vp / t;
    double mm = 2 * BT * (3 * Cl * C + C * Cl + Hl * C + C * Hl) / 2e12;
    double attention = 2 * B * T * T * Cl / 0.5e12;
    double stream = X * 10 * R * C, gelu = X * 2 * BT * Hl;
    double layer_f = mm + attention + stream / 10e9 + gelu / 4e9;
    double layer_b = 2 * mm + 2.5 * attention + 2 * stream / 10e9 + 1.5 * gelu / 4e9;
    double embeddings = X * 3 * R * C / 10e9, classifier = 2 * BT * Vl * C / 2e12;
    double head_f = X * 4 * R * C / 10e9 + X * 3 * BT * Vl / 4e9 + classifier;
    double head_b = X * 6 * R * C / 10e9 + 2 * classifier;
    return {L * layer_f + embeddings + head_f, L * layer_b + embeddings + head_b};
}

TEST_CASE("predict_step on one rank equals a count by hand", "[planner]") {
    GPTConfig c = parse_model_descriptor(MODEL);
    HandCount h = hand_count(1);
    double psi = Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C;
    double optimizer = (28 + X) * psi / 10e9;  // AdamW's 28 bytes and the norm's read, per parameter
    double step = h.forward + h.backward + optimizer;
    StepTime s = predict_step(c, (int)B, (int)T, ParallelPlan{}, Device::CPU, round_profile(), 8);
    CHECK(s.seconds == Approx(step).epsilon(1e-12));
    CHECK(s.compute == Approx(step).epsilon(1e-12));
    CHECK(s.dp == 0.0);
    CHECK(s.tp == 0.0);
    CHECK(s.bubble == 0.0);
    CHECK(s.tokens_per_second == Approx(B * T / step).epsilon(1e-12));
    double flops_per_token = 6 * psi + 6 * L * C * T;  // llm.c's count
    CHECK(s.mfu == Approx(B * T * flops_per_token / (step * 1e12)).epsilon(1e-12));
}

TEST_CASE("predict_step under tp 2 with sp and dp 2 equals a count by hand", "[planner]") {
    GPTConfig c = parse_model_descriptor(MODEL);
    ParallelPlan par;
    par.dp = 2, par.tp = 2, par.sp = true;
    HandCount h = hand_count(2);
    // the rank's half of each split tensor: half the vocab rows, per layer 12C²/2 weights and 7C/2 biases
    double psi = Vp / 2 * C + maxT * C + L * (12 * C * C / 2 + 7 * C / 2 + 6 * C) + 2 * C;
    double optimizer = (28 + X) * psi / 10e9;
    // tp at 1 GB/s: per layer four crossings of (t-1)/t·BT·C values forward and four backward, and under sp two
    // more in backward (the norm outputs gathered again), one each way for the embeddings and for the head, and
    // the cross-entropy's three floats per token to the other rank
    double unit = 0.5 * B * T * C * X;
    double tp = (2 * (4 * L + 2) * unit + 2 * L * unit + B * T * 3 * 4) / 1e9;
    // dp at 1 GB/s, nothing hidden (overlap 0): every element reduce-scattered and all-gathered, half of it sent
    // each time (no padding: every bucket is even), and the norm (one double to the other rank) and the loss
    // (two doubles)
    double dp = (2 * 0.5 * psi * X + 8 + 16) / 1e9;
    StepTime s = predict_step(c, (int)B, (int)T, par, Device::CPU, round_profile(), 8);
    CHECK(s.compute == Approx(h.forward + h.backward + optimizer).epsilon(1e-12));
    CHECK(s.tp == Approx(tp).epsilon(1e-12));
    CHECK(s.dp == Approx(dp).epsilon(1e-12));
    CHECK(s.seconds == Approx(h.forward + h.backward + optimizer + tp + dp).epsilon(1e-12));
    CHECK(s.tokens_per_second == Approx(2 * B * T / s.seconds).epsilon(1e-12));
    // across nodes (one device per node) the same bytes cross at 0.5 GB/s: twice the time
    StepTime apart = predict_step(c, (int)B, (int)T, par, Device::CPU, round_profile(), 1);
    CHECK(apart.tp == Approx(2 * tp).epsilon(1e-12));
    CHECK(apart.dp == Approx(2 * dp).epsilon(1e-12));
}

TEST_CASE("predict_step with --fp8 1: the layers between the first and the last at the FP8 rate, plus their casts, "
          "by hand", "[planner][fp8]") {
    GPTConfig c = parse_model_descriptor("d4c64h2t16v128");  // MODEL with 4 layers: layers 1 and 2 in FP8
    HardwareProfile hw = round_profile();
    hw.fp8_matmul_tflops = {{1, 5.0}};  // 5 TFLOP/s at every size, against bf16's 2
    ParallelPlan plain, fp8;
    fp8.fp8 = true;
    double BT = B * T, mm = 0, mm8 = 0, casts = 0;
    // the four linear layers (out, in): qkv, the attention projection, fc, fc_proj; each cast reads X bytes
    // twice (the amax, then the cast) and, on the CPU, writes each cast value as a float: the input and the weight
    // forward, the output gradient (once for both gradients), the weight and the input again backward
    for (auto [out, in] : {std::pair<double, double>{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}}) {
        mm += 2 * BT * out * in / 2e12, mm8 += 2 * BT * out * in / 5e12;
        casts += ((2 * X + 4) * (BT * in + out * in) + (2 * X + 4) * BT * out + (2 * X + 4) * (out * in + BT * in)) / 10e9;
    }
    // forward, the input gradient and the weight gradient: three GEMMs of each shape in each of the 2 layers
    double saved = 2 * (3 * (mm - mm8) - casts);
    StepTime a = predict_step(c, (int)B, (int)T, plain, Device::CPU, hw, 8), b = predict_step(c, (int)B, (int)T, fp8, Device::CPU, hw, 8);
    CHECK(a.seconds - b.seconds == Approx(saved).epsilon(1e-9));
    CHECK(b.fp8_casts == Approx(2 * casts).epsilon(1e-9));
    CHECK(a.fp8_casts == 0.0);
    // without FP8 rates in the profile, FP8 GEMMs cost what bf16's do, and only the casts are added
    StepTime priced_as_bf16 = predict_step(c, (int)B, (int)T, fp8, Device::CPU, round_profile(), 8);
    CHECK(priced_as_bf16.seconds - a.seconds == Approx(2 * casts).epsilon(1e-9));
    // a model of 2 layers has none in FP8
    GPTConfig two = parse_model_descriptor(MODEL);
    CHECK(predict_step(two, (int)B, (int)T, fp8, Device::CPU, hw, 8).seconds ==
          predict_step(two, (int)B, (int)T, plain, Device::CPU, hw, 8).seconds);
}

TEST_CASE("predict_step prices each FP8 recipe on the GPU as llmc/fp8.cuh runs it: the casts' passes, padding, "
          "scales and kernels, the recipe's GEMM rate, by hand", "[planner][fp8]") {
    // GPT-2 with C = 128: every weight is whole tiles of 128 and of 32; B=2 sequences of T=40 make 80 rows, which the
    // weight gradient pads to 80 (tensorwise: 16), 128 (blockwise) or 96 (mxfp8). Layers 1 and 2 of 4 run in FP8.
    GPTConfig c = parse_model_descriptor("d4c128h2t64v128");
    const double C = 128, M = 2 * 40, X = 2, F = 4;  // bf16 values, fp32 scales
    HardwareProfile hw = round_profile();
    hw.launch_us = 1;  // each kernel 1 µs, so that the casts' kernels count
    hw.fp8_matmul_tflops = {{1, 5.0}}, hw.fp8_blockwise_matmul_tflops = {{1, 4.0}}, hw.mxfp8_matmul_tflops = {{1, 3.0}};
    hw.fp8_recipes = {"tensorwise", "blockwise", "mxfp8"};
    auto up = [](double n, double m) { return std::ceil(n / m) * m; };
    // the scales' bytes, as cuBLASLt lays them out for an operand of `rows` rows summed along k: blockwise's fp32 per
    // 1x128 tile (rows padded to 4) and per 128x128 block (a row of blocks padded to 4), mxfp8's byte per 1x32 tile
    // (rows padded to 128, tiles along k to 4)
    auto tiles128 = [&](double rows, double k) { return F * std::ceil(k / 128) * up(rows, 4); };
    auto blocks128 = [&](double rows, double k) { return F * std::ceil(rows / 128) * up(std::ceil(k / 128), 4); };
    auto tiles32 = [&](double rows, double k) { return up(rows, 128) * up(std::ceil(k / 32), 4); };
    struct Expected {
        const char* name;
        Fp8Recipe recipe;
        double rate, padded;
        std::function<double(double, double)> bytes;  // one weight's casts, forward and backward
        double kernels;                               // ... and their launches
    };
    std::vector<Expected> recipes = {
        // an amax pass and a cast pass each (2X read, a byte written): x and W forward; dout once for both gradients,
        // with its transposed copy (P rows), W again and x again (its transpose, P rows); four kernels a cast
        {"tensorwise", Fp8Recipe::Tensorwise, 5.0, up(M, 16),
         [&](double out, double in) {
             double P = up(M, 16);
             return (2 * X + 1) * (M * in + out * in) + (2 * X + 1) * M * out + P * out + (2 * X + 1) * out * in +
                    2 * X * M * in + P * in;
         },
         20},
        // one pass a cast (X read, a byte and the tile's scale written): x and W forward; dout along its rows and W
        // transposed (blocks) for the input's gradient; dout and x down their columns (P rows) for the weight's
        {"blockwise", Fp8Recipe::Blockwise, 4.0, up(M, 128),
         [&](double out, double in) {
             double P = up(M, 128);
             return (X + 1) * (M * in + out * in) + tiles128(M, in) + blocks128(out, in) +  // forward
                    (X + 1) * (M * out + out * in) + tiles128(M, out) + blocks128(in, out) +  // the input's gradient
                    X * M * (out + in) + P * (out + in) + tiles128(out, P) + tiles128(in, P);  // the weight's
         },
         6},
        {"mxfp8", Fp8Recipe::Mxfp8, 3.0, up(M, 32),
         [&](double out, double in) {
             double P = up(M, 32);
             return (X + 1) * (M * in + out * in) + tiles32(M, in) + tiles32(out, in) +
                    (X + 1) * (M * out + out * in) + tiles32(M, out) + tiles32(in, out) +
                    X * M * (out + in) + P * (out + in) + tiles32(out, P) + tiles32(in, P);
         },
         6},
    };
    ParallelPlan plain;
    StepTime bf16 = predict_step(c, 2, 40, plain, Device::CUDA, hw, 8);
    for (const Expected& e : recipes) {
        INFO(e.name);
        double saved = 0, casts = 0;
        for (auto [out, in] : {std::pair<double, double>{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}}) {
            double gemm = 2 * M * out * in / 2e12 + 1e-6;                              // bf16, with its launch
            double fp8 = 2 * (2 * M * out * in / (e.rate * 1e12) + 1e-6) +            // forward, the input's gradient
                         2 * e.padded * out * in / (e.rate * 1e12) + 1e-6;             // the weight's, padded rows
            double cast = e.bytes(out, in) / 10e9 + e.kernels * 1e-6;
            saved += 3 * gemm - fp8 - cast, casts += cast;
        }
        ParallelPlan par;
        par.fp8 = true, par.fp8_recipe = e.recipe;
        StepTime s = predict_step(c, 2, 40, par, Device::CUDA, hw, 8);
        CHECK(bf16.seconds - s.seconds == Approx(2 * saved).epsilon(1e-9));  // layers 1 and 2
        CHECK(s.fp8_casts == Approx(2 * casts).epsilon(1e-9));
        CHECK(s.compute == Approx(s.seconds).epsilon(1e-12));  // one rank: nothing but compute
    }
    // a recipe without rates of its own is priced at the FP8 rate: blockwise's GEMMs then cost tensorwise's
    HardwareProfile no_block = hw;
    no_block.fp8_blockwise_matmul_tflops.clear();
    ParallelPlan block, tensorwise;
    block.fp8 = tensorwise.fp8 = true, block.fp8_recipe = Fp8Recipe::Blockwise;
    StepTime at_own = predict_step(c, 2, 40, block, Device::CUDA, hw, 8),
             at_fp8 = predict_step(c, 2, 40, block, Device::CUDA, no_block, 8);
    CHECK(at_fp8.seconds < at_own.seconds);
    CHECK(at_fp8.fp8_casts == at_own.fp8_casts);
    // a weight that is not whole tiles runs in bf16, casts and all: at C = 64 blockwise takes none (the step is
    // bf16's to the bit), mxfp8 all (tiles of 32)
    GPTConfig narrow = parse_model_descriptor("d4c64h2t64v128");
    ParallelPlan mx = block;
    mx.fp8_recipe = Fp8Recipe::Mxfp8;
    StepTime narrow_bf16 = predict_step(narrow, 2, 40, plain, Device::CUDA, hw, 8);
    StepTime narrow_block = predict_step(narrow, 2, 40, block, Device::CUDA, hw, 8);
    CHECK(narrow_block.seconds == narrow_bf16.seconds);
    CHECK(narrow_block.fp8_casts == 0.0);
    CHECK(predict_step(narrow, 2, 40, mx, Device::CUDA, hw, 8).fp8_casts > 0.0);
    // tensorwise shares each cast's amax over tp: a one-float all-gather a cast, exposed in tp's part (2 a weight
    // forward, 3 backward, four weights in each of 2 layers), at 1 GB/s and 15 µs a call
    HardwareProfile latency = hw;
    latency.intra_latency_us = 15;
    ParallelPlan tp = tensorwise, tp_bf16;
    tp.tp = tp_bf16.tp = 2, tp.sp = tp_bf16.sp = true;
    double gathers = 2 * 4 * 5 * (4 / 1e9 + 15e-6);
    double tp_plain = predict_step(c, 2, 40, tp_bf16, Device::CUDA, latency, 8).tp;
    CHECK(predict_step(c, 2, 40, tp, Device::CUDA, latency, 8).tp - tp_plain == Approx(gathers).epsilon(1e-9));
    ParallelPlan tp_block = tp;
    tp_block.fp8_recipe = Fp8Recipe::Blockwise;  // each tile's scale from the tile: nothing to gather
    CHECK(predict_step(c, 2, 40, tp_block, Device::CUDA, latency, 8).tp == Approx(tp_plain).epsilon(1e-12));
}

TEST_CASE("a pipeline's predicted step is the simulated schedule's makespan plus the update", "[planner]") {
    // with pp the stages' timeline comes from the schedule: AFAB and 1F1B take equally long with the same
    // costs, and more micro-batches shrink the bubble's share
    GPTConfig c = parse_model_descriptor("d4c64h2t16v128");
    auto step = [&](PPKind kind, int m) {
        ParallelPlan par;
        par.pp = PPSpec{2, 0, 1, kind};
        par.accumulation = m;
        return predict_step(c, 2, 16, par, Device::CPU, round_profile(), 8);
    };
    StepTime afab = step(PPKind::AFAB, 4), one_f_one_b = step(PPKind::OneFOneB, 4),
             long_run = step(PPKind::OneFOneB, 16);
    CHECK(afab.seconds == Approx(one_f_one_b.seconds).epsilon(1e-12));
    CHECK(one_f_one_b.bubble > 0.0);
    CHECK(long_run.bubble / long_run.seconds < one_f_one_b.bubble / one_f_one_b.seconds);
    CHECK(one_f_one_b.pp > 0.0);
}

TEST_CASE("predict_step prices every layout family: its parts add up to the step, each part where it belongs",
          "[planner]") {
    GPTConfig dense = parse_model_descriptor("d8c64h4t32v128"), moe = parse_model_descriptor("d8c64h4t32v128e4k2");
    HardwareProfile hw = round_profile();
    hw.overlap = 0.5;
    hw.peak_tflops = 4;  // above every achieved rate, as on real hardware
    struct Layout {
        const char* name;
        GPTConfig c;
        ParallelPlan par;
        bool dp, tp, cp, pp, ep;  // which exposed parts must be positive
    };
    auto plan = [](int dp, int zero, int tp, int cp, PPSpec pp, int ep, int recompute, int accumulation) {
        ParallelPlan p;
        p.dp = dp, p.zero = zero, p.tp = tp, p.sp = tp > 1, p.cp = cp, p.pp = pp, p.ep = ep, p.recompute = recompute;
        p.accumulation = accumulation;
        return p;
    };
    std::vector<Layout> layouts;
    for (int zero = 0; zero <= 3; zero++)
        layouts.push_back({"dp 4", dense, plan(4, zero, 1, 1, {}, 1, 0, 2), true, false, false, false, false});
    layouts.push_back({"tp 2 sp, -r 2", dense, plan(1, 0, 2, 1, {}, 1, 2, 1), false, true, false, false, false});
    layouts.push_back({"cp 2 x dp 2", dense, plan(2, 1, 1, 2, {}, 1, 0, 1), true, false, true, false, false});
    for (PPKind kind : {PPKind::AFAB, PPKind::OneFOneB, PPKind::ZeroBubble, PPKind::DualPipeV})
        layouts.push_back(
            {"pp 2", dense, plan(1, 0, 1, 1, PPSpec{2, 0, 1, kind}, 1, 0, 4), false, false, false, true, false});
    layouts.push_back({"pp 2 interleaved", dense, plan(2, 1, 2, 1, PPSpec{2, 0, 2, PPKind::Interleaved}, 1, 1, 4), true,
                       true, false, true, false});
    layouts.push_back({"ep 2 x dp 4", moe, plan(4, 2, 1, 1, {}, 2, 0, 1), true, false, false, false, true});
    layouts.push_back({"ep 2, tp 2, cp 2, pp 2", moe, plan(2, 1, 2, 2, PPSpec{2, 0, 1, PPKind::OneFOneB}, 2, 1, 2),
                       true, true, true, true, true});
    for (const Layout& l : layouts) {
        INFO(l.name << ", ZeRO-" << l.par.zero);
        StepTime s = predict_step(l.c, 2, 32, l.par, Device::CPU, hw, 8);
        CHECK(std::isfinite(s.seconds));
        CHECK(s.compute > 0.0);
        CHECK(s.seconds == Approx(s.compute + s.dp + s.tp + s.cp + s.pp + s.ep + s.bubble).epsilon(1e-12));
        CHECK((s.dp > 0.0) == l.dp);
        CHECK((s.tp > 0.0) == l.tp);
        CHECK((s.cp > 0.0) == l.cp);
        CHECK((s.pp > 0.0) == l.pp);
        CHECK((s.bubble > 0.0) == l.pp);
        CHECK((s.ep > 0.0) == l.ep);
        CHECK(s.mfu > 0.0);
        CHECK(s.mfu < 1.0);
    }
}

TEST_CASE("hardware profiles: the files in dev/hardware parse, and a bad line is named by file and line", "[planner]") {
    for (const char* path : {"dev/hardware/h100.txt", "dev/hardware/b200.txt", "dev/hardware/a100.txt", "dev/hardware/cpu.txt"}) {
        INFO(path);
        HardwareProfile h = load_hardware(path);
        CHECK(!h.name.empty());
        CHECK(h.matmul_rate(1e9) > 0.0);
        HardwareProfile again = parse_hardware(format_hardware(h), "formatted");
        CHECK(again.memory_gbps == Approx(h.memory_gbps).epsilon(1e-3));
        CHECK(again.matmul_tflops.size() == h.matmul_tflops.size());
        CHECK(again.fp8_matmul_tflops.size() == h.fp8_matmul_tflops.size());
        CHECK(again.fp8_blockwise_matmul_tflops == h.fp8_blockwise_matmul_tflops);
        CHECK(again.mxfp8_matmul_tflops == h.mxfp8_matmul_tflops);
        CHECK(again.recipes_run() == h.recipes_run());
    }
    // the recipes each GPU runs (fp8_gpu_problem): Hopper tensorwise and blockwise, Blackwell tensorwise and mxfp8,
    // Ampere none; a CPU emulates all three
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt"), b200 = load_hardware("dev/hardware/b200.txt");
    using Names = std::vector<std::string>;
    CHECK(h100.fp8_matmul_tflops.size() == 4);  // Hopper has FP8
    CHECK(h100.recipes_run() == Names{"tensorwise", "blockwise"});
    CHECK(b200.recipes_run() == Names{"tensorwise", "mxfp8"});
    CHECK(load_hardware("dev/hardware/a100.txt").fp8_matmul_tflops.empty());  // Ampere has none
    CHECK(load_hardware("dev/hardware/a100.txt").recipes_run().empty());
    CHECK(load_hardware("dev/hardware/cpu.txt").recipes_run() == Names{"tensorwise", "blockwise", "mxfp8"});
    // blockwise GEMMs on Hopper below tensorwise's and above bf16's at every size; mxfp8's on Blackwell likewise
    for (double n : {64.0, 300.0, 1024.0, 8192.0}) {
        INFO("n = " << n);
        CHECK(h100.matmul_rate(n, true, "blockwise") < h100.matmul_rate(n, true, "tensorwise"));
        CHECK(h100.matmul_rate(n, true, "blockwise") > h100.matmul_rate(n));
        CHECK(b200.matmul_rate(n, true, "mxfp8") < b200.matmul_rate(n, true, "tensorwise"));
        CHECK(b200.matmul_rate(n, true, "mxfp8") > b200.matmul_rate(n));
        CHECK(b200.matmul_rate(n) > h100.matmul_rate(n));
    }
    CHECK(b200.peak_tflops == 2250);    // dense bf16, MFU's denominator
    CHECK(b200.memory_gib > 170);      // 180 GB
    HardwareProfile h = parse_hardware(round_profile_file(2), "round.txt");
    CHECK(h.memory_gib == 2.0);
    CHECK(h.matmul_rate(4096) == 2.0);
    std::string two_sizes =
        std::regex_replace(round_profile_file(2), std::regex("matmul_tflops 1 2"), "matmul_tflops 64 2");
    HardwareProfile two = parse_hardware(two_sizes + "matmul_tflops 256 4\n", "two.txt");
    CHECK(two.matmul_rate(16) == 2.0);           // below the smallest size: its rate
    CHECK(two.matmul_rate(16384) == 4.0);        // above the largest: its rate
    CHECK(two.matmul_rate(128) == Approx(3.0));  // log-linear between 64 and 256
    CHECK(two.matmul_rate(100) < two.matmul_rate(128));
    CHECK(two.matmul_rate(128, true) == two.matmul_rate(128));  // no FP8 rates: FP8 at bf16's
    HardwareProfile fp8 = parse_hardware(two_sizes + "fp8_matmul_tflops 64 5\nfp8_matmul_tflops 256 9\n", "fp8.txt");
    CHECK(fp8.matmul_rate(128, true) == Approx(7.0));
    CHECK(fp8.matmul_rate(128) == Approx(2.0));
    CHECK(fp8.recipes_run() == std::vector<std::string>{"tensorwise", "blockwise", "mxfp8"});  // a CPU emulates all
    std::string gpu = std::regex_replace(two_sizes, std::regex("device cpu"), "device cuda");
    // a GPU profile with FP8 rates and no list: tensorwise, the recipe there was before the list
    CHECK(parse_hardware(gpu + "fp8_matmul_tflops 64 5\n", "fp8.txt").recipes_run() == std::vector<std::string>{"tensorwise"});
    // a recipe's own rates where given, else the FP8 rate's
    HardwareProfile recipes = parse_hardware(gpu + "fp8_matmul_tflops 64 5\nfp8_blockwise_matmul_tflops 64 3\n"
                                                   "fp8_blockwise_matmul_tflops 256 7\nfp8_recipes tensorwise blockwise\n",
                                             "recipes.txt");
    CHECK(recipes.matmul_rate(128, true, "blockwise") == Approx(5.0));
    CHECK(recipes.matmul_rate(128, true, "tensorwise") == Approx(5.0));
    CHECK(recipes.matmul_rate(128, true, "mxfp8") == Approx(5.0));
    CHECK(recipes.runs("blockwise"));
    CHECK(!recipes.runs("mxfp8"));
    auto refused = [](const std::string& text, const std::string& words) {
        try {
            parse_hardware(text, "bad.txt");
        } catch (const Error& e) {
            INFO(e.what());
            CHECK(std::string(e.what()).find(words) != std::string::npos);
            return;
        }
        FAIL("accepted: " << text);
    };
    refused(std::regex_replace(round_profile_file(2), std::regex("memory_gbps 10"), "memory_gbps fast"),
            "bad.txt:10: memory_gbps: expected a non-negative number");
    refused(std::regex_replace(round_profile_file(2), std::regex("overlap 0\n"), ""), "missing 'overlap'");
    refused(round_profile_file(2) + "bandwidth 5\n", "unknown key 'bandwidth'");
    refused(round_profile_file(2) + "overlap 0.5\n", "overlap given twice");
    refused(round_profile_file(2) + "device cuda\n", "bad.txt:18: device given twice");
    refused(std::regex_replace(round_profile_file(2), std::regex("device cpu"), "device tpu"),
            "device: expected cuda or cpu");
    refused(round_profile_file(2) + "fp8_recipes tensorwise rowwise\n", "bad.txt:18: fp8_recipes: 'rowwise' is no recipe");
    refused(gpu + "mxfp8_matmul_tflops 64 3\nfp8_recipes tensorwise\n",
            "mxfp8_matmul_tflops: the rates of a recipe that fp8_recipes does not list");
    refused(gpu + "fp8_blockwise_matmul_tflops 64 3\n", "fp8_blockwise_matmul_tflops: the rates of a recipe");
}

TEST_CASE("train_gpt --plan --hardware prints predict_step's line", "[planner]") {
    TempDir dir;
    std::string profile = dir / "round.txt";
    File(profile, "w").write(round_profile_file(1).data(), round_profile_file(1).size());
    CommandResult r =
        single(strfmt("-e %s -b 2 -t 16 --device cpu --plan --world 4 --tp 2 --hardware %s", MODEL, profile.c_str()));
    INFO(r.output);
    REQUIRE(r.status == 0);
    ParallelPlan par;
    par.dp = 2, par.tp = 2, par.sp = true;
    StepTime s = predict_step(parse_model_descriptor(MODEL), 2, 16, par, Device::CPU, round_profile(), 8);
    CHECK(r.output.find("predicted step: " + describe_step(s) + "\n") != std::string::npos);
    CHECK(r.output.find("fits round figures: yes") != std::string::npos);
    // a profile for the GPU does not price a CPU plan
    CommandResult wrong =
        single(strfmt("-e %s -b 2 -t 16 --device cpu --plan --hardware dev/hardware/h100.txt", MODEL));
    check_one_line_error(wrong, {"--hardware dev/hardware/h100.txt", "cuda", "--device cpu"});
}

TEST_CASE("--search prints only layouts that --plan says fit, after dropping some that do not", "[planner]") {
    TempDir dir;
    std::string profile = dir / "small.txt";
    // 4 MiB per rank: the model's states fit, the larger micro-batches' activations do not
    std::string text = round_profile_file(4.0 / 1024);
    File(profile, "w").write(text.data(), text.size());
    std::string model = strfmt("-e %s -t 16 -d 512 --device cpu --hardware %s", MODEL, profile.c_str());
    CommandResult r = single(model + " --search --gpus 4");
    INFO(r.output);
    REQUIRE(r.status == 0);
    std::smatch m;
    REQUIRE(std::regex_search(
        r.output, m, std::regex(R"(layouts considered: (\d+); fit: (\d+); do not fit in [0-9.]+ GiB: (\d+))")));
    CHECK(std::stoi(m[3]) > 0);
    CHECK(std::stoi(m[2]) >= 10);
    std::regex row(
        R"(\n +(\d+) +[0-9.]+ +[0-9]+ +[0-9.]+%  mpirun -np 4 \./train_gpt -e \S+ -t 16 -d 512 (.*) --device cpu)");
    int rows = 0;
    double previous = 0;
    for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), row); it != std::sregex_iterator(); ++it) {
        rows++;
        std::string flags = (*it)[2];
        INFO("layout " << flags);
        CommandResult plan = single(model + " --plan --world 4 " + flags);
        REQUIRE(plan.status == 0);
        CHECK(plan.output.find("fits round figures: NO") == std::string::npos);
        CHECK(plan.output.find("fits round figures: yes") != std::string::npos);
        // ranked by the predicted step, which --plan prints the same
        std::smatch ms;
        REQUIRE(std::regex_search(plan.output, ms, std::regex(R"(predicted step: ([0-9.]+) ms)")));
        CHECK(std::stod(ms[1]) >= previous);
        previous = std::stod(ms[1]);
    }
    CHECK(rows == 10);
    CHECK(r.output.find("runner-up (") != std::string::npos);
}

// the Options train_gpt parses from this command line
Options parsed(const std::string& line) {
    std::istringstream in("train_gpt " + line);
    std::vector<std::string> words{std::istream_iterator<std::string>(in), std::istream_iterator<std::string>()};
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    return parse_options((int)argv.size(), argv.data());
}

// --search of 4 devices for a 4-layer model (FP8 reaches its middle layers) and a batch of 32 sequences of 16
const std::string SEARCH = "-e d4c64h2t16v128 -t 16 -d 512 --search --gpus 4";

struct Searched {
    std::vector<SearchCandidate> found;  // fastest first
    std::map<std::string, int> refused;
    int too_big = 0;
    std::vector<std::string> layouts() const {
        std::vector<std::string> l;
        for (const SearchCandidate& c : found) l.push_back(layout_flags(c.o));
        return l;
    }
};

Searched searched(const std::string& flags, Device dev, const HardwareProfile& hw) {
    Options o = parsed(SEARCH + " " + flags);
    Searched s;
    s.found = search_layouts(o, parse_model_descriptor(o.model), dev, hw, hw.devices_per_node, s.refused, s.too_big);
    return s;
}

TEST_CASE("--search holds the layout flags the command line gives: it finds the full search's layouts with those "
          "values, and only those, in the same order", "[planner]") {
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt");  // 80 GiB: every layout of the small model fits
    Searched all = searched("", Device::CUDA, h100);
    struct Held {
        const char* flags;
        std::function<bool(const Options&)> has;
    };
    std::vector<Held> holds = {
        {"--fp8 0", [](const Options& o) { return o.fp8 == 0; }},
        {"--fp8 1", [](const Options& o) { return o.fp8 == 1; }},
        {"--tp 2", [](const Options& o) { return o.tp == 2 && o.sp == 1; }},
        {"-z 1", [](const Options& o) { return o.zero == 1; }},
        {"-b 2", [](const Options& o) { return o.B == 2; }},
        {"-r 2", [](const Options& o) { return o.recompute == 2; }},
        {"--pp 2 --pp-schedule zb", [](const Options& o) { return o.pp == 2 && o.pp_schedule == "zb"; }},
        {"--tp 1 -z 3 -b 4 --fp8 1",
         [](const Options& o) { return o.tp == 1 && o.zero == 3 && o.B == 4 && o.fp8 == 1; }},
        {"--fp8 1 --fp8-recipe blockwise", [](const Options& o) { return o.fp8 == 1 && o.fp8_recipe == "blockwise"; }},
    };
    for (const Held& h : holds) {
        INFO("held: " << h.flags);
        Searched held = searched(h.flags, Device::CUDA, h100);
        std::vector<std::string> expected;
        for (const SearchCandidate& c : all.found)
            if (h.has(c.o)) expected.push_back(layout_flags(c.o));
        REQUIRE(!expected.empty());
        CHECK(expected.size() < all.found.size());  // the full search has layouts with other values
        CHECK(held.layouts() == expected);
        for (const SearchCandidate& c : held.found) CHECK(h.has(c.o));
    }
}

TEST_CASE("--search holds --sp: --sp 0 keeps sp off under tp, --sp 1 leaves only tp layouts", "[planner]") {
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt");
    Searched off = searched("--sp 0", Device::CUDA, h100);
    REQUIRE(!off.found.empty());
    int tp_layouts = 0;
    for (const SearchCandidate& c : off.found) {
        INFO(layout_flags(c.o));
        CHECK(c.o.sp == 0);
        if (c.o.tp > 1) {
            tp_layouts++;
            CHECK(layout_flags(c.o).find(" --sp 0") != std::string::npos);  // the command runs it without sp
        }
    }
    CHECK(tp_layouts > 0);
    // parse_options takes --sp 1 without --tp here; the trainer's check refuses each layout with tp 1
    Searched on = searched("--sp 1", Device::CUDA, h100);
    REQUIRE(!on.found.empty());
    for (const SearchCandidate& c : on.found) CHECK((c.o.tp > 1 && c.o.sp == 1));
    CHECK(on.refused["--sp"] > 0);
}

TEST_CASE("--search with a held value no layout can have finds none, and says which flags were held", "[planner]") {
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt");
    // --tp 3 on 4 devices: the trainer refuses every layout, by --tp
    Searched three = searched("--tp 3", Device::CUDA, h100);
    CHECK(three.found.empty());
    CHECK(three.too_big == 0);
    CHECK(three.refused.size() == 1);
    CHECK(three.refused["--tp"] > 0);
    // --tp 8 on 4 devices, more than a node: the same
    Searched eight = searched("--tp 8", Device::CUDA, h100);
    CHECK(eight.found.empty());
    CHECK(eight.refused["--tp"] > 0);
    // a layout the trainer runs that the device cannot hold: 4 MiB, where the smaller micro-batches fit
    HardwareProfile small = parse_hardware(round_profile_file(4.0 / 1024), "small.txt");
    Searched some = searched("", Device::CPU, small);
    REQUIRE(!some.found.empty());
    REQUIRE(some.too_big > 0);
    Searched held = searched("-b 8 -z 0 -r 0 --tp 1 --cp 1 --pp 1", Device::CPU, small);
    CHECK(held.found.empty());
    CHECK(held.too_big == 1);
    CHECK(held.refused.empty());
    // the train_gpt's lines: the held flags named after the first line, and in the verdict
    TempDir dir;
    std::string profile = dir / "small.txt";
    std::string text = round_profile_file(4.0 / 1024);
    File(profile, "w").write(text.data(), text.size());
    CommandResult r = single(SEARCH + " --device cpu --hardware " + profile + " -b 8 -z 0 -r 0 --tp 1 --cp 1 --pp 1");
    INFO(r.output);
    REQUIRE(r.status == 0);
    std::vector<std::string> lines = lines_of(r.output);
    REQUIRE(lines.size() >= 2);
    CHECK(lines[1] == "search: fixed by the command line: -b 8, --tp 1, --cp 1, --pp 1, -z 0, -r 0");
    CHECK(lines.back() == "no layout fits with -b 8, --tp 1, --cp 1, --pp 1, -z 0, -r 0 fixed by the command line");
    CommandResult refused = single(SEARCH + " --device cuda --tp 3");
    INFO(refused.output);
    REQUIRE(refused.status == 0);
    CHECK(refused.output.find("  refused by --tp: ") != std::string::npos);
    CHECK(refused.output.find("\nno layout fits with --tp 3 fixed by the command line\n") != std::string::npos);
}

TEST_CASE("--search names the flags it holds on its second line; --fp8 0 ranks bf16 layouts alone", "[planner]") {
    CHECK(fixed_search_flags(parsed(SEARCH + " --fp8 0 --tp 2 -c 0.1 --seed 3")) == "--tp 2, --fp8 0");
    CHECK(fixed_search_flags(parsed(SEARCH)) == "");
    CHECK(fixed_search_flags(parsed(SEARCH + " --fp8-recipe mxfp8 --fp8 1")) == "--fp8 1, --fp8-recipe mxfp8");
    // Llama 3 8B on 8 H100s at sequence 4096: the full search ranks an FP8 layout first, the held one none
    std::string llama = "-e llama3-8b -t 4096 -d 1048576 --device cuda --search --gpus 8";
    std::regex row(R"(\n +\d+ +[0-9.]+ +[0-9]+ +[0-9.]+%  mpirun -np 8 \./train_gpt -e llama3-8b -t 4096 -d 1048576 ([^\n]*))");
    auto rows = [&](const std::string& output) {
        std::vector<std::string> r;
        for (auto it = std::sregex_iterator(output.begin(), output.end(), row); it != std::sregex_iterator(); ++it)
            r.push_back((*it)[1]);
        return r;
    };
    CommandResult unheld = single(llama);
    INFO(unheld.output);
    REQUIRE(unheld.status == 0);
    std::vector<std::string> unheld_rows = rows(unheld.output);
    REQUIRE(unheld_rows.size() == 10);
    CHECK(unheld_rows[0].find("--fp8 1 --fp8-recipe ") != std::string::npos);  // the command names its recipe
    CHECK(unheld.output.find("mxfp8") == std::string::npos);  // an H100 runs none
    CHECK(lines_of(unheld.output)[0].find("with and without FP8 matmuls (tensorwise, blockwise)") != std::string::npos);
    CHECK(unheld.output.find("fixed by the command line") == std::string::npos);
    CommandResult bf16 = single(llama + " --fp8 0");
    INFO(bf16.output);
    REQUIRE(bf16.status == 0);
    std::vector<std::string> lines = lines_of(bf16.output);
    REQUIRE(lines.size() >= 2);
    CHECK(lines[0].find(", bf16 mixed precision on cuda") != std::string::npos);
    CHECK(lines[1] == "search: fixed by the command line: --fp8 0");
    std::vector<std::string> bf16_rows = rows(bf16.output);
    CHECK(bf16_rows.size() == 10);
    for (const std::string& flags : bf16_rows) CHECK(flags.find("--fp8") == std::string::npos);
}

TEST_CASE("--search tries each FP8 recipe the profile's GPU runs (tensorwise and blockwise on an H100, tensorwise and "
          "mxfp8 on a B200), refuses the layouts a recipe cannot run, and plans each with its recipe's buffers",
          "[planner][fp8]") {
    const GPTConfig config = parse_model_descriptor("d4c64h2t16v128");
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt"), b200 = load_hardware("dev/hardware/b200.txt");
    auto recipes = [](const Searched& s) {
        std::set<std::string> r;
        for (const SearchCandidate& c : s.found)
            if (c.o.fp8) r.insert(c.o.fp8_recipe);
        return r;
    };
    Searched on_h100 = searched("", Device::CUDA, h100), on_b200 = searched("", Device::CUDA, b200);
    CHECK(recipes(on_h100) == std::set<std::string>{"blockwise", "tensorwise"});
    CHECK(recipes(on_b200) == std::set<std::string>{"mxfp8", "tensorwise"});
    for (const Searched* s : {&on_h100, &on_b200}) {
        // 4-token chunks under cp cut the block recipes' tiles of tokens, and tp 4 mxfp8's queries (16 of 64)
        CHECK(s->refused.at("--fp8-recipe") > 0);
        for (size_t i = 0; i < s->found.size(); i++) {
            const SearchCandidate& c = s->found[i];
            std::string flags = layout_flags(c.o);
            INFO(flags);
            if (i > 0) CHECK(s->found[i - 1].step.seconds <= c.step.seconds);  // ranked
            CHECK((flags.find("--fp8") != std::string::npos) == (c.o.fp8 == 1));  // the command runs what was planned
            if (c.o.fp8) CHECK(flags.find(" --fp8 1 --fp8-recipe " + c.o.fp8_recipe) != std::string::npos);
            if (c.o.fp8 && c.o.fp8_recipe != "tensorwise") CHECK(c.o.cp == 1);
            if (c.o.fp8 && c.o.fp8_recipe == "mxfp8") CHECK(c.o.tp <= 2);
            // the bytes the search compares with the device: the plan of the candidate's own flags, recipe included
            CheckedLayout l = check_layout(c.o, config, 4);
            ParallelPlan par = parallel_plan(c.o, l.dp, l.accumulation);
            double bytes = 0;
            for (int stage = 0; stage < c.o.pp; stage++) {
                par.pp.rank = stage;
                bytes = std::max(bytes, planned_device_bytes(plan_memory(config, c.o.B, 16, omp_get_max_threads(), par,
                                                                         Device::CUDA), Device::CUDA, h100));
            }
            CHECK(c.bytes == bytes);
        }
    }
    // ... which differ by recipe (a block recipe's tile scales), so that the check above sees the recipe
    ParallelPlan tensorwise, blockwise;
    tensorwise.fp8 = blockwise.fp8 = true, blockwise.fp8_recipe = Fp8Recipe::Blockwise;
    CHECK(plan_memory(config, 4, 16, 1, tensorwise, Device::CUDA).total() !=
          plan_memory(config, 4, 16, 1, blockwise, Device::CUDA).total());
    // a recipe the command line gives is the only one tried; one the GPU does not run is refused, by --fp8-recipe
    Searched mx = searched("--fp8 1 --fp8-recipe mxfp8", Device::CUDA, b200);
    REQUIRE(!mx.found.empty());
    CHECK(recipes(mx) == std::set<std::string>{"mxfp8"});
    Searched not_hopper = searched("--fp8 1 --fp8-recipe mxfp8", Device::CUDA, h100);
    CHECK(not_hopper.found.empty());
    CHECK(not_hopper.refused.size() == 1);
    CHECK(not_hopper.refused["--fp8-recipe"] > 0);
    // a GPU without FP8 (no recipe in its profile) is never tried with it, and refuses a --fp8 1 that is given
    HardwareProfile a100 = load_hardware("dev/hardware/a100.txt");
    CHECK(recipes(searched("", Device::CUDA, a100)).empty());
    Searched ampere = searched("--fp8 1", Device::CUDA, a100);
    CHECK(ampere.found.empty());
    CHECK(ampere.refused["--fp8"] > 0);
}

TEST_CASE("train_gpt --plan with --fp8 1 names the recipe, the weights it takes, its casts' share of the step and the "
          "rates its GEMMs are priced at, and says when the profile's GPU does not run it", "[planner][fp8]") {
    // a Llama whose MLP projection (128 x 320) is no whole tiles of 128: blockwise takes 3 of the 4 weights of a layer
    const std::string model = "-e l4c128h4g2f320t64v256 -b 2 -t 64 --device cuda --plan --fp8 1";
    GPTConfig config = parse_model_descriptor("l4c128h4g2f320t64v256");
    HardwareProfile h100 = load_hardware("dev/hardware/h100.txt");
    ParallelPlan par;
    par.fp8 = true, par.fp8_recipe = Fp8Recipe::Blockwise;
    StepTime step = predict_step(config, 2, 64, par, Device::CUDA, h100, 8);
    CommandResult r = single(model + " --fp8-recipe blockwise --hardware dev/hardware/h100.txt");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("bf16 mixed precision with FP8 matmuls (blockwise) on cuda") != std::string::npos);
    CHECK(r.output.find(strfmt("\nfp8: --fp8-recipe blockwise on layers 1 to 2, 3 of the 4 matmul weights of a layer "
                               "(the others in bf16: dimensions not whole tiles of 128); casts %.3f ms of compute (%.1f%% "
                               "of the step), GEMMs at the profile's blockwise rates\n",
                               step.fp8_casts * 1e3, 100 * step.fp8_casts / step.seconds)) != std::string::npos);
    CHECK(r.output.find("predicted step: " + describe_step(step) + "\n") != std::string::npos);
    // mxfp8 on an H100: priced at the FP8 rates, and said to be refused there
    CommandResult mx = single(model + " --fp8-recipe mxfp8 --hardware dev/hardware/h100.txt");
    INFO(mx.output);
    REQUIRE(mx.status == 0);
    CHECK(mx.output.find("fp8: --fp8-recipe mxfp8 on layers 1 to 2, 4 of the 4 matmul weights of a layer; casts ") !=
          std::string::npos);
    CHECK(mx.output.find("GEMMs at the profile's FP8 rates (it gives none of this recipe's own); the profile's GPU runs "
                         "tensorwise, blockwise, so the trainer would refuse this recipe there\n") != std::string::npos);
}

}  // namespace test_planner

// The planner: what a layout needs and how fast it runs, from the flags alone, before any rank starts.
//   --plan    one layout: each stage's memory by ledger category (llmc/plan.h), the bytes each kind of
//             parallelism sends, and the predicted step (llmc/step_time.h) against a hardware profile;
//   --search  every layout of N devices the trainer accepts, dropped when it does not fit, the rest ranked by
//             predicted tokens/s, with the command line that launches each; the layout flags the command line
//             gives are held fixed, and only the others are varied. FP8 is tried in each recipe the profile says
//             the GPU runs (fp8_recipes: tensorwise and blockwise on an H100, tensorwise and mxfp8 on a B200).
// Both refuse exactly what the trainer refuses: check_layout is the trainer's own check of the flags.
#pragma once

#include <omp.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "llmc/cuda_common.cuh"
#include "llmc/grid.cuh"
#include "llmc/hardware.h"
#include "llmc/options.h"
#include "llmc/plan.h"
#include "llmc/pp.cuh"
#include "llmc/step_time.h"

inline GridShape grid_shape(const Options& o) { return GridShape{o.tp, o.cp, o.pp, o.ep}; }

inline PPSpec pp_spec(const Options& o, int rank) {
    return PPSpec{o.pp, rank, o.vpp, parse_pp_schedule(o.pp_schedule)};
}

inline ParallelPlan parallel_plan(const Options& o, int dp, int accumulation) {
    ParallelPlan p;
    p.dp = dp, p.zero = o.zero, p.bucket_floats = o.bucket_floats();
    p.accumulation = accumulation;
    p.tp = o.tp, p.sp = o.sp == 1, p.recompute = o.recompute, p.fp8 = o.fp8 == 1, p.cp = o.cp, p.pp = pp_spec(o, 0), p.ep = o.ep;
    p.aux_batch = o.moe_aux_scope == "batch", p.capacity = o.moe_capacity;
    p.fp8_recipe = fp8_recipe_named(o.fp8_recipe);
    p.fp8_param_gather = o.fp8_param_gather == 1;
    return p;
}

inline CPSplit cp_split(const Options& o) { return o.cp_split == "contiguous" ? CPSplit::Contiguous : CPSplit::ZigZag; }

// a layout the trainer accepts for a world of ranks: its dp size and the micro-steps of a step
struct CheckedLayout {
    int dp, accumulation;
    long tokens_per_micro_step, total_batch;
};

// the trainer's checks of the layout flags against the model and the world, each failing with one line naming
// the flag
inline CheckedLayout check_layout(const Options& o, const GPTConfig& config, int world) {
    CheckedLayout l;
    l.dp = grid_dp(world, grid_shape(o));
    if (o.sp == 1 && o.tp == 1) fail("--sp 1: sequence parallelism needs tensor parallelism (--tp > 1)");
    check_split(config, o.T, TPSpec{o.tp, 0, o.sp == 1}, CPSpec{o.cp, 0, cp_split(o)}, o.ep);
    if (o.given.count("--moe-aux") && !config.moe()) fail("--moe-aux %g: the model has no experts", o.moe_aux);
    if (!o.moe_aux_scope.empty() && !config.moe())
        fail("--moe-aux-scope %s: the model has no experts", o.moe_aux_scope.c_str());
    if (o.moe_capacity > 0.0f && !config.moe()) fail("--moe-capacity %g: the model has no experts", o.moe_capacity);
    if (o.given.count("--moe-bias-rate") && !config.router_bias)
        fail("--moe-bias-rate %g: only for a model whose router has a selection bias (a descriptor's a)", o.moe_bias_rate);
    if (!o.fp8_recipe.empty() && !o.fp8) fail("--fp8-recipe %s: needs --fp8 1", o.fp8_recipe.c_str());
    if (o.fp8_param_gather) {
        if (!o.fp8) fail("--fp8-param-gather 1: needs --fp8 1");
        std::string why = fp8_param_gather_problem(o.zero, fp8_recipe_named(o.fp8_recipe), (long)o.B * o.T / o.cp);
        if (!why.empty()) fail("--fp8-param-gather 1: %s", why.c_str());
    }
    if (o.fp8) {
        std::string why = fp8_layout_problem(config, fp8_recipe_named(o.fp8_recipe), o.tp, o.cp, o.T);
        if (!why.empty()) fail("--fp8-recipe %s: %s", o.fp8_recipe.c_str(), why.c_str());
    }
    l.tokens_per_micro_step = (long)o.B * o.T * l.dp;
    l.total_batch = o.total_batch == -1 ? l.tokens_per_micro_step : o.total_batch;
    if (l.total_batch % l.tokens_per_micro_step != 0)
        fail("-d %ld: must be a multiple of b*t*dp = %ld", l.total_batch, l.tokens_per_micro_step);
    if (l.total_batch / l.tokens_per_micro_step > (1 << 20))
        fail("-d %ld: needs %ld micro-steps of b*t*dp = %ld tokens; at most %d", l.total_batch,
             l.total_batch / l.tokens_per_micro_step, l.tokens_per_micro_step, 1 << 20);
    l.accumulation = (int)(l.total_batch / l.tokens_per_micro_step);
    // the pipeline: the layers fill the stages, and the schedule takes this many micro-batches
    stage_part(config, pp_spec(o, 0));
    check_pp_micro_batches(pp_spec(o, 0).kind, o.pp, l.accumulation, o.vpp);
    // ZeRO-2/3 stage each bucket's gradients for one reduction at a time; a split backward writes some of a
    // micro-batch's (the layernorms') long before the rest, while other micro-batches' arrive
    if (pp_kind_splits_backward(parse_pp_schedule(o.pp_schedule)) && o.zero >= 2)
        fail("--pp-schedule %s: its deferred weight gradients work with -z 0 or 1, not -z %d", o.pp_schedule.c_str(), o.zero);
    return l;
}

// --hardware, or the device's default profile; the default may be absent (a binary run outside the repository)
inline bool plan_hardware(const Options& o, Device dev, HardwareProfile& hw, std::string& path) {
    path = !o.hardware.empty() ? o.hardware : dev == Device::CUDA ? "dev/hardware/h100.txt" : "dev/hardware/cpu.txt";
    if (o.hardware.empty() && access(path.c_str(), R_OK) != 0) return false;
    hw = load_hardware(path);
    if (hw.device != (dev == Device::CUDA ? "cuda" : "cpu"))
        fail("--hardware %s: a profile for %s, but the plan is for --device %s", path.c_str(), hw.device.c_str(),
             dev == Device::CUDA ? "cuda" : "cpu");
    return true;
}

// the devices of a node: --gpus-per-node, or the profile's
inline int devices_per_node(const Options& o, const HardwareProfile& hw) {
    return o.gpus_per_node > 0 ? o.gpus_per_node : hw.devices_per_node;
}

// A rank's memory as the planner compares it with the device's: the ledger's categories, and on the GPU
// cuBLASLt's workspace and the profile's reserve (the CUDA context, NCCL)
inline double planned_device_bytes(const MemoryPlan& p, Device dev, const HardwareProfile& hw) {
    double outside = dev == Device::CUDA ? (double)CUBLASLT_WORKSPACE_BYTES + hw.reserved_mib * 1048576.0 : 0.0;
    return (double)p.total() + outside;
}

// --plan's line on FP8: the recipe, which weights of a layer it takes (a block recipe's others stay bf16), what its
// casts cost of the predicted step, the rate its GEMMs are priced at, and whether the profile's GPU runs it
inline std::string describe_fp8(const GPTConfig& config, const ParallelPlan& par, const HardwareProfile& hw,
                                const StepTime& step) {
    const std::string recipe = fp8_recipe_name(par.fp8_recipe);
    ModelTable table = model_table(config);
    int taken = 0, weights = 0;
    int layer = std::min(1, config.num_layers - 1);  // a layer FP8 reaches (its weights are every such layer's)
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        const TensorSpec& w = table[t];
        if (!fp8_matmul_weight(t) || w.block() == 0 || !layer_holds(config, w.layers, layer)) continue;
        weights++;
        taken += fp8_recipe_takes(par.fp8_recipe, (long)w.local_rows(par.tp), (long)w.local_cols(par.tp));
    }
    std::string which = config.num_layers <= 2
                            ? "no layers (the first and the last stay bf16)"
                            : strfmt("layers 1 to %d, %d of the %d matmul weights of a layer", config.num_layers - 2,
                                     taken, weights);
    if (taken < weights)
        which += strfmt(" (the others in bf16: dimensions not whole tiles of %d)", fp8_tile(par.fp8_recipe));
    const HardwareProfile::Points& points = hw.fp8_points(recipe);
    std::string rates = &points == &hw.matmul_tflops ? "bf16's rates (the profile gives no FP8 rates)"
                        : &points == &hw.fp8_matmul_tflops && recipe != "tensorwise"
                            ? "the profile's FP8 rates (it gives none of this recipe's own)"
                            : "the profile's " + recipe + " rates";
    std::string s = strfmt("fp8: --fp8-recipe %s on %s; casts %.3f ms of compute (%.1f%% of the step), GEMMs at %s",
                           recipe.c_str(), which.c_str(), step.fp8_casts * 1e3, 100 * step.fp8_casts / step.seconds,
                           rates.c_str());
    if (!hw.runs(recipe)) {
        std::string run;
        for (const std::string& r : hw.recipes_run()) run += (run.empty() ? "" : ", ") + r;
        s += strfmt("; the profile's GPU runs %s, so the trainer would refuse this recipe there",
                    run.empty() ? "no FP8 recipe" : run.c_str());
    }
    return s;
}

inline void print_plan(const Options& o, const GPTConfig& config, const std::string& device, Device dev, int world,
                       int accumulation) {
    HardwareProfile hw;
    std::string hw_path;
    bool priced = plan_hardware(o, dev, hw, hw_path);  // refused before the first line, if at all
    int dp = grid_dp(world, grid_shape(o));
    ParallelPlan par = parallel_plan(o, dp, accumulation);
    printf("%s\n", device.c_str());
    size_t psi = num_parameters(config);
    printf("model L=%d C=%d NH=%d V=%d Vp=%d maxT=%d%s%s: %zu parameters\n", config.num_layers, config.channels,
           config.num_heads, config.vocab_size, config.padded_vocab_size, config.max_seq_len, family_shape(config).c_str(),
           experts_shape(config).c_str(), psi);
    printf(
        "layout: %d ranks, dp=%d, tp=%d (sp %s), cp=%d (%s), pp=%d (%s, vpp %d), ZeRO-%d over dp·cp = %d ranks%s, %d "
        "micro-steps per step, recompute %d\n",
        world, dp, o.tp, o.sp ? "on" : "off", o.cp, o.cp_split.c_str(), o.pp, o.pp_schedule.c_str(), o.vpp, o.zero,
        par.grad_ranks(),
        o.ep > 1
            ? strfmt(", ep=%d (each expert on %d rank%s)", o.ep, par.expert_ranks(), par.expert_ranks() == 1 ? "" : "s")
                  .c_str()
            : "",
        accumulation, o.recompute);
    if (config.moe()) {  // what the experts' buffers are sized for
        long rows = local_dims(config, TPSpec{o.tp, 0, o.sp == 1}, o.B, o.T, o.cp, o.ep, o.moe_capacity).expert_rows;
        if (o.moe_capacity > 0.0f)
            printf("experts: a rank's experts take at most %ld rows a layer, %ld of each sequence per expert "
                   "(--moe-capacity %g); the rest are dropped\n", rows,
                   expert_capacity(o.moe_capacity, config.top_k, config.num_experts, o.T), o.moe_capacity);
        else
            printf("experts: a rank's experts take up to %ld rows a layer, sized for the worst case (every token of "
                   "the ep group routed to them; --moe-capacity bounds it)\n", rows);
    }
    if (par.pp.on()) print_stage_layers(config, par.pp);
    const char* recipe = fp8_recipe_name(par.fp8_recipe);
    std::string precision = dev == Device::CUDA
                                ? (o.fp8 ? strfmt("bf16 mixed precision with FP8 matmuls (%s) on cuda", recipe)
                                         : "bf16 mixed precision on cuda")
                                : (o.fp8 ? strfmt("fp32 with FP8 matmuls (%s) emulated on cpu", recipe) : "fp32 on cpu");
    // each stage holds other layers and keeps another number of micro-batches in flight: a plan for each
    for (int stage = 0; stage < o.pp; stage++) {
        par.pp.rank = stage;
        MemoryPlan plan = plan_memory(config, o.B, o.T, omp_get_max_threads(), par, dev);
        int in_flight = planned_in_flight(par.pp, accumulation);
        std::string where =
            o.pp > 1 ? strfmt(" on stage %d (%d micro-batch%s in flight)", stage, in_flight, in_flight == 1 ? "" : "es")
                     : "";
        std::string title = strfmt("predicted memory per rank%s, B=%d T=%d, %s:", where.c_str(), o.B, o.T,
                                   precision.c_str());
        print_memory(title.c_str(), plan.bytes, plan.total());
        if (dev == Device::CUDA) {
            // outside the ledger: cuBLASLt's workspace (counted by the run's measured figure) and the CUDA context
            // (not counted: the run measures from after its creation)
            printf("  %-16s %14zu bytes %10.1f MiB\n", "cuBLASLt", CUBLASLT_WORKSPACE_BYTES,
                   CUBLASLT_WORKSPACE_BYTES / 1048576.0);
            printf("  %-16s %14s       about %.0f MiB per process (driver and kernels; not in the totals)\n",
                   "CUDA context", "", CUDA_CONTEXT_MIB);
            printf("  %-16s %14zu bytes %10.1f MiB\n", "total on device", plan.total() + CUBLASLT_WORKSPACE_BYTES,
                   (plan.total() + CUBLASLT_WORKSPACE_BYTES) / 1048576.0);
        } else {
            ModelPart part = planned_part(config, par);
            size_t local = num_parameters(config, o.tp, part, o.ep);
            size_t shard = planned_shard_size(config, par);
            size_t mixed[MEM_CATEGORIES] = {};
            plan_model_states(mixed, local, shard, o.zero, BF16_MIXED);
            printf(
                "model states per rank in bf16 mixed precision: params %.1f MiB, master weights %.1f MiB, grads %.1f "
                "MiB, optimizer %.1f MiB\n",
                mixed[MEM_PARAMS] / 1048576.0, mixed[MEM_MASTER_WEIGHTS] / 1048576.0, mixed[MEM_GRADS] / 1048576.0,
                mixed[MEM_OPTIMIZER] / 1048576.0);
        }
        if (priced) {
            double need = planned_device_bytes(plan, dev, hw) / 1073741824.0;
            printf("  fits %s: %s (%.1f of %.1f GiB, with its %.0f MiB reserve)\n", hw.name.c_str(),
                   need <= hw.memory_gib ? "yes" : "NO", need, hw.memory_gib,
                   dev == Device::CUDA ? hw.reserved_mib : 0.0);
        }
    }
    par.pp.rank = 0;
    const char* of = o.pp > 1 ? " on stage 0" : "";
    printf("communication per step per rank%s: %.0f bytes\n", of, planned_comm_bytes(config, par, dev));
    printf("tensor-parallel communication per step per rank%s: %.0f bytes\n", of,
           planned_tp_comm_bytes(config, par, o.B, o.T, dev));
    printf("context-parallel communication per step per rank%s: %.0f bytes\n", of,
           planned_cp_comm_bytes(config, par, o.B, o.T, dev));
    printf("pipeline-parallel communication per step per rank%s: %.0f bytes\n", of,
           planned_pp_comm_bytes(config, par, o.B, o.T, dev));
    if (o.ep > 1)
        printf("expert-parallel communication per step per rank%s, with balanced routing: %.0f bytes\n", of,
               planned_ep_comm_bytes(config, par, o.B, o.T, dev));
    if (!priced) {
        printf("predicted step: no hardware profile at %s (give --hardware FILE, e.g. one of dev/hardware/)\n",
               hw_path.c_str());
        return;
    }
    int per_node = devices_per_node(o, hw);
    printf("hardware: %s (%s), %d per node\n", hw.name.c_str(), hw_path.c_str(), per_node);
    StepTime step = predict_step(config, o.B, o.T, par, dev, hw, per_node);
    printf("predicted step: %s\n", describe_step(step).c_str());
    if (o.fp8) printf("%s\n", describe_fp8(config, par, hw, step).c_str());
}

// One candidate of --search: its flags, what it needs and what it is predicted to do
struct SearchCandidate {
    Options o;
    double bytes;  // the largest stage's, on the device
    StepTime step;
};

// the flags that launch a candidate, beside the model, -t and -d the search was given: -b, and each layout flag
// whose value is not the trainer's default (sp's default is on with tp; a pipeline names its schedule)
inline std::string layout_flags(const Options& o) {
    const Options defaults;
    std::string s = strfmt("-b %d", o.B);
    if (o.tp > 1) s += strfmt(" --tp %d", o.tp);
    if (o.sp != (o.tp > 1)) s += strfmt(" --sp %d", o.sp);
    if (o.cp > 1) s += strfmt(" --cp %d", o.cp);
    if (o.cp_split != defaults.cp_split) s += " --cp-split " + o.cp_split;
    if (o.pp > 1) s += strfmt(" --pp %d", o.pp);
    if (o.pp > 1 || o.pp_schedule != defaults.pp_schedule) s += " --pp-schedule " + o.pp_schedule;
    if (o.vpp > 1) s += strfmt(" --vpp %d", o.vpp);
    if (o.ep > 1) s += strfmt(" --ep %d", o.ep);
    if (o.zero > 0) s += strfmt(" -z %d", o.zero);
    if (o.recompute > 0) s += strfmt(" -r %d", o.recompute);
    if (o.fp8) s += " --fp8 1" + (o.fp8_recipe.empty() ? std::string() : " --fp8-recipe " + o.fp8_recipe);
    if (o.fp8_param_gather) s += " --fp8-param-gather 1";
    if (o.bucket_mb != defaults.bucket_mb) s += strfmt(" --bucket-mb %g", o.bucket_mb);
    return s;
}

// the layout flags --search varies, in the order its command lines give them; one the command line gives is held
inline const std::vector<std::string> SEARCH_FLAGS = {"-b", "--tp", "--sp", "--cp",  "--pp", "--pp-schedule", "--vpp",
                                                      "--ep", "-z", "-r",   "--fp8", "--fp8-recipe"};

// the flags the search holds, as the command line gave them ("--tp 2, --fp8 0"); empty when it varies every one
inline std::string fixed_search_flags(const Options& o) {
    std::string s;
    for (const std::string& flag : SEARCH_FLAGS) {
        auto given = o.given.find(flag);
        if (given != o.given.end()) s += (s.empty() ? "" : ", ") + flag + " " + given->second;
    }
    return s;
}

// the values the search tries for a flag: the one the command line gave, or its own
template <typename T>
std::vector<T> search_choices(const Options& base, const std::string& flag, T given, std::vector<T> tried) {
    return base.given.count(flag) ? std::vector<T>{given} : tried;
}

// --fp8's choices: FP8 where the profile's GPU runs a recipe (the profile's fp8_recipes; tensorwise where it gives
// FP8 rates and no list) and the model has layers between its first and last, unless the command line fixed it
inline std::vector<int> search_fp8_choices(const Options& base, const GPTConfig& config, Device dev,
                                           const HardwareProfile& hw) {
    std::vector<int> tried = {0};
    if (dev == Device::CUDA && !hw.recipes_run().empty() && config.num_layers > 2) tried.push_back(1);
    return search_choices(base, "--fp8", base.fp8, tried);
}

// --fp8-recipe's choices with --fp8 1: the one the command line gave, or each the profile's device runs (every one
// on a CPU, which emulates them); a GPU that runs none gets the default, which the search then refuses
inline std::vector<std::string> search_recipe_choices(const Options& base, const HardwareProfile& hw) {
    if (base.given.count("--fp8-recipe")) return {base.fp8_recipe};
    std::vector<std::string> run = hw.recipes_run();
    return run.empty() ? std::vector<std::string>{"tensorwise"} : run;
}

inline std::vector<int> divisors(int n) {
    std::vector<int> d;
    for (int k = 1; k <= n; k++)
        if (n % k == 0) d.push_back(k);
    return d;
}

inline std::vector<int> powers_of_two_dividing(int n) {
    std::vector<int> p;
    for (int k = 1; n % k == 0 && k <= n; k *= 2) p.push_back(k);
    return p;
}

// Every layout of `gpus` devices: tp within a node and dividing the heads, cp splitting the sequence, pp with
// each schedule (interleaved with 2 and 4 virtual stages), ep dividing dp and the experts, ZeRO 0-3,
// micro-batches of powers of two, recomputation 0-2, and bf16 or FP8 matmuls in each recipe the GPU runs; sp with
// tp. A layout flag the command line gives (SEARCH_FLAGS) takes its value alone, which may be one the search would
// never try. Those the trainer refuses are counted by the flag that refuses them (an FP8 recipe the profile's GPU
// does not run by --fp8-recipe, or by --fp8 when no recipe was given), those that do not fit by how much they lack.
inline std::vector<SearchCandidate> search_layouts(const Options& base, const GPTConfig& config, Device dev,
                                                   const HardwareProfile& hw, int per_node,
                                                   std::map<std::string, int>& refused, int& too_big) {
    std::vector<SearchCandidate> fitting;
    int gpus = base.search_gpus;
    bool sp_given = base.given.count("--sp") > 0;
    // the precisions tried: bf16, and FP8 in each recipe (a recipe the command line gives is held with --fp8 0 too,
    // where the trainer refuses it)
    std::vector<std::pair<int, std::string>> precisions;
    for (int fp8 : search_fp8_choices(base, config, dev, hw)) {
        if (fp8 == 0) precisions.push_back({0, base.fp8_recipe});
        else
            for (const std::string& recipe : search_recipe_choices(base, hw)) precisions.push_back({1, recipe});
    }
    const bool recipe_given = base.given.count("--fp8-recipe") > 0;
    too_big = 0;
    // the grid's sizes the search tries divide the devices; a given one that does not is the trainer's to refuse
    for (int tp : search_choices(base, "--tp", base.tp, divisors(std::gcd(gpus, per_node))))
        for (int cp : search_choices(base, "--cp", base.cp, powers_of_two_dividing(std::max(gpus / tp, 1))))
            for (int pp : search_choices(base, "--pp", base.pp, divisors(std::max(gpus / (tp * cp), 1)))) {
                int dp = std::max(gpus / (tp * cp * pp), 1);
                std::vector<std::string> kinds = {"1f1b"};
                if (pp > 1) kinds = {"afab", "1f1b", "zb", "interleaved", "dualpipev"};
                std::vector<std::pair<std::string, int>> schedules;  // each with its virtual stages
                for (const std::string& kind : search_choices(base, "--pp-schedule", base.pp_schedule, kinds))
                    for (int vpp : search_choices(base, "--vpp", base.vpp,
                                                  pp > 1 && kind == "interleaved" ? std::vector<int>{2, 4} : std::vector<int>{1}))
                        schedules.push_back({kind, vpp});
                std::vector<int> batches;
                for (int B = 1; (long)B * base.T * dp <= base.total_batch; B *= 2) batches.push_back(B);
                for (auto [schedule, vpp] : schedules)
                    for (int ep : search_choices(base, "--ep", base.ep, config.moe() ? divisors(dp) : std::vector<int>{1}))
                        for (int zero : search_choices(base, "-z", base.zero, {0, 1, 2, 3}))
                            for (int B : search_choices(base, "-b", base.B, batches))
                                for (int recompute : search_choices(base, "-r", base.recompute, {0, 1, 2})) for (auto [fp8, recipe] : precisions) {
                                    Options o = base;
                                    o.tp = tp, o.sp = sp_given ? base.sp : tp > 1, o.cp = cp, o.pp = pp,
                                    o.pp_schedule = schedule, o.vpp = vpp;
                                    o.ep = ep, o.zero = zero, o.B = B, o.recompute = recompute, o.fp8 = fp8;
                                    o.fp8_recipe = recipe;
                                    // a recipe the GPU does not run: the trainer's fp8_check_gpu refuses it there
                                    if (fp8 && !hw.runs(recipe.empty() ? "tensorwise" : recipe)) {
                                        refused[recipe_given ? "--fp8-recipe" : "--fp8"]++;
                                        continue;
                                    }
                                    CheckedLayout l;
                                    try {
                                        l = check_layout(o, config, gpus);
                                    } catch (const Error& e) {
                                        std::string why = e.what();
                                        refused[why.substr(0, why.find_first_of(" :"))]++;
                                        continue;
                                    }
                                    ParallelPlan par = parallel_plan(o, l.dp, l.accumulation);
                                    double bytes = 0;
                                    for (int stage = 0; stage < pp; stage++) {
                                        par.pp.rank = stage;
                                        MemoryPlan p = plan_memory(config, B, o.T, omp_get_max_threads(), par, dev);
                                        bytes = std::max(bytes, planned_device_bytes(p, dev, hw));
                                    }
                                    par.pp.rank = 0;
                                    if (bytes > hw.memory_gib * 1073741824.0) {
                                        too_big++;
                                        continue;
                                    }
                                    fitting.push_back({o, bytes, predict_step(config, B, o.T, par, dev, hw, per_node)});
                                }
            }
    std::stable_sort(fitting.begin(), fitting.end(), [](const SearchCandidate& a, const SearchCandidate& b) {
        return a.step.seconds < b.step.seconds;
    });
    return fitting;
}

// the components of a predicted step, named, for saying where the runner-up loses its time
inline std::vector<std::pair<const char*, double>> step_parts(const StepTime& s) {
    return {{"compute", s.compute}, {"dp", s.dp}, {"tp", s.tp}, {"cp", s.cp},
            {"pp", s.pp}, {"ep", s.ep}, {"bubble", s.bubble}};
}

inline void print_search(const Options& o, const GPTConfig& config, Device dev) {
    HardwareProfile hw;
    std::string hw_path;
    if (!plan_hardware(o, dev, hw, hw_path))
        fail("--search: no hardware profile at %s (give --hardware FILE, e.g. one of dev/hardware/)", hw_path.c_str());
    int per_node = devices_per_node(o, hw);
    std::map<std::string, int> refused;
    int too_big = 0;
    std::vector<SearchCandidate> found = search_layouts(o, config, dev, hw, per_node, refused, too_big);
    size_t considered = found.size() + too_big;
    for (auto& [flag, n] : refused) considered += n;
    std::vector<int> fp8 = search_fp8_choices(o, config, dev, hw);
    std::string recipes;
    for (const std::string& r : search_recipe_choices(o, hw)) recipes += (recipes.empty() ? "" : ", ") + r;
    std::string with_fp8 = fp8.size() == 2   ? ", with and without FP8 matmuls (" + recipes + "),"
                           : fp8[0] == 1 ? " with FP8 matmuls (" + recipes + ")"
                                         : "";
    std::string precision = dev == Device::CUDA ? "bf16 mixed precision" + with_fp8 + " on cuda"
                                                : "fp32" + (fp8[0] == 1 ? with_fp8 + " emulated" : "") + " on cpu";
    printf("search: %d devices (%d per node) of %s (%s), model L=%d C=%d NH=%d%s%s, -t %d -d %ld, %s\n", o.search_gpus,
           per_node, hw.name.c_str(), hw_path.c_str(), config.num_layers, config.channels, config.num_heads,
           family_shape(config).c_str(), experts_shape(config).c_str(), o.T, o.total_batch,
           precision.c_str());
    std::string fixed = fixed_search_flags(o);
    if (!fixed.empty()) printf("search: fixed by the command line: %s\n", fixed.c_str());
    printf("layouts considered: %zu; fit: %zu; do not fit in %.1f GiB: %d; refused by the trainer: %zu\n", considered,
           found.size(), hw.memory_gib, too_big, considered - found.size() - too_big);
    for (auto& [flag, n] : refused) printf("  refused by %s: %d\n", flag.c_str(), n);
    if (found.empty()) {
        printf("no layout fits%s\n", fixed.empty() ? "" : (" with " + fixed + " fixed by the command line").c_str());
        return;
    }
    printf("%4s %10s %14s %7s  %s\n", "rank", "GiB", "tokens/s", "MFU", "command");
    for (size_t i = 0; i < found.size() && i < 10; i++) {
        const SearchCandidate& c = found[i];
        printf("%4zu %10.2f %14.0f %6.1f%%  mpirun -np %d ./train_gpt -e %s -t %d -d %ld %s%s\n", i + 1,
               c.bytes / 1073741824.0, c.step.tokens_per_second, 100 * c.step.mfu, o.search_gpus, o.model.c_str(), o.T,
               o.total_batch, layout_flags(c.o).c_str(), dev == Device::CUDA ? "" : " --device cpu");
    }
    printf("best: %s\n", describe_step(found[0].step).c_str());
    if (found.size() < 2) return;
    const StepTime &a = found[0].step, &b = found[1].step;
    std::vector<std::pair<const char*, double>> pa = step_parts(a), pb = step_parts(b);
    std::string why;
    for (size_t i = 0; i < pa.size(); i++) {
        double d = pb[i].second - pa[i].second;
        if (std::fabs(d) >= 0.005 * a.seconds) why += strfmt("%s %s%.3f ms, ", pa[i].first, d > 0 ? "+" : "", d * 1e3);
    }
    if (!why.empty()) why.resize(why.size() - 2);
    printf("runner-up (%s) is %.3f ms slower: %s\n", layout_flags(found[1].o).c_str(), (b.seconds - a.seconds) * 1e3,
           why.empty() ? "every part within 0.5% of the best's" : why.c_str());
}

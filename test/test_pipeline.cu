// Tests of pipeline parallelism in the trainer (llmc/pp.cuh; the schedules themselves are tested in
// test_pp_schedules.cu): the split of the layers over the stages, looped and in DualPipeV's V; the split
// backward of the zero-bubble schedule against the whole backward, dense and with experts; every schedule
// (AFAB, 1F1B, interleaved with 2 virtual stages, ZB-H1, DualPipeV) on 2 stages, 1F1B and ZB-H1 on 3 stages of
// an uneven split, DualPipeV on 4 stages of 8 micro-batches, and pp × dp under ZeRO-1 (1F1B, ZB-H1, DualPipeV)
// and ZeRO-3, pp × tp (sp) and pp × cp (1F1B, DualPipeV), each with 4 micro-batches a step, DualPipeV on pp 4 ×
// dp 2, × tp 2 and, with experts, × ep 2 (8 ranks, 8 micro-batches a rank), against the single-rank run with the
// same global batch over 10 steps (the equivalence principle), the tied embeddings bit-identical on the first
// and the last stage at the end (DualPipeV holds both ends on rank 0, one copy); the counted p2p bytes against
// the formula; the ledger of every stage against --plan; the trace of a step; a pp × dp run resumed
// bit-exactly; and the layouts the pipeline refuses.
//
// The models have odd sizes everywhere (C=33, 3 heads of 11, a vocab of 301), as the other parallel tests'.
#include <catch.hpp>

#include "llmc/plan.h"
#include "llmc/pp.cuh"
#include "mpi_helpers.h"

namespace test_pipeline {

const char* PP_MODEL = "d4c36h4t32v301";     // 4 layers: 2 stages of 2, or 2 × 2 virtual stages of 1
const char* UNEVEN_MODEL = "d5c36h4t32v301"; // 5 layers on 3 stages: 2, 2, 1
const char* V4_MODEL = "d8c36h4t32v301";     // 8 layers: DualPipeV's 8 stages of 1 on 4 ranks

// how many times s occurs in text
size_t count_of(const std::string& text, const std::string& s) {
    size_t n = 0;
    for (size_t at = text.find(s); at != std::string::npos; at = text.find(s, at + 1)) n++;
    return n;
}

// DualPipeV's rank 0 runs both ends of the model: the embeddings and the classifier, one copy of the tied wte
bool dualpipev(const std::string& flags) { return flags.find("dualpipev") != std::string::npos; }
void check_tied_copies(const std::string& run, const std::string& flags) {
    bool copies = run.find("replicas: the embeddings are identical on the first and the last stage") != std::string::npos;
    CHECK(copies == !dualpipev(flags));
    if (dualpipev(flags)) CHECK(run.find("(embeddings on stage 0, the classifier on stage 0)") != std::string::npos);
}

// the measured bubble and the formula's, from "pp: bubble X measured (...); the S formula says Y"
bool bubble_line(const std::string& output, double* measured, double* formula) {
    for (const std::string& line : lines_of(output)) {
        size_t says = line.find(" formula says ");
        if (sscanf(line.c_str(), "pp: bubble %lf measured", measured) == 1 && says != std::string::npos)
            return sscanf(line.c_str() + says + 14, "%lf", formula) == 1;
    }
    return false;
}

TEST_CASE("the layers split as evenly as they can over the virtual stages, the extra ones first", "[pp]") {
    GPTConfig c = parse_model_descriptor("d7c32h2");
    // 7 layers on 3 stages: 3, 2, 2
    std::vector<std::vector<int>> firsts, counts;
    for (int r = 0; r < 3; r++) {
        ModelPart p = stage_part(c, PPSpec{3, r, 1, PPKind::OneFOneB});
        firsts.push_back(p.chunk_first);
        counts.push_back(p.chunk_layers);
        CHECK(p.first == (r == 0));
        CHECK(p.last == (r == 2));
        CHECK(p.embeddings() == (r != 1));
    }
    CHECK(firsts == std::vector<std::vector<int>>{{0}, {3}, {5}});
    CHECK(counts == std::vector<std::vector<int>>{{3}, {2}, {2}});
    // 7 layers as 2 stages × 3 virtual stages: 2, 1, 1, 1, 1, 1; rank 0 runs virtual stages 0, 2, 4
    ModelPart p0 = stage_part(c, PPSpec{2, 0, 3, PPKind::Interleaved}), p1 = stage_part(c, PPSpec{2, 1, 3, PPKind::Interleaved});
    CHECK(p0.chunk_first == std::vector<int>{0, 3, 5});
    CHECK(p0.chunk_layers == std::vector<int>{2, 1, 1});
    CHECK(p1.chunk_first == std::vector<int>{2, 4, 6});
    CHECK(p1.chunk_layers == std::vector<int>{1, 1, 1});
    CHECK(p1.model_layer(2) == 6);
    CHECK(p0.head(2) == false);
    CHECK(p1.head(2) == true);
    // DualPipeV: 7 layers as the V's 4 stages of 2, 2, 2, 1; rank 0 runs stages 0 and 3 (both ends, the tied wte
    // once), rank 1 stages 1 and 2
    ModelPart v0 = stage_part(c, PPSpec{2, 0, 1, PPKind::DualPipeV}), v1 = stage_part(c, PPSpec{2, 1, 1, PPKind::DualPipeV});
    CHECK(v0.chunk_first == std::vector<int>{0, 6});
    CHECK(v0.chunk_layers == std::vector<int>{2, 1});
    CHECK(v1.chunk_first == std::vector<int>{2, 4});
    CHECK(v1.chunk_layers == std::vector<int>{2, 2});
    CHECK((v0.first && v0.last && v0.head(1) && !v0.head(0) && v0.embeddings()));
    CHECK((!v1.first && !v1.last && !v1.embeddings()));
    CHECK(v0.model_layer(2) == 6);
    // 8 layers on 4 ranks: rank r runs layers r and 7 - r
    for (int r = 0; r < 4; r++)
        CHECK(stage_part(parse_model_descriptor(V4_MODEL), PPSpec{4, r, 1, PPKind::DualPipeV}).chunk_first ==
              std::vector<int>{r, 7 - r});
    // validation's forward-only lists: down the V and back up, the bottom handed over on rank 1
    auto list = [](int rank) {
        std::string s;
        for (const PPAction& a : pp_forward_only(PPSpec{2, rank, 1, PPKind::DualPipeV}, 1)) s += pp_describe(a) + "; ";
        return s;
    };
    CHECK(list(0) == "F micro 0 chunk 0; send act micro 0 chunk 0 to rank 1; recv act micro 0 chunk 1 from rank 1; "
                     "F micro 0 chunk 1; ");
    CHECK(list(1) == "recv act micro 0 chunk 0 from rank 0; F micro 0 chunk 0; F micro 0 chunk 1; "
                     "send act micro 0 chunk 1 to rank 0; ");
    // too few layers for the virtual stages: one line naming the flags
    CHECK_THROWS_WITH(stage_part(c, PPSpec{4, 0, 2, PPKind::Interleaved}), Catch::Contains("--pp 4 --vpp 2"));
    CHECK_THROWS_WITH(stage_part(c, PPSpec{4, 0, 1, PPKind::DualPipeV}),
                      Catch::Contains("--pp 4 --pp-schedule dualpipev: the model's 7 layers cannot fill 8"));
}

TEST_CASE("every schedule on 2 stages, 1F1B and ZB-H1 on 3 stages of 2, 2 and 1 layers, and DualPipeV on 4 stages of 8 "
          "micro-batches give the single-rank run's losses over 10 steps of 4 (or 8) micro-batches; the tied "
          "embeddings stay identical; the p2p bytes equal the formula; DualPipeV's trace", "[pp]") {
    Data data;
    TempDir out;
    struct Layout {
        const char* name;
        const char* model;
        int ranks, b;
        std::string flags;
    };
    std::map<std::string, std::map<std::string, double>> reference;
    for (const char* model : {PP_MODEL, UNEVEN_MODEL, V4_MODEL}) {
        REQUIRE(single_ok(data.flags(2, 128, EQUIVALENCE_STEPS, model), out / model));
        reference[model] = losses(out / model);
    }
    std::string trace = out / "dualpipev.json";
    for (Layout l : {Layout{"afab", PP_MODEL, 2, 2, " --pp 2 --pp-schedule afab"},
                     Layout{"1f1b", PP_MODEL, 2, 2, " --pp 2 --pp-schedule 1f1b"},
                     Layout{"interleaved", PP_MODEL, 2, 2, " --pp 2 --pp-schedule interleaved --vpp 2"},
                     Layout{"zb", PP_MODEL, 2, 2, " --pp 2 --pp-schedule zb"},
                     Layout{"dualpipev", PP_MODEL, 2, 2, " --pp 2 --pp-schedule dualpipev --trace '" + trace + "'"},
                     Layout{"1f1b_pp3", UNEVEN_MODEL, 3, 2, " --pp 3"},
                     Layout{"zb_pp3_r2", UNEVEN_MODEL, 3, 2, " --pp 3 --pp-schedule zb -r 2"},
                     Layout{"dualpipev_pp4", V4_MODEL, 4, 1, " --pp 4 --pp-schedule dualpipev"}}) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(l.ranks, data.flags(l.b, 128, EQUIVALENCE_STEPS, l.model) + l.flags + " --debug-check-replicas 1", dir, &run)) continue;
        check_close(losses(dir), reference[l.model], 1e-5);
        require_pp_counted_equals_formula(run);
        check_tied_copies(run, l.flags);
        double measured = -1, formula = -1;
        CHECK(bubble_line(run, &measured, &formula));
        CHECK(measured >= 0);
        CHECK(formula > 0);
    }
    // DualPipeV's step on 2 ranks: 4 micro-batches through 2 chunks on each, every backward split into B and W
    std::string json = read_file(trace);
    for (const char* category : {"forward", "backward", "weight"}) {
        INFO(category);
        CHECK(count_of(json, strfmt("\"cat\": \"%s\"", category)) == 16);
    }
    CHECK(count_of(json, "\"chunk\": 1,") > 0);
    CHECK(count_of(json, "\"name\": \"rank 0 (stages 0 and 3)\"") == 1);
    CHECK(count_of(json, "\"name\": \"rank 1 (stages 1 and 2)\"") == 1);
    CHECK(count_of(json, "\"chunk\": 1, \"stage\": 3") > 0);
}

TEST_CASE("pp 2 × dp 2 under ZeRO-1 (1F1B, ZB-H1 and DualPipeV) and ZeRO-3, pp 2 × tp 2 (sp; 1F1B, ZB-H1 with -r 2, DualPipeV) "
          "and pp 2 × cp 2 (1F1B, DualPipeV) give the single-rank run's losses over 10 steps of 4 micro-batches", "[pp]") {
    Data data;
    TempDir out;
    // the same global batch of 8 sequences: 4 micro-batches of 2 on one rank, or of 1 on each of 2 dp ranks
    REQUIRE(single_ok(data.flags(2, 128, EQUIVALENCE_STEPS, PP_MODEL), out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    struct Layout {
        const char* name;
        int b;
        const char* flags;
    };
    for (Layout l : {Layout{"pp2_dp2_z1", 1, " --pp 2 -z 1"}, Layout{"pp2_dp2_z1_zb", 1, " --pp 2 -z 1 --pp-schedule zb"},
                     Layout{"pp2_dp2_z1_dualpipev", 1, " --pp 2 -z 1 --pp-schedule dualpipev"},
                     Layout{"pp2_dp2_z3", 1, " --pp 2 -z 3"},
                     Layout{"pp2_tp2", 2, " --pp 2 --tp 2"}, Layout{"pp2_tp2_zb_r2", 2, " --pp 2 --tp 2 --pp-schedule zb -r 2"},
                     Layout{"pp2_tp2_dualpipev", 2, " --pp 2 --tp 2 --pp-schedule dualpipev"},
                     Layout{"pp2_cp2", 2, " --pp 2 --cp 2"}, Layout{"pp2_cp2_dualpipev", 2, " --pp 2 --cp 2 --pp-schedule dualpipev"}}) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(4, data.flags(l.b, 128, EQUIVALENCE_STEPS, PP_MODEL) + l.flags + " --debug-check-replicas 1", dir, &run)) continue;
        check_close(losses(dir), reference, 1e-5);
        require_pp_counted_equals_formula(run);
        // a split backward under sp gathers the norm outputs again in its weight-gradient steps
        if (std::string(l.flags).find("--tp") != std::string::npos) require_tp_counted_equals_formula(run, 2, true);
        check_tied_copies(run, l.flags);
        if (l.b == 1) require_counted_equals_formula(run);
    }
}

TEST_CASE("DualPipeV on pp 4 × dp 2 (ZeRO-1) and pp 4 × tp 2 (sp), and a GPT-2 with experts on pp 2 × ep 2 and pp 4 × "
          "ep 2, give the single-rank run's losses over 10 steps of 8 micro-batches a rank", "[pp]") {
    Data data;
    TempDir out;
    // the V's 8 stages of a layer on 4 ranks; the global batch of 16 sequences gives each dp rank 8 micro-batches
    const char* with_experts = "d8c36h4t32v301e4k2";
    const std::vector<EquivalenceLayout> layouts = {
        {"pp4_dp2_z1", V4_MODEL, 8, 1, " --pp 4 -z 1 --pp-schedule dualpipev --debug-check-replicas 1", 16},
        {"pp4_tp2_sp", V4_MODEL, 8, 2, " --pp 4 --tp 2 --sp 1 --pp-schedule dualpipev --debug-check-replicas 1", 16},
        {"moe_pp2_ep2", with_experts, 4, 1, " --pp 2 --ep 2 -z 1 --pp-schedule dualpipev", 16},
        {"moe_pp4_ep2", with_experts, 8, 1, " --pp 4 --ep 2 -z 1 --pp-schedule dualpipev", 16}};
    std::map<std::string, std::string> outputs = check_layouts(data, out, layouts);
    for (const EquivalenceLayout& l : layouts) {
        INFO(l.name);
        REQUIRE(outputs.count(l.name));
        check_tied_copies(outputs[l.name], l.flags);
    }
}

TEST_CASE("--plan predicts the ledger of every stage under every schedule, with dp, ZeRO and tp; the micro-batches "
          "in flight are the schedule's", "[pp]") {
    GPTConfig c = parse_model_descriptor(UNEVEN_MODEL);
    struct Layout {
        PPKind kind;
        int N, V, m;
    };
    for (Layout l : {Layout{PPKind::AFAB, 2, 1, 4}, Layout{PPKind::OneFOneB, 3, 1, 4}, Layout{PPKind::OneFOneB, 2, 1, 1},
                     Layout{PPKind::Interleaved, 2, 2, 4}, Layout{PPKind::Interleaved, 2, 2, 6},
                     Layout{PPKind::ZeroBubble, 3, 1, 4}, Layout{PPKind::ZeroBubble, 2, 1, 8},
                     Layout{PPKind::DualPipeV, 2, 1, 4}, Layout{PPKind::DualPipeV, 2, 1, 7}})
        for (int zero : {0, 1, 3})
            for (int tp : {1, 2})
                for (int stage = 0; stage < l.N; stage++) {
                    INFO(pp_schedule_name(l.kind) << " N=" << l.N << " V=" << l.V << " m=" << l.m << ", stage " << stage
                                                  << ", tp " << tp << ", ZeRO-" << zero);
                    PPSpec pp{l.N, stage, l.V, l.kind};
                    PPSchedule s = pp_schedule(l.kind, l.N, l.m, l.V);
                    int slots = Pipeline<float>::slots_needed(s[stage], pp);
                    CHECK(slots == planned_in_flight(pp, l.m));
                    Comm group;  // dp 2: only the size and rank matter until a collective runs
                    group.size = 2;
                    GPT m;
                    ModelLayout layout;
                    layout.own = DataParallel<float>::model_buffers(zero), layout.tp = TPSpec{tp, 0, tp > 1};
                    layout.part = stage_part(c, pp), layout.slots = slots;
                    layout.split_backward = pp_kind_splits_backward(l.kind);
                    gpt_allocate(m, c, 2, 16, layout);
                    DataParallel dpr(m, group, zero, 1000, StageLinks{&group, nullptr});
                    ParallelPlan par{2, zero, 1000, l.m, tp, tp > 1};
                    par.pp = pp;
                    MemoryPlan plan = plan_memory(c, 2, 16, omp_get_max_threads(), par);
                    for (int i = 0; i < MEM_CATEGORIES; i++) {
                        INFO(mem_category_name(i));
                        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                    }
                }
    // DualPipeV's chunks in flight, as the runner's slot plan counts them in its lists, on 2 to 8 ranks
    for (int N = 2; N <= 8; N++)
        for (int m : {2 * N, 2 * N + 3, 32})
            for (int r = 0; r < N; r++) {
                INFO("dualpipev N=" << N << " m=" << m << ", rank " << r);
                PPSpec pp{N, r, 1, PPKind::DualPipeV};
                CHECK(Pipeline<float>::slots_needed(matched_pp_schedule(PPKind::DualPipeV, N, m, 1).actions[r], pp) ==
                      planned_in_flight(pp, m));
            }
    // the command line prints a plan for each stage
    Data data;
    CommandResult r = single(data.flags(2, 128, 1, UNEVEN_MODEL) + " --plan --world 3 --pp 3");
    INFO(r.output);
    REQUIRE(r.status == 0);
    for (int stage = 0; stage < 3; stage++)
        CHECK(r.output.find(strfmt("predicted memory per rank on stage %d", stage)) != std::string::npos);
    CHECK(r.output.find("pp: layers 0-1 on stage 0; 2-3 on stage 1; 4 on stage 2") != std::string::npos);
}

TEST_CASE("--trace writes every rank's actions of the profiled step as a Chrome trace, which the plot script draws",
          "[pp]") {
    Data data;
    TempDir out;
    std::string trace = out / "pipeline.json", run;
    // 2 steps: the trace records the last (the third step, --profile-step's default, is past the run's end)
    REQUIRE(train_ok(2, data.flags(2, 128, 2, PP_MODEL) + " --pp 2 --trace '" + trace + "'", out / "run", &run));
    CHECK(run.find("trace: written to") != std::string::npos);
    std::string json = read_file(trace);
    // 4 micro-batches, each with a forward and a backward on each of the 2 ranks
    auto count = [&](const std::string& s) { return count_of(json, s); };
    CHECK(count("\"cat\": \"forward\"") == 8);
    CHECK(count("\"cat\": \"backward\"") == 8);
    CHECK(count("\"cat\": \"p2p\"") > 0);
    CHECK(count("\"name\": \"process_name\"") == 2);
    // the whole file is JSON, and the script turns it into a PNG
    std::string png = out / "pipeline.png";
    CommandResult plot = run_command(strfmt("scripts/plot_pipeline.py '%s' -o '%s'", trace.c_str(), png.c_str()));
    INFO(plot.output);
    CHECK(plot.status == 0);
    CHECK(read_file(png).compare(1, 3, "PNG") == 0);
    // what is not a trace, or an action without its times, is one line naming the file, not a traceback
    for (std::string bad : {"[1, 2]", "{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"forward\", \"pid\": 0}]}"}) {
        INFO(bad);
        std::string path = out / "bad.json";
        File(path, "wb").write(bad.data(), bad.size());
        CommandResult refused = run_command(strfmt("scripts/plot_pipeline.py '%s' -o '%s'", path.c_str(), png.c_str()));
        INFO(refused.output);
        CHECK(refused.status == 1);
        CHECK(lines_of(refused.output).size() == 1);
        CHECK(refused.output.find("plot_pipeline.py: " + path) == 0);
    }
}

TEST_CASE("a pp 2 × dp 2 run resumed from its checkpoint continues bit-exactly; its model file is the whole model",
          "[pp]") {
    Data data;
    TempDir out;
    GPTConfig c = parse_model_descriptor(PP_MODEL);
    // 1F1B under ZeRO-0 and ZeRO-2, and DualPipeV (both ends of the model on rank 0) under ZeRO-1
    const std::vector<std::string> layouts = {" -z 0", " -z 2", " -z 1 --pp-schedule dualpipev"};
    for (size_t i = 0; i < layouts.size(); i++) {
        INFO("pp 2 × dp 2," << layouts[i]);
        check_resumes_bit_exactly(4, data.flags(1, 128, 6, PP_MODEL) + " --pp 2" + layouts[i], out / strfmt("whole%zu", i),
                                  out / strfmt("resumed%zu", i), num_parameters(c));
    }
}

TEST_CASE("layouts the pipeline cannot run are refused with one line", "[pp]") {
    Data data;
    std::string flags = data.flags(2, 128, 1, PP_MODEL);
    check_one_line_error(single(flags + " --pp 8 --plan --world 8"), {"--pp 8", "4 layers"});
    check_one_line_error(single(flags + " --pp 2 --vpp 2 --pp-schedule 1f1b --plan --world 2"), {"--vpp 2", "interleaved"});
    // 4 micro-batches do not split into groups of 3 stages
    check_one_line_error(single(data.flags(2, 128, 1, "d6c36h4t32v301") + " --pp 3 --pp-schedule interleaved --plan --world 3"),
                         {"interleaved", "--pp 3"});
    check_one_line_error(single(flags + " --pp 2 --pp-schedule zb -z 2 --plan --world 4"), {"zb", "-z 2"});
    // DualPipeV defers weight gradients as ZB-H1 does, and fills its V with 2·pp micro-batches
    check_one_line_error(single(data.flags(1, 128, 1, PP_MODEL) + " --pp 2 --pp-schedule dualpipev -z 2 --plan --world 4"),
                         {"dualpipev", "-z 2"});
    check_one_line_error(single(data.flags(2, 128, 1, "d6c36h4t32v301") + " --pp 3 --pp-schedule dualpipev --plan --world 3"),
                         {"dualpipev", "4 micro-batches", "twice --pp 3"});
}

TEST_CASE("a split backward and its weight-gradient step give the whole backward's gradients, bit for bit; with "
          "experts too", "[pp]") {
    // with experts (4 of them, top-2) the B step takes the experts' weight gradients and the W step attention's
    for (const char* model : {UNEVEN_MODEL, "d2c48h4t32v301e4k2"}) {
        GPTConfig c = parse_model_descriptor(model);
        Rng rng(5);
        std::vector<float> params(num_parameters(c));
        gpt_init_random(c, params.data(), 11);
        std::vector<int> inputs(2 * 16), targets(2 * 16);
        for (size_t i = 0; i < inputs.size(); i++) inputs[i] = (int)rng.below(301), targets[i] = (int)rng.below(301);
        for (int recompute : {0, 1, 2}) {
            INFO(model << ", -r " << recompute);
            GPT whole, split;
            ModelLayout layout;
            layout.recompute = recompute;
            gpt_allocate(whole, c, 2, 16, layout);
            layout.split_backward = true;
            gpt_allocate(split, c, 2, 16, layout);
            for (GPT* m : {&whole, &split}) {
                gpt_set_params(*m, params.data());
                gpt_zero_grad(*m);
                gpt_forward(*m, inputs.data(), targets.data(), 2, 16);
            }
            gpt_backward(whole, 1.0f / 32);
            gpt_backward(split, 1.0f / 32);
            bool differs = memcmp(whole.grads, split.grads, whole.num_parameters * sizeof(float)) != 0;
            CHECK(differs);  // the matmuls' weight gradients are still missing
            gpt_weight_grads_chunk(split, 0, 0);
            CHECK(memcmp(whole.grads, split.grads, whole.num_parameters * sizeof(float)) == 0);
        }
    }
}

}  // namespace test_pipeline

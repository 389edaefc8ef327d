// Tests of Llama 3 under the parallelisms on the CPU, under `mpirun --oversubscribe`, against the single-rank
// Llama run with the same global batch over 10 steps of 2 or 4 micro-batches (the equivalence principle):
// dp 2 under ZeRO-1 and ZeRO-3; tp 2 with and without sp, which splits the 4 query heads and the 2 key/value
// heads; tp 4 (with sp, and without it under ZeRO-2), which holds each key/value head on two ranks and sums its
// gradient over them; pp 2 under 1F1B, ZB-H1, the interleaved schedule and DualPipeV, pp 2 × dp 2, and
// DualPipeV under pp 2 × tp 2 and pp 2 × cp 2; DualPipeV on pp 4 (an 8-layer Llama, 8 micro-batches a rank)
// alone, × dp 2 (ZeRO-1), × tp 2 (sp), and with experts × ep 2; a Llama whose classifier is tied to wte (Llama
// 3.2's) under pp 2, where the first and the last stage sum the tied gradient, under DualPipeV × dp 2 (ZeRO-1),
// where rank 0 holds both ends and one wte, and under tp 2; the experts' Llama under DualPipeV × ep 2; the bytes
// counted against the formulas. Also the ledger of every rank against --plan, where an untied lm_head lives (on
// the last stage alone), and a Llama checkpoint resumed under another layout (tp 4's too, whose replicated
// key/value heads two optimizer files hold).
//
// Under cp 2 (zig-zag and contiguous, and cp 2 × tp 2) RoPE turns each token by its position in the whole
// sequence, which is not contiguous on a rank, and the ring carries the key/value heads only: the counted cp
// bytes equal the formula, which counts KV/NH of what GPT-2's ring sends.
//
// The models: 4 layers (pp 2 × 2 virtual stages of 1), 32 channels in 4 heads of 8 sharing 2 key/value heads,
// 80 hidden units (tp 2 splits each of SwiGLU's two input matrices), a vocab of 301 (no multiple of 128: memory
// pads it to 384, of which tp 4's last rank holds 13 real rows and 83 padding rows, the files only the 301); one
// with Mixtral's experts (4 SwiGLU experts of 80 hidden units in every layer, top 2) under ep 2 and ep 2 × tp 2.
#include <omp.h>

#include "llmc/plan.h"
#include "llmc/pp.cuh"
#include "llmc/zero.cuh"
#include "mpi_helpers.h"

namespace test_llama_parallel {

const char* LLAMA = "l4c32h4g2f80t32v301";
const char* TIED = "l4c32h4g2f80t32v301w";
const char* MOE = "l4c32h4g2f80t32v301e4k2";  // Mixtral's shape: 4 SwiGLU experts in every layer, top 2
const char* LLAMA8 = "l8c32h4g2f80t32v301";     // DualPipeV's 8 stages on pp 4, a layer each
const char* MOE8 = "l8c32h4g2f80t32v301e4k2";   // the same with experts

TEST_CASE("Llama under dp 2 (ZeRO-1, ZeRO-3), tp 2 with and without sp (and with sp under -r 1 and 2), tp 4 over 2 key/value heads, pp 2 (1F1B, ZB-H1, interleaved, DualPipeV), pp 2 × dp 2, "
          "DualPipeV × tp 2, cp 2 (both splits) and cp 2 × tp 2 gives the single-rank run's losses over 10 steps with accumulation; a "
          "tied Llama under pp 2, DualPipeV × dp 2, tp 2 and cp 2 too; a Llama with SwiGLU experts under ep 2, ep 2 × tp 2 (-r 0 and 2), dp 2 and DualPipeV × ep 2",
          "[llama][parallel]") {
    Data data;
    TempDir out;
    std::vector<EquivalenceLayout> layouts = {
        {"dp2_z1", LLAMA, 2, 2, " -z 1"}, {"dp2_z3", LLAMA, 2, 2, " -z 3"},
        {"tp2_sp", LLAMA, 2, 2, " --tp 2 --sp 1"}, {"tp2", LLAMA, 2, 2, " --tp 2 --sp 0"},
        {"tp2_sp_r1", LLAMA, 2, 2, " --tp 2 --sp 1 -r 1"}, {"tp2_sp_r2", LLAMA, 2, 2, " --tp 2 --sp 1 -r 2"},
        {"tp4_sp", LLAMA, 4, 2, " --tp 4 --sp 1 --debug-check-replicas 1"},
        {"tp4_z2", LLAMA, 4, 2, " --tp 4 --sp 0 -z 2 --debug-check-replicas 1"},
        {"pp2_1f1b", LLAMA, 2, 2, " --pp 2 --debug-check-replicas 1"}, {"pp2_zb", LLAMA, 2, 2, " --pp 2 --pp-schedule zb"},
        {"pp2_interleaved", LLAMA, 2, 2, " --pp 2 --pp-schedule interleaved --vpp 2"},
        {"pp2_dp2", LLAMA, 4, 1, " --pp 2 -z 1 --debug-check-replicas 1"},
        {"pp2_dualpipev", LLAMA, 2, 2, " --pp 2 --pp-schedule dualpipev"},
        {"pp2_tp2_dualpipev", LLAMA, 4, 2, " --pp 2 --tp 2 --pp-schedule dualpipev"},
        {"cp2_zigzag", LLAMA, 2, 2, " --cp 2 --cp-split zigzag"},
        {"cp2_contiguous", LLAMA, 2, 2, " --cp 2 --cp-split contiguous"},
        {"cp2_tp2", LLAMA, 4, 2, " --cp 2 --tp 2 --sp 1"},
        {"tied_pp2", TIED, 2, 2, " --pp 2 --debug-check-replicas 1"},
        {"tied_pp2_dp2_dualpipev", TIED, 4, 1, " --pp 2 --pp-schedule dualpipev -z 1 --debug-check-replicas 1"},
        {"tied_tp2", TIED, 2, 2, " --tp 2 --sp 1"}, {"tied_cp2", TIED, 2, 2, " --cp 2"},
        {"moe_ep2", MOE, 2, 2, " --ep 2 -z 1"}, {"moe_ep2_tp2", MOE, 4, 2, " --ep 2 --tp 2 -z 1"},
        {"moe_ep2_tp2_r2", MOE, 4, 2, " --ep 2 --tp 2 --sp 1 -z 1 -r 2"}, {"moe_dp2", MOE, 2, 2, " -z 1"},
        {"moe_ep2_pp2_dualpipev", MOE, 4, 1, " --ep 2 --pp 2 --pp-schedule dualpipev -z 1"}};
    std::map<std::string, std::string> outputs = check_layouts(data, out, layouts);
    // under pp, where the embeddings and the classifier live: DualPipeV's V holds both on rank 0
    for (const EquivalenceLayout& l : layouts) {
        if (!outputs.count(l.name)) continue;
        INFO(l.name);
        const std::string& run = outputs[l.name];
        std::string flags = l.flags;
        bool tied = l.model == TIED, v_shape = flags.find("dualpipev") != std::string::npos;
        if (flags.find("--pp") != std::string::npos)
            CHECK(run.find(v_shape ? "(embeddings on stage 0, the classifier on stage 0)"
                           : tied  ? "(embeddings on stages 0 and 1, the classifier on stage 1)"
                                   : "(embeddings on stage 0, the classifier on stage 1)") != std::string::npos);
        if (flags.find("replicas") != std::string::npos)  // only a tied classifier on another stage keeps a second wte
            CHECK((run.find("replicas: the embeddings are identical on the first and the last stage") != std::string::npos) ==
                  (tied && !v_shape));
    }
}

TEST_CASE("DualPipeV on pp 4 (an 8-layer Llama, 8 micro-batches a rank) alone, with dp 2 (ZeRO-1) and with tp 2 (sp), "
          "on pp 2 × cp 2, and a Llama with SwiGLU experts on pp 4 × ep 2, gives the single-rank run's losses over 10 "
          "steps; rank 0 holds the embeddings and the classifier",
          "[llama][parallel]") {
    Data data;
    TempDir out;
    // a global batch of 16 sequences: 8 micro-batches on each dp rank
    std::map<std::string, std::string> outputs = check_layouts(
        data, out,
        {{"pp4", LLAMA8, 4, 2, " --pp 4 --pp-schedule dualpipev", 16},
         {"pp4_dp2_z1", LLAMA8, 8, 1, " --pp 4 -z 1 --pp-schedule dualpipev --debug-check-replicas 1", 16},
         {"pp4_tp2_sp", LLAMA8, 8, 2, " --pp 4 --tp 2 --sp 1 --pp-schedule dualpipev", 16},
         {"pp2_cp2", LLAMA, 4, 2, " --pp 2 --cp 2 --pp-schedule dualpipev"},
         {"moe_pp4_ep2", MOE8, 8, 1, " --pp 4 --ep 2 -z 1 --pp-schedule dualpipev", 16}});
    CHECK(outputs.size() == 5);  // every run finished
    for (const auto& [name, run] : outputs) {
        INFO(name);
        CHECK(run.find("(embeddings on stage 0, the classifier on stage 0)") != std::string::npos);
    }
}

TEST_CASE("--plan predicts the ledger of every Llama rank under dp with ZeRO-1 and 3, tp with sp (tp 4 replicating the "
          "key/value heads), cp and pp (1F1B, DualPipeV); an untied lm_head lives on the last stage only, a tied wte on both "
          "ends, and under DualPipeV both on rank 0, wte once",
          "[llama][parallel]") {
    for (const char* model : {LLAMA, TIED}) {
        GPTConfig c = parse_model_descriptor(model);
        // the stages' parameters: the whole model, plus the last stage's copy of a tied wte
        PPSpec two{2, 0, 1, PPKind::OneFOneB};
        size_t stages = num_parameters(c, 1, stage_part(c, two)) + num_parameters(c, 1, stage_part(c, PPSpec{2, 1, 1, PPKind::OneFOneB}));
        CHECK(stages == num_parameters(c) + (c.tied() ? (size_t)c.padded_vocab_size * c.channels : 0));
        // DualPipeV's V: rank 0 holds both ends, so its stages hold the whole model, each tensor once
        size_t v_stages = num_parameters(c, 1, stage_part(c, PPSpec{2, 0, 1, PPKind::DualPipeV})) +
                          num_parameters(c, 1, stage_part(c, PPSpec{2, 1, 1, PPKind::DualPipeV}));
        CHECK(v_stages == num_parameters(c));
        for (int zero : {1, 3})
            for (int tp : {1, 2, 4})  // tp 4: each key/value head on two ranks
                for (int cp : {1, 2})
                    for (auto [N, kind] : {std::pair{1, PPKind::OneFOneB}, {2, PPKind::OneFOneB}, {2, PPKind::DualPipeV}})
                        for (int stage = 0; stage < N; stage++)
                            for (int rank = 0; rank < tp * cp; rank++) {  // tp fastest, then cp
                                INFO(model << " ZeRO-" << zero << " dp 2, tp " << tp << ", cp " << cp << ", rank " << rank
                                           << ", pp " << N << " (" << pp_schedule_name(kind) << ") stage " << stage);
                                PPSpec pp{N, stage, 1, kind};
                                int micro = 4, slots = N > 1 ? planned_in_flight(pp, micro) : 1;
                                Comm group;  // dp 2 × cp: only the size and rank matter until a collective runs
                                group.size = 2 * cp;
                                group.rank = rank / tp;
                                GPT m;
                                ModelLayout layout;
                                layout.own = DataParallel<float>::model_buffers(zero);
                                layout.tp = TPSpec{tp, rank % tp, tp > 1};
                                layout.cp = CPSpec{cp, rank / tp, CPSplit::ZigZag};
                                if (N > 1) layout.part = stage_part(c, pp);
                                layout.slots = slots, layout.split_backward = N > 1 && pp_kind_splits_backward(kind);
                                layout.accumulation = micro;
                                gpt_allocate(m, c, 2, 16, layout);
                                DataParallel dpr(m, group, zero, 1000, StageLinks{N > 1 ? &group : nullptr, nullptr});
                                ParallelPlan par{2, zero, 1000, micro, tp, tp > 1};
                                par.cp = cp;
                                if (N > 1) par.pp = pp;
                                MemoryPlan plan = plan_memory(c, 2, 16, omp_get_max_threads(), par);
                                for (int i = 0; i < MEM_CATEGORIES; i++) {
                                    INFO(mem_category_name(i));
                                    CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                                }
                            }
    }
}

TEST_CASE("--plan predicts the ledger of every rank of a Llama with SwiGLU experts under ep 2, with tp, ZeRO-1 and 3",
          "[llama][parallel]") {
    GPTConfig c = parse_model_descriptor(MOE);
    for (int ep : {1, 2})
        for (int tp : {1, 2})
            for (int zero : {1, 3}) {
                INFO("ep " << ep << " (dp 2), tp " << tp << ", ZeRO-" << zero);
                Comm group, replicas, experts;  // only the sizes matter until a collective runs
                group.size = 2, replicas.size = 2 / ep, experts.size = ep;
                GPT m;
                ModelLayout layout;
                layout.own = DataParallel<float>::model_buffers(zero);
                layout.tp = TPSpec{tp, 0, tp > 1}, layout.ep = ep;
                gpt_allocate(m, c, 2, 16, layout);
                DataParallel dpr(m, group, zero, 1000, StageLinks{}, ExpertLinks{ep > 1 ? &replicas : nullptr, &experts});
                ParallelPlan par{2, zero, 1000, 1, tp, tp > 1};
                par.ep = ep;
                MemoryPlan plan = plan_memory(c, 2, 16, omp_get_max_threads(), par);
                for (int i = 0; i < MEM_CATEGORIES; i++) {
                    INFO(mem_category_name(i));
                    CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                }
            }
}

TEST_CASE("Llama layouts tp cannot split are refused in one line naming the flag", "[llama][parallel]") {
    Data data;
    struct Refused {
        const char *model, *flags;
        std::vector<std::string> words;
    };
    for (const Refused& r : {Refused{LLAMA, "--world 3 --tp 3", {"--tp 3", "heads (4)"}},
                             Refused{"l2c96h12g4f96t32v301", "--world 6 --tp 6", {"--tp 6", "key/value heads (4)"}},
                             Refused{"l4c32h4g2f81t32v301", "--world 2 --tp 2", {"--tp 2", "81", "fcw"}}}) {
        INFO(r.model << " " << r.flags);
        check_one_line_error(single(data.flags(2, 128, 1, r.model) + " --plan " + r.flags), r.words);
    }
}

TEST_CASE("a Llama checkpoint resumes under another layout with the uninterrupted single-rank run's losses: "
          "tp 2 × dp 2 to pp 2 × dp 2, pp 2 (1F1B and DualPipeV) to one rank, one rank to dp 2 under ZeRO-3, tp 4 (key/value heads on two "
          "ranks each) to tp 2; tied too; --convert of the checkpoints",
          "[llama][parallel]") {
    Data data;
    TempDir out;
    for (const char* model : {LLAMA, TIED}) {
        INFO(model);
        std::map<std::string, double> reference = resume_reference_losses(data, model, out / (std::string(model) + "_one"));
        check_resume(data, model, {4, "-b 2 --tp 2 -z 1"}, {4, "-b 2 --pp 2 -z 1"}, reference, out / (std::string(model) + "_tp"));
        check_resume(data, model, {2, "-b 4 --pp 2"}, {1, "-b 4"}, reference, out / (std::string(model) + "_pp"));
        // DualPipeV's rank 0 holds both ends (a tied wte once), its other ranks two chunks of layers apart
        check_resume(data, model, {2, "-b 2 --pp 2 --pp-schedule dualpipev"}, {1, "-b 4"}, reference,
                     out / (std::string(model) + "_dualpipev"));
        check_resume(data, model, {1, "-b 4"}, {2, "-b 2 -z 3"}, reference, out / (std::string(model) + "_z3"));
        // tp 4 holds each of the 2 key/value heads on two ranks, whose optimizer files both hold its state
        check_resume(data, model, {4, "-b 4 --tp 4"}, {2, "-b 4 --tp 2"}, reference, out / (std::string(model) + "_tp4"));
        // --convert of a checkpoint written under tp 2 × dp 2 (then resumed under pp 2 × dp 2): llm.c's Llama file,
        // the checkpoint's whole model byte for byte
        std::string ckpt = out / (std::string(model) + "_tp/ckpt_00000008"), file = out / (std::string(model) + ".bin");
        CommandResult conv = single("--convert '" + ckpt + "' --to '" + file + "'");
        INFO(conv.output);
        REQUIRE(conv.status == 0);
        CHECK(read_file(file) == read_file(ckpt + "/model.bin"));
        int version;
        CHECK(same_model_shape(read_model_header(file, &version), parse_model_descriptor(model)));
    }
}

}  // namespace test_llama_parallel

// Tests of tensor parallelism with sequence parallelism (Megatron-LM's layout) on the CPU, under
// `mpirun --oversubscribe`: tp 2 and 4, with and without sp, and tp × dp with ZeRO, against the single-rank run
// with the same global batch (the equivalence principle); the replicated tensors identical across a tp group;
// the ledger of every tp and dp rank against --plan; the counted tp and dp bytes against the formulas; the
// whole model saved under one tp and loaded under another; and the layouts that are refused.
//
// The model, d3c36h4t32v301, has 4 heads and C=36 (4C=144), which tp 2 and 4 split, and a vocab of 301, which no
// tp divides (padded to 384). -t 16 -b 2 gives B·T = 32 rows per micro-batch, which tp 2 and 4 divide under sp.
#include <unistd.h>

#include "llmc/checkpoint.h"
#include "llmc/plan.h"
#include "llmc/tp.cuh"
#include "llmc/zero.cuh"
#include "mpi_helpers.h"

namespace test_tensor_parallel {

const char* TP_MODEL = "d3c36h4t32v301";

TEST_CASE("tp = 2 and 4, with and without sp, give the single-rank run's losses over 10 steps, with accumulation", "[tp]") {
    Data data;
    TempDir out;
    for (int shuffle : {1, 0}) {
        // one dp rank: 2 micro-steps of b=2 × t=16
        std::string flags = data.flags(2, 64, EQUIVALENCE_STEPS, TP_MODEL) + strfmt(" --shuffle %d", shuffle);
        REQUIRE(single_ok(flags, out / strfmt("one_s%d", shuffle)));
        std::map<std::string, double> reference = losses(out / strfmt("one_s%d", shuffle));
        for (int tp : {2, 4})
            for (int sp : {0, 1}) {
                INFO("tp " << tp << " sp " << sp << " --shuffle " << shuffle);
                std::string dir = out / strfmt("tp%d_sp%d_s%d", tp, sp, shuffle), run;
                if (!train_ok(tp, flags + strfmt(" --tp %d --sp %d", tp, sp), dir, &run)) continue;
                check_close(losses(dir), reference, 1e-5);
            }
    }
}

TEST_CASE("tp 2 × dp 2 with ZeRO-0, 1 and 3 gives the single-rank run's losses over 10 steps, with accumulation", "[tp]") {
    Data data;
    TempDir out;
    for (int shuffle : {1, 0}) {
        // the same global batch, 2 micro-steps each: 4 sequences on one rank, or 2 on each of the 2 dp ranks
        std::string shuffled = strfmt(" --shuffle %d", shuffle), one = out / strfmt("one_s%d", shuffle);
        REQUIRE(single_ok(data.flags(4, 128, EQUIVALENCE_STEPS, TP_MODEL) + shuffled, one));
        std::map<std::string, double> reference = losses(one);
        for (int z : {0, 1, 3}) {
            INFO("ZeRO-" << z << ", tp 2 (sp by default), dp 2, --shuffle " << shuffle);
            std::string dir = out / strfmt("z%d_s%d", z, shuffle), run;
            if (!train_ok(4, data.flags(2, 128, EQUIVALENCE_STEPS, TP_MODEL) + shuffled + strfmt(" --tp 2 -z %d", z), dir, &run)) continue;
            check_close(losses(dir), reference, 1e-5);
        }
    }
}

TEST_CASE("the replicated tensors stay identical across the tp group, bit for bit", "[tp]") {
    Data data;
    TempDir out;
    struct Layout {
        int ranks, tp, sp, zero;
    };
    for (Layout l : {Layout{4, 2, 1, 0}, Layout{4, 2, 1, 3}, Layout{4, 4, 1, 0}}) {
        INFO(l.ranks << " ranks, tp " << l.tp << " sp " << l.sp << " ZeRO-" << l.zero);
        std::string run;
        std::string flags = data.flags(2, 2 * (l.ranks / l.tp) * 16 * 2, 10, TP_MODEL) +
                            strfmt(" --tp %d --sp %d -z %d --debug-check-replicas 1", l.tp, l.sp, l.zero);
        train_ok(l.ranks, flags, out / strfmt("n%dtp%dz%d", l.ranks, l.tp, l.zero), &run);
        INFO(run);
        CHECK(run.find("replicas: identical across tp") != std::string::npos);
        CHECK(run.find("replicas: differ") == std::string::npos);
    }
}

// The gradient plan (llmc/grad_plan.h) against the share layout itself: which ranks of the tp group hold each
// element of the whole model, element by element from share_runs. An element a lower rank holds too is counted
// by the norm there, not here, and so is a later stage's copy of the tied embeddings; an element of a column
// split that k > 1 ranks hold (the key/value heads tp spreads over several ranks, each rank's gradient from its
// own query heads) is a partial sum over those k, and a tensor the table marks partial (under sp the norms and
// wpe, QK-norm always) over the whole group.
TEST_CASE("the gradient plan: what is a partial sum over tp and what the norm counts elsewhere, element by element "
          "from the share layout", "[tp]") {
    for (const char* model : {"d2c64h4t64v301", "l2c64h4g2t64v301", "l2c64h8g2t64v301w", "q2c64h4g1d16f128t64v301w"})
        for (int tp : {2, 4})
            for (bool sp : {false, true})
                for (int stage : {-1, 0, 1}) {  // -1: no pp; else this stage of pp 2
                    INFO(model << " tp " << tp << " sp " << sp << " stage " << stage);
                    GPTConfig c = parse_model_descriptor(model);
                    ModelPart part = stage < 0 ? whole_part(c) : stage_part(c, PPSpec{2, stage});
                    ModelTable table = model_table(c);
                    std::vector<uint8_t> holders(num_parameters(c), 0);  // per whole element: a bit per tp rank
                    for (int r = 0; r < tp; r++)
                        for (const ShareRun& run : share_runs(c, ShareSpec{tp, r}, part))
                            for (size_t i = 0; i < run.count; i++) holders[run.whole + i] |= 1 << r;
                    for (int a = 0; a < tp; a++) {
                        INFO("tp rank " << a);
                        size_t sizes[NUM_PARAM_TENSORS], total = 0;
                        param_tensor_sizes(c, sizes, tp, part);
                        std::vector<int> tensor_of;
                        for (int t = 0; t < NUM_PARAM_TENSORS; t++) tensor_of.insert(tensor_of.end(), sizes[t], t), total += sizes[t];
                        bool copy = stage > 0 && part.embedding_copy();
                        GradientPlan plan = gradient_plan(table, sizes, tp, a, sp, copy);
                        std::vector<int> partial(total, -1);  // the ranks summing it (0: the whole group), -1: none
                        for (const GradientPlan::Partial& p : plan.tp_partials)
                            for (size_t i = 0; i < p.count; i++) partial[p.offset + i] = p.ranks;
                        std::vector<bool> counted(total, false);
                        for (const ShareRange& r : plan.counted(0, total))
                            for (size_t i = 0; i < r.count; i++) counted[r.offset + i] = true;
                        size_t wrong_partial = 0, wrong_counted = 0, shared = 0;
                        for (const ShareRun& run : share_runs(c, ShareSpec{tp, a}, part))
                            for (size_t i = 0; i < run.count; i++) {
                                size_t at = run.local + i;
                                const TensorSpec& spec = table[tensor_of[at]];
                                int mask = holders[run.whole + i], ranks = __builtin_popcount(mask);
                                bool column_shared = spec.split == TPSplit::Column && ranks > 1;
                                int expected = spec.partial_over_tp(sp) ? 0 : column_shared ? ranks : -1;
                                bool elsewhere = (mask & ((1 << a) - 1)) != 0 || (copy && spec.holder == Holder::Embeddings);
                                wrong_partial += partial[at] != expected;
                                wrong_counted += counted[at] == elsewhere;
                                shared += column_shared;
                            }
                        CHECK(wrong_partial == 0);
                        CHECK(wrong_counted == 0);
                        if (std::string(model).find("g") != std::string::npos && tp == 4) CHECK(shared > 0);
                    }
                }
}

TEST_CASE("--plan predicts the ledger of every tp and dp rank, with and without sp, for ZeRO-0, 1 and 3", "[tp]") {
    GPTConfig c = parse_model_descriptor(TP_MODEL);
    size_t whole_params = 0;  // the params bytes of one rank without tp, dp 1
    for (int tp : {1, 2, 4})
        for (int sp : {0, 1}) {
            if (sp && tp == 1) continue;
            for (int zero : {0, 1, 3})
                for (int dp : {1, 2})
                    for (size_t bucket : {(size_t)1000, (size_t)15728})
                        for (int dp_rank = 0; dp_rank < dp; dp_rank++)
                            for (int tp_rank = 0; tp_rank < tp; tp_rank++) {
                                INFO("tp " << tp << " rank " << tp_rank << " sp " << sp << ", dp " << dp << " rank " << dp_rank
                                           << ", ZeRO-" << zero << ", bucket " << bucket);
                                Comm group;  // only the size and rank matter until a collective runs
                                group.size = dp;
                                group.rank = dp_rank;
                                GPT m;
                                ModelLayout layout;
                                layout.own = DataParallel<float>::model_buffers(zero);
                                layout.tp = TPSpec{tp, tp_rank, sp == 1};
                                gpt_allocate(m, c, 2, 16, layout);
                                DataParallel dpr(m, group, zero, bucket);
                                MemoryPlan plan = plan_memory(c, 2, 16, omp_get_max_threads(),
                                                              ParallelPlan{dp, zero, bucket, 1, tp, sp == 1});
                                for (int i = 0; i < MEM_CATEGORIES; i++) {
                                    INFO(mem_category_name(i));
                                    CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                                }
                                if (tp == 1 && dp == 1 && zero == 0) whole_params = m.ledger.bytes[MEM_PARAMS];
                                // a tp rank holds a part of the model
                                if (tp > 1 && zero == 0) CHECK(m.ledger.bytes[MEM_PARAMS] < whole_params);
                            }
        }
    CHECK(whole_params > 0);

    // the command line prints the same plan (for rank 0)
    Data data;
    for (int sp : {0, 1}) {
        INFO("--plan --world 4 --tp 2 -z 1 --sp " << sp);
        CommandResult r = single(data.flags(2, 128, 1, TP_MODEL) + strfmt(" -z 1 --plan --world 4 --tp 2 --sp %d", sp));
        INFO(r.output);
        REQUIRE(r.status == 0);
        MemoryPlan plan = plan_memory(c, 2, 16, 1, ParallelPlan{2, 1, (size_t)(0.06f * 1048576.0 / 4.0), 2, 2, sp == 1});
        for (int i = 0; i < MEM_CATEGORIES; i++) {
            INFO(mem_category_name(i));
            CHECK(plan_category_bytes(r.output, mem_category_name(i)) == (long long)plan.bytes[i]);
        }
        CHECK(plan_category_bytes(r.output, "total") == (long long)plan.total());
    }
}

TEST_CASE("the counted tp and dp bytes equal the formulas and --plan; sp adds the norm outputs' second gathers "
          "and the layernorm and wpe gradients", "[tp]") {
    Data data;
    TempDir out;
    // Every rank runs tp 2 on micro-batches of the same shape, so the activations' crossings of the parallel
    // regions move the same bytes in every layout below, with sp or without (sp's all-gathers and
    // reduce-scatters are the all-reduce's two halves). Under sp each rank keeps only its rows of the two
    // layernorm outputs and backward gathers them again for the weight gradients: 2·L·(tp-1)/tp·BT·C floats a
    // micro-step. And the layernorm parameters and wpe see a rank's rows only: their gradients are partial and
    // one all-reduce over tp adds them, in every gradient reduction (once per step under ZeRO-0/1, once per
    // micro-step under ZeRO-2/3): 2(tp-1)/tp of their fp32 bytes each time.
    GPTConfig c = parse_model_descriptor(TP_MODEL);
    const int L = c.num_layers, C = c.channels, accumulation = 2;
    const double sequence_split_floats = 4.0 * L * C + 2.0 * C + (double)c.max_seq_len * C;
    double tp_bytes = -1;  // without sp
    struct Layout {
        int ranks, sp, zero;
    };
    for (Layout l : {Layout{2, 0, 0}, Layout{2, 1, 0}, Layout{4, 0, 0}, Layout{4, 0, 3}, Layout{4, 1, 0}, Layout{4, 1, 3}}) {
        INFO(l.ranks << " ranks, tp 2, sp " << l.sp << ", ZeRO-" << l.zero);
        int dp = l.ranks / 2;
        // 2 micro-steps of b=2 × t=16 on each dp rank
        std::string flags = data.flags(2, dp * accumulation * 2 * 16, 1, TP_MODEL) + strfmt(" --tp 2 --sp %d -z %d", l.sp, l.zero);
        std::string run;
        if (!train_ok(l.ranks, flags, out / strfmt("n%dsp%dz%d", l.ranks, l.sp, l.zero), &run)) continue;
        require_tp_counted_equals_formula(run, 2, l.sp);
        CommLine tpl = tp_comm_line(run), dpl = dp_comm_line(run);
        if (tp_bytes < 0) tp_bytes = tpl.sent;
        double reductions = l.zero >= 2 ? accumulation : 1;
        double gathered_again = l.sp ? accumulation * 2.0 * L * (2 - 1) / 2 * (2 * 16) * C * sizeof(float) : 0.0;
        double sp_extra = l.sp ? reductions * 2.0 * (2 - 1) / 2 * sequence_split_floats * sizeof(float) : 0.0;
        INFO("without sp " << tp_bytes << " bytes; sp adds " << gathered_again << " for the norm outputs gathered "
             "again and " << sp_extra << " for the layernorm and wpe gradients");
        CHECK(tpl.sent == tp_bytes + gathered_again + sp_extra);
        if (dp > 1) {
            require_counted_equals_formula(run, l.zero);
        } else {
            INFO(run);
            CHECK(!dpl.found);  // no dp line without dp
        }
        CommandResult plan = single(flags + strfmt(" --plan --world %d", l.ranks));
        INFO(plan.output);
        REQUIRE(plan.status == 0);
        CHECK(line_value(plan.output, "tensor-parallel communication per step per rank: ") == tpl.sent);
        if (dp > 1) CHECK(line_value(plan.output, "communication per step per rank: ") == dpl.sent);
    }
}

TEST_CASE("the whole model saved under one tp loads under any other", "[tp]") {
    Data data;
    TempDir out;
    GPTConfig c = parse_model_descriptor(TP_MODEL);
    // the file is llm.c's: the whole model, gathered over tp, vocab padded to 384
    auto check_model_file = [&](const std::string& path) {
        INFO(path);
        REQUIRE(file_exists(path));
        std::string bytes = read_file(path);
        CHECK(bytes.size() == 256 * sizeof(int32_t) + num_parameters(c) * sizeof(float));
        REQUIRE(bytes.size() >= 256 * sizeof(int32_t));
        const int32_t* header = (const int32_t*)bytes.data();
        CHECK(header[0] == 20240326);
        CHECK(header[1] == 3);
        CHECK(header[7] == 384);
    };
    // loads a saved model in a fresh run of one step, on `tp` ranks (1: without mpirun); returns its main.log
    auto load = [&](const std::string& model, int tp, const std::string& dir) {
        std::string flags = data.flags(2, 32, 1, "'" + model + "'");
        bool ok = tp == 1 ? single_ok(flags, dir) : train_ok(tp, flags + strfmt(" --tp %d", tp), dir);
        return ok ? losses(dir) : std::map<std::string, double>{};
    };

    SECTION("saved under tp 2, loaded on one rank and under tp 2 and 4") {
        std::string a = out / "A";
        // 5 steps, validating at step 0 and at the last step, checkpointed at step 5
        REQUIRE(train_ok(2, data.flags(2, 32, 5, TP_MODEL) + " --tp 2 -n 5", a));
        std::string model = a + "/ckpt_00000005/model.bin";
        check_model_file(model);
        double a_val = loss_at(losses(a), "tel 5");
        std::map<std::string, double> one = load(model, 1, out / "B");
        for (int tp : {2, 4}) {
            INFO("loaded under tp " << tp);
            std::map<std::string, double> l = load(model, tp, out / strfmt("tp%d", tp));
            for (const char* key : {"trl 0", "tel 0"}) {
                INFO(key << ": " << loss_at(l, key) << " under tp, " << loss_at(one, key) << " on one rank");
                CHECK(rel_close(loss_at(l, key), loss_at(one, key), 1e-5));
            }
        }
        INFO("val loss: " << loss_at(one, "tel 0") << " loaded on one rank, " << a_val << " at step 5 of the tp 2 run");
        CHECK(rel_close(loss_at(one, "tel 0"), a_val, 1e-5));
    }
    SECTION("saved on one rank, loaded under tp 4") {
        std::string e = out / "E";
        REQUIRE(single_ok(data.flags(2, 32, 5, TP_MODEL) + " -n 5", e));
        std::string model = e + "/ckpt_00000005/model.bin";
        check_model_file(model);
        std::map<std::string, double> one = load(model, 1, out / "G"), tp4 = load(model, 4, out / "F");
        for (const char* key : {"trl 0", "tel 0"}) {
            INFO(key << ": " << loss_at(tp4, key) << " under tp 4, " << loss_at(one, key) << " on one rank");
            CHECK(rel_close(loss_at(tp4, key), loss_at(one, key), 1e-5));
        }
        INFO("val loss: " << loss_at(one, "tel 0") << " loaded, " << loss_at(losses(e), "tel 5") << " at step 5 of the saving run");
        CHECK(rel_close(loss_at(one, "tel 0"), loss_at(losses(e), "tel 5"), 1e-5));
    }
}

TEST_CASE("layouts tensor parallelism cannot run are refused with one line naming the flag", "[tp]") {
    Data data;
    std::string flags = data.flags(2, 32, 1, TP_MODEL);
    SECTION("--tp 3 does not divide the 4 heads") {
        check_one_line_error(single(data.flags(2, 64, 1, TP_MODEL) + " --sp 0 --plan --world 6 --tp 3"), {"--tp 3", "head"});
        CommandResult r = mpirun(3, "./train_gpt", flags + " --sp 0 --tp 3");
        INFO(r.output);
        CHECK(r.status != 0);
        CHECK(r.output.find("train_gpt: --tp 3") != std::string::npos);
    }
    SECTION("--sp 1 needs tensor parallelism") {
        check_one_line_error(single(flags + " --sp 1"), {"--sp"});
    }
    SECTION("under sp, tp must divide B·T") {
        // -b 1 -t 15: 15 rows
        std::string odd = data.flags(1, 15, 1, TP_MODEL) + " -t 15 --tp 2";
        // the line may name --tp or --sp (both take part)
        CommandResult plan = single(odd + " --plan --world 2");
        check_one_line_error(plan, {});
        CHECK((plan.output.find("--tp 2") != std::string::npos || plan.output.find("--sp") != std::string::npos));
        CommandResult r = mpirun(2, "./train_gpt", odd);
        INFO(r.output);
        CHECK(r.status != 0);
        CHECK((r.output.find("train_gpt: --tp 2") != std::string::npos || r.output.find("train_gpt: --sp") != std::string::npos));
        // without sp the rows are whole on every rank: the same layout is fine
        CommandResult no_sp = single(odd + " --sp 0 --plan --world 2");
        INFO(no_sp.output);
        CHECK(no_sp.status == 0);
    }
}

TEST_CASE("a tp × dp run resumed from its checkpoint continues bit-exactly", "[tp]") {
    Data data;
    TempDir out;
    for (int z : {0, 1, 3}) {
        INFO("tp 2 × dp 2, ZeRO-" << z);
        std::string flags = data.flags(2, 2 * 2 * 16, 6, "d3c36h4t32v301") + strfmt(" --tp 2 -z %d -n 3", z);
        std::string whole = out / strfmt("whole%d", z), resumed = out / strfmt("resumed%d", z);
        train(4, flags, whole);
        REQUIRE(run_command(strfmt("cp -r '%s' '%s' && rm -r '%s/ckpt_00000006'", whole.c_str(), resumed.c_str(),
                                   resumed.c_str())).status == 0);
        std::string again = train(4, flags + " -y 1", resumed);
        CHECK(again.find("resumed from " + resumed + "/ckpt_00000003 at step 3") != std::string::npos);
        // one optimizer file per tp rank under ZeRO-0, per rank under ZeRO-1 and 3
        int files = z == 0 ? 2 : 4;
        for (int r = 0; r < 4; r++) CHECK(file_exists(whole + strfmt("/ckpt_00000006/optimizer_rank%d.bin", r)) == (r < files));
        std::vector<std::string> names = {"model.bin", "state_rank0.bin", "manifest.txt"};
        for (int r = 0; r < files; r++) names.push_back(strfmt("optimizer_rank%d.bin", r));
        for (const std::string& name : names) {
            INFO(name);
            CHECK(read_file(whole + "/ckpt_00000006/" + name) == read_file(resumed + "/ckpt_00000006/" + name));
        }
    }
}

}  // namespace test_tensor_parallel

// Tests of the distributed runtime on the CPU, under `mpirun --oversubscribe`: the collectives against a naive
// reference (comm_check.h), data parallelism against the single-rank run with the same global batch
// (the equivalence principle), ZeRO-0..3 against each other bit for bit, the ledger against --plan, the counted
// bytes against the formula, sharded checkpoints, the process grid, a rank that stops answering, and NCCL's id
// handed over a shared directory (--comm-init file).
#include <algorithm>
#include <cstring>
#include <time.h>
#include <unistd.h>

#include "llmc/checkpoint.h"
#include "llmc/grid.cuh"
#include "llmc/plan.h"
#include "llmc/zero.cuh"
#include "comm_check.h"
#include "mpi_helpers.h"

namespace test_distributed {

TEST_CASE("every collective matches a naive reference on 2, 3 and 4 ranks, blocking and async", "[distributed]") {
    for (int ranks : {2, 3, 4}) {
        CheckCounts counts = run_check(ranks, "comm_check");
        CHECK(counts.passed > 600);
        CHECK(counts.failed == 0);
    }
}

TEST_CASE("--comm-init file: rank 0 publishes NCCL's unique id whole in --comm-dir, and every other rank reads the "
          "same bytes", "[distributed]") {
    TempDir dir;
    Launch first{}, second{};
    first.rank = 0, second.rank = 1;
    ncclUniqueId written = nccl_id_over_file(first, dir.path, now_seconds() + 5.0);
    ncclUniqueId read = nccl_id_over_file(second, dir.path, now_seconds() + 5.0);
    CHECK(memcmp(&written, &read, sizeof(written)) == 0);
    CHECK(!file_exists(dir / "llm5d_nccl_id.tmp"));  // written under it, then renamed into place
}

TEST_CASE("dp = 2 and 4 give the single-rank run's losses over 10 steps, with gradient accumulation", "[distributed]") {
    Data data;
    TempDir out;
    for (int shuffle : {1, 0})
        for (int ranks : {2, 4}) {
            INFO(ranks << " ranks, --shuffle " << shuffle);
            // the same global batch: 2 micro-steps of 2·ranks sequences, split across ranks or not
            int d = 2 * (2 * ranks) * 16;
            std::string one = out / strfmt("one%d_s%d", ranks, shuffle), dp = out / strfmt("dp%d_s%d", ranks, shuffle);
            CommandResult r = single(data.flags(2 * ranks, d, EQUIVALENCE_STEPS) + strfmt(" --shuffle %d -o '%s'", shuffle, one.c_str()));
            INFO(r.output);
            REQUIRE(r.status == 0);
            train(ranks, data.flags(2, d, EQUIVALENCE_STEPS) + strfmt(" --shuffle %d", shuffle), dp);
            require_close(losses(dp), losses(one), 1e-5);
        }
}

TEST_CASE("the same data at -b 1, 2, 4 on one rank and -b 1, 2 on two ranks: the same losses, shuffled or not",
          "[distributed]") {
    Data data;
    TempDir out;
    // -d 64 = 4 sequences of 16 per step: 4, 2 or 1 micro-steps on one rank; 2 or 1 on each of two
    const int d = 64;
    for (const char* shuffle : {"", " --shuffle 0"}) {
        INFO("flags" << shuffle);
        const char* tag = *shuffle ? "_s0" : "";
        std::string reference = out / strfmt("b4%s", tag);
        CommandResult r = single(data.flags(4, d, EQUIVALENCE_STEPS) + shuffle + " -o '" + reference + "'");
        INFO(r.output);
        REQUIRE(r.status == 0);
        for (int b : {1, 2}) {
            INFO("-b " << b << ", one rank");
            std::string dir = out / strfmt("b%d%s", b, tag);
            CommandResult one = single(data.flags(b, d, EQUIVALENCE_STEPS) + shuffle + " -o '" + dir + "'");
            INFO(one.output);
            REQUIRE(one.status == 0);
            require_close(losses(dir), losses(reference), 1e-5);
        }
        for (int b : {1, 2}) {
            INFO("-b " << b << ", 2 ranks");
            std::string dir = out / strfmt("dp2_b%d%s", b, tag);
            train(2, data.flags(b, d, EQUIVALENCE_STEPS) + shuffle, dir);
            require_close(losses(dir), losses(reference), 1e-5);
        }
    }
}

TEST_CASE("ZeRO-0, 1, 2 and 3 give identical losses and identical final parameters, bit for bit", "[distributed]") {
    Data data;
    TempDir out;
    for (int ranks : {2, 4}) {
        INFO(ranks << " ranks, one micro-step");
        std::string flags = data.flags(2, 2 * ranks * 16, EQUIVALENCE_STEPS) + strfmt(" -n %d", EQUIVALENCE_STEPS);
        std::string model0;
        std::map<std::string, double> losses0;
        for (int z = 0; z <= 3; z++) {
            INFO("ZeRO-" << z);
            std::string dir = out / strfmt("n%dz%d", ranks, z);
            require_counted_equals_formula(train(ranks, flags + strfmt(" -z %d", z), dir));
            std::string model = read_file(dir + strfmt("/ckpt_%08d/model.bin", EQUIVALENCE_STEPS));
            if (z == 0) model0 = model, losses0 = losses(dir);
            CHECK(model == model0);
            CHECK(losses(dir) == losses0);
        }
    }
    // With accumulation, ZeRO-0/1 sum micro-steps before ranks and ZeRO-2/3 ranks before micro-steps (they hold
    // no full gradient between micro-steps): each pair is identical, and the pairs agree to rounding.
    SECTION("with gradient accumulation") {
        std::string flags = data.flags(2, 2 * 2 * 2 * 16, EQUIVALENCE_STEPS) + strfmt(" -n %d", EQUIVALENCE_STEPS);
        std::string model[4];
        std::map<std::string, double> loss[4];
        for (int z = 0; z <= 3; z++) {
            std::string dir = out / strfmt("acc_z%d", z);
            require_counted_equals_formula(train(2, flags + strfmt(" -z %d", z), dir));
            model[z] = read_file(dir + strfmt("/ckpt_%08d/model.bin", EQUIVALENCE_STEPS));
            loss[z] = losses(dir);
        }
        CHECK(model[0] == model[1]);
        CHECK(model[2] == model[3]);
        CHECK(loss[0] == loss[1]);
        CHECK(loss[2] == loss[3]);
        require_close(loss[2], loss[0], 1e-5);
    }
}

// (with accumulation, the tied wte's gradient of a micro-step is summed apart where the gradients accumulate in
// the model's own buffer, ZeRO-0 and 1: llmc/gpt.cuh's tied_wte_summed_apart)
TEST_CASE("--plan predicts the ledger of every rank, for every ZeRO stage, dp size and bucket size, with and without "
          "gradient accumulation", "[distributed]") {
    for (int dp : {1, 2, 3, 4})
        for (int zero = 0; zero <= 3; zero++)
            for (size_t bucket : {(size_t)1000, (size_t)15728, DEFAULT_BUCKET_FLOATS})
                for (int accumulation : {1, 2})
                    for (int rank = 0; rank < dp; rank++) {
                        INFO("dp " << dp << " rank " << rank << " ZeRO-" << zero << " bucket " << bucket << ", "
                                   << accumulation << " micro-steps");
                        GPTConfig c = parse_model_descriptor("d3c33h3t32v301");
                        Comm group;  // only the size and rank matter until a collective runs
                        group.size = dp;
                        group.rank = rank;
                        GPT m;
                        ModelLayout layout;
                        layout.own = DataParallel<float>::model_buffers(zero);
                        layout.accumulation = accumulation;
                        gpt_allocate(m, c, 2, 16, layout);
                        DataParallel dpr(m, group, zero, bucket);
                        MemoryPlan plan =
                            plan_memory(c, 2, 16, omp_get_max_threads(), ParallelPlan{dp, zero, bucket, accumulation});
                        for (int i = 0; i < MEM_CATEGORIES; i++) {
                            INFO(mem_category_name(i));
                            CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                        }
                    }
}

TEST_CASE("the model states follow the Playbook's per-stage formulas", "[distributed]") {
    // Ψ = 1000, a 4-way shard of 250 elements: bf16 mixed precision gives 2Ψ+2Ψ+12Ψ/N ... 16Ψ/N
    size_t b[MEM_CATEGORIES] = {};
    auto states = [&] { return b[MEM_PARAMS] + b[MEM_MASTER_WEIGHTS] + b[MEM_GRADS] + b[MEM_OPTIMIZER]; };
    plan_model_states(b, 1000, 250, 0, BF16_MIXED);
    CHECK(states() == 16 * 1000);
    plan_model_states(b, 1000, 250, 1, BF16_MIXED);
    CHECK(states() == 2 * 1000 + 2 * 1000 + 12 * 250);
    plan_model_states(b, 1000, 250, 2, BF16_MIXED);
    CHECK(states() == 2 * 1000 + 14 * 250);
    plan_model_states(b, 1000, 250, 3, BF16_MIXED);
    CHECK(states() == 16 * 250);
    plan_model_states(b, 1000, 250, 3, CPU_FP32);
    CHECK(states() == 16 * 250);
}

TEST_CASE("buckets: every rank's pieces together cover every parameter exactly once", "[distributed]") {
    GPTConfig c = parse_model_descriptor("d3c33h3t32v301");
    size_t psi = num_parameters(c);
    for (int dp : {1, 2, 3, 4, 7})
        for (size_t bucket : {(size_t)1, (size_t)15728, (size_t)1 << 30}) {
            INFO("dp " << dp << " bucket " << bucket);
            BucketLayout lay = bucket_layout(c, dp, bucket);
            CHECK(lay.buckets.back().first_unit == embedding_unit(c.num_layers));
            std::vector<int> covered(psi, 0);
            size_t shard = 0;
            for (const Bucket& b : lay.buckets) {
                CHECK(b.padded % dp == 0);
                CHECK(b.padded - b.size < (size_t)dp);
                shard += b.piece;
            }
            CHECK(shard == lay.shard_size);
            for (int r = 0; r < dp; r++)
                for (const Bucket& b : lay.buckets)
                    for (const OwnedSegment& s : owned_segments(b, r)) {
                        CHECK(s.shard_offset + s.size <= lay.shard_size);
                        for (size_t i = 0; i < s.size; i++) covered[s.flat_offset + i]++;
                    }
            size_t wrong = 0;
            for (int n : covered) wrong += n != 1;
            CHECK(wrong == 0);
        }
}

TEST_CASE("the counted bytes sent per step equal the formula for every stage, and --plan prints it", "[distributed]") {
    Data data;
    TempDir out;
    for (int z = 0; z <= 3; z++) {
        INFO("ZeRO-" << z);
        // 4 ranks, 2 micro-steps: ZeRO-2 and 3 reduce in each
        std::string flags = data.flags(2, 4 * 2 * 2 * 16, 1) + strfmt(" -z %d", z);
        std::string run = train(4, flags, out / strfmt("z%d", z));
        require_counted_equals_formula(run);
        CommandResult plan = single(flags + " --plan --world 4");
        INFO(plan.output);
        REQUIRE(plan.status == 0);
        double planned = line_value(plan.output, "communication per step per rank: ");
        CHECK(planned > 0);
        CHECK(planned == dp_comm_line(run).sent);
    }
}

TEST_CASE("a resumed sharded run continues bit-exactly, and says so when it resumes under another ZeRO stage", "[distributed]") {
    Data data;
    TempDir out;
    for (int z = 0; z <= 3; z++) {
        INFO("ZeRO-" << z);
        std::string flags = data.flags(2, 2 * 2 * 16, 6) + strfmt(" -z %d -n 3", z);
        std::string whole = out / strfmt("whole%d", z), resumed = out / strfmt("resumed%d", z);
        train(2, flags, whole);
        // the run again from its step-3 checkpoint
        REQUIRE(run_command(strfmt("cp -r '%s' '%s' && rm -r '%s/ckpt_00000006'", whole.c_str(), resumed.c_str(), resumed.c_str())).status == 0);
        std::string again = train(2, flags + " -y 1", resumed);
        CHECK(again.find("resumed from " + resumed + "/ckpt_00000003 at step 3") != std::string::npos);
        for (const char* file : {"model.bin", "optimizer_rank0.bin", "state_rank0.bin", "manifest.txt"}) {
            INFO(file);
            CHECK(read_file(whole + "/ckpt_00000006/" + file) == read_file(resumed + "/ckpt_00000006/" + file));
        }
        CHECK(file_exists(whole + "/ckpt_00000006/optimizer_rank1.bin") == (z >= 1));
        if (z >= 1)
            CHECK(read_file(whole + "/ckpt_00000006/optimizer_rank1.bin") == read_file(resumed + "/ckpt_00000006/optimizer_rank1.bin"));
    }
    // the same checkpoint under another ZeRO stage: the first line after resuming names both layouts
    std::string other = train(2, data.flags(2, 2 * 2 * 16, 9) + " -z 1 -n 3 -y 1", out / "whole2");
    CHECK(other.find("resumed from " + out / "whole2/ckpt_00000006 at step 6: written on 2 ranks (dp 2, ZeRO-2, -b 2) "
                     "on cpu, continuing on 2 ranks (dp 2, ZeRO-1, -b 2) on cpu") != std::string::npos);
    CHECK(file_exists(out / "whole2/ckpt_00000009"));
}

TEST_CASE("a rank that stops answering makes the job exit non-zero within the deadline, saying where", "[distributed]") {
    Data data;
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CommandResult r = mpirun(2, "./train_gpt", data.flags(2, 64, 5) + " --debug-stall-rank 1 --comm-timeout 2");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK(seconds < 60);
    CHECK(r.output.find("rank 0: comm timeout:") != std::string::npos);
    CHECK(r.output.find("on group dp (rank 0 of 2)") != std::string::npos);
    CHECK(r.output.find("unfinished after 2 s, waiting for rank 1 of the group, rank 1 of the job") != std::string::npos);
    CHECK(r.output.find("rank 1: comm timeout:") == std::string::npos);  // the rank that stalled says nothing
}

TEST_CASE("the process grid: tp fastest, then cp, dp, pp; groups and errors", "[distributed]") {
    GridShape s{2, 2, 2, 1};
    int world = 16, dp = grid_dp(world, s);
    CHECK(dp == 2);
    for (int r = 0; r < world; r++) {
        GridCoords c = grid_coords(r, s, dp);
        CHECK(grid_rank(c, s, dp) == r);
        CHECK(c.tp == r % 2);
        CHECK(c.pp == r / 8);
    }
    // rank 5 = tp 1, cp 0, dp 1, pp 0
    GridCoords c = grid_coords(5, s, dp);
    CHECK((c.tp == 1 && c.cp == 0 && c.dp == 1 && c.pp == 0));
    CHECK_THROWS_WITH(grid_dp(6, GridShape{4, 1, 1, 1}), Catch::Contains("not divisible by tp·cp·pp = 4"));
    CHECK_THROWS_WITH(grid_dp(8, GridShape{1, 1, 1, 3}), Catch::Contains("--ep 3: must divide the data-parallel size 8"));
    CHECK(grid_coords(7, GridShape{1, 1, 1, 4}, 8).ep == 3);

    // the expert replicas under ep 2 (tp 2, cp 2, pp 2, 32 ranks: dp 4): the ranks with the same tp, pp and
    // ep_rank, dp/ep · cp = 4 of them, numbered cp fastest, then dp_rank / ep
    GridShape e{2, 2, 2, 2};
    int edp = grid_dp(32, e);
    CHECK(edp == 4);
    for (int r = 0; r < 32; r++) {
        GridCoords a = grid_coords(r, e, edp);
        GroupPlace pa = expert_replica_place(a, e, edp);
        CHECK(pa.key == a.cp + 2 * (a.dp / 2));
        std::vector<int> members;
        for (int q = 0; q < 32; q++) {
            GridCoords b = grid_coords(q, e, edp);
            bool same = a.tp == b.tp && a.pp == b.pp && a.ep == b.ep;
            CHECK((expert_replica_place(b, e, edp).color == pa.color) == same);
            if (same) members.push_back(expert_replica_place(b, e, edp).key);
        }
        std::sort(members.begin(), members.end());
        CHECK(members == std::vector<int>{0, 1, 2, 3});
    }

    // a single process forms every group alone
    Comm self;
    Grid g = make_grid(self, GridShape{});
    CHECK((g.dp == 1 && g.dp_comm.size == 1 && g.tp_comm.size == 1));
    CHECK(&g.dp_cp() == &g.dp_comm);  // without cp, gradients are reduced over dp alone
    CHECK(&g.expert_replicas() == &g.dp_comm);  // without ep, the experts' gradients too

    // on the command line: a grid that does not fit, and experts split where the model has none
    Data data;
    CommandResult bad = single(data.flags(2, 32, 1) + " --plan --world 6 --tp 4");
    CHECK(bad.status == 1);
    CHECK(bad.output.find("train_gpt: --tp 4 --cp 1 --pp 1: the world of 6 ranks is not divisible") != std::string::npos);
    CommandResult ep = mpirun(2, "./train_gpt", data.flags(2, 64, 1) + " --ep 2");
    INFO(ep.output);
    CHECK(ep.status != 0);
    CHECK(ep.output.find("--ep 2: the model has no experts to split") != std::string::npos);
}

}  // namespace test_distributed

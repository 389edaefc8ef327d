// Tests of context parallelism (llmc/cp.cuh): on the CPU the zig-zag and contiguous splits, the refusal of a T
// the chunks do not divide, the balance zig-zag buys, and ring attention against attention over the whole
// sequence under `mpirun --oversubscribe` on 2, 3 and 4 ranks (cp_check.h); the trainer under cp 2 and 4,
// cp × tp (sp) and cp × dp with ZeRO against the single-rank run with the same global batch (the equivalence
// principle); the ledger of every cp rank against --plan; the counted cp bytes against the formula; a cp run
// resumed bit-exactly; and on a GPU, the ring's CUDA path on one rank against the CPU reference.
//
// The model, d3c36h4t32v301 (4 heads of 9, a vocab no tp divides), at -t 16: cp 2 keeps 8 positions of each
// sequence per rank in chunks of 4, cp 4 keeps 4 in chunks of 2, and cp 2 × tp 2 under sp splits each rank's
// 2·8 rows of a micro-batch of 2 sequences again.
#include <unistd.h>

#include <algorithm>

#include "cp_check.h"
#include "dev/cuda/attention_case.h"
#include "llmc/cp.cuh"
#include "llmc/plan.h"
#include "llmc/zero.cuh"
#include "mpi_helpers.h"

namespace test_context_parallel {

const char* CP_MODEL = "d3c36h4t32v301";

// "cp: rank R (SPLIT) scores P query-key pairs ..." of each rank of rank 0's cp group, in rank order
std::vector<long> cp_pairs_lines(const std::string& output) {
    std::vector<long> pairs;
    for (const std::string& line : lines_of(output)) {
        int rank;
        long p;
        char split[16];
        if (sscanf(line.c_str(), "cp: rank %d (%15[a-z]) scores %ld query-key pairs", &rank, split, &p) == 3 &&
            rank == (int)pairs.size())
            pairs.push_back(p);
    }
    return pairs;
}

TEST_CASE("the zig-zag split gives rank r chunks r and 2N-1-r, the contiguous split chunks 2r and 2r+1", "[cp]") {
    CHECK(cp_positions(cp_layout(8, 2, 0, CPSplit::ZigZag)) == std::vector<int>{0, 1, 6, 7});
    CHECK(cp_positions(cp_layout(8, 2, 1, CPSplit::ZigZag)) == std::vector<int>{2, 3, 4, 5});
    CHECK(cp_positions(cp_layout(12, 3, 1, CPSplit::ZigZag)) == std::vector<int>{2, 3, 8, 9});
    CHECK(cp_positions(cp_layout(8, 2, 0, CPSplit::Contiguous)) == std::vector<int>{0, 1, 2, 3});
    CHECK(cp_positions(cp_layout(12, 3, 2, CPSplit::Contiguous)) == std::vector<int>{8, 9, 10, 11});
    // every position is held by exactly one rank, in increasing order within each chunk
    for (CPSplit split : {CPSplit::ZigZag, CPSplit::Contiguous})
        for (int N : {1, 2, 3, 4}) {
            int T = 2 * N * 5;
            std::vector<int> all;
            for (int r = 0; r < N; r++) {
                std::vector<int> mine = cp_positions(cp_layout(T, N, r, split));
                REQUIRE((int)mine.size() == T / N);
                all.insert(all.end(), mine.begin(), mine.end());
            }
            std::sort(all.begin(), all.end());
            for (int t = 0; t < T; t++) CHECK(all[t] == t);
        }
}

TEST_CASE("cp_select takes a rank's tokens, rows and per-token statistics at its positions", "[cp]") {
    CPLayout l = cp_layout(8, 2, 0, CPSplit::ZigZag);
    std::vector<int> tokens = {10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25, 26, 27}, mine(8);
    cp_select(mine.data(), tokens.data(), 2, 8, 1, cp_positions(l));
    CHECK(mine == std::vector<int>{10, 11, 16, 17, 20, 21, 26, 27});
    std::vector<float> rows(8 * 3), picked(4 * 3);  // one sequence of 8 rows of 3
    for (size_t i = 0; i < rows.size(); i++) rows[i] = (float)i;
    cp_select(picked.data(), rows.data(), 1, 8, 3, cp_positions(l));
    CHECK(picked == std::vector<float>{0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23});
}

TEST_CASE("a sequence length that 2·cp does not divide gets one clear line", "[cp]") {
    CHECK_THROWS_WITH(cp_layout(30, 4, 0, CPSplit::ZigZag),
                      "context parallelism: the sequence length T=30 must be a multiple of 2·cp = 8 (cp=4 ranks, two "
                      "chunks of T/(2·cp) tokens each)");
    CHECK_THROWS_AS(cp_layout(12, 4, 0, CPSplit::Contiguous), Error);
    CHECK_NOTHROW(cp_layout(24, 4, 3, CPSplit::Contiguous));
}

TEST_CASE("under a causal mask zig-zag gives every rank the same attention work, contiguous does not", "[cp]") {
    for (int N : {2, 3, 4}) {
        INFO("cp=" << N);
        int n = 7;  // tokens per chunk
        for (CPSplit split : {CPSplit::ZigZag, CPSplit::Contiguous}) {
            std::vector<long> pairs(N);  // (query, key) pairs each rank scores over the whole ring
            for (int r = 0; r < N; r++) pairs[r] = cp_attention_pairs(cp_layout(2 * N * n, N, r, split));
            long total = 0;
            for (long p : pairs) total += p;
            CHECK(total == (long)(2 * N * n) * (2 * N * n + 1) / 2);  // the causal triangle, once
            bool balanced = std::all_of(pairs.begin(), pairs.end(), [&](long p) { return p == pairs[0]; });
            CHECK(balanced == (split == CPSplit::ZigZag));
        }
    }
}

TEST_CASE("ring attention equals whole-sequence attention on every rank's slice, cp = 2, 3, 4, both splits, "
          "multi-head and grouped-query", "[cp]") {
    for (int ranks : {2, 3, 4}) {
        CheckCounts counts = run_check(ranks, "cp_check");
        CHECK(counts.passed == 2 * 2 * 5 * ranks);  // per rank, heads and split: out, lse, dq, dk, dv
        CHECK(counts.failed == 0);
    }
}

// The kernels each GPU case runs: the mma.sync ones, then the wgmma ones where the device and the binary have them
// (--attention picks them for the layers and the ring alike).
std::vector<AttentionKernels> gpu_attention_kernels() {
    std::vector<AttentionKernels> kinds = {AttentionKernels::MMA};
    std::string why;
    if (attention_hopper_available(&why)) kinds.push_back(AttentionKernels::WGMMA);
    else WARN("wgmma attention skipped: not Hopper (" << why << ")");
    return kinds;
}

void require_close(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    Comparison c = compare_rms(gpu, cpu, tol);
    INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    CHECK(c.pass());
}

// One rank's two chunks already make three blocks (two causal, one full, merged into the second chunk's rows),
// so a group of one runs every CUDA piece of the ring but the transfers. Tolerances are the flash attention's
// (dev/cuda/attention_case.h): the inputs are bf16 and so are out and dqkv.
TEST_CASE("on the GPU, ring attention on one rank matches the CPU reference, on the mma and the wgmma kernels",
          "[cp][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    struct Shape {
        int B, T, C, NH, KV;
    };
    for (AttentionKernels kind : gpu_attention_kernels())
        for (Shape s : {Shape{2, 42, 128, 2, 2}, Shape{1, 30, 256, 2, 2}, Shape{1, 30, 256, 4, 2}}) {  // hs 64, 128, 64
            INFO((kind == AttentionKernels::MMA ? "mma" : "wgmma") << " B=" << s.B << " T=" << s.T << " C=" << s.C
                                                                   << " NH=" << s.NH << " KV=" << s.KV);
            AttentionCase k(s.B, s.T, s.C, s.NH, s.KV, 15);
            RingHeads heads{s.C, s.NH, s.KV};
            Comm self;
            CPLayout l = cp_layout(s.T, 1, 0, CPSplit::ZigZag);
            Ledger ledger;
            RingBuffers<bf16> ring = ring_buffers<bf16>(ledger, s.B, s.T, heads);
            ring_attention_forward(k.d_out.ptr, k.d_lse.ptr, k.d_qkv.ptr, s.B, heads, l, self, ring, kind);
            cuda_check(cudaStreamSynchronize(main_stream()));
            require_close("out", download(k.d_out), k.out, AttentionCase::OUT_TOL);
            require_close("lse", download(k.d_lse), k.lse, 1e-3);
            ring_attention_backward(k.d_dqkv.ptr, k.d_dout.ptr, k.d_qkv.ptr, k.d_out.ptr, k.d_lse.ptr, s.B, heads, l,
                                    self, ring, kind);
            cuda_check(cudaStreamSynchronize(main_stream()));
            require_close("dqkv", download(k.d_dqkv), k.dqkv_for_out(download(k.d_out)), AttentionCase::DQKV_TOL);
        }
}

// One block of the ring on the flash kernels against the CPU block (ring_block_forward and ring_block_backward on
// floats, from the same bf16 inputs): the n query rows of a rank's second chunk (q0 = n of Tl = 2n) against n key
// rows of a separate K/V buffer, as a ring step holds another rank's: its second chunk under the causal mask (the
// diagonal block) or its first under the full one (a block of an earlier chunk). The forward's out and lse are
// poisoned first. The backward adds to accumulators that start from random values: what it added must match the
// CPU's share, and the rows outside the block must keep their values bit for bit; a second run from the same
// start gives the same bits. The backward takes the global lse and D as given: here the block's own lse plus a
// random amount (as if other blocks had been merged), and a random D.
void check_ring_block(int B, int n, int C, int NH, int KV, bool causal) {
    INFO("ring block B=" << B << " n=" << n << " hs=" << C / NH << " NH=" << NH << " KV=" << KV
                         << (causal ? " causal" : " full"));
    RingHeads a{C, NH, KV};
    int Tl = 2 * n, q0 = n, k0 = causal ? n : 0;
    Rng rng(31 + n + KV + causal);
    std::vector<float> qkv = random_bf16_values((size_t)B * Tl * a.qkv_row(), rng),
                       kv = random_bf16_values((size_t)B * Tl * a.kv_row(), rng),
                       dout = random_bf16_values((size_t)B * Tl * C, rng);
    std::vector<float> out((size_t)B * n * C), lse_blk((size_t)B * NH * n);
    ring_block_forward(out.data(), lse_blk.data(), qkv.data(), q0, kv.data(), k0, n, causal, B, Tl, a, AttentionKernels::MMA);
    std::vector<float> lse = random_vector((size_t)B * NH * Tl, rng), delta = random_vector((size_t)B * NH * Tl, rng);
    for (int bh = 0; bh < B * NH; bh++)
        for (int i = 0; i < n; i++) lse[(size_t)bh * Tl + q0 + i] = lse_blk[(size_t)bh * n + i] + rng.uniform();
    std::vector<float> dq((size_t)B * Tl * C), dkv((size_t)B * Tl * a.kv_row());
    ring_block_backward(dq.data(), dkv.data(), dout.data(), qkv.data(), q0, kv.data(), k0, n, causal, lse.data(),
                        delta.data(), B, Tl, a, AttentionKernels::MMA);
    std::vector<float> dq_start = random_vector(dq.size(), rng), dkv_start = random_vector(dkv.size(), rng);

    DeviceArray<bf16> d_qkv(qkv.size()), d_kv(kv.size()), d_dout(dout.size());
    DeviceArray<float> d_out(out.size()), d_lse_blk(lse_blk.size()), d_lse(lse.size()), d_delta(delta.size()),
        d_dq(dq.size()), d_dkv(dkv.size());
    upload(d_qkv, qkv);
    upload(d_kv, kv);
    upload(d_dout, dout);
    upload(d_lse, lse);
    upload(d_delta, delta);
    for (AttentionKernels kind : gpu_attention_kernels()) {
        INFO((kind == AttentionKernels::MMA ? "mma" : "wgmma"));
        d_out.poison();
        d_lse_blk.poison();
        ring_block_forward(d_out.ptr, d_lse_blk.ptr, d_qkv.ptr, q0, d_kv.ptr, k0, n, causal, B, Tl, a, kind);
        cuda_check(cudaStreamSynchronize(main_stream()));
        require_close("block out", download(d_out), out, AttentionCase::OUT_TOL);
        require_close("block lse", download(d_lse_blk), lse_blk, 1e-3);

        std::vector<float> first_dq, first_dkv;
        for (int run = 0; run < 2; run++) {
            upload(d_dq, dq_start);
            upload(d_dkv, dkv_start);
            ring_block_backward(d_dq.ptr, d_dkv.ptr, d_dout.ptr, d_qkv.ptr, q0, d_kv.ptr, k0, n, causal, d_lse.ptr,
                                d_delta.ptr, B, Tl, a, kind);
            cuda_check(cudaStreamSynchronize(main_stream()));
            std::vector<float> got_dq = download(d_dq), got_dkv = download(d_dkv);
            if (run == 1) {
                CHECK(got_dq == first_dq);  // deterministic: the same start and inputs, the same bits
                CHECK(got_dkv == first_dkv);
                break;
            }
            first_dq = got_dq;
            first_dkv = got_dkv;
            // what the kernels added; the rows of the other chunk (dQ) or the other key rows (dK, dV) untouched
            auto added = [&](const std::vector<float>& got, const std::vector<float>& start, int width, int r0,
                             const char* what) {
                std::vector<float> share(got.size());
                bool untouched = true;
                for (size_t i = 0; i < got.size(); i++) {
                    int row = (int)(i / width % Tl);
                    share[i] = got[i] - start[i];
                    if (row < r0 || row >= r0 + n) untouched = untouched && got[i] == start[i];
                }
                INFO(what << ": rows outside the block untouched");
                CHECK(untouched);
                return share;
            };
            std::vector<float> dq_share = added(got_dq, dq_start, C, q0, "dq");
            std::vector<float> dkv_share = added(got_dkv, dkv_start, a.kv_row(), k0, "dkv");
            require_close("block dq", dq_share, dq, AttentionCase::DQKV_TOL);
            // dK and dV apart, each against its own scale
            std::vector<float> dk_got, dk_want, dv_got, dv_want;
            for (size_t i = 0; i < dkv.size(); i++) {
                bool is_k = (int)(i % a.kv_row()) < a.K();
                (is_k ? dk_got : dv_got).push_back(dkv_share[i]);
                (is_k ? dk_want : dv_want).push_back(dkv[i]);
            }
            require_close("block dk", dk_got, dk_want, AttentionCase::DQKV_TOL);
            require_close("block dv", dv_got, dv_want, AttentionCase::DQKV_TOL);
        }
    }
}

// n = 77 leaves a ragged last tile in every kernel (the full mask must hide its keys past n as the causal one
// hides those after each query), n = 200 more than one block of rows; multi-head and grouped-query, hs 64 and 128
TEST_CASE("on the GPU, a ring block on the flash kernels (mma and wgmma), causal and full, matches the CPU block",
          "[cp][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    for (bool causal : {true, false}) {
        check_ring_block(2, 77, 128, 2, 2, causal);    // hs 64, multi-head
        check_ring_block(1, 200, 512, 8, 2, causal);   // hs 64, groups of 4
        check_ring_block(1, 77, 1024, 8, 8, causal);   // hs 128, multi-head
        check_ring_block(2, 200, 1024, 8, 1, causal);  // hs 128, multi-query
    }
}

TEST_CASE("cp = 2 (both splits) and 4 give the single-rank run's losses over 10 steps with accumulation; the cp bytes "
          "equal the formula; zig-zag balances the attention work", "[cp]") {
    Data data;
    TempDir out;
    // one dp rank: 2 micro-steps of b=2 × t=16, on one rank or split over the cp group
    std::string flags = data.flags(2, 64, EQUIVALENCE_STEPS, CP_MODEL);
    REQUIRE(single_ok(flags, out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    struct Layout {
        int cp;
        const char* split;
    };
    for (Layout l : {Layout{2, "zigzag"}, Layout{2, "contiguous"}, Layout{4, "zigzag"}}) {
        INFO("cp " << l.cp << " " << l.split);
        std::string dir = out / strfmt("cp%d_%s", l.cp, l.split), run;
        if (!train_ok(l.cp, flags + strfmt(" --cp %d --cp-split %s", l.cp, l.split), dir, &run)) continue;
        check_close(losses(dir), reference, 1e-5);
        require_cp_counted_equals_formula(run, l.cp);
        require_counted_equals_formula(run, 0);  // the gradients, reduced over the cp group
        std::vector<long> pairs = cp_pairs_lines(run);
        REQUIRE((int)pairs.size() == l.cp);
        long total = 0;
        for (long p : pairs) total += p;
        CHECK(total == 16 * 17 / 2);  // the causal triangle of a sequence, once
        bool balanced = std::all_of(pairs.begin(), pairs.end(), [&](long p) { return p == pairs[0]; });
        CHECK(balanced == (std::string(l.split) == "zigzag"));
    }
}

TEST_CASE("cp 2 × tp 2 (sp) and cp 2 × dp 2 under ZeRO-1, 2 and 3 (with -r 2) give the single-rank run's losses over "
          "10 steps with accumulation", "[cp]") {
    Data data;
    TempDir out;
    // the same global batch, 2 micro-steps each: 4 sequences on one rank, or 2 on each of the 2 dp ranks
    REQUIRE(single_ok(data.flags(4, 128, EQUIVALENCE_STEPS, CP_MODEL), out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    struct Layout {
        const char* name;
        int b;
        const char* flags;
    };
    for (Layout l : {Layout{"cp2_tp2", 4, " --cp 2 --tp 2"}, Layout{"cp2_dp2_z1", 2, " --cp 2 -z 1"},
                     Layout{"cp2_dp2_z2", 2, " --cp 2 -z 2"}, Layout{"cp2_dp2_z3_r2", 2, " --cp 2 -z 3 -r 2"}}) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(4, data.flags(l.b, 128, EQUIVALENCE_STEPS, CP_MODEL) + l.flags, dir, &run)) continue;
        check_close(losses(dir), reference, 1e-5);
        require_cp_counted_equals_formula(run, 2);
        require_counted_equals_formula(run);
        if (std::string(l.flags).find("--tp") != std::string::npos) require_tp_counted_equals_formula(run, 2, 1);
    }
}

TEST_CASE("--plan predicts the ledger of every cp rank, with tp and sp, dp and ZeRO-0, 1 and 3", "[cp]") {
    GPTConfig c = parse_model_descriptor(CP_MODEL);
    size_t whole_activations = 0;  // without cp, tp 1
    for (int cp : {1, 2, 4})
        for (int tp : {1, 2})
            for (int zero : {0, 1, 3})
                for (int dp : {1, 2})
                    for (int cp_rank = 0; cp_rank < cp; cp_rank++) {
                        INFO("cp " << cp << " rank " << cp_rank << ", tp " << tp << " (sp), dp " << dp << ", ZeRO-" << zero);
                        Comm group;  // dp × cp: only the size and rank matter until a collective runs
                        group.size = dp * cp;
                        group.rank = cp_rank;
                        GPT m;
                        ModelLayout layout;
                        layout.own = DataParallel<float>::model_buffers(zero);
                        layout.tp = TPSpec{tp, 0, tp > 1}, layout.cp = CPSpec{cp, cp_rank, CPSplit::ZigZag};
                        gpt_allocate(m, c, 2, 16, layout);
                        DataParallel dpr(m, group, zero, 1000);
                        ParallelPlan par{dp, zero, 1000, 1, tp, tp > 1};
                        par.cp = cp;
                        MemoryPlan plan = plan_memory(c, 2, 16, omp_get_max_threads(), par);
                        for (int i = 0; i < MEM_CATEGORIES; i++) {
                            INFO(mem_category_name(i));
                            CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                        }
                        if (cp == 1 && tp == 1 && dp == 1 && zero == 0) whole_activations = m.ledger.bytes[MEM_ACTIVATIONS];
                        if (cp > 1 && tp == 1) CHECK(m.ledger.bytes[MEM_ACTIVATIONS] < whole_activations);
                    }
    CHECK(whole_activations > 0);

    // the command line prints the same plan (for rank 0) and the cp bytes
    Data data;
    CommandResult r = single(data.flags(2, 128, 1, CP_MODEL) + " -z 1 --plan --world 4 --cp 2");
    INFO(r.output);
    REQUIRE(r.status == 0);
    ParallelPlan par{2, 1, (size_t)(0.06f * 1048576.0 / 4.0), 2, 1, false};
    par.cp = 2;
    MemoryPlan plan = plan_memory(c, 2, 16, 1, par);
    for (int i = 0; i < MEM_CATEGORIES; i++) {
        INFO(mem_category_name(i));
        CHECK(plan_category_bytes(r.output, mem_category_name(i)) == (long long)plan.bytes[i]);
    }
    CHECK(line_value(r.output, "context-parallel communication per step per rank: ") ==
          planned_cp_comm_bytes(c, par, 2, 16, Device::CPU));
}

TEST_CASE("a sequence cp cannot split is refused with one line, before any rank starts", "[cp]") {
    Data data;
    SECTION("-t 12 is not a multiple of 2·cp = 8") {
        std::string flags = data.flags(2, 24, 1, CP_MODEL) + " -t 12 --cp 4";
        check_one_line_error(single(flags + " --plan --world 4"), {"T=12", "2·cp = 8"});
        CommandResult r = mpirun(4, "./train_gpt", flags);
        INFO(r.output);
        CHECK(r.status != 0);
        CHECK(r.output.find("train_gpt: context parallelism: the sequence length T=12") != std::string::npos);
    }
    SECTION("under sp, tp must divide each cp rank's positions") {
        // -t 12 --cp 2: 6 positions per rank, which --tp 4 does not divide
        check_one_line_error(single(data.flags(2, 24, 1, CP_MODEL) + " -t 12 --cp 2 --tp 4 --plan --world 8"),
                             {"--sp 1", "--tp 4", "--cp 2"});
    }
}

TEST_CASE("a cp × dp run resumed from its checkpoint continues bit-exactly; its model file is the whole model", "[cp]") {
    Data data;
    TempDir out;
    GPTConfig c = parse_model_descriptor(CP_MODEL);
    for (int z : {0, 1}) {
        INFO("cp 2 × dp 2, ZeRO-" << z);
        check_resumes_bit_exactly(4, data.flags(2, 2 * 2 * 16, 6, CP_MODEL) + strfmt(" --cp 2 -z %d", z),
                                  out / strfmt("whole%d", z), out / strfmt("resumed%d", z), num_parameters(c));
    }
}

TEST_CASE("on the GPU, --plan --device cuda predicts the ledger of every cp rank, with tp and ZeRO", "[cp][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    GPTConfig c = parse_model_descriptor("d2c256h4t64v301");  // head size 64, which the GPU kernels take
    for (int cp : {2, 4})
        for (int tp : {1, 2})
            for (int zero : {0, 1, 3})
                for (int cp_rank = 0; cp_rank < cp; cp_rank++) {
                    INFO("cp " << cp << " rank " << cp_rank << ", tp " << tp << " (sp), ZeRO-" << zero);
                    Comm group;  // dp 1 × cp: only the size and rank matter until a collective runs
                    group.size = cp;
                    group.rank = cp_rank;
                    GPTCuda m;
                    ModelLayout layout;
                    layout.own = DataParallel<bf16>::model_buffers(zero);
                    layout.tp = TPSpec{tp, 0, tp > 1}, layout.cp = CPSpec{cp, cp_rank, CPSplit::ZigZag};
                    gpt_allocate(m, c, 2, 32, layout);
                    DataParallel<bf16> dpr(m, group, zero, 1000);
                    ParallelPlan par{1, zero, 1000, 1, tp, tp > 1};
                    par.cp = cp;
                    MemoryPlan plan = plan_memory(c, 2, 32, 1, par, Device::CUDA);
                    for (int i = 0; i < MEM_CATEGORIES; i++) {
                        INFO(mem_category_name(i));
                        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                    }
                }
}

}  // namespace test_context_parallel

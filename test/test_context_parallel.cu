// Tests of context parallelism (llmc/cp.cuh): on the CPU the zig-zag and contiguous splits, the refusal of a T
// the chunks do not divide, the balance zig-zag buys, and ring attention against attention over the whole
// sequence under `mpirun --oversubscribe` on 2, 3 and 4 ranks (build/cp_check); on a GPU, the ring's CUDA path
// on one rank against the CPU reference.
#include <unistd.h>

#include <algorithm>

#include "dev/cuda/kernel_cases.h"
#include "llmc/cp.cuh"
#include "mpi_helpers.h"

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
            for (int r = 0; r < N; r++) {
                CPLayout l = cp_layout(2 * N * n, N, r, split);
                for (int source = 0; source < N; source++)
                    for (int qi = 0; qi < 2; qi++)
                        for (int ki = 0; ki < 2; ki++) {
                            BlockMask m = block_mask(l.chunk_of(r, qi), l.chunk_of(source, ki));
                            pairs[r] += m == BlockMask::Full ? n * n : m == BlockMask::Causal ? n * (n + 1) / 2 : 0;
                        }
            }
            long total = 0;
            for (long p : pairs) total += p;
            CHECK(total == (long)(2 * N * n) * (2 * N * n + 1) / 2);  // the causal triangle, once
            bool balanced = std::all_of(pairs.begin(), pairs.end(), [&](long p) { return p == pairs[0]; });
            CHECK(balanced == (split == CPSplit::ZigZag));
        }
    }
}

TEST_CASE("ring attention equals whole-sequence attention on every rank's slice, cp = 2, 3, 4, both splits", "[cp]") {
    REQUIRE(access("build/cp_check", X_OK) == 0);
    for (int ranks : {2, 3, 4}) {
        CheckCounts counts = run_check_program(ranks, "cp_check");
        CHECK(counts.passed == 2 * 5 * ranks);  // per rank and split: out, lse, dq, dk, dv
        CHECK(counts.failed == 0);
    }
}

// One rank's two chunks already make three blocks (two causal, one full, merged into the second chunk's rows),
// so a group of one runs every CUDA piece of the ring but the transfers. Tolerances are the flash attention's
// (dev/cuda/kernel_cases.h): the inputs are bf16 and so are out and dqkv.
TEST_CASE("on the GPU, ring attention on one rank matches the CPU reference", "[cp][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    struct Shape {
        int B, T, C, NH;
    };
    for (Shape s : {Shape{2, 42, 128, 2}, Shape{1, 30, 96, 3}}) {  // head sizes 64 and 32
        INFO("B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH);
        AttentionCase k(s.B, s.T, s.C, s.NH, 15);
        Comm self;
        CPLayout l = cp_layout(s.T, 1, 0, CPSplit::ZigZag);
        auto close = [](const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
            Comparison c = compare_rms(gpu, cpu, tol);
            INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
            CHECK(c.pass());
        };
        ring_attention_forward(k.d_out.ptr, k.d_lse.ptr, k.d_qkv.ptr, s.B, s.C, s.NH, l, self);
        cuda_check(cudaStreamSynchronize(main_stream()));
        close("out", download(k.d_out), k.out, AttentionCase::OUT_TOL);
        close("lse", download(k.d_lse), k.lse, 1e-3);
        ring_attention_backward(k.d_dqkv.ptr, k.d_dout.ptr, k.d_qkv.ptr, k.d_out.ptr, k.d_lse.ptr, s.B, s.C, s.NH, l, self);
        cuda_check(cudaStreamSynchronize(main_stream()));
        close("dqkv", download(k.d_dqkv), k.dqkv_for_out(download(k.d_out)), AttentionCase::DQKV_TOL);
    }
}

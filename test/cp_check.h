// cp_check: ring attention (llmc/cp.cuh) against attention over the whole sequence, a hidden case of build/tests
// that test/test_context_parallel.cu runs under mpirun on 2, 3 or 4 ranks (a case of the test binary, which
// compiles the attention kernels anyway, rather than a program that compiled them once more). For multi-head
// attention (3 heads) and grouped-query attention (4 query heads sharing 2 key/value heads), every rank draws the
// same random qkv and output gradient for the whole sequence (B=2, T=2N·7: never a power of two, and chunks of 7
// tokens) and runs llmc/attention.cuh's CPU reference on all of it; the reference log-sum-exp is computed here in
// double from the same scores. Then, for the zig-zag and the contiguous split, ring attention runs on this rank's
// rows alone, and its output, log-sum-exp and dQ, dK, dV must equal the reference's at the same positions within
// 1e-6 relative (fp32, against each quantity's largest entry).
// On rank 0, a line with the worst relative error of each quantity, then "cp_check: R ranks, N passed, M failed"
// (ranks_check.h); the case fails if anything did.
#pragma once

#include <catch.hpp>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/cp.cuh"
#include "ranks_check.h"

namespace cp_check {

static Tally tally;

static const char* cp_split_name(CPSplit s) { return s == CPSplit::ZigZag ? "zigzag" : "contiguous"; }
constexpr double TOLERANCE = 1e-6;

// largest |got - want| over the arrays, relative to the largest |want|: normwise, so that entries near zero,
// which fp32 rounding in a different order moves by the same absolute amount as the others, do not dominate
static double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
    double worst = 0.0, scale = 0.0;
    for (size_t i = 0; i < want.size(); i++) {
        worst = fmax(worst, fabs((double)got[i] - want[i]));
        scale = fmax(scale, fabs((double)want[i]));
    }
    return worst / scale;
}

static void check(Comm& c, double error, const std::string& what, double* worst) {
    *worst = fmax(*worst, error);
    if (error <= TOLERANCE) {
        tally.passes++;
    } else {
        tally.failures++;
        printf("rank %d: FAIL %s: relative error %.3g > %.0e\n", c.rank, what.c_str(), error, TOLERANCE);
    }
}

TEST_CASE("cp_check: the ranks' side, run under mpirun by run_check (mpi_helpers.h)", "[.cp_check]") {
    run_on_ranks("cp_check", tally, [](Comm& world) {
        const int N = world.size, B = 2, C = 24, T = 2 * N * 7;
        double worst[5] = {};  // out, lse, dq, dk, dv
        for (RingHeads a : {RingHeads{C, 3, 3}, RingHeads{C, 4, 2}}) {
            const int NH = a.NH, KV = a.KV, hs = a.hs(), K = a.K(), row = a.qkv_row();
            // the whole sequence, the same on every rank
            Rng rng(2024 + KV);
            std::vector<float> qkv((size_t)B * T * row), dout((size_t)B * T * C);
            for (float& x : qkv) x = rng.normal(0.0f, 1.0f);
            for (float& x : dout) x = rng.normal(0.0f, 1.0f);
            std::vector<float> out(dout.size()), att((size_t)B * NH * T * T), dqkv(qkv.size()), lse((size_t)B * NH * T);
            std::vector<float> scratch((size_t)omp_get_max_threads() * T);
            attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH, KV);
            attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH, KV, scratch.data());
            for (int b = 0; b < B; b++)
                for (int h = 0; h < NH; h++)
                    for (int t = 0; t < T; t++) {
                        std::vector<double> scores;
                        double top = -INFINITY, sum = 0.0;
                        for (int t2 = 0; t2 <= t; t2++) {
                            double dot = 0.0;
                            for (int e = 0; e < hs; e++)
                                dot += (double)qkv[((size_t)b * T + t) * row + h * hs + e] *
                                       qkv[((size_t)b * T + t2) * row + C + h / (NH / KV) * hs + e];
                            scores.push_back(dot / sqrt((double)hs));
                            top = fmax(top, scores.back());
                        }
                        for (double x : scores) sum += exp(x - top);
                        lse[((size_t)b * NH + h) * T + t] = (float)(top + log(sum));
                    }

            for (CPSplit split : {CPSplit::ZigZag, CPSplit::Contiguous}) {
                CPLayout layout = cp_layout(T, N, world.rank, split);
                std::vector<int> positions = cp_positions(layout);
                int Tl = layout.local_tokens();
                auto slice = [&](const std::vector<float>& whole, long outer, int width) {
                    std::vector<float> part((size_t)outer * Tl * width);
                    cp_select(part.data(), whole.data(), outer, T, width, positions);
                    return part;
                };
                std::vector<float> my_qkv = slice(qkv, B, row), my_dout = slice(dout, B, C);
                std::vector<float> my_out((size_t)B * Tl * C, NAN), my_lse((size_t)B * NH * Tl, NAN),
                    my_dqkv((size_t)B * Tl * row, NAN);
                Ledger ledger;
                RingBuffers<float> ring = ring_buffers<float>(ledger, B, Tl, a);
                ring_attention_forward(my_out.data(), my_lse.data(), my_qkv.data(), B, a, layout, world, ring, AttentionKernels::MMA);
                ring_attention_backward(my_dqkv.data(), my_dout.data(), my_qkv.data(), my_out.data(), my_lse.data(), B, a,
                                        layout, world, ring, AttentionKernels::MMA);

                std::vector<float> want_dqkv = slice(dqkv, B, row);
                // the Q, K and V columns of a (B·Tl, C + 2K) gradient apart
                auto part = [&](const std::vector<float>& g, int which) {
                    int first = which == 0 ? 0 : C + (which - 1) * K, width = which == 0 ? C : K;
                    std::vector<float> p((size_t)B * Tl * width);
                    for (size_t r = 0; r < (size_t)B * Tl; r++)
                        for (int c = 0; c < width; c++) p[r * width + c] = g[r * row + first + c];
                    return p;
                };
                std::string tag = strfmt("cp=%d %s NH=%d KV=%d", N, cp_split_name(split), NH, KV);
                check(world, relative_error(my_out, slice(out, B, C)), tag + " out", &worst[0]);
                check(world, relative_error(my_lse, slice(lse, (long)B * NH, 1)), tag + " lse", &worst[1]);
                const char* names[3] = {"dq", "dk", "dv"};
                for (int which = 0; which < 3; which++)
                    check(world, relative_error(part(my_dqkv, which), part(want_dqkv, which)), tag + " " + names[which],
                          &worst[2 + which]);
            }
        }

        std::vector<double> worst_all(5);
        for (int i = 0; i < 5; i++) {
            double w = worst[i];
            std::vector<double> every(N);
            world.wait(world.all_gather(&w, every.data(), 1, DType::F64));
            for (double x : every) worst_all[i] = fmax(worst_all[i], x);
        }
        if (world.rank == 0)
            printf("worst relative errors: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", worst_all[0], worst_all[1],
                   worst_all[2], worst_all[3], worst_all[4]);
    });
}

}  // namespace cp_check

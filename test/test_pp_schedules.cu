// Tests of the pipeline-parallel schedules in llmc/pp_schedules.h, all on the host: every schedule for
// N = 1..4 ranks and m = 1..8 micro-batches must pass the checker (complete, ordered, matched, deadlock-free
// under rendezvous semantics); each rank's peak of micro-batches in flight must equal the closed form of its
// schedule (Megatron-LM's counts for 1F1B and interleaved); the simulated bubble must equal the Playbook's
// formula exactly for AFAB, 1F1B and interleaved and come within one stage-time of the zero-bubble paper's
// for ZB-H1. Planted errors, each a small edit of a valid schedule, must fail the checker with their rule.
#include <algorithm>
#include <string>
#include <vector>

#include "llmc/pp_schedules.h"
#include "test_helpers.h"

namespace test_pp_schedules {

// How many (micro, chunk) pairs hold activations at the worst point of a rank's list: from the Forward to the
// last action that reads them, the Backward, or the WeightGrad when the list has any. AFAB holds m; 1F1B
// min(N-rank, m); interleaved Megatron's warm-up + 1, at most m*V; ZB-H1 min(N+1, m) on every rank, counted
// until the W although a pending W needs only the inputs of its matmuls, not the whole chunk's activations
// (until their B it holds 1F1B's min(N-rank, m)).
int pp_peak_in_flight(const std::vector<PPAction>& rank_actions) {
    bool split = std::any_of(rank_actions.begin(), rank_actions.end(),
                             [](const PPAction& a) { return a.op == PPOp::WeightGrad; });
    PPOp last = split ? PPOp::WeightGrad : PPOp::Backward;
    int held = 0, peak = 0;
    for (const PPAction& a : rank_actions) {
        if (a.op == PPOp::Forward) peak = std::max(peak, ++held);
        if (a.op == last) held--;
    }
    return peak;
}

const PPKind all_kinds[] = {PPKind::AFAB, PPKind::OneFOneB, PPKind::Interleaved, PPKind::ZeroBubble};

// the (N, m, V) each schedule accepts within N <= 4, m <= 8, V <= 3
std::vector<std::vector<int>> shapes(PPKind kind) {
    std::vector<std::vector<int>> out;
    for (int N = 1; N <= 4; N++)
        for (int m = 1; m <= 8; m++)
            for (int V = 1; V <= (kind == PPKind::Interleaved ? 3 : 1); V++)
                if (kind != PPKind::Interleaved || m % N == 0) out.push_back({N, m, V});
    return out;
}

// idle time over the ideal time of one rank, the Playbook's normalization of pp_bubble_formula
double idle_over_ideal(const PPSimulation& sim) {
    double mean_busy = 0.0;
    for (double b : sim.busy) mean_busy += b / sim.busy.size();
    return (sim.makespan - mean_busy) / mean_busy;
}

std::vector<PPAction> without_weight_grads(std::vector<PPAction> actions) {
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [](const PPAction& a) { return a.op == PPOp::WeightGrad; }),
                  actions.end());
    return actions;
}

// index of the first action on a list with this op and micro-batch
size_t find_action(const std::vector<PPAction>& actions, PPOp op, int micro) {
    for (size_t i = 0; i < actions.size(); i++)
        if (actions[i].op == op && actions[i].micro == micro) return i;
    FAIL("no such action");
    return 0;
}

TEST_CASE("every schedule passes its checker", "[pp]") {
    for (PPKind kind : all_kinds)
        for (const auto& shape : shapes(kind)) {
            int N = shape[0], m = shape[1], V = shape[2];
            INFO(pp_schedule_name(kind) << " N " << N << " m " << m << " V " << V);
            PPSchedule s = pp_schedule(kind, N, m, V);
            REQUIRE((int)s.size() == N);
            CHECK_NOTHROW(check_pp_schedule(s, N, m, V, kind == PPKind::ZeroBubble));
        }
}

TEST_CASE("1F1B pairs each send with the neighbour's next receive in one group", "[pp]") {
    // rank 0 of N = 2: after F1 it sends micro 1's activation and receives micro 0's gradient together,
    // Megatron's send_forward_recv_backward
    PPSchedule s = pp_schedule(PPKind::OneFOneB, 2, 4, 1);
    size_t f1 = find_action(s[0], PPOp::Forward, 1);
    REQUIRE(f1 + 3 < s[0].size());
    std::vector<PPOp> group = {s[0][f1 + 1].op, s[0][f1 + 2].op};
    CHECK(std::count(group.begin(), group.end(), PPOp::SendActivation) == 1);
    CHECK(std::count(group.begin(), group.end(), PPOp::RecvGradient) == 1);
    CHECK(s[0][f1 + 3].op == PPOp::Backward);
}

TEST_CASE("micro-batches in flight per rank match each schedule's closed form", "[pp]") {
    for (PPKind kind : all_kinds)
        for (const auto& shape : shapes(kind)) {
            int N = shape[0], m = shape[1], V = shape[2];
            PPSchedule s = pp_schedule(kind, N, m, V);
            for (int rank = 0; rank < N; rank++) {
                INFO(pp_schedule_name(kind) << " N " << N << " m " << m << " V " << V << " rank " << rank);
                int expected = 0;
                switch (kind) {
                    case PPKind::AFAB: expected = m; break;
                    case PPKind::OneFOneB: expected = std::min(N - rank, m); break;
                    case PPKind::Interleaved:
                        // Megatron-LM: warm-up (N-rank-1)*2 + (V-1)*N forwards, plus the steady phase's one
                        expected = V == 1 ? std::min(N - rank, m) : std::min((N - rank - 1) * 2 + (V - 1) * N + 1, m * V);
                        break;
                    case PPKind::ZeroBubble:
                        expected = std::min(N + 1, m);
                        // until their B, ZB-H1 holds what 1F1B holds
                        CHECK(pp_peak_in_flight(without_weight_grads(s[rank])) == std::min(N - rank, m));
                        break;
                }
                CHECK(pp_peak_in_flight(s[rank]) == expected);
            }
        }
}

TEST_CASE("simulated bubbles equal the Playbook's formula for AFAB, 1F1B and interleaved", "[pp]") {
    // equal stage costs, whole backward b: bubble (N-1)(f+b) per rank over the ideal m*V*(f+b), exact
    for (PPKind kind : {PPKind::AFAB, PPKind::OneFOneB, PPKind::Interleaved})
        for (const auto& shape : shapes(kind))
            for (double b : {1.0, 2.0}) {
                int N = shape[0], m = shape[1], V = shape[2];
                INFO(pp_schedule_name(kind) << " N " << N << " m " << m << " V " << V << " b " << b);
                PPSimulation sim = simulate_pp_schedule(pp_schedule(kind, N, m, V), N, 1.0, b, 0.0);
                double formula = pp_bubble_formula(kind, N, m, V);
                CHECK(idle_over_ideal(sim) == Approx(formula).margin(1e-12));
                // the same as the idle share of the makespan that PPSimulation::bubble reports
                CHECK(sim.bubble == Approx(formula / (1.0 + formula)).margin(1e-12));
                for (double busy : sim.busy) CHECK(busy == Approx(m * V * (1.0 + b)));
            }
}

TEST_CASE("ZB-H1's bubble is below 1F1B's, and within one stage-time of a third of it", "[pp]") {
    // f = b = w = 1: 1F1B idles 3(N-1) stage-times per rank, the zero-bubble paper's ZB-H1 N-1
    for (int N = 2; N <= 4; N++)
        for (int m = 1; m <= 8; m++) {
            INFO("N " << N << " m " << m);
            PPSimulation zb = simulate_pp_schedule(pp_schedule(PPKind::ZeroBubble, N, m, 1), N, 1, 1, 1);
            PPSimulation one_f_one_b = simulate_pp_schedule(pp_schedule(PPKind::OneFOneB, N, m, 1), N, 1, 1, 1);
            for (double busy : zb.busy) CHECK(busy == Approx(3.0 * m));
            CHECK(idle_over_ideal(one_f_one_b) == Approx(double(N - 1) / m));
            CHECK(zb.makespan < one_f_one_b.makespan);
            if (m >= 2 * N) {
                CHECK(idle_over_ideal(zb) >= pp_bubble_formula(PPKind::ZeroBubble, N, m, 1) - 1e-12);
                CHECK(zb.makespan <= 3 * m + (N - 1) + 1);
            }
        }
    // the last shape, exact: N = 4, m = 8 idles 3 stage-times of 27, against 1F1B's 9 of 33
    PPSimulation zb = simulate_pp_schedule(pp_schedule(PPKind::ZeroBubble, 4, 8, 1), 4, 1, 1, 1);
    CHECK(zb.makespan == 27.0);
    CHECK(idle_over_ideal(zb) == Approx(pp_bubble_formula(PPKind::ZeroBubble, 4, 8, 1)));
}

TEST_CASE("the checker refuses a missing receive", "[pp]") {
    PPSchedule s = pp_schedule(PPKind::OneFOneB, 3, 4, 1);
    s[1].erase(s[1].begin() + find_action(s[1], PPOp::RecvActivation, 2));
    REQUIRE_THROWS_WITH(check_pp_schedule(s, 3, 4, 1, false),
                        Catch::Contains("rank 1") && Catch::Contains("(F micro 2 chunk 0): no earlier receive"));
}

TEST_CASE("the checker refuses a send to the wrong peer", "[pp]") {
    PPSchedule s = pp_schedule(PPKind::OneFOneB, 4, 4, 1);
    s[1][find_action(s[1], PPOp::SendActivation, 0)].peer = 3;
    REQUIRE_THROWS_WITH(check_pp_schedule(s, 4, 4, 1, false),
                        Catch::Contains("rank 1") && Catch::Contains("to rank 3): activations go to the next rank"));
}

TEST_CASE("the checker refuses a backward before its forward", "[pp]") {
    PPSchedule s = pp_schedule(PPKind::OneFOneB, 2, 2, 1);
    // the last rank runs F0 and B0 back to back; swap them
    size_t f0 = find_action(s[1], PPOp::Forward, 0);
    size_t b0 = find_action(s[1], PPOp::Backward, 0);
    std::swap(s[1][f0], s[1][b0]);
    REQUIRE_THROWS_WITH(check_pp_schedule(s, 2, 2, 1, false),
                        Catch::Contains("rank 1, action " + std::to_string(f0) + " (B micro 0 chunk 0): backward before its forward"));
}

TEST_CASE("the checker refuses a missing or unexpected weight gradient", "[pp]") {
    PPSchedule zb = pp_schedule(PPKind::ZeroBubble, 3, 6, 1);
    PPSchedule missing = zb;
    missing[0].erase(missing[0].begin() + find_action(missing[0], PPOp::WeightGrad, 4));
    REQUIRE_THROWS_WITH(check_pp_schedule(missing, 3, 6, 1, true),
                        Catch::Contains("rank 0, end of its") && Catch::Contains("micro 4 chunk 0 has no weight gradient"));
    REQUIRE_THROWS_WITH(check_pp_schedule(zb, 3, 6, 1, false),
                        Catch::Contains("weight gradient in a schedule whose backward is not split"));
    REQUIRE_THROWS_WITH(check_pp_schedule(pp_schedule(PPKind::OneFOneB, 3, 6, 1), 3, 6, 1, true),
                        Catch::Contains("has no weight gradient"));
}

TEST_CASE("the checker refuses exchanges split so that each rank receives before it sends", "[pp]") {
    // 1F1B on N = 2, m = 2, valid in every per-rank rule, but rank 0 waits for micro 0's gradient before it
    // sends micro 1's activation, while rank 1 waits for that activation before it sends the gradient
    auto compute = [](PPOp op, int micro) { return PPAction{op, micro, 0, -1}; };
    auto p2p = [](PPOp op, int micro, int peer) { return PPAction{op, micro, 0, peer}; };
    PPSchedule s(2);
    s[0] = {compute(PPOp::Forward, 0), p2p(PPOp::SendActivation, 0, 1), compute(PPOp::Forward, 1),
            p2p(PPOp::RecvGradient, 0, 1), compute(PPOp::Backward, 0), p2p(PPOp::SendActivation, 1, 1),
            p2p(PPOp::RecvGradient, 1, 1), compute(PPOp::Backward, 1)};
    s[1] = {p2p(PPOp::RecvActivation, 0, 0), compute(PPOp::Forward, 0), p2p(PPOp::RecvActivation, 1, 0),
            compute(PPOp::Backward, 0), p2p(PPOp::SendGradient, 0, 0), compute(PPOp::Forward, 1),
            compute(PPOp::Backward, 1), p2p(PPOp::SendGradient, 1, 0)};
    REQUIRE_THROWS_WITH(check_pp_schedule(s, 2, 2, 1, false),
                        Catch::Contains("deadlock: rank 0 at action 3 (recv grad micro 0 chunk 0 from rank 1)") &&
                            Catch::Contains("rank 1 at action 2 (recv act micro 1 chunk 0 from rank 0)"));
    // the same exchanges grouped as pp_schedule groups them run through
    PPSchedule grouped(2);
    grouped[0] = {compute(PPOp::Forward, 0), p2p(PPOp::SendActivation, 0, 1), compute(PPOp::Forward, 1),
                  p2p(PPOp::SendActivation, 1, 1), p2p(PPOp::RecvGradient, 0, 1), compute(PPOp::Backward, 0),
                  p2p(PPOp::RecvGradient, 1, 1), compute(PPOp::Backward, 1)};
    grouped[1] = {p2p(PPOp::RecvActivation, 0, 0), compute(PPOp::Forward, 0), compute(PPOp::Backward, 0),
                  p2p(PPOp::SendGradient, 0, 0), p2p(PPOp::RecvActivation, 1, 0), compute(PPOp::Forward, 1),
                  compute(PPOp::Backward, 1), p2p(PPOp::SendGradient, 1, 0)};
    CHECK_NOTHROW(check_pp_schedule(grouped, 2, 2, 1, false));
    CHECK(simulate_pp_schedule(grouped, 2, 1, 1, 0).makespan == 6.0);
}

TEST_CASE("schedule names and micro-batch counts that do not fit are refused with the flag to change", "[pp]") {
    for (PPKind kind : all_kinds) CHECK(parse_pp_schedule(pp_schedule_name(kind)) == kind);
    REQUIRE_THROWS_WITH(parse_pp_schedule("gpipe"), "--pp-schedule gpipe: expected afab, 1f1b, interleaved or zb");
    REQUIRE_THROWS_WITH(check_pp_micro_batches(PPKind::Interleaved, 4, 6, 2),
                        "--pp-schedule interleaved: the 6 micro-batches of a step must be a multiple of --pp 4");
    REQUIRE_THROWS_WITH(check_pp_micro_batches(PPKind::OneFOneB, 4, 8, 2),
                        "--vpp 2: only the interleaved schedule has virtual stages");
    REQUIRE_THROWS_WITH(pp_schedule(PPKind::ZeroBubble, 2, 4, 3), "--vpp 3: only the interleaved schedule has virtual stages");
    CHECK_NOTHROW(check_pp_micro_batches(PPKind::Interleaved, 4, 8, 1));
    CHECK_NOTHROW(check_pp_micro_batches(PPKind::AFAB, 4, 3, 1));
}

}  // namespace test_pp_schedules

// Tests of the pipeline-parallel schedules in llmc/pp_schedules.h, all on the host: every schedule for
// N = 1..4 ranks and m = 1..8 micro-batches must pass the checker (complete, ordered, matched, deadlock-free
// under rendezvous semantics), DualPipeV for N = 1..8 and m = 2N..32; each rank's peak of micro-batches in
// flight must equal the closed form of its schedule (Megatron-LM's counts for 1F1B and interleaved,
// DeepSeek's table's for DualPipeV); the simulated bubble must equal the Playbook's formula exactly for AFAB,
// 1F1B and interleaved, come within one stage-time of the zero-bubble paper's for ZB-H1, and equal the
// DeepSeek-V3 report's for DualPipeV. Planted errors, each a small edit of a valid schedule, must fail the
// checker with their rule.
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
// (until their B it holds 1F1B's min(N-rank, m)); DualPipeV 2N+1 chunks on every rank, until the W or the B.
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

// the looped schedules; DualPipeV, whose lists take 2·pp micro-batches or more, has its own cases below
const PPKind all_kinds[] = {PPKind::AFAB, PPKind::OneFOneB, PPKind::Interleaved, PPKind::ZeroBubble};

// each schedule's closed form of pp_peak_in_flight on a rank
int expected_in_flight(PPKind kind, int N, int m, int V, int rank) {
    switch (kind) {
        case PPKind::AFAB: return m;
        case PPKind::OneFOneB: return std::min(N - rank, m);
        case PPKind::Interleaved:
            // Megatron-LM: warm-up (N-rank-1)*2 + (V-1)*N forwards, plus the steady phase's one
            return V == 1 ? std::min(N - rank, m) : std::min((N - rank - 1) * 2 + (V - 1) * N + 1, m * V);
        case PPKind::ZeroBubble: return std::min(N + 1, m);
        // DeepSeek's table: PP+1 stages' activations per device, for its PP = 2N stages (m >= 2N always)
        case PPKind::DualPipeV: return 2 * N + 1;
    }
    return -1;
}

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
                // until their B, ZB-H1 holds what 1F1B holds
                if (kind == PPKind::ZeroBubble)
                    CHECK(pp_peak_in_flight(without_weight_grads(s[rank])) == std::min(N - rank, m));
                CHECK(pp_peak_in_flight(s[rank]) == expected_in_flight(kind, N, m, V, rank));
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
    REQUIRE_THROWS_WITH(parse_pp_schedule("gpipe"), "--pp-schedule gpipe: expected afab, 1f1b, interleaved, zb or dualpipev");
    REQUIRE_THROWS_WITH(check_pp_micro_batches(PPKind::Interleaved, 4, 6, 2),
                        "--pp-schedule interleaved: the 6 micro-batches of a step must be a multiple of --pp 4");
    REQUIRE_THROWS_WITH(check_pp_micro_batches(PPKind::OneFOneB, 4, 8, 2),
                        "--vpp 2: only the interleaved schedule has virtual stages");
    REQUIRE_THROWS_WITH(pp_schedule(PPKind::ZeroBubble, 2, 4, 3), "--vpp 3: only the interleaved schedule has virtual stages");
    CHECK_NOTHROW(check_pp_micro_batches(PPKind::Interleaved, 4, 8, 1));
    CHECK_NOTHROW(check_pp_micro_batches(PPKind::AFAB, 4, 3, 1));
}

// ----------------------------------------------------------------------------------------------------------
// DualPipeV: two chunks per rank in a V, its lists checked with that placement

PPPlacement v_placement(int N) { return pp_placement(PPKind::DualPipeV, N, 1); }

// index of the action on a list with this op, micro-batch and chunk
size_t find_action(const std::vector<PPAction>& actions, PPOp op, int micro, int chunk) {
    for (size_t i = 0; i < actions.size(); i++)
        if (actions[i].op == op && actions[i].micro == micro && actions[i].chunk == chunk) return i;
    FAIL("no such action");
    return 0;
}

// the exchange group that ends just before action i, or starts just after it
std::vector<PPAction> group_before(const std::vector<PPAction>& actions, size_t i) {
    size_t first = i;
    while (first > 0 && pp_is_p2p(actions[first - 1].op)) first--;
    return std::vector<PPAction>(actions.begin() + first, actions.begin() + i);
}
std::vector<PPAction> group_after(const std::vector<PPAction>& actions, size_t i) {
    size_t end = i + 1;
    while (end < actions.size() && pp_is_p2p(actions[end].op)) end++;
    return std::vector<PPAction>(actions.begin() + i + 1, actions.begin() + end);
}
bool holds(const std::vector<PPAction>& group, PPOp op, int micro, int chunk) {
    return std::any_of(group.begin(), group.end(),
                       [&](const PPAction& a) { return a.op == op && a.micro == micro && a.chunk == chunk; });
}

TEST_CASE("placements: looped stages wrap around the ranks, DualPipeV's go down the ranks and back up", "[pp]") {
    for (int N = 1; N <= 8; N++) {
        for (int V = 1; V <= 4; V++) {
            PPPlacement looped = pp_placement(PPKind::Interleaved, N, V);
            for (int g = 0; g < N * V; g++) {
                CHECK(looped.rank_of(g) == g % N);
                CHECK(looped.stage(g % N, g / N) == g);
                CHECK(looped.p2p_after(g) == (g < N * V - 1));
            }
        }
        // deepseek-ai/DualPipe's DualPipeV: rank r holds the r-th and the (2N-1-r)-th of 2N chunks, so the
        // embeddings and the loss are on rank 0, and rank N-1 passes stage N-1's output to its stage N in memory
        PPPlacement v = v_placement(N);
        REQUIRE(v.stages() == 2 * N);
        for (int r = 0; r < N; r++) {
            CHECK(v.stage(r, 0) == r);
            CHECK(v.stage(r, 1) == 2 * N - 1 - r);
            for (int chunk : {0, 1}) {
                CHECK(v.rank_of(v.stage(r, chunk)) == r);
                CHECK(v.chunk_of(v.stage(r, chunk)) == chunk);
            }
        }
        for (int g = 0; g < 2 * N; g++) CHECK(v.p2p_after(g) == (g < 2 * N - 1 && g != N - 1));
    }
}

TEST_CASE("DualPipeV's lists pass the checker for pp 1..8 and 2·pp..32 micro-batches", "[pp]") {
    for (int N = 1; N <= 8; N++)
        for (int m = 2 * N; m <= 32; m++) {
            INFO("N " << N << " m " << m);
            PPSchedule s = pp_schedule(PPKind::DualPipeV, N, m, 1);
            REQUIRE((int)s.size() == N);
            CHECK_NOTHROW(check_pp_schedule(s, v_placement(N), m, true));
            // the rules of the looped placement of two chunks do not hold for them
            CHECK_THROWS(check_pp_schedule(s, N, m, 2, true));
        }
}

TEST_CASE("DualPipeV pairs the forward of one micro-batch with the whole backward of another between two exchange groups", "[pp]") {
    // rank 1 of N = 4, m = 12, both of whose chunks exchange with both neighbours: phase 4's 2(m-2N+r+1) pairs
    // and phase 5's N-r-1, each F(i, c) B(j, 1-c) W(j, 1-c) with both receives in the group before (the first
    // pair's F0 input came a step early, in phase 2) and both sends in the group after
    const int N = 4, m = 12, rank = 1;
    std::vector<PPAction> actions = pp_schedule(PPKind::DualPipeV, N, m, 1)[rank];
    int pairs = 0;
    for (size_t i = 0; i + 2 < actions.size(); i++) {
        const PPAction &f = actions[i], &b = actions[i + 1];
        if (f.op != PPOp::Forward || b.op != PPOp::Backward) continue;
        INFO("pair " << pairs << ": " << pp_describe(f) << ", " << pp_describe(b));
        CHECK(f.micro != b.micro);
        CHECK(f.chunk != b.chunk);
        CHECK((actions[i + 2].op == PPOp::WeightGrad && actions[i + 2].micro == b.micro && actions[i + 2].chunk == b.chunk));
        std::vector<PPAction> before = group_before(actions, i), after = group_after(actions, i + 2);
        CHECK(holds(before, PPOp::RecvGradient, b.micro, b.chunk));
        CHECK(holds(before, PPOp::RecvActivation, f.micro, f.chunk) == (pairs > 0));
        CHECK(holds(after, PPOp::SendActivation, f.micro, f.chunk));
        CHECK(holds(after, PPOp::SendGradient, b.micro, b.chunk));
        pairs++;
    }
    CHECK(pairs == 2 * (m - 2 * N + rank + 1) + (N - rank - 1));
}

// DeepSeek-V3 report's DualPipe bubble, (PP/2-1)(F&B + B - 3W) for PP = 2N stages, with F = f, B = b + w the
// whole backward and W = w of one chunk. Where the two cannot agree: F&B is a forward and a backward overlapped
// on the GPU, while the CPU and the simulator run the pair in turn (an action's cost is its own: the simulator
// has no overlap to model), so F&B = F + B here. And the formula reads the schedule's picture, whose F and B
// cells are as wide: with b = f it is exact for any w, but with b != f the warm-up's chains of F's and the
// drain's of B's no longer cancel (measured at N = 8: f=2 b=1 w=1 idles 29 against the formula's 21; f=1 b=2
// w=1 27 against 28).
double deepseek_idle(int N, double f, double b, double w) {
    double F = f, B = b + w, W = w, F_and_B = F + B;
    return (N - 1) * (F_and_B + B - 3 * W);
}

TEST_CASE("DualPipeV's simulated bubble is the DeepSeek-V3 report's (PP/2-1)(F&B+B-3W), F&B run in turn", "[pp]") {
    const double costs[][3] = {{1, 1, 1}, {1, 1, 0.5}, {2, 2, 1}};
    for (const auto& c : costs)
        for (int N = 2; N <= 8; N++)
            for (int m = 2 * N; m <= 32; m++) {
                double f = c[0], b = c[1], w = c[2];
                INFO("f " << f << " b " << b << " w " << w << " N " << N << " m " << m);
                PPSimulation sim = simulate_pp_schedule(pp_schedule(PPKind::DualPipeV, N, m, 1), v_placement(N), f, b, w);
                for (double busy : sim.busy) CHECK(busy == Approx(2 * m * (f + b + w)));
                CHECK(sim.makespan - 2 * m * (f + b + w) == Approx(deepseek_idle(N, f, b, w)).margin(1e-9));
                if (f == b && b == w) CHECK(idle_over_ideal(sim) == Approx(pp_bubble_formula(PPKind::DualPipeV, N, m, 1)));
            }
    // the step-time model's path, matched_pp_schedule, matches with the V placement: the same time
    const MatchedSchedule& matched = matched_pp_schedule(PPKind::DualPipeV, 4, 10, 1);
    PPSimulation sim = simulate_pp_schedule(matched.actions, 4, matched.match, [](int, const PPAction&) { return 1.0; });
    CHECK(sim.makespan == 6 * 10 + deepseek_idle(4, 1, 1, 1));
}

TEST_CASE("DualPipeV's bubble against 1F1B, interleaved and ZB-H1 on the same micro-batches", "[pp]") {
    // each schedule's idle time over its ideal, which does not depend on how its chunks divide the layers. At
    // f = b = w, 1F1B idles (N-1)/m, interleaved with 2 chunks half that, ZB-H1 and DualPipeV (F&B in turn) a
    // third; at w = f/2 DualPipeV's (N-1)(f+2b-w)/(2m(f+b+w)) ties interleaved's (N-1)/(2m)
    const double costs[][3] = {{1, 1, 1}, {1, 1, 0.5}};
    for (const auto& c : costs)
        for (int N : {2, 4})
            for (int m : {8, 16}) {
                INFO("f " << c[0] << " b " << c[1] << " w " << c[2] << " N " << N << " m " << m);
                auto bubble = [&](PPKind kind, int V) {
                    return idle_over_ideal(simulate_pp_schedule(pp_schedule(kind, N, m, V), pp_placement(kind, N, V), c[0], c[1], c[2]));
                };
                double one_f_one_b = bubble(PPKind::OneFOneB, 1), interleaved = bubble(PPKind::Interleaved, 2),
                       zb = bubble(PPKind::ZeroBubble, 1), dualpipev = bubble(PPKind::DualPipeV, 1);
                CHECK(one_f_one_b == Approx(double(N - 1) / m));
                CHECK(interleaved == Approx(double(N - 1) / (2 * m)));
                CHECK(dualpipev < one_f_one_b);
                CHECK(dualpipev <= interleaved + 1e-12);
                if (c[2] == c[0]) {
                    CHECK(dualpipev == Approx(double(N - 1) / (3 * m)));
                    CHECK(dualpipev <= zb + 1e-12);
                } else {
                    CHECK(dualpipev == Approx(interleaved));
                }
            }
}

TEST_CASE("DualPipeV keeps 2·pp+1 chunks' activations on every rank, DeepSeek's PP+1", "[pp]") {
    // the same whether a chunk's activations are counted until its B or its W: the deferred W's are those of
    // the last backwards, after the forwards have run out
    for (int N = 1; N <= 8; N++)
        for (int m = 2 * N; m <= 32; m++) {
            PPSchedule s = pp_schedule(PPKind::DualPipeV, N, m, 1);
            for (int rank = 0; rank < N; rank++) {
                INFO("N " << N << " m " << m << " rank " << rank);
                CHECK(pp_peak_in_flight(s[rank]) == expected_in_flight(PPKind::DualPipeV, N, m, 1, rank));
                CHECK(pp_peak_in_flight(without_weight_grads(s[rank])) == 2 * N + 1);
            }
        }
}

TEST_CASE("the checker refuses DualPipeV lists with a planted error", "[pp]") {
    const int N = 4, m = 8;
    const PPSchedule valid = pp_schedule(PPKind::DualPipeV, N, m, 1);
    auto refused = [&](const PPSchedule& s) { return check_pp_schedule(s, v_placement(N), m, true); };
    SECTION("a dropped receive") {
        PPSchedule s = valid;
        s[2].erase(s[2].begin() + find_action(s[2], PPOp::RecvGradient, 0, 1));
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("rank 2") &&
                                            Catch::Contains("(B micro 0 chunk 1): no earlier receive of its output gradient"));
    }
    SECTION("an activation sent down on the way up") {
        PPSchedule s = valid;
        s[1][find_action(s[1], PPOp::SendActivation, 0, 1)].peer = 2;
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("rank 1") && Catch::Contains("to rank 2): activations go to the next rank"));
    }
    SECTION("the V's bottom run upside down") {
        PPSchedule s = valid;
        size_t down = find_action(s[N - 1], PPOp::Forward, 0, 0), up = find_action(s[N - 1], PPOp::Forward, 0, 1);
        std::swap(s[N - 1][down], s[N - 1][up]);
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("rank 3, action " + std::to_string(down) +
                                                        " (F micro 0 chunk 1): no earlier forward of the stage before it, on this rank"));
        s = valid;
        down = find_action(s[N - 1], PPOp::Backward, 0, 0), up = find_action(s[N - 1], PPOp::Backward, 0, 1);
        std::swap(s[N - 1][down], s[N - 1][up]);
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("rank 3, action " + std::to_string(up) +
                                                        " (B micro 0 chunk 0): no earlier backward of the stage after it, on this rank"));
    }
    SECTION("a p2p across the V's bottom") {
        PPSchedule s = valid;
        size_t f = find_action(s[N - 1], PPOp::Forward, 0, 0);
        s[N - 1].insert(s[N - 1].begin() + f + 1, PPAction{PPOp::SendActivation, 0, 0, N - 1});
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("(send act micro 0 chunk 0 to rank 3): the next stage is on this rank"));
    }
    SECTION("each receive just before its forward, without DualPipeV's early receives: a deadlock") {
        PPSchedule s = valid;
        for (int rank = 1; rank < N; rank++)
            for (int micro = 0; micro < m; micro++) {
                std::vector<PPAction>& actions = s[rank];
                PPAction receive = actions[find_action(actions, PPOp::RecvActivation, micro, 0)];
                actions.erase(actions.begin() + find_action(actions, PPOp::RecvActivation, micro, 0));
                actions.insert(actions.begin() + find_action(actions, PPOp::Forward, micro, 0), receive);
            }
        REQUIRE_THROWS_WITH(refused(s), Catch::Contains("pp schedule: deadlock: rank 0"));
    }
    CHECK_NOTHROW(refused(valid));
}

TEST_CASE("dualpipev is the trainer's name for DualPipeV, refused with fewer than 2·pp micro-batches", "[pp]") {
    CHECK(std::string(pp_schedule_name(PPKind::DualPipeV)) == "dualpipev");
    CHECK(parse_pp_schedule("dualpipev") == PPKind::DualPipeV);
    REQUIRE_THROWS_WITH(check_pp_micro_batches(PPKind::DualPipeV, 4, 7, 1),
                        "--pp-schedule dualpipev: the 7 micro-batches of a step (the gradient accumulation) must be "
                        "at least twice --pp 4");
    REQUIRE_THROWS_WITH(pp_schedule(PPKind::DualPipeV, 2, 3, 1), Catch::Contains("must be at least twice --pp 2"));
    REQUIRE_THROWS_WITH(pp_schedule(PPKind::DualPipeV, 2, 4, 2), "--vpp 2: only the interleaved schedule has virtual stages");
    CHECK_NOTHROW(check_pp_micro_batches(PPKind::DualPipeV, 4, 8, 1));
}

}  // namespace test_pp_schedules

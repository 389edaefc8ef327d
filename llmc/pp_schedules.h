// Pipeline-parallel schedules written out as lists of actions, one list per pp rank, and the checker that
// validates a list before anything runs. A runner executes a rank's list in order: compute actions (F, B, W)
// run the rank's model chunk, and each run of consecutive p2p actions is one exchange group (all receives
// posted, then all sends, waited together). Keeping the schedule as data lets the tests prove every schedule
// complete, ordered and deadlock-free, and measure its bubble and activation memory, with no GPU.
//
// Layout: the layers are split into virtual stages g in model order, and the schedule's placement (PPPlacement)
// says which rank holds g as which of its chunks: looped for AFAB, 1F1B, interleaved and ZB-H1 (N*V stages, g on
// rank g % N as its chunk g / N), a V for DualPipeV (2N stages down the ranks and back up: rank r holds stages r
// and 2N-1-r as its chunks 0 and 1). Every action names the local chunk on the rank that issues it.
// Schedules: AFAB (all forwards, then all backwards), 1F1B (Megatron-LM's non-interleaved schedule),
// interleaved 1F1B (Megatron-LM's virtual-pipeline schedule), ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline
// Parallelism": the backward split into B, the input gradient, and W, the weight gradient, W's deferred) and
// DualPipeV (deepseek-ai/DualPipe: DeepSeek-V3's DualPipe cut in half, the forward of one micro-batch paired
// with the backward of another so that on the GPU one's communication hides behind the other's compute).
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "llmc/utils.h"

enum class PPKind { AFAB, OneFOneB, Interleaved, ZeroBubble, DualPipeV };

// The trainer's names
inline PPKind parse_pp_schedule(const std::string& name) {
    if (name == "afab") return PPKind::AFAB;
    if (name == "1f1b") return PPKind::OneFOneB;
    if (name == "interleaved") return PPKind::Interleaved;
    if (name == "zb") return PPKind::ZeroBubble;
    if (name == "dualpipev") return PPKind::DualPipeV;
    fail("--pp-schedule %s: expected afab, 1f1b, interleaved, zb or dualpipev", name.c_str());
}

inline const char* pp_schedule_name(PPKind kind) {
    switch (kind) {
        case PPKind::AFAB: return "afab";
        case PPKind::OneFOneB: return "1f1b";
        case PPKind::Interleaved: return "interleaved";
        case PPKind::ZeroBubble: return "zb";
        case PPKind::DualPipeV: return "dualpipev";
    }
    return "?";
}

// Which rank holds virtual stage g, as which of its chunks. Looped: the N*V stages wrap around the ranks V
// times. V-shaped: 2N stages go down the ranks and back up, so the first stage (the embeddings) and the last
// (the loss) are both on rank 0, and rank N-1 holds stages N-1 and N and hands the one's output to the other in
// memory: every boundary between stages is a p2p exchange but that one.
struct PPPlacement {
    int ranks = 1;   // N
    int chunks = 1;  // per rank: V looped, 2 in a V
    bool v_shape = false;
    int stages() const { return ranks * chunks; }
    int stage(int rank, int chunk) const { return v_shape && chunk == 1 ? 2 * ranks - 1 - rank : chunk * ranks + rank; }
    int rank_of(int g) const { return v_shape && g >= ranks ? 2 * ranks - 1 - g : g % ranks; }
    int chunk_of(int g) const { return g / ranks; }
    // whether stage g's output reaches stage g + 1 by p2p, and stage g's input comes from stage g - 1 by p2p
    bool p2p_after(int g) const { return g < stages() - 1 && !(v_shape && g == ranks - 1); }
    bool p2p_before(int g) const { return g > 0 && p2p_after(g - 1); }
};

inline PPPlacement pp_looped(int N, int V) { return PPPlacement{N, V, false}; }
inline PPPlacement pp_placement(PPKind kind, int N, int V) {
    return kind == PPKind::DualPipeV ? PPPlacement{N, 2, true} : pp_looped(N, V);
}

// whether the schedule splits backward into B (the input gradient) and W (the weight gradients), run apart
inline bool pp_kind_splits_backward(PPKind kind) { return kind == PPKind::ZeroBubble || kind == PPKind::DualPipeV; }

// Backward is the whole backward, or only the input gradient when the schedule has WeightGrad actions
enum class PPOp { Forward, Backward, WeightGrad, SendActivation, RecvActivation, SendGradient, RecvGradient };

struct PPAction {
    PPOp op;
    int micro;
    int chunk;  // local chunk on the issuing rank
    int peer;   // pp rank at the other end of a p2p action; -1 for compute
};

using PPSchedule = std::vector<std::vector<PPAction>>;  // [rank] -> its actions in execution order

inline bool pp_is_p2p(PPOp op) { return op != PPOp::Forward && op != PPOp::Backward && op != PPOp::WeightGrad; }

// one line for error messages, e.g. "B micro 3 chunk 0" or "recv act micro 1 chunk 0 from rank 2"
inline const char* pp_op_name(PPOp op) {
    static const char* names[] = {"F", "B", "W", "send act", "recv act", "send grad", "recv grad"};
    return names[int(op)];
}
inline std::string pp_describe(const PPAction& a) {
    std::string s = std::string(pp_op_name(a.op)) + " micro " + std::to_string(a.micro) + " chunk " +
                    std::to_string(a.chunk);
    bool sends = a.op == PPOp::SendActivation || a.op == PPOp::SendGradient;
    if (pp_is_p2p(a.op)) s += (sends ? " to rank " : " from rank ") + std::to_string(a.peer);
    return s;
}

// Refuses micro-batch counts and virtual stages a schedule cannot use, with the flag to change.
inline void check_pp_micro_batches(PPKind kind, int N, int m, int V) {
    if (N < 1) fail("--pp %d: must be at least 1", N);
    if (m < 1) fail("pp: a step needs at least one micro-batch, got %d", m);
    if (V < 1) fail("--vpp %d: must be at least 1", V);
    if (V > 1 && kind != PPKind::Interleaved) fail("--vpp %d: only the interleaved schedule has virtual stages", V);
    if (kind == PPKind::Interleaved && m % N != 0)
        fail("--pp-schedule interleaved: the %d micro-batches of a step must be a multiple of --pp %d", m, N);
    // DualPipe's own requirement: the V fills with 2N forwards before its steady state's first pair
    if (kind == PPKind::DualPipeV && m < 2 * N)
        fail("--pp-schedule dualpipev: the %d micro-batches of a step (the gradient accumulation) must be at least "
             "twice --pp %d",
             m, N);
}

// ----------------------------------------------------------------------------------------------------------
// building schedules: AFAB, 1F1B and interleaved say in which order a rank runs its F and B, cut into steps,
// and pp_add_exchanges places one exchange group between consecutive steps; ZB-H1 places its exchanges by time

// A step is compute actions that run back to back; the exchange group before it receives what they consume
// and sends what the step before produced.
using PPSteps = std::vector<std::vector<PPAction>>;

// Turns a rank's step list into its action list. Pairing the sends of one step with the receives of the next
// in one group is Megatron's send_forward_recv_backward / send_backward_recv_forward: two neighbours that both
// want to send first meet in one group instead of waiting for each other.
inline std::vector<PPAction> pp_add_exchanges(int rank, const PPPlacement& at, const PPSteps& steps) {
    auto receives = [&](const std::vector<PPAction>& step, std::vector<PPAction>& out) {
        for (const PPAction& a : step) {
            int g = at.stage(rank, a.chunk);
            if (a.op == PPOp::Forward && at.p2p_before(g))
                out.push_back({PPOp::RecvActivation, a.micro, a.chunk, at.rank_of(g - 1)});
            if (a.op == PPOp::Backward && at.p2p_after(g))
                out.push_back({PPOp::RecvGradient, a.micro, a.chunk, at.rank_of(g + 1)});
        }
    };
    auto sends = [&](const std::vector<PPAction>& step, std::vector<PPAction>& out) {
        for (const PPAction& a : step) {
            int g = at.stage(rank, a.chunk);
            if (a.op == PPOp::Forward && at.p2p_after(g))
                out.push_back({PPOp::SendActivation, a.micro, a.chunk, at.rank_of(g + 1)});
            if (a.op == PPOp::Backward && at.p2p_before(g))
                out.push_back({PPOp::SendGradient, a.micro, a.chunk, at.rank_of(g - 1)});
        }
    };
    std::vector<PPAction> out;
    for (size_t s = 0; s < steps.size(); s++) {
        receives(steps[s], out);
        if (s > 0) sends(steps[s - 1], out);
        out.insert(out.end(), steps[s].begin(), steps[s].end());
    }
    if (!steps.empty()) sends(steps.back(), out);
    return out;
}

// the steps of 1F1B-like orders: an exchange between every two compute actions
inline PPSteps pp_one_step_each(const std::vector<PPAction>& order) {
    PPSteps steps;
    for (const PPAction& a : order) steps.push_back({a});
    return steps;
}

inline PPAction pp_compute(PPOp op, int micro, int chunk = 0) { return {op, micro, chunk, -1}; }

// all forwards, then all backwards, both in micro-batch order
inline std::vector<PPAction> pp_afab_order(int m) {
    std::vector<PPAction> order;
    for (int i = 0; i < m; i++) order.push_back(pp_compute(PPOp::Forward, i));
    for (int i = 0; i < m; i++) order.push_back(pp_compute(PPOp::Backward, i));
    return order;
}

// warm-up: the forwards that fill the pipeline below this rank; steady: one forward, one backward; cool-down:
// the backwards left
inline std::vector<PPAction> pp_1f1b_order(int rank, int N, int m) {
    int warmup = std::min(N - rank - 1, m);
    std::vector<PPAction> order;
    for (int i = 0; i < warmup; i++) order.push_back(pp_compute(PPOp::Forward, i));
    for (int i = warmup; i < m; i++) {
        order.push_back(pp_compute(PPOp::Forward, i));
        order.push_back(pp_compute(PPOp::Backward, i - warmup));
    }
    for (int i = m - warmup; i < m; i++) order.push_back(pp_compute(PPOp::Backward, i));
    return order;
}

// Megatron-LM's interleaved schedule. The rank's forwards walk the micro-batches in groups of N: micro-batches
// 0..N-1 through chunk 0, then the same through chunk 1, ..., then micro-batches N..2N-1 through chunk 0, and
// so on; the backwards walk the same way with the chunks reversed. The warm-up runs (N-rank-1)*2 + (V-1)*N
// forwards so that the first backward's gradient has had time to come back through every rank below. In the
// steady phase a forward and a backward form one step, so one group carries both their sends and both
// receives of the next step: the ranks form a ring (rank 0's chunk c+1 follows rank N-1's chunk c), and with
// a group after every action each rank's gradient send would wait on a neighbour's later group all round it.
inline PPSteps pp_interleaved_steps(int rank, int N, int m, int V) {
    int total = m * V;
    auto micro_of = [&](int k) { return (k / (N * V)) * N + k % N; };
    auto forward = [&](int k) { return pp_compute(PPOp::Forward, micro_of(k), (k / N) % V); };
    auto backward = [&](int k) { return pp_compute(PPOp::Backward, micro_of(k), V - 1 - (k / N) % V); };
    int warmup = std::min((N - rank - 1) * 2 + (V - 1) * N, total);
    PPSteps steps;
    for (int k = 0; k < warmup; k++) steps.push_back({forward(k)});
    for (int k = warmup; k < total; k++) steps.push_back({forward(k), backward(k - warmup)});
    for (int k = total - warmup; k < total; k++) steps.push_back({backward(k)});
    return steps;
}

// ZB-H1 (zero-bubble paper, section 3.1): B is only the input gradient, so the gradient reaches the rank
// below one B sooner, and W's, which nothing waits for, fill the time a rank would otherwise idle. The lists
// come from list-scheduling every rank on unit costs (f = b = w): each time slot a rank runs its next B if the
// gradient is there, else its next F if the input is there and memory allows, else its oldest pending W. F
// keeps 1F1B's limit of N-rank activations waiting for their B, and at most N+1 micro-batches waiting for
// their W (1F1B's first-stage N, plus one). With every rank's F, B and W on one clock, each send and its
// receive are placed at the time the data is ready, so the exchanges of one time slot form one group on every
// rank involved and no rank waits at a group for a partner that is still computing; the schedule is
// deadlock-free because the groups complete in time order. This comes within two slots of the paper's bubble
// of N-1 slots for N <= 6, against 1F1B's 3(N-1).
inline PPSchedule pp_zb_h1(int N, int m) {
    const int not_yet = 1 << 30;
    std::vector<std::vector<int>> forward_end(N, std::vector<int>(m, not_yet)), backward_end = forward_end;
    std::vector<int> forwards(N, 0), backwards(N, 0), weight_grads(N, 0);
    struct Timed {
        int time;
        int order;  // at one time, the exchanges (0) before the compute that starts then (1)
        PPAction action;
    };
    std::vector<std::vector<Timed>> timeline(N);
    auto exchange = [&](int from, int to, PPOp send, PPOp recv, int micro, int time) {
        timeline[from].push_back({time, 0, {send, micro, 0, to}});
        timeline[to].push_back({time, 0, {recv, micro, 0, from}});
    };
    for (int t = 0, done = 0; done < N; t++) {
        done = 0;
        for (int r = 0; r < N; r++) {
            int f = forwards[r], b = backwards[r], w = weight_grads[r];
            if (w == m) {
                done++;
                continue;
            }
            bool b_ready = b < m && forward_end[r][b] <= t && (r == N - 1 || backward_end[r + 1][b] <= t);
            bool f_ready = f < m && f - b < N - r && f - w < N + 1 && (r == 0 || forward_end[r - 1][f] <= t);
            if (b_ready) {
                timeline[r].push_back({t, 1, pp_compute(PPOp::Backward, b)});
                backward_end[r][b] = t + 1;
                if (r > 0) exchange(r, r - 1, PPOp::SendGradient, PPOp::RecvGradient, b, t + 1);
                backwards[r]++;
            } else if (f_ready) {
                timeline[r].push_back({t, 1, pp_compute(PPOp::Forward, f)});
                forward_end[r][f] = t + 1;
                if (r < N - 1) exchange(r, r + 1, PPOp::SendActivation, PPOp::RecvActivation, f, t + 1);
                forwards[r]++;
            } else if (w < b) {
                timeline[r].push_back({t, 1, pp_compute(PPOp::WeightGrad, w)});
                weight_grads[r]++;
            }
        }
    }
    PPSchedule schedule(N);
    for (int r = 0; r < N; r++) {
        std::stable_sort(timeline[r].begin(), timeline[r].end(), [](const Timed& x, const Timed& y) {
            return std::make_pair(x.time, x.order) < std::make_pair(y.time, y.order);
        });
        for (const Timed& x : timeline[r]) schedule[r].push_back(x.action);
    }
    return schedule;
}

// DualPipeV, as deepseek-ai/DualPipe's dualpipev.py runs it. Chunk 0 is the rank's stage on the way down, chunk
// 1 its stage on the way up; each chunk runs its forwards and its backwards, and receives and sends, in
// micro-batch order. A backward is B with its W right after it (the whole backward), or B alone with its W
// deferred, first in first out, to a step where the rank would otherwise wait (zero bubble). Rank r of N runs
// eight phases:
//   1. 2(N-r-1) F0: the way down fills below the rank;
//   2. r+1 times F0, F1: the first micro-batches turn at rank N-1 and come back up;
//   3. N-r-1 times B1 (W deferred), a deferred W, F1;
//   4. m-2N+r+1 times F0&B1, F1&B0: the steady state, the forward of one micro-batch paired with the whole
//      backward of another, both receives in the exchange group before the pair and both sends in the one
//      after it, so that on the GPU one's communication runs under the other's compute; at rank N-1 the first
//      F0 and B1 run apart (DeepSeek's, noted there as shortening the bubble);
//   5. N-r-1 times B1, F1&B0: the forwards run out;
//   6. r+1 times B1, B0: the backwards drain, the second half's W deferred (from a B1 on odd ranks, a B0 on
//      even ones);
//   7. N-r-1 times a deferred W, B0 (W deferred);
//   8. r+1 deferred W.
// The exchanges are grouped as dualpipev.py batches them: an action's receives and the sends of what ran
// before it wait together just before it, with two exceptions of DeepSeek's, kept. In phase 2 each F0's input is
// received one step early, with the F1 before it: with each receive just before its compute (as
// pp_add_exchanges places them) the lists deadlock for N >= 3, rank r's F0 send and rank r+1's F1 send each
// waiting in a group the other has not reached. And rank N-1 holds phase 2's last F1 output until its first
// B1's exchange, which changes neither the checker's verdict nor the simulated time. The micro-batches must be
// at least 2N, so that phase 4 runs on every rank.
inline PPSchedule pp_dualpipev(int N, int m) {
    PPPlacement at = pp_placement(PPKind::DualPipeV, N, 1);
    PPSchedule schedule(N);
    for (int rank = 0; rank < N; rank++) {
        std::vector<PPAction>& out = schedule[rank];
        std::vector<PPAction> pending;  // the p2p ops of the next exchange group
        std::deque<PPAction> deferred;  // W's waiting to run
        int next[7][2] = {};            // per op and chunk, the micro-batch its next action takes
        auto take = [&](PPOp op, int chunk) { return next[int(op)][chunk]++; };
        // a p2p op of the chunk, unless its stage's neighbour that way is no p2p away (the model's ends, the V's bottom)
        auto p2p = [&](PPOp op, int chunk) {
            int g = at.stage(rank, chunk);
            bool onward = op == PPOp::SendActivation || op == PPOp::RecvGradient;  // with stage g + 1
            if (onward ? at.p2p_after(g) : at.p2p_before(g))
                pending.push_back({op, take(op, chunk), chunk, at.rank_of(onward ? g + 1 : g - 1)});
        };
        auto exchange = [&]() {
            out.insert(out.end(), pending.begin(), pending.end());
            pending.clear();
        };
        auto forward = [&](int chunk) { out.push_back(pp_compute(PPOp::Forward, take(PPOp::Forward, chunk), chunk)); };
        auto backward = [&](int chunk, bool defer_w) {
            int micro = take(PPOp::Backward, chunk);
            out.push_back(pp_compute(PPOp::Backward, micro, chunk));
            PPAction w = pp_compute(PPOp::WeightGrad, micro, chunk);
            if (defer_w) deferred.push_back(w);
            else out.push_back(w);
        };
        // dualpipev.py's steps: an exchange group, then compute, whose sends wait for the next group
        auto forward_step = [&](int chunk, bool receive, bool send) {
            if (receive) p2p(PPOp::RecvActivation, chunk);
            exchange();
            forward(chunk);
            if (send) p2p(PPOp::SendActivation, chunk);
        };
        auto backward_step = [&](int chunk, bool defer_w) {
            p2p(PPOp::RecvGradient, chunk);
            exchange();
            backward(chunk, defer_w);
            p2p(PPOp::SendGradient, chunk);
        };
        auto pair_step = [&](int forward_chunk, int backward_chunk, bool receive) {
            if (receive) p2p(PPOp::RecvActivation, forward_chunk);
            p2p(PPOp::RecvGradient, backward_chunk);
            exchange();
            forward(forward_chunk);
            backward(backward_chunk, false);
            p2p(PPOp::SendActivation, forward_chunk);
            p2p(PPOp::SendGradient, backward_chunk);
        };
        auto weight_step = [&]() {
            exchange();
            out.push_back(deferred.front());
            deferred.pop_front();
        };
        bool last = rank == N - 1;
        for (int i = 0; i < 2 * (N - rank - 1); i++) forward_step(0, true, true);
        p2p(PPOp::RecvActivation, 0);  // each phase-2 F0's input a step early, and phase 4's first
        for (int i = 0; i < rank + 1; i++) {
            forward_step(0, false, false);
            p2p(PPOp::RecvActivation, 0);
            forward_step(1, true, !last || i < rank);  // rank N-1 holds its last F1's output
            p2p(PPOp::SendActivation, 0);
        }
        for (int i = 0; i < N - rank - 1; i++) {
            backward_step(1, true);
            p2p(PPOp::RecvActivation, 1);
            weight_step();
            forward_step(1, false, true);
        }
        for (int i = 0; i < m - 2 * N + rank + 1; i++) {
            if (i == 0 && last) {
                forward_step(0, false, false);
                p2p(PPOp::SendActivation, 1);  // phase 2's last F1
                backward_step(1, false);
            } else {
                pair_step(0, 1, i > 0);
            }
            pair_step(1, 0, true);
        }
        for (int i = 0; i < N - rank - 1; i++) {
            backward_step(1, false);
            pair_step(1, 0, true);
        }
        for (int i = 0, half = (rank + 1) / 2; i < rank + 1; i++) {
            backward_step(1, i > half || (i == half && rank % 2 == 1));
            backward_step(0, i >= half);
        }
        for (int i = 0; i < N - rank - 1; i++) {
            weight_step();
            backward_step(0, true);
        }
        for (int i = 0; i < rank + 1; i++) weight_step();
        exchange();
    }
    return schedule;
}

// The action lists of every rank. Interleaved with V = 1 is 1F1B, which is what Megatron-LM runs then.
inline PPSchedule pp_schedule(PPKind kind, int N, int m, int V) {
    check_pp_micro_batches(kind, N, m, V);
    if (kind == PPKind::ZeroBubble) return pp_zb_h1(N, m);
    if (kind == PPKind::DualPipeV) return pp_dualpipev(N, m);
    PPPlacement at = pp_placement(kind, N, V);
    PPSchedule schedule(N);
    for (int rank = 0; rank < N; rank++) {
        PPSteps steps;
        switch (kind) {
            case PPKind::AFAB: steps = pp_one_step_each(pp_afab_order(m)); break;
            case PPKind::OneFOneB: steps = pp_one_step_each(pp_1f1b_order(rank, N, m)); break;
            case PPKind::Interleaved:
                steps = V == 1 ? pp_one_step_each(pp_1f1b_order(rank, N, m)) : pp_interleaved_steps(rank, N, m, V);
                break;
            case PPKind::ZeroBubble:
            case PPKind::DualPipeV: break;  // built above
        }
        schedule[rank] = pp_add_exchanges(rank, at, steps);
    }
    return schedule;
}

// ----------------------------------------------------------------------------------------------------------
// running a schedule under rendezvous semantics: the deadlock check and the timing simulation share it

// Where each p2p action's partner is: the matching op on the other rank, found by (activation or gradient,
// micro-batch, the boundary between virtual stages g and g+1 that it crosses).
struct PPMatching {
    std::vector<std::vector<int>> group;                       // [rank][action] -> exchange group index, -1 for compute
    std::vector<std::vector<std::pair<int, int>>> partner;     // [rank][action] -> (rank, action) of the matching op
    std::vector<std::vector<std::pair<int, int>>> group_span;  // [rank][group] -> [first action, end)
};

inline PPMatching pp_match(const PPSchedule& s, const PPPlacement& at) {
    int N = at.ranks;
    PPMatching match;
    using Key = std::tuple<bool, int, int>;  // (is gradient, micro, boundary)
    std::map<Key, std::pair<int, int>> senders, receivers;
    for (int rank = 0; rank < N; rank++) {
        const auto& actions = s[rank];
        match.group.emplace_back(actions.size(), -1);
        match.partner.emplace_back(actions.size(), std::make_pair(-1, -1));
        match.group_span.emplace_back();
        for (int i = 0; i < (int)actions.size(); i++) {
            const PPAction& a = actions[i];
            if (!pp_is_p2p(a.op)) continue;
            if (i == 0 || !pp_is_p2p(actions[i - 1].op)) match.group_span[rank].push_back({i, i});
            match.group_span[rank].back().second = i + 1;
            match.group[rank][i] = (int)match.group_span[rank].size() - 1;
            int g = at.stage(rank, a.chunk);
            bool gradient = a.op == PPOp::SendGradient || a.op == PPOp::RecvGradient;
            bool receives = a.op == PPOp::RecvActivation || a.op == PPOp::RecvGradient;
            int boundary = (a.op == PPOp::SendActivation || a.op == PPOp::RecvGradient) ? g : g - 1;
            (receives ? receivers : senders)[Key(gradient, a.micro, boundary)] = {rank, i};
        }
    }
    for (auto& [key, send] : senders) {
        auto recv = receivers.find(key);
        if (recv == receivers.end()) continue;
        match.partner[send.first][send.second] = recv->second;
        match.partner[recv->second.first][recv->second.second] = send;
    }
    for (int rank = 0; rank < N; rank++)
        for (int i = 0; i < (int)s[rank].size(); i++)
            if (pp_is_p2p(s[rank][i].op) && match.partner[rank][i].first < 0)
                fail("pp schedule: rank %d, action %d (%s): no matching op on any rank", rank, i,
                     pp_describe(s[rank][i]).c_str());
    return match;
}

struct PPRun {
    std::vector<double> end;   // per rank, the time its last action finished
    std::vector<double> busy;  // per rank, the compute time
    std::string stuck;         // empty when every rank finished; else what each stuck rank waits for
};

// Runs every rank: compute actions never block and take cost(rank, action); an exchange group completes, taking no
// time, once every op in it has its partner in the partner rank's current group or in a group that rank has
// already completed. It completes when the last of the ranks involved arrives, so data flows from the end of
// the producing compute to the start of the consuming one.
template <typename Cost>
inline PPRun pp_run(const PPSchedule& s, int N, const PPMatching& match, Cost cost) {
    PPRun run{std::vector<double>(N, 0.0), std::vector<double>(N, 0.0), ""};
    std::vector<int> pos(N, 0);
    std::vector<std::vector<double>> arrival(N);
    std::vector<std::vector<bool>> completed(N);
    for (int r = 0; r < N; r++) {
        arrival[r].assign(match.group_span[r].size(), 0.0);
        completed[r].assign(match.group_span[r].size(), false);
    }
    auto current_group = [&](int r) { return pos[r] < (int)s[r].size() ? match.group[r][pos[r]] : -1; };
    bool progress = true;
    while (progress) {
        progress = false;
        for (int r = 0; r < N; r++) {
            while (pos[r] < (int)s[r].size()) {
                const PPAction& a = s[r][pos[r]];
                if (!pp_is_p2p(a.op)) {
                    double c = cost(r, a);
                    run.end[r] += c;
                    run.busy[r] += c;
                    pos[r]++;
                    progress = true;
                    continue;
                }
                int gi = match.group[r][pos[r]];
                arrival[r][gi] = run.end[r];
                auto [first, end] = match.group_span[r][gi];
                bool ready = true;
                double done = run.end[r];
                for (int i = first; i < end && ready; i++) {
                    auto [pr, pa] = match.partner[r][i];
                    int pg = match.group[pr][pa];
                    ready = completed[pr][pg] || current_group(pr) == pg;
                    if (ready) done = std::max(done, arrival[pr][pg]);
                }
                if (!ready) break;
                completed[r][gi] = true;
                run.end[r] = done;
                pos[r] = end;
                progress = true;
            }
        }
    }
    for (int r = 0; r < N; r++) {
        if (pos[r] == (int)s[r].size()) continue;
        auto [first, end] = match.group_span[r][match.group[r][pos[r]]];
        for (int i = first; i < end; i++) {
            auto [pr, pa] = match.partner[r][i];
            if (completed[pr][match.group[pr][pa]] || current_group(pr) == match.group[pr][pa]) continue;
            if (!run.stuck.empty()) run.stuck += "; ";
            run.stuck += "rank " + std::to_string(r) + " at action " + std::to_string(i) + " (" +
                         pp_describe(s[r][i]) + ") while rank " + std::to_string(pr) + " is at action " +
                         std::to_string(pos[pr]);
            break;
        }
    }
    return run;
}

// ----------------------------------------------------------------------------------------------------------
// the checker

// Fails on the first broken rule with "pp schedule: rank R, action I (what): rule". The rules: (a) every
// (micro, virtual stage) has one F and one B on its rank, and one W exactly when the backward is split;
// (b) F before B before W; (c) the receive a compute action consumes comes before it, the send of what it
// produced after it, and there are no p2p actions past the first and last virtual stages; where the neighbouring
// stage is on the same rank (the V's bottom), its F comes before this F, and its B before this B, with no p2p
// between them; (d) every op is sent to the right peer and matched by one op there; (e) the ranks run to the
// end under rendezvous semantics.
inline void check_pp_schedule(const PPSchedule& s, const PPPlacement& at, int m, bool split_backward) {
    int N = at.ranks, V = at.chunks;
    if ((int)s.size() != N) fail("pp schedule: %d rank lists for --pp %d", (int)s.size(), N);
    int last_stage = at.stages() - 1;
    for (int rank = 0; rank < N; rank++) {
        const auto& actions = s[rank];
        // per (micro, chunk), how many of each op this rank has run so far
        std::vector<std::vector<std::vector<int>>> seen(m, std::vector<std::vector<int>>(V, std::vector<int>(7, 0)));
        auto broken = [&](int i, const char* rule) {
            fail("pp schedule: rank %d, action %d (%s): %s", rank, i, pp_describe(actions[i]).c_str(), rule);
        };
        for (int i = 0; i < (int)actions.size(); i++) {
            const PPAction& a = actions[i];
            if (a.micro < 0 || a.micro >= m) broken(i, "micro-batch out of range");
            if (a.chunk < 0 || a.chunk >= V) broken(i, "chunk out of range");
            int g = at.stage(rank, a.chunk);
            auto count = [&](PPOp op) { return seen[a.micro][a.chunk][int(op)]; };
            // the same micro-batch's op on this rank's stage g + step, which must be here when no p2p reaches it
            auto here = [&](int step, PPOp op) { return seen[a.micro][at.chunk_of(g + step)][int(op)]; };
            if (count(a.op) > 0) broken(i, "appears twice");
            switch (a.op) {
                case PPOp::Forward:
                    if (a.peer != -1) broken(i, "a compute action takes peer -1");
                    if (at.p2p_before(g) && count(PPOp::RecvActivation) == 0) broken(i, "no earlier receive of its input activation");
                    if (g > 0 && !at.p2p_before(g) && here(-1, PPOp::Forward) == 0)
                        broken(i, "no earlier forward of the stage before it, on this rank");
                    break;
                case PPOp::Backward:
                    if (a.peer != -1) broken(i, "a compute action takes peer -1");
                    if (count(PPOp::Forward) == 0) broken(i, "backward before its forward");
                    if (at.p2p_after(g) && count(PPOp::RecvGradient) == 0) broken(i, "no earlier receive of its output gradient");
                    if (g < last_stage && !at.p2p_after(g) && here(1, PPOp::Backward) == 0)
                        broken(i, "no earlier backward of the stage after it, on this rank");
                    break;
                case PPOp::WeightGrad:
                    if (a.peer != -1) broken(i, "a compute action takes peer -1");
                    if (!split_backward) broken(i, "weight gradient in a schedule whose backward is not split");
                    if (count(PPOp::Backward) == 0) broken(i, "weight gradient before its backward");
                    break;
                case PPOp::SendActivation:
                    if (g == last_stage) broken(i, "the last virtual stage has no next stage to send to");
                    if (!at.p2p_after(g)) broken(i, "the next stage is on this rank: no p2p to it");
                    if (a.peer != at.rank_of(g + 1)) broken(i, "activations go to the next rank");
                    if (count(PPOp::Forward) == 0) broken(i, "sent before the forward that produces it");
                    break;
                case PPOp::RecvActivation:
                    if (g == 0) broken(i, "the first virtual stage has no previous stage to receive from");
                    if (!at.p2p_before(g)) broken(i, "the previous stage is on this rank: no p2p from it");
                    if (a.peer != at.rank_of(g - 1)) broken(i, "activations come from the previous rank");
                    break;
                case PPOp::SendGradient:
                    if (g == 0) broken(i, "the first virtual stage has no previous stage to send to");
                    if (!at.p2p_before(g)) broken(i, "the previous stage is on this rank: no p2p to it");
                    if (a.peer != at.rank_of(g - 1)) broken(i, "gradients go to the previous rank");
                    if (count(PPOp::Backward) == 0) broken(i, "sent before the backward that produces it");
                    break;
                case PPOp::RecvGradient:
                    if (g == last_stage) broken(i, "the last virtual stage has no next stage to receive from");
                    if (!at.p2p_after(g)) broken(i, "the next stage is on this rank: no p2p from it");
                    if (a.peer != at.rank_of(g + 1)) broken(i, "gradients come from the next rank");
                    break;
            }
            seen[a.micro][a.chunk][int(a.op)]++;
        }
        for (int micro = 0; micro < m; micro++)
            for (int chunk = 0; chunk < V; chunk++) {
                const auto& c = seen[micro][chunk];
                int g = at.stage(rank, chunk);
                auto missing = [&](const char* what) {
                    fail("pp schedule: rank %d, end of its %d actions: micro %d chunk %d has no %s", rank,
                         (int)actions.size(), micro, chunk, what);
                };
                if (!c[int(PPOp::Forward)]) missing("forward");
                if (!c[int(PPOp::Backward)]) missing("backward");
                if (split_backward && !c[int(PPOp::WeightGrad)]) missing("weight gradient");
                if (at.p2p_after(g) && !c[int(PPOp::SendActivation)]) missing("send of its output activation");
                if (at.p2p_before(g) && !c[int(PPOp::SendGradient)]) missing("send of its input gradient");
            }
    }
    PPMatching match = pp_match(s, at);
    PPRun run = pp_run(s, N, match, [](int, const PPAction&) { return 1.0; });
    if (!run.stuck.empty()) fail("pp schedule: deadlock: %s", run.stuck.c_str());
}

// the looped schedules' (AFAB, 1F1B, interleaved, ZB-H1) N ranks of V chunks
inline void check_pp_schedule(const PPSchedule& s, int N, int m, int V, bool split_backward) {
    check_pp_schedule(s, pp_looped(N, V), m, split_backward);
}

// ----------------------------------------------------------------------------------------------------------
// time

// Timing of a schedule: each rank's compute action takes cost(rank, action); p2p takes no time but a group
// completes only when all ranks in it have arrived. `bubble` is the idle share of the makespan,
// 1 - mean(busy)/makespan. pp_bubble_formula is the Playbook's ratio of idle time to the ideal time instead,
// so the two relate as bubble = formula / (1 + formula).
struct PPSimulation {
    double makespan;
    std::vector<double> busy;
    double bubble;
};

template <typename Cost>
inline PPSimulation simulate_pp_schedule(const PPSchedule& s, int N, const PPMatching& match, Cost cost) {
    PPRun run = pp_run(s, N, match, cost);
    if (!run.stuck.empty()) fail("pp schedule: deadlock: %s", run.stuck.c_str());
    PPSimulation sim{*std::max_element(run.end.begin(), run.end.end()), run.busy, 0.0};
    double mean_busy = 0.0;
    for (double x : run.busy) mean_busy += x / N;
    sim.bubble = sim.makespan > 0 ? 1.0 - mean_busy / sim.makespan : 0.0;
    return sim;
}

template <typename Cost>
inline PPSimulation simulate_pp_schedule(const PPSchedule& s, const PPPlacement& at, Cost cost) {
    return simulate_pp_schedule(s, at.ranks, pp_match(s, at), cost);
}

// A schedule's action lists with their matching, built once per (kind, N, m, V) and kept: --search prices
// tens of thousands of layouts with the same schedules again and again, and matching the sends to the receives
// was most of its time.
struct MatchedSchedule {
    PPSchedule actions;
    PPMatching match;
};
inline const MatchedSchedule& matched_pp_schedule(PPKind kind, int N, int m, int V) {
    static std::map<std::tuple<PPKind, int, int, int>, MatchedSchedule> built;
    auto key = std::make_tuple(kind, N, m, V);
    auto found = built.find(key);
    if (found != built.end()) return found->second;
    PPSchedule actions = pp_schedule(kind, N, m, V);
    PPMatching match = pp_match(actions, pp_placement(kind, N, V));
    return built.emplace(key, MatchedSchedule{std::move(actions), std::move(match)}).first->second;
}

inline bool pp_splits_backward(const PPSchedule& s) {
    for (const auto& actions : s)
        for (const PPAction& a : actions)
            if (a.op == PPOp::WeightGrad) return true;
    return false;
}

// the same stage costs on every rank: a Forward takes f, a Backward b and a WeightGrad w, per chunk and
// micro-batch (a Backward takes b + w when the schedule has no WeightGrad, so every schedule does the same work)
inline PPSimulation simulate_pp_schedule(const PPSchedule& s, const PPPlacement& at, double f, double b, double w) {
    bool split = pp_splits_backward(s);
    return simulate_pp_schedule(s, at, [&](int, const PPAction& a) {
        if (a.op == PPOp::Forward) return f;
        if (a.op == PPOp::Backward) return split ? b : b + w;
        return w;
    });
}
// the looped schedules' on N ranks, which match their sends and receives alike for any V
inline PPSimulation simulate_pp_schedule(const PPSchedule& s, int N, double f, double b, double w) {
    return simulate_pp_schedule(s, pp_looped(N, 1), f, b, w);
}

// The Playbook's bubble: idle time over the ideal m*(f+b) of one rank, for equal stage costs. ZB-H1's is the
// paper's for f = b = w and m >= N, where it idles (N-1) * (f + b - w) instead of 1F1B's (N-1) * (f + b + w).
// DualPipeV's is the DeepSeek-V3 report's (PP/2-1)(F&B + B - 3W) for its PP = 2N stages, with F = f, B = b + w
// (the whole backward) and W = w of one chunk, over the ideal 2m(F + B) of the rank's two chunks; F&B, a
// forward and a backward paired, is taken as F + B, the two run in turn as the CPU runs them: at f = b = w,
// 2(N-1)f of 6mf, ZB-H1's ratio. On a GPU the pair's communication hides under compute instead of adding to it,
// which this does not count.
inline double pp_bubble_formula(PPKind kind, int N, int m, int V) {
    switch (kind) {
        case PPKind::AFAB:
        case PPKind::OneFOneB: return double(N - 1) / m;
        case PPKind::Interleaved: return double(N - 1) / (V * m);
        case PPKind::ZeroBubble:
        case PPKind::DualPipeV: return double(N - 1) / (3.0 * m);
    }
    return 0.0;
}

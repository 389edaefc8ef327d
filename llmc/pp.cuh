// Pipeline parallelism: the model's layers split over the N ranks of the pp group (stages), the micro-batches
// of a step flowing through them. Three things live here: the split (which layers each stage holds), the
// runner (which executes a stage's list of actions from llmc/pp_schedules.h: forwards, backwards and
// weight-gradient steps of chunks on micro-batches, and the exchanges with the neighbouring stages), each action
// a span of the profiled step's trace (llmc/profile.h), and the timing of its busy and idle time.
//
// The split. The L layers form the schedule's virtual stages (N·V looped, V = --vpp virtual stages per rank for
// the interleaved schedule; 2N for DualPipeV's V), as even as can be: where every layer is of one kind the first
// L mod stages get one layer more (the last stage also runs the final layernorm and the classifier, so the extra
// layers go first); where dense and sparse layers differ in cost (the weights a token passes through:
// layer_token_weights), consecutive runs of layers whose largest cost is the least it can be, each stage taking
// as many layers as that allows while one remains for each stage after it. The
// schedule's placement (PPPlacement, llmc/pp_schedules.h) says which rank runs virtual stage g as which of its
// chunks: looped, rank g mod N as its chunk g / N; in the V, rank r runs stages r and 2N-1-r as its chunks 0
// and 1, both in model order. The first stage holds the embeddings; the last the final norm and the classifier:
// a tied one is wte, so when that stage is on another rank it holds a copy of the embeddings (llmc/zero.cuh
// keeps the copies equal), while an untied Llama's lm_head is its own and lives on the last stage alone. In the
// V both ends are rank 0's: it embeds the micro-batches and takes their loss, with one copy of a tied wte.
//
// What crosses stages: the residual stream after a chunk's last layer, forward, and its gradient, backward;
// B×T/cp rows of C on each rank, or under sequence parallelism the rank's share of them (each tp rank
// exchanges with the tp rank of the same index on the next stage). Where two consecutive stages are one rank's
// (the V's bottom, stages N-1 and N on rank N-1) the runner hands them over in memory instead. Every stage is
// given the whole micro-batch of tokens: the first embeds the inputs, the last scores the targets.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/gpt.cuh"
#include "llmc/pp_schedules.h"
#include "llmc/zero.cuh"

struct PPSpec {
    int size = 1, rank = 0;
    int virtual_stages = 1;  // V, chunks per rank
    PPKind kind = PPKind::OneFOneB;
    bool on() const { return size > 1; }
    PPPlacement placement() const { return pp_placement(kind, size, virtual_stages); }
    // the rank that runs the last virtual stage: the classifier and the loss (N-1 looped, 0 in the V)
    int head_rank() const {
        PPPlacement at = placement();
        return at.rank_of(at.stages() - 1);
    }
};

// the layers of virtual stage g of `stages`: [first, first + count)
inline std::pair<int, int> virtual_stage_layers(const GPTConfig& c, int stages, int g) {
    int L = c.num_layers;
    // layers of one kind (a dense model's, or a model's with experts in every layer) cost the same, so they are not
    // weighed: the planner's search asks for thousands of splits
    bool one_kind = c.count_dense_layers() == 0;
    std::vector<double> cost = one_kind ? std::vector<double>{} : layer_token_weights(c);
    if (one_kind || std::all_of(cost.begin(), cost.end(), [&](double x) { return x == cost[0]; })) {
        int base = L / stages, extra = L % stages;
        return {g * base + std::min(g, extra), base + (g < extra ? 1 : 0)};
    }
    // the stages' first layers, filling each up to `cap` while one layer remains for each later stage
    auto split = [&](double cap) {
        std::vector<int> first(stages + 1, L);
        int l = 0;
        for (int s = 0; s < stages; s++) {
            first[s] = l;
            double sum = cost[l++];
            while (l < L && L - l > stages - 1 - s && sum + cost[l] <= cap) sum += cost[l++];
        }
        first[stages] = l;
        return first;
    };
    // the least cap that fits (the costs are whole numbers): between the largest layer's and the whole model's
    double lo = *std::max_element(cost.begin(), cost.end()), hi = std::accumulate(cost.begin(), cost.end(), 0.0);
    while (lo < hi) {
        double mid = std::floor((lo + hi) / 2);
        if (split(mid)[stages] == L) hi = mid;
        else lo = mid + 1;
    }
    std::vector<int> first = split(lo);
    return {first[g], first[g + 1] - first[g]};
}

// the part of the model a stage holds; one line naming the flags when the layers cannot fill the stages
inline ModelPart stage_part(const GPTConfig& c, const PPSpec& pp) {
    PPPlacement at = pp.placement();
    int stages = at.stages();
    if (c.num_layers < stages) {
        std::string flags = pp.kind == PPKind::DualPipeV ? strfmt("--pp %d --pp-schedule dualpipev", pp.size)
                                                         : strfmt("--pp %d --vpp %d", pp.size, pp.virtual_stages);
        fail("%s: the model's %d layers cannot fill %d virtual stages (one layer at least each)", flags.c_str(),
             c.num_layers, stages);
    }
    ModelPart part;
    for (int k = 0; k < at.chunks; k++) {
        auto [first, count] = virtual_stage_layers(c, stages, at.stage(pp.rank, k));
        part.chunk_first.push_back(first);
        part.chunk_layers.push_back(count);
    }
    part.first = at.rank_of(0) == pp.rank;
    part.last = pp.head_rank() == pp.rank;
    part.tied = c.tied();
    return part;
}

// Runs a stage's share of a step: its actions in order, on the model's micro-batch slots. A (micro-batch,
// chunk) takes a slot at its first action (the receive of its input, or its forward) and gives it back after
// its backward (its weight-gradient step under a split backward). The gradient of its input leaves from the
// model's backward scratch, which a weight-gradient step leaves alone, so its send must come before the next
// forward or backward (DualPipeV runs a whole backward as B, its W, then the send). Where the stage before a
// chunk's is this rank's own other chunk (the V's bottom), its forward copies that chunk's output of the same
// micro-batch into its input, and its backward copies its input's gradient into that chunk's output gradient:
// both slots are held then, the one chunk's from its forward to its backward, the other's from its forward on.
template <typename floatX>
struct Pipeline {
    Comm* comm = nullptr;  // the pp group
    PPSpec spec;           // this rank's place in the pipeline, and the schedule's placement of the chunks
    int head_slot = 0;     // the slot of the classifier's last forward, which row losses and logits read
    bool timing = false;   // time each action to its end on the device, for busy and span
    double busy = 0.0;     // seconds of compute (forward, backward, weight gradients) in the last run, when timing
    double span = 0.0;     // ... and the whole run's

    // the chunk of the rank that runs the virtual stage before `chunk`'s, when no p2p comes between them (the
    // V's bottom); else -1
    static int chunk_before(const PPSpec& pp, int chunk) {
        PPPlacement at = pp.placement();
        int g = at.stage(pp.rank, chunk);
        return g > 0 && !at.p2p_before(g) ? at.chunk_of(g - 1) : -1;
    }

    // per action, the (micro-batch, chunk) pairs that give their slots back after it; and the most slots held
    // at once, for the actions of rank pp.rank
    struct SlotPlan {
        std::vector<std::vector<std::pair<int, int>>> release;
        int peak = 0;
    };
    static SlotPlan plan_slots(const std::vector<PPAction>& actions, const PPSpec& pp) {
        SlotPlan plan;
        plan.release.assign(actions.size(), {});
        std::map<std::pair<int, int>, size_t> last;
        for (size_t i = 0; i < actions.size(); i++) {
            const PPAction& a = actions[i];
            // a forward at the V's bottom reads the output of the chunk below (forward-only lists have no later use)
            int below = a.op == PPOp::Forward ? chunk_before(pp, a.chunk) : -1;
            if (below >= 0) last[{a.micro, below}] = i;
            if (a.op == PPOp::SendGradient) {
                size_t k = i;
                auto same = [&](const PPAction& b) { return b.micro == a.micro && b.chunk == a.chunk; };
                while (k > 0 && (pp_is_p2p(actions[k - 1].op) || (actions[k - 1].op == PPOp::WeightGrad && same(actions[k - 1]))))
                    k--;
                if (k == 0 || actions[k - 1].op != PPOp::Backward || !same(actions[k - 1]))
                    fail("pipeline: %s must come in the exchange right after its backward (or its W)", pp_describe(a).c_str());
                continue;
            }
            last[{a.micro, a.chunk}] = i;
        }
        for (const auto& [pair, i] : last) plan.release[i].push_back(pair);
        // held from the first action to the exchange or action that releases it
        int held = 0;
        std::map<std::pair<int, int>, bool> holding;
        for (size_t i = 0; i < actions.size(); i++) {
            const PPAction& a = actions[i];
            if (a.op != PPOp::SendGradient && !holding[{a.micro, a.chunk}]) holding[{a.micro, a.chunk}] = true, held++;
            plan.peak = std::max(plan.peak, held);
            bool group_ends = !pp_is_p2p(a.op) || i + 1 == actions.size() || !pp_is_p2p(actions[i + 1].op);
            if (!group_ends) continue;
            for (size_t k = i + 1; k-- > 0;) {  // this action, or every op of the exchange it ends
                held -= (int)plan.release[k].size();
                if (k == 0 || !pp_is_p2p(actions[k].op) || !pp_is_p2p(actions[k - 1].op)) break;
            }
        }
        return plan;
    }
    static int slots_needed(const std::vector<PPAction>& actions, const PPSpec& pp) {
        return std::max(1, plan_slots(actions, pp).peak);
    }

    // Executes `actions` over micro-batches of B×T tokens (inputs[j], targets[j] for micro-batch j; targets may
    // be empty for a forward-only list, which leaves the logits). dloss is each token's weight in the loss
    // (gpt_backward_chunk's), 0 for a forward-only list. Returns the sum of the micro-batches' losses on the
    // last stage, 0 elsewhere. Under data parallelism each backward and weight-gradient step tells dpr
    // whether it is of the last micro-batch, when ZeRO-0/1 reduce. A weight-gradient step needs the model's
    // backward split (ModelLayout's split_backward).
    double run(GPTModel<floatX>& m, DataParallel<floatX>* dpr, const std::vector<PPAction>& actions,
               const std::vector<std::vector<int>>& inputs, const std::vector<std::vector<int>>& targets, int B, int T,
               float dloss) {
        int micro_batches = (int)inputs.size();
        SlotPlan plan = plan_slots(actions, spec);
        if (plan.peak > (int)m.slots.size())
            fail("pipeline: the schedule keeps %d micro-batches in flight; the model has %zu slots", plan.peak, m.slots.size());
        std::map<std::pair<int, int>, int> slot_of;
        std::vector<int> free_slots;
        for (int s = (int)m.slots.size() - 1; s >= 0; s--) free_slots.push_back(s);
        auto slot_for = [&](const PPAction& a) {
            auto it = slot_of.find({a.micro, a.chunk});
            if (it != slot_of.end()) return it->second;
            int s = free_slots.back();
            free_slots.pop_back();
            return slot_of[{a.micro, a.chunk}] = s;
        };
        auto release = [&](size_t i) {
            for (const std::pair<int, int>& pair : plan.release[i]) {
                free_slots.push_back(slot_of.at(pair));
                slot_of.erase(pair);
            }
        };
        LocalDims d = model_dims(m, B, T);
        size_t rows = (size_t)d.R * d.C;
        floatX* input_grad = nullptr;  // of the last backward, until its send
        double t0 = now_seconds(), loss = 0.0;
        busy = 0.0;
        for (size_t i = 0; i < actions.size();) {
            const PPAction& a = actions[i];
            double start = now_seconds();
            ProfileScope action = profile_action(a);
            if (pp_is_p2p(a.op)) {
                // an exchange: the run of p2p ops up to the next compute action
                size_t end = i;
                std::vector<Comm::P2P> ops;
                for (; end < actions.size() && pp_is_p2p(actions[end].op); end++) {
                    const PPAction& p = actions[end];
                    bool send = p.op == PPOp::SendActivation || p.op == PPOp::SendGradient;
                    floatX* buf = nullptr;
                    if (p.op == PPOp::SendGradient) buf = input_grad;
                    else if (p.op == PPOp::RecvActivation) buf = gpt_chunk_input(m, slot_for(p));
                    else buf = gpt_chunk_output(m, slot_for(p), p.chunk);  // leaving forward, arriving backward
                    ops.push_back({send, buf, rows, dtype_of<floatX>(), p.peer});
                }
                for (CommRequest& r : comm->exchange(ops)) comm->wait(r);
                for (size_t k = i; k < end; k++) release(k);
                i = end;
                continue;
            }
            int s = slot_for(a);
            int below = chunk_before(spec, a.chunk);  // this rank's chunk that runs the stage before, or -1
            if (a.op == PPOp::Forward) {
                if (below >= 0)
                    device_copy<floatX>(gpt_chunk_input(m, s), gpt_chunk_output(m, slot_of.at({a.micro, below}), below), rows);
                const int* labels = targets.empty() ? nullptr : targets[a.micro].data();
                float l = gpt_forward_chunk(m, s, a.chunk, inputs[a.micro].data(), labels, B, T, dloss);
                if (m.part.head(a.chunk)) head_slot = s;
                if (m.part.head(a.chunk) && labels) loss += l;
            } else {
                // ZeRO-0/1 reduce a bucket when the last micro-batch's gradients of it are complete
                if (dpr) dpr->begin_micro_step(a.micro == micro_batches - 1);
                if (a.op == PPOp::Backward) input_grad = gpt_backward_chunk(m, s, a.chunk, dloss);
                else gpt_weight_grads_chunk(m, s, a.chunk);
                if (a.op == PPOp::Backward && below >= 0)
                    device_copy<floatX>(gpt_chunk_output(m, slot_of.at({a.micro, below}), below), input_grad, rows);
            }
            if (timing) device_synchronize<floatX>();  // time the work, not its launch
            busy += now_seconds() - start;
            release(i);
            i++;
        }
        span = now_seconds() - t0;
        return loss;
    }

    // an action's span of the trace: "F3" (the forward of micro-batch 3) in category forward, backward or weight,
    // or an exchange with the neighbours in category p2p (named by its first op), with the micro-batch, the chunk
    // and its virtual stage
    ProfileScope profile_action(const PPAction& a) const {
        bool p2p = pp_is_p2p(a.op);
        const char* category = p2p ? "p2p" : a.op == PPOp::Forward ? "forward" : a.op == PPOp::Backward ? "backward" : "weight";
        return profile_span(category, [&] {
            std::string args = strfmt("\"micro\": %d, \"chunk\": %d, \"stage\": %d", a.micro, a.chunk,
                                      spec.placement().stage(spec.rank, a.chunk));
            if (p2p) args += strfmt(", \"first_op\": \"%s\", \"peer\": %d", pp_op_name(a.op), a.peer);
            return std::make_pair(p2p ? std::string("p2p") : strfmt("%s%d", pp_op_name(a.op), a.micro), args);
        });
    }
};

// The forward-only list of a stage for validation and sampling: micro-batches one after another through the
// virtual stages in model order, each received, run and sent on (or, at the V's bottom, run on this rank).
inline std::vector<PPAction> pp_forward_only(const PPSpec& pp, int micro_batches) {
    PPPlacement at = pp.placement();
    std::vector<PPAction> list;
    for (int j = 0; j < micro_batches; j++)
        for (int g = 0; g < at.stages(); g++) {
            if (at.rank_of(g) != pp.rank) continue;
            int k = at.chunk_of(g);
            if (at.p2p_before(g)) list.push_back({PPOp::RecvActivation, j, k, at.rank_of(g - 1)});
            list.push_back({PPOp::Forward, j, k, -1});
            if (at.p2p_after(g)) list.push_back({PPOp::SendActivation, j, k, at.rank_of(g + 1)});
        }
    return list;
}

// the virtual stages a rank runs, for its name in a trace: "stage 1", or "stages 0 and 3" (DualPipeV's V of 2)
inline std::string stage_names(const PPSpec& pp) {
    PPPlacement at = pp.placement();
    if (at.chunks == 1) return strfmt("stage %d", at.stage(pp.rank, 0));
    std::string s = "stages ";
    for (int k = 0; k < at.chunks; k++)
        s += strfmt("%s%d", k == 0 ? "" : k == at.chunks - 1 ? " and " : ", ", at.stage(pp.rank, k));
    return s;
}

// which layers each stage runs, in one line: "pp: layers 0-2 on stage 0, 3-4 on stage 1, ..."
inline void print_stage_layers(const GPTConfig& c, const PPSpec& pp) {
    std::string line = "pp: layers";
    for (int s = 0; s < pp.size; s++) {
        ModelPart part = stage_part(c, PPSpec{pp.size, s, pp.virtual_stages, pp.kind});
        line += s == 0 ? " " : "; ";
        for (int k = 0; k < part.chunks(); k++) {
            int a = part.chunk_first[k], b = a + part.chunk_layers[k] - 1;
            line += (k ? ", " : "") + (a == b ? strfmt("%d", a) : strfmt("%d-%d", a, b));
        }
        line += strfmt(" on stage %d", s);
    }
    int head = pp.head_rank();
    std::string embeddings = c.tied() && head != 0 ? strfmt("stages 0 and %d", head) : "stage 0";
    printf("%s (embeddings on %s, the classifier on stage %d)\n", line.c_str(), embeddings.c_str(), head);
}

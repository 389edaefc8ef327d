// The step-time model behind --plan's "predicted step" line and --search: one optimizer step of a layout,
// priced against a hardware profile (llmc/hardware.h), from the same shapes and byte counts as the memory plan.
//
// Compute. Each matmul costs 2·M·N·K FLOPs at the profile's rate for its smallest dimension; backward does two
// of the same shapes per forward matmul (the input's gradient and the weight's). Causal attention does
// 2·B·Tq·T·Cl FLOPs forward (Tq = T/cp local queries against T/2 keys on average, two products) and 2.5 times
// that backward. The element-wise kernels cost the bytes they read and write at the profile's bandwidth:
// streaming ones (layernorm, residual, the embeddings, AdamW, the gradient norm, FP8's casts) at memory_gbps,
// those with a tanh or exp per element (GELU, the cross-entropy) at transcendental_gbps; every op a fixed launch
// cost.
//
// FP8 (--fp8 1, by --fp8-recipe). The matmuls of every layer but the model's first and last run at the recipe's
// rate in the profile (blockwise GEMMs on Hopper apply their 1x128 and 128x128 scales in the main loop and
// accumulate in fp32 throughout: slower than tensorwise ones; mxfp8's scale in Blackwell's tensor cores), after
// the casts of their operands, which fp8_casts (below) counts as llmc/fp8.cuh runs them. A weight whose dimensions
// are not whole tiles of a block recipe runs in bf16, casts and all, as the router does under every recipe.
//
// Communication. Each collective costs the bytes one rank sends (the plan's counts: llmc/plan.h) at the bus
// bandwidth of the link its group crosses, plus a latency per call. Ranks are laid out tp fastest, then cp,
// dp and pp (llmc/grid.cuh), so a group stays inside a node when its span, the product of its size and the
// sizes inside it, fits the node's devices. What is exposed:
//   tp  every collective: the next op needs its result;
//   cp  the ring's hops beyond the attention they overlap with;
//   ep  the all-to-alls, which the experts wait for;
//   pp  each send, on the sending stage, and the bubble the schedule leaves (simulated with each stage's own
//       costs: llmc/pp_schedules.h);
//   dp  the reductions that cannot hide behind backward (the embeddings' bucket, reduced last; ZeRO-0's gathers,
//       done when a reduce staging is reused; the parameters' all-gather after the update under ZeRO-1/2), and
//       the share of the rest the backend does not overlap (the profile's `overlap`).
// The step is the pipeline's makespan (m micro-batches back to back without pp), the exposed dp time and the
// optimizer. MFU counts the model's FLOPs as llm.c does, 6N + 6·L·C·T per token (N: the parameters a token
// uses), against the profile's peak on every rank.
#pragma once

#include <algorithm>
#include <vector>

#include "llmc/hardware.h"
#include "llmc/plan.h"
#include "llmc/pp_schedules.h"

struct StepTime {
    double compute = 0;                             // the critical stage's own work, including the optimizer
    double dp = 0, tp = 0, cp = 0, pp = 0, ep = 0;  // exposed communication
    double bubble = 0;                              // the critical stage's idle time in the pipeline
    double seconds = 0;                             // the sum of the above
    double tokens_per_second = 0, mfu = 0;
    double fp8_casts = 0;  // of compute: the critical stage's FP8 casts (--fp8 1)
    double optimizer = 0;  // of compute: the critical stage's optimizer step (AdamW and the gradient norm)
};

// the link a group crosses: inside a node when its span of consecutive ranks fits the node's devices
struct Link {
    double bytes_per_second, latency;
};
inline Link group_link(const HardwareProfile& hw, long span, int devices_per_node) {
    if (span <= devices_per_node) return {hw.intra_gbps * 1e9, hw.intra_latency_us * 1e-6};
    return {hw.inter_gbps * 1e9, hw.inter_latency_us * 1e-6};
}

// a collective's time: the bytes this rank sends over the link, and the calls' latency
inline double link_seconds(const Link& l, double bytes, double calls) {
    return bytes / l.bytes_per_second + calls * l.latency;
}

// FLOPs per token by llm.c's count: 6 per parameter a token uses (with experts, K of the E blocks of each expert
// tensor) and 6·L·A·T for attention, A its width (C, but NH·hd where a head size of its own makes it other:
// Qwen3's)
inline double model_flops_per_token(const GPTConfig& c, int T) {
    ModelTable table = model_table(c);
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    double dense = 0, experts = 0, A = (double)table[ATTPROJW].cols, L = c.num_layers;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) (table[t].expert ? experts : dense) += (double)sizes[t];
    return 6 * (dense + experts * c.top_k / c.num_experts) + 6 * L * A * T;
}

// One micro-batch's work on one rank: a forward pass and a backward pass of a chunk of layers (with the
// embeddings when it starts the model, the head when it ends it). Backward's weight-gradient share is kept
// apart for the zero-bubble schedule's W; the exposed communication of each pass is priced separately.
struct PassCost {
    double forward = 0, backward = 0, weight_grad = 0;  // compute
    double casts = 0;                                   // ... of which FP8's casts
    double tp = 0, cp = 0, ep = 0, pp = 0;              // exposed communication, forward and backward together
    double forward_comm = 0;                            // ... of which in forward
};

// One linear layer's FP8 casts: the bytes they move and the kernels they launch, in forward, for the input's
// gradient and for the weight's (fp8_cast_forward and fp8_cast_backward in llmc/fp8.cuh), and the amaxes that
// tensorwise gathers over the ranks holding pieces of the tensor.
struct Fp8CastCount {
    double bytes = 0, ops = 0, gathers = 0;
    void add(double b, double o, double g) { bytes += b, ops += o, gathers += g; }
};
struct Fp8Casts {
    Fp8CastCount forward, input_grad, weight_grad;
    Fp8CastCount split;  // what a split backward (the zero-bubble schedules) casts again in its W step
    double padded = 0;   // the rows of the weight gradient's sum, padded as its casts pad them
};
// A layer with weight W (out×in) on M rows of input x (M×in) and output gradient dout (M×out), X bytes a value.
//   tensorwise  each cast is an amax pass over the operand (X bytes an element read), the scale, and a cast pass
//               (X read, a code written): 2X + 1 bytes and 4 kernels (the amax's memset, the amax, the scale, the
//               cast); a gathered amax per cast where a group holds the tensor's pieces. Forward casts x and W.
//               Backward casts dout once for both gradients, the GPU writing its transposed copy, the tokens
//               padded to 16 (P rows), in the same pass (2X + 1 + 1 bytes), then W again (its transpose) for the
//               input's gradient and x again (its transpose, P rows) for the weight's. A split backward casts dout
//               in each step: once more, without the copy.
//   blockwise   no amax pass: each 1×128 tile's scale comes from the tile in hand, so a cast is one kernel that
//               reads X and writes a code and its tile's fp32 scale (a 128×128 block's for W). But a tile runs
//               along the GEMM's sum, so x and dout are cast twice: along their rows for the forward and the input's
//               gradient, down their columns (the tokens, padded to 128: P rows) for the weight's. W is cast once
//               for the forward and once transposed for the input's gradient, both in 128×128 blocks.
//   mxfp8       as blockwise with 1×32 tiles and one-byte E8M0 scales, W cast along its rows and down its columns.
// The bytes counted are the ones that cross memory: a block kernel's second look at its tile (the cast after the
// tile's amax) hits the cache. The scales take the bytes of their layouts (fp8_scale_bytes). Every pass is priced
// at memory_gbps, the column casts' transposed one-byte stores too, which no GPU has timed yet. The CPU (the
// emulation) writes each cast value as a float, keeps scales in the values and makes no transposed copies.
inline Fp8Casts fp8_casts(Fp8Recipe r, Device dev, double M, double out, double in) {
    const bool gpu = dev == Device::CUDA, tensorwise = r == Fp8Recipe::Tensorwise;
    const double X = stored_value_bytes(dev), code = gpu ? 1.0 : 4.0;
    const double P = !gpu ? M : tensorwise ? (double)fp8_padded((long)M) : (double)pad_to((long)M, fp8_tile(r));
    auto scales = [&](double rows, double k, bool blocks) {
        return gpu && !tensorwise ? (double)fp8_scale_bytes(r, blocks, (long)rows, (long)k) : 0.0;
    };
    const bool blocks = r == Fp8Recipe::Blockwise;  // blockwise weights: 128×128 blocks
    Fp8Casts k;
    k.padded = P;
    if (tensorwise) {
        const double read = 2 * X;  // the amax pass and the cast pass
        k.forward.add((read + code) * (M * in + out * in), 8, 2);
        k.input_grad.add((read + code) * M * out + (gpu ? code * P * out : 0) + (read + code) * out * in, 8, 2);
        k.weight_grad.add(read * M * in + code * P * in, 4, 1);
        k.split.add((read + code) * M * out, 4, 1);
        return k;
    }
    k.forward.add((X + code) * (M * in + out * in) + scales(M, in, false) + scales(out, in, blocks), 2, 0);
    k.input_grad.add((X + code) * (M * out + out * in) + scales(M, out, false) + scales(in, out, blocks), 2, 0);
    k.weight_grad.add(X * M * (out + in) + code * P * (out + in) + scales(out, P, false) + scales(in, P, false), 2, 0);
    return k;
}

struct StepModel {
    const GPTConfig& c;
    const ParallelPlan& par;
    const HardwareProfile& hw;
    Device dev;
    int B, T, gpus_per_node;

    double value_bytes() const { return stored_value_bytes(dev); }
    // a GEMM in bf16 (fp32 on the CPU), or in FP8 at the recipe's rate
    double gemm(double M, double N, double K, bool fp8 = false) const {
        return 2 * M * N * K / (hw.matmul_rate(std::min({M, N, K}), fp8, fp8_recipe_name(par.fp8_recipe)) * 1e12) +
               hw.launch_us * 1e-6;
    }
    double memory(double bytes, int ops) const { return bytes / (hw.memory_gbps * 1e9) + ops * hw.launch_us * 1e-6; }
    double transcendental(double bytes, int ops) const {
        return bytes / (hw.transcendental_gbps * 1e9) + ops * hw.launch_us * 1e-6;
    }
    Link link(int size, long inner) const { return group_link(hw, (long)size * inner, gpus_per_node); }
    Link tp_link() const { return link(par.tp, 1); }
    Link cp_link() const { return link(par.cp, par.tp); }
    Link ep_link() const { return link(par.ep, (long)par.tp * par.cp); }
    Link dp_link() const { return link(par.dp * par.cp, par.tp); }
    Link pp_link() const { return link(par.pp.size, (long)par.tp * par.cp * par.dp); }

    // a chunk of `layers` layers of the model from its layer `first`, with the embeddings and/or the head
    PassCost pass(int first, int layers, bool embeddings, bool head, bool sends_forward, bool sends_backward) const {
        const double X = value_bytes(), t = par.tp, C = c.channels, BT = (double)B * T / par.cp;
        ModelTable table = model_table(c);
        const double R = par.sp ? BT / t : BT, Cl = (double)table[ATTPROJW].cols / t;
        const double Vl = std::ceil(c.padded_vocab_size / t);
        PassCost p;
        const double E = c.num_experts, experts = E / par.ep, rows = par.ep * BT * c.top_k / E;
        double attention_flops = 2 * (double)B * (T / par.cp) * T * Cl;
        double attn_f = attention_flops / (hw.attention_tflops * 1e12), attn_b = 2.5 * attn_f;
        bool again_gelu = par.recompute >= 1, again_layernorm = par.recompute >= 2;
        // One layer of each kind: its matmuls, forward, from the table: each 2-D weight the layer holds, as the rank
        // holds it, on every token row, an expert's on the rows balanced routing sends it; backward does each shape
        // twice. Under --fp8 the layers between the model's first and last run them in the recipe, each weight
        // that the recipe takes (fp8_recipe_takes: under a block recipe, dimensions of whole tiles) after its
        // operands' casts (fp8_casts), the weight gradient over the rows the casts pad; the others as bf16. A
        // tensorwise cast's gathered amax waits on the group holding the tensor's pieces (tp × cp for the dense
        // weights, tp for the experts': gpt.cuh's ModelLinks): a one-float all-gather. The bytes of the
        // element-wise ops: two layernorms (in, out) and two residual sums (two in, one out) on R rows and, in a
        // sparse layer, the rows copied out to the experts and back; GELU on the hidden layer (one in, one out
        // forward, two in and one out backward, once more forward when -r recomputes it).
        const bool split = par.pp.on() && pp_kind_splits_backward(par.pp.kind);  // a W step of its own
        struct LayerCost {
            double mm = 0;                              // bf16: one GEMM of each shape
            double mm8 = 0, mm8_w = 0;                  // FP8: forward (or the input's gradient); the weight's
            double cast_f = 0, cast_b = 0, cast_w = 0;  // FP8's casts: forward, input gradient, weight gradient
            double gather_f = 0, gather_b = 0;          // FP8's amax gathers (tensorwise)
            double other_f = 0, other_b = 0;
        };
        const Fp8Recipe recipe = par.fp8_recipe;
        auto gathers = [&](double n, int pieces) {  // one float from each rank of the group, n times
            if (pieces == 1) return 0.0;
            return n * link_seconds(link(pieces, 1), (pieces - 1) * sizeof(float), 1);
        };
        auto layer_cost = [&](int layer) {
            LayerCost k;
            bool sparse = c.sparse_layer(layer);
            for (const TensorSpec& w : table) {
                if (w.holder != Holder::Layer || w.cols == 1 || w.block() == 0 || !layer_holds(c, w.layers, layer))
                    continue;
                double out = w.local_rows(par.tp), in = w.local_cols(par.tp), M = w.expert ? rows : BT;
                double n = w.expert ? experts : 1;
                double once = n * gemm(M, out, in);
                k.mm += once;
                bool router = &w == &table[ROUTERW] || &w == &table[SHARED_GATEW];  // stay in their own precision
                if (router || !fp8_recipe_takes(recipe, (long)out, (long)in)) {
                    k.mm8 += once, k.mm8_w += once;
                    continue;
                }
                Fp8Casts casts = fp8_casts(recipe, dev, M, out, in);
                k.mm8 += n * gemm(M, out, in, true);
                k.mm8_w += n * gemm(casts.padded, out, in, true);
                k.cast_f += n * memory(casts.forward.bytes, (int)casts.forward.ops);
                k.cast_b += n * memory(casts.input_grad.bytes, (int)casts.input_grad.ops);
                k.cast_w += n * memory(casts.weight_grad.bytes, (int)casts.weight_grad.ops);
                int pieces = w.expert ? par.tp : par.tp * par.cp;
                k.gather_f += gathers(n * casts.forward.gathers, pieces);
                k.gather_b += gathers(n * (casts.input_grad.gathers + casts.weight_grad.gathers), pieces);
                if (split) {
                    k.cast_w += n * memory(casts.split.bytes, (int)casts.split.ops);
                    k.gather_b += gathers(n * casts.split.gathers, pieces);
                }
            }
            // the hidden layer: a dense layer's on every row, the experts' on the rows they took and the shared
            // expert's on every row
            double width = (double)table[mlp_tensors(c, layer).fcprojw].cols / t;
            double hidden = width * (c.dense_layer(layer) ? BT : rows * experts) +
                            (sparse ? (double)table[SHARED_FCPROJW].cols / t * BT : 0);
            double stream = X * 10 * R * C + (sparse ? X * 4 * c.top_k * BT * C : 0), gelu = X * 2 * hidden;
            k.other_f = attn_f + memory(stream, 6) + transcendental(gelu, 1);
            k.other_b = attn_b + memory(2 * stream + (again_layernorm ? X * 4 * R * C : 0), 10 + 2 * again_layernorm) +
                        transcendental(1.5 * gelu + (again_gelu ? gelu : 0), 1 + again_gelu);
            return k;
        };
        // the two kinds' costs (a model with dense layers has layer 0 dense), then each layer of the chunk by its
        // kind (the model's first layer and its last stay bf16)
        int sparse_at = 0;
        while (c.dense_layer(sparse_at)) sparse_at++;
        const LayerCost sparse = layer_cost(sparse_at), dense = c.dense_layer(0) ? layer_cost(0) : sparse;
        int sparse_layers = 0;
        double gathered_f = 0, gathered_b = 0;  // FP8's amax gathers, exposed
        for (int l = first; l < first + layers; l++) {
            const LayerCost& k = c.dense_layer(l) ? dense : sparse;
            sparse_layers += c.sparse_layer(l);
            bool fp8 = par.fp8 && l != 0 && l != c.num_layers - 1;
            p.forward += (fp8 ? k.mm8 + k.cast_f : k.mm) + k.other_f;
            p.backward += (fp8 ? k.mm8 + k.cast_b : k.mm) + k.other_b;
            p.weight_grad += fp8 ? k.mm8_w + k.cast_w : k.mm;  // the weight gradients' matmuls (and their casts)
            if (fp8) p.casts += k.cast_f + k.cast_b + k.cast_w, gathered_f += k.gather_f, gathered_b += k.gather_b;
        }
        if (embeddings) {  // the first chunk's lookup and its gradient's scatter
            p.forward += memory(X * 3 * R * C, 1);
            p.backward += memory(X * 3 * R * C, 1);
        }
        if (head) {  // the final layernorm, the classifier and the cross-entropy (forward and backward fused)
            double classifier = gemm(BT, Vl, C);
            p.forward += memory(X * 4 * R * C, 1) + transcendental(X * 3 * BT * Vl, 1) + classifier;
            p.backward += memory(X * 6 * R * C, 1) + classifier;
            p.weight_grad += classifier;
        }
        // tp: each layer crosses into and out of its two parallel regions, forward and backward (2 units of
        // (t-1)/t·BT·C each, by planned_tp_comm_bytes' count); the embeddings and the head one crossing each way,
        // and the cross-entropy's three floats per token; under sp backward gathers the two norm outputs again
        if (par.tp > 1) {
            Link l = tp_link();
            double unit = (t - 1) / t * BT * C * X;
            double regions = layers * 4 * unit + (embeddings + head) * unit, calls = layers * 2 + embeddings + head;
            double ce = head ? (t - 1) * BT * 3 * sizeof(float) : 0.0;
            double regathered = par.sp ? layers * 2 * unit : 0.0;
            double f = link_seconds(l, regions + ce, calls + head);
            p.tp = f + link_seconds(l, regions + regathered, calls + (regathered > 0 ? 2 * layers : 0));
            p.forward_comm += f;
        }
        // cp: per layer, forward passes the K/V block (the rank's key/value heads) N-1 times, backward again and
        // the fp32 dK/dV N times; the hops overlap with the attention of the block in hand
        if (par.cp > 1) {
            double N = par.cp, kv = BT * 2 * ((double)c.kv_heads(par.tp) * c.head_size());
            Link l = cp_link();
            double f = link_seconds(l, (N - 1) * kv * X, N - 1),
                   b = link_seconds(l, (N - 1) * kv * X + N * kv * 4, 2 * N - 1);
            double exposed_f = f - hw.overlap * std::min(f, attn_f), exposed_b = b - hw.overlap * std::min(b, attn_b);
            p.cp = layers * (exposed_f + exposed_b);
            p.forward_comm += layers * exposed_f;
        }
        // ep: per sparse layer, dispatch and return in forward and the same in backward, (N-1)/N of the K·BT rows each
        if (par.ep > 1) {
            double N = par.ep, bytes = (N - 1) / N * c.top_k * BT * C * X;
            double f = sparse_layers * link_seconds(ep_link(), 2 * bytes, 3);
            p.ep = 2 * f;
            p.forward_comm += f;
        }
        // FP8's gathered amaxes (tensorwise, over tp × cp): in tp's part where the group has tp ranks, else in cp's
        (par.tp > 1 ? p.tp : p.cp) += gathered_f + gathered_b;
        p.forward_comm += gathered_f;
        // pp: the chunk's output on, and its input's gradient back, R rows of the residual stream
        if (par.pp.on()) {
            double send = link_seconds(pp_link(), R * C * X, 1);
            p.pp = (sends_forward + sends_backward) * send;
            p.forward_comm += sends_forward * send;
        }
        return p;
    }
};

// What one rank's dp reductions cost and how much of it backward hides: `window` is the compute they may
// overlap with (the last micro-batch's backward under ZeRO-0/1, every backward under ZeRO-2, all of forward and
// backward under ZeRO-3)
inline double exposed_dp_seconds(const StepModel& sm, double window) {
    const ParallelPlan& par = sm.par;
    if (par.grad_ranks() == 1) return 0.0;
    double k = par.accumulation, X = sm.value_bytes(), exposed = 0.0, overlappable = 0.0;
    std::vector<PlannedGroup> groups = planned_groups(sm.c, par);
    for (size_t i = 0; i < groups.size(); i++) {
        const PlannedGroup& g = groups[i];
        double ring = (g.ranks - 1.0) / g.ranks, P = ring * g.layout.padded_total * X;
        double buckets = (double)g.layout.buckets.size(), last = ring * g.layout.embeddings().padded * X;
        Link l = sm.dp_link();  // the expert replicas are strided over the same dp·cp ranks
        double reduce_passes = par.zero >= 2 ? k : 1, gather_passes = par.zero == 3 ? 2 * k : 1;
        double reduce = link_seconds(l, reduce_passes * P, reduce_passes * buckets);
        double gather = link_seconds(l, gather_passes * P, gather_passes * buckets);
        double tail = link_seconds(l, last, 1);  // the embeddings' bucket, complete only when backward ends
        if (par.zero == 3) {
            overlappable += reduce + gather - tail;
        } else {
            overlappable += reduce - tail;
            exposed += gather;
        }
        exposed += tail + link_seconds(l, (g.ranks - 1) * 8.0 + (i == 0 ? 16.0 : 0.0), 2);  // norm and loss
    }
    return exposed + overlappable - sm.hw.overlap * std::min(overlappable, window);
}

inline StepTime predict_step(const GPTConfig& c, int B, int T, const ParallelPlan& par, Device dev,
                             const HardwareProfile& hw, int gpus_per_node) {
    StepModel sm{c, par, hw, dev, B, T, gpus_per_node};
    const int N = par.pp.size, V = par.pp.virtual_stages, m = par.accumulation;
    const PPPlacement at = par.pp.placement();
    // each stage's cost per chunk, and its optimizer step
    std::vector<std::vector<PassCost>> costs(N);
    std::vector<double> optimizer(N);
    for (int r = 0; r < N; r++) {
        PPSpec spec = par.pp;
        spec.rank = r;
        ModelPart part = stage_part(c, spec);
        for (int k = 0; k < part.chunks(); k++) {
            int g = at.stage(r, k);
            bool sends_on = at.p2p_after(g), sends_back = at.p2p_before(g);  // by p2p: not the model's ends, not the V's bottom
            costs[r].push_back(sm.pass(part.chunk_first[k], part.chunk_layers[k], part.starts_model(k), part.head(k), sends_on, sends_back));
        }
        ParallelPlan stage = par;
        stage.pp.rank = r;
        double psi = (double)num_parameters(c, par.tp, part, par.ep);
        double owned = par.zero >= 1 && par.grad_ranks() > 1 ? (double)planned_shard_size(c, stage) : psi;
        // AdamW reads and writes 28 bytes per element it updates (parameters, moments, gradients, and on the GPU
        // the master weights); the norm reads the gradients
        optimizer[r] = sm.memory(28 * owned + sm.value_bytes() * owned, 2);
    }
    auto action_cost = [&](int r, const PPAction& a, bool split) {
        const PassCost& p = costs[r][a.chunk];
        double comm_f = p.forward_comm, comm_b = p.tp + p.cp + p.ep + p.pp - comm_f;
        if (a.op == PPOp::Forward) return p.forward + comm_f;
        if (a.op == PPOp::Backward) return (split ? p.backward : p.backward + p.weight_grad) + comm_b;
        return p.weight_grad;
    };
    // the stages' timeline: the schedule simulated, or m micro-batches back to back on one stage
    double makespan;
    std::vector<double> busy(N, 0.0);
    if (par.pp.on()) {
        const MatchedSchedule& schedule = matched_pp_schedule(par.pp.kind, N, m, V);
        bool split = pp_splits_backward(schedule.actions);
        PPSimulation sim = simulate_pp_schedule(schedule.actions, N, schedule.match,
                                                [&](int r, const PPAction& a) { return action_cost(r, a, split); });
        makespan = sim.makespan, busy = sim.busy;
    } else {
        const PassCost& p = costs[0][0];
        busy[0] = m * (p.forward + p.backward + p.weight_grad + p.tp + p.cp + p.ep + p.pp);
        makespan = busy[0];
    }
    // the critical stage: the one whose step ends last, its pipeline time plus its reductions and update
    StepTime best;
    for (int r = 0; r < N; r++) {
        StepTime s;
        double window = 0.0;
        for (const PassCost& p : costs[r]) {
            s.compute += m * (p.forward + p.backward + p.weight_grad);
            s.fp8_casts += m * p.casts;
            s.tp += m * p.tp, s.cp += m * p.cp, s.ep += m * p.ep, s.pp += m * p.pp;
            double backward = p.backward + p.weight_grad;
            window += par.zero == 3 ? m * (p.forward + backward) : par.zero == 2 ? m * backward : backward;
        }
        s.bubble = makespan - busy[r];
        ParallelPlan stage = par;
        stage.pp.rank = r;
        s.dp = exposed_dp_seconds(StepModel{c, stage, hw, dev, B, T, gpus_per_node}, window);
        s.compute += optimizer[r];
        s.optimizer = optimizer[r];
        s.seconds = s.compute + s.dp + s.tp + s.cp + s.pp + s.ep + s.bubble;
        if (r == 0 || s.seconds > best.seconds) best = s;
    }
    double tokens = (double)B * T * par.dp * m, world = (double)par.dp * par.tp * par.cp * N;
    best.tokens_per_second = tokens / best.seconds;
    best.mfu = tokens * model_flops_per_token(c, T) / (best.seconds * world * hw.peak_tflops * 1e12);
    return best;
}

inline std::string describe_step(const StepTime& s) {
    return strfmt(
        "%.3f ms, %.0f tokens/s, MFU %.1f%% (compute %.3f ms, dp %.3f ms, tp %.3f ms, cp %.3f ms, pp %.3f ms, "
        "ep %.3f ms, bubble %.3f ms)",
        s.seconds * 1e3, s.tokens_per_second, 100 * s.mfu, s.compute * 1e3, s.dp * 1e3, s.tp * 1e3, s.cp * 1e3,
        s.pp * 1e3, s.ep * 1e3, s.bubble * 1e3);
}

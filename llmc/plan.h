// --plan: the memory a run will need, per ledger category, predicted from the flags alone (no allocation), and
// the bytes each parallelism sends per step. A rank's memory is the list of buffers its allocations walk
// (llmc/gpt.cuh's gpt_buffers: the model states the model holds whole, the activations of llmc/activations.cuh,
// the scratch, the ring's and the experts' buffers; llmc/zero.cuh's DataParallel::buffers: the shards of the
// other states, the staging of the collectives, the FP8 gathers'), made here for the planned rank's layout
// without allocating, so the plan and the Ledger agree by construction. What this file adds is arithmetic that
// is no allocation: the layout's (the micro-batches a pipeline schedule keeps in flight, the reduction groups and
// their buckets, which llmc/step_time.h's step model reads too), the Playbook's model-state formulas, and the
// communication formulas.
//
// Notation as in the Ultra-Scale Playbook: Ψ parameters, L layers, C channels (h), NH heads (a), B×T tokens
// (b, s), Vp padded vocab. On the CPU everything is fp32 (4 bytes), the parameters are their own master copy,
// and AdamW keeps two moments, so the model states are 4Ψ + 4Ψ + 8Ψ = 16Ψ bytes. On the GPU (bf16 mixed
// precision) parameters, gradients and activations are 2-byte bf16 and the master weights, moments, layernorm
// statistics, losses and attention's logsumexps 4-byte fp32; the kernels share one fp32 scratch (llmc/device.cuh).
//
// Under data parallelism over N ranks, ZeRO divides model states by N stage by stage (the Playbook's
// formulas, per rank): ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + (4+8)Ψ/N, ZeRO-3 (4+4+8)Ψ/N; with bf16 mixed
// precision (2-byte parameters and gradients, a 4-byte master copy and two 4-byte moments) the same stages
// give 2Ψ + 2Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N. Here Ψ/N is a rank's shard: the buckets of llmc/zero.cuh
// padded to multiples of N, divided by N. Under context parallelism N is dp·cp: the ranks of a cp group hold
// the same parameters and reduce their gradients together. Under expert parallelism the expert tensors form
// buckets of their own, sharded over their dp/ep·cp replicas: the shard is both groups' pieces.
#pragma once

#include <cstdio>

#include "llmc/gpt.cuh"
#include "llmc/grad_plan.h"
#include "llmc/ledger.h"
#include "llmc/pp.cuh"
#include "llmc/zero.cuh"

constexpr size_t DEFAULT_BUCKET_FLOATS = 25 * 1048576 / 4;  // --bucket-mb 25

// the layout a plan is for: parallelism, accumulation and activation recomputation
struct ParallelPlan {
    int dp = 1, zero = 0;
    size_t bucket_floats = DEFAULT_BUCKET_FLOATS;
    int accumulation = 1;  // micro-steps per optimizer step
    int tp = 1;
    bool sp = false;
    int recompute = 0;  // -r
    int cp = 1;
    PPSpec pp;  // the stages, the schedule, and which stage the plan is for (pp.rank)
    int ep = 1;
    bool fp8 = false;  // --fp8
    Fp8Recipe fp8_recipe = Fp8Recipe::Tensorwise;  // --fp8-recipe
    bool fp8_param_gather = false;                 // --fp8-param-gather
    bool aux_batch = false;  // --moe-aux-scope batch
    float capacity = 0.0f;   // --moe-capacity
    // the ranks that reduce gradients and shard model states together (the expert tensors': expert_ranks())
    int grad_ranks() const { return dp * cp; }
    int expert_ranks() const { return dp / ep * cp; }
};

// the part of the model the planned stage holds
inline ModelPart planned_part(const GPTConfig& c, const ParallelPlan& par) { return stage_part(c, par.pp); }

// the planned rank's reduction groups (llmc/zero.cuh): one holding every tensor over dp·cp, or under expert
// parallelism the others over dp·cp and the expert tensors over their replicas; each with its buckets
struct PlannedGroup {
    int ranks;
    BucketLayout layout;
};
inline std::vector<PlannedGroup> planned_groups(const GPTConfig& c, const ParallelPlan& par) {
    ModelPart part = planned_part(c, par);
    auto group = [&](int ranks, TensorGroup which) {
        return PlannedGroup{ranks, bucket_layout(c, ranks, par.bucket_floats, par.tp, part, par.ep, which)};
    };
    if (par.ep == 1) return {group(par.grad_ranks(), TensorGroup::All)};
    return {group(par.grad_ranks(), TensorGroup::Dense), group(par.expert_ranks(), TensorGroup::Experts)};
}
// a rank's shard: every group's pieces
inline size_t planned_shard_size(const GPTConfig& c, const ParallelPlan& par) {
    size_t n = 0;
    for (const PlannedGroup& g : planned_groups(c, par)) n += g.layout.shard_size;
    return n;
}

// How many micro-batches' activations a stage keeps at once, from each schedule's arithmetic: AFAB all m
// (every forward before any backward); 1F1B the N - r forwards of its warm-up and steady state (stage r of N),
// at most m; interleaved, Megatron-LM's warm-up of (N - r - 1)·2 + (V - 1)·N chunk forwards plus the one in
// its steady state, at most m·V; ZB-H1 keeps a micro-batch until its weight-gradient step, which waits for a
// bubble: N + 1 on every stage, at most m (llmc/pp_schedules.h). DualPipeV counts chunks of micro-batches, each
// half a rank's layers: between a chunk's forward and its weight-gradient step its lists (m >= 2N) hold 2N + 1
// on every rank, the DeepSeek-V3 report's PP + 1 for its PP = 2N stages; a slot is taken at the receive of the
// input, though, and the ranks between the ends receive one F0's input a step early (the lists' deadlock-free
// grouping), which holds 2N + 2 there at once. These are what the runner's slot plan finds in the lists.
inline int planned_in_flight(const PPSpec& pp, int m) {
    int N = pp.size, r = pp.rank, V = pp.virtual_stages;
    switch (pp.kind) {
        case PPKind::AFAB: return m * V;
        case PPKind::Interleaved: return std::min((N - r - 1) * 2 + (V - 1) * N + 1, m * V);
        case PPKind::ZeroBubble: return std::min(N + 1, m);
        case PPKind::DualPipeV: return r == 0 || r == N - 1 ? 2 * N + 1 : 2 * N + 2;
        default: return std::min(N - r, m);
    }
}

// --fp8-param-gather: each group's buckets on the wire (llmc/fp8_gather.cuh), and the FP8 weights' scales of them all
struct PlannedWires {
    std::vector<std::vector<Fp8BucketWire>> groups;
    std::vector<size_t> group_scales;  // each group's
    size_t scales = 0;
};
inline PlannedWires planned_wires(const GPTConfig& c, const ParallelPlan& par, Device dev) {
    PlannedWires w;
    if (!par.fp8_param_gather) return w;
    for (const PlannedGroup& g : planned_groups(c, par)) {
        size_t before = w.scales;
        w.groups.push_back(fp8_bucket_wires(c, planned_part(c, par), par.tp, g.layout, g.ranks, par.fp8_recipe,
                                            dev == Device::CUDA ? 2 : 4, w.scales));
        w.group_scales.push_back(w.scales - before);
    }
    return w;
}

struct MemoryPlan {
    size_t bytes[MEM_CATEGORIES] = {};
    size_t total() const {
        size_t t = 0;
        for (size_t b : bytes) t += b;
        return t;
    }
};

// bytes per element of each model state: fp32 on the CPU; bf16 mixed precision on a GPU
struct StatePrecision {
    size_t params, master, grads, optimizer;
};
constexpr StatePrecision CPU_FP32 = {4, 0, 4, 8};
constexpr StatePrecision BF16_MIXED = {2, 4, 2, 8};

// one rank's model states by the Playbook's formulas: whole (psi elements) or sharded (shard elements) as the ZeRO
// stage says (--plan prints them in bf16 mixed precision beside a CPU plan)
inline void plan_model_states(size_t bytes[MEM_CATEGORIES], size_t psi, size_t shard, int zero, StatePrecision e) {
    bytes[MEM_PARAMS] = e.params * (zero >= 3 ? shard : psi);
    bytes[MEM_MASTER_WEIGHTS] = e.master * (zero >= 1 ? shard : psi);
    bytes[MEM_GRADS] = e.grads * (zero >= 2 ? shard : psi);
    bytes[MEM_OPTIMIZER] = e.optimizer * (zero >= 1 ? shard : psi);
}

// the bytes of one stored value: parameters, gradients and activations are fp32 on the CPU and bf16 on the GPU,
// and the collectives move them as they are stored
inline double stored_value_bytes(Device device) { return device == Device::CUDA ? 2.0 : 4.0; }

// How the planned rank holds the model (llmc/gpt.cuh's ModelLayout), as train_gpt.cu sets it up: the states
// ZeRO leaves to the model, the first rank of each group (which holds as much as any other), the stage's part, a
// slot per micro-batch in flight, the zero-bubble schedules' split backward, -r and the accumulation.
inline ModelLayout planned_layout(const GPTConfig& c, const ParallelPlan& par) {
    ModelLayout l;
    l.own = DataParallel<float>::model_buffers(par.zero);
    l.tp = TPSpec{par.tp, 0, par.sp};
    l.cp = CPSpec{par.cp, 0};
    l.ep = par.ep, l.capacity = par.capacity;
    l.part = planned_part(c, par);
    l.slots = planned_in_flight(par.pp, par.accumulation);
    l.split_backward = pp_kind_splits_backward(par.pp.kind);
    l.recompute = par.recompute, l.accumulation = par.accumulation;
    return l;
}

// The buffers the planned rank's data-parallel runtime allocates, in the storage type floatX: the list its
// constructor walks (DataParallel::buffers), made for reduction groups that are never allocated, each with its
// ranks and buckets (planned_groups) and under --fp8-param-gather its wires (planned_wires)
template <typename floatX>
inline BufferList planned_zero_buffers(const GPTConfig& c, const ParallelPlan& par) {
    using Runtime = DataParallel<floatX>;
    std::vector<PlannedGroup> planned = planned_groups(c, par);
    PlannedWires wires = planned_wires(c, par, device_of<floatX>);
    std::vector<typename Runtime::Group> groups(planned.size());
    for (size_t i = 0; i < planned.size(); i++) {
        groups[i].N = planned[i].ranks, groups[i].layout = planned[i].layout;
        if (par.fp8_param_gather) groups[i].wires = wires.groups[i];
    }
    ZeroShards<floatX> shards;
    Fp8Gathers<floatX> fp8;
    fp8.scales = wires.scales;
    return Runtime::buffers(shards, groups, par.zero, par.fp8_param_gather ? &fp8 : nullptr);
}

// The buffers the planned rank allocates, in the storage type floatX, in the order a run allocates them: the list
// gpt_allocate walks (gpt_buffers), made for a model that is never allocated, with --fp8 gpt_allocate_fp8's, then
// its data-parallel runtime's (planned_zero_buffers). Only the sizes of the list are read, never the pointers.
template <typename floatX>
inline BufferList planned_buffers(const GPTConfig& c, int B, int T, int threads, const ParallelPlan& par) {
    GPTModel<floatX> unallocated;
    BufferList list = gpt_buffers(unallocated, c, B, T, planned_layout(c, par), threads);
    if (par.fp8) {
        LocalDims d = local_dims(c, TPSpec{par.tp, 0, par.sp}, B, T, par.cp, par.ep, par.capacity);
        append(list, fp8_buffers(unallocated.fp8, fp8_layer_sizes(d, par.tp * par.cp, device_of<floatX>, par.fp8_recipe)));
    }
    append(list, planned_zero_buffers<floatX>(c, par));
    return list;
}
inline BufferList planned_buffers(const GPTConfig& c, int B, int T, int threads, const ParallelPlan& par, Device dev) {
    return dev == Device::CUDA ? planned_buffers<bf16>(c, B, T, threads, par) : planned_buffers<float>(c, B, T, threads, par);
}

// The memory a rank needs: its buffers (planned_buffers: the parameters, gradients and optimizer states its model
// holds whole, the activations of the micro-batches in flight, the scratch, the ring's and the experts' buffers,
// the FP8 casts'; its data-parallel runtime's shards of the other states, the staging of the reductions and
// gathers in flight, and --fp8-param-gather's buffers). A pipeline's exchanges need none of their own: the
// embeddings' output is where the previous stage's activations arrive, and the last layer's output the next
// stage's gradient.
inline MemoryPlan plan_memory(const GPTConfig& c, int B, int T, int threads, const ParallelPlan& par = {},
                              Device dev = Device::CPU) {
    MemoryPlan p;
    add_bytes(p.bytes, planned_buffers(c, B, T, threads, par, dev));
    return p;
}

inline void print_memory(const char* title, const size_t bytes[MEM_CATEGORIES], size_t total) {
    printf("%s\n", title);
    for (int i = 0; i < MEM_CATEGORIES; i++) printf("  %-16s %14zu bytes %10.1f MiB\n", mem_category_name(i), bytes[i], bytes[i] / 1048576.0);
    printf("  %-16s %14zu bytes %10.1f MiB\n", "total", total, total / 1048576.0);
}

// Bytes one rank sends to its dp group per optimizer step, counted as a ring algorithm sends them: (N-1)/N of
// every buffer reduce-scattered or all-gathered, where a full pass over the rank's share of the model moves P =
// its padded parameter count. ZeRO-0 and 1 reduce-scatter the gradients once and all-gather once (the
// gradients, or the updated parameters): 2P, the all-reduce's volume. ZeRO-2 reduce-scatters in each of k
// micro-steps: (k+1)P. ZeRO-3 gathers the parameters for forward and again for backward and reduce-scatters,
// each micro-step: 3kP. The loss (an all-reduce of one double) and the gradient norm (an all-gather of one
// double per rank, summed in rank order) add 2(N-1)/N·8 + (N-1)·8 bytes. Values move as stored on the device.
// Under expert parallelism the expert tensors' buckets move over their own group of replicas, which also
// all-gathers its norm (the experts' norm then crosses the ep group: planned_ep_comm_bytes counts it). A router
// with a selection bias all-reduces the step's loads (L·E doubles) over dp·cp, tp and pp (balance_experts);
// under --moe-aux-scope batch each sparse layer's forward all-reduces its E counts (doubles) over dp·cp.
inline double balancing_bytes(const GPTConfig& c, double N) {
    return c.router_bias ? 2 * (N - 1) / N * c.num_layers * c.num_experts * sizeof(double) : 0.0;
}
inline double aux_batch_bytes(const GPTConfig& c, const ParallelPlan& par, double N) {
    if (!par.aux_batch) return 0.0;
    return par.accumulation * sparse_layers(c, planned_part(c, par)) * 2 * (N - 1) / N * c.num_experts * sizeof(double);
}
// Under --fp8-param-gather a parameter gather moves each bucket with FP8 weights as its pieces on the wire (every
// rank's padded to the largest, codes a byte each), and each update all-gathers every FP8 weight's amaxes per scale
// (a float each) over the group that reduces the weight.
inline double planned_comm_bytes(const GPTConfig& c, const ParallelPlan& par, Device device) {
    if (par.grad_ranks() == 1) return 0.0;
    double k = par.accumulation;
    double reduce = par.zero <= 1 ? 1.0 : k, gather = par.zero <= 2 ? 1.0 : 2.0 * k;
    std::vector<PlannedGroup> groups = planned_groups(c, par);
    PlannedWires wires = planned_wires(c, par, device);
    double bytes = 0.0;
    for (size_t i = 0; i < groups.size(); i++) {
        const BucketLayout& lay = groups[i].layout;
        double N = groups[i].ranks, ring = (N - 1) / N, X = stored_value_bytes(device);
        double P = (double)lay.padded_total * X, gathered = P;  // a pass over the buckets, and a parameter gather
        if (par.fp8_param_gather)
            for (size_t b = 0; b < lay.buckets.size(); b++) {
                const Fp8BucketWire& w = wires.groups[i][b];
                if (!w.weights.empty()) gathered += N * (double)w.piece_bytes - (double)lay.buckets[b].padded * X;
            }
        double loss = i == 0 ? 2 * sizeof(double) : 0.0;  // the loss: over dp·cp, the first group's ranks
        bytes += ring * (reduce * P + gather * gathered + loss) + (N - 1) * sizeof(double);
        if (par.fp8_param_gather) bytes += (N - 1) * sizeof(float) * wires.group_scales[i];
        if (i == 0) bytes += balancing_bytes(c, N) + aux_batch_bytes(c, par, N);
    }
    return bytes;
}

// Bytes one rank sends to its tensor-parallel group per optimizer step. A micro-step's forward enters and
// leaves two parallel regions per layer, plus the embedding (leaving) and the classifier (entering): 2L + 2
// crossings of a BT·C activation, each an all-reduce without sp (2 units of (t-1)/t·BT·C floats when leaving,
// none when entering) or an all-gather / reduce-scatter with sp (1 unit each): 4L + 2 units either way, and as
// many again in backward. The cross-entropy all-gathers three floats per token (max, sum, target logit).
// Under sp, the gradients the table marks sequence-partial (the norms' weights, and GPT-2's biases of them and
// wpe: 4LC + 2C + maxT·C; Llama's 2LC + C) are summed over the group (all-gathered), and so are, under any tp,
// the key/value heads' rows that several ranks hold when tp exceeds KV (2·hd·C a layer, gathered from the whole
// group, summed over the ranks holding them), and QK-norm's weights under any tp: what llmc/grad_plan.h calls
// partial over tp, once per reduction, that is once per step under ZeRO-0/1, each
// micro-step under ZeRO-2/3. The norm all-gathers one double. Under sp each rank keeps its rows of the two norm
// outputs, and backward gathers them again for the weight gradients (Megatron-LM's sequence parallelism): 2L
// more units. With experts, each sparse layer's backward sums the gates'
// gradients over the group (all-gathers BT·K fp32), and a gated shared expert's (BT fp32). Activations and gradients move as stored (bf16 on the
// GPU), the cross-entropy's three and the gates' gradients as fp32.
// A pipeline stage counts its own L layers, the embedding's crossing on the first stage, the classifier's and
// the cross-entropy on the last, the final norm on the last and GPT-2's wpe on both.
inline double planned_tp_comm_bytes(const GPTConfig& c, const ParallelPlan& par, int B, int T, Device device) {
    if (par.tp == 1) return 0.0;
    ModelPart part = planned_part(c, par);
    double t = par.tp, BT = (double)B * T / par.cp, C = c.channels, L = part.layers(), k = par.accumulation;
    double first = part.first, last = part.last;
    double units = 8 * L + 2 * (first + last) + (par.sp ? 2 * L : 0), value = stored_value_bytes(device);
    double gates = sparse_layers(c, part) * (t - 1) * BT * (c.top_k + c.shared_gate) * sizeof(float);
    double per_micro_step = units * (t - 1) / t * BT * C * value + last * (t - 1) * BT * 3 * sizeof(float) + gates;
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes, par.tp, part, par.ep);
    double partial = 0.0;  // each is all-gathered over the group and summed (TensorParallel::sum_in_rank_order)
    for (const GradientPlan::Partial& p : gradient_plan(model_table(c), sizes, par.tp, 0, par.sp, false).tp_partials)
        partial += p.count;
    double partial_grads = (t - 1) * partial * value;
    double sums = par.zero <= 1 ? 1.0 : k;
    return k * per_micro_step + sums * partial_grads + (t - 1) * sizeof(double) + balancing_bytes(c, t);
}

// Bytes one rank sends to its cp group per optimizer step: in each layer of each micro-step, forward passes
// the K/V block on N-1 times (BT·2Kl values as stored, BT = B·T/N local rows, Kl = KV/tp·hd the rank's key
// channels: Cl for GPT-2, NH/KV times fewer under grouped-query attention, hd when tp exceeds KV), and
// backward passes it on N-1 times again and its fp32 dK/dV accumulator N times (the last hop brings each one
// home to the keys' rank). With experts each sparse layer's forward sums its sequences' aux statistics over the
// group (an all-reduce of 2·B·E fp32: counts and Σ P), and under a capacity gathers their choices (an all-gather
// of the rank's B·T/N·K int32), so that every rank sees whole sequences (llmc/moe.cuh).
inline double planned_cp_comm_bytes(const GPTConfig& c, const ParallelPlan& par, int B, int T, Device device) {
    if (par.cp == 1) return 0.0;
    double N = par.cp, kv = (double)B * (T / par.cp) * 2 * (c.kv_heads(par.tp) * c.head_size());
    double per_layer = 2 * (N - 1) * kv * stored_value_bytes(device) + N * kv * sizeof(float);
    double statistics = 2 * (N - 1) / N * 2.0 * B * c.num_experts * sizeof(float);
    double choices = par.capacity > 0.0f ? (N - 1) * (double)B * (T / par.cp) * c.top_k * sizeof(int) : 0.0;
    ModelPart part = planned_part(c, par);
    double sparse = c.moe() ? sparse_layers(c, part) : 0;
    return par.accumulation * (part.layers() * per_layer + sparse * (statistics + choices));
}

// Bytes one rank sends to its pp group per optimizer step: for each micro-batch, each of its chunks sends its
// output on (unless it is the model's last, or the next stage is this rank's: the V's bottom) and its input's
// gradient back (unless it is the model's first, or the V's bottom again): the rank's R×C rows of the residual
// stream, as stored. The classifier's stage broadcasts the loss (one double) and the gradient norm all-gathers
// one double per stage.
inline double planned_pp_comm_bytes(const GPTConfig& c, const ParallelPlan& par, int B, int T, Device device) {
    if (!par.pp.on()) return 0.0;
    int N = par.pp.size;
    PPPlacement at = par.pp.placement();
    double BT = (double)B * T / par.cp, rows = par.sp ? BT / par.tp : BT, sends = 0;
    for (int k = 0; k < at.chunks; k++) {
        int g = at.stage(par.pp.rank, k);
        sends += at.p2p_after(g) + at.p2p_before(g);
    }
    double loss = par.pp.rank == par.pp.head_rank() ? sizeof(double) : 0.0;
    return par.accumulation * sends * rows * c.channels * stored_value_bytes(device) + loss + (N - 1) * sizeof(double) +
           balancing_bytes(c, N);
}

// Bytes one rank sends to its ep group per optimizer step, from the rows that crossed ranks (sent to another
// rank's experts, or received from another rank) over every sparse layer and micro-step, and the count exchanges
// (one per layer and micro-step, E/ep ints to each other rank). Each row crosses twice in forward (dispatch,
// return) and twice in backward, C values as stored: the rows a rank sends away go out in both dispatches, the
// rows it received come back in both returns. Once a step the experts' gradient norm sends one double to each
// other rank. The run passes what its routing really sent (llmc/moe.cuh counts it); the plan, routing that spreads
// every token's K rows evenly over the experts.
inline double ep_bytes_sent(double rows_crossing, double count_exchanges, const GPTConfig& c, int ep, Device device) {
    return 2 * rows_crossing * c.channels * stored_value_bytes(device) +
           count_exchanges * (ep - 1) * (c.num_experts / ep) * sizeof(int) + (ep - 1) * sizeof(double);
}
inline double planned_ep_comm_bytes(const GPTConfig& c, const ParallelPlan& par, int B, int T, Device device) {
    if (par.ep == 1) return 0.0;
    double N = par.ep, BT = (double)B * T / par.cp, exchanges = par.accumulation * sparse_layers(c, planned_part(c, par));
    // a rank sends (ep-1)/ep of its K·BT rows away and receives as many back, in each layer and micro-step
    return ep_bytes_sent(exchanges * 2 * (N - 1) / N * c.top_k * BT, exchanges, c, par.ep, device);
}

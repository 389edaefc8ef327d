// The activations: what forward keeps for backward, and where. The sizes one rank works with under its layout
// (LocalDims), every activation buffer named and sized once (layer_buffers, per layer and stacked layer 0 first;
// edge_buffers, around the layers), what -r recomputes instead of keeping, the scratch that lives only inside
// backward, and a micro-batch's slot of activations and tokens (several in flight under pipeline parallelism).
// activation_buffers and scratch_buffers turn them into the model's list of buffers (llmc/ledger.h), which the
// allocation (llmc/gpt.cuh's gpt_allocate) walks and --plan (llmc/plan.h) reads, so the bytes planned are the
// bytes allocated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/device.cuh"
#include "llmc/encoder.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/model_table.h"
#include "llmc/moe.cuh"
#include "llmc/norm.cuh"
#include "llmc/tp.cuh"

// the sizes one rank works with: T its tokens of each sequence (T/cp under context parallelism), BT token rows
// in the parallel regions, R rows between them (BT/tp under sequence parallelism), and the rank's share of
// channels, hidden units, query and key/value heads and vocab rows, and the widths of its qkv and of the MLP's
// first matmul (Llama's holds c_fc and c_fc2: twice the hidden units); Cl: attention's width, NHl·hd (C/tp but
// for a head size of the model's own, as Qwen3's); ring: attention runs around a cp group; means: the norms keep
// a mean (GPT-2's layernorm; Llama's RMSNorm keeps only 1/rms); qk_norm: q and k heads are normed (Qwen3)
struct LocalDims {
    int B, T, C;
    long BT, R;
    int Cl, Hl, NHl, KVl, hd, QKVl, FCl, Vl;
    bool ring, means, qk_norm;
    int K;             // with experts: the slots per token (0: a dense MLP)
    int E;             // ... and the experts (0: none)
    long expert_rows;  // ... and the rows this rank's experts may see at most (llmc/moe.cuh): every token of the
                       // ep group with up to min(K, E/ep) of them; under a capacity, each expert's of every sequence
    // the dense layers of a model with experts: their MLP's hidden units and first matmul's width (0: none), and
    // the same of the sparse layers' shared expert (0: none)
    int dense_Hl, dense_FCl, shared_Hl, shared_FCl;
    bool shared_gate;  // ... whose output a gate scales
};

inline LocalDims local_dims(const GPTConfig& c, const TPSpec& tp, int B, int T, int cp = 1, int ep = 1,
                            float capacity = 0.0f) {
    LocalDims d;
    d.B = B, d.T = T / cp, d.C = c.channels, d.ring = cp > 1;
    d.BT = (long)B * d.T;
    d.K = c.moe() ? c.top_k : 0;
    d.E = c.moe() ? c.num_experts : 0;
    long X = c.num_experts / ep;  // the experts a rank holds
    d.expert_rows = c.moe() ? (long)ep * d.BT * std::min((long)c.top_k, X) : 0;
    if (c.moe() && capacity > 0.0f)
        d.expert_rows = std::min(d.expert_rows, X * ep * B * expert_capacity(capacity, c.top_k, c.num_experts, T));
    d.R = tp.sp ? d.BT / tp.size : d.BT;
    ModelTable table = model_table(c);
    d.Cl = (int)(table[ATTPROJW].cols / tp.size), d.Hl = (int)(table[FCPROJW].cols / tp.size);
    d.NHl = c.num_heads / tp.size, d.KVl = c.kv_heads(tp.size), d.hd = c.head_size();
    d.QKVl = (int)table[QKVW].local_rows(tp.size), d.FCl = (int)table[FCW].local_rows(tp.size);
    d.dense_Hl = (int)(table[DENSE_FCPROJW].cols / tp.size), d.dense_FCl = (int)table[DENSE_FCW].local_rows(tp.size);
    d.shared_Hl = (int)(table[SHARED_FCPROJW].cols / tp.size), d.shared_FCl = (int)table[SHARED_FCW].local_rows(tp.size);
    d.shared_gate = c.shared_gate;
    d.Vl = vocab_rows(c.padded_vocab_size, tp.size);
    d.means = c.norm() == Norm::LayerNorm;
    d.qk_norm = c.qk_norm();
    return d;
}

// ... in model layer l, whose MLP is a dense layer's (every row, its own width) or the experts': what the layer
// body computes with. The buffers stay sized by the dims of the model (layer_buffers), for the wider of the two.
inline LocalDims layer_dims(const LocalDims& d, const GPTConfig& c, int layer) {
    if (!c.dense_layer(layer)) return d;
    LocalDims dense = d;
    dense.Hl = d.dense_Hl, dense.FCl = d.dense_FCl, dense.K = 0;
    return dense;
}

// floatX: the storage type; statistics, losses and attention's saved state are fp32 on both devices
template <typename floatX>
struct Activations {
    floatX *encoded, *ln1;
    float *ln1_mean, *ln1_rstd;
    floatX* qkv;
    float* att;  // attention's saved state: the probabilities on the CPU, the logsumexp on the GPU
    // under QK-norm: qkv's matmul writes qkv_normed's input here, and the norm keeps each q and k head's rstd
    floatX* qkv_pre;
    float* qk_rstd;
    floatX *atty, *attproj, *residual2, *ln2;
    float *ln2_mean, *ln2_rstd;
    floatX *fch, *fch_act, *fcproj, *residual3, *lnf;  // fch_act: the MLP's activation, GELU's or SwiGLU's
    float *lnf_mean, *lnf_rstd;
    floatX* logits;
    float *losses, *lse;
    // under a split backward (the zero-bubble pipeline), what the deferred weight gradients read besides the
    // inputs above: the output gradients of the layer's four matmuls (an expert's: of its rows)
    floatX *dqkv, *dattproj, *dfch, *dfcproj;
    // with experts: the routing (llmc/moe.cuh's ExpertActivations), the rows they took (expert-major) and the
    // rows they gave back (dispatch order); fch and fch_act then hold the experts' rows too
    float *route_logits, *route_gate, *route_freq, *shared_scale;
    int *route_expert, *route_row;
    floatX *moe_in, *moe_out;
    // ... and the shared expert's hidden layer before and after its activation, its output (kept where a gate
    // scales it: the gate's gradient reads it), and under a split backward its two output gradients
    floatX *shared_fch, *shared_act, *shared_out, *dshared_fch, *dshared_out;
};

// Activation recomputation (-r): 0 keeps everything; 1 recomputes the MLP's activation (GELU's output, or
// SwiGLU's product) in backward from its input; 2 also recomputes both norms' outputs from their inputs (the
// saved statistics make it cheap). What is recomputed is not kept per layer: one buffer, shared by all layers,
// holds it while it is used.
enum Recompute { RECOMPUTE_NONE = 0, RECOMPUTE_ACTIVATION = 1, RECOMPUTE_NORMS = 2 };

// attention's saved state per layer: the T×T probabilities of every head on the CPU, T logsumexps on the GPU
// and around a cp ring
inline size_t attention_state_floats(const LocalDims& d, Device dev) {
    return (size_t)d.NHl * d.B * d.T * (dev == Device::CUDA || d.ring ? 1 : d.T);
}

// An activation buffer: its name, where its pointer is, the size of its elements, and the elements it holds for
// one layer (per-layer buffers, stacked layer 0 first) or one micro-batch (the others); a per-layer buffer that
// -r recomputes from level `recomputed` on holds nothing per layer: one buffer per level, shared by every layer
// and micro-batch, holds it while it is used.
struct ActivationBuffer {
    const char* name;
    void** pointer;
    size_t element, count;
    int recomputed = 0;  // the -r level that recomputes it (0: never)
};
template <typename E>
inline ActivationBuffer buffer(const char* name, E*& p, size_t count, int recomputed = 0) {
    return {name, reinterpret_cast<void**>(&p), sizeof(E), count, recomputed};
}

// Every per-layer activation buffer, sized: the norm outputs, their statistics and the residual stream are the
// rank's rows (under sp the norm outputs are gathered again where a matmul reads them: norm_rows), the rest
// local. The output gradients of the
// matmuls are kept only under a split backward (the projections' whole: under sp they are gathered before
// the matmul); with experts the rows the experts took (expert-major) and gave back (dispatch order), the hidden
// layers the experts' rows, and the shared expert's buffers (its activation recomputed under -r 1 as the
// MLP's: backward uses one and then the other).
template <typename floatX>
inline std::vector<ActivationBuffer> layer_buffers(Activations<floatX>& a, const LocalDims& d, bool split) {
    size_t BT = d.BT, R = d.R, C = d.C, S = split, mlp_rows = d.K ? d.expert_rows : BT;
    size_t means = d.means ? R : 0, QK = d.qk_norm, shared = d.shared_FCl > 0, gated = d.shared_gate;
    // the MLP's buffers hold the experts' rows or a dense layer's (layer_dims), whichever is larger
    size_t fch = std::max(mlp_rows * d.FCl, BT * d.dense_FCl), act = std::max(mlp_rows * d.Hl, BT * d.dense_Hl);
    size_t dfch = S * fch, dfcproj = S * std::max(mlp_rows, BT) * C;
    return {buffer("ln1", a.ln1, R * C, RECOMPUTE_NORMS), buffer("ln1_mean", a.ln1_mean, means), buffer("ln1_rstd", a.ln1_rstd, R),
            buffer("qkv", a.qkv, BT * d.QKVl), buffer("att", a.att, attention_state_floats(d, device_of<floatX>)),
            buffer("atty", a.atty, BT * d.Cl), buffer("attproj", a.attproj, R * C), buffer("residual2", a.residual2, R * C),
            buffer("ln2", a.ln2, R * C, RECOMPUTE_NORMS), buffer("ln2_mean", a.ln2_mean, means), buffer("ln2_rstd", a.ln2_rstd, R),
            buffer("fch", a.fch, fch), buffer("fch_act", a.fch_act, act, RECOMPUTE_ACTIVATION),
            buffer("fcproj", a.fcproj, R * C), buffer("residual3", a.residual3, R * C), buffer("dqkv", a.dqkv, S * BT * d.QKVl),
            buffer("dattproj", a.dattproj, S * BT * C), buffer("dfch", a.dfch, dfch), buffer("dfcproj", a.dfcproj, dfcproj),
            buffer("route_logits", a.route_logits, BT * d.E), buffer("route_expert", a.route_expert, BT * d.K),
            buffer("route_gate", a.route_gate, BT * d.K), buffer("route_row", a.route_row, BT * d.K),
            buffer("route_freq", a.route_freq, (size_t)d.B * d.E), buffer("shared_scale", a.shared_scale, gated * BT),
            buffer("moe_in", a.moe_in, d.expert_rows * C), buffer("moe_out", a.moe_out, d.K * BT * C),
            buffer("qkv_pre", a.qkv_pre, QK * BT * d.QKVl), buffer("qk_rstd", a.qk_rstd, QK * BT * (d.NHl + d.KVl)),
            buffer("shared_fch", a.shared_fch, BT * d.shared_FCl),
            buffer("shared_act", a.shared_act, BT * d.shared_Hl, RECOMPUTE_ACTIVATION),
            buffer("shared_out", a.shared_out, gated * BT * C), buffer("dshared_fch", a.dshared_fch, S * BT * d.shared_FCl),
            buffer("dshared_out", a.dshared_out, S * shared * BT * C)};
}

// ... and the buffers of a micro-batch around the layers: the embeddings' output (where a previous stage's
// activations arrive), and on the last stage the head's: the final layernorm (its output whole, its statistics
// on the rank's rows), the rank's logits, the per-token losses and, under tp, their log-sum-exp
template <typename floatX>
inline std::vector<ActivationBuffer> edge_buffers(Activations<floatX>& a, const LocalDims& d, bool head, int tp) {
    size_t BT = d.BT, R = d.R, C = d.C;
    std::vector<ActivationBuffer> buffers = {buffer("encoded", a.encoded, R * C)};
    if (!head) return buffers;
    for (ActivationBuffer s : {buffer("lnf", a.lnf, BT * C), buffer("lnf_mean", a.lnf_mean, d.means ? R : 0), buffer("lnf_rstd", a.lnf_rstd, R),
                             buffer("logits", a.logits, BT * d.Vl), buffer("losses", a.losses, BT)})
        buffers.push_back(s);
    if (tp > 1) buffers.push_back(buffer("lse", a.lse, BT));
    return buffers;
}

// what a buffer keeps per layer under recomputation level `recompute`
inline size_t kept_per_layer(const ActivationBuffer& s, int recompute) {
    return s.recomputed && recompute >= s.recomputed ? 0 : s.count;
}

// the bytes a layer's forward stores for its backward in a slot (what -r does not recompute), and what a
// micro-batch stores around the layers: the embeddings' output, and the head's buffers on the last stage; the
// profiler's live activations (llmc/profile.h) rise and fall by these
template <typename floatX>
inline size_t stored_layer_bytes(const LocalDims& d, bool split, int recompute) {
    Activations<floatX> sizing{};
    size_t bytes = 0;
    for (const ActivationBuffer& s : layer_buffers(sizing, d, split)) bytes += kept_per_layer(s, recompute) * s.element;
    return bytes;
}
template <typename floatX>
inline size_t stored_edge_bytes(const LocalDims& d, bool head, int tp) {
    Activations<floatX> sizing{};
    size_t bytes = 0;
    for (const ActivationBuffer& s : edge_buffers(sizing, d, head, tp)) bytes += s.count * s.element;
    return bytes;
}

// the buffer whose size the shared buffer of recomputation level `level` takes: the level's largest (null: none)
inline const ActivationBuffer* largest_recomputed(const std::vector<ActivationBuffer>& per_layer, int level) {
    const ActivationBuffer* largest = nullptr;
    for (const ActivationBuffer& s : per_layer)
        if (s.recomputed == level && (!largest || s.count > largest->count)) largest = &s;
    return largest;
}

// layer l's slice of every per-layer activation buffer (stacked layer 0 first); the other fields unchanged
template <typename floatX>
inline Activations<floatX> layer_slice(const Activations<floatX>& a, int l, const LocalDims& d, int recompute,
                                       bool split) {
    Activations<floatX> v = a;
    for (const ActivationBuffer& s : layer_buffers(v, d, split))
        *s.pointer = static_cast<char*>(*s.pointer) + l * kept_per_layer(s, recompute) * s.element;
    return v;
}

// buffers that live only inside backward (activation gradients), plus the kernels' workspaces (on the CPU the
// GEMM's packing panels and attention's rows per thread; on the GPU the kernels' workspace, which the
// model passes to the layers that need it: llmc/device.cuh's Workspace); under tensor parallelism also the partial sums of row-parallel outputs, and under sequence
// parallelism the gathered output gradients, the reduced input gradients and a norm's output gathered (the
// layers keep their own rows of it: norm_rows). dact: the gradient of SwiGLU's
// output, which is half as wide as its input's (GPT-2's GELU takes its gradient in place: null)
template <typename floatX>
struct Scratch {
    floatX *dresidual, *dln, *dqkv, *datty, *dfch, *dact;
    float *attention, *gemm;
    floatX *partial, *gather, *whole, *dchunk, *norm_whole;
    floatX* dwte_micro_step;  // a tied wte's gradient of one micro-step, or null (tied_wte_summed_apart)
};

// the fp32 scratch the GPU kernels of one rank's forward and backward need at most (llmc/device.cuh)
inline size_t gpu_kernel_scratch_floats(const LocalDims& d) {
    size_t need = (size_t)norm_backward_scratch_floats(d.means ? Norm::LayerNorm : Norm::RMSNorm, d.R, d.C);
    for (long oc : {(long)d.QKVl, (long)d.C, (long)d.FCl, (long)d.dense_FCl, (long)d.shared_FCl})  // the matmuls with a bias gradient (an
        need = std::max(need, (size_t)matmul_backward_scratch_floats(std::max(d.BT, d.expert_rows), oc));  // expert's: all its rows
    need = std::max(need, attention_backward_scratch_floats(d.B, d.T, d.Cl, d.NHl));
    if (d.qk_norm) need = std::max(need, (size_t)qk_norm_backward_scratch_floats(d.BT, d.hd));
    // CUB sizes the encoder's sort only on a GPU; a plan made without one takes its usual need: keys, positions
    // and their sorted copies (4·BT int32 at most), the runs (BT + V), and the sort's own buffers and histograms
    // (2·BT int32 + 64 KiB)
    size_t sort_bytes = cuda_device_available() ? encoder_backward_scratch_bytes(d.B, d.T, d.Vl)
                                                : (7 * d.BT + d.Vl) * sizeof(int) + 65536;
    need = std::max(need, (sort_bytes + 3) / 4);
    return std::max(need, (size_t)GLOBAL_NORM_BLOCKS);  // the gradient norm's partial sums
}

// What one micro-batch keeps from its forward through a chunk of the model until its backward: the chunk's
// activations, sized for the part's longest chunk, and the micro-batch's tokens. Under pipeline parallelism a
// stage holds several in flight (llmc/pp.cuh); otherwise there is one.
template <typename floatX>
struct MicroBatchSlot {
    Activations<floatX> acts;
    std::vector<int> inputs, targets;  // this rank's tokens of the micro-batch (its positions under cp)
    std::vector<MoERoute> routes;      // with experts: each layer's routing of the micro-batch, for backward
    int *device_inputs = nullptr, *device_targets = nullptr;  // the same, where the kernels read them
    int B = 0, T = 0;
    float loss = -1.0f;  // the chunk's loss: -1 without targets, or when the chunk is not the model's last
    bool dlogits = false;  // the logits hold their gradient already: a training forward took both in one pass
};

// The activations of a rank's micro-batch slots as the list the model's allocation walks: first the one buffer of
// each -r level (the level's largest), then per slot the embeddings' output, every per-layer buffer stacked for
// chunks of up to chunk_layers layers (one that -r recomputes shares its level's buffer), the head's buffers on
// the last stage and, on the GPU, the tokens and targets (the CPU's kernels read the slot's own vectors).
// recomputed: where the levels' buffers go.
template <typename floatX>
inline BufferList activation_buffers(std::vector<MicroBatchSlot<floatX>>& slots, void* (&recomputed)[RECOMPUTE_NORMS + 1],
                                     const LocalDims& d, size_t chunk_layers, bool split, int recompute, bool head, int tp) {
    auto kept = [](const ActivationBuffer& s, size_t count) {
        return PlannedBuffer{s.name, MEM_ACTIVATIONS, count * s.element, s.pointer};
    };
    BufferList list;
    Activations<floatX> sizing{};
    std::vector<ActivationBuffer> per_layer = layer_buffers(sizing, d, split);
    for (int level = RECOMPUTE_ACTIVATION; level <= recompute; level++)
        if (const ActivationBuffer* s = largest_recomputed(per_layer, level))
            list.push_back({s->name, MEM_ACTIVATIONS, s->count * s->element, &recomputed[level]});
    for (MicroBatchSlot<floatX>& mb : slots) {
        std::vector<ActivationBuffer> edges = edge_buffers(mb.acts, d, head, tp);
        list.push_back(kept(edges[0], edges[0].count));  // the embeddings' output
        for (const ActivationBuffer& s : layer_buffers(mb.acts, d, split))
            if (s.recomputed && recompute >= s.recomputed)
                list.push_back({s.name, MEM_ACTIVATIONS, 0, s.pointer, &recomputed[s.recomputed]});
            else
                list.push_back(kept(s, chunk_layers * s.count));
        for (size_t i = 1; i < edges.size(); i++) list.push_back(kept(edges[i], edges[i].count));
        if (device_of<floatX> == Device::CUDA) {
            list.push_back(planned("device_inputs", MEM_ACTIVATIONS, mb.device_inputs, d.BT));
            list.push_back(planned("device_targets", MEM_ACTIVATIONS, mb.device_targets, d.BT));
        }
    }
    return list;
}

// The scratch as the list the model's allocation walks: backward's activation gradients (dfch for the experts'
// rows, a dense layer's or the shared expert's; dact, SwiGLU's output gradient, where its input is wider: GELU's
// runs in place), the kernels' workspaces (the GPU's shared scratch; the CPU's attention rows and GEMM panels for
// `threads` threads), tp's and sp's buffers, and a tied wte's gradient summed apart (a gradient, when
// summed_apart: tied_wte_summed_apart). The pointers not listed stay null.
template <typename floatX>
inline BufferList scratch_buffers(Scratch<floatX>& s, const LocalDims& d, const TPSpec& tp, int threads, bool summed_apart) {
    size_t C = d.C, BT = d.BT, R = d.R, mlp_rows = d.K ? d.expert_rows : BT;
    BufferList list = {planned("dresidual", MEM_SCRATCH, s.dresidual, R * C), planned("dln", MEM_SCRATCH, s.dln, BT * C),
                       planned("dqkv", MEM_SCRATCH, s.dqkv, BT * d.QKVl), planned("datty", MEM_SCRATCH, s.datty, BT * d.Cl),
                       planned("dfch", MEM_SCRATCH, s.dfch, std::max({mlp_rows * d.FCl, BT * d.dense_FCl, BT * d.shared_FCl}))};
    if (d.FCl != d.Hl)
        list.push_back(planned("dact", MEM_SCRATCH, s.dact, std::max({mlp_rows * d.Hl, BT * d.dense_Hl, BT * d.shared_Hl})));
    if (device_of<floatX> == Device::CUDA) {
        list.push_back(planned("gpu kernel scratch", MEM_SCRATCH, s.gemm, gpu_kernel_scratch_floats(d)));
    } else {
        list.push_back(planned("attention rows", MEM_SCRATCH, s.attention, (size_t)threads * d.T));
        list.push_back(planned("gemm panels", MEM_SCRATCH, s.gemm, gemm_workspace_floats(threads)));
    }
    if (tp.size > 1) {
        list.push_back(planned("tp partial", MEM_SCRATCH, s.partial, BT * C));
        list.push_back(planned("tp gather", MEM_SCRATCH, s.gather, BT * C / tp.size));
    }
    if (tp.sp) {
        list.push_back(planned("sp whole", MEM_SCRATCH, s.whole, BT * C));
        list.push_back(planned("sp dchunk", MEM_SCRATCH, s.dchunk, R * C));
        list.push_back(planned("sp norm_whole", MEM_SCRATCH, s.norm_whole, BT * C));
    }
    if (summed_apart) list.push_back(planned("dwte_micro_step", MEM_GRADS, s.dwte_micro_step, (size_t)d.Vl * C));
    return list;
}

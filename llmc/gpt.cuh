// The model of every architecture in the table (llmc/model_table.h: GPT-2, Llama 3, Qwen3, each dense or with
// experts): the flat parameter/gradient/optimizer buffers in the table's tensor order, their allocation with the
// activations (llmc/activations.cuh) for a rank's layout, initialization, and forward()/backward()/update()
// written as explicit layer calls: one layer body whose operations the architecture's properties and tensors
// choose. Everything the model owns is allocated through its Ledger. Its configuration and descriptors are
// llmc/model_config.h's, llm.c's model files llmc/model_file.h's. The names (GPTModel, gpt_*) are llm.c's, kept for
// every architecture: each is a GPT, a decoder-only transformer.
//
// One model for both devices: GPTModel<floatX> stores its parameters, gradients and activations as floatX (llm.c's
// name for it): float on the CPU and bf16 on the GPU (llmc/device.cuh), with fp32 master weights, moments and
// statistics there. Every layer call below resolves by its pointer types to the CPU reference or the CUDA kernel
// of the same name, so forward and backward are the same call sequence on both devices. GPT is the CPU model,
// GPTCuda the GPU's.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "llmc/activations.cuh"
#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/cp.cuh"
#include "llmc/device.cuh"
#include "llmc/encoder.cuh"
#include "llmc/fp8.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/mlp.cuh"
#include "llmc/model_config.h"
#include "llmc/model_file.h"
#include "llmc/model_table.h"
#include "llmc/moe.cuh"
#include "llmc/norm.cuh"
#include "llmc/nvtx.h"
#include "llmc/residual.cuh"
#include "llmc/rope.cuh"
#include "llmc/tp.cuh"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------------------
// the model: its buffers, their allocation for a rank's layout, and initialization

// Where the parameters and gradients live when they are not the model's own flat buffers, and what to do when
// backward has finished a unit's gradients: the hooks a data-parallel runtime (llmc/zero.cuh) plugs into the
// model. Without one, everything is local and flat.
template <typename floatX>
struct ParamStore {
    virtual ~ParamStore() = default;
    // a forward or backward pass over units [low_unit, high_unit] (and the embeddings) begins
    virtual void begin_pass(bool backward, int low_unit, int high_unit) = 0;
    virtual ParamViews<floatX> params(int unit) = 0;  // ready to read when this returns
    virtual ParamViews<floatX> grads(int unit) = 0;   // where backward accumulates this unit's gradients
    virtual void grads_done(int unit) = 0;    // this micro-step's gradients of the unit are complete
    virtual void end_pass() = 0;
};

template <typename floatX>
struct GPTModel {
    GPTConfig config;
    ModelTable table;  // its tensors (llmc/model_table.h)
    int B = 0, T = 0;  // the largest batch forward() accepts
    Ledger ledger;
    size_t param_sizes[NUM_PARAM_TENSORS];
    size_t num_parameters = 0;
    floatX* params = nullptr;
    floatX* grads = nullptr;
    float* master = nullptr;  // the GPU's fp32 copy of params, which AdamW updates; null on the CPU
    float* adam_m = nullptr;
    float* adam_v = nullptr;
    std::vector<std::vector<Segment>> units;
    ParamStore<floatX>* store = nullptr;  // null: parameters and gradients are the flat buffers above
    int adam_step = 0;  // updates taken so far (AdamW's t)
    uint64_t seed = 0;  // the stochastic rounding's bits on the GPU
    TensorParallel tp;  // this rank's place in its tensor-parallel group
    ContextParallel<floatX> cp;  // ... and in its context-parallel group
    MixtureOfExperts<floatX> moe;  // the experts' routing and dispatch, and this rank's place in its ep group
    ModelPart part;     // the layers it holds (all, or a pipeline stage's)
    int recompute = RECOMPUTE_NONE;
    bool split_backward = false;  // backward leaves the matmuls' weight gradients to gpt_weight_grads_chunk()
    std::vector<MicroBatchSlot<floatX>> slots;  // one per micro-batch in flight (one without pipelining)
    // what a micro-batch's forward stores in its slot until backward releases it, in bytes: the input, each
    // layer's activations, the head's (the profiler's live activations: llmc/profile.h)
    size_t stored_input = 0, stored_per_layer = 0, stored_head = 0;
    void* recomputed[RECOMPUTE_NORMS + 1] = {};  // the buffer of each -r level, shared by every layer and slot
    Scratch<floatX> scratch{};
    Workspace workspace;  // the kernels' fp32 workspace (llmc/device.cuh): scratch.gemm with the count allocated
    AttentionKernels attention_kernels = AttentionKernels::MMA;  // the GPU's (llmc/attention.cuh); the CPU has its own
    float* rope = nullptr;  // Llama: RoPE's (cos, sin) per position and frequency (llmc/rope.cuh)
    // --fp8 (gpt_allocate_fp8): the layers' FP8 casts, their scales shared over the ranks that hold pieces of a
    // micro-batch's tensors (tp × cp), and the same buffers for the experts, whose scales tp alone shares
    bool fp8_on = false;
    Fp8Scaling<floatX> fp8, fp8_experts;

    GPTModel() = default;
    GPTModel(const GPTModel&) = delete;
    GPTModel& operator=(const GPTModel&) = delete;
};
using GPT = GPTModel<float>;
using GPTCuda = GPTModel<bf16>;

// that the model and its sequences of T tokens split over tp × cp ranks, and its experts over ep, as asked, or one
// line naming the flag that does not fit (the trainer's check_layout and gpt_allocate both ask here)
inline void check_split(const GPTConfig& config, int T, const TPSpec& tp, const CPSpec& cp, int ep) {
    validate_config(config, "model");
    if (T > config.max_seq_len) fail("-t %d: longer than the model's maximum sequence length %d", T, config.max_seq_len);
    if (config.num_heads % tp.size != 0)
        fail("--tp %d: must divide the number of heads (%d)", tp.size, config.num_heads);
    if (config.kv_heads() % tp.size != 0 && tp.size % config.kv_heads() != 0)
        fail("--tp %d: must divide the number of key/value heads (%d) or be a multiple of it (each head then held by "
             "tp/KV ranks)", tp.size, config.kv_heads());
    // every column split's parts and every row split's columns (the MLP's hidden units among them)
    for (const TensorSpec& s : model_table(config)) {
        for (int p = 0; p < 3; p++)  // into tp pieces, or a part with fewer heads into its heads
            if (s.split == TPSplit::Column && s.parts[p] % s.pieces(p, tp.size) != 0)
                fail("--tp %d: must divide the %zu rows of each part of %s (the MLP's hidden units, or the heads' channels)",
                     tp.size, s.parts[p], s.name);
        if (s.split == TPSplit::Row && s.block() > 0 && s.cols % tp.size != 0)
            fail("--tp %d: must divide the %zu columns of %s", tp.size, s.cols, s.name);
    }
    if (cp.size > 1) cp_layout(T, cp.size, cp.rank, cp.split);  // T splits into 2·cp chunks
    if (tp.sp && cp.size == 1 && T % tp.size != 0)
        fail("--sp 1: the sequence length -t %d must be divisible by --tp %d (each rank keeps T/tp positions)", T, tp.size);
    if (tp.sp && (T / cp.size) % tp.size != 0)
        fail("--sp 1: the %d tokens of a sequence on each cp rank (-t %d / --cp %d) must be divisible by --tp %d", T / cp.size,
             T, cp.size, tp.size);
    if (ep > 1 && !config.moe()) fail("--ep %d: the model has no experts to split (-e ...e<E>k<K>)", ep);
    if (config.num_experts % ep != 0) fail("--ep %d: must divide the number of experts (%d)", ep, config.num_experts);
}

// which of the model states the model allocates itself; ZeRO allocates the rest as shards
struct ModelBuffers {
    bool params = true, grads = true, optimizer = true;
};

// The communicators the model's collectives run on, which the parallel layout (llmc/parallel.cuh) hands over at
// allocation; null where the rank has no group (a model built alone, in a test)
struct ModelLinks {
    Comm* tp = nullptr;  // the tensor-parallel group
    Comm* cp = nullptr;  // the context-parallel ring
    Comm* ep = nullptr;  // the expert-parallel group, and this rank's place in it
    int ep_rank = 0;
    Comm* batch = nullptr;          // the dp × cp ranks, whose tokens make the aux loss's batch; null for one rank
    Comm* amaxes = nullptr;         // FP8: the ranks holding pieces of a dense layer's tensors (tp × cp)
    Comm* expert_amaxes = nullptr;  // ... of an expert's (tp)
    bool speaks = true;             // FP8: this rank says which weights stay out of a block recipe
};

// How one rank holds the model: which states it allocates itself, its places in the tensor-, context- and
// expert-parallel groups and the communicators of those groups, the part it holds (empty: the whole model; or a
// pipeline stage's chunks), the micro-batches in flight, whether backward leaves the matmuls' weight gradients to
// gpt_weight_grads_chunk (the zero-bubble pipeline's split backward), what -r recomputes, the experts' settings
// and, on the GPU, the attention kernels. The defaults: one rank holding the whole model, with the experts' default
// settings (llmc/expert_settings.h) and this GPU's attention kernels (wgmma on a Hopper, else mma).
struct ModelLayout {
    ModelBuffers own;
    TPSpec tp;
    CPSpec cp;
    int ep = 1;
    ModelLinks links;
    ExpertSettings experts;
    float capacity = 0.0f;  // the experts' capacity factor (--moe-capacity; 0: every assignment taken)
    ModelPart part;
    int slots = 1;
    bool split_backward = false;
    int recompute = RECOMPUTE_NONE;
    int accumulation = 1;  // micro-steps per optimizer step
    std::optional<AttentionKernels> attention_kernels;  // --attention; none: this GPU's (attention_select(""))
};

// A micro-step's gradient is added to the gradients accumulated over the step's earlier micro-steps whole, one
// add per element, so that one rank accumulating micro-steps sums the same numbers in the same order as dp's
// ranks that each run one of them and reduce (llmc/zero.cuh): the layers' kernels sum over their rows before
// they add. A tied wte takes two gradients in a micro-step, the classifier's at the start of backward and the
// embedding's at its end, so where they would land in gradients that accumulate (the model's own buffer, with
// more than one micro-step; ZeRO-2/3 stage each micro-step's anew) the two are summed apart first, in a buffer
// of wte's size. Under a pipeline the two are on different stages, or (DualPipeV's first rank) in backward
// passes that other micro-batches' come between, and go straight into the gradients.
inline bool tied_wte_summed_apart(const GPTConfig& c, const ModelPart& part, bool own_grads, int accumulation) {
    return c.tied() && part.first && part.last && part.chunks() == 1 && own_grads && accumulation > 1;
}

// Every buffer of the model's part as the layout says, for micro-batches of up to B×T tokens and `threads` CPU
// threads: the list gpt_allocate walks and --plan reads (llmc/plan.h). It is made from the sizes alone and
// allocates nothing, so a plan can list a model no machine at hand could hold. In order: the model states the rank
// allocates itself (the parameters, gradients, on the GPU the fp32 master weights, AdamW's moments), the
// activations of each micro-batch in flight (llmc/activations.cuh), the scratch, Llama's RoPE table, the ring's
// buffers under cp (llmc/cp.cuh) and the experts' (llmc/moe.cuh). The pointers are m's: it takes the layout's
// cp group, ep group and capacity, and a slot per micro-batch in flight.
template <typename floatX>
inline BufferList gpt_buffers(GPTModel<floatX>& m, const GPTConfig& config, int B, int T, const ModelLayout& layout,
                              int threads) {
    ModelPart part = layout.part.chunks() > 0 ? layout.part : whole_part(config);
    size_t n = num_parameters(config, layout.tp.size, part, layout.ep);
    BufferList list;
    if (layout.own.params) list.push_back(planned("params", MEM_PARAMS, m.params, n));
    if (layout.own.grads) list.push_back(planned("grads", MEM_GRADS, m.grads, n));
    if (layout.own.optimizer) {
        if (device_of<floatX> == Device::CUDA) list.push_back(planned("master", MEM_MASTER_WEIGHTS, m.master, n));
        list.push_back(planned("adam_m", MEM_OPTIMIZER, m.adam_m, n));
        list.push_back(planned("adam_v", MEM_OPTIMIZER, m.adam_v, n));
    }
    LocalDims d = local_dims(config, layout.tp, B, T, layout.cp.size, layout.ep, layout.capacity);
    size_t chunk_layers = *std::max_element(part.chunk_layers.begin(), part.chunk_layers.end());
    m.slots.resize(layout.slots);
    append(list, activation_buffers(m.slots, m.recomputed, d, chunk_layers, layout.split_backward, layout.recompute,
                                    part.last, layout.tp.size));
    bool summed_apart = tied_wte_summed_apart(config, part, layout.own.grads, layout.accumulation);
    append(list, scratch_buffers(m.scratch, d, layout.tp, threads, summed_apart));
    if (!config.learned_positions())
        list.push_back(planned("rope", MEM_SCRATCH, m.rope, (size_t)config.max_seq_len * d.hd));
    // under cp, a learned position table is gathered at the rank's positions (C wide); RoPE reads the positions
    m.cp.spec = layout.cp;
    append(list, m.cp.buffers(B, T, config.learned_positions() ? config.channels : 0, RingHeads{d.Cl, d.NHl, d.KVl}));
    m.moe.ep_size = layout.ep, m.moe.capacity = layout.capacity;
    append(list, m.moe.buffers(config, B, d.BT, d.expert_rows, layout.cp.size));
    return list;
}

// Allocates the model's part as the layout says, for micro-batches of up to B×T tokens: checks the layout, walks
// gpt_buffers' list through the model's ledger, and sets up what the list does not hold (the host's tokens, the
// kernels' workspace with its size, the GPU's attention kernels, RoPE's table, the routing's host state); the
// parallel layout's communicators and the experts' settings come in with the layout (ModelLinks from
// llmc/parallel.cuh, ExpertSettings from the options)
template <typename floatX>
inline void gpt_allocate(GPTModel<floatX>& m, const GPTConfig& config, int B, int T, const ModelLayout& layout = {}) {
    constexpr bool gpu = device_of<floatX> == Device::CUDA;
    const TPSpec& tp = layout.tp;
    check_split(config, T, tp, layout.cp, layout.ep);
    ModelPart part = layout.part.chunks() > 0 ? layout.part : whole_part(config);
    int head_size = config.head_size();
    if (gpu && head_size != 64 && head_size != 128)
        fail("model: head size %d: the GPU attention kernels take 64 or 128", head_size);
    m.config = config;
    m.table = model_table(config);
    m.B = B;
    m.T = T;
    m.tp.spec = tp;
    m.part = part;
    m.recompute = layout.recompute;
    m.split_backward = layout.split_backward;
    param_tensor_sizes(config, m.param_sizes, tp.size, part, layout.ep);
    m.num_parameters = num_parameters(config, tp.size, part, layout.ep);
    m.units = unit_segments(config, tp.size, part, layout.ep);
    LocalDims d = local_dims(config, tp, B, T, layout.cp.size, layout.ep, layout.capacity);
    m.cp.spec = layout.cp;
    m.cp.prepare(T, RingHeads{d.Cl, d.NHl, d.KVl});
    m.stored_input = stored_edge_bytes<floatX>(d, false, tp.size);
    m.stored_per_layer = stored_layer_bytes<floatX>(d, layout.split_backward, layout.recompute);
    m.stored_head = part.last ? stored_edge_bytes<floatX>(d, true, tp.size) - m.stored_input : 0;

    BufferList buffers = gpt_buffers(m, config, B, T, layout, omp_get_max_threads());
    m.ledger.template allocate<floatX>(buffers);
    for (const PlannedBuffer& b : buffers)  // the kernels' workspace, as large as the list made it
        if (b.pointer == reinterpret_cast<void**>(&m.scratch.gemm))
            m.workspace = {m.scratch.gemm, b.bytes / sizeof(float)};
    if (gpu) m.attention_kernels = layout.attention_kernels ? *layout.attention_kernels : attention_select("");

    for (MicroBatchSlot<floatX>& mb : m.slots) {
        mb.inputs.assign(d.BT, 0);
        mb.targets.assign(d.BT, 0);
        mb.routes.resize(config.moe() ? *std::max_element(part.chunk_layers.begin(), part.chunk_layers.end()) : 0);
        if (!gpu) mb.device_inputs = mb.inputs.data(), mb.device_targets = mb.targets.data();
    }
    m.tp.gather = m.scratch.gather;
    if (!config.learned_positions()) {  // RoPE's (cos, sin) table for every position the model takes
        size_t n = (size_t)config.max_seq_len * d.hd;
        std::vector<float> table(n);
        rope_table(table.data(), config.max_seq_len, d.hd, config.rope_theta, config.rope_scaling);
        device_upload<floatX>(m.rope, table.data(), n);
    }
    m.moe.prepare(config);
    const ModelLinks& links = layout.links;
    m.tp.comm = links.tp, m.cp.comm = links.cp;
    m.moe.ep = links.ep, m.moe.ep_rank = links.ep_rank, m.moe.batch = links.batch;
    m.fp8.group = links.amaxes, m.fp8_experts.group = links.expert_amaxes;
    m.fp8.speaks = m.fp8_experts.speaks = links.speaks;
    m.moe.settings = layout.experts;
}

// the sizes the model works with on a micro-batch of B×T tokens
template <typename floatX>
inline LocalDims model_dims(const GPTModel<floatX>& m, int B, int T) {
    return local_dims(m.config, m.tp.spec, B, T, m.cp.spec.size, m.moe.ep_size, m.moe.capacity);
}

// The FP8 casts' buffers (llmc/fp8.cuh) for a rank's layer matmuls: inputs up to the widest of ln's C, attention's
// Cl and the MLPs' Hl; outputs up to the widest of qkv's, the projections' C and the MLPs' first; the largest
// weight; on the rows of a micro-batch or, with experts, the most an expert may see; group: the ranks whose
// amaxes are gathered (tp × cp)
inline Fp8Sizes fp8_layer_sizes(const LocalDims& d, int group, Device dev, Fp8Recipe recipe = Fp8Recipe::Tensorwise) {
    long rows = std::max(d.BT, d.expert_rows);
    long in = std::max({(long)d.C, (long)d.Cl, (long)d.Hl, (long)d.dense_Hl, (long)d.shared_Hl});
    long out = std::max({(long)d.QKVl, (long)d.C, (long)d.FCl, (long)d.dense_FCl, (long)d.shared_FCl});
    size_t weight = std::max({(size_t)d.QKVl * d.C, (size_t)d.C * d.Cl, (size_t)d.FCl * d.C, (size_t)d.C * d.Hl,
                              (size_t)d.dense_FCl * d.C, (size_t)d.shared_FCl * d.C});
    return fp8_sizes(rows, in, out, weight, group, dev, recipe);
}

// What stops a layout from casting a block recipe's tiles as the single rank does ("" when nothing does). Each tile
// is scaled alone, so the tiles need only be whole on every rank: under tp a weight that runs in the recipe on one
// rank (its dimensions whole tiles) must split into pieces of whole tiles (q, k and v of the attention's first
// matmul, the MLPs' hidden units), and under cp the weight gradient's tiles of tokens must not straddle the
// sequence's chunks, which are T/(2·cp) tokens.
inline std::string fp8_layout_problem(const GPTConfig& c, Fp8Recipe r, int tp, int cp, int T) {
    if (r == Fp8Recipe::Tensorwise) return "";
    int L = fp8_tile(r);
    LocalDims whole = local_dims(c, TPSpec{1, 0, false}, 1, T), piece = local_dims(c, TPSpec{tp, 0, false}, 1, T);
    struct Split {
        const char* what;
        long rows, cols, whole_piece, piece;
    } splits[] = {{"the queries", whole.QKVl, whole.C, whole.Cl, piece.Cl},
                  {"the keys and values", whole.QKVl, whole.C, (long)whole.KVl * whole.hd, (long)piece.KVl * piece.hd},
                  {"the MLP's hidden units", whole.FCl, whole.C, whole.Hl, piece.Hl},
                  {"the dense MLP's hidden units", whole.dense_FCl, whole.C, whole.dense_Hl, piece.dense_Hl},
                  {"the shared expert's hidden units", whole.shared_FCl, whole.C, whole.shared_Hl, piece.shared_Hl}};
    for (const Split& s : splits)
        if (tp > 1 && s.whole_piece > 0 && fp8_recipe_takes(r, s.rows, s.cols) && s.piece % L != 0)
            return strfmt("--tp %d splits %s into pieces of %ld, which cut the whole tensor's tiles of %d", tp, s.what,
                          s.piece, L);
    if (cp > 1 && (T / (2 * cp)) % L != 0)
        return strfmt("--cp %d cuts sequences into chunks of %d tokens, which cut the weight gradient's tiles of %d tokens",
                      cp, T / (2 * cp), L);
    return "";
}

// The FP8 casts' buffers of the sizes z as the list gpt_allocate_fp8 walks and --plan reads: the cast operands
// (an input, a weight, an output gradient and its copy for the weight gradient; those of no elements are left
// out), the scales with the amaxes after them, and on the GPU a block recipe's tile scales
template <typename floatX>
inline BufferList fp8_buffers(Fp8Scaling<floatX>& q, const Fp8Sizes& z) {
    BufferList list;
    for (const PlannedBuffer& b : {planned("fp8 input", MEM_SCRATCH, q.input, z.input), planned("fp8 weight", MEM_SCRATCH, q.weight, z.weight),
                                   planned("fp8 grad", MEM_SCRATCH, q.grad, z.grad), planned("fp8 grad_t", MEM_SCRATCH, q.grad_t, z.grad_t)})
        if (b.bytes) list.push_back(b);
    list.push_back(planned("fp8 scales", MEM_SCRATCH, q.scales, z.floats));
    if (device_of<floatX> == Device::CUDA)  // (the CPU's casts keep their scales in the values)
        for (int o = 0; o < 4; o++)
            if (z.tiles[o]) list.push_back({"fp8 tiles", MEM_SCRATCH, z.tiles[o], &q.tiles[o]});
    return list;
}

// --fp8 1: the buffers of the FP8 casts, after gpt_allocate, which set their groups (ModelLinks)
template <typename floatX>
inline void gpt_allocate_fp8(GPTModel<floatX>& m, Fp8Recipe recipe = Fp8Recipe::Tensorwise) {
    constexpr Device dev = device_of<floatX>;
    if (m.config.num_layers <= 2)
        fail("--fp8 1: the first and the last layer stay bf16, so a model of %d layers has none to run in FP8",
             m.config.num_layers);
    if (dev == Device::CUDA) fp8_check_gpu(recipe);
    std::string why = fp8_layout_problem(m.config, recipe, m.tp.size(), m.cp.spec.size, m.T);
    if (!why.empty()) fail("--fp8-recipe %s: %s", fp8_recipe_name(recipe), why.c_str());
    LocalDims d = model_dims(m, m.B, m.T);
    // cuBLASLt's FP8 kernels want every K, and the leading dimensions, a multiple of 16 (the rows are padded)
    for (long k : {(long)d.C, (long)d.Cl, (long)d.Hl, (long)d.QKVl, (long)d.FCl, (long)d.dense_Hl, (long)d.shared_Hl})
        if (dev == Device::CUDA && k % 16 != 0)
            fail("--fp8 1: the rank's matmul widths (C %d, C/tp %d, hidden %d, qkv %d, MLP in %d, dense layers' hidden "
                 "%d, shared expert's hidden %d) must be multiples of 16", d.C, d.Cl, d.Hl, d.QKVl, d.FCl, d.dense_Hl,
                 d.shared_Hl);
    m.fp8.recipe = recipe;
    m.ledger.template allocate<floatX>(fp8_buffers(m.fp8, fp8_layer_sizes(d, m.tp.size() * m.cp.spec.size, dev, recipe)));
    m.fp8.amaxes = m.fp8.scales + FP8_SCALE_FLOATS;
    Comm* experts_group = m.fp8_experts.group;  // the experts' amaxes are shared over tp alone (ModelLinks)
    m.fp8_experts = m.fp8;
    m.fp8_experts.group = experts_group;
    m.fp8_on = true;
}

// the FP8 state of model layer `layer`'s matmuls, its experts' with `experts`; null where they stay bf16: every
// layer without --fp8, and the first and the last layer with it
template <typename floatX>
inline const Fp8Scaling<floatX>* fp8_for(const GPTModel<floatX>& m, int layer, bool experts = false) {
    if (!m.fp8_on || layer == 0 || layer == m.config.num_layers - 1) return nullptr;
    return experts ? &m.fp8_experts : &m.fp8;
}

// an MLP's tensors out of its layer's unit (a view is null where the layer holds no such tensor: a bias the
// architecture lacks, a shared expert the model has none of)
template <typename floatX>
inline MlpTensorViews<floatX> mlp_views(const ParamViews<floatX>& v, const MlpTensors& t) {
    return {v[t.fcw], v[t.fcb], v[t.fcprojw], v[t.fcprojb]};
}
// a sparse layer's router, experts, shared expert and its gate; `mlps` false: without the MLPs' (a split
// backward's gradients, which the weight-gradient step takes)
template <typename floatX>
inline ExpertTensors<floatX> expert_tensors(const ParamViews<floatX>& v, bool mlps = true) {
    MlpTensorViews<floatX> none{};
    return {v[ROUTERW], mlps ? mlp_views(v, EXPERT_MLP) : none, mlps ? mlp_views(v, SHARED_MLP) : none, v[SHARED_GATEW]};
}
// the shape of a layer's MLP of Hl hidden units on this rank (the experts', a dense layer's, the shared expert's)
inline MlpShape mlp_shape(const GPTConfig& c, const LocalDims& d, int Hl) { return {d.C, Hl, c.activation()}; }
// what a sparse layer keeps for backward, out of its activations
template <typename floatX>
inline ExpertActivations<floatX> expert_activations(const Activations<floatX>& la, bool split) {
    floatX* none = nullptr;
    return {la.route_logits, la.route_gate, la.route_freq, la.shared_scale, la.route_expert, la.route_row,
            la.moe_in, la.fch, la.fch_act, la.moe_out, la.shared_fch, la.shared_act, la.shared_out,
            split ? la.dfcproj : none, split ? la.dfch : none, split ? la.dshared_out : none,
            split ? la.dshared_fch : none};
}

// Initialization as the table says: zeros, ones, N(0, 0.02), or N(0, 0.02/sqrt(2L)) for the projections into
// the residual stream (GPT-2's; torchtitan's for Llama). A vocab-split tensor draws only the vocab's rows: the
// padding rows stay zero, since no token ever uses them. Drawn in fixed chunks from per-chunk seeds so any
// thread count gives the same weights.
inline void gpt_init_random(const GPTConfig& c, float* params, uint64_t seed) {
    ModelTable table = model_table(c);
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    ParamViews p = param_views(params, sizes);
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        const TensorSpec& spec = table[i];
        float* t = p[i];
        size_t n = sizes[i];
        if (n == 0) continue;  // a tensor the architecture lacks (a dense model's router, a tied Llama's lm_head)
        if (spec.init == Init::Zeros || spec.init == Init::Ones) {
            std::fill(t, t + n, spec.init == Init::Ones ? 1.0f : 0.0f);
            continue;
        }
        float std = spec.init == Init::ResidualNormal ? 0.02f / sqrtf(2.0f * c.num_layers) : 0.02f;
        if (spec.split == TPSplit::Vocab) {
            std::fill(t + (size_t)c.vocab_size * spec.cols, t + n, 0.0f);
            n = (size_t)c.vocab_size * spec.cols;
        }
        constexpr size_t CHUNK = 1 << 20;
        size_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for
        for (size_t k = 0; k < chunks; k++) {
            Rng rng(seed * 1000003ull + (uint64_t)i * 7919ull + k);
            size_t end = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
            for (size_t j = k * CHUNK; j < end; j++) t[j] = rng.normal(0.0f, std);
        }
    }
}

// ----------------------------------------------------------------------------------------------------------
// forward, backward, update

// a unit's parameters and gradients, from the store when there is one
template <typename floatX>
inline ParamViews<floatX> unit_params(GPTModel<floatX>& m, int unit) {
    return m.store ? m.store->params(unit) : unit_views(m.units[unit], m.params, false);
}
template <typename floatX>
inline ParamViews<floatX> unit_grads(GPTModel<floatX>& m, int unit) {
    return m.store ? m.store->grads(unit) : unit_views(m.units[unit], m.grads, false);
}

// the units a pass through chunk `chunk` uses besides the embeddings: [lowest, highest] (the final layernorm's
// is 0, with the model's last chunk), so that a store can fetch them ahead in order
inline std::pair<int, int> chunk_units(const ModelPart& part, int chunk) {
    int L = part.layers(), lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    return {chunk == part.chunks() - 1 ? HEAD_UNIT : layer_unit(L, lo + n - 1), layer_unit(L, lo)};
}

// What a layer's forward starts from: the layer before it in the chunk, whose residual add is fused with this
// layer's first norm, or (null) the chunk's input
template <typename floatX>
struct LayerInput {
    const Activations<floatX>* prev;
    const floatX* chunk_input;
    const floatX* residual() const { return prev ? prev->residual3 : chunk_input; }
};

// The architecture's norm (llmc/model_table.h, llmc/norm.cuh): GPT-2's layernorm keeps a mean and has a bias,
// RMSNorm neither
template <typename floatX>
inline void norm_forward(const GPTConfig& c, floatX* out, float* mean, float* rstd, const floatX* inp,
                         const floatX* weight, const floatX* bias, long rows, long C) {
    norm_forward(c.norm(), out, mean, rstd, inp, weight, bias, rows, (int)C, c.norm_eps);
}
// ... fused with the residual add before it: residual = inp1 + inp2, out = norm(residual)
template <typename floatX>
inline void fused_residual_norm_forward(const GPTConfig& c, floatX* residual, floatX* out, float* mean, float* rstd,
                                        const floatX* inp1, const floatX* inp2, const floatX* weight,
                                        const floatX* bias, long rows, long C) {
    fused_residual_norm_forward(c.norm(), residual, out, mean, rstd, inp1, inp2, weight, bias, rows, (int)C,
                                c.norm_eps);
}
template <typename floatX>
inline void norm_backward(const GPTConfig& c, floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout,
                          const floatX* inp, const floatX* weight, const float* mean, const float* rstd, long rows,
                          long C, Workspace ws) {
    norm_backward(c.norm(), dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, (int)C, ws);
}

// A norm's output for every row, where a matmul reads it (its forward, and its weight gradient in backward).
// Each rank keeps only the R rows it computed: under sp they are gathered into the scratch again each time, as
// Megatron-LM's sequence parallelism does, an all-gather more in backward for the 2·(BT - R)·C values a layer
// would otherwise keep; without sp the rows kept are every row.
template <typename floatX>
inline const floatX* norm_rows(GPTModel<floatX>& m, const floatX* mine, long BT, long C) {
    return m.tp.all_rows(mine, m.scratch.norm_whole, BT, (int)C);
}
// ... in backward: first computed again from the norm's input under -r 2 (the rank's rows, from the saved
// statistics)
template <typename floatX>
inline const floatX* norm_rows_again(GPTModel<floatX>& m, const LocalDims& d, floatX* mine, float* mean, float* rstd,
                                     const floatX* inp, const floatX* weight, const floatX* bias) {
    if (m.recompute >= RECOMPUTE_NORMS) norm_forward(m.config, mine, mean, rstd, inp, weight, bias, d.R, d.C);
    return norm_rows(m, mine, d.BT, d.C);
}

// A sparse layer's mixture of experts (llmc/moe.cuh) in place of its MLP, for either architecture's layer body:
// forward from the norm's output ln2 (every row), and backward from the MLP output's gradient dout
template <typename floatX>
inline void layer_experts_forward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                                  const floatX* ln2, const ParamViews<floatX>& w, MoERoute& route, int layer) {
    const GPTConfig& c = m.config;
    m.moe.forward(la.fcproj, m.scratch.partial, route, expert_activations(la, m.split_backward), ln2, expert_tensors(w),
                  B, d.T, mlp_shape(c, d, d.Hl), mlp_shape(c, d, d.shared_Hl), m.tp, m.cp, layer, m.workspace,
                  fp8_for(m, layer, true), fp8_for(m, layer));
}
template <typename floatX>
inline void layer_experts_backward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                                   const ParamViews<floatX>& w, const ParamViews<floatX>& dw, const MoERoute& route,
                                   const floatX* dout, float dloss, int layer) {
    const GPTConfig& c = m.config;
    Scratch<floatX>& s = m.scratch;
    const floatX* ln2 = norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
    m.moe.backward(s.dln, expert_tensors(dw, !m.split_backward), dout, s.dfch, s.dact, route,
                   expert_activations(la, m.split_backward), ln2, expert_tensors(w), B, d.T, mlp_shape(c, d, d.Hl),
                   mlp_shape(c, d, d.shared_Hl), m.tp, dloss, m.recompute >= RECOMPUTE_ACTIVATION, m.workspace,
                   fp8_for(m, layer, true), fp8_for(m, layer));
}

// One layer, forward, for every architecture, in the order of the Playbook's diagrams: the norm, qkv (NH query
// heads, KV key/value heads), QK-norm on q and k where the architecture has it (Qwen3's, into a buffer of its
// own), RoPE on q and k where positions are rotated, attention, the attention projection,
// the residual add fused with the second norm, the MLP's first matmul and its activation (GELU in the matmul's
// epilogue; SwiGLU after the matmul that holds c_fc and c_fc2), or a mixture of experts behind a router, and
// the MLP projection; the residual add that ends it is fused with the next layer's first norm. A bias is added
// where the table has one (null views otherwise). tp wraps the calls that cross ranks (llmc/tp.cuh), cp
// attention (llmc/cp.cuh).
template <typename floatX>
inline void layer_forward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                          const LayerInput<floatX>& in, const ParamViews<floatX>& w, MoERoute* route, int layer) {
    const GPTConfig& c = m.config;
    TensorParallel& tp = m.tp;
    long BT = d.BT, R = d.R, C = d.C;
    Workspace ws = m.workspace;
    floatX* partial = m.scratch.partial;
    const Fp8Scaling<floatX>* fp8 = fp8_for(m, layer);
    if (!in.prev) norm_forward(c, la.ln1, la.ln1_mean, la.ln1_rstd, in.chunk_input, w[LN1W], w[LN1B], R, C);
    else fused_residual_norm_forward(c, in.prev->residual3, la.ln1, la.ln1_mean, la.ln1_rstd, in.prev->residual2,
                                     in.prev->fcproj, w[LN1W], w[LN1B], R, C);
    matmul_forward(d.qk_norm ? la.qkv_pre : la.qkv, norm_rows(m, la.ln1, BT, C), w[QKVW], w[QKVB], BT, C, d.QKVl, ws,
                   fp8);
    if (d.qk_norm) qk_norm_forward(la.qkv, la.qk_rstd, la.qkv_pre, w[QNORMW], w[KNORMW], BT, d.NHl, d.KVl, d.hd, c.norm_eps);
    if (!c.learned_positions()) rope_forward(la.qkv, m.rope, m.cp.token_positions(), B, d.T, d.NHl, d.KVl, d.hd);
    m.cp.attention_forward(la.atty, la.att, la.qkv, B, d.T, d.Cl, d.NHl, d.KVl, m.attention_kernels);
    tp.row_parallel_forward(la.attproj, partial, la.atty, w[ATTPROJW], w[ATTPROJB], BT, d.Cl, C, ws, fp8);
    fused_residual_norm_forward(c, la.residual2, la.ln2, la.ln2_mean, la.ln2_rstd, in.residual(), la.attproj,
                                w[LN2W], w[LN2B], R, C);
    const floatX* ln2 = norm_rows(m, la.ln2, BT, C);
    if (route) return layer_experts_forward(m, d, B, la, ln2, w, *route, layer);
    // the MLP's partial sums, reduced over the group: fc_proj's bias on tp rank 0 alone, so that the sum adds it once
    MlpTensorViews<floatX> mlp = mlp_views(w, mlp_tensors(c, layer));
    if (tp.spec.rank != 0) mlp.fcprojb = nullptr;
    floatX* sum = tp.spec.sp ? partial : la.fcproj;
    mlp_forward(sum, la.fch, la.fch_act, ln2, mlp, BT, mlp_shape(c, d, d.Hl), ws, fp8);
    tp.reduce_rows(sum, la.fcproj, BT, C);
}

// Runs chunk `chunk` of the model's part on a micro-batch of B×T tokens (B and T at most what the model was
// allocated for), keeping what backward needs in `slot`. The model's first chunk embeds the inputs; any other
// starts from the residual stream a previous stage sent into gpt_chunk_input(). The model's last chunk ends in
// the logits and, with targets, the loss, which it returns (the mean over the rank's tokens; on the GPU reading
// it waits for the forward to finish); any other chunk returns -1 and leaves its output, the residual stream
// after its last layer, in gpt_chunk_output() for the next stage. inputs and targets are the micro-batch's
// whole B×T tokens on every chunk. Training passes dloss, the weight its backward will give each token's loss:
// the last chunk then turns the logits into their gradient in the pass that computes the loss (as llm.c's fused
// classifier), so the logits are read once and written once, and the backward starts from them (0: the logits
// stay, for sampling, scoring and validation).
// Under tensor parallelism every rank of the group calls it with the same tokens; tp wraps the layer calls
// that cross ranks (llmc/tp.cuh), and R = BT/tp rows of the residual stream live on each rank under sp.
// Under context parallelism every rank of the cp group calls it with the same B×T tokens too, and keeps its
// T/cp positions of each sequence (llmc/cp.cuh): only attention and the position embedding see where they are.
template <typename floatX>
inline float gpt_forward_chunk(GPTModel<floatX>& m, int slot, int chunk, const int* inputs, const int* targets, int B,
                               int T, float dloss = 0.0f) {
    if (B > m.B || T > m.T) fail("forward: batch %dx%d exceeds the allocated %dx%d", B, T, m.B, m.T);
    const GPTConfig& c = m.config;
    const ModelPart& part = m.part;
    int Lp = part.layers(), V = c.vocab_size;
    ContextParallel<floatX>& cp = m.cp;
    LocalDims d = model_dims(m, B, T);
    long BT = d.BT, R = d.R, C = d.C, first = m.tp.first_row(BT) * C;
    for (long i = 0; i < (long)B * T; i++) {
        if (inputs[i] < 0 || inputs[i] >= V) fail("forward: input token %d outside the vocab [0, %d)", inputs[i], V);
        if (targets && (targets[i] < 0 || targets[i] >= V))
            fail("forward: target token %d outside the vocab [0, %d)", targets[i], V);
    }
    MicroBatchSlot<floatX>& mb = m.slots[slot];
    bool head = part.head(chunk);
    cp.begin(T);
    cp.select_tokens(mb.inputs.data(), inputs, B, T);
    if (targets) cp.select_tokens(mb.targets.data(), targets, B, T);
    if (part.starts_model(chunk)) device_upload<floatX>(mb.device_inputs, mb.inputs.data(), BT);
    if (head && targets) device_upload<floatX>(mb.device_targets, mb.targets.data(), BT);
    mb.B = B;
    mb.T = T;
    mb.loss = -1.0f;
    mb.dlogits = false;
    Activations<floatX>& a = mb.acts;
    TensorParallel& tp = m.tp;
    Workspace ws = m.workspace;
    floatX* partial = m.scratch.partial;
    NvtxRange pass("forward");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(false, low_unit, high_unit);
    profile_store(m.stored_input);

    if (part.starts_model(chunk)) {  // GPT-2 adds its learned positions; Llama's RoPE turns q and k instead
        ParamViews<floatX> emb = unit_params(m, embedding_unit(Lp));
        const floatX* positions = c.learned_positions() ? cp.position_rows(emb[WPE], C) : nullptr;
        tp.embedding_forward(a.encoded, partial, mb.device_inputs, emb[WTE], positions, B, d.T, C, d.Vl);
    }
    int lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    for (int i = 0; i < n; i++) {
        NvtxRange layer("layer", part.model_layer(lo + i));
        ParamViews<floatX> w = unit_params(m, layer_unit(Lp, lo + i));
        Activations<floatX> la = layer_slice(a, i, d, m.recompute, m.split_backward), prev = layer_slice(a, std::max(i - 1, 0), d, m.recompute, m.split_backward);
        LayerInput<floatX> in{i == 0 ? nullptr : &prev, a.encoded};
        int layer_index = part.model_layer(lo + i);
        MoERoute* route = c.sparse_layer(layer_index) ? &mb.routes[i] : nullptr;
        layer_forward(m, layer_dims(d, c, layer_index), B, la, in, w, route, layer_index);
        profile_store(m.stored_per_layer);
    }
    Activations<floatX> last = layer_slice(a, n - 1, d, m.recompute, m.split_backward);
    if (!head) {
        residual_forward(last.residual3, last.residual2, last.fcproj, R * C);
        if (m.store) m.store->end_pass();
        return -1.0f;
    }
    // the head: the last residual add fused with the final norm, and the classifier (wte when tied)
    ParamViews<floatX> fin = unit_params(m, HEAD_UNIT);
    fused_residual_norm_forward(c, last.residual3, a.lnf + first, a.lnf_mean, a.lnf_rstd, last.residual2, last.fcproj,
                                fin[LNFW], fin[LNFB], R, C);
    tp.gather_rows(a.lnf, BT, C);
    ParamViews<floatX> cls = unit_params(m, classifier_unit(c, Lp));
    matmul_forward(a.logits, a.lnf, cls[classifier_tensor(c)], (const floatX*)nullptr, BT, C, d.Vl, ws);
    profile_store(m.stored_head);
    if (m.store) m.store->end_pass();
    if (!targets) return -1.0f;
    if (tp.on()) {
        mb.loss = tp.crossentropy_forward(a.losses, a.lse, a.logits, mb.device_targets, BT, V, d.Vl, ws);
    } else if (dloss > 0.0f) {  // training: the logits' gradient from the same read of them
        mb.loss = crossentropy_fused(a.losses, a.logits, mb.device_targets, BT, V, c.padded_vocab_size, dloss, ws);
        mb.dlogits = true;
    } else {
        mb.loss = crossentropy_forward(a.losses, a.logits, mb.device_targets, BT, V, c.padded_vocab_size, ws);
    }
    return mb.loss;
}

// the whole model on one micro-batch (a part that is the whole model: no pipeline)
template <typename floatX>
inline float gpt_forward(GPTModel<floatX>& m, const int* inputs, const int* targets, int B, int T,
                         float dloss = 0.0f) {
    if (m.part.chunks() != 1 || !m.part.first || !m.part.last) fail("forward: the model holds a pipeline stage");
    return gpt_forward_chunk(m, 0, 0, inputs, targets, B, T, dloss);
}

// Where a chunk's input arrives from the previous stage, and where its output waits for the next one: the
// residual stream (this rank's R rows of it, R×C). The output buffer, which backward does not read, also takes
// the output's gradient before backward.
template <typename floatX>
inline floatX* gpt_chunk_input(GPTModel<floatX>& m, int slot) { return m.slots[slot].acts.encoded; }
template <typename floatX>
inline floatX* gpt_chunk_output(GPTModel<floatX>& m, int slot, int chunk) {
    const MicroBatchSlot<floatX>& mb = m.slots[slot];
    LocalDims d = model_dims(m, mb.B, mb.T);
    return layer_slice(mb.acts, m.part.chunk_layers[chunk] - 1, d, m.recompute, m.split_backward).residual3;
}

// the logits at position t of sequence b of the last forward through the head (in `slot`), over the whole
// vocab, for sampling: from the cp rank that holds the position, gathered over the tensor-parallel group (a
// collective of both groups)
template <typename floatX>
inline std::vector<float> gpt_logits_row(GPTModel<floatX>& m, int b, int t, int slot = 0) {
    int Vl = vocab_rows(m.config.padded_vocab_size, m.tp.size());
    std::vector<float> mine(Vl), whole((size_t)Vl * m.tp.size());
    const ContextParallel<floatX>& cp = m.cp;
    const MicroBatchSlot<floatX>& mb = m.slots[slot];
    if (cp.on()) {
        int owner = cp.owner(t);
        std::vector<float> held(Vl, 0.0f), every((size_t)Vl * cp.spec.size);
        long row = (long)b * cp.local_tokens(mb.T) + cp.local_index(t);
        if (owner == cp.spec.rank) download_as_float(held.data(), mb.acts.logits + row * Vl, Vl);
        cp.comm->wait(cp.comm->all_gather(held.data(), every.data(), Vl, DType::F32));
        std::copy(every.begin() + (long)owner * Vl, every.begin() + (long)(owner + 1) * Vl, mine.begin());
    } else {
        download_as_float(mine.data(), mb.acts.logits + ((long)b * mb.T + t) * Vl, Vl);
    }
    if (m.tp.on()) m.tp.comm->wait(m.tp.comm->all_gather(mine.data(), whole.data(), Vl, DType::F32));
    else whole = mine;
    whole.resize(m.config.vocab_size);
    return whole;
}

// Each of the B rows of the last forward through the head (in `slot`; it had targets): the sum of its tokens'
// losses where `mask` (B×T, the whole sequences) is 1, on every rank of the cp group (a collective of it), each
// having added the positions it holds. For scoring the completions of a multiple-choice eval (llmc/evals.h).
template <typename floatX>
inline std::vector<double> gpt_row_losses(GPTModel<floatX>& m, const std::vector<int>& mask, int slot = 0) {
    const MicroBatchSlot<floatX>& mb = m.slots[slot];
    if (mb.loss < 0) fail("row losses: the last forward had no targets");
    long local = m.cp.local_tokens(mb.T);
    std::vector<int> mine((size_t)mb.B * local);
    m.cp.select_tokens(mine.data(), mask.data(), mb.B, mb.T);
    std::vector<float> losses(mine.size());
    device_download<floatX>(losses.data(), mb.acts.losses, losses.size());
    std::vector<double> rows(mb.B, 0.0), summed(mb.B);
    for (size_t i = 0; i < mine.size(); i++)
        if (mine[i]) rows[i / local] += losses[i];
    if (!m.cp.on()) return rows;
    m.cp.comm->wait(m.cp.comm->all_reduce(rows.data(), summed.data(), mb.B, DType::F64));
    return summed;
}

template <typename floatX>
inline void gpt_zero_grad(GPTModel<floatX>& m) { device_zero<floatX>(m.grads, m.num_parameters); }

// One layer, backward, for every architecture: the forward's calls in reverse. The scratch's dresidual carries
// the gradient of the residual stream: each branch reads it and adds its input gradient back (the residual add
// passes gradient to both of its inputs unchanged). `residual`: the layer's input. What forward did not keep
// under -r is computed again exactly as forward did, where it is read: the MLPs' activations (-r 1: GELU's
// output, or SwiGLU's product, just before each MLP's backward), the norms' outputs (-r 2: norm_rows_again).
// RoPE's backward turns dq and dk back in place. A split backward (the zero-bubble pipeline) leaves the matmuls'
// weight gradients to gpt_weight_grads_chunk and keeps their output gradients (qkv's before RoPE and
// QK-norm; QK-norm's own weight gradients are taken at once, as the norms').
template <typename floatX>
inline void layer_backward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                           const floatX* residual, const ParamViews<floatX>& w, const ParamViews<floatX>& dw,
                           MoERoute* route, float dloss, int layer) {
    const GPTConfig& c = m.config;
    TensorParallel& tp = m.tp;
    Scratch<floatX>& s = m.scratch;
    long BT = d.BT, R = d.R, C = d.C;
    Workspace ws = m.workspace;
    floatX* dln_rows = tp.spec.sp ? s.dchunk : s.dln;  // a norm output's gradient, reduced to this rank's rows
    floatX* none = nullptr;
    bool split = m.split_backward;
    auto now = [&](floatX* grad) { return split ? nullptr : grad; };
    floatX *dfch = split ? la.dfch : s.dfch, *dqkv = split ? la.dqkv : s.dqkv;
    const Fp8Scaling<floatX>* fp8 = fp8_for(m, layer);

    const floatX* dout = tp.all_rows(s.dresidual, s.whole, BT, C);
    if (route) {
        layer_experts_backward(m, d, B, la, w, dw, *route, dout, dloss, layer);
    } else {  // a split backward keeps the MLP's output gradients and leaves its weight gradients to the W step
        if (split) device_copy<floatX>(la.dfcproj, dout, BT * C);
        MlpShape shape = mlp_shape(c, d, d.Hl);
        MlpTensors mlp = mlp_tensors(c, layer);
        if (m.recompute >= RECOMPUTE_ACTIVATION) mlp_activation_again(la.fch_act, la.fch, BT, shape);
        // the norm's output is read by the weight gradient alone (a split backward's W step reads it there)
        const floatX* ln2 =
            split ? none : norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
        mlp_backward(s.dln, split ? MlpTensorViews<floatX>{} : mlp_views(dw, mlp), dout, dfch, s.dact, la.fch,
                     la.fch_act, ln2, mlp_views(w, mlp), BT, shape, ws, fp8);
    }
    tp.reduce_rows(s.dln, dln_rows, BT, C);
    norm_backward(c, s.dresidual, dw[LN2W], dw[LN2B], dln_rows, la.residual2, w[LN2W], la.ln2_mean, la.ln2_rstd, R, C,
                  ws);
    dout = tp.all_rows(s.dresidual, s.whole, BT, C);
    if (split) device_copy<floatX>(la.dattproj, dout, BT * C);
    matmul_backward(s.datty, now(dw[ATTPROJW]), now(dw[ATTPROJB]), dout, la.atty, w[ATTPROJW], BT, d.Cl, C, ws, fp8);
    m.cp.attention_backward(dqkv, s.datty, la.qkv, la.atty, la.att, B, d.T, d.Cl, d.NHl, d.KVl, s.attention, ws,
                            m.attention_kernels);
    if (!c.learned_positions()) rope_backward(dqkv, m.rope, m.cp.token_positions(), B, d.T, d.NHl, d.KVl, d.hd);
    if (d.qk_norm)
        qk_norm_backward(dqkv, dw[QNORMW], dw[KNORMW], dqkv, la.qkv_pre, w[QNORMW], w[KNORMW], la.qk_rstd, BT, d.NHl,
                         d.KVl, d.hd, ws);
    const floatX* ln1 =
        split ? none : norm_rows_again(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
    matmul_backward(s.dln, now(dw[QKVW]), now(dw[QKVB]), dqkv, ln1, w[QKVW], BT, C, d.QKVl, ws, fp8);
    tp.reduce_rows(s.dln, dln_rows, BT, C);
    norm_backward(c, s.dresidual, dw[LN1W], dw[LN1B], dln_rows, residual, w[LN1W], la.ln1_mean, la.ln1_rstd, R, C, ws);
}

// Accumulates into the gradients the backward of chunk `chunk` for the micro-batch whose forward is in `slot`.
// The model's last chunk starts from the loss (its forward must have had targets): dloss is the weight of
// each token's loss in the objective, 1 / (B·T·micro-batches) for a mean over the global batch (the forward's,
// when the forward was given it and took the logits' gradient already). Any other
// chunk starts from its output's gradient, which the next stage sent into gpt_chunk_output(). Returns where
// the gradient of the chunk's input is, for the previous stage, until the next backward (null for the model's
// first chunk).
template <typename floatX>
inline floatX* gpt_backward_chunk(GPTModel<floatX>& m, int slot, int chunk, float dloss) {
    const GPTConfig& c = m.config;
    const ModelPart& part = m.part;
    MicroBatchSlot<floatX>& mb = m.slots[slot];
    bool head = part.head(chunk);
    if (head && mb.loss < 0) fail("backward: the last forward had no targets");
    int B = mb.B, T = mb.T, Lp = part.layers(), V = c.vocab_size;
    LocalDims d = model_dims(m, B, T);
    long BT = d.BT, R = d.R, C = d.C;
    Activations<floatX>& a = mb.acts;
    Scratch<floatX>& s = m.scratch;
    TensorParallel& tp = m.tp;
    ContextParallel<floatX>& cp = m.cp;
    Workspace ws = m.workspace;
    int lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    // the gradient of a layernorm's output for this rank's rows: the partial sums of every rank, reduced
    floatX* dln_rows = tp.spec.sp ? s.dchunk : s.dln;
    // a unit's gradients are complete here, or after the weight-gradient step of a split backward
    bool split = m.split_backward;
    auto done = [&](int unit) {
        if (m.store && !split) m.store->grads_done(unit);
    };
    NvtxRange pass("backward");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(true, low_unit, high_unit);

    if (head) {
        // the classifier: logits turn into their gradient in place, then through its weight and the final norm
        if (tp.on()) tp.crossentropy_backward_inplace(a.logits, a.lse, mb.device_targets, BT, V, d.Vl, dloss);
        else if (!mb.dlogits) crossentropy_backward_inplace(a.logits, nullptr, mb.device_targets, BT, V, c.padded_vocab_size, dloss);
        int unit = classifier_unit(c, Lp), t = classifier_tensor(c);
        ParamViews<floatX> cls = unit_params(m, unit), dcls = unit_grads(m, unit);
        floatX* dclassifier = s.dwte_micro_step ? s.dwte_micro_step : dcls[t];
        if (s.dwte_micro_step) device_zero<floatX>(dclassifier, (size_t)d.Vl * C);
        matmul_backward(s.dln, dclassifier, (floatX*)nullptr, a.logits, a.lnf, cls[t], BT, C, d.Vl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        device_zero<floatX>(s.dresidual, R * C);
        const floatX* last_residual = layer_slice(a, n - 1, d, m.recompute, m.split_backward).residual3;
        ParamViews<floatX> fin = unit_params(m, HEAD_UNIT), dfin = unit_grads(m, HEAD_UNIT);
        norm_backward(c, s.dresidual, dfin[LNFW], dfin[LNFB], dln_rows, last_residual, fin[LNFW], a.lnf_mean,
                      a.lnf_rstd, R, C, ws);
        profile_release(m.stored_head);  // the logits and the final norm's, read for the last time
    } else {
        device_copy<floatX>(s.dresidual, gpt_chunk_output(m, slot, chunk), R * C);
    }
    // the head's unit goes with the part's last chunk (empty off the model's last stage)
    if (chunk == part.chunks() - 1) done(HEAD_UNIT);

    // dresidual carries the gradient of the residual stream down the layers: each branch reads it and adds
    // its input gradient back (the residual add passes gradient to both of its inputs unchanged)
    for (int i = n - 1; i >= 0; i--) {
        NvtxRange layer("layer", part.model_layer(lo + i));
        Activations<floatX> la = layer_slice(a, i, d, m.recompute, m.split_backward);
        const floatX* residual = i == 0 ? a.encoded : layer_slice(a, i - 1, d, m.recompute, m.split_backward).residual3;
        int unit = layer_unit(Lp, lo + i);
        ParamViews<floatX> w = unit_params(m, unit), dw = unit_grads(m, unit);
        int layer_index = part.model_layer(lo + i);
        MoERoute* route = c.sparse_layer(layer_index) ? &mb.routes[i] : nullptr;
        layer_backward(m, layer_dims(d, c, layer_index), B, la, residual, w, dw, route, dloss, layer_index);
        if (!split) profile_release(m.stored_per_layer);  // a split backward's W step reads them still
        done(unit);
    }
    if (part.starts_model(chunk)) {
        ParamViews<floatX> demb = unit_grads(m, embedding_unit(Lp));
        floatX* dpositions = c.learned_positions() ? cp.position_grads_begin(demb[WPE], C) : nullptr;
        floatX* dwte = s.dwte_micro_step ? s.dwte_micro_step : demb[WTE];
        tp.embedding_backward(dwte, dpositions, s.dresidual, s.whole, mb.device_inputs, B, d.T, C, d.Vl, ws);
        if (s.dwte_micro_step) accumulate(demb[WTE], s.dwte_micro_step, (size_t)d.Vl * C);
        if (dpositions) cp.position_grads_end(demb[WPE], C);
    }
    // the embeddings' unit goes with the part's first chunk, whose backward of a micro-batch comes last: on the
    // last stage its wte gradient, the classifier's, is complete by then too (empty on the middle stages)
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
    if (!split) profile_release(m.stored_input);
    return part.starts_model(chunk) ? nullptr : s.dresidual;
}

// The weight gradients a split backward of chunk `chunk` left for later (the W step of the zero-bubble
// pipeline): the matmuls of each of its layers (a bias gradient where the table has the bias; in a sparse layer
// each expert's and the shared expert's), from the output gradients backward kept and the inputs forward kept
// (computed again where -r does not keep them). The units' gradients are complete after it.
template <typename floatX>
inline void gpt_weight_grads_chunk(GPTModel<floatX>& m, int slot, int chunk) {
    if (!m.split_backward) fail("weight gradients: the model's backward is not split");
    const ModelPart& part = m.part;
    MicroBatchSlot<floatX>& mb = m.slots[slot];
    int Lp = part.layers(), lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    LocalDims d = model_dims(m, mb.B, mb.T);
    long BT = d.BT, C = d.C;
    Workspace ws = m.workspace;
    auto done = [&](int unit) {
        if (m.store) m.store->grads_done(unit);
    };
    NvtxRange pass("weight gradients");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(true, low_unit, high_unit);
    if (chunk == part.chunks() - 1) done(HEAD_UNIT);
    for (int i = n - 1; i >= 0; i--) {
        Activations<floatX> la = layer_slice(mb.acts, i, d, m.recompute, true);
        const floatX* residual = i == 0 ? mb.acts.encoded : layer_slice(mb.acts, i - 1, d, m.recompute, true).residual3;
        int unit = layer_unit(Lp, lo + i);
        ParamViews<floatX> w = unit_params(m, unit), dw = unit_grads(m, unit);
        int layer = part.model_layer(lo + i);
        const GPTConfig& c = m.config;
        const Fp8Scaling<floatX>* fp8 = fp8_for(m, layer);
        bool recompute = m.recompute >= RECOMPUTE_ACTIVATION;
        floatX* none = nullptr;
        const floatX* ln2 = norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
        if (c.sparse_layer(layer)) {
            m.moe.weight_grads(expert_tensors(dw), mb.routes[i], expert_activations(la, true), ln2, expert_tensors(w), BT,
                               mlp_shape(c, d, d.Hl), mlp_shape(c, d, d.shared_Hl), recompute, ws,
                               fp8_for(m, layer, true), fp8);
        } else {
            LocalDims dl = layer_dims(d, c, layer);
            MlpShape shape = mlp_shape(c, dl, dl.Hl);
            MlpTensors mlp = mlp_tensors(c, layer);
            if (recompute) mlp_activation_again(la.fch_act, la.fch, BT, shape);
            mlp_weight_grads(mlp_views(dw, mlp), la.dfcproj, la.dfch, la.fch_act, ln2, mlp_views(w, mlp), BT, shape, ws,
                             fp8);
        }
        matmul_backward(none, dw[ATTPROJW], dw[ATTPROJB], la.dattproj, la.atty, w[ATTPROJW], BT, d.Cl, C, ws, fp8);
        const floatX* ln1 = norm_rows_again(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
        matmul_backward(none, dw[QKVW], dw[QKVB], la.dqkv, ln1, w[QKVW], BT, C, d.QKVl, ws, fp8);
        profile_release(m.stored_per_layer);
        done(unit);
    }
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
    profile_release(m.stored_input);
}

// the backward of the whole model's last forward (a part that is the whole model)
template <typename floatX>
inline void gpt_backward(GPTModel<floatX>& m, float dloss) { gpt_backward_chunk(m, 0, 0, dloss); }

// The gradient norm of a model that holds all of its parameters (one rank; llmc/zero.cuh sums it under any
// parallelism), over the elements its file holds: a Llama's vocab padding rows (zero) are left out of the sum's
// blocks too, so the norm has the bits of the same model laid out without them
template <typename floatX>
inline double gpt_grad_norm(const GPTModel<floatX>& m) {
    if (m.num_parameters != num_parameters(m.config)) fail("gradient norm: the model holds a share of its parameters");
    BufferRanges ranges;
    for (const ShareRun& r : stored_runs(m.config, whole_runs(m.config))) {
        if (!ranges.empty() && ranges.back().first + ranges.back().second == (long)r.local) ranges.back().second += r.count;
        else ranges.push_back({(long)r.local, (long)r.count});
    }
    return sqrt(sum_of_squares(m.grads, ranges, m.workspace));
}

// one AdamW step over every tensor; grad_scale is the clipping factor
template <typename floatX>
inline void gpt_update(GPTModel<floatX>& m, float lr, float weight_decay, float grad_scale) {
    m.adam_step++;
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        size_t n = m.param_sizes[i];
        if (m.table[i].trained)  // (the router's selection bias moves by the loads: gpt_balance_experts)
            adamw_update(m.params + offset, m.master ? m.master + offset : nullptr, m.grads + offset, m.adam_m + offset,
                         m.adam_v + offset, (long)n, lr, m.table[i].decayed ? weight_decay : 0.0f, grad_scale,
                         m.adam_step, m.seed, (long)offset);
        offset += n;
    }
}

// fp32 values of elements [at, at + n) of the flat parameters, where the model keeps them whole: the parameters
// (rounded to nearest on the GPU) and the master weights
template <typename floatX>
inline void gpt_set_values(GPTModel<floatX>& m, size_t at, const float* values, size_t n) {
    if (m.params) upload_from_float(m.params + at, values, n);
    if (m.master) device_upload<floatX>(m.master + at, values, n);
}

// where the selection bias of each of the part's sparse layers lies in the flat buffer: (model layer, offset)
template <typename floatX>
inline std::vector<std::pair<int, size_t>> expert_bias_blocks(const GPTModel<floatX>& m) {
    std::vector<std::pair<int, size_t>> blocks;
    int Lp = m.part.layers();
    for (int l = 0; l < Lp; l++)
        for (const Segment& s : m.units[layer_unit(Lp, l)])
            if (s.tensor == ROUTER_BIAS) blocks.push_back({m.part.model_layer(l), s.offset});
    return blocks;
}
// the routing's copy of the selection biases, from the rank's share of fp32 parameters (after loading them)
template <typename floatX>
inline void gpt_read_expert_bias(GPTModel<floatX>& m, const float* share) {
    int E = m.config.num_experts;
    for (auto [layer, offset] : expert_bias_blocks(m))
        std::copy(share + offset, share + offset + E, m.moe.bias.begin() + (size_t)layer * E);
}
// DeepSeek-V3's balancing after a step: the routing's biases move by the global batch's loads (load: every model
// layer's, summed over the ranks that routed other tokens and the stages), and so do the parameters that hold
// them, through set(offset, values, n) (the model's own copies, or DataParallel's set_values, which also writes
// the shards a rank owns)
template <typename floatX, typename Set>
inline void gpt_balance_experts(GPTModel<floatX>& m, const std::vector<double>& load, Set&& set) {
    m.moe.balance(load);
    int E = m.config.num_experts;
    for (auto [layer, offset] : expert_bias_blocks(m)) set(offset, &m.moe.bias[(size_t)layer * E], (size_t)E);
}

// The parameters of this rank's share, from fp32 values on the host (initialized or read from a file): copied
// on the CPU (unless they are the model's own buffer already); on the GPU the master weights take them exactly
// and the bf16 parameters rounded to nearest.
template <typename floatX>
inline void gpt_set_params(GPTModel<floatX>& m, const float* host) {
    if (m.master) device_upload<floatX>(m.master, host, m.num_parameters);
    upload_from_float(m.params, host, m.num_parameters);
}

// ... and back: the fp32 values the model trains (the master weights where there are any), into host memory
template <typename floatX>
inline void gpt_get_params(const GPTModel<floatX>& m, float* host) {
    if (m.master) device_download<floatX>(host, m.master, m.num_parameters);
    else download_as_float(host, m.params, m.num_parameters);
}

// The GPT-2 model: its configuration, the flat parameter/gradient/optimizer buffers in llm.c's tensor order,
// the activation arena, llm.c-format model files, and forward()/backward()/update() written as explicit layer
// calls. Everything the model owns is allocated through its Ledger.
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
#include <cstdio>
#include <string>
#include <vector>

#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/cp.cuh"
#include "llmc/device.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/model_table.h"
#include "llmc/moe.cuh"
#include "llmc/nvtx.h"
#include "llmc/residual.cuh"
#include "llmc/tp.cuh"
#include "llmc/utils.h"

constexpr int MODEL_MAGIC = 20240326;
constexpr int MODEL_VERSION_FP32 = 3;
constexpr int MODEL_VERSION_BF16 = 5;

inline void validate_config(const GPTConfig& c, const std::string& where) {
    if (c.num_layers < 1 || c.num_heads < 1 || c.channels < 1 || c.max_seq_len < 1 || c.vocab_size < 1)
        fail("%s: every model dimension must be positive", where.c_str());
    if (c.channels % c.num_heads != 0)
        fail("%s: channels (%d) must be divisible by heads (%d)", where.c_str(), c.channels, c.num_heads);
    // bounds far above any real model that keep every size computation inside 64 bits
    if (c.num_layers > 4096 || c.channels > 65536 || c.max_seq_len > (1 << 20) || c.vocab_size > (1 << 24) ||
        c.padded_vocab_size > (1 << 24))
        fail("%s: implausible model shape (L=%d C=%d maxT=%d V=%d Vp=%d)", where.c_str(), c.num_layers, c.channels,
             c.max_seq_len, c.vocab_size, c.padded_vocab_size);
    if (c.padded_vocab_size < c.vocab_size)
        fail("%s: padded vocab %d is smaller than vocab %d", where.c_str(), c.padded_vocab_size, c.vocab_size);
    if (c.num_experts < 1 || c.num_experts > 1024 || c.top_k < 1 || c.top_k > c.num_experts)
        fail("%s: %d experts with top-%d routing: need 1 <= K <= E <= 1024", where.c_str(), c.num_experts, c.top_k);
}

// "d12", "d24", "d36", "d48" are GPT-2 124M, 350M, 774M and 1.5B. Other shapes: d<L>c<C>h<NH>[t<maxT>][v<V>],
// e.g. d4c128h4 (4 layers, 128 channels, 4 heads, maxT 1024, the GPT-2 vocab) or d2c64h2t128v1000. Either form
// may end in e<E>k<K>: a mixture of E experts with top-K routing in every layer (d12e8k2, d2c48h4e4k2); e1k1
// is the dense model.
inline bool is_model_descriptor(const std::string& s) { return s.size() >= 2 && s[0] == 'd' && isdigit(s[1]); }

inline GPTConfig parse_model_descriptor(const std::string& s) {
    GPTConfig c;
    const char* p = s.c_str() + 1;
    auto number = [&](char key) {
        char* end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > (1 << 24)) fail("-e %s: bad number after '%c'", s.c_str(), key);
        p = end;
        return (int)v;
    };
    c.num_layers = number('d');
    bool have_c = false, have_h = false, have_e = false, have_k = false;
    while (*p) {
        char key = *p++;
        switch (key) {
            case 'c': c.channels = number(key), have_c = true; break;
            case 'h': c.num_heads = number(key), have_h = true; break;
            case 't': c.max_seq_len = number(key); break;
            case 'v': c.vocab_size = number(key); break;
            case 'e': c.num_experts = number(key), have_e = true; break;
            case 'k': c.top_k = number(key), have_k = true; break;
            default: fail("-e %s: unknown field '%c' (expected d<L>c<C>h<NH>[t<maxT>][v<V>][e<E>k<K>])", s.c_str(), key);
        }
    }
    if (have_e != have_k) fail("-e %s: experts need both e<E> and k<K>", s.c_str());
    if (!have_c && !have_h) {
        switch (c.num_layers) {
            case 12: c.channels = 768, c.num_heads = 12; break;
            case 24: c.channels = 1024, c.num_heads = 16; break;
            case 36: c.channels = 1280, c.num_heads = 20; break;
            case 48: c.channels = 1600, c.num_heads = 25; break;
            default: fail("-e %s: GPT-2 sizes are d12, d24, d36, d48; give other shapes as d<L>c<C>h<NH>", s.c_str());
        }
    } else if (!have_c || !have_h) {
        fail("-e %s: a custom shape needs c<channels> and h<heads>", s.c_str());
    }
    if (c.top_k > c.num_experts)
        fail("-e %s: top-%d routing needs at least %d experts, not %d", s.c_str(), c.top_k, c.top_k, c.num_experts);
    c.padded_vocab_size = pad_vocab(c.vocab_size);
    validate_config(c, "-e " + s);
    return c;
}

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

// ----------------------------------------------------------------------------------------------------------
// activations: what forward keeps for backward, sized for B×T; per-layer slots are stacked layer 0 first

// the sizes one rank works with: T its tokens of each sequence (T/cp under context parallelism), BT token rows
// in the parallel regions, R rows between them (BT/tp under sequence parallelism), and the rank's share of
// channels, hidden units, heads and vocab rows; ring: attention runs around a cp group
struct LocalDims {
    int B, T, C;
    long BT, R;
    int Cl, Hl, NHl, Vl;
    bool ring;
    int K;             // with experts: the slots per token (0: a dense MLP)
    long expert_rows;  // ... and the rows this rank's experts may see at most (llmc/moe.cuh)
};

inline LocalDims local_dims(const GPTConfig& c, const TPSpec& tp, int B, int T, int cp = 1, int ep = 1) {
    LocalDims d;
    d.B = B, d.T = T / cp, d.C = c.channels, d.ring = cp > 1;
    d.BT = (long)B * d.T;
    d.K = c.moe() ? c.top_k : 0;
    d.expert_rows = c.moe() ? (long)ep * d.BT * std::min(c.top_k, c.num_experts / ep) : 0;
    d.R = tp.sp ? d.BT / tp.size : d.BT;
    d.Cl = c.channels / tp.size, d.Hl = (int)(model_table(c)[FCPROJW].cols / tp.size), d.NHl = c.num_heads / tp.size;
    d.Vl = TensorParallel::vocab_rows(c.padded_vocab_size, tp.size);
    return d;
}

// floatX: the storage type; statistics, losses and attention's saved state are fp32 on both devices
template <typename floatX>
struct Activations {
    floatX *encoded, *ln1;
    float *ln1_mean, *ln1_rstd;
    floatX* qkv;
    float* att;  // attention's saved state: the probabilities on the CPU, the logsumexp on the GPU
    floatX *atty, *attproj, *residual2, *ln2;
    float *ln2_mean, *ln2_rstd;
    floatX *fch, *fch_gelu, *fcproj, *residual3, *lnf;
    float *lnf_mean, *lnf_rstd;
    floatX* logits;
    float *losses, *lse;
    // under a split backward (the zero-bubble pipeline), what the deferred weight gradients read besides the
    // inputs above: the output gradients of the layer's four matmuls
    floatX *dqkv, *dattproj, *dfch, *dfcproj;
    // with experts: the rows they took (expert-major) and the rows they gave back (dispatch order); fch and
    // fch_gelu then hold the experts' rows too
    floatX *moe_in, *moe_out;
};

// Activation recomputation (-r): 0 keeps everything; 1 recomputes GELU's output in backward from its input;
// 2 also recomputes both layernorms' outputs from their inputs (the saved statistics make it cheap). What is
// recomputed is not kept per layer: one buffer, shared by all layers, holds it while it is used.
enum Recompute { RECOMPUTE_NONE = 0, RECOMPUTE_GELU = 1, RECOMPUTE_LAYERNORM = 2 };

// attention's saved state per layer: the T×T probabilities of every head on the CPU, T logsumexps on the GPU
// and around a cp ring
inline size_t attention_state_floats(const LocalDims& d, Device dev) {
    return (size_t)d.NHl * d.B * d.T * (dev == Device::CUDA || d.ring ? 1 : d.T);
}

// An activation slot: its name, where its pointer is, the size of its elements, and the elements it holds for
// one layer (per-layer slots, stacked layer 0 first) or one micro-batch (the others); a per-layer slot that
// -r recomputes from level `recomputed` on holds nothing per layer: one buffer per level, shared by every layer
// and micro-batch, holds it while it is used.
struct ActivationSlot {
    const char* name;
    void** pointer;
    size_t element, count;
    int recomputed = 0;  // the -r level that recomputes it (0: never)
};
template <typename E>
inline ActivationSlot slot(const char* name, E*& p, size_t count, int recomputed = 0) {
    return {name, reinterpret_cast<void**>(&p), sizeof(E), count, recomputed};
}

// Every per-layer activation slot, sized: the layernorm outputs are whole (they enter a column-parallel layer),
// their statistics and the residual stream are the rank's rows, the rest local. The output gradients of the
// four matmuls are kept only under a split backward (the projections' whole: under sp they are gathered before
// the matmul; the MLP's two not for experts, whose weight gradients backward takes at once); with experts the
// rows the experts took (expert-major) and gave back (dispatch order), and the hidden layers the experts' rows.
template <typename floatX>
inline std::vector<ActivationSlot> layer_slots(Activations<floatX>& a, const LocalDims& d, bool split) {
    size_t BT = d.BT, R = d.R, C = d.C, S = split, mlp_rows = d.K ? d.expert_rows : BT, M = split && !d.K;
    return {slot("ln1", a.ln1, BT * C, RECOMPUTE_LAYERNORM), slot("ln1_mean", a.ln1_mean, R), slot("ln1_rstd", a.ln1_rstd, R),
            slot("qkv", a.qkv, BT * 3 * d.Cl), slot("att", a.att, attention_state_floats(d, device_of<floatX>)),
            slot("atty", a.atty, BT * d.Cl), slot("attproj", a.attproj, R * C), slot("residual2", a.residual2, R * C),
            slot("ln2", a.ln2, BT * C, RECOMPUTE_LAYERNORM), slot("ln2_mean", a.ln2_mean, R), slot("ln2_rstd", a.ln2_rstd, R),
            slot("fch", a.fch, mlp_rows * d.Hl), slot("fch_gelu", a.fch_gelu, mlp_rows * d.Hl, RECOMPUTE_GELU),
            slot("fcproj", a.fcproj, R * C), slot("residual3", a.residual3, R * C), slot("dqkv", a.dqkv, S * BT * 3 * d.Cl),
            slot("dattproj", a.dattproj, S * BT * C), slot("dfch", a.dfch, M * BT * d.Hl), slot("dfcproj", a.dfcproj, M * BT * C),
            slot("moe_in", a.moe_in, d.expert_rows * C), slot("moe_out", a.moe_out, d.K * BT * C)};
}

// ... and the slots of a micro-batch around the layers: the embeddings' output (where a previous stage's
// activations arrive), and on the last stage the head's: the final layernorm (its output whole, its statistics
// on the rank's rows), the rank's logits, the per-token losses and, under tp, their log-sum-exp
template <typename floatX>
inline std::vector<ActivationSlot> edge_slots(Activations<floatX>& a, const LocalDims& d, bool head, int tp) {
    size_t BT = d.BT, R = d.R, C = d.C;
    std::vector<ActivationSlot> slots = {slot("encoded", a.encoded, R * C)};
    if (!head) return slots;
    for (ActivationSlot s : {slot("lnf", a.lnf, BT * C), slot("lnf_mean", a.lnf_mean, R), slot("lnf_rstd", a.lnf_rstd, R),
                             slot("logits", a.logits, BT * d.Vl), slot("losses", a.losses, BT)})
        slots.push_back(s);
    if (tp > 1) slots.push_back(slot("lse", a.lse, BT));
    return slots;
}

// what a slot keeps per layer under recomputation level `recompute`
inline size_t kept_per_layer(const ActivationSlot& s, int recompute) {
    return s.recomputed && recompute >= s.recomputed ? 0 : s.count;
}

// the slot whose size the shared buffer of recomputation level `level` takes: the level's largest (null: none)
inline const ActivationSlot* recomputed_slot(const std::vector<ActivationSlot>& per_layer, int level) {
    const ActivationSlot* largest = nullptr;
    for (const ActivationSlot& s : per_layer)
        if (s.recomputed == level && (!largest || s.count > largest->count)) largest = &s;
    return largest;
}

// The bytes of a micro-batch's activations in the storage type floatX: what each layer keeps, what the slots
// around the layers hold, and the shared buffers of the slots -r recomputes. The plan's figures (llmc/plan.h).
struct ActivationBytes {
    size_t per_layer = 0, edges = 0, recomputed = 0;
};
template <typename floatX>
inline ActivationBytes activation_bytes(const LocalDims& d, bool split, int recompute, bool head, int tp) {
    Activations<floatX> a{};
    ActivationBytes b;
    std::vector<ActivationSlot> per_layer = layer_slots(a, d, split);
    for (const ActivationSlot& s : per_layer) b.per_layer += kept_per_layer(s, recompute) * s.element;
    for (const ActivationSlot& s : edge_slots(a, d, head, tp)) b.edges += s.count * s.element;
    for (int level = RECOMPUTE_GELU; level <= recompute; level++)
        if (const ActivationSlot* s = recomputed_slot(per_layer, level)) b.recomputed += s->count * s->element;
    return b;
}

// layer l's slice of every per-layer activation slot (stacked layer 0 first); the other fields unchanged
template <typename floatX>
inline Activations<floatX> layer_slice(const Activations<floatX>& a, int l, const LocalDims& d, int recompute,
                                       bool split) {
    Activations<floatX> v = a;
    for (const ActivationSlot& s : layer_slots(v, d, split))
        *s.pointer = static_cast<char*>(*s.pointer) + l * kept_per_layer(s, recompute) * s.element;
    return v;
}

// buffers that live only inside backward (activation gradients), plus the kernels' workspaces (on the CPU the
// GEMM's packing panels and attention's rows per thread; on the GPU the shared kernel scratch of
// llmc/device.cuh); under tensor parallelism also the partial sums of row-parallel outputs, and under sequence
// parallelism the gathered output gradients and the reduced input gradients
template <typename floatX>
struct Scratch {
    floatX *dresidual, *dln, *dqkv, *datty, *dfch;
    float *attention, *gemm;
    floatX *partial, *gather, *whole, *dchunk;
};

// the fp32 scratch the GPU kernels of one rank's forward and backward need at most (llmc/device.cuh)
inline size_t gpu_kernel_scratch_floats(const LocalDims& d) {
    size_t need = (size_t)layernorm_backward_scratch_floats(d.R, d.C);
    for (long oc : {3L * d.Cl, (long)d.C, (long)d.Hl})  // the matmuls with a bias gradient (an expert's: all its rows)
        need = std::max(need, (size_t)matmul_backward_scratch_floats(std::max(d.BT, d.expert_rows), oc));
    need = std::max(need, attention_backward_scratch_floats(d.B, d.T, d.Cl, d.NHl));
    // CUB sizes the encoder's sort only on a GPU; a plan made without one takes its usual need: keys, positions
    // and their sorted copies (4·BT int32 at most), the runs (BT + V), and the sort's own buffers and histograms
    // (2·BT int32 + 64 KiB)
    size_t sort_bytes = cuda_device_available() ? encoder_backward_scratch_bytes(d.B, d.T, d.Vl)
                                                : (7 * d.BT + d.Vl) * sizeof(int) + 65536;
    need = std::max(need, (sort_bytes + 3) / 4);
    return std::max(need, (size_t)GLOBAL_NORM_BLOCKS + 1);
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
    Scratch<floatX> scratch;

    GPTModel() = default;
    GPTModel(const GPTModel&) = delete;
    GPTModel& operator=(const GPTModel&) = delete;
    ~GPTModel() {
        GpuScratch& registered = gpu_scratch_registry();
        if (device_of<floatX> == Device::CUDA && registered.floats == scratch.gemm) registered = GpuScratch{};
    }
};
using GPT = GPTModel<float>;
using GPTCuda = GPTModel<bf16>;

// that the model and its sequences of T tokens split over tp × cp ranks as asked, or one line naming the flag
// that does not fit
inline void check_split(const GPTConfig& config, int T, const TPSpec& tp, const CPSpec& cp) {
    validate_config(config, "model");
    if (T > config.max_seq_len) fail("-t %d: longer than the model's maximum sequence length %d", T, config.max_seq_len);
    if (config.num_heads % tp.size != 0)
        fail("--tp %d: must divide the number of heads (%d)", tp.size, config.num_heads);
    if (cp.size > 1) cp_layout(T, cp.size, cp.rank, cp.split);  // T splits into 2·cp chunks
    if (tp.sp && cp.size == 1 && T % tp.size != 0)
        fail("--sp 1: the sequence length -t %d must be divisible by --tp %d (each rank keeps T/tp positions)", T, tp.size);
    if (tp.sp && (T / cp.size) % tp.size != 0)
        fail("--sp 1: the %d tokens of a sequence on each cp rank (-t %d / --cp %d) must be divisible by --tp %d", T / cp.size,
             T, cp.size, tp.size);
}

// which of the model states the model allocates itself; ZeRO allocates the rest as shards
struct ModelBuffers {
    bool params = true, grads = true, optimizer = true;
};

// Allocates the model's part (all of it by default) for micro-batches of up to B×T tokens, with `slots`
// micro-batches in flight, and what a split backward keeps for its weight gradients when asked to
template <typename floatX>
inline void gpt_allocate(GPTModel<floatX>& m, const GPTConfig& config, int B, int T, ModelBuffers own = {}, TPSpec tp = {},
                         int recompute = RECOMPUTE_NONE, CPSpec cp = {}, ModelPart part = {}, int slots = 1,
                         bool split_backward = false, int ep = 1) {
    constexpr bool gpu = device_of<floatX> == Device::CUDA;
    check_split(config, T, tp, cp);
    if (config.num_experts % ep != 0)
        fail("--ep %d: must divide the number of experts (%d)", ep, config.num_experts);
    if (part.chunks() == 0) part = whole_part(config);
    m.cp.spec = cp;
    int head_size = config.channels / config.num_heads;
    if (gpu && head_size != 64 && head_size != 128)
        fail("model: head size %d (channels / heads): the GPU attention kernels take 64 or 128", head_size);
    m.config = config;
    m.table = model_table(config);
    m.B = B;
    m.T = T;
    m.tp.spec = tp;
    m.part = part;
    m.recompute = recompute;
    m.split_backward = split_backward;
    param_tensor_sizes(config, m.param_sizes, tp.size, part, ep);
    m.num_parameters = num_parameters(config, tp.size, part, ep);
    Ledger& led = m.ledger;
    if (own.params) m.params = led.alloc<floatX, floatX>(MEM_PARAMS, m.num_parameters);
    if (own.grads) m.grads = led.alloc<floatX, floatX>(MEM_GRADS, m.num_parameters);
    if (own.optimizer) {
        if (gpu) m.master = led.alloc<floatX, float>(MEM_MASTER_WEIGHTS, m.num_parameters);
        m.adam_m = led.alloc<floatX, float>(MEM_OPTIMIZER, m.num_parameters);
        m.adam_v = led.alloc<floatX, float>(MEM_OPTIMIZER, m.num_parameters);
    }
    for (int u = 0; u < num_units(part.layers()); u++) m.units.push_back(unit_segments(config, u, tp.size, part, ep));

    LocalDims d = local_dims(config, tp, B, T, cp.size, ep);
    size_t mlp_rows = config.moe() ? d.expert_rows : d.BT;
    size_t C = config.channels, BT = d.BT, R = d.R;
    size_t chunk_layers = *std::max_element(part.chunk_layers.begin(), part.chunk_layers.end());
    // a slot's buffer in its element type (on the CPU every slot is fp32)
    auto act = [&](const ActivationSlot& s, size_t n) {
        *s.pointer = s.element == sizeof(float) ? (void*)led.alloc<floatX, float>(MEM_ACTIVATIONS, n)
                                                : (void*)led.alloc<floatX, floatX>(MEM_ACTIVATIONS, n);
    };
    // a recomputed slot is one buffer per level for every layer of every micro-batch (layer_slice steps through
    // it by 0), as large as the level's largest slot
    void* recomputed_buffer[RECOMPUTE_LAYERNORM + 1] = {};
    Activations<floatX> sizing{};
    std::vector<ActivationSlot> per_layer = layer_slots(sizing, d, split_backward);
    for (int level = RECOMPUTE_GELU; level <= recompute; level++)
        if (const ActivationSlot* s = recomputed_slot(per_layer, level)) act(*s, s->count), recomputed_buffer[level] = *s->pointer;
    m.slots.resize(slots);
    for (MicroBatchSlot<floatX>& mb : m.slots) {
        Activations<floatX>& a = mb.acts;
        std::vector<ActivationSlot> edges = edge_slots(a, d, part.last, tp.size);
        act(edges[0], edges[0].count);  // the embeddings' output
        for (const ActivationSlot& s : layer_slots(a, d, split_backward)) {
            act(s, chunk_layers * kept_per_layer(s, recompute));
            if (s.recomputed && recompute >= s.recomputed) *s.pointer = recomputed_buffer[s.recomputed];
        }
        for (size_t i = 1; i < edges.size(); i++) act(edges[i], edges[i].count);
        mb.inputs.assign(BT, 0);
        mb.targets.assign(BT, 0);
        mb.routes.resize(config.moe() ? chunk_layers : 0);
        if (gpu) {
            mb.device_inputs = led.alloc<floatX, int>(MEM_ACTIVATIONS, BT);
            mb.device_targets = led.alloc<floatX, int>(MEM_ACTIVATIONS, BT);
        } else {
            mb.device_inputs = mb.inputs.data();
            mb.device_targets = mb.targets.data();
        }
    }

    Scratch<floatX>& s = m.scratch;
    int threads = omp_get_max_threads();
    auto scr = [&](size_t n) { return led.alloc<floatX, floatX>(MEM_SCRATCH, n); };
    s.dresidual = scr(R * C);
    s.dln = scr(BT * C);
    s.dqkv = scr(BT * 3 * d.Cl);
    s.datty = scr(BT * d.Cl);
    s.dfch = scr(mlp_rows * d.Hl);
    if (gpu) {
        size_t floats = gpu_kernel_scratch_floats(d);
        s.attention = nullptr;
        s.gemm = led.alloc<floatX, float>(MEM_SCRATCH, floats);
        gpu_scratch_registry() = GpuScratch{s.gemm, floats};
    } else {
        s.attention = led.alloc<floatX, float>(MEM_SCRATCH, (size_t)threads * d.T);
        s.gemm = led.alloc<floatX, float>(MEM_SCRATCH, gemm_workspace_floats(threads));
    }
    s.partial = tp.size > 1 ? scr(BT * C) : nullptr;
    s.gather = tp.size > 1 ? scr(BT * C / tp.size) : nullptr;
    s.whole = tp.sp ? scr(BT * C) : nullptr;
    s.dchunk = tp.sp ? scr(R * C) : nullptr;
    m.tp.gather = s.gather;
    m.cp.allocate(led, B, T, (int)C, d.Cl, d.NHl);
    m.moe.ep_size = ep;
    m.moe.allocate(led, config.num_experts, config.top_k, config.num_layers, BT, (int)C);
}

// the sizes the model works with on a micro-batch of B×T tokens
template <typename floatX>
inline LocalDims model_dims(const GPTModel<floatX>& m, int B, int T) {
    return local_dims(m.config, m.tp.spec, B, T, m.cp.spec.size, m.moe.ep_size);
}

// a layer's router and experts, out of its unit's tensors
template <typename floatX>
inline ExpertTensors<floatX> expert_tensors(const ParamViews<floatX>& v) {
    return {v[ROUTERW], v[FCW], v[FCB], v[FCPROJW], v[FCPROJB]};
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
// llm.c model files: 256 int32 header, then the parameters in order, fp32 (version 3) or bf16 (version 5)

inline GPTConfig read_model_header(const std::string& path, int* version) {
    File f(path, "rb");
    int h[256];
    if (f.size() < (long)sizeof(h)) fail("%s: too short for a model header", path.c_str());
    f.read(h, sizeof(h));
    if (h[0] != MODEL_MAGIC) fail("%s: not an llm.c model file (magic %d, expected %d)", path.c_str(), h[0], MODEL_MAGIC);
    if (h[1] != MODEL_VERSION_FP32 && h[1] != MODEL_VERSION_BF16)
        fail("%s: unsupported model version %d (expected 3 for fp32 or 5 for bf16)", path.c_str(), h[1]);
    GPTConfig c;
    c.max_seq_len = h[2];
    c.vocab_size = h[3];
    c.num_layers = h[4];
    c.num_heads = h[5];
    c.channels = h[6];
    c.padded_vocab_size = h[7];
    // header[8] and [9]: the experts and their top-K (0 and 0 in llm.c's dense files)
    if (h[8] > 1 || h[9] > 1) c.num_experts = h[8], c.top_k = h[9];
    else if (h[8] != h[9]) fail("%s: header says %d experts with top-%d routing", path.c_str(), h[8], h[9]);
    validate_config(c, path);
    long expected = (long)sizeof(h) + (long)(num_parameters(c) * (h[1] == MODEL_VERSION_FP32 ? 4 : 2));
    if (f.size() != expected)
        fail("%s: size %ld bytes, but its header implies %ld", path.c_str(), f.size(), expected);
    *version = h[1];
    return c;
}

// the index of the first NaN or Inf among n floats, or n when every one is finite
inline size_t first_non_finite(const float* x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!std::isfinite(x[i])) return i;
    return n;
}

// Reads the runs of the parameters that a rank holds (`runs`: where each run of `params` lies in the whole model)
// from a model file whose header matches mc, fp32 or bf16. A NaN or Inf is refused, naming the tensor, since
// training from it could only produce NaN.
inline void gpt_read_params(const GPTConfig& mc, float* params, const std::vector<ShareRun>& runs, const std::string& path) {
    int version;
    GPTConfig c = read_model_header(path, &version);
    if (c.num_layers != mc.num_layers || c.channels != mc.channels || c.num_heads != mc.num_heads ||
        c.vocab_size != mc.vocab_size || c.padded_vocab_size != mc.padded_vocab_size || c.max_seq_len != mc.max_seq_len ||
        c.num_experts != mc.num_experts || c.top_k != mc.top_k)
        fail("%s: model shape differs from the run's model", path.c_str());
    File f(path, "rb");
    std::vector<uint16_t> halves;
    for (const ShareRun& r : runs) {
        float* dst = params + r.local;
        if (version == MODEL_VERSION_FP32) {
            f.read_at(dst, r.count * 4, 1024 + (long)r.whole * 4);
        } else {
            halves.resize(r.count);
            f.read_at(halves.data(), r.count * 2, 1024 + (long)r.whole * 2);
            for (size_t i = 0; i < r.count; i++) {
                uint32_t bits = (uint32_t)halves[i] << 16;  // bf16 is the top half of an fp32
                memcpy(&dst[i], &bits, 4);
            }
        }
        size_t bad = first_non_finite(dst, r.count);
        if (bad < r.count)
            fail("%s: %g in %s (a model must be finite)", path.c_str(), dst[bad], describe_param(c, r.whole + bad).c_str());
    }
}

// reads a whole model file into params (a flat buffer)
inline void gpt_load_params(const GPTConfig& mc, float* params, const std::string& path) {
    gpt_read_params(mc, params, whole_runs(mc), path);
}

// writes an llm.c model file from a flat parameter buffer: fp32 (version 3), or bf16 (version 5) rounded to
// nearest even; returns the checksum of the bytes written
inline uint64_t gpt_save_params(const GPTConfig& c, const float* params, const std::string& path,
                                int version = MODEL_VERSION_FP32) {
    int h[256] = {};
    h[0] = MODEL_MAGIC;
    h[1] = version;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    h[6] = c.channels;
    h[7] = c.padded_vocab_size;
    if (c.moe()) h[8] = c.num_experts, h[9] = c.top_k;  // a dense file stays llm.c's, byte for byte
    File f(path, "wb");
    size_t count = num_parameters(c);
    f.write(h, sizeof(h));
    if (version == MODEL_VERSION_FP32) {
        f.write(params, count * 4);
    } else {
        std::vector<uint16_t> halves(1 << 20);
        for (size_t done = 0; done < count; done += halves.size()) {
            size_t n = std::min(halves.size(), count - done);
            for (size_t i = 0; i < n; i++) {
                uint32_t bits;
                memcpy(&bits, &params[done + i], 4);
                halves[i] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
            }
            f.write(halves.data(), n * 2);
        }
    }
    f.close();
    return f.written.value;
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
    return {chunk == part.chunks() - 1 ? FINAL_NORM_UNIT : layer_unit(L, lo + n - 1), layer_unit(L, lo)};
}

// Runs chunk `chunk` of the model's part on a micro-batch of B×T tokens (B and T at most what the model was
// allocated for), keeping what backward needs in `slot`. The model's first chunk embeds the inputs; any other
// starts from the residual stream a previous stage sent into gpt_chunk_input(). The model's last chunk ends in
// the logits and, with targets, the loss, which it returns (the mean over the rank's tokens; on the GPU reading
// it waits for the forward to finish); any other chunk returns -1 and leaves its output, the residual stream
// after its last layer, in gpt_chunk_output() for the next stage. inputs and targets are the micro-batch's
// whole B×T tokens on every chunk.
// Under tensor parallelism every rank of the group calls it with the same tokens; tp wraps the layer calls
// that cross ranks (llmc/tp.cuh), and R = BT/tp rows of the residual stream live on each rank under sp.
// Under context parallelism every rank of the cp group calls it with the same B×T tokens too, and keeps its
// T/cp positions of each sequence (llmc/cp.cuh): only attention and the position embedding see where they are.
template <typename floatX>
inline float gpt_forward_chunk(GPTModel<floatX>& m, int slot, int chunk, const int* inputs, const int* targets, int B,
                               int T) {
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
    Activations<floatX>& a = mb.acts;
    TensorParallel& tp = m.tp;
    float* ws = m.scratch.gemm;
    floatX* partial = m.scratch.partial;
    NvtxRange pass("forward");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(false, low_unit, high_unit);

    if (part.starts_model(chunk)) {
        ParamViews<floatX> emb = unit_params(m, embedding_unit(Lp));
        tp.embedding_forward(a.encoded, partial, mb.device_inputs, emb[WTE], cp.position_rows(emb[WPE], C), B, d.T, C,
                             d.Vl);
    }
    int lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    for (int i = 0; i < n; i++) {
        NvtxRange layer("layer", part.model_layer(lo + i));
        ParamViews<floatX> w = unit_params(m, layer_unit(Lp, lo + i));
        Activations<floatX> la = layer_slice(a, i, d, m.recompute, m.split_backward), prev = layer_slice(a, std::max(i - 1, 0), d, m.recompute, m.split_backward);
        // the residual add that ends the previous layer is fused with the layernorm that begins this one
        if (i == 0) layernorm_forward(la.ln1 + first, la.ln1_mean, la.ln1_rstd, a.encoded, w[LN1W], w[LN1B], R, C);
        else fused_residual_layernorm_forward(prev.residual3, la.ln1 + first, la.ln1_mean, la.ln1_rstd, prev.residual2,
                                              prev.fcproj, w[LN1W], w[LN1B], R, C);
        const floatX* residual = i == 0 ? a.encoded : prev.residual3;
        tp.gather_rows(la.ln1, BT, C);
        matmul_forward(la.qkv, la.ln1, w[QKVW], w[QKVB], BT, C, 3 * d.Cl, ws);
        cp.attention_forward(la.atty, la.att, la.qkv, B, d.T, d.Cl, d.NHl);
        tp.row_parallel_forward(la.attproj, partial, la.atty, w[ATTPROJW], w[ATTPROJB], BT, d.Cl, C, ws);
        fused_residual_layernorm_forward(la.residual2, la.ln2 + first, la.ln2_mean, la.ln2_rstd, residual, la.attproj,
                                         w[LN2W], w[LN2B], R, C);
        tp.gather_rows(la.ln2, BT, C);
        if (c.moe()) {
            m.moe.forward(la.fcproj, partial, mb.routes[i], la.moe_in, la.fch, la.fch_gelu, la.moe_out, la.ln2,
                          expert_tensors(w), B, d.T, (int)C, d.Hl, tp, cp, part.model_layer(lo + i), ws);
        } else {
            matmul_gelu_forward(la.fch_gelu, la.fch, la.ln2, w[FCW], w[FCB], BT, C, d.Hl, ws);
            tp.row_parallel_forward(la.fcproj, partial, la.fch_gelu, w[FCPROJW], w[FCPROJB], BT, d.Hl, C, ws);
        }
    }
    Activations<floatX> last = layer_slice(a, n - 1, d, m.recompute, m.split_backward);
    if (!head) {
        residual_forward(last.residual3, last.residual2, last.fcproj, R * C);
        if (m.store) m.store->end_pass();
        return -1.0f;
    }
    ParamViews<floatX> fin = unit_params(m, FINAL_NORM_UNIT);
    fused_residual_layernorm_forward(last.residual3, a.lnf + first, a.lnf_mean, a.lnf_rstd, last.residual2, last.fcproj,
                                     fin[LNFW], fin[LNFB], R, C);
    tp.gather_rows(a.lnf, BT, C);
    ParamViews<floatX> emb = unit_params(m, embedding_unit(Lp));
    matmul_forward(a.logits, a.lnf, emb[WTE], (const floatX*)nullptr, BT, C, d.Vl, ws);
    if (m.store) m.store->end_pass();
    if (!targets) return -1.0f;
    mb.loss = tp.on() ? tp.crossentropy_forward(a.losses, a.lse, a.logits, mb.device_targets, BT, V, d.Vl)
                      : crossentropy_forward(a.losses, a.logits, mb.device_targets, BT, V, c.padded_vocab_size);
    return mb.loss;
}

// the whole model on one micro-batch (a part that is the whole model: no pipeline)
template <typename floatX>
inline float gpt_forward(GPTModel<floatX>& m, const int* inputs, const int* targets, int B, int T) {
    if (m.part.chunks() != 1 || !m.part.first || !m.part.last) fail("forward: the model holds a pipeline stage");
    return gpt_forward_chunk(m, 0, 0, inputs, targets, B, T);
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
    int Vl = TensorParallel::vocab_rows(m.config.padded_vocab_size, m.tp.size());
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

// What forward did not keep under -r, computed again exactly as forward did (and gathered again under sp) where
// a layer's backward or its weight-gradient step reads it: GELU's output (-r 1), the layernorms' (-r 2)
template <typename floatX>
inline void recompute_gelu(GPTModel<floatX>& m, const Activations<floatX>& la, const LocalDims& d, long rows) {
    if (m.recompute >= RECOMPUTE_GELU) gelu_forward(la.fch_gelu, la.fch, rows * d.Hl);
}
template <typename floatX>
inline void recompute_layernorm(GPTModel<floatX>& m, const LocalDims& d, floatX* out, float* mean, float* rstd,
                                const floatX* inp, const floatX* weight, const floatX* bias) {
    if (m.recompute < RECOMPUTE_LAYERNORM) return;
    layernorm_forward(out + m.tp.first_row(d.BT) * d.C, mean, rstd, inp, weight, bias, d.R, d.C);
    m.tp.gather_rows(out, d.BT, d.C);
}

template <typename floatX>
inline void gpt_zero_grad(GPTModel<floatX>& m) { device_zero<floatX>(m.grads, m.num_parameters); }

// Accumulates into the gradients the backward of chunk `chunk` for the micro-batch whose forward is in `slot`.
// The model's last chunk starts from the loss (its forward must have had targets): dloss is the weight of
// each token's loss in the objective, 1 / (B·T·micro-batches) for a mean over the global batch. Any other
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
    float* ws = s.gemm;
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
        // the classifier: logits turn into their gradient in place, then through the tied wte and the final norm
        if (tp.on()) tp.crossentropy_backward_inplace(a.logits, a.lse, mb.device_targets, BT, V, d.Vl, dloss);
        else crossentropy_backward_inplace(a.logits, mb.device_targets, BT, V, c.padded_vocab_size, dloss);
        ParamViews<floatX> emb = unit_params(m, embedding_unit(Lp)), demb = unit_grads(m, embedding_unit(Lp));
        matmul_backward(s.dln, demb[WTE], (floatX*)nullptr, a.logits, a.lnf, emb[WTE], BT, C, d.Vl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        device_zero<floatX>(s.dresidual, R * C);
        const floatX* last_residual = layer_slice(a, n - 1, d, m.recompute, m.split_backward).residual3;
        ParamViews<floatX> fin = unit_params(m, FINAL_NORM_UNIT), dfin = unit_grads(m, FINAL_NORM_UNIT);
        layernorm_backward(s.dresidual, dfin[LNFW], dfin[LNFB], dln_rows, last_residual, fin[LNFW], a.lnf_mean,
                           a.lnf_rstd, R, C);
    } else {
        device_copy<floatX>(s.dresidual, gpt_chunk_output(m, slot, chunk), R * C);
    }
    // the final layernorm's unit goes with the part's last chunk (empty off the model's last stage)
    if (chunk == part.chunks() - 1) done(FINAL_NORM_UNIT);

    // dresidual carries the gradient of the residual stream down the layers: each branch reads it and adds
    // its input gradient back (the residual add passes gradient to both of its inputs unchanged)
    for (int i = n - 1; i >= 0; i--) {
        NvtxRange layer("layer", part.model_layer(lo + i));
        Activations<floatX> la = layer_slice(a, i, d, m.recompute, m.split_backward);
        const floatX* residual = i == 0 ? a.encoded : layer_slice(a, i - 1, d, m.recompute, m.split_backward).residual3;
        int unit = layer_unit(Lp, lo + i);
        ParamViews<floatX> w = unit_params(m, unit), dw = unit_grads(m, unit);
        recompute_gelu(m, la, d, c.moe() ? mb.routes[i].rows : BT);
        // a split backward leaves the matmuls' weight gradients for later and keeps their output gradients
        auto now = [&](floatX* grad) { return split ? nullptr : grad; };
        floatX *dfch = split ? la.dfch : s.dfch, *dqkv = split ? la.dqkv : s.dqkv;

        const floatX* dout = tp.row_parallel_dout(s.dresidual, s.whole, BT, C);
        if (c.moe()) {
            recompute_layernorm(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
            m.moe.backward(s.dln, expert_tensors(dw), dout, s.dfch, mb.routes[i], la.moe_in, la.fch, la.fch_gelu,
                           la.moe_out, la.ln2, expert_tensors(w), B, d.T, (int)C, d.Hl, tp, dloss, ws);
        } else {
            if (split) device_copy<floatX>(la.dfcproj, dout, BT * C);
            matmul_backward(dfch, now(dw[FCPROJW]), now(dw[FCPROJB]), dout, la.fch_gelu, w[FCPROJW], BT, d.Hl, C, ws);
            gelu_backward(dfch, la.fch, dfch, BT * d.Hl);
            recompute_layernorm(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
            matmul_backward(s.dln, now(dw[FCW]), now(dw[FCB]), dfch, la.ln2, w[FCW], BT, C, d.Hl, ws);
        }
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        layernorm_backward(s.dresidual, dw[LN2W], dw[LN2B], dln_rows, la.residual2, w[LN2W], la.ln2_mean, la.ln2_rstd, R, C);
        dout = tp.row_parallel_dout(s.dresidual, s.whole, BT, C);
        if (split) device_copy<floatX>(la.dattproj, dout, BT * C);
        matmul_backward(s.datty, now(dw[ATTPROJW]), now(dw[ATTPROJB]), dout, la.atty, w[ATTPROJW], BT, d.Cl, C, ws);
        cp.attention_backward(dqkv, s.datty, la.qkv, la.atty, la.att, B, d.T, d.Cl, d.NHl, s.attention);
        recompute_layernorm(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
        matmul_backward(s.dln, now(dw[QKVW]), now(dw[QKVB]), dqkv, la.ln1, w[QKVW], BT, C, 3 * d.Cl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        layernorm_backward(s.dresidual, dw[LN1W], dw[LN1B], dln_rows, residual, w[LN1W], la.ln1_mean, la.ln1_rstd, R, C);
        done(unit);
    }
    if (part.starts_model(chunk)) {
        ParamViews<floatX> demb = unit_grads(m, embedding_unit(Lp));
        tp.embedding_backward(demb[WTE], cp.position_grads_begin(demb[WPE], C), s.dresidual, s.whole, mb.device_inputs,
                              B, d.T, C, d.Vl);
        cp.position_grads_end(demb[WPE], C);
    }
    // the embeddings' unit goes with the part's first chunk, whose backward of a micro-batch comes last: on the
    // last stage its wte gradient, the classifier's, is complete by then too (empty on the middle stages)
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
    return part.starts_model(chunk) ? nullptr : s.dresidual;
}

// The weight gradients a split backward of chunk `chunk` left for later (the W step of the zero-bubble
// pipeline): the four matmuls of each of its layers, from the output gradients backward kept and the inputs
// forward kept (computed again where -r does not keep them). The units' gradients are complete after it. With
// experts it is attention's two: an expert's matmuls see a different number of rows in every micro-batch, and
// backward takes their weight gradients at once rather than keep their output gradients.
template <typename floatX>
inline void gpt_weight_grads_chunk(GPTModel<floatX>& m, int slot, int chunk) {
    if (!m.split_backward) fail("weight gradients: the model's backward is not split");
    const ModelPart& part = m.part;
    MicroBatchSlot<floatX>& mb = m.slots[slot];
    int Lp = part.layers(), lo = part.chunk_begin(chunk), n = part.chunk_layers[chunk];
    LocalDims d = model_dims(m, mb.B, mb.T);
    long BT = d.BT, C = d.C;
    float* ws = m.scratch.gemm;
    auto done = [&](int unit) {
        if (m.store) m.store->grads_done(unit);
    };
    NvtxRange pass("weight gradients");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(true, low_unit, high_unit);
    if (chunk == part.chunks() - 1) done(FINAL_NORM_UNIT);
    for (int i = n - 1; i >= 0; i--) {
        Activations<floatX> la = layer_slice(mb.acts, i, d, m.recompute, true);
        const floatX* residual = i == 0 ? mb.acts.encoded : layer_slice(mb.acts, i - 1, d, m.recompute, true).residual3;
        int unit = layer_unit(Lp, lo + i);
        ParamViews<floatX> w = unit_params(m, unit), dw = unit_grads(m, unit);
        if (!m.config.moe()) {
            recompute_gelu(m, la, d, BT);
            matmul_backward((floatX*)nullptr, dw[FCPROJW], dw[FCPROJB], la.dfcproj, la.fch_gelu, w[FCPROJW], BT, d.Hl, C,
                            ws);
            recompute_layernorm(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
            matmul_backward((floatX*)nullptr, dw[FCW], dw[FCB], la.dfch, la.ln2, w[FCW], BT, C, d.Hl, ws);
        }
        matmul_backward((floatX*)nullptr, dw[ATTPROJW], dw[ATTPROJB], la.dattproj, la.atty, w[ATTPROJW], BT, d.Cl, C, ws);
        recompute_layernorm(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
        matmul_backward((floatX*)nullptr, dw[QKVW], dw[QKVB], la.dqkv, la.ln1, w[QKVW], BT, C, 3 * d.Cl, ws);
        done(unit);
    }
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
}

// the backward of the whole model's last forward (a part that is the whole model)
template <typename floatX>
inline void gpt_backward(GPTModel<floatX>& m, float dloss) { gpt_backward_chunk(m, 0, 0, dloss); }

template <typename floatX>
inline double gpt_grad_norm(const GPTModel<floatX>& m) {
    return sqrt(sum_of_squares(m.grads, (long)m.num_parameters));
}

// one AdamW step over every tensor; grad_scale is the clipping factor
template <typename floatX>
inline void gpt_update(GPTModel<floatX>& m, float lr, float weight_decay, float grad_scale) {
    m.adam_step++;
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        size_t n = m.param_sizes[i];
        adamw_update(m.params + offset, m.master ? m.master + offset : nullptr, m.grads + offset, m.adam_m + offset,
                     m.adam_v + offset, (long)n, lr, m.table[i].decayed ? weight_decay : 0.0f, grad_scale, m.adam_step,
                     m.seed, (long)offset);
        offset += n;
    }
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

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
#include "llmc/nvtx.h"
#include "llmc/residual.cuh"
#include "llmc/tp.cuh"
#include "llmc/utils.h"

constexpr int MODEL_MAGIC = 20240326;
constexpr int MODEL_VERSION_FP32 = 3;
constexpr int MODEL_VERSION_BF16 = 5;

struct GPTConfig {
    int max_seq_len = 1024;
    int vocab_size = 50257;
    int padded_vocab_size = 50304;  // vocab rounded up to a multiple of 128
    int num_layers = 12;
    int num_heads = 12;
    int channels = 768;
};

inline int pad_vocab(int V) { return (V + 127) / 128 * 128; }

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
}

// "d12", "d24", "d36", "d48" are GPT-2 124M, 350M, 774M and 1.5B. Other shapes: d<L>c<C>h<NH>[t<maxT>][v<V>],
// e.g. d4c128h4 (4 layers, 128 channels, 4 heads, maxT 1024, the GPT-2 vocab) or d2c64h2t128v1000.
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
    if (*p == '\0') {
        switch (c.num_layers) {
            case 12: c.channels = 768, c.num_heads = 12; break;
            case 24: c.channels = 1024, c.num_heads = 16; break;
            case 36: c.channels = 1280, c.num_heads = 20; break;
            case 48: c.channels = 1600, c.num_heads = 25; break;
            default: fail("-e %s: GPT-2 sizes are d12, d24, d36, d48; give other shapes as d<L>c<C>h<NH>", s.c_str());
        }
    } else {
        bool have_c = false, have_h = false;
        while (*p) {
            char key = *p++;
            switch (key) {
                case 'c': c.channels = number(key), have_c = true; break;
                case 'h': c.num_heads = number(key), have_h = true; break;
                case 't': c.max_seq_len = number(key); break;
                case 'v': c.vocab_size = number(key); break;
                default: fail("-e %s: unknown field '%c' (expected d<L>c<C>h<NH>[t<maxT>][v<V>])", s.c_str(), key);
            }
        }
        if (!have_c || !have_h) fail("-e %s: a custom shape needs c<channels> and h<heads>", s.c_str());
    }
    c.padded_vocab_size = pad_vocab(c.vocab_size);
    validate_config(c, "-e " + s);
    return c;
}

// ----------------------------------------------------------------------------------------------------------
// parameters: 16 tensors in llm.c's order, stored back to back

enum ParamTensor { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW, FCPROJB, LNFW,
                   LNFB, NUM_PARAM_TENSORS };

// the tensors' sizes on one rank of a tensor-parallel group of tp ranks (tp = 1: the whole model): QKV and fc
// keep their rows of the rank's heads and hidden units, the projections their columns, wte its vocab rows
inline void param_tensor_sizes(const GPTConfig& c, size_t sizes[NUM_PARAM_TENSORS], int tp = 1) {
    size_t L = c.num_layers, C = c.channels, Cl = C / tp, Hl = 4 * C / tp;
    sizes[WTE] = (size_t)TensorParallel::vocab_rows(c.padded_vocab_size, tp) * C;
    sizes[WPE] = (size_t)c.max_seq_len * C;
    sizes[LN1W] = L * C;
    sizes[LN1B] = L * C;
    sizes[QKVW] = L * 3 * Cl * C;
    sizes[QKVB] = L * 3 * Cl;
    sizes[ATTPROJW] = L * C * Cl;
    sizes[ATTPROJB] = L * C;
    sizes[LN2W] = L * C;
    sizes[LN2B] = L * C;
    sizes[FCW] = L * Hl * C;
    sizes[FCB] = L * Hl;
    sizes[FCPROJW] = L * C * Hl;
    sizes[FCPROJB] = L * C;
    sizes[LNFW] = C;
    sizes[LNFB] = C;
}

// tensors every rank of a tensor-parallel group holds whole
inline bool is_replicated(int tensor) {
    return tensor == WPE || tensor == LN1W || tensor == LN1B || tensor == ATTPROJB || tensor == LN2W ||
           tensor == LN2B || tensor == FCPROJB || tensor == LNFW || tensor == LNFB;
}
// the replicated tensors whose gradients are partial sums under sequence parallelism (the others see every row)
inline bool is_sequence_partial(int tensor) { return is_replicated(tensor) && tensor != ATTPROJB && tensor != FCPROJB; }

inline size_t num_parameters(const GPTConfig& c, int tp = 1) {
    size_t sizes[NUM_PARAM_TENSORS], n = 0;
    param_tensor_sizes(c, sizes, tp);
    for (size_t s : sizes) n += s;
    return n;
}

// the 2-D weight matrices, which AdamW decays; biases and layernorm parameters are not decayed
inline bool is_decayed(int tensor) {
    return tensor == WTE || tensor == WPE || tensor == QKVW || tensor == ATTPROJW || tensor == FCW || tensor == FCPROJW;
}

// pointers to the tensors of one flat buffer (parameters or gradients, same layout), or to one unit's slices
template <typename floatX>
struct ParamViews {
    floatX* t[NUM_PARAM_TENSORS] = {};
    floatX* operator[](int i) const { return t[i]; }
};

template <typename floatX>
inline ParamViews<floatX> param_views(floatX* base, const size_t sizes[NUM_PARAM_TENSORS]) {
    ParamViews<floatX> v;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        v.t[i] = base;
        base += sizes[i];
    }
    return v;
}

// Units: the parameters that forward uses together and that backward finishes together, numbered in the order
// backward finishes them: 0 the final layernorm, 1..L the layers from last to first, L+1 the embeddings (the
// token embedding is also the classifier, so its gradient is final only at the very end). Data parallelism
// reduces gradients unit by unit as backward goes; ZeRO-3 gathers parameters unit by unit.
constexpr int FINAL_NORM_UNIT = 0;
inline int num_units(const GPTConfig& c) { return c.num_layers + 2; }
inline int layer_unit(const GPTConfig& c, int layer) { return c.num_layers - layer; }
inline int embedding_unit(const GPTConfig& c) { return c.num_layers + 1; }

// a unit's slice of one tensor: where it sits in the flat buffer
struct Segment {
    int tensor;
    size_t offset, size;
};

// a unit's slices in llm.c tensor order; packed back to back, they are the unit's packed layout
inline std::vector<Segment> unit_segments(const GPTConfig& c, int unit, int tp = 1) {
    size_t sizes[NUM_PARAM_TENSORS], start[NUM_PARAM_TENSORS], offset = 0;
    param_tensor_sizes(c, sizes, tp);
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) start[i] = offset, offset += sizes[i];
    std::vector<Segment> segs;
    if (unit == FINAL_NORM_UNIT) {
        for (int t : {LNFW, LNFB}) segs.push_back({t, start[t], sizes[t]});
    } else if (unit == embedding_unit(c)) {
        for (int t : {WTE, WPE}) segs.push_back({t, start[t], sizes[t]});
    } else {
        size_t l = c.num_layers - unit, L = c.num_layers;
        for (int t = LN1W; t <= FCPROJB; t++) segs.push_back({t, start[t] + l * (sizes[t] / L), sizes[t] / L});
    }
    return segs;
}

inline size_t segments_size(const std::vector<Segment>& segs) {
    size_t n = 0;
    for (const Segment& s : segs) n += s.size;
    return n;
}

// views of a unit's tensors: inside the flat buffer at base, or packed back to back from base
template <typename floatX>
inline ParamViews<floatX> unit_views(const std::vector<Segment>& segs, floatX* base, bool packed) {
    ParamViews<floatX> v;
    size_t running = 0;
    for (const Segment& s : segs) {
        v.t[s.tensor] = base + (packed ? running : s.offset);
        running += s.size;
    }
    return v;
}

// Where the parameters and gradients live when they are not the model's own flat buffers, and what to do when
// backward has finished a unit's gradients: the hooks a data-parallel runtime (llmc/zero.cuh) plugs into the
// model. Without one, everything is local and flat.
template <typename floatX>
struct ParamStore {
    virtual ~ParamStore() = default;
    virtual void begin_pass(bool backward) = 0;
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
};

inline LocalDims local_dims(const GPTConfig& c, const TPSpec& tp, int B, int T, int cp = 1) {
    LocalDims d;
    d.B = B, d.T = T / cp, d.C = c.channels, d.ring = cp > 1;
    d.BT = (long)B * d.T;
    d.R = tp.sp ? d.BT / tp.size : d.BT;
    d.Cl = c.channels / tp.size, d.Hl = 4 * c.channels / tp.size, d.NHl = c.num_heads / tp.size;
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

// the elements of each per-layer slot, in Activations order: the layernorm outputs are whole (they enter a
// column-parallel layer), their statistics and the residual stream are the rank's rows, the rest local; 0
// for a slot that is recomputed
inline std::vector<size_t> layer_slot_sizes(const LocalDims& d, int recompute, Device dev) {
    size_t BT = d.BT, R = d.R, C = d.C;
    size_t ln = recompute >= RECOMPUTE_LAYERNORM ? 0 : BT * C, gelu = recompute >= RECOMPUTE_GELU ? 0 : BT * d.Hl;
    return {ln, R, R, BT * 3 * d.Cl, attention_state_floats(d, dev), BT * d.Cl, R * C, R * C,
            ln, R, R, BT * d.Hl, gelu, R * C, R * C};
}

// a per-layer slot: where its pointer is, and the size of its elements
struct SlotRef {
    void** pointer;
    size_t element;
};
template <typename E>
inline SlotRef slot(E*& p) {
    return {reinterpret_cast<void**>(&p), sizeof(E)};
}

// the per-layer slot pointers of Activations, in the order of layer_slot_sizes
template <typename floatX>
inline std::vector<SlotRef> layer_slots(Activations<floatX>& a) {
    return {slot(a.ln1), slot(a.ln1_mean), slot(a.ln1_rstd), slot(a.qkv), slot(a.att), slot(a.atty), slot(a.attproj),
            slot(a.residual2), slot(a.ln2), slot(a.ln2_mean), slot(a.ln2_rstd), slot(a.fch), slot(a.fch_gelu),
            slot(a.fcproj), slot(a.residual3)};
}

// layer l's slice of every per-layer activation slot (stacked layer 0 first); the other fields unchanged
template <typename floatX>
inline Activations<floatX> layer_slice(const Activations<floatX>& a, int l, const LocalDims& d, int recompute) {
    Activations<floatX> v = a;
    std::vector<SlotRef> slots = layer_slots(v);
    std::vector<size_t> sizes = layer_slot_sizes(d, recompute, device_of<floatX>);
    for (size_t i = 0; i < slots.size(); i++)
        *slots[i].pointer = static_cast<char*>(*slots[i].pointer) + l * sizes[i] * slots[i].element;
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
    for (long oc : {3L * d.Cl, (long)d.C, (long)d.Hl})  // the matmuls with a bias gradient
        need = std::max(need, (size_t)matmul_backward_scratch_floats(d.BT, oc));
    need = std::max(need, attention_backward_scratch_floats(d.B, d.T, d.Cl, d.NHl));
    // CUB sizes the encoder's sort only on a GPU; a plan made without one takes its usual need: keys, positions
    // and their sorted copies (4·BT int32 at most), the runs (BT + V), and the sort's own buffers and histograms
    // (2·BT int32 + 64 KiB)
    size_t sort_bytes = cuda_device_available() ? encoder_backward_scratch_bytes(d.B, d.T, d.Vl)
                                                : (7 * d.BT + d.Vl) * sizeof(int) + 65536;
    need = std::max(need, (sort_bytes + 3) / 4);
    return std::max(need, (size_t)GLOBAL_NORM_BLOCKS + 1);
}

template <typename floatX>
struct GPTModel {
    GPTConfig config;
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
    int recompute = RECOMPUTE_NONE;
    Activations<floatX> acts;
    Scratch<floatX> scratch;
    std::vector<int> inputs, targets;  // the batch of the last forward, which backward needs
    int *device_inputs = nullptr, *device_targets = nullptr;  // the same, where the kernels read them
    int last_B = 0, last_T = 0;
    float last_loss = -1.0f;

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

template <typename floatX>
inline void gpt_allocate(GPTModel<floatX>& m, const GPTConfig& config, int B, int T, ModelBuffers own = {}, TPSpec tp = {},
                         int recompute = RECOMPUTE_NONE, CPSpec cp = {}) {
    constexpr bool gpu = device_of<floatX> == Device::CUDA;
    check_split(config, T, tp, cp);
    m.cp.spec = cp;
    int head_size = config.channels / config.num_heads;
    if (gpu && head_size != 64 && head_size != 128)
        fail("model: head size %d (channels / heads): the GPU attention kernels take 64 or 128", head_size);
    m.config = config;
    m.B = B;
    m.T = T;
    m.tp.spec = tp;
    m.recompute = recompute;
    param_tensor_sizes(config, m.param_sizes, tp.size);
    m.num_parameters = num_parameters(config, tp.size);
    Ledger& led = m.ledger;
    if (own.params) m.params = led.alloc<floatX, floatX>(MEM_PARAMS, m.num_parameters);
    if (own.grads) m.grads = led.alloc<floatX, floatX>(MEM_GRADS, m.num_parameters);
    if (own.optimizer) {
        if (gpu) m.master = led.alloc<floatX, float>(MEM_MASTER_WEIGHTS, m.num_parameters);
        m.adam_m = led.alloc<floatX, float>(MEM_OPTIMIZER, m.num_parameters);
        m.adam_v = led.alloc<floatX, float>(MEM_OPTIMIZER, m.num_parameters);
    }
    for (int u = 0; u < num_units(config); u++) m.units.push_back(unit_segments(config, u, tp.size));

    LocalDims d = local_dims(config, tp, B, T, cp.size);
    size_t L = config.num_layers, C = config.channels, BT = d.BT, R = d.R;
    Activations<floatX>& a = m.acts;
    auto act = [&](size_t n) { return led.alloc<floatX, floatX>(MEM_ACTIVATIONS, n); };
    auto act_f = [&](size_t n) { return led.alloc<floatX, float>(MEM_ACTIVATIONS, n); };
    a.encoded = act(R * C);
    std::vector<SlotRef> slots = layer_slots(a);
    std::vector<size_t> sizes = layer_slot_sizes(d, recompute, device_of<floatX>);
    for (size_t i = 0; i < slots.size(); i++)
        *slots[i].pointer = slots[i].element == sizeof(float) ? (void*)act_f(L * sizes[i]) : (void*)act(L * sizes[i]);
    // a recomputed slot is one buffer for every layer (layer_slice steps through it by 0)
    if (recompute >= RECOMPUTE_GELU) a.fch_gelu = act(BT * d.Hl);
    if (recompute >= RECOMPUTE_LAYERNORM) a.ln1 = a.ln2 = act(BT * C);
    a.lnf = act(BT * C);
    a.lnf_mean = act_f(R);
    a.lnf_rstd = act_f(R);
    a.logits = act(BT * d.Vl);
    a.losses = act_f(BT);
    a.lse = tp.size > 1 ? act_f(BT) : nullptr;

    Scratch<floatX>& s = m.scratch;
    int threads = omp_get_max_threads();
    auto scr = [&](size_t n) { return led.alloc<floatX, floatX>(MEM_SCRATCH, n); };
    s.dresidual = scr(R * C);
    s.dln = scr(BT * C);
    s.dqkv = scr(BT * 3 * d.Cl);
    s.datty = scr(BT * d.Cl);
    s.dfch = scr(BT * d.Hl);
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
    m.inputs.assign(BT, 0);
    m.targets.assign(BT, 0);
    if (gpu) {
        m.device_inputs = led.alloc<floatX, int>(MEM_ACTIVATIONS, BT);
        m.device_targets = led.alloc<floatX, int>(MEM_ACTIVATIONS, BT);
    } else {
        m.device_inputs = m.inputs.data();
        m.device_targets = m.targets.data();
    }
}

// Moves parameters between the whole model (llm.c's layout) and one tensor-parallel rank's share of it, in
// either direction: what a checkpoint gathers on save and splits on load.
inline void tp_copy_params(const GPTConfig& c, int tp, int rank, float* whole, float* local, bool to_local) {
    size_t ws[NUM_PARAM_TENSORS], ls[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, ws, 1);
    param_tensor_sizes(c, ls, tp);
    ParamViews w = param_views(whole, ws), l = param_views(local, ls);
    auto move = [&](float* wp, float* lp, size_t n) {
        if (to_local) memcpy(lp, wp, n * sizeof(float));
        else memcpy(wp, lp, n * sizeof(float));
    };
    size_t L = c.num_layers, C = c.channels, Cl = C / tp, Hl = 4 * C / tp;
    // rows of this rank, runs of `width` floats: a block of `rows` whole rows starting at row `first`
    auto rows = [&](int t, size_t per_layer_whole, size_t per_layer_local, size_t first, size_t count, size_t width) {
        for (size_t layer = 0; layer < L; layer++)
            move(w[t] + layer * per_layer_whole + first * width, l[t] + layer * per_layer_local, count * width);
    };
    for (int t = 0; t < NUM_PARAM_TENSORS; t++)
        if (is_replicated(t)) move(w[t], l[t], ws[t]);
    size_t Vp = c.padded_vocab_size, Vl = TensorParallel::vocab_rows((int)Vp, tp), vlo = rank * Vl;
    if (vlo < Vp) move(w[WTE] + vlo * C, l[WTE], (std::min(Vp, vlo + Vl) - vlo) * C);
    for (size_t part = 0; part < 3; part++) {  // Q, K and V: this rank's heads of each
        for (size_t layer = 0; layer < L; layer++) {
            move(w[QKVW] + layer * 3 * C * C + (part * C + rank * Cl) * C, l[QKVW] + layer * 3 * Cl * C + part * Cl * C, Cl * C);
            move(w[QKVB] + layer * 3 * C + part * C + rank * Cl, l[QKVB] + layer * 3 * Cl + part * Cl, Cl);
        }
    }
    rows(FCW, 4 * C * C, Hl * C, rank * Hl, Hl, C);
    rows(FCB, 4 * C, Hl, rank * Hl, Hl, 1);
    // the projections: this rank's columns of every output row
    for (size_t layer = 0; layer < L; layer++)
        for (size_t o = 0; o < C; o++) {
            move(w[ATTPROJW] + layer * C * C + o * C + rank * Cl, l[ATTPROJW] + layer * C * Cl + o * Cl, Cl);
            move(w[FCPROJW] + layer * C * 4 * C + o * 4 * C + rank * Hl, l[FCPROJW] + layer * C * Hl + o * Hl, Hl);
        }
}

// GPT-2's initialization: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), zero biases, unit
// layernorm gains. Drawn in fixed chunks from per-chunk seeds so any thread count gives the same weights.
inline void gpt_init_random(const GPTConfig& c, float* params, uint64_t seed) {
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    ParamViews p = param_views(params, sizes);
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        float* t = p[i];
        size_t n = sizes[i];
        if (i == LN1W || i == LN2W || i == LNFW) {
            for (size_t j = 0; j < n; j++) t[j] = 1.0f;
            continue;
        }
        if (!is_decayed(i)) continue;  // biases and layernorm shifts stay zero
        float std = (i == ATTPROJW || i == FCPROJW) ? 0.02f / sqrtf(2.0f * c.num_layers) : 0.02f;
        if (i == WTE) n = (size_t)c.vocab_size * c.channels;  // padding rows stay zero: no token ever uses them
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
    validate_config(c, path);
    long expected = (long)sizeof(h) + (long)(num_parameters(c) * (h[1] == MODEL_VERSION_FP32 ? 4 : 2));
    if (f.size() != expected)
        fail("%s: size %ld bytes, but its header implies %ld", path.c_str(), f.size(), expected);
    *version = h[1];
    return c;
}

inline const char* param_tensor_name(int tensor) {
    static const char* names[NUM_PARAM_TENSORS] = {"wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw",
                                                   "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb",
                                                   "lnfw", "lnfb"};
    return names[tensor];
}

// where element i of the whole model's flat buffer lies, in words: "ln1w of layer 1, element 5"
inline std::string describe_param(const GPTConfig& c, size_t i) {
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    int t = 0;
    while (t + 1 < NUM_PARAM_TENSORS && i >= sizes[t]) i -= sizes[t++];
    bool per_layer = t != WTE && t != WPE && t != LNFW && t != LNFB;
    if (!per_layer) return strfmt("%s, element %zu", param_tensor_name(t), i);
    size_t per = sizes[t] / c.num_layers;
    return strfmt("%s of layer %zu, element %zu", param_tensor_name(t), i / per, i % per);
}

// the index of the first NaN or Inf among n floats, or n when every one is finite
inline size_t first_non_finite(const float* x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!std::isfinite(x[i])) return i;
    return n;
}

// reads into params (a flat buffer) the parameters of a model file whose header matches mc; a NaN or Inf in it
// is refused, naming the tensor, since training from it could only produce NaN
inline void gpt_load_params(const GPTConfig& mc, float* params, const std::string& path) {
    int version;
    GPTConfig c = read_model_header(path, &version);
    if (c.num_layers != mc.num_layers || c.channels != mc.channels || c.num_heads != mc.num_heads ||
        c.vocab_size != mc.vocab_size || c.padded_vocab_size != mc.padded_vocab_size || c.max_seq_len != mc.max_seq_len)
        fail("%s: model shape differs from the run's model", path.c_str());
    size_t count = num_parameters(c);
    File f(path, "rb");
    fseek(f.f, 1024, SEEK_SET);
    if (version == MODEL_VERSION_FP32) {
        f.read(params, count * 4);
    } else {
        std::vector<uint16_t> buf(1 << 20);
        for (size_t done = 0; done < count; done += buf.size()) {
            size_t n = std::min(buf.size(), count - done);
            f.read(buf.data(), n * 2);
            for (size_t i = 0; i < n; i++) {
                uint32_t bits = (uint32_t)buf[i] << 16;  // bf16 is the top half of an fp32
                memcpy(&params[done + i], &bits, 4);
            }
        }
    }
    size_t bad = first_non_finite(params, count);
    if (bad < count)
        fail("%s: %g in %s (a model must be finite)", path.c_str(), params[bad], describe_param(c, bad).c_str());
}

// writes an fp32 (version 3) llm.c model file from a flat parameter buffer
// returns the checksum of the bytes written
inline uint64_t gpt_save_params(const GPTConfig& c, const float* params, const std::string& path) {
    int h[256] = {};
    h[0] = MODEL_MAGIC;
    h[1] = MODEL_VERSION_FP32;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    h[6] = c.channels;
    h[7] = c.padded_vocab_size;
    File f(path, "wb");
    size_t count = num_parameters(c);
    f.write(h, sizeof(h));
    f.write(params, count * 4);
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

// Runs the model on inputs (B×T tokens, B and T at most what the model was allocated for). With targets, also
// the loss, which it returns (mean over the rank's tokens; on the GPU reading it waits for the forward to
// finish); without, returns -1 and leaves only the logits.
// Under tensor parallelism every rank of the group calls it with the same tokens; tp wraps the layer calls
// that cross ranks (llmc/tp.cuh), and R = BT/tp rows of the residual stream live on each rank under sp.
// Under context parallelism every rank of the cp group calls it with the same B×T tokens too, and keeps its
// T/cp positions of each sequence (llmc/cp.cuh): only attention and the position embedding see where they are.
template <typename floatX>
inline float gpt_forward(GPTModel<floatX>& m, const int* inputs, const int* targets, int B, int T) {
    if (B > m.B || T > m.T) fail("forward: batch %dx%d exceeds the allocated %dx%d", B, T, m.B, m.T);
    const GPTConfig& c = m.config;
    int L = c.num_layers, V = c.vocab_size;
    ContextParallel<floatX>& cp = m.cp;
    LocalDims d = local_dims(c, m.tp.spec, B, T, cp.spec.size);
    long BT = d.BT, R = d.R, C = d.C, first = m.tp.first_row(BT) * C;
    for (long i = 0; i < (long)B * T; i++) {
        if (inputs[i] < 0 || inputs[i] >= V) fail("forward: input token %d outside the vocab [0, %d)", inputs[i], V);
        if (targets && (targets[i] < 0 || targets[i] >= V))
            fail("forward: target token %d outside the vocab [0, %d)", targets[i], V);
    }
    cp.begin(T);
    cp.select_tokens(m.inputs.data(), inputs, B, T);
    if (targets) cp.select_tokens(m.targets.data(), targets, B, T);
    device_upload<floatX>(m.device_inputs, m.inputs.data(), BT);
    if (targets) device_upload<floatX>(m.device_targets, m.targets.data(), BT);
    m.last_B = B;
    m.last_T = T;
    Activations<floatX>& a = m.acts;
    TensorParallel& tp = m.tp;
    float* ws = m.scratch.gemm;
    floatX* partial = m.scratch.partial;
    NvtxRange pass("forward");
    if (m.store) m.store->begin_pass(false);

    ParamViews<floatX> emb = unit_params(m, embedding_unit(c));
    tp.embedding_forward(a.encoded, partial, m.device_inputs, emb[WTE], cp.position_rows(emb[WPE], C), B, d.T, C, d.Vl);
    for (int l = 0; l < L; l++) {
        NvtxRange layer("layer", l);
        ParamViews<floatX> w = unit_params(m, layer_unit(c, l));
        Activations<floatX> la = layer_slice(a, l, d, m.recompute), prev = layer_slice(a, std::max(l - 1, 0), d, m.recompute);
        // the residual add that ends the previous layer is fused with the layernorm that begins this one
        if (l == 0) layernorm_forward(la.ln1 + first, la.ln1_mean, la.ln1_rstd, a.encoded, w[LN1W], w[LN1B], R, C);
        else fused_residual_layernorm_forward(prev.residual3, la.ln1 + first, la.ln1_mean, la.ln1_rstd, prev.residual2,
                                              prev.fcproj, w[LN1W], w[LN1B], R, C);
        const floatX* residual = l == 0 ? a.encoded : prev.residual3;
        tp.gather_rows(la.ln1, BT, C);
        matmul_forward(la.qkv, la.ln1, w[QKVW], w[QKVB], BT, C, 3 * d.Cl, ws);
        cp.attention_forward(la.atty, la.att, la.qkv, B, d.T, d.Cl, d.NHl);
        tp.row_parallel_forward(la.attproj, partial, la.atty, w[ATTPROJW], w[ATTPROJB], BT, d.Cl, C, ws);
        fused_residual_layernorm_forward(la.residual2, la.ln2 + first, la.ln2_mean, la.ln2_rstd, residual, la.attproj,
                                         w[LN2W], w[LN2B], R, C);
        tp.gather_rows(la.ln2, BT, C);
        matmul_gelu_forward(la.fch_gelu, la.fch, la.ln2, w[FCW], w[FCB], BT, C, d.Hl, ws);
        tp.row_parallel_forward(la.fcproj, partial, la.fch_gelu, w[FCPROJW], w[FCPROJB], BT, d.Hl, C, ws);
    }
    Activations<floatX> last = layer_slice(a, L - 1, d, m.recompute);
    ParamViews<floatX> fin = unit_params(m, FINAL_NORM_UNIT);
    fused_residual_layernorm_forward(last.residual3, a.lnf + first, a.lnf_mean, a.lnf_rstd, last.residual2, last.fcproj,
                                     fin[LNFW], fin[LNFB], R, C);
    tp.gather_rows(a.lnf, BT, C);
    emb = unit_params(m, embedding_unit(c));
    matmul_forward(a.logits, a.lnf, emb[WTE], (const floatX*)nullptr, BT, C, d.Vl, ws);
    if (m.store) m.store->end_pass();
    if (!targets) return m.last_loss = -1.0f;
    m.last_loss = tp.on() ? tp.crossentropy_forward(a.losses, a.lse, a.logits, m.device_targets, BT, V, d.Vl)
                          : crossentropy_forward(a.losses, a.logits, m.device_targets, BT, V, c.padded_vocab_size);
    return m.last_loss;
}

// the logits at position t of sequence b of the last forward, over the whole vocab, for sampling: from the cp
// rank that holds the position, gathered over the tensor-parallel group (a collective of both groups)
template <typename floatX>
inline std::vector<float> gpt_logits_row(GPTModel<floatX>& m, int b, int t) {
    int Vl = TensorParallel::vocab_rows(m.config.padded_vocab_size, m.tp.size());
    std::vector<float> mine(Vl), whole((size_t)Vl * m.tp.size());
    const ContextParallel<floatX>& cp = m.cp;
    if (cp.on()) {
        int owner = cp.owner(t);
        std::vector<float> held(Vl, 0.0f), every((size_t)Vl * cp.spec.size);
        long row = (long)b * cp.local_tokens(m.last_T) + cp.local_index(t);
        if (owner == cp.spec.rank) download_as_float(held.data(), m.acts.logits + row * Vl, Vl);
        cp.comm->wait(cp.comm->all_gather(held.data(), every.data(), Vl, DType::F32));
        std::copy(every.begin() + (long)owner * Vl, every.begin() + (long)(owner + 1) * Vl, mine.begin());
    } else {
        download_as_float(mine.data(), m.acts.logits + ((long)b * m.last_T + t) * Vl, Vl);
    }
    if (m.tp.on()) m.tp.comm->wait(m.tp.comm->all_gather(mine.data(), whole.data(), Vl, DType::F32));
    else whole = mine;
    whole.resize(m.config.vocab_size);
    return whole;
}

template <typename floatX>
inline void gpt_zero_grad(GPTModel<floatX>& m) { device_zero<floatX>(m.grads, m.num_parameters); }

// accumulates into the gradients the backward of the last forward (which must have had targets); dloss is the
// weight of each token's loss in the objective: 1 / (B·T·accumulation steps) for a mean over the global batch
template <typename floatX>
inline void gpt_backward(GPTModel<floatX>& m, float dloss) {
    if (m.last_loss < 0) fail("backward: the last forward had no targets");
    const GPTConfig& c = m.config;
    int B = m.last_B, T = m.last_T, L = c.num_layers, V = c.vocab_size;
    LocalDims d = local_dims(c, m.tp.spec, B, T, m.cp.spec.size);
    long BT = d.BT, R = d.R, C = d.C, first = m.tp.first_row(BT) * C;
    Activations<floatX>& a = m.acts;
    Scratch<floatX>& s = m.scratch;
    TensorParallel& tp = m.tp;
    ContextParallel<floatX>& cp = m.cp;
    float* ws = s.gemm;
    // the gradient of a layernorm's output for this rank's rows: the partial sums of every rank, reduced
    floatX* dln_rows = tp.spec.sp ? s.dchunk : s.dln;
    auto done = [&](int unit) {
        if (m.store) m.store->grads_done(unit);
    };
    NvtxRange pass("backward");
    if (m.store) m.store->begin_pass(true);

    // the classifier: logits turn into their gradient in place, then through the tied wte and the final norm
    if (tp.on()) tp.crossentropy_backward_inplace(a.logits, a.lse, m.device_targets, BT, V, d.Vl, dloss);
    else crossentropy_backward_inplace(a.logits, m.device_targets, BT, V, c.padded_vocab_size, dloss);
    ParamViews<floatX> emb = unit_params(m, embedding_unit(c)), demb = unit_grads(m, embedding_unit(c));
    matmul_backward(s.dln, demb[WTE], (floatX*)nullptr, a.logits, a.lnf, emb[WTE], BT, C, d.Vl, ws);
    tp.reduce_rows(s.dln, dln_rows, BT, C);
    device_zero<floatX>(s.dresidual, R * C);
    const floatX* last_residual = a.residual3 + (L - 1) * R * C;
    ParamViews<floatX> fin = unit_params(m, FINAL_NORM_UNIT), dfin = unit_grads(m, FINAL_NORM_UNIT);
    layernorm_backward(s.dresidual, dfin[LNFW], dfin[LNFB], dln_rows, last_residual, fin[LNFW], a.lnf_mean, a.lnf_rstd, R, C);
    done(FINAL_NORM_UNIT);

    // dresidual carries the gradient of the residual stream down the layers: each branch reads it and adds
    // its input gradient back (the residual add passes gradient to both of its inputs unchanged)
    for (int l = L - 1; l >= 0; l--) {
        NvtxRange layer("layer", l);
        const floatX* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * R * C;
        Activations<floatX> la = layer_slice(a, l, d, m.recompute);
        ParamViews<floatX> w = unit_params(m, layer_unit(c, l)), dw = unit_grads(m, layer_unit(c, l));
        // what forward did not keep, computed again exactly as forward did (and gathered again under sp)
        auto recompute_layernorm = [&](floatX* out, float* mean, float* rstd, const floatX* inp, int weight, int bias) {
            layernorm_forward(out + first, mean, rstd, inp, w[weight], w[bias], R, C);
            tp.gather_rows(out, BT, C);
        };
        if (m.recompute >= RECOMPUTE_GELU) gelu_forward(la.fch_gelu, la.fch, BT * d.Hl);

        const floatX* dout = tp.row_parallel_dout(s.dresidual, s.whole, BT, C);
        matmul_backward(s.dfch, dw[FCPROJW], dw[FCPROJB], dout, la.fch_gelu, w[FCPROJW], BT, d.Hl, C, ws);
        gelu_backward(s.dfch, la.fch, s.dfch, BT * d.Hl);
        if (m.recompute >= RECOMPUTE_LAYERNORM)
            recompute_layernorm(la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, LN2W, LN2B);
        matmul_backward(s.dln, dw[FCW], dw[FCB], s.dfch, la.ln2, w[FCW], BT, C, d.Hl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        layernorm_backward(s.dresidual, dw[LN2W], dw[LN2B], dln_rows, la.residual2, w[LN2W], la.ln2_mean, la.ln2_rstd, R, C);
        dout = tp.row_parallel_dout(s.dresidual, s.whole, BT, C);
        matmul_backward(s.datty, dw[ATTPROJW], dw[ATTPROJB], dout, la.atty, w[ATTPROJW], BT, d.Cl, C, ws);
        cp.attention_backward(s.dqkv, s.datty, la.qkv, la.atty, la.att, B, d.T, d.Cl, d.NHl, s.attention);
        if (m.recompute >= RECOMPUTE_LAYERNORM) recompute_layernorm(la.ln1, la.ln1_mean, la.ln1_rstd, residual, LN1W, LN1B);
        matmul_backward(s.dln, dw[QKVW], dw[QKVB], s.dqkv, la.ln1, w[QKVW], BT, C, 3 * d.Cl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        layernorm_backward(s.dresidual, dw[LN1W], dw[LN1B], dln_rows, residual, w[LN1W], la.ln1_mean, la.ln1_rstd, R, C);
        done(layer_unit(c, l));
    }
    demb = unit_grads(m, embedding_unit(c));
    tp.embedding_backward(demb[WTE], cp.position_grads_begin(demb[WPE], C), s.dresidual, s.whole, m.device_inputs, B, d.T,
                          C, d.Vl);
    cp.position_grads_end(demb[WPE], C);
    done(embedding_unit(c));
    if (m.store) m.store->end_pass();
}

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
                     m.adam_v + offset, (long)n, lr, is_decayed(i) ? weight_decay : 0.0f, grad_scale, m.adam_step,
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

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
#include "llmc/fp8.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/model_table.h"
#include "llmc/moe.cuh"
#include "llmc/nvtx.h"
#include "llmc/qknorm.cuh"
#include "llmc/residual.cuh"
#include "llmc/rmsnorm.cuh"
#include "llmc/rope.cuh"
#include "llmc/swiglu.cuh"
#include "llmc/tp.cuh"
#include "llmc/utils.h"

constexpr int MODEL_MAGIC = 20240326;
constexpr int MODEL_VERSION_FP32 = 3;
constexpr int MODEL_VERSION_BF16 = 5;

inline void validate_config(const GPTConfig& c, const std::string& where) {
    if (c.num_layers < 1 || c.num_heads < 1 || c.channels < 1 || c.max_seq_len < 1 || c.vocab_size < 1)
        fail("%s: every model dimension must be positive", where.c_str());
    if (c.head_dim == 0 && c.channels % c.num_heads != 0)
        fail("%s: channels (%d) must be divisible by heads (%d)", where.c_str(), c.channels, c.num_heads);
    if (c.head_dim < 0 || c.head_dim > 1024 || c.intermediate_size < 0)
        fail("%s: head size %d, MLP size %d", where.c_str(), c.head_dim, c.intermediate_size);
    // bounds far above any real model that keep every size computation inside 64 bits
    if (c.num_layers > 4096 || c.channels > 65536 || c.max_seq_len > (1 << 20) || c.vocab_size > (1 << 24) ||
        c.padded_vocab_size > (1 << 24))
        fail("%s: implausible model shape (L=%d C=%d maxT=%d V=%d Vp=%d)", where.c_str(), c.num_layers, c.channels,
             c.max_seq_len, c.vocab_size, c.padded_vocab_size);
    if (c.padded_vocab_size < c.vocab_size)
        fail("%s: padded vocab %d is smaller than vocab %d", where.c_str(), c.padded_vocab_size, c.vocab_size);
    if (c.num_experts < 1 || c.num_experts > 1024 || c.top_k < 1 || c.top_k > c.num_experts)
        fail("%s: %d experts with top-%d routing: need 1 <= K <= E <= 1024", where.c_str(), c.num_experts, c.top_k);
    if (!c.llama()) return;
    int KV = c.kv_heads();
    if (KV < 1 || KV > c.num_heads || c.num_heads % KV != 0)
        fail("%s: %d key/value heads must divide the %d query heads", where.c_str(), KV, c.num_heads);
    if (c.head_size() % 2 != 0) fail("%s: RoPE rotates pairs: head size %d must be even", where.c_str(), c.head_size());
    if (c.multiple_of < 1 || c.multiple_of > (1 << 20) || !(c.ffn_dim_multiplier >= 0 && c.ffn_dim_multiplier <= 64))
        fail("%s: MLP size: multiple_of %d, ffn_dim_multiplier %g", where.c_str(), c.multiple_of, c.ffn_dim_multiplier);
    if (c.hidden() < 1 || c.hidden() > (1 << 20)) fail("%s: implausible MLP hidden size %d", where.c_str(), c.hidden());
    if (!(c.norm_eps > 0 && c.norm_eps < 1) || !(c.rope_theta > 1))
        fail("%s: norm eps %g and RoPE theta %g: need 0 < eps < 1 and theta > 1", where.c_str(), c.norm_eps, c.rope_theta);
    if (!(c.rope_scaling == 0 || (c.rope_scaling >= 1 && c.rope_scaling <= 1024)))
        fail("%s: RoPE scaling factor %g: need 0 (none) or 1 to 1024", where.c_str(), c.rope_scaling);
}

// "d12", "d24", "d36", "d48" are GPT-2 124M, 350M, 774M and 1.5B. Other shapes: d<L>c<C>h<NH>[t<maxT>][v<V>],
// e.g. d4c128h4 (4 layers, 128 channels, 4 heads, maxT 1024, the GPT-2 vocab) or d2c64h2t128v1000. Either form
// may end in e<E>k<K>: a mixture of E experts with top-K routing in every layer (d12e8k2, d2c48h4e4k2); e1k1
// is the dense model.
// Llama 3: "llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "llama3-405b" are Meta's shapes (vocab 128256,
// 8 key/value heads, RoPE theta 500000 with Llama 3's scaling, maxT 8192; the 1B and 3B are Llama 3.2's, with
// the classifier tied to wte and RoPE scaled by 32, the others Llama 3.1's, untied and scaled by 8); any other
// shape is l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][e<E>k<K>][w]: KV key/value heads (default NH), H hidden
// units in the MLP (default Meta's rule: 2/3 of 4C rounded up to a multiple of 256), maxT 1024 and the GPT-2
// vocab by default, RoPE theta 500000 unscaled, E SwiGLU experts of H hidden units with top-K routing in every
// layer (Mixtral's shape), w: the classifier tied to wte, e.g. l4c128h4g2f352 (4 layers, 128 channels, 4 heads
// sharing 2 key/value heads).
// Qwen3: "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b" are Qwen's dense shapes; any other shape is
// q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][e<E>k<K>][w], a Llama's fields and hd channels a head (default
// C/NH), H the MLP's hidden units as given, RoPE theta 1e6 and norm eps 1e-6, e.g. q2c48h4g2d16f88 (4 heads of
// 16 channels: attention is 64 wide in a model of 48 channels).
inline bool is_model_descriptor(const std::string& s) {
    return (s.size() >= 2 && (s[0] == 'd' || s[0] == 'l' || s[0] == 'q') && isdigit(s[1])) ||
           s.rfind("llama3-", 0) == 0 || s.rfind("qwen3-", 0) == 0;
}

// what every Qwen3 shares (Hugging Face's Qwen3Config): RMSNorm eps 1e-6, RoPE theta 1e6 without scaling
inline GPTConfig qwen3_defaults() {
    GPTConfig c;
    c.arch = Arch::Qwen3;
    c.norm_eps = 1e-6f, c.rope_theta = 1000000.0f, c.rope_scaling = 0.0f;
    return c;
}

// Meta's published Llama 3 shapes (Llama 3.1 8B, 70B, 405B; Llama 3.2 1B, 3B)
inline GPTConfig llama3_named(const std::string& s) {
    struct Shape {
        const char* name;
        int L, C, NH, multiple_of;
        float multiplier;
        int minor;  // Llama 3.2's small models tie the classifier to wte and scale RoPE by 32; Llama 3.1's by 8
    };
    for (Shape m : {Shape{"llama3-1b", 16, 2048, 32, 256, 1.5f, 2}, Shape{"llama3-3b", 28, 3072, 24, 256, 1.0f, 2},
                    Shape{"llama3-8b", 32, 4096, 32, 1024, 1.3f, 1}, Shape{"llama3-70b", 80, 8192, 64, 4096, 1.3f, 1},
                    Shape{"llama3-405b", 126, 16384, 128, 4096, 1.2f, 1}}) {
        if (s != m.name) continue;
        GPTConfig c;
        c.arch = Arch::Llama3;
        c.num_layers = m.L, c.channels = m.C, c.num_heads = m.NH, c.num_kv_heads = 8;
        c.multiple_of = m.multiple_of, c.ffn_dim_multiplier = m.multiplier;
        c.vocab_size = 128256, c.padded_vocab_size = pad_vocab(c.vocab_size), c.max_seq_len = 8192;
        c.version_minor = m.minor;
        c.tied_embeddings = m.minor == 2;
        c.rope_theta = 500000.0f, c.rope_scaling = m.minor == 2 ? 32.0f : 8.0f;
        validate_config(c, "-e " + s);
        return c;
    }
    fail("-e %s: Llama 3 sizes are llama3-1b, llama3-3b, llama3-8b, llama3-70b, llama3-405b; give other shapes as "
         "l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][e<E>k<K>][w]", s.c_str());
}

// Qwen3's published dense shapes (Qwen/Qwen3-0.6B, -1.7B, -4B, -8B's config.json): vocab 151936, 8 key/value
// heads of 128 channels whatever C/NH is, RMSNorm eps 1e-6, RoPE theta 1e6 unscaled, maxT 40960, the classifier
// tied to the embedding below 8B
inline GPTConfig qwen3_named(const std::string& s) {
    struct Shape {
        const char* name;
        int L, C, NH, H;
        bool tied;
    };
    for (Shape m : {Shape{"qwen3-0.6b", 28, 1024, 16, 3072, true}, Shape{"qwen3-1.7b", 28, 2048, 16, 6144, true},
                    Shape{"qwen3-4b", 36, 2560, 32, 9728, true}, Shape{"qwen3-8b", 36, 4096, 32, 12288, false}}) {
        if (s != m.name) continue;
        GPTConfig c = qwen3_defaults();
        c.num_layers = m.L, c.channels = m.C, c.num_heads = m.NH, c.num_kv_heads = 8, c.head_dim = 128;
        c.intermediate_size = m.H, c.tied_embeddings = m.tied;
        c.vocab_size = 151936, c.padded_vocab_size = pad_vocab(c.vocab_size), c.max_seq_len = 40960;
        validate_config(c, "-e " + s);
        return c;
    }
    fail("-e %s: Qwen3 sizes are qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b; give other shapes as "
         "q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][e<E>k<K>][w]", s.c_str());
}

inline GPTConfig parse_model_descriptor(const std::string& s) {
    if (s.rfind("llama3-", 0) == 0) return llama3_named(s);
    if (s.rfind("qwen3-", 0) == 0) return qwen3_named(s);
    bool llama = s[0] == 'l', qwen = s[0] == 'q';
    GPTConfig c = qwen ? qwen3_defaults() : GPTConfig{};
    if (llama) c.arch = Arch::Llama3;
    llama = llama || qwen;  // the Llama family's fields
    const char* p = s.c_str() + 1;
    auto number = [&](char key) {
        char* end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > (1 << 24)) fail("-e %s: bad number after '%c'", s.c_str(), key);
        p = end;
        return (int)v;
    };
    c.num_layers = number(s[0]);
    bool have_c = false, have_h = false, have_e = false, have_k = false;
    int hidden = 0;
    const char* fields = qwen    ? "q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][e<E>k<K>][w]"
                         : llama ? "l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][e<E>k<K>][w]"
                                 : "d<L>c<C>h<NH>[t<maxT>][v<V>][e<E>k<K>]";
    while (*p) {
        char key = *p++;
        bool known = true;
        switch (key) {
            case 'c': c.channels = number(key), have_c = true; break;
            case 'h': c.num_heads = number(key), have_h = true; break;
            case 't': c.max_seq_len = number(key); break;
            case 'v': c.vocab_size = number(key); break;
            case 'e': c.num_experts = number(key), have_e = true; break;
            case 'k': c.top_k = number(key), have_k = true; break;
            case 'g': known = llama && (c.num_kv_heads = number(key)); break;
            case 'f': known = llama && (hidden = number(key)); break;
            case 'd': known = qwen && (c.head_dim = number(key)); break;
            case 'w': known = c.tied_embeddings = llama && !*p; break;  // a flag, last
            default: known = false;
        }
        if (!known) fail("-e %s: unknown field '%c' (expected %s)", s.c_str(), key, fields);
    }
    if (have_e != have_k) fail("-e %s: experts need both e<E> and k<K>", s.c_str());
    c.padded_vocab_size = pad_vocab(c.vocab_size);
    if (qwen) {  // H hidden units as given (default Meta's rule, as a Llama's)
        if (!have_c || !have_h) fail("-e %s: a Qwen3 shape needs c<channels> and h<heads>", s.c_str());
        c.intermediate_size = hidden;
        validate_config(c, "-e " + s);
        return c;
    }
    if (llama) {
        if (!have_c || !have_h) fail("-e %s: a Llama shape needs c<channels> and h<heads>", s.c_str());
        // H hidden units exactly: Meta's rule with multiple_of H and a multiplier that brings 2/3 of 4C to H + 1/2,
        // which truncates to H whatever the multiplier's rounding
        if (hidden > 0)
            c.multiple_of = hidden, c.ffn_dim_multiplier = (hidden + 0.5f) / (int)(2.0 * (4L * c.channels) / 3);
        validate_config(c, "-e " + s);
        if (hidden > 0 && c.hidden() != hidden) fail("-e %s: no Llama MLP rule gives %d hidden units", s.c_str(), hidden);
        return c;
    }
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
// activations: what forward keeps for backward, sized for B×T; per-layer buffers are stacked layer 0 first

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
    long expert_rows;  // ... and the rows this rank's experts may see at most (llmc/moe.cuh)
};

inline LocalDims local_dims(const GPTConfig& c, const TPSpec& tp, int B, int T, int cp = 1, int ep = 1) {
    LocalDims d;
    d.B = B, d.T = T / cp, d.C = c.channels, d.ring = cp > 1;
    d.BT = (long)B * d.T;
    d.K = c.moe() ? c.top_k : 0;
    d.expert_rows = c.moe() ? (long)ep * d.BT * std::min(c.top_k, c.num_experts / ep) : 0;
    d.R = tp.sp ? d.BT / tp.size : d.BT;
    ModelTable table = model_table(c);
    d.Cl = (int)(table[ATTPROJW].cols / tp.size), d.Hl = (int)(table[FCPROJW].cols / tp.size);
    d.NHl = c.num_heads / tp.size, d.KVl = c.kv_heads(tp.size), d.hd = c.head_size();
    d.QKVl = (int)table[QKVW].local_rows(tp.size), d.FCl = (int)table[FCW].local_rows(tp.size);
    d.Vl = vocab_rows(c.padded_vocab_size, tp.size);
    d.means = c.norm() == Norm::LayerNorm;
    d.qk_norm = c.qk_norm();
    return d;
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
    // inputs above: the output gradients of the layer's four matmuls
    floatX *dqkv, *dattproj, *dfch, *dfcproj;
    // with experts: the rows they took (expert-major) and the rows they gave back (dispatch order); fch and
    // fch_gelu then hold the experts' rows too
    floatX *moe_in, *moe_out;
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
// four matmuls are kept only under a split backward (the projections' whole: under sp they are gathered before
// the matmul; the MLP's two not for experts, whose weight gradients backward takes at once); with experts the
// rows the experts took (expert-major) and gave back (dispatch order), and the hidden layers the experts' rows.
template <typename floatX>
inline std::vector<ActivationBuffer> layer_buffers(Activations<floatX>& a, const LocalDims& d, bool split) {
    size_t BT = d.BT, R = d.R, C = d.C, S = split, mlp_rows = d.K ? d.expert_rows : BT, M = split && !d.K;
    size_t means = d.means ? R : 0, QK = d.qk_norm;
    return {buffer("ln1", a.ln1, R * C, RECOMPUTE_NORMS), buffer("ln1_mean", a.ln1_mean, means), buffer("ln1_rstd", a.ln1_rstd, R),
            buffer("qkv", a.qkv, BT * d.QKVl), buffer("att", a.att, attention_state_floats(d, device_of<floatX>)),
            buffer("atty", a.atty, BT * d.Cl), buffer("attproj", a.attproj, R * C), buffer("residual2", a.residual2, R * C),
            buffer("ln2", a.ln2, R * C, RECOMPUTE_NORMS), buffer("ln2_mean", a.ln2_mean, means), buffer("ln2_rstd", a.ln2_rstd, R),
            buffer("fch", a.fch, mlp_rows * d.FCl), buffer("fch_act", a.fch_act, mlp_rows * d.Hl, RECOMPUTE_ACTIVATION),
            buffer("fcproj", a.fcproj, R * C), buffer("residual3", a.residual3, R * C), buffer("dqkv", a.dqkv, S * BT * d.QKVl),
            buffer("dattproj", a.dattproj, S * BT * C), buffer("dfch", a.dfch, M * BT * d.FCl), buffer("dfcproj", a.dfcproj, M * BT * C),
            buffer("moe_in", a.moe_in, d.expert_rows * C), buffer("moe_out", a.moe_out, d.K * BT * C),
            buffer("qkv_pre", a.qkv_pre, QK * BT * d.QKVl), buffer("qk_rstd", a.qk_rstd, QK * BT * (d.NHl + d.KVl))};
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

// the buffer whose size the shared buffer of recomputation level `level` takes: the level's largest (null: none)
inline const ActivationBuffer* largest_recomputed(const std::vector<ActivationBuffer>& per_layer, int level) {
    const ActivationBuffer* largest = nullptr;
    for (const ActivationBuffer& s : per_layer)
        if (s.recomputed == level && (!largest || s.count > largest->count)) largest = &s;
    return largest;
}

// The bytes of a micro-batch's activations in the storage type floatX: what each layer keeps, what the buffers
// around the layers hold, and the shared buffers of those -r recomputes. The plan's figures (llmc/plan.h).
struct ActivationBytes {
    size_t per_layer = 0, edges = 0, recomputed = 0;
};
template <typename floatX>
inline ActivationBytes activation_bytes(const LocalDims& d, bool split, int recompute, bool head, int tp) {
    Activations<floatX> a{};
    ActivationBytes b;
    std::vector<ActivationBuffer> per_layer = layer_buffers(a, d, split);
    for (const ActivationBuffer& s : per_layer) b.per_layer += kept_per_layer(s, recompute) * s.element;
    for (const ActivationBuffer& s : edge_buffers(a, d, head, tp)) b.edges += s.count * s.element;
    for (int level = RECOMPUTE_ACTIVATION; level <= recompute; level++)
        if (const ActivationBuffer* s = largest_recomputed(per_layer, level)) b.recomputed += s->count * s->element;
    return b;
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
// GEMM's packing panels and attention's rows per thread; on the GPU the shared kernel scratch of
// llmc/device.cuh); under tensor parallelism also the partial sums of row-parallel outputs, and under sequence
// parallelism the gathered output gradients, the reduced input gradients and a norm's output gathered (the
// layers keep their own rows of it: norm_rows). dact: the gradient of SwiGLU's
// output, which is half as wide as its input's (GPT-2's GELU takes its gradient in place: null)
template <typename floatX>
struct Scratch {
    floatX *dresidual, *dln, *dqkv, *datty, *dfch, *dact;
    float *attention, *gemm;
    floatX *partial, *gather, *whole, *dchunk, *norm_whole;
};

// the fp32 scratch the GPU kernels of one rank's forward and backward need at most (llmc/device.cuh)
inline size_t gpu_kernel_scratch_floats(const LocalDims& d) {
    size_t need = (size_t)(d.means ? layernorm_backward_scratch_floats(d.R, d.C) : rmsnorm_backward_scratch_floats(d.R, d.C));
    for (long oc : {(long)d.QKVl, (long)d.C, (long)d.FCl})  // the matmuls with a bias gradient (an expert's: all its rows)
        need = std::max(need, (size_t)matmul_backward_scratch_floats(std::max(d.BT, d.expert_rows), oc));
    need = std::max(need, attention_backward_scratch_floats(d.B, d.T, d.Cl, d.NHl));
    if (d.qk_norm) need = std::max(need, (size_t)qk_norm_backward_scratch_floats(d.BT, d.hd));
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
    bool dlogits = false;  // the logits hold their gradient already: a training forward took both in one pass
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
    float* rope = nullptr;  // Llama: RoPE's (cos, sin) per position and frequency (llmc/rope.cuh)
    // --fp8 (gpt_allocate_fp8): the layers' FP8 casts, their scales shared over the ranks that hold pieces of a
    // micro-batch's tensors (tp × cp), and the same buffers for the experts, whose scales tp alone shares
    bool fp8_on = false;
    Fp8Scaling<floatX> fp8, fp8_experts;

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
    int head_size = config.head_size();
    if (gpu && head_size != 64 && head_size != 128)
        fail("model: head size %d: the GPU attention kernels take 64 or 128", head_size);
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
    // a buffer in its element type (on the CPU every buffer is fp32)
    auto act = [&](const ActivationBuffer& s, size_t n) {
        *s.pointer = s.element == sizeof(float) ? (void*)led.alloc<floatX, float>(MEM_ACTIVATIONS, n)
                                                : (void*)led.alloc<floatX, floatX>(MEM_ACTIVATIONS, n);
    };
    // a recomputed buffer is one per level for every layer of every micro-batch (layer_slice steps through it
    // by 0), as large as the level's largest
    void* recomputed_buffer[RECOMPUTE_NORMS + 1] = {};
    Activations<floatX> sizing{};
    std::vector<ActivationBuffer> per_layer = layer_buffers(sizing, d, split_backward);
    for (int level = RECOMPUTE_ACTIVATION; level <= recompute; level++)
        if (const ActivationBuffer* s = largest_recomputed(per_layer, level)) act(*s, s->count), recomputed_buffer[level] = *s->pointer;
    m.slots.resize(slots);
    for (MicroBatchSlot<floatX>& mb : m.slots) {
        Activations<floatX>& a = mb.acts;
        std::vector<ActivationBuffer> edges = edge_buffers(a, d, part.last, tp.size);
        act(edges[0], edges[0].count);  // the embeddings' output
        for (const ActivationBuffer& s : layer_buffers(a, d, split_backward)) {
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
    s.dqkv = scr(BT * d.QKVl);
    s.datty = scr(BT * d.Cl);
    s.dfch = scr(mlp_rows * d.FCl);
    s.dact = d.FCl != d.Hl ? scr(mlp_rows * d.Hl) : nullptr;
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
    s.norm_whole = tp.sp ? scr(BT * C) : nullptr;
    m.tp.gather = s.gather;
    if (!config.learned_positions()) {  // RoPE's (cos, sin) table for every position the model takes
        size_t n = (size_t)config.max_seq_len * d.hd;
        std::vector<float> table(n);
        rope_table(table.data(), config.max_seq_len, d.hd, config.rope_theta, config.rope_scaling);
        m.rope = led.alloc<floatX, float>(MEM_SCRATCH, n);
        device_upload<floatX>(m.rope, table.data(), n);
    }
    // under cp, a learned position table is gathered at the rank's positions (C wide); RoPE reads the positions
    m.cp.allocate(led, B, T, config.learned_positions() ? (int)C : 0, RingHeads{d.Cl, d.NHl, d.KVl});
    m.moe.ep_size = ep;
    // the experts are gated (SwiGLU) when the MLP's first matmul is twice as wide as its hidden units
    m.moe.allocate(led, config.num_experts, config.top_k, config.num_layers, BT, (int)C, d.FCl != d.Hl);
}

// the sizes the model works with on a micro-batch of B×T tokens
template <typename floatX>
inline LocalDims model_dims(const GPTModel<floatX>& m, int B, int T) {
    return local_dims(m.config, m.tp.spec, B, T, m.cp.spec.size, m.moe.ep_size);
}

// The FP8 casts' buffers (llmc/fp8.cuh) for a rank's layer matmuls: inputs up to the widest of ln's C, attention's
// Cl and the MLP's Hl; outputs up to the widest of qkv's, the projections' C and the MLP's first; the largest
// weight; on the rows of a micro-batch or, with experts, the most an expert may see; group: the ranks whose
// amaxes are gathered (tp × cp)
inline Fp8Sizes fp8_layer_sizes(const LocalDims& d, int group, Device dev) {
    long rows = std::max(d.BT, d.expert_rows);
    long in = std::max({(long)d.C, (long)d.Cl, (long)d.Hl}), out = std::max({(long)d.QKVl, (long)d.C, (long)d.FCl});
    size_t weight = std::max({(size_t)d.QKVl * d.C, (size_t)d.C * d.Cl, (size_t)d.FCl * d.C, (size_t)d.C * d.Hl});
    return fp8_sizes(rows, in, out, weight, group, dev);
}

// --fp8 1: the buffers of the FP8 casts, after gpt_allocate; the groups are set with the rest of the comms
template <typename floatX>
inline void gpt_allocate_fp8(GPTModel<floatX>& m) {
    constexpr Device dev = device_of<floatX>;
    if (m.config.num_layers <= 2)
        fail("--fp8 1: the first and the last layer stay bf16, so a model of %d layers has none to run in FP8",
             m.config.num_layers);
    if (dev == Device::CUDA) fp8_check_gpu();
    LocalDims d = model_dims(m, m.B, m.T);
    // cuBLASLt's FP8 kernels want every K, and the leading dimensions, a multiple of 16 (the rows are padded)
    for (long k : {(long)d.C, (long)d.Cl, (long)d.Hl, (long)d.QKVl, (long)d.FCl})
        if (dev == Device::CUDA && k % 16 != 0)
            fail("--fp8 1: the rank's matmul widths (C %d, C/tp %d, hidden %d, qkv %d, MLP in %d) must be multiples of 16",
                 d.C, d.Cl, d.Hl, d.QKVl, d.FCl);
    Fp8Sizes z = fp8_layer_sizes(d, m.tp.size() * m.cp.spec.size, dev);
    using Code = typename Fp8Scaling<floatX>::Code;
    auto codes = [&](size_t n) { return n ? m.ledger.template alloc<floatX, Code>(MEM_SCRATCH, n) : nullptr; };
    Fp8Scaling<floatX>& q = m.fp8;
    q.input = codes(z.input), q.weight = codes(z.weight), q.grad = codes(z.grad), q.grad_t = codes(z.grad_t);
    q.scales = m.ledger.template alloc<floatX, float>(MEM_SCRATCH, z.floats);
    q.amaxes = q.scales + FP8_SCALE_FLOATS;
    m.fp8_experts = q;
    m.fp8_on = true;
}

// the FP8 state of model layer `layer`'s matmuls, its experts' with `experts`; null where they stay bf16: every
// layer without --fp8, and the first and the last layer with it
template <typename floatX>
inline const Fp8Scaling<floatX>* fp8_for(const GPTModel<floatX>& m, int layer, bool experts = false) {
    if (!m.fp8_on || layer == 0 || layer == m.config.num_layers - 1) return nullptr;
    return experts ? &m.fp8_experts : &m.fp8;
}

// a layer's router and experts, out of its unit's tensors (null for the biases a model has none of)
template <typename floatX>
inline ExpertTensors<floatX> expert_tensors(const GPTModel<floatX>& m, const ParamViews<floatX>& v) {
    auto held = [&](int t) { return m.table[t].block() > 0 ? v[t] : nullptr; };
    return {v[ROUTERW], v[FCW], held(FCB), v[FCPROJW], held(FCPROJB)};
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
// llm.c model files, fp32 (version 3) or bf16 (version 5). GPT-2's: a header of 256 int32 (magic 20240326,
// version, maxT, V, L, NH, C, Vp, and llm5d's experts E and top-K, 0 in a dense file), then the parameters in
// table order. Llama 3's (llm.c's llama3 branch): 256 int32 (magic 20240803, version, maxT, V, L, NH, KV, C,
// multiple_of, use_scaled_rope, major, minor; then llm5d's [12] and [13]: experts E and top-K, 0 in a dense
// file, and [14]: 1 if the classifier is tied to wte) and 256 float32 (ffn_dim_multiplier, norm_eps, rope_theta;
// then llm5d's [3]: RoPE's scaling factor where it is not llm.c's 8), then the tensors in GPT-2's slots: lm_head
// in wpe's (a tied model's wte again, so that llm.c reads it), and every bias slot present and zero (the table's
// file_rows). Each file keeps its format's vocab rows: GPT-2's the padded Vp its header gives, Llama 3's the V
// of the vocab (its header has no Vp), so reading a Llama file fills the padding rows memory adds with zeros,
// and writing one drops them. Qwen3's is llm5d's own, Llama 3's layout with int [15] 1, [16] the head size and
// [17] the MLP's hidden units ([8], [10] and [11] 0), and the QK-norm weights (L×hd for q, then for k) after
// lnfb's slot; llm.c reads none of it.

constexpr int LLAMA_MODEL_MAGIC = 20240803;

// the rows a model file holds of each vocab-split tensor (wte, lm_head), a prefix of the padded rows in memory
inline size_t file_vocab_rows(const GPTConfig& c) { return c.llama() ? c.vocab_size : c.padded_vocab_size; }

// Where each tensor lies in a model file and in the flat buffer, in elements
struct FileLayout {
    long header = 0;                      // bytes
    size_t file_start[NUM_PARAM_TENSORS];  // elements of the file before the tensor
    size_t file_size[NUM_PARAM_TENSORS];   // the tensor's elements in the file (zeros or a copy where it is absent;
                                           // of a vocab-split tensor its first file_vocab_rows rows)
    size_t flat_start[NUM_PARAM_TENSORS];  // elements of the flat buffer before it
    size_t elements = 0;                   // in the file
};
inline FileLayout file_layout(const GPTConfig& c) {
    ModelTable table = model_table(c);
    size_t sizes[NUM_PARAM_TENSORS], flat = 0;
    param_tensor_sizes(c, sizes);
    FileLayout f;
    f.header = c.llama() ? 2048 : 1024;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t blocks = (table[t].holder == Holder::Layer ? c.num_layers : 1) * (table[t].expert ? c.num_experts : 1);
        f.flat_start[t] = flat, flat += sizes[t];
        f.file_start[t] = f.elements;
        size_t held = table[t].split == TPSplit::Vocab ? file_vocab_rows(c) * table[t].cols : sizes[t];
        f.file_size[t] = table[t].block() > 0 ? held : table[t].file_copy >= 0 ? f.file_size[table[t].file_copy]
                                                                               : blocks * table[t].file_rows;
        f.elements += f.file_size[t];
    }
    return f;
}

// How many of a run's elements (a run of the whole model's flat buffer, inside one tensor) the model file holds:
// all but those in padding rows the file lacks, which end the tensor
inline size_t stored_count(const GPTConfig& c, const FileLayout& layout, const ShareRun& r) {
    int t = param_coord(c, r.whole).tensor;
    size_t at = r.whole - layout.flat_start[t];
    return at < layout.file_size[t] ? std::min(r.count, layout.file_size[t] - at) : 0;
}

// the parts of runs that the model file holds, in the same order (what a checkpoint stores of them)
inline std::vector<ShareRun> stored_runs(const GPTConfig& c, const std::vector<ShareRun>& runs) {
    FileLayout layout = file_layout(c);
    std::vector<ShareRun> stored;
    for (const ShareRun& r : runs)
        if (size_t n = stored_count(c, layout, r)) stored.push_back({r.whole, r.local, n});
    return stored;
}

// what a Llama adds to the shape GPT-2's L, C, NH, V and maxT say, in the lines that print a model ("" for GPT-2)
inline std::string llama_shape(const GPTConfig& c) {
    if (!c.llama()) return "";
    std::string scaling = c.rope_scaling > 0 ? strfmt(" scaled x%g", c.rope_scaling) : "";
    std::string family = c.arch == Arch::Qwen3 ? strfmt("Qwen3 hd=%d", c.head_size())
                                               : strfmt("Llama %d.%d", c.version_major, c.version_minor);
    return strfmt(" %s KV=%d H=%d eps=%g theta=%g%s%s", family.c_str(), c.kv_heads(), c.hidden(), c.norm_eps,
                  c.rope_theta, scaling.c_str(), c.tied_embeddings ? " tied" : "");
}

inline bool same_model_shape(const GPTConfig& a, const GPTConfig& b) {
    return a.arch == b.arch && a.num_layers == b.num_layers && a.channels == b.channels && a.num_heads == b.num_heads &&
           a.kv_heads() == b.kv_heads() && a.vocab_size == b.vocab_size && a.padded_vocab_size == b.padded_vocab_size &&
           a.max_seq_len == b.max_seq_len && a.num_experts == b.num_experts && a.top_k == b.top_k &&
           a.head_size() == b.head_size() &&
           (!a.llama() || (a.hidden() == b.hidden() && a.norm_eps == b.norm_eps && a.rope_theta == b.rope_theta &&
                           a.rope_scaling == b.rope_scaling && a.tied_embeddings == b.tied_embeddings));
}

inline GPTConfig read_model_header(const std::string& path, int* version) {
    File f(path, "rb");
    int h[256];
    float hf[256] = {};
    if (f.size() < (long)sizeof(h)) fail("%s: too short for a model header", path.c_str());
    f.read(h, sizeof(h));
    if (h[0] != MODEL_MAGIC && h[0] != LLAMA_MODEL_MAGIC)
        fail("%s: not an llm.c model file (magic %d, expected %d for GPT-2 or %d for Llama 3)", path.c_str(), h[0],
             MODEL_MAGIC, LLAMA_MODEL_MAGIC);
    if (h[1] != MODEL_VERSION_FP32 && h[1] != MODEL_VERSION_BF16)
        fail("%s: unsupported model version %d (expected 3 for fp32 or 5 for bf16)", path.c_str(), h[1]);
    GPTConfig c;
    c.max_seq_len = h[2];
    c.vocab_size = h[3];
    c.num_layers = h[4];
    c.num_heads = h[5];
    if (h[0] == LLAMA_MODEL_MAGIC) {
        if (f.size() < (long)(sizeof(h) + sizeof(hf))) fail("%s: too short for a Llama 3 model header", path.c_str());
        f.read(hf, sizeof(hf));
        c.arch = Arch::Llama3;
        c.num_kv_heads = h[6];
        c.channels = h[7];
        c.padded_vocab_size = pad_vocab(c.vocab_size);  // the file's rows are the vocab's: the padding is memory's
        if (h[15] != 1) {  // Llama 3's MLP rule and version (Qwen3's: slots 15 to 17 below)
            c.multiple_of = h[8];
            c.version_major = h[10], c.version_minor = h[11];
        }
        // header[12] and [13]: llm5d's experts and their top-K (0 and 0 in a dense file)
        if (h[12] > 1 || h[13] > 1) c.num_experts = h[12], c.top_k = h[13];
        else if (h[12] != h[13]) fail("%s: header says %d experts with top-%d routing", path.c_str(), h[12], h[13]);
        c.ffn_dim_multiplier = hf[0], c.norm_eps = hf[1], c.rope_theta = hf[2];
        if (h[9] == 0 && hf[3] != 0) fail("%s: header gives RoPE a scaling factor %g but use_scaled_rope 0", path.c_str(), hf[3]);
        c.rope_scaling = h[9] == 0 ? 0.0f : hf[3] != 0 ? hf[3] : 8.0f;
        if (h[14] != 0 && h[14] != 1) fail("%s: header slot 14 (tied embeddings) is %d, not 0 or 1", path.c_str(), h[14]);
        c.tied_embeddings = h[14] == 1;
        // header[15]: 1 for llm5d's Qwen3 (Llama 3's layout, QK-norm's weights after the final norm's slots),
        // with its head size and MLP size in [16] and [17]
        if (h[15] == 1) {
            c.arch = Arch::Qwen3;
            c.head_dim = h[16], c.intermediate_size = h[17];
            if (c.head_dim < 2 || c.intermediate_size < 1)
                fail("%s: a Qwen3 header needs its head size and MLP size (slots 16 and 17: %d, %d)", path.c_str(),
                     h[16], h[17]);
        } else if (h[15] != 0) {
            fail("%s: header slot 15 (the architecture) is %d: 0 is Llama 3, 1 Qwen3", path.c_str(), h[15]);
        }
    } else {
        c.channels = h[6];
        c.padded_vocab_size = h[7];
        // header[8] and [9]: the experts and their top-K (0 and 0 in llm.c's dense files)
        if (h[8] > 1 || h[9] > 1) c.num_experts = h[8], c.top_k = h[9];
        else if (h[8] != h[9]) fail("%s: header says %d experts with top-%d routing", path.c_str(), h[8], h[9]);
    }
    validate_config(c, path);
    FileLayout layout = file_layout(c);
    long expected = layout.header + (long)(layout.elements * (h[1] == MODEL_VERSION_FP32 ? 4 : 2));
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

// n values of a model file from element `at` on, as fp32
inline void read_file_values(File& f, const FileLayout& layout, int version, size_t at, size_t n, float* dst) {
    if (version == MODEL_VERSION_FP32) return f.read_at(dst, n * 4, layout.header + (long)at * 4);
    std::vector<uint16_t> halves(n);
    f.read_at(halves.data(), n * 2, layout.header + (long)at * 2);
    for (size_t i = 0; i < n; i++) dst[i] = bf16_bits_to_float(halves[i]);
}

// Reads the runs of the parameters that a rank holds (`runs`: where each run of `params` lies in the whole model)
// from a model file whose header matches mc, fp32 or bf16, and zeros their padding rows the file lacks (a Llama
// file's vocab rows past V). A NaN or Inf is refused, naming the tensor, since training from it could only
// produce NaN; so is a nonzero value in a slot the model does not have (a Llama's biases), which this model
// could not represent.
inline void gpt_read_params(const GPTConfig& mc, float* params, const std::vector<ShareRun>& runs, const std::string& path) {
    int version;
    GPTConfig c = read_model_header(path, &version);
    if (!same_model_shape(c, mc)) fail("%s: model shape differs from the run's model", path.c_str());
    FileLayout layout = file_layout(c);
    ModelTable table = model_table(c);
    File f(path, "rb");
    for (const ShareRun& r : runs) {
        int t = param_coord(c, r.whole).tensor;
        float* dst = params + r.local;
        size_t n = stored_count(c, layout, r);
        read_file_values(f, layout, version, layout.file_start[t] + (r.whole - layout.flat_start[t]), n, dst);
        std::fill(dst + n, dst + r.count, 0.0f);
        size_t bad = first_non_finite(dst, n);
        if (bad < n)
            fail("%s: %g in %s (a model must be finite)", path.c_str(), dst[bad], describe_param(c, r.whole + bad).c_str());
    }
    // the slots this model lacks, a million values at a time: zeros, or the copy of the tensor they repeat
    std::vector<float> absent, copied;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (table[t].block() > 0) continue;
        int source = table[t].file_copy;
        for (size_t at = 0, n; at < layout.file_size[t]; at += n) {
            n = std::min(layout.file_size[t] - at, (size_t)1 << 20);
            absent.resize(n), copied.assign(n, 0.0f);
            read_file_values(f, layout, version, layout.file_start[t] + at, n, absent.data());
            if (source >= 0) read_file_values(f, layout, version, layout.file_start[source] + at, n, copied.data());
            for (size_t i = 0; i < n; i++) {
                if (absent[i] == copied[i]) continue;
                if (source >= 0)
                    fail("%s: %s differs from %s at element %zu: the header ties the classifier to %s, so the two "
                         "must be equal", path.c_str(), table[t].name, table[source].name, at + i, table[source].name);
                fail("%s: %s holds %g at element %zu: this Llama has no biases, so every bias slot must be zero",
                     path.c_str(), table[t].name, absent[i], at + i);
            }
        }
    }
}

// reads a whole model file into params (a flat buffer)
inline void gpt_load_params(const GPTConfig& mc, float* params, const std::string& path) {
    gpt_read_params(mc, params, whole_runs(mc), path);
}

// n values to a model file: fp32 as they are, or bf16 rounded to nearest even (null: n zeros)
inline void write_file_values(File& f, const float* values, size_t n, int version) {
    std::vector<float> zeros(values ? 0 : std::min(n, (size_t)1 << 20), 0.0f);
    std::vector<uint16_t> halves(version == MODEL_VERSION_FP32 ? 0 : std::min(n, (size_t)1 << 20));
    for (size_t done = 0; done < n;) {
        size_t k = std::min(n - done, values ? n - done : zeros.size());
        const float* v = values ? values + done : zeros.data();
        if (version == MODEL_VERSION_FP32) {
            f.write(v, k * 4);
        } else {
            k = std::min(k, halves.size());
            for (size_t i = 0; i < k; i++) halves[i] = float_to_bf16_bits(v[i]);  // the values are finite
            f.write(halves.data(), k * 2);
        }
        done += k;
    }
}

// writes an llm.c model file from a flat parameter buffer: fp32 (version 3), or bf16 (version 5) rounded to
// nearest even; returns the checksum of the bytes written
inline uint64_t gpt_save_params(const GPTConfig& c, const float* params, const std::string& path,
                                int version = MODEL_VERSION_FP32) {
    int h[256] = {};
    float hf[256] = {};
    h[1] = version;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    if (c.llama()) {
        h[0] = LLAMA_MODEL_MAGIC;
        h[6] = c.kv_heads();
        h[7] = c.channels;
        h[8] = c.multiple_of;
        h[9] = c.rope_scaling > 0;
        h[10] = c.version_major, h[11] = c.version_minor;
        if (c.moe()) h[12] = c.num_experts, h[13] = c.top_k;
        h[14] = c.tied_embeddings;
        if (c.arch == Arch::Qwen3) {  // its H is given, and it has no Llama version: those slots hold 0
            h[8] = h[10] = h[11] = 0;
            h[15] = 1, h[16] = c.head_size(), h[17] = c.hidden();
        }
        hf[0] = c.ffn_dim_multiplier, hf[1] = c.norm_eps, hf[2] = c.rope_theta;
        hf[3] = c.rope_scaling == 8.0f ? 0.0f : c.rope_scaling;  // llm.c's files stay llm.c's, byte for byte
    } else {
        h[0] = MODEL_MAGIC;
        h[6] = c.channels;
        h[7] = c.padded_vocab_size;
        if (c.moe()) h[8] = c.num_experts, h[9] = c.top_k;  // a dense file stays llm.c's, byte for byte
    }
    FileLayout layout = file_layout(c);
    File f(path, "wb");
    f.write(h, sizeof(h));
    if (c.llama()) f.write(hf, sizeof(hf));
    ModelTable table = model_table(c);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int source = table[t].block() > 0 ? t : table[t].file_copy;
        write_file_values(f, source >= 0 ? params + layout.flat_start[source] : nullptr, layout.file_size[t], version);
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

// The architecture's norm (llmc/model_table.h): GPT-2's layernorm keeps a mean and has a bias, RMSNorm neither
template <typename floatX>
inline void norm_forward(const GPTConfig& c, floatX* out, float* mean, float* rstd, const floatX* inp,
                         const floatX* weight, const floatX* bias, long rows, long C) {
    if (c.norm() == Norm::RMSNorm) rmsnorm_forward(out, rstd, inp, weight, rows, (int)C, c.norm_eps);
    else layernorm_forward(out, mean, rstd, inp, weight, bias, rows, (int)C);
}
// ... fused with the residual add before it: residual = inp1 + inp2, out = norm(residual)
template <typename floatX>
inline void fused_residual_norm_forward(const GPTConfig& c, floatX* residual, floatX* out, float* mean, float* rstd,
                                        const floatX* inp1, const floatX* inp2, const floatX* weight,
                                        const floatX* bias, long rows, long C) {
    if (c.norm() == Norm::RMSNorm)
        fused_residual_rmsnorm_forward(residual, out, rstd, inp1, inp2, weight, rows, (int)C, c.norm_eps);
    else fused_residual_layernorm_forward(residual, out, mean, rstd, inp1, inp2, weight, bias, rows, (int)C);
}
template <typename floatX>
inline void norm_backward(const GPTConfig& c, floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout,
                          const floatX* inp, const floatX* weight, const float* mean, const float* rstd, long rows,
                          long C) {
    if (c.norm() == Norm::RMSNorm) rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, rows, (int)C);
    else layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, (int)C);
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

// A layer's mixture of experts (llmc/moe.cuh) in place of its MLP, for either architecture's layer body:
// forward from the norm's output ln2 (every row), and backward from the MLP output's gradient dout (SwiGLU
// experts take the hidden units' gradient in a buffer of its own, half as wide as the first matmul's)
template <typename floatX>
inline void layer_experts_forward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                                  const floatX* ln2, const ParamViews<floatX>& w, MoERoute& route, int layer) {
    m.moe.forward(la.fcproj, m.scratch.partial, route, la.moe_in, la.fch, la.fch_act, la.moe_out, ln2,
                  expert_tensors(m, w), B, d.T, d.C, d.Hl, m.tp, m.cp, layer, m.scratch.gemm, fp8_for(m, layer, true));
}
template <typename floatX>
inline void layer_experts_backward(GPTModel<floatX>& m, const LocalDims& d, int B, const Activations<floatX>& la,
                                   const ParamViews<floatX>& w, const ParamViews<floatX>& dw, const MoERoute& route,
                                   const floatX* dout, float dloss, int layer) {
    Scratch<floatX>& s = m.scratch;
    const floatX* ln2 = norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
    floatX* dhidden = d.FCl != d.Hl ? s.dact : s.dfch;
    m.moe.backward(s.dln, expert_tensors(m, dw), dout, dhidden, s.dfch, route, la.moe_in, la.fch, la.fch_act, la.moe_out,
                   ln2, expert_tensors(m, w), B, d.T, d.C, d.Hl, m.tp, dloss, s.gemm, fp8_for(m, layer, true));
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
    float* ws = m.scratch.gemm;
    floatX* partial = m.scratch.partial;
    const Fp8Scaling<floatX>* fp8 = fp8_for(m, layer);
    if (!in.prev) norm_forward(c, la.ln1, la.ln1_mean, la.ln1_rstd, in.chunk_input, w[LN1W], w[LN1B], R, C);
    else fused_residual_norm_forward(c, in.prev->residual3, la.ln1, la.ln1_mean, la.ln1_rstd, in.prev->residual2,
                                     in.prev->fcproj, w[LN1W], w[LN1B], R, C);
    matmul_forward(d.qk_norm ? la.qkv_pre : la.qkv, norm_rows(m, la.ln1, BT, C), w[QKVW], w[QKVB], BT, C, d.QKVl, ws,
                   fp8);
    if (d.qk_norm) qk_norm_forward(la.qkv, la.qk_rstd, la.qkv_pre, w[QNORMW], w[KNORMW], BT, d.NHl, d.KVl, d.hd, c.norm_eps);
    if (!c.learned_positions()) rope_forward(la.qkv, m.rope, m.cp.token_positions(), B, d.T, d.NHl, d.KVl, d.hd);
    m.cp.attention_forward(la.atty, la.att, la.qkv, B, d.T, d.Cl, d.NHl, d.KVl);
    tp.row_parallel_forward(la.attproj, partial, la.atty, w[ATTPROJW], w[ATTPROJB], BT, d.Cl, C, ws, fp8);
    fused_residual_norm_forward(c, la.residual2, la.ln2, la.ln2_mean, la.ln2_rstd, in.residual(), la.attproj,
                                w[LN2W], w[LN2B], R, C);
    const floatX* ln2 = norm_rows(m, la.ln2, BT, C);
    if (route) return layer_experts_forward(m, d, B, la, ln2, w, *route, layer);
    if (c.activation() == Activation::GELU) {
        matmul_gelu_forward(la.fch_act, la.fch, ln2, w[FCW], w[FCB], BT, C, d.Hl, ws, fp8);
    } else {
        matmul_forward(la.fch, ln2, w[FCW], w[FCB], BT, C, d.FCl, ws, fp8);
        swiglu_forward(la.fch_act, la.fch, BT, d.Hl);
    }
    tp.row_parallel_forward(la.fcproj, partial, la.fch_act, w[FCPROJW], w[FCPROJB], BT, d.Hl, C, ws, fp8);
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
    float* ws = m.scratch.gemm;
    floatX* partial = m.scratch.partial;
    NvtxRange pass("forward");
    auto [low_unit, high_unit] = chunk_units(part, chunk);
    if (m.store) m.store->begin_pass(false, low_unit, high_unit);

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
        MoERoute* route = c.moe() ? &mb.routes[i] : nullptr;
        layer_forward(m, d, B, la, in, w, route, part.model_layer(lo + i));
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
    if (m.store) m.store->end_pass();
    if (!targets) return -1.0f;
    if (tp.on()) {
        mb.loss = tp.crossentropy_forward(a.losses, a.lse, a.logits, mb.device_targets, BT, V, d.Vl);
    } else if (dloss > 0.0f) {  // training: the logits' gradient from the same read of them
        mb.loss = crossentropy_fused(a.losses, a.logits, mb.device_targets, BT, V, c.padded_vocab_size, dloss);
        mb.dlogits = true;
    } else {
        mb.loss = crossentropy_forward(a.losses, a.logits, mb.device_targets, BT, V, c.padded_vocab_size);
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

// What forward did not keep under -r, computed again exactly as forward did where a layer's backward or its
// weight-gradient step reads it: the MLP's activation (-r 1: GELU's output, or SwiGLU's product), the norms'
// outputs (-r 2: norm_rows_again)
template <typename floatX>
inline void recompute_activation(GPTModel<floatX>& m, const Activations<floatX>& la, const LocalDims& d, long rows) {
    if (m.recompute < RECOMPUTE_ACTIVATION) return;
    if (m.config.activation() == Activation::SwiGLU) swiglu_forward(la.fch_act, la.fch, rows, d.Hl);
    else gelu_forward(la.fch_act, la.fch, rows * d.Hl);
}

template <typename floatX>
inline void gpt_zero_grad(GPTModel<floatX>& m) { device_zero<floatX>(m.grads, m.num_parameters); }

// One layer, backward, for every architecture: the forward's calls in reverse. The scratch's dresidual carries
// the gradient of the residual stream: each branch reads it and adds its input gradient back (the residual add
// passes gradient to both of its inputs unchanged). `residual`: the layer's input. GELU's backward goes on
// from the MLP projection's input gradient in one call, which also sums fc's bias gradient (on the GPU in the
// GEMM's epilogue); SwiGLU's output gradient (half as wide as its input's) has a buffer of its own. RoPE's
// backward turns dq and dk back in place. A split backward (the zero-bubble pipeline) leaves the matmuls'
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
    float* ws = s.gemm;
    floatX* dln_rows = tp.spec.sp ? s.dchunk : s.dln;  // a norm output's gradient, reduced to this rank's rows
    floatX* none = nullptr;
    bool split = m.split_backward, gelu = c.activation() == Activation::GELU;
    auto now = [&](floatX* grad) { return split ? nullptr : grad; };
    floatX *dfch = split ? la.dfch : s.dfch, *dqkv = split ? la.dqkv : s.dqkv;
    const Fp8Scaling<floatX>* fp8 = fp8_for(m, layer);
    recompute_activation(m, la, d, route ? route->rows : BT);

    const floatX* dout = tp.all_rows(s.dresidual, s.whole, BT, C);
    if (route) {
        layer_experts_backward(m, d, B, la, w, dw, *route, dout, dloss, layer);
    } else {
        if (split) device_copy<floatX>(la.dfcproj, dout, BT * C);
        if (gelu) {  // a split backward leaves fc's bias gradient with its weight gradient to the W step
            gelu_matmul_backward(dfch, now(dw[FCPROJW]), now(dw[FCPROJB]), now(dw[FCB]), dout, la.fch_act, la.fch,
                                 w[FCPROJW], BT, d.Hl, C, ws, fp8);
        } else {
            matmul_backward(s.dact, now(dw[FCPROJW]), now(dw[FCPROJB]), dout, la.fch_act, w[FCPROJW], BT, d.Hl, C, ws,
                            fp8);
            swiglu_backward(dfch, la.fch, s.dact, BT, d.Hl);
        }
        // the norm's output is read by the weight gradient alone (a split backward's W step reads it there)
        const floatX* ln2 =
            split ? none : norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
        matmul_backward(s.dln, now(dw[FCW]), gelu ? none : now(dw[FCB]), dfch, ln2, w[FCW], BT, C, d.FCl, ws, fp8);
    }
    tp.reduce_rows(s.dln, dln_rows, BT, C);
    norm_backward(c, s.dresidual, dw[LN2W], dw[LN2B], dln_rows, la.residual2, w[LN2W], la.ln2_mean, la.ln2_rstd, R, C);
    dout = tp.all_rows(s.dresidual, s.whole, BT, C);
    if (split) device_copy<floatX>(la.dattproj, dout, BT * C);
    matmul_backward(s.datty, now(dw[ATTPROJW]), now(dw[ATTPROJB]), dout, la.atty, w[ATTPROJW], BT, d.Cl, C, ws, fp8);
    m.cp.attention_backward(dqkv, s.datty, la.qkv, la.atty, la.att, B, d.T, d.Cl, d.NHl, d.KVl, s.attention);
    if (!c.learned_positions()) rope_backward(dqkv, m.rope, m.cp.token_positions(), B, d.T, d.NHl, d.KVl, d.hd);
    if (d.qk_norm)
        qk_norm_backward(dqkv, dw[QNORMW], dw[KNORMW], dqkv, la.qkv_pre, w[QNORMW], w[KNORMW], la.qk_rstd, BT, d.NHl,
                         d.KVl, d.hd);
    const floatX* ln1 =
        split ? none : norm_rows_again(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
    matmul_backward(s.dln, now(dw[QKVW]), now(dw[QKVB]), dqkv, ln1, w[QKVW], BT, C, d.QKVl, ws, fp8);
    tp.reduce_rows(s.dln, dln_rows, BT, C);
    norm_backward(c, s.dresidual, dw[LN1W], dw[LN1B], dln_rows, residual, w[LN1W], la.ln1_mean, la.ln1_rstd, R, C);
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
        // the classifier: logits turn into their gradient in place, then through its weight and the final norm
        if (tp.on()) tp.crossentropy_backward_inplace(a.logits, a.lse, mb.device_targets, BT, V, d.Vl, dloss);
        else if (!mb.dlogits) crossentropy_backward_inplace(a.logits, nullptr, mb.device_targets, BT, V, c.padded_vocab_size, dloss);
        int unit = classifier_unit(c, Lp), t = classifier_tensor(c);
        ParamViews<floatX> cls = unit_params(m, unit), dcls = unit_grads(m, unit);
        matmul_backward(s.dln, dcls[t], (floatX*)nullptr, a.logits, a.lnf, cls[t], BT, C, d.Vl, ws);
        tp.reduce_rows(s.dln, dln_rows, BT, C);
        device_zero<floatX>(s.dresidual, R * C);
        const floatX* last_residual = layer_slice(a, n - 1, d, m.recompute, m.split_backward).residual3;
        ParamViews<floatX> fin = unit_params(m, HEAD_UNIT), dfin = unit_grads(m, HEAD_UNIT);
        norm_backward(c, s.dresidual, dfin[LNFW], dfin[LNFB], dln_rows, last_residual, fin[LNFW], a.lnf_mean,
                      a.lnf_rstd, R, C);
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
        MoERoute* route = c.moe() ? &mb.routes[i] : nullptr;
        int layer_index = part.model_layer(lo + i);
        layer_backward(m, d, B, la, residual, w, dw, route, dloss, layer_index);
        done(unit);
    }
    if (part.starts_model(chunk)) {
        ParamViews<floatX> demb = unit_grads(m, embedding_unit(Lp));
        floatX* dpositions = c.learned_positions() ? cp.position_grads_begin(demb[WPE], C) : nullptr;
        tp.embedding_backward(demb[WTE], dpositions, s.dresidual, s.whole, mb.device_inputs, B, d.T, C, d.Vl);
        if (dpositions) cp.position_grads_end(demb[WPE], C);
    }
    // the embeddings' unit goes with the part's first chunk, whose backward of a micro-batch comes last: on the
    // last stage its wte gradient, the classifier's, is complete by then too (empty on the middle stages)
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
    return part.starts_model(chunk) ? nullptr : s.dresidual;
}

// The weight gradients a split backward of chunk `chunk` left for later (the W step of the zero-bubble
// pipeline): the four matmuls of each of its layers (a bias gradient where the table has the bias), from the
// output gradients backward kept and the inputs forward kept (computed again where -r does not keep them). The
// units' gradients are complete after it. With experts it is attention's two: an expert's matmuls see a different number of rows in every micro-batch, and
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
    if (chunk == part.chunks() - 1) done(HEAD_UNIT);
    for (int i = n - 1; i >= 0; i--) {
        Activations<floatX> la = layer_slice(mb.acts, i, d, m.recompute, true);
        const floatX* residual = i == 0 ? mb.acts.encoded : layer_slice(mb.acts, i - 1, d, m.recompute, true).residual3;
        int unit = layer_unit(Lp, lo + i);
        ParamViews<floatX> w = unit_params(m, unit), dw = unit_grads(m, unit);
        const Fp8Scaling<floatX>* fp8 = fp8_for(m, part.model_layer(lo + i));
        floatX* none = nullptr;
        if (!m.config.moe()) {
            recompute_activation(m, la, d, BT);
            matmul_backward(none, dw[FCPROJW], dw[FCPROJB], la.dfcproj, la.fch_act, w[FCPROJW], BT, d.Hl, C, ws, fp8);
            const floatX* ln2 = norm_rows_again(m, d, la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, w[LN2W], w[LN2B]);
            matmul_backward(none, dw[FCW], dw[FCB], la.dfch, ln2, w[FCW], BT, C, d.FCl, ws, fp8);
        }
        matmul_backward(none, dw[ATTPROJW], dw[ATTPROJB], la.dattproj, la.atty, w[ATTPROJW], BT, d.Cl, C, ws, fp8);
        const floatX* ln1 = norm_rows_again(m, d, la.ln1, la.ln1_mean, la.ln1_rstd, residual, w[LN1W], w[LN1B]);
        matmul_backward(none, dw[QKVW], dw[QKVB], la.dqkv, ln1, w[QKVW], BT, C, d.QKVl, ws, fp8);
        done(unit);
    }
    if (chunk == 0) done(embedding_unit(Lp));
    if (m.store) m.store->end_pass();
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
    return sqrt(sum_of_squares(m.grads, ranges));
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

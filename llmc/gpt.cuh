// The GPT-2 model: its configuration, the flat parameter/gradient/optimizer buffers in llm.c's tensor order,
// the activation arena, llm.c-format model files, and forward()/backward()/update() written as explicit layer
// calls. Everything the model owns is allocated through its Ledger.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/ledger.h"
#include "llmc/matmul.cuh"
#include "llmc/residual.cuh"
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

inline void param_tensor_sizes(const GPTConfig& c, size_t sizes[NUM_PARAM_TENSORS]) {
    size_t L = c.num_layers, C = c.channels;
    sizes[WTE] = (size_t)c.padded_vocab_size * C;
    sizes[WPE] = (size_t)c.max_seq_len * C;
    sizes[LN1W] = L * C;
    sizes[LN1B] = L * C;
    sizes[QKVW] = L * 3 * C * C;
    sizes[QKVB] = L * 3 * C;
    sizes[ATTPROJW] = L * C * C;
    sizes[ATTPROJB] = L * C;
    sizes[LN2W] = L * C;
    sizes[LN2B] = L * C;
    sizes[FCW] = L * 4 * C * C;
    sizes[FCB] = L * 4 * C;
    sizes[FCPROJW] = L * C * 4 * C;
    sizes[FCPROJB] = L * C;
    sizes[LNFW] = C;
    sizes[LNFB] = C;
}

// the 2-D weight matrices, which AdamW decays; biases and layernorm parameters are not decayed
inline bool is_decayed(int tensor) {
    return tensor == WTE || tensor == WPE || tensor == QKVW || tensor == ATTPROJW || tensor == FCW || tensor == FCPROJW;
}

// pointers to each tensor inside one flat buffer (parameters or gradients, same layout)
struct ParamViews {
    float* t[NUM_PARAM_TENSORS];
    float* operator[](int i) const { return t[i]; }
};

inline ParamViews param_views(float* base, const size_t sizes[NUM_PARAM_TENSORS]) {
    ParamViews v;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        v.t[i] = base;
        base += sizes[i];
    }
    return v;
}

// ----------------------------------------------------------------------------------------------------------
// activations: what forward keeps for backward, sized for B×T; per-layer slots are stacked layer 0 first

struct Activations {
    float *encoded, *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *attproj, *residual2, *ln2, *ln2_mean, *ln2_rstd,
        *fch, *fch_gelu, *fcproj, *residual3, *lnf, *lnf_mean, *lnf_rstd, *logits, *losses;
};

// layer l's slice of every per-layer activation slot, for a batch of B×T (the slots are stacked layer 0 first
// with strides from B and T); the other fields are copied unchanged
inline Activations layer_slice(const Activations& a, int l, int B, int T, int C, int NH) {
    long BT = (long)B * T;
    Activations v = a;
    v.ln1 = a.ln1 + l * BT * C;
    v.ln1_mean = a.ln1_mean + l * BT;
    v.ln1_rstd = a.ln1_rstd + l * BT;
    v.qkv = a.qkv + l * BT * 3 * C;
    v.att = a.att + (long)l * B * NH * T * T;
    v.atty = a.atty + l * BT * C;
    v.attproj = a.attproj + l * BT * C;
    v.residual2 = a.residual2 + l * BT * C;
    v.ln2 = a.ln2 + l * BT * C;
    v.ln2_mean = a.ln2_mean + l * BT;
    v.ln2_rstd = a.ln2_rstd + l * BT;
    v.fch = a.fch + l * BT * 4 * C;
    v.fch_gelu = a.fch_gelu + l * BT * 4 * C;
    v.fcproj = a.fcproj + l * BT * C;
    v.residual3 = a.residual3 + l * BT * C;
    return v;
}

// buffers that live only inside backward (activation gradients), plus per-thread kernel workspaces
struct Scratch {
    float *dresidual, *dln, *dqkv, *datty, *dfch, *attention, *gemm;
};

struct GPT {
    GPTConfig config;
    int B = 0, T = 0;  // the largest batch forward() accepts
    Ledger ledger;
    size_t param_sizes[NUM_PARAM_TENSORS];
    size_t num_parameters = 0;
    float* params = nullptr;
    float* grads = nullptr;
    float* adam_m = nullptr;
    float* adam_v = nullptr;
    ParamViews p, g;
    int adam_step = 0;  // updates taken so far (AdamW's t)
    Activations acts;
    Scratch scratch;
    std::vector<int> inputs, targets;  // the batch of the last forward, which backward needs
    int last_B = 0, last_T = 0;
    float last_loss = -1.0f;
};

inline void gpt_allocate(GPT& m, const GPTConfig& config, int B, int T) {
    validate_config(config, "model");
    if (T > config.max_seq_len) fail("-t %d: longer than the model's maximum sequence length %d", T, config.max_seq_len);
    m.config = config;
    m.B = B;
    m.T = T;
    param_tensor_sizes(config, m.param_sizes);
    m.num_parameters = 0;
    for (size_t s : m.param_sizes) m.num_parameters += s;
    m.params = m.ledger.alloc_floats(MEM_PARAMS, m.num_parameters);
    m.grads = m.ledger.alloc_floats(MEM_GRADS, m.num_parameters);
    m.adam_m = m.ledger.alloc_floats(MEM_OPTIMIZER, m.num_parameters);
    m.adam_v = m.ledger.alloc_floats(MEM_OPTIMIZER, m.num_parameters);
    m.p = param_views(m.params, m.param_sizes);
    m.g = param_views(m.grads, m.param_sizes);

    size_t L = config.num_layers, C = config.channels, NH = config.num_heads, BT = (size_t)B * T;
    Activations& a = m.acts;
    auto act = [&](size_t n) { return m.ledger.alloc_floats(MEM_ACTIVATIONS, n); };
    a.encoded = act(BT * C);
    a.ln1 = act(L * BT * C);
    a.ln1_mean = act(L * BT);
    a.ln1_rstd = act(L * BT);
    a.qkv = act(L * BT * 3 * C);
    a.att = act(L * B * NH * T * T);
    a.atty = act(L * BT * C);
    a.attproj = act(L * BT * C);
    a.residual2 = act(L * BT * C);
    a.ln2 = act(L * BT * C);
    a.ln2_mean = act(L * BT);
    a.ln2_rstd = act(L * BT);
    a.fch = act(L * BT * 4 * C);
    a.fch_gelu = act(L * BT * 4 * C);
    a.fcproj = act(L * BT * C);
    a.residual3 = act(L * BT * C);
    a.lnf = act(BT * C);
    a.lnf_mean = act(BT);
    a.lnf_rstd = act(BT);
    a.logits = act(BT * config.padded_vocab_size);
    a.losses = act(BT);

    Scratch& s = m.scratch;
    int threads = omp_get_max_threads();
    auto scr = [&](size_t n) { return m.ledger.alloc_floats(MEM_SCRATCH, n); };
    s.dresidual = scr(BT * C);
    s.dln = scr(BT * C);
    s.dqkv = scr(BT * 3 * C);
    s.datty = scr(BT * C);
    s.dfch = scr(BT * 4 * C);
    s.attention = scr((size_t)threads * T);
    s.gemm = scr(gemm_workspace_floats(threads));
    m.inputs.assign(BT, 0);
    m.targets.assign(BT, 0);
}

// GPT-2's initialization: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), zero biases, unit
// layernorm gains. Drawn in fixed chunks from per-chunk seeds so any thread count gives the same weights.
inline void gpt_init_random(GPT& m, uint64_t seed) {
    const GPTConfig& c = m.config;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        float* t = m.p[i];
        size_t n = m.param_sizes[i];
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
    size_t sizes[NUM_PARAM_TENSORS], n = 0;
    param_tensor_sizes(c, sizes);
    for (size_t s : sizes) n += s;
    long expected = (long)sizeof(h) + (long)(n * (h[1] == MODEL_VERSION_FP32 ? 4 : 2));
    if (f.size() != expected)
        fail("%s: size %ld bytes, but its header implies %ld", path.c_str(), f.size(), expected);
    *version = h[1];
    return c;
}

// reads the parameters of a model file whose header matches m.config
inline void gpt_load_params(GPT& m, const std::string& path) {
    int version;
    GPTConfig c = read_model_header(path, &version);
    const GPTConfig& mc = m.config;
    if (c.num_layers != mc.num_layers || c.channels != mc.channels || c.num_heads != mc.num_heads ||
        c.vocab_size != mc.vocab_size || c.padded_vocab_size != mc.padded_vocab_size || c.max_seq_len != mc.max_seq_len)
        fail("%s: model shape differs from the run's model", path.c_str());
    File f(path, "rb");
    fseek(f.f, 1024, SEEK_SET);
    if (version == MODEL_VERSION_FP32) {
        f.read(m.params, m.num_parameters * 4);
    } else {
        std::vector<uint16_t> buf(1 << 20);
        for (size_t done = 0; done < m.num_parameters; done += buf.size()) {
            size_t n = std::min(buf.size(), m.num_parameters - done);
            f.read(buf.data(), n * 2);
            for (size_t i = 0; i < n; i++) {
                uint32_t bits = (uint32_t)buf[i] << 16;  // bf16 is the top half of an fp32
                memcpy(&m.params[done + i], &bits, 4);
            }
        }
    }
}

// writes an fp32 (version 3) llm.c model file
inline void gpt_save_params(const GPT& m, const std::string& path) {
    int h[256] = {};
    const GPTConfig& c = m.config;
    h[0] = MODEL_MAGIC;
    h[1] = MODEL_VERSION_FP32;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    h[6] = c.channels;
    h[7] = c.padded_vocab_size;
    File f(path, "wb");
    f.write(h, sizeof(h));
    f.write(m.params, m.num_parameters * 4);
    f.close();
}

// ----------------------------------------------------------------------------------------------------------
// forward, backward, update

// runs the model on inputs (B×T tokens, B and T at most what the model was allocated for). With targets, also
// the loss, which it returns (mean over the B×T tokens); without, returns -1 and leaves only the logits.
inline float gpt_forward(GPT& m, const int* inputs, const int* targets, int B, int T) {
    if (B > m.B || T > m.T) fail("forward: batch %dx%d exceeds the allocated %dx%d", B, T, m.B, m.T);
    const GPTConfig& c = m.config;
    int L = c.num_layers, C = c.channels, NH = c.num_heads, V = c.vocab_size, Vp = c.padded_vocab_size;
    long BT = (long)B * T;
    for (long i = 0; i < BT; i++) {
        if (inputs[i] < 0 || inputs[i] >= V) fail("forward: input token %d outside the vocab [0, %d)", inputs[i], V);
        if (targets && (targets[i] < 0 || targets[i] >= V))
            fail("forward: target token %d outside the vocab [0, %d)", targets[i], V);
    }
    std::copy(inputs, inputs + BT, m.inputs.begin());
    if (targets) std::copy(targets, targets + BT, m.targets.begin());
    m.last_B = B;
    m.last_T = T;
    Activations& a = m.acts;
    const ParamViews& p = m.p;
    float* ws = m.scratch.gemm;

    encoder_forward(a.encoded, inputs, p[WTE], p[WPE], B, T, C);
    const float* residual = a.encoded;
    for (int l = 0; l < L; l++) {
        Activations la = layer_slice(a, l, B, T, C, NH);
        layernorm_forward(la.ln1, la.ln1_mean, la.ln1_rstd, residual, p[LN1W] + l * C, p[LN1B] + l * C, BT, C);
        matmul_forward(la.qkv, la.ln1, p[QKVW] + (long)l * 3 * C * C, p[QKVB] + l * 3 * C, BT, C, 3 * C, ws);
        attention_forward(la.atty, la.att, la.qkv, B, T, C, NH);
        matmul_forward(la.attproj, la.atty, p[ATTPROJW] + (long)l * C * C, p[ATTPROJB] + l * C, BT, C, C, ws);
        residual_forward(la.residual2, residual, la.attproj, BT * C);
        layernorm_forward(la.ln2, la.ln2_mean, la.ln2_rstd, la.residual2, p[LN2W] + l * C, p[LN2B] + l * C, BT, C);
        matmul_forward(la.fch, la.ln2, p[FCW] + (long)l * 4 * C * C, p[FCB] + l * 4 * C, BT, C, 4 * C, ws);
        gelu_forward(la.fch_gelu, la.fch, BT * 4 * C);
        matmul_forward(la.fcproj, la.fch_gelu, p[FCPROJW] + (long)l * 4 * C * C, p[FCPROJB] + l * C, BT, 4 * C, C, ws);
        residual_forward(la.residual3, la.residual2, la.fcproj, BT * C);
        residual = la.residual3;
    }
    layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, residual, p[LNFW], p[LNFB], BT, C);
    matmul_forward(a.logits, a.lnf, p[WTE], nullptr, BT, C, Vp, ws);
    m.last_loss = targets ? crossentropy_forward(a.losses, a.logits, targets, BT, V, Vp) : -1.0f;
    return m.last_loss;
}

inline void gpt_zero_grad(GPT& m) { memset(m.grads, 0, m.num_parameters * sizeof(float)); }

// accumulates into the gradients the backward of the last forward (which must have had targets); dloss is the
// weight of each token's loss in the objective: 1 / (B·T·accumulation steps) for a mean over the global batch
inline void gpt_backward(GPT& m, float dloss) {
    if (m.last_loss < 0) fail("backward: the last forward had no targets");
    const GPTConfig& c = m.config;
    int B = m.last_B, T = m.last_T;
    int L = c.num_layers, C = c.channels, NH = c.num_heads, V = c.vocab_size, Vp = c.padded_vocab_size;
    long BT = (long)B * T;
    Activations& a = m.acts;
    Scratch& s = m.scratch;
    const ParamViews& p = m.p;
    const ParamViews& g = m.g;
    float* ws = s.gemm;

    // the classifier: logits turn into their gradient in place, then through the tied wte and the final norm
    crossentropy_backward_inplace(a.logits, m.targets.data(), BT, V, Vp, dloss);
    matmul_backward(s.dln, g[WTE], nullptr, a.logits, a.lnf, p[WTE], BT, C, Vp, ws);
    memset(s.dresidual, 0, BT * C * sizeof(float));
    const float* last_residual = a.residual3 + (L - 1) * BT * C;
    layernorm_backward(s.dresidual, g[LNFW], g[LNFB], s.dln, last_residual, p[LNFW], a.lnf_mean, a.lnf_rstd, BT, C);

    // dresidual carries the gradient of the residual stream down the layers: each branch reads it and adds
    // its input gradient back (the residual add passes gradient to both of its inputs unchanged)
    for (int l = L - 1; l >= 0; l--) {
        const float* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * BT * C;
        Activations la = layer_slice(a, l, B, T, C, NH);

        matmul_backward(s.dfch, g[FCPROJW] + (long)l * 4 * C * C, g[FCPROJB] + l * C, s.dresidual, la.fch_gelu,
                        p[FCPROJW] + (long)l * 4 * C * C, BT, 4 * C, C, ws);
        gelu_backward(s.dfch, la.fch, s.dfch, BT * 4 * C);
        matmul_backward(s.dln, g[FCW] + (long)l * 4 * C * C, g[FCB] + l * 4 * C, s.dfch, la.ln2,
                        p[FCW] + (long)l * 4 * C * C, BT, C, 4 * C, ws);
        layernorm_backward(s.dresidual, g[LN2W] + l * C, g[LN2B] + l * C, s.dln, la.residual2, p[LN2W] + l * C,
                           la.ln2_mean, la.ln2_rstd, BT, C);
        matmul_backward(s.datty, g[ATTPROJW] + (long)l * C * C, g[ATTPROJB] + l * C, s.dresidual, la.atty,
                        p[ATTPROJW] + (long)l * C * C, BT, C, C, ws);
        attention_backward(s.dqkv, s.datty, la.qkv, la.att, B, T, C, NH, s.attention);
        matmul_backward(s.dln, g[QKVW] + (long)l * 3 * C * C, g[QKVB] + l * 3 * C, s.dqkv, la.ln1,
                        p[QKVW] + (long)l * 3 * C * C, BT, C, 3 * C, ws);
        layernorm_backward(s.dresidual, g[LN1W] + l * C, g[LN1B] + l * C, s.dln, residual, p[LN1W] + l * C,
                           la.ln1_mean, la.ln1_rstd, BT, C);
    }
    encoder_backward(g[WTE], g[WPE], s.dresidual, m.inputs.data(), B, T, C);
}

inline double gpt_grad_norm(const GPT& m) { return sqrt(sum_of_squares(m.grads, (long)m.num_parameters)); }

// one AdamW step over every tensor; grad_scale is the clipping factor
inline void gpt_update(GPT& m, float lr, float weight_decay, float grad_scale) {
    m.adam_step++;
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        size_t n = m.param_sizes[i];
        adamw_update(m.params + offset, m.grads + offset, m.adam_m + offset, m.adam_v + offset, (long)n, lr,
                     is_decayed(i) ? weight_decay : 0.0f, grad_scale, m.adam_step);
        offset += n;
    }
}

// A model's configuration, as the run is given it: the checks every configuration passes wherever it comes from
// (a descriptor, an llm.c file's header, a checkpoint, a Hugging Face config.json), the descriptors of -e (GPT-2's
// d12..d48 and d<L>c<C>h<NH>, Llama 3's and Qwen3's published shapes and their short forms l... and q...), and
// the comparison and the printed description of a shape. GPTConfig itself, and the tensors a configuration
// implies, are llmc/model_table.h's. Host code only: a configuration is settled before any device or layout is.
#pragma once

#include <cctype>
#include <cstdlib>
#include <string>

#include "llmc/model_table.h"
#include "llmc/utils.h"

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
    if (c.expert_size < 0 || c.expert_size > (1 << 20) || (!c.moe() && (c.expert_size != 0 || !c.norm_topk)))
        fail("%s: expert size %d%s: only a model with experts has either", where.c_str(), c.expert_size,
             c.norm_topk ? "" : " with unnormalized gates");
    if (c.dense_layers < 0 || c.sparse_step < 1 || (!c.moe() && (c.dense_layers != 0 || c.sparse_step != 1)))
        fail("%s: %d dense layers first, a sparse layer every %d: only a model with experts has dense layers",
             where.c_str(), c.dense_layers, c.sparse_step);
    if (c.shared_size < 0 || c.shared_size > (1 << 20) || (!c.moe() && c.shared_size != 0) ||
        (c.shared_gate && c.shared_size == 0))
        fail("%s: a shared expert of %d hidden units%s: only a model with experts has one, and only a shared expert "
             "a gate", where.c_str(), c.shared_size, c.shared_gate ? ", gated" : "");
    if (!(c.routed_scale > 0 && c.routed_scale <= 1000) || (!c.moe() && (c.sigmoid_scores || c.routed_scale != 1)))
        fail("%s: %s scores scaled by %g: only a model with experts has a router, and its scale is in (0, 1000]",
             where.c_str(), c.sigmoid_scores ? "sigmoid" : "softmax", c.routed_scale);
    if (c.router_bias && !c.moe()) fail("%s: a router's selection bias: only a model with experts has a router", where.c_str());
    if (c.moe() && c.count_dense_layers() == c.num_layers)
        fail("%s: %d dense layers first and a sparse layer every %d leave none of the %d layers sparse", where.c_str(),
             c.dense_layers, c.sparse_step, c.num_layers);
    if (!c.llama() && c.attention_bias) fail("%s: attention biases are a Llama-family property (GPT-2 always has them)", where.c_str());
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
// is the dense model. After it, x<H> gives each expert H hidden units of its own (HF's moe_intermediate_size;
// default the MLP's), and u keeps a token's K gates as the softmax over all E gives them rather than
// renormalized to sum to one (HF's norm_topk_prob false), e.g. q2c48h4e8k2x24u; n<N> makes the first N layers
// dense (DeepSeek's first_k_dense_replace) and s<S> only every S-th layer sparse (HF's decoder_sparse_step: layer
// l when (l + 1) % S == 0), the dense layers an MLP of the model's own size, e.g. q4c48h4e4k2x24n1s2 (layers 1
// and 3 sparse); y<H> adds to every sparse layer a shared expert of H hidden units that takes every token
// (DeepSeek's), z<H> one whose output a sigmoid gate of its own scales (Qwen2-MoE's), e.g. l2c48h4e4k2x24y48; i
// scores each expert by a sigmoid rather than the softmax over all E, r<F> scales the gates by F (a decimal), and a
// adds a bias per expert to the scores that choose, which training moves toward balanced loads (DeepSeek-V3's
// routing is i, r2.5 and a).
// Llama 3: "llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "llama3-405b" are Meta's shapes (vocab 128256,
// 8 key/value heads, RoPE theta 500000 with Llama 3's scaling, maxT 8192; the 1B and 3B are Llama 3.2's, with
// the classifier tied to wte and RoPE scaled by 32, the others Llama 3.1's, untied and scaled by 8); any other
// shape is l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][b][e<E>k<K>][w]: KV key/value heads (default NH), H hidden
// units in the MLP (default Meta's rule: 2/3 of 4C rounded up to a multiple of 256), maxT 1024 and the GPT-2
// vocab by default, RoPE theta 500000 unscaled, E SwiGLU experts of H hidden units with top-K routing in every
// layer (Mixtral's shape), b: biases on q, k and v (Qwen2's), w: the classifier tied to wte, e.g. l4c128h4g2f352
// (4 layers, 128 channels, 4 heads sharing 2 key/value heads).
// Qwen3: "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b" are Qwen's dense shapes; any other shape is
// q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][b][e<E>k<K>][w], a Llama's fields and hd channels a head (default
// C/NH), H the MLP's hidden units as given, RoPE theta 1e6 and norm eps 1e-6, e.g. q2c48h4g2d16f88 (4 heads of
// 16 channels: attention is 64 wide in a model of 48 channels).
// Mixtures of experts by name: "qwen3-30b-a3b" (Qwen3-30B-A3B: 48 layers of 128 experts of 768 hidden units, 8
// per token, gates renormalized) and "mixtral-8x7b" (Mixtral 8x7B: a Llama of 32 layers of 8 experts of 14336,
// 2 per token, RoPE theta 1e6, vocab 32000).
inline bool is_model_descriptor(const std::string& s) {
    return (s.size() >= 2 && (s[0] == 'd' || s[0] == 'l' || s[0] == 'q') && isdigit(s[1])) ||
           s.rfind("llama3-", 0) == 0 || s.rfind("qwen3-", 0) == 0 || s.rfind("mixtral-", 0) == 0;
}

// A Llama's MLP of H hidden units exactly: Meta's rule with multiple_of H and a multiplier that brings 2/3 of 4C
// to H + 1/2, which truncates to H whatever the multiplier's rounding (what a file without Meta's two numbers
// gives: a descriptor's f<H>, a Hugging Face config's intermediate_size)
inline void set_llama_hidden(GPTConfig& c, int H) {
    c.multiple_of = H, c.ffn_dim_multiplier = (H + 0.5f) / (int)(2.0 * (4L * c.channels) / 3);
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
         "l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][b][e<E>k<K>][w]", s.c_str());
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
                    Shape{"qwen3-4b", 36, 2560, 32, 9728, true}, Shape{"qwen3-8b", 36, 4096, 32, 12288, false},
                    Shape{"qwen3-30b-a3b", 48, 2048, 32, 6144, false}}) {
        if (s != m.name) continue;
        GPTConfig c = qwen3_defaults();
        c.num_layers = m.L, c.channels = m.C, c.num_heads = m.NH, c.num_kv_heads = 8, c.head_dim = 128;
        c.intermediate_size = m.H, c.tied_embeddings = m.tied;
        c.vocab_size = 151936, c.padded_vocab_size = pad_vocab(c.vocab_size), c.max_seq_len = 40960;
        if (s == "qwen3-30b-a3b")  // Qwen/Qwen3-30B-A3B's config.json: 4 key/value heads, every layer sparse
            c.num_kv_heads = 4, c.num_experts = 128, c.top_k = 8, c.expert_size = 768, c.norm_topk = true;
        validate_config(c, "-e " + s);
        return c;
    }
    fail("-e %s: Qwen3 sizes are qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-30b-a3b; give other shapes as "
         "q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][b][e<E>k<K>[x<H>][u][n<N>][s<S>][y<H>|z<H>][i][r<F>][a]][w]", s.c_str());
}

// Mistral's Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1's config.json): a Llama of 32 layers, 4096 channels, 32
// query heads and 8 key/value heads, 8 SwiGLU experts of 14336 hidden units in every layer, 2 per token, RoPE
// theta 1e6 unscaled, vocab 32000, maxT 32768, untied
inline GPTConfig mixtral_named(const std::string& s) {
    if (s != "mixtral-8x7b") fail("-e %s: the Mixtral size is mixtral-8x7b; give other shapes as l...e<E>k<K>", s.c_str());
    GPTConfig c;
    c.arch = Arch::Llama3;
    c.num_layers = 32, c.channels = 4096, c.num_heads = 32, c.num_kv_heads = 8;
    set_llama_hidden(c, 14336);
    c.num_experts = 8, c.top_k = 2;
    c.vocab_size = 32000, c.padded_vocab_size = pad_vocab(c.vocab_size), c.max_seq_len = 32768;
    c.rope_theta = 1000000.0f, c.rope_scaling = 0.0f;
    validate_config(c, "-e " + s);
    return c;
}

inline GPTConfig parse_model_descriptor(const std::string& s) {
    if (s.rfind("llama3-", 0) == 0) return llama3_named(s);
    if (s.rfind("qwen3-", 0) == 0) return qwen3_named(s);
    if (s.rfind("mixtral-", 0) == 0) return mixtral_named(s);
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
    const char* fields = qwen    ? "q<L>c<C>h<NH>[g<KV>][d<hd>][f<H>][t<maxT>][v<V>][b][e<E>k<K>[x<H>][u][n<N>][s<S>][y<H>|z<H>][i][r<F>]][w]"
                         : llama ? "l<L>c<C>h<NH>[g<KV>][f<H>][t<maxT>][v<V>][b][e<E>k<K>[x<H>][u][n<N>][s<S>][y<H>|z<H>][i][r<F>]][w]"
                                 : "d<L>c<C>h<NH>[t<maxT>][v<V>][e<E>k<K>[x<H>][u][n<N>][s<S>][y<H>|z<H>][i][r<F>]]";
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
            case 'x': c.expert_size = number(key); break;
            case 'u': c.norm_topk = false; break;  // a flag
            case 'n': c.dense_layers = number(key); break;
            case 's': c.sparse_step = number(key); break;
            case 'y': c.shared_size = number(key), c.shared_gate = false; break;
            case 'z': c.shared_size = number(key), c.shared_gate = true; break;
            case 'i': c.sigmoid_scores = true; break;  // a flag
            case 'a': c.router_bias = true; break;     // a flag
            case 'r': {                                // a decimal
                char* end;
                c.routed_scale = strtof(p, &end);
                if (end == p || !(c.routed_scale > 0)) fail("-e %s: bad number after 'r'", s.c_str());
                p = end;
                break;
            }
            case 'g': known = llama && (c.num_kv_heads = number(key)); break;
            case 'f': known = llama && (hidden = number(key)); break;
            case 'd': known = qwen && (c.head_dim = number(key)); break;
            case 'b': known = c.attention_bias = llama; break;  // a flag
            case 'w': known = c.tied_embeddings = llama && !*p; break;  // a flag, last
            default: known = false;
        }
        if (!known) fail("-e %s: unknown field '%c' (expected %s)", s.c_str(), key, fields);
    }
    if (have_e != have_k) fail("-e %s: experts need both e<E> and k<K>", s.c_str());
    if ((c.expert_size > 0 || !c.norm_topk || c.dense_layers > 0 || c.sparse_step != 1 || c.shared_size > 0 ||
         c.sigmoid_scores || c.routed_scale != 1 || c.router_bias) && c.num_experts < 2)
        fail("-e %s: x<H>, u, n<N>, s<S>, y<H>, z<H>, i, r<F> and a describe experts: give e<E>k<K> with E > 1",
             s.c_str());
    c.padded_vocab_size = pad_vocab(c.vocab_size);
    if (qwen) {  // H hidden units as given (default Meta's rule, as a Llama's)
        if (!have_c || !have_h) fail("-e %s: a Qwen3 shape needs c<channels> and h<heads>", s.c_str());
        c.intermediate_size = hidden;
        validate_config(c, "-e " + s);
        return c;
    }
    if (llama) {
        if (!have_c || !have_h) fail("-e %s: a Llama shape needs c<channels> and h<heads>", s.c_str());
        if (hidden > 0) set_llama_hidden(c, hidden);
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

// what the Llama family (Llama 3, Qwen3) adds to the shape GPT-2's L, C, NH, V and maxT say, in the lines that
// print a model ("" for GPT-2)
inline std::string family_shape(const GPTConfig& c) {
    if (!c.llama()) return "";
    std::string scaling = c.rope_scaling > 0 ? strfmt(" scaled x%g", c.rope_scaling) : "";
    std::string family = c.arch == Arch::Qwen3 ? strfmt("Qwen3 hd=%d", c.head_size())
                                               : strfmt("Llama %d.%d", c.version_major, c.version_minor);
    return strfmt(" %s KV=%d H=%d eps=%g theta=%.10g%s%s%s", family.c_str(), c.kv_heads(), c.hidden(), c.norm_eps,
                  c.rope_theta, scaling.c_str(), c.attention_bias ? " qkv bias" : "", c.tied_embeddings ? " tied" : "");
}

// the experts of a model, in the lines that print it ("" when dense): " E=8 K=2", each one's hidden units where
// they are not the MLP's, and the gates when they are not renormalized
inline std::string experts_shape(const GPTConfig& c) {
    if (!c.moe()) return "";
    std::string dense = c.count_dense_layers() == 0 ? ""
                        : strfmt(" dense layers %d (first %d, sparse every %d)", c.count_dense_layers(), c.dense_layers,
                                 c.sparse_step);
    std::string shared = c.shared_size == 0 ? ""
                         : strfmt(" shared expert H=%d%s", c.shared_size, c.shared_gate ? " gated" : "");
    std::string scores = strfmt("%s%s%s", c.sigmoid_scores ? " sigmoid scores" : "",
                                c.routed_scale != 1 ? strfmt(" gates x%g", c.routed_scale).c_str() : "",
                                c.router_bias ? " selection bias" : "");
    return strfmt(" E=%d K=%d%s%s%s%s%s", c.num_experts, c.top_k,
                  c.expert_size > 0 ? strfmt(" expert H=%d", c.expert_size).c_str() : "",
                  c.norm_topk ? "" : " gates unnormalized", scores.c_str(), dense.c_str(), shared.c_str());
}

inline bool same_model_shape(const GPTConfig& a, const GPTConfig& b) {
    return a.arch == b.arch && a.num_layers == b.num_layers && a.channels == b.channels && a.num_heads == b.num_heads &&
           a.kv_heads() == b.kv_heads() && a.vocab_size == b.vocab_size && a.padded_vocab_size == b.padded_vocab_size &&
           a.max_seq_len == b.max_seq_len && a.num_experts == b.num_experts && a.top_k == b.top_k &&
           a.expert_hidden() == b.expert_hidden() && a.norm_topk == b.norm_topk && a.dense_layers == b.dense_layers &&
           a.sparse_step == b.sparse_step && (a.count_dense_layers() == 0 || a.hidden() == b.hidden()) &&
           a.shared_size == b.shared_size && a.shared_gate == b.shared_gate &&
           a.sigmoid_scores == b.sigmoid_scores && a.routed_scale == b.routed_scale && a.router_bias == b.router_bias &&
           a.head_size() == b.head_size() &&
           (!a.llama() || (a.hidden() == b.hidden() && a.norm_eps == b.norm_eps && a.rope_theta == b.rope_theta &&
                           a.rope_scaling == b.rope_scaling && a.tied_embeddings == b.tied_embeddings &&
                           a.attention_bias == b.attention_bias));
}

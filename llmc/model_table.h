// The model's shape: its configuration, and the table of its tensors, one row each, from which everything that
// sizes, splits, names, decays or initializes a parameter derives: the flat buffers (llm.c's tensor order), a
// rank's share under tensor and expert parallelism, the units data parallelism reduces and ZeRO-3 gathers, the
// element coordinates checkpoints index, the plan and the step-time model. Nothing else restates a shape.
//
// A row says: the tensor's name; which unit holds it (the embeddings, each layer, the head); whether each
// layer stacks one block of it per expert; its rows and columns (the rows in parts when a column split divides
// them separately: Q, K and V); how tensor parallelism places it (the table below); whether AdamW decays it;
// whether a tp rank's gradient of it is a partial sum (TPGrad); and how it starts.
//
//   split       a rank of tp holds                                        GPT-2
//   replicated  all of it                                                 wpe, norms, row-parallel biases, router
//   column      rows [r·n/tp, (r+1)·n/tp) of each part of n rows         qkvw/qkvb (3 parts), fcw/fcb
//               (a part of h heads, h < tp: head ⌊r·h/tp⌋, held whole    Llama's K and V when tp > KV
//               by tp/h ranks)
//   row         columns [r·k/tp, (r+1)·k/tp) of every row of k columns   attprojw, fcprojw
//   vocab       rows [r·⌈V/tp⌉, (r+1)·⌈V/tp⌉) of the padded vocab         wte (and so the tied classifier)
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/utils.h"

// The architectures: GPT-2; Llama 3 (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, no position
// table, a classifier of its own or tied to the token embedding); Qwen3 (Llama 3's, with an RMSNorm on each
// query and key head before RoPE, and a head size and MLP size of their own). Each is its table of tensors
// (below: which exist, biases among them) and the properties the one layer body of llmc/gpt.cuh reads: which
// norm, how attention sees positions, the MLP's activation, and whether q and k are normed. Nothing in the
// compute asks which architecture runs.
enum class Arch { GPT2, Llama3, Qwen3 };
enum class Norm { LayerNorm, RMSNorm };   // GPT-2's layernorm (a mean, a bias) or RMSNorm (neither)
enum class Positions { Learned, RoPE };   // a table added to the embeddings, or q and k rotated
enum class Activation { GELU, SwiGLU };   // the MLP's (and each expert's): SwiGLU's first matmul is twice as wide

struct ArchProperties {
    Norm norm;
    Positions positions;
    Activation activation;
    bool qk_norm;  // each query and key head through an RMSNorm of its own weights before RoPE (llmc/norm.cuh)
};
inline ArchProperties arch_properties(Arch a) {
    switch (a) {
        case Arch::GPT2: return {Norm::LayerNorm, Positions::Learned, Activation::GELU, false};
        case Arch::Llama3: return {Norm::RMSNorm, Positions::RoPE, Activation::SwiGLU, false};
        case Arch::Qwen3: return {Norm::RMSNorm, Positions::RoPE, Activation::SwiGLU, true};
    }
    fail("unknown architecture %d", (int)a);
}

struct GPTConfig {
    Arch arch = Arch::GPT2;
    int max_seq_len = 1024;
    int vocab_size = 50257;
    // the vocab rounded up to a multiple of 128, as llm.c pads GPT-2's (50257 -> 50304), for every architecture:
    // the rows wte and a classifier of its own hold in memory, so that the GPU's cross-entropy reads whole 16-byte
    // vectors and a vocab split gives every tp rank the same rows. The padding rows are zero and stay zero (no
    // token looks them up, their logits get zero gradient). Files keep their format's own rows: llm.c's GPT-2 file
    // this padded count (its header's Vp), llm.c's Llama 3 file and Hugging Face's the vocab's (llmc/model_file.h)
    int padded_vocab_size = 50304;
    int num_layers = 12;
    int num_heads = 12;
    int num_kv_heads = 0;  // key/value heads under grouped-query attention; 0: one per query head (GPT-2)
    int channels = 768;
    int num_experts = 1;  // E experts in every layer's MLP, top_k of them per token (llmc/moe.cuh); 1 and 1: dense
    int top_k = 1;
    // ... each expert of expert_size hidden units (HF's moe_intermediate_size; 0: the MLP's, hidden()), and a
    // token's K gates, the softmax over all E experts taken at its K chosen ones, renormalized to sum to one
    // (norm_topk_prob: Mixtral's, Qwen3-30B-A3B's) or not (Qwen1.5-MoE's, OLMoE's)
    int expert_size = 0;
    bool norm_topk = true;
    // ... in the sparse layers: all but the first dense_layers (DeepSeek's first_k_dense_replace; HF Qwen-MoE's
    // mlp_only_layers, as a prefix), and of those every sparse_step-th (HF's decoder_sparse_step: layer l when
    // (l + 1) % sparse_step == 0); the others are dense layers, an MLP of hidden() units of their own
    int dense_layers = 0;
    int sparse_step = 1;
    // ... and beside the routed experts, in every sparse layer, a shared expert that takes every token: an MLP of
    // shared_size hidden units (DeepSeek's n_shared_experts·moe_intermediate_size, always on; Qwen2-MoE's
    // shared_expert_intermediate_size; 0: none), its output scaled by sigmoid(x·wᵀ) of a gate vector w of its own
    // when shared_gate (Qwen2-MoE's shared_expert_gate)
    int shared_size = 0;
    bool shared_gate = false;
    // ... and the router's scores: the softmax over all E (Mixtral's, Qwen's), or each expert's sigmoid
    // (DeepSeek-V3's), the gates scaled by routed_scale (DeepSeek-V3's routed_scaling_factor, 2.5; 1 elsewhere)
    bool sigmoid_scores = false;
    float routed_scale = 1.0f;
    // ... and a bias per expert added to the scores only to choose the experts (DeepSeek-V3's balancing without
    // an auxiliary loss): a tensor of the table that training moves by the step's loads, not by AdamW
    bool router_bias = false;
    // Llama 3, as llm.c's Llama 3 files give it: the MLP's hidden size by Meta's formula from multiple_of and
    // ffn_dim_multiplier (0: none), RMSNorm's eps, RoPE's theta and the factor of Llama 3's frequency scaling
    // (0: none; 8 in Llama 3.1, 32 in Llama 3.2), and the version the file names; whether the classifier is the
    // token embedding (Llama 3.2 1B and 3B) rather than a matrix of its own
    int multiple_of = 256;
    float ffn_dim_multiplier = 0.0f;
    float norm_eps = 1e-5f;
    float rope_theta = 500000.0f;
    float rope_scaling = 0.0f;
    int version_major = 3, version_minor = 1;
    bool tied_embeddings = false;
    // the Llama family's q, k and v projections with biases (Qwen2's and Qwen2-MoE's; GPT-2's always have them)
    bool attention_bias = false;
    // Qwen3 gives these two as numbers of their own (0: C/NH, and Meta's rule above)
    int head_dim = 0;
    int intermediate_size = 0;

    bool moe() const { return num_experts > 1; }
    // llm.c's Llama 3 family (Llama 3 and Qwen3): its file layout, grouped-query attention, a classifier of its own
    bool llama() const { return arch != Arch::GPT2; }
    bool tied() const { return !llama() || tied_embeddings; }  // GPT-2's classifier always is wte
    Norm norm() const { return arch_properties(arch).norm; }
    Activation activation() const { return arch_properties(arch).activation; }
    bool qk_norm() const { return arch_properties(arch).qk_norm; }
    // how attention sees positions: a learned table added to the embeddings (GPT-2's wpe), or RoPE (Llama)
    bool learned_positions() const { return arch_properties(arch).positions == Positions::Learned; }
    int kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
    // ... and those one of tp ranks holds: KV/tp, or one when tp exceeds KV (each held by tp/KV ranks)
    int kv_heads(int tp) const { return std::max(1, kv_heads() / tp); }
    int head_size() const { return head_dim > 0 ? head_dim : channels / num_heads; }
    // the MLP's hidden units: 4C for GPT-2; Qwen3's intermediate_size; for Llama Meta's: 2/3 of 4C, times
    // ffn_dim_multiplier, rounded up to a multiple of multiple_of (Llama 3 8B: 4096 channels, 1.3 and 1024 give
    // 14336)
    int hidden() const {
        if (!llama()) return 4 * channels;
        if (intermediate_size > 0) return intermediate_size;
        long h = (long)(2.0 * (4L * channels) / 3);
        if (ffn_dim_multiplier > 0) h = (long)((double)ffn_dim_multiplier * h);
        return (int)((h + multiple_of - 1) / multiple_of * multiple_of);
    }
    int expert_hidden() const { return expert_size > 0 ? expert_size : hidden(); }
    // the hidden units of the MLP tensors of the table: each expert's in a model with experts
    int mlp_hidden() const { return moe() ? expert_hidden() : hidden(); }
    // layer l routes its tokens to the experts; a layer of a model with experts that does not is a dense layer,
    // with an MLP of its own (the DENSE_ tensors); a dense model's layers are neither: their MLP is the table's
    // FCW..FCPROJB, one expert that takes every row
    bool sparse_layer(int l) const { return moe() && l >= dense_layers && (l + 1) % sparse_step == 0; }
    bool dense_layer(int l) const { return moe() && !sparse_layer(l); }
    int count_dense_layers() const {
        int n = 0;
        for (int l = 0; l < num_layers; l++) n += dense_layer(l);
        return n;
    }
};

// the assignments of a sequence of T tokens each of E experts takes under a capacity factor F (--moe-capacity),
// K chosen per token: ceil(F·K·T/E), F times an expert's share were the routing even
inline long expert_capacity(float F, int K, int E, long T) { return (long)std::ceil((double)F * K * T / E); }

inline int pad_vocab(int V) { return (V + 127) / 128 * 128; }
// the padded vocab rows each of tp ranks holds (the last ranks may hold padding only past Vp)
inline int vocab_rows(int Vp, int tp) { return (Vp + tp - 1) / tp; }

// The part of the model one rank holds: all of it, or under pipeline parallelism (llmc/pp.cuh) one stage's
// chunks, each a run of consecutive layers (one chunk per virtual stage, in model order), stacked in that
// order. The stage that runs the model's first chunk holds the embeddings; the one that runs its last chunk
// holds the head: the final norm and the classifier. A classifier of its own (an untied Llama's lm_head) is in
// the head; a tied one is wte, so that stage keeps a copy of the embeddings, which llmc/zero.cuh keeps equal to
// the first stage's bit for bit.
struct ModelPart {
    std::vector<int> chunk_first, chunk_layers;  // per chunk: its first layer in the model, its number of layers
    bool first = true, last = true;              // runs the model's first / last chunk
    bool tied = true;                            // the classifier is wte

    int chunks() const { return (int)chunk_layers.size(); }
    int layers() const {
        int n = 0;
        for (int k : chunk_layers) n += k;
        return n;
    }
    // where the chunk's layers start among the part's
    int chunk_begin(int chunk) const {
        int n = 0;
        for (int k = 0; k < chunk; k++) n += chunk_layers[k];
        return n;
    }
    bool embeddings() const { return first || (last && tied); }
    // holds one of the two copies of the tied embeddings (under pp: the first stage or the last)
    bool embedding_copy() const { return tied && (first || last); }
    // ... and the other copy is on another stage, the two summing their gradients: not where one rank runs both
    // ends (DualPipeV's rank 0) with one copy
    bool tied_across_stages() const { return embedding_copy() && first != last; }
    bool head(int chunk) const { return last && chunk == chunks() - 1; }
    bool starts_model(int chunk) const { return first && chunk == 0; }
    // the model's index of the part's layer l
    int model_layer(int l) const {
        for (int k = 0; k < chunks(); l -= chunk_layers[k++])
            if (l < chunk_layers[k]) return chunk_first[k] + l;
        fail("model part: layer %d is not in the part", l);
    }
};
inline ModelPart whole_part(const GPTConfig& c) { return ModelPart{{0}, {c.num_layers}, true, true, c.tied()}; }

// ----------------------------------------------------------------------------------------------------------
// the table

// The tensors in the order of llm.c's files: its 16, and the router's weight before the MLP's (empty in a dense
// model, whose buffers are then llm.c's). With experts each MLP tensor stacks the experts of a layer (layer
// first, then expert). Llama keeps its lm_head in wpe's slot, as llm.c's Llama 3 files do.
// Qwen3's QK-norm weights come after them, so that the other architectures' files and checkpoints keep their
// order, then the MLP of the dense layers of a model with experts, and last the sparse layers' shared expert and
// its gate, and the router's selection bias (each empty in every other model).
enum ParamTensor { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, ROUTERW, FCW, FCB, FCPROJW,
                   FCPROJB, LNFW, LNFB, QNORMW, KNORMW, DENSE_FCW, DENSE_FCB, DENSE_FCPROJW, DENSE_FCPROJB,
                   SHARED_FCW, SHARED_FCB, SHARED_FCPROJW, SHARED_FCPROJB, SHARED_GATEW, ROUTER_BIAS,
                   NUM_PARAM_TENSORS };
// the Llama family's classifier, where GPT-2 has wpe (which it lacks)
constexpr ParamTensor LM_HEAD = WPE;

// the layer matmuls' weights, which --fp8 1 runs in FP8 in all but the first and the last layer (the router and the
// shared expert's gate, small, stay in bf16)
inline bool fp8_matmul_weight(int t) {
    switch (t) {
        case QKVW: case ATTPROJW: case FCW: case FCPROJW: case DENSE_FCW: case DENSE_FCPROJW: case SHARED_FCW:
        case SHARED_FCPROJW: return true;
        default: return false;
    }
}

enum class TPSplit { Replicated, Column, Row, Vocab };
// the unit that holds a tensor: the embeddings, a layer, or the head (the final norm, and a classifier of its own)
enum class Holder { Embeddings, Layer, Head };
// how initialization fills a tensor: with zeros, ones, N(0, 0.02), or N(0, 0.02/sqrt(2L)) for the projections
// that write into the residual stream (GPT-2's scaling, which torchtitan keeps)
enum class Init { Zeros, Ones, Normal, ResidualNormal };
// what a tp rank's gradient of a tensor it holds whole or in part is: its own (complete for what it holds), a
// partial sum under sequence parallelism (a replicated tensor applied to the rank's rows only: the norms, wpe),
// or always a partial sum (a replicated tensor applied to the rank's heads only: QK-norm's weights); the
// partial ones are summed over the tp group before data parallelism reduces them (llmc/zero.cuh)
enum class TPGrad { Own, SequencePartial, HeadsPartial };
// the layers that hold a layer tensor: every one; those whose MLP is the experts' (a model's sparse layers, or every
// layer of a dense model: its MLP the one expert); the dense layers of a model with experts
enum class LayerSet { Every, Experts, Dense };
inline bool layer_holds(const GPTConfig& c, LayerSet set, int layer) {
    switch (set) {
        case LayerSet::Every: return true;
        case LayerSet::Experts: return !c.dense_layer(layer);
        case LayerSet::Dense: return c.dense_layer(layer);
    }
    return false;
}

struct TensorSpec {
    const char* name;
    Holder holder;
    bool expert;       // one block per expert in every layer
    size_t parts[3];   // its rows, in the parts a column split divides separately (unused parts 0)
    size_t cols;       // elements per row (1 for a vector)
    TPSplit split;
    bool decayed;  // AdamW's weight decay applies (the 2-D weights)
    TPGrad tp_grad;
    Init init;
    size_t file_rows = 0;  // absent here (no rows) but in the model file as zeros: llm.c's Llama 3 files keep GPT-2's
                           // bias slots
    int file_copy = -1;    // absent here but in the model file as a copy of this tensor (a tied Llama's lm_head)
    size_t head_rows = 0;  // rows per attention head: a column split never cuts one (0: rows without heads)
    bool trained = true;   // AdamW updates it (the router's selection bias is moved by the loads instead)
    LayerSet layers = LayerSet::Every;  // the layers that hold it (a layer tensor)

    size_t rows() const { return parts[0] + parts[1] + parts[2]; }
    // a tp rank's gradient is a partial sum of the group's (with sequence parallelism on or off)
    bool partial_over_tp(bool sp) const {
        return tp_grad == TPGrad::HeadsPartial || (tp_grad == TPGrad::SequencePartial && sp);
    }
    size_t block() const { return rows() * cols; }  // one layer's (and expert's) elements in the whole model
    // A column split cuts part p into tp pieces, one a rank, or, where the part has fewer heads than tp, into
    // its heads, each then held whole by tp/heads consecutive ranks (as Megatron-LM replicates key/value heads):
    // the pieces, the rows of one, and the piece tp rank r holds
    size_t pieces(int p, int tp) const {
        size_t heads = head_rows ? parts[p] / head_rows : 0;
        return heads > 0 && heads < (size_t)tp ? heads : tp;
    }
    size_t piece_rows(int p, int tp) const { return parts[p] / pieces(p, tp); }
    size_t piece_of(int p, int tp, int r) const { return r / (tp / pieces(p, tp)); }
    // ... and on one rank of a tensor-parallel group of tp ranks: its rows and its block
    size_t local_rows(int tp) const {
        switch (split) {
            case TPSplit::Column: return piece_rows(0, tp) + piece_rows(1, tp) + piece_rows(2, tp);
            case TPSplit::Vocab: return (size_t)vocab_rows((int)rows(), tp);
            default: return rows();
        }
    }
    size_t local_cols(int tp) const { return split == TPSplit::Row ? cols / tp : cols; }
    size_t block(int tp) const { return local_rows(tp) * local_cols(tp); }
    // where in a rank's block (from a local row, that many rows) a column split's pieces held by several ranks
    // lie, and how many consecutive ranks hold each
    struct SharedRows {
        size_t first, rows;
        int ranks;
    };
    std::vector<SharedRows> shared_rows(int tp) const {
        std::vector<SharedRows> shared;
        size_t first = 0;  // the part's first row in the rank's block
        for (int p = 0; split == TPSplit::Column && p < 3; first += piece_rows(p++, tp))
            if (pieces(p, tp) < (size_t)tp) shared.push_back({first, piece_rows(p, tp), tp / (int)pieces(p, tp)});
        return shared;
    }
    // calls f(at, count, ranks) for each range of the tensor's `size` elements in a rank's share (its blocks:
    // one per layer and expert) that `ranks` consecutive tp ranks hold alike: the pieces of a column split
    // several ranks hold
    template <typename F>
    void for_each_shared(size_t size, int tp, F&& f) const {
        std::vector<SharedRows> shared = shared_rows(tp);
        size_t b = block(tp), c = local_cols(tp);
        for (size_t k = 0; !shared.empty() && k < size / b; k++)
            for (const SharedRows& r : shared) f(k * b + r.first * c, r.rows * c, r.ranks);
    }
};
using ModelTable = std::array<TensorSpec, NUM_PARAM_TENSORS>;

// GPT-2: learned positions, layernorms with biases, biases on every matmul but the classifier, a 4C MLP with
// GELU, and the classifier tied to wte
inline ModelTable gpt2_table(const GPTConfig& c) {
    const TPSplit rep = TPSplit::Replicated, column = TPSplit::Column, row = TPSplit::Row, vocab = TPSplit::Vocab;
    const Holder emb = Holder::Embeddings, layer = Holder::Layer, head = Holder::Head;
    const Init zeros = Init::Zeros, ones = Init::Ones, normal = Init::Normal, residual = Init::ResidualNormal;
    size_t C = c.channels, Vp = c.padded_vocab_size, H = c.mlp_hidden(), router = c.moe() ? c.num_experts : 0;
    size_t Hd = c.count_dense_layers() > 0 ? c.hidden() : 0, Hs = c.shared_size, gate = c.shared_gate;
    size_t bias = c.router_bias ? c.num_experts : 0;
    bool expert = true, decay = true;
    const TPGrad own = TPGrad::Own, sp = TPGrad::SequencePartial;
    ModelTable table = {{
        // name       holder      experts   rows           cols split   AdamW     tp grad   init
        {"wte",      emb,        !expert, {Vp},         C,   vocab,  decay,  own,      normal},
        {"wpe",      emb,        !expert, {(size_t)c.max_seq_len}, C, rep, decay, sp,      normal},
        {"ln1w",     layer,      !expert, {C},          1,   rep,    !decay, sp,       ones},
        {"ln1b",     layer,      !expert, {C},          1,   rep,    !decay, sp,       zeros},
        {"qkvw",     layer,      !expert, {C, C, C},    C,   column, decay,  own,      normal},
        {"qkvb",     layer,      !expert, {C, C, C},    1,   column, !decay, own,      zeros},
        {"attprojw", layer,      !expert, {C},          C,   row,    decay,  own,      residual},
        {"attprojb", layer,      !expert, {C},          1,   rep,    !decay, own,      zeros},
        {"ln2w",     layer,      !expert, {C},          1,   rep,    !decay, sp,       ones},
        {"ln2b",     layer,      !expert, {C},          1,   rep,    !decay, sp,       zeros},
        {"routerw",  layer,      !expert, {router},     C,   rep,    decay,  own,      normal},
        {"fcw",      layer,      expert,  {H},          C,   column, decay,  own,      normal},
        {"fcb",      layer,      expert,  {H},          1,   column, !decay, own,      zeros},
        {"fcprojw",  layer,      expert,  {C},          H,   row,    decay,  own,      residual},
        {"fcprojb",  layer,      expert,  {C},          1,   rep,    !decay, own,      zeros},
        {"lnfw",     head,       !expert, {C},          1,   rep,    !decay, sp,       ones},
        {"lnfb",     head,       !expert, {C},          1,   rep,    !decay, sp,       zeros},
        {"qnormw",   layer,      !expert, {0},          1,   rep,    !decay, own,      ones},
        {"knormw",   layer,      !expert, {0},          1,   rep,    !decay, own,      ones},
        {"dense_fcw", layer,     !expert, {Hd},         C,   column, decay,  own,      normal},
        {"dense_fcb", layer,     !expert, {Hd},         1,   column, !decay, own,      zeros},
        {"dense_fcprojw", layer, !expert, {C},          Hd,  row,    decay,  own,      residual},
        {"dense_fcprojb", layer, !expert, {Hd ? C : 0}, 1,   rep,    !decay, own,      zeros},
        {"shared_fcw", layer,    !expert, {Hs},         C,   column, decay,  own,      normal},
        {"shared_fcb", layer,    !expert, {Hs},         1,   column, !decay, own,      zeros},
        {"shared_fcprojw", layer, !expert, {C},         Hs,  row,    decay,  own,      residual},
        {"shared_fcprojb", layer, !expert, {Hs ? C : 0}, 1,  rep,    !decay, own,      zeros},
        {"shared_gatew", layer,  !expert, {gate},       C,   rep,    decay,  own,      normal},
        {"router_bias", layer,   !expert, {bias},       1,   rep,    !decay, own,      zeros},
    }};
    table[QKVW].head_rows = table[QKVB].head_rows = c.head_size();
    return table;
}

// Llama 3: no position table, RMSNorm without biases, no biases anywhere (but q, k and v's where the model has
// them: Qwen2's attention_bias), grouped-query attention (NH query
// heads and KV key/value heads of hd channels, so qkvw has NH·hd + 2·KV·hd rows), SwiGLU's two input matrices
// c_fc and c_fc2 stacked in fcw (a column split takes its rows of each), and a classifier, lm_head, in the slot
// of GPT-2's wpe as llm.c's Llama 3 files keep it; wte and lm_head have the padded vocab's rows, as GPT-2's wte
// does, of which the files hold the vocab's (llmc/model_file.h's file_vocab_rows). The bias slots are empty here; the
// files hold them, as zeros (file_rows). A tied model (Llama 3.2 1B and 3B) has no lm_head: its classifier is
// wte, which its files repeat in lm_head's slot (file_copy), so that llm.c reads them as they are. With experts (Mixtral's shape) every
// layer has a router (E×C, after ln2's slots) and E SwiGLU experts, each MLP tensor stacking them as GPT-2's do.
// Qwen3 is this table with its own head size (Q = NH·hd need not be C) and the QK-norm weights: one hd-vector
// per layer for the query heads and one for the key heads, shared by the heads (at the end of the files; a tp
// rank's gradient of them comes from its own heads only).
inline ModelTable llama_table(const GPTConfig& c) {
    const TPSplit rep = TPSplit::Replicated, column = TPSplit::Column, row = TPSplit::Row, vocab = TPSplit::Vocab;
    const Holder emb = Holder::Embeddings, layer = Holder::Layer, head = Holder::Head;
    const Init zeros = Init::Zeros, ones = Init::Ones, normal = Init::Normal, residual = Init::ResidualNormal;
    size_t C = c.channels, Vp = c.padded_vocab_size, hd = c.head_size(), Q = c.num_heads * hd, KV = c.kv_heads() * hd;
    size_t H = c.mlp_hidden(), router = c.moe() ? c.num_experts : 0, qk = c.qk_norm() ? hd : 0;
    size_t Hd = c.count_dense_layers() > 0 ? c.hidden() : 0, Hs = c.shared_size, gate = c.shared_gate;
    size_t bias = c.router_bias ? c.num_experts : 0;
    size_t qb = c.attention_bias;  // q, k and v biases, or none (the files' slot then holds zeros)
    bool expert = true, decay = true, tied = c.tied_embeddings;
    const TPGrad own = TPGrad::Own, sp = TPGrad::SequencePartial, heads = TPGrad::HeadsPartial;
    ModelTable table = {{
        // name       holder      experts   rows        cols split   AdamW     tp grad   init      zeros in the file, copy of
        {"wte",      emb,        !expert, {Vp},       C,   vocab,  decay,  own,      normal},
        {"lm_head",  head,       !expert, {tied ? 0 : Vp}, C, vocab, decay, own,      normal, 0,  tied ? WTE : -1},
        {"ln1w",     layer,      !expert, {C},        1,   rep,    !decay, sp,       ones},
        {"ln1b",     layer,      !expert, {0},        1,   rep,    !decay, sp,       zeros,   C},
        {"qkvw",     layer,      !expert, {Q, KV, KV}, C,  column, decay,  own,      normal},
        {"qkvb",     layer,      !expert, {qb * Q, qb * KV, qb * KV}, 1, column, !decay, own, zeros, (1 - qb) * (Q + 2 * KV)},
        {"attprojw", layer,      !expert, {C},        Q,   row,    decay,  own,      residual},
        {"attprojb", layer,      !expert, {0},        1,   rep,    !decay, own,      zeros,   C},
        {"ln2w",     layer,      !expert, {C},        1,   rep,    !decay, sp,       ones},
        {"ln2b",     layer,      !expert, {0},        1,   rep,    !decay, sp,       zeros,   C},
        {"routerw",  layer,      !expert, {router},   C,   rep,    decay,  own,      normal},
        {"fcw",      layer,      expert,  {H, H},     C,   column, decay,  own,      normal},
        {"fcb",      layer,      expert,  {0},        1,   column, !decay, own,      zeros,   2 * H},
        {"fcprojw",  layer,      expert,  {C},        H,   row,    decay,  own,      residual},
        {"fcprojb",  layer,      expert,  {0},        1,   rep,    !decay, own,      zeros,   C},
        {"lnfw",     head,       !expert, {C},        1,   rep,    !decay, sp,       ones},
        {"lnfb",     head,       !expert, {0},        1,   rep,    !decay, sp,       zeros,   C},
        {"qnormw",   layer,      !expert, {qk},       1,   rep,    !decay, heads,    ones},
        {"knormw",   layer,      !expert, {qk},       1,   rep,    !decay, heads,    ones},
        {"dense_fcw", layer,     !expert, {Hd, Hd},   C,   column, decay,  own,      normal},
        {"dense_fcb", layer,     !expert, {0},        1,   column, !decay, own,      zeros},
        {"dense_fcprojw", layer, !expert, {C},        Hd,  row,    decay,  own,      residual},
        {"dense_fcprojb", layer, !expert, {0},        1,   rep,    !decay, own,      zeros},
        {"shared_fcw", layer,    !expert, {Hs, Hs},   C,   column, decay,  own,      normal},
        {"shared_fcb", layer,    !expert, {0},        1,   column, !decay, own,      zeros},
        {"shared_fcprojw", layer, !expert, {C},       Hs,  row,    decay,  own,      residual},
        {"shared_fcprojb", layer, !expert, {0},       1,   rep,    !decay, own,      zeros},
        {"shared_gatew", layer,  !expert, {gate},     C,   rep,    decay,  own,      normal},
        {"router_bias", layer,   !expert, {bias},     1,   rep,    !decay, own,      zeros},
    }};
    table[QKVW].head_rows = table[QKVB].head_rows = hd;  // with fewer key/value heads than tp ranks, each is held by tp/KV ranks
    return table;
}

// A model with experts has them in its sparse layers, their router and any shared expert with them, and in its
// dense layers (if any) an MLP of the architecture's own (GPT-2's with biases, SwiGLU's without), hidden() units
// wide
inline ModelTable model_table(const GPTConfig& c) {
    ModelTable table = c.llama() ? llama_table(c) : gpt2_table(c);
    for (int t : {ROUTERW, FCW, FCB, FCPROJW, FCPROJB, SHARED_FCW, SHARED_FCB, SHARED_FCPROJW, SHARED_FCPROJB,
                  SHARED_GATEW, ROUTER_BIAS})
        table[t].layers = LayerSet::Experts;
    table[ROUTER_BIAS].trained = false;
    for (int t : {DENSE_FCW, DENSE_FCB, DENSE_FCPROJW, DENSE_FCPROJB}) table[t].layers = LayerSet::Dense;
    return table;
}

// The tensors of an MLP: the experts' (a dense model's one expert), a dense layer's of a model with experts, a
// sparse layer's shared expert's; and those of model layer l's MLP
struct MlpTensors {
    int fcw, fcb, fcprojw, fcprojb;
};
constexpr MlpTensors EXPERT_MLP = {FCW, FCB, FCPROJW, FCPROJB};
constexpr MlpTensors DENSE_MLP = {DENSE_FCW, DENSE_FCB, DENSE_FCPROJW, DENSE_FCPROJB};
constexpr MlpTensors SHARED_MLP = {SHARED_FCW, SHARED_FCB, SHARED_FCPROJW, SHARED_FCPROJB};
inline MlpTensors mlp_tensors(const GPTConfig& c, int layer) { return c.dense_layer(layer) ? DENSE_MLP : EXPERT_MLP; }

// how many of a part's first n layers hold a tensor of the layer set (n = part.layers(): all of the part's)
inline size_t held_layers(const GPTConfig& c, LayerSet set, const ModelPart& part, int n) {
    size_t k = 0;
    for (int l = 0; l < n; l++) k += layer_holds(c, set, part.model_layer(l));
    return k;
}
// the sparse layers of a part (none in a dense model)
inline int sparse_layers(const GPTConfig& c, const ModelPart& part) {
    return c.moe() ? (int)held_layers(c, LayerSet::Experts, part, part.layers()) : 0;
}

// The weights one token passes through in each model layer: every matrix the layer holds, an expert tensor's K
// blocks of E (the experts it is routed to). A layer's matmul FLOPs per token are twice this: the pipeline's
// split weighs layers of different kinds by it (llmc/pp.cuh).
inline std::vector<double> layer_token_weights(const GPTConfig& c) {
    ModelTable table = model_table(c);
    std::vector<double> n(c.num_layers, 0.0);
    for (int l = 0; l < c.num_layers; l++)
        for (const TensorSpec& t : table)
            if (t.holder == Holder::Layer && t.cols > 1 && layer_holds(c, t.layers, l))
                n[l] += (double)t.block() * (t.expert ? c.top_k : 1);
    return n;
}

// the tensor the classifier multiplies by: the token embedding (GPT-2's, a tied Llama's), or Llama's lm_head
inline int classifier_tensor(const GPTConfig& c) { return c.tied() ? WTE : LM_HEAD; }

inline const char* param_tensor_name(const GPTConfig& c, int tensor) { return model_table(c)[tensor].name; }

// ----------------------------------------------------------------------------------------------------------
// sizes and the flat buffers

// the tensors' sizes on one rank of a tensor-parallel group of tp ranks and an expert-parallel group of ep
// ranks (1 and 1: the whole model), for a part of the model: its layers, the embeddings and the final norm if
// it holds them (empty tensors otherwise), E/ep blocks of each expert tensor
inline void param_tensor_sizes(const GPTConfig& c, size_t sizes[NUM_PARAM_TENSORS], int tp, const ModelPart& part,
                               int ep = 1) {
    ModelTable table = model_table(c);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        const TensorSpec& s = table[t];
        size_t blocks = s.holder == Holder::Layer        ? held_layers(c, s.layers, part, part.layers())
                        : s.holder == Holder::Embeddings ? part.embeddings()
                                                         : part.last;
        sizes[t] = blocks * (s.expert ? c.num_experts / ep : 1) * s.block(tp);
    }
}
inline void param_tensor_sizes(const GPTConfig& c, size_t sizes[NUM_PARAM_TENSORS], int tp = 1) {
    param_tensor_sizes(c, sizes, tp, whole_part(c));
}

inline size_t num_parameters(const GPTConfig& c, int tp, const ModelPart& part, int ep = 1) {
    size_t sizes[NUM_PARAM_TENSORS], n = 0;
    param_tensor_sizes(c, sizes, tp, part, ep);
    for (size_t s : sizes) n += s;
    return n;
}
inline size_t num_parameters(const GPTConfig& c, int tp = 1) { return num_parameters(c, tp, whole_part(c)); }

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

// ----------------------------------------------------------------------------------------------------------
// units: the parameters that forward uses together and that backward finishes together, numbered in the order
// backward finishes them: 0 the head (the final norm, and a classifier of its own), 1..L the layers from last
// to first, L+1 the embeddings (a tied token embedding is also the classifier, so its gradient is final only at
// the very end). Data parallelism reduces gradients unit by unit as backward goes; ZeRO-3 gathers parameters
// unit by unit. L counts the layers of the model's part; a part without the head or the embeddings has those
// units empty.
constexpr int HEAD_UNIT = 0;
inline int num_units(int layers) { return layers + 2; }
inline int layer_unit(int layers, int layer) { return layers - layer; }
inline int embedding_unit(int layers) { return layers + 1; }
// the unit that holds the classifier's weight (classifier_tensor) in a part of `layers` layers
inline int classifier_unit(const GPTConfig& c, int layers) { return c.tied() ? embedding_unit(layers) : HEAD_UNIT; }

// a unit's slice of one tensor: where it sits in the flat buffer
struct Segment {
    int tensor;
    size_t offset, size;
};

// each unit's slices in tensor order (indexed by unit); packed back to back, they are the unit's packed layout. A
// tensor the architecture lacks (a dense model's router) has none, nor has a layer's unit a tensor of another
// kind of layer (a dense layer's the experts'); one the part lacks, an empty one. The table and the sizes are
// read once for every unit (--search lays out some 10^5 layouts).
inline std::vector<std::vector<Segment>> unit_segments(const GPTConfig& c, int tp, const ModelPart& part, int ep = 1) {
    ModelTable table = model_table(c);
    size_t sizes[NUM_PARAM_TENSORS], L = part.layers();
    param_tensor_sizes(c, sizes, tp, part, ep);
    std::vector<std::vector<Segment>> units(num_units((int)L));
    size_t offset = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; offset += sizes[t++]) {
        const TensorSpec& s = table[t];
        if (s.block() == 0) continue;
        if (s.holder != Holder::Layer) {
            units[s.holder == Holder::Head ? HEAD_UNIT : embedding_unit((int)L)].push_back({t, offset, sizes[t]});
            continue;
        }
        // the layers holding the tensor keep one block each, in layer order
        size_t held = held_layers(c, s.layers, part, (int)L), k = 0;
        for (int layer = 0; layer < (int)L && held > 0; layer++)  // the part's layers
            if (layer_holds(c, s.layers, part.model_layer(layer)))
                units[layer_unit((int)L, layer)].push_back({t, offset + k++ * (sizes[t] / held), sizes[t] / held});
    }
    return units;
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

// ----------------------------------------------------------------------------------------------------------
// a rank's share of the whole model

// A rank's coordinates in the groups that split the parameters: tensor parallelism splits every matrix,
// expert parallelism the experts
struct ShareSpec {
    int tp = 1, tp_rank = 0, ep = 1, ep_rank = 0;
};

// A run of elements that lie back to back both in one rank's share of the parameters and in the whole model
// (llm.c's flat layout): `count` of them, from `whole` in the model and from `local` in the share. A run never
// crosses from one tensor, layer or expert to the next.
struct ShareRun {
    size_t whole, local, count;
};

// Where a rank's share of the parameters lies in the whole model, as runs in the share's order: each tensor's
// blocks (per layer of the rank's part, per expert of its ep rank's E/ep) placed by the table's split, a column
// split giving a run per part, a row split a run per row joined where rows are whole. What copy_share_params
// moves, and what a checkpoint's index records.
inline std::vector<ShareRun> share_runs(const GPTConfig& c, const ShareSpec& sh, const ModelPart& part) {
    ModelTable table = model_table(c);
    size_t ws[NUM_PARAM_TENSORS], ls[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, ws, 1);
    param_tensor_sizes(c, ls, sh.tp, part, sh.ep);
    std::vector<ShareRun> runs;
    // `join`: the run may continue the one before (the next row of a matrix the rank holds whole)
    auto add = [&](size_t whole, size_t local, size_t n, bool join) {
        if (join && runs.back().whole + runs.back().count == whole && runs.back().local + runs.back().count == local)
            runs.back().count += n;
        else
            runs.push_back({whole, local, n});
    };
    // one block of a tensor: at `whole` in the model, at `local` in the share
    auto place = [&](const TensorSpec& s, size_t whole, size_t local) {
        int tp = sh.tp, rank = sh.tp_rank;
        size_t cols = s.cols;
        if (s.split == TPSplit::Column) {
            size_t first = 0, mine = 0;  // the part's first row in the block, and in the rank's block
            for (int p = 0; p < 3 && s.parts[p] > 0; first += s.parts[p], mine += s.piece_rows(p++, tp)) {
                size_t n = s.piece_rows(p, tp);
                add(whole + (first + s.piece_of(p, tp, rank) * n) * cols, local + mine * cols, n * cols, false);
            }
        } else if (s.split == TPSplit::Row) {
            for (size_t r = 0, k = cols / tp; r < s.rows(); r++) add(whole + r * cols + rank * k, local + r * k, k, r > 0);
        } else if (s.split == TPSplit::Vocab) {
            size_t V = s.rows(), Vl = vocab_rows((int)V, sh.tp), lo = rank * Vl;
            if (lo < V) add(whole + lo * cols, local, (std::min(V, lo + Vl) - lo) * cols, false);
        } else {
            add(whole, local, s.block(), false);
        }
    };
    size_t Lp = part.layers(), E = c.num_experts, X = E / sh.ep;
    const ModelPart whole = whole_part(c);
    for (size_t t = 0, wo = 0, lo = 0; t < NUM_PARAM_TENSORS; wo += ws[t], lo += ls[t], t++) {
        const TensorSpec& s = table[t];
        if (s.block() == 0) continue;
        if (s.holder == Holder::Layer) {
            size_t experts = s.expert ? X : 1, first = s.expert ? sh.ep_rank * X : 0;
            for (size_t layer = 0, held = 0; layer < Lp; layer++) {
                int model_layer = part.model_layer((int)layer);
                if (!layer_holds(c, s.layers, model_layer)) continue;
                size_t before = held_layers(c, s.layers, whole, model_layer);  // the model's layers holding it
                for (size_t x = 0; x < experts; x++)
                    place(s, wo + (before * (s.expert ? E : 1) + first + x) * s.block(),
                          lo + (held * experts + x) * s.block(sh.tp));
                held++;
            }
        } else if (s.holder == Holder::Embeddings ? part.embeddings() : part.last) {
            place(s, wo, lo);
        }
    }
    std::sort(runs.begin(), runs.end(), [](const ShareRun& a, const ShareRun& b) { return a.local < b.local; });
    return runs;
}

// Moves parameters between the whole model and one rank's share of it (share_runs), in either direction: what
// initializing and loading a model split, and what saving one gathers.
inline void copy_share_params(const GPTConfig& c, const ShareSpec& sh, const ModelPart& part, float* whole, float* local,
                              bool to_local) {
    for (const ShareRun& r : share_runs(c, sh, part)) {
        if (to_local) memcpy(local + r.local, whole + r.whole, r.count * sizeof(float));
        else memcpy(whole + r.whole, local + r.local, r.count * sizeof(float));
    }
}

// the whole model as one share: runs that place it onto itself
inline std::vector<ShareRun> whole_runs(const GPTConfig& c) { return share_runs(c, ShareSpec{}, whole_part(c)); }

// A range of elements of a rank's share
struct ShareRange {
    size_t offset, count;
};

// The elements two ranks a ≠ b of a tp group both hold: the tensors every rank holds whole, and the pieces of a
// column split that several ranks hold (Llama's key/value heads when tp exceeds them) where a and b hold the
// same piece. Every tp rank's share has the same layout (sizes: its tensors' sizes), so the ranges lie at the
// same offsets in both; in offset order. What the gradient norm counts once and what the replica check compares.
inline std::vector<ShareRange> common_ranges(const ModelTable& table, const size_t sizes[NUM_PARAM_TENSORS], int tp,
                                             int a, int b) {
    std::vector<ShareRange> ranges;
    for (size_t t = 0, offset = 0; t < NUM_PARAM_TENSORS; offset += sizes[t++]) {
        const TensorSpec& s = table[t];
        if (sizes[t] == 0) continue;
        if (s.split == TPSplit::Replicated) {
            ranges.push_back({offset, sizes[t]});
            continue;
        }
        s.for_each_shared(sizes[t], tp, [&](size_t at, size_t count, int ranks) {
            if (a / ranks == b / ranks) ranges.push_back({offset + at, count});
        });
    }
    return ranges;
}

// ranges sorted by offset, the overlapping and touching ones joined
inline std::vector<ShareRange> merged_ranges(std::vector<ShareRange> ranges) {
    std::sort(ranges.begin(), ranges.end(), [](const ShareRange& x, const ShareRange& y) { return x.offset < y.offset; });
    std::vector<ShareRange> merged;
    for (const ShareRange& r : ranges) {
        if (!merged.empty() && r.offset <= merged.back().offset + merged.back().count)
            merged.back().count = std::max(merged.back().count, r.offset + r.count - merged.back().offset);
        else
            merged.push_back(r);
    }
    return merged;
}

// ... and the elements of rank a's share that a lower rank of its group holds too, merged, in offset order: a
// sum over the group that counts each element once leaves them out
inline std::vector<ShareRange> repeated_ranges(const ModelTable& table, const size_t sizes[NUM_PARAM_TENSORS], int tp,
                                               int a) {
    std::vector<ShareRange> all;
    for (int b = 0; b < a; b++)
        for (const ShareRange& r : common_ranges(table, sizes, tp, a, b)) all.push_back(r);
    return merged_ranges(all);
}

// ----------------------------------------------------------------------------------------------------------
// an element's coordinates

// An element of the whole model in the model's own coordinates: its tensor, the layer and the expert whose
// block of the tensor holds it (0 where the tensor has no layers or no experts), and its place in that block
struct ParamCoord {
    int tensor, layer, expert;
    size_t element;
};

// the blocks a tensor stacks (per layer that holds it, and per expert of a layer)
inline size_t param_experts(const GPTConfig& c, int t) { return model_table(c)[t].expert ? c.num_experts : 1; }
inline size_t param_block_size(const GPTConfig& c, int t) { return model_table(c)[t].block(); }
// the tensor has a block at this layer (0 for a tensor outside the layers) and expert (0 for one without experts)
inline bool param_block_exists(const GPTConfig& c, int t, int layer, int expert) {
    const TensorSpec s = model_table(c)[t];
    bool in_layer = s.holder == Holder::Layer ? layer >= 0 && layer < c.num_layers && layer_holds(c, s.layers, layer)
                                              : layer == 0;
    return in_layer && expert >= 0 && (size_t)expert < param_experts(c, t);
}

// element i of the whole model's flat buffer in the model's coordinates, and back; a layer tensor's blocks are
// those of the layers that hold it
inline ParamCoord param_coord(const GPTConfig& c, size_t i) {
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    int t = 0;
    while (t + 1 < NUM_PARAM_TENSORS && i >= sizes[t]) i -= sizes[t++];
    size_t block = param_block_size(c, t), per_layer = block * param_experts(c, t), k = i / per_layer;
    int layer = 0;  // the k-th layer that holds the tensor
    const TensorSpec s = model_table(c)[t];
    for (size_t held = 0; s.holder == Holder::Layer; layer++)
        if (layer_holds(c, s.layers, layer) && held++ == k) break;
    return {t, layer, (int)(i % per_layer / block), i % block};
}
inline size_t param_offset(const GPTConfig& c, const ParamCoord& p) {
    size_t sizes[NUM_PARAM_TENSORS], offset = 0;
    param_tensor_sizes(c, sizes);
    for (int t = 0; t < p.tensor; t++) offset += sizes[t];
    const TensorSpec s = model_table(c)[p.tensor];
    size_t before = s.holder == Holder::Layer ? held_layers(c, s.layers, whole_part(c), p.layer) : 0;
    return offset + (before * param_experts(c, p.tensor) + p.expert) * s.block() + p.element;
}

// where element i of the whole model's flat buffer lies, in words: "ln1w of layer 1, element 5"
inline std::string describe_param(const GPTConfig& c, size_t i) {
    ParamCoord p = param_coord(c, i);
    std::string where = param_tensor_name(c, p.tensor);
    if (model_table(c)[p.tensor].holder == Holder::Layer) where += strfmt(" of layer %d", p.layer);
    if (c.moe() && model_table(c)[p.tensor].expert) where += strfmt(", expert %d", p.expert);
    return where + strfmt(", element %zu", p.element);
}

// Hugging Face checkpoints at the edge: `--convert ... --format hf` writes what transformers' from_pretrained
// reads, a directory of config.json and model.safetensors (sharded above HF_SHARD_BYTES, with
// model.safetensors.index.json, as save_pretrained shards), from a whole model in llm5d's flat layout; `-e DIR`
// reads such a directory (F32, BF16 or F16) as the model to train. One table (hf_placements) says where each HF
// tensor lies in the flat buffer, for both directions.
//
// The tensors take HF's names, shapes and layouts (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM):
//   GPT-2   transformer.wte (the padded vocab rows dropped; lm_head is tied to it, so it is not written),
//           transformer.wpe, transformer.h.{l}.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj,
//           transformer.ln_f. HF's Conv1D stores a weight [in, out], the transpose of ours [out, in].
//   Llama   model.embed_tokens, model.layers.{l}.input_layernorm, self_attn.{q,k,v,o}_proj,
//           post_attention_layernorm, mlp.{gate,up,down}_proj, model.norm, lm_head (none when tied to
//           embed_tokens, tie_word_embeddings, as Llama 3.2 1B and 3B are); embed_tokens and lm_head of
//           vocab_size rows, the padded vocab rows dropped as GPT-2's are. Our fcw holds c_fc (HF's
//           up_proj) then c_fc2 (gate_proj, the one SwiGLU passes through silu). HF's Llama turns RoPE's pairs
//           (i, i + hd/2) (rotate_half), ours and Meta's (2i, 2i + 1): q_proj's and k_proj's rows are reordered
//           within each head so that HF's pair i is our pair i, which leaves every attention score unchanged.
//   Qwen3   Llama's names, and self_attn.{q,k}_norm: the QK-norm weights, reordered as a rotated head's rows
//           are (RMSNorm over a head does not see the order, so the model is the same function).
//   Qwen3-MoE (Qwen3MoeForCausalLM) Qwen3's names, and in every sparse layer mlp.gate (the router, E×C) and
//           mlp.experts.{e}.{gate,up,down}_proj, one tensor per expert as the Hub holds them (a dense layer's
//           MLP as Qwen3's); Mixtral (MixtralForCausalLM, a Llama with experts) Llama's names, and
//           block_sparse_moe.gate and block_sparse_moe.experts.{e}.{w1,w3,w2} (gate, up, down), every layer
//           sparse; Qwen2-MoE (Qwen2MoeForCausalLM: a Llama with q, k and v biases and experts) Qwen3-MoE's
//           names without QK-norm, self_attn.{q,k,v}_proj.bias, and in each sparse layer the gated shared
//           expert, mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate (1×C).
#pragma once

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/gpt.cuh"
#include "llmc/json.h"
#include "llmc/safetensors.h"

constexpr size_t HF_SHARD_BYTES = 5000000000ull;  // save_pretrained's default max_shard_size, "5GB"

// Where one HF tensor lies in the flat buffer: rows [first, first + rows) of `cols` columns of one layer's (and
// expert's) block (layer and expert 0 for a tensor without them) of our tensor, transposed in HF's file (GPT-2's Conv1D) or not, and for
// q_proj and k_proj the number of heads whose rows are reordered (0: none)
struct HfPlacement {
    std::string name;
    std::vector<int64_t> shape;
    int tensor;
    int64_t layer, expert;
    size_t first, rows, cols;
    bool transpose;
    int rotated_heads;
};

// The Hugging Face class a model is, by its properties: GPT-2's, Llama's, Qwen3's; with experts Qwen3-MoE's (a
// Qwen3), Qwen2-MoE's (a Llama with q, k and v biases and a gated shared expert) or Mixtral's (a Llama with
// neither, every layer sparse, the gates renormalized); or one line saying what has no class
enum class HfClass { GPT2, Llama, Qwen3, Qwen3Moe, Qwen2Moe, Mixtral };
inline HfClass hf_class(const GPTConfig& c) {
    if (!c.llama()) {
        if (c.moe())
            fail("--format hf: GPT-2 with experts (%d, top-%d) has no Hugging Face form (Mixtral, Qwen2-MoE and "
                 "Qwen3-MoE are Llama's and Qwen3's)", c.num_experts, c.top_k);
        return HfClass::GPT2;
    }
    if (c.sigmoid_scores || c.routed_scale != 1 || c.router_bias)
        fail("--format hf: sigmoid scores, scaled gates or a selection bias (DeepSeek-V3's routing) have no Hugging "
             "Face form here");
    if (c.shared_size > 0 && !c.shared_gate)
        fail("--format hf: a shared expert without a gate (DeepSeek's) has no Hugging Face form here (Qwen2-MoE's is "
             "gated: z<H>)");
    if (c.arch == Arch::Qwen3) {
        if (c.attention_bias) fail("--format hf: Qwen3 here has no q, k and v biases");
        if (c.shared_size > 0) fail("--format hf: Qwen3-MoE has no shared expert (Qwen2-MoE, a Llama shape, has)");
        return c.moe() ? HfClass::Qwen3Moe : HfClass::Qwen3;
    }
    if (c.shared_size > 0) {
        if (!c.attention_bias) fail("--format hf: Qwen2-MoE's q, k and v have biases; this model's have none (b)");
        return HfClass::Qwen2Moe;
    }
    if (c.attention_bias)
        fail("--format hf: a Llama with q, k and v biases is Qwen2's, whose dense form (Qwen2ForCausalLM) is not "
             "built; with experts it is Qwen2-MoE, which has a gated shared expert (z<H>)");
    if (!c.moe()) return HfClass::Llama;
    if (!c.norm_topk)
        fail("--format hf: Mixtral renormalizes its top-%d gates; this model's are not (a Qwen3 shape can be "
             "Qwen3-MoE, whose norm_topk_prob says either)", c.top_k);
    if (c.count_dense_layers() > 0)
        fail("--format hf: Mixtral has experts in every layer; this model has %d dense layers (a Qwen3 shape can be "
             "Qwen3-MoE, whose mlp_only_layers and decoder_sparse_step say which)", c.count_dense_layers());
    return HfClass::Mixtral;
}

// the whole model's HF tensors, in HF's order: the one table export and import both read
inline std::vector<HfPlacement> hf_placements(const GPTConfig& c) {
    HfClass cls = hf_class(c);
    int64_t L = c.num_layers, C = c.channels, V = c.vocab_size, H = c.mlp_hidden();
    std::vector<HfPlacement> out;
    // rows [first, first + n) of `cols` columns of layer l's (expert x's) block of tensor t, as HF's shape
    auto add_expert = [&](std::string name, int t, int64_t l, int64_t x, size_t first, size_t n, size_t cols,
                          bool transpose = false, int rotated = 0) {
        std::vector<int64_t> shape = cols == 1 ? std::vector<int64_t>{(int64_t)n}
                                     : transpose ? std::vector<int64_t>{(int64_t)cols, (int64_t)n}
                                                 : std::vector<int64_t>{(int64_t)n, (int64_t)cols};
        out.push_back({std::move(name), shape, t, l, x, first, n, cols, transpose, rotated});
    };
    auto add = [&](std::string name, int t, int64_t l, size_t first, size_t n, size_t cols, bool transpose = false,
                   int rotated = 0) { add_expert(std::move(name), t, l, 0, first, n, cols, transpose, rotated); };
    if (!c.llama()) {
        add("transformer.wte.weight", WTE, 0, 0, V, C);
        add("transformer.wpe.weight", WPE, 0, 0, c.max_seq_len, C);
        for (int64_t l = 0; l < L; l++) {
            std::string h = strfmt("transformer.h.%ld.", (long)l);
            add(h + "ln_1.weight", LN1W, l, 0, C, 1);
            add(h + "ln_1.bias", LN1B, l, 0, C, 1);
            add(h + "attn.c_attn.weight", QKVW, l, 0, 3 * C, C, true);
            add(h + "attn.c_attn.bias", QKVB, l, 0, 3 * C, 1);
            add(h + "attn.c_proj.weight", ATTPROJW, l, 0, C, C, true);
            add(h + "attn.c_proj.bias", ATTPROJB, l, 0, C, 1);
            add(h + "ln_2.weight", LN2W, l, 0, C, 1);
            add(h + "ln_2.bias", LN2B, l, 0, C, 1);
            add(h + "mlp.c_fc.weight", FCW, l, 0, H, C, true);
            add(h + "mlp.c_fc.bias", FCB, l, 0, H, 1);
            add(h + "mlp.c_proj.weight", FCPROJW, l, 0, C, H, true);
            add(h + "mlp.c_proj.bias", FCPROJB, l, 0, C, 1);
        }
        add("transformer.ln_f.weight", LNFW, 0, 0, C, 1);
        add("transformer.ln_f.bias", LNFB, 0, 0, C, 1);
        return out;
    }
    int NH = c.num_heads, KV = c.kv_heads(), hd = c.head_size();
    size_t Q = (size_t)NH * hd, K = (size_t)KV * hd;
    add("model.embed_tokens.weight", WTE, 0, 0, V, C);
    for (int64_t l = 0; l < L; l++) {
        std::string h = strfmt("model.layers.%ld.", (long)l);
        add(h + "input_layernorm.weight", LN1W, l, 0, C, 1);
        add(h + "self_attn.q_proj.weight", QKVW, l, 0, Q, C, false, NH);
        add(h + "self_attn.k_proj.weight", QKVW, l, Q, K, C, false, KV);
        add(h + "self_attn.v_proj.weight", QKVW, l, Q + K, K, C);
        if (c.attention_bias) {
            add(h + "self_attn.q_proj.bias", QKVB, l, 0, Q, 1, false, NH);
            add(h + "self_attn.k_proj.bias", QKVB, l, Q, K, 1, false, KV);
            add(h + "self_attn.v_proj.bias", QKVB, l, Q + K, K, 1);
        }
        add(h + "self_attn.o_proj.weight", ATTPROJW, l, 0, C, Q);
        if (c.qk_norm()) {
            add(h + "self_attn.q_norm.weight", QNORMW, l, 0, hd, 1, false, 1);
            add(h + "self_attn.k_norm.weight", KNORMW, l, 0, hd, 1, false, 1);
        }
        add(h + "post_attention_layernorm.weight", LN2W, l, 0, C, 1);
        if (!c.sparse_layer((int)l)) {  // a dense model's MLP, or a dense layer's (Qwen3-MoE's mlp_only_layers)
            MlpTensors mlp = mlp_tensors(c, (int)l);
            int64_t Hl = c.dense_layer((int)l) ? c.hidden() : H;
            add(h + "mlp.gate_proj.weight", mlp.fcw, l, Hl, Hl, C);
            add(h + "mlp.up_proj.weight", mlp.fcw, l, 0, Hl, C);
            add(h + "mlp.down_proj.weight", mlp.fcprojw, l, 0, C, Hl);
            continue;
        }
        // the experts' SwiGLU: Qwen-MoE names it as the dense MLP, Mixtral w1 (gate), w3 (up) and w2 (down)
        bool mixtral = cls == HfClass::Mixtral;
        std::string block = h + (mixtral ? "block_sparse_moe." : "mlp.");
        add(block + "gate.weight", ROUTERW, l, 0, c.num_experts, C);
        for (int64_t x = 0; x < c.num_experts; x++) {
            std::string e = block + strfmt("experts.%ld.", (long)x);
            add_expert(e + (mixtral ? "w1.weight" : "gate_proj.weight"), FCW, l, x, H, H, C);
            add_expert(e + (mixtral ? "w3.weight" : "up_proj.weight"), FCW, l, x, 0, H, C);
            add_expert(e + (mixtral ? "w2.weight" : "down_proj.weight"), FCPROJW, l, x, 0, C, H);
        }
        if (c.shared_size > 0) {  // Qwen2-MoE's shared expert and its gate
            int64_t Hs = c.shared_size;
            add(block + "shared_expert.gate_proj.weight", SHARED_FCW, l, Hs, Hs, C);
            add(block + "shared_expert.up_proj.weight", SHARED_FCW, l, 0, Hs, C);
            add(block + "shared_expert.down_proj.weight", SHARED_FCPROJW, l, 0, C, Hs);
            add(block + "shared_expert_gate.weight", SHARED_GATEW, l, 0, 1, C);
        }
    }
    add("model.norm.weight", LNFW, 0, 0, C, 1);
    if (!c.tied_embeddings) add("lm_head.weight", LM_HEAD, 0, 0, V, C);
    return out;
}

// where our row r of a rotated head goes in HF's: our pair (2i, 2i + 1) is HF's (i, hd/2 + i)
inline int hf_rotated_row(int r, int hd) { return r % 2 == 0 ? r / 2 : hd / 2 + r / 2; }

// where a placement's block starts in the flat buffer
inline float* hf_block(const GPTConfig& c, float* params, const HfPlacement& p) {
    return params + param_offset(c, {p.tensor, (int)p.layer, (int)p.expert, 0});
}

// A placement's values in HF's layout, from the flat buffer (export), or into it (import)
inline void hf_move(const GPTConfig& c, float* params, const HfPlacement& p, float* values, bool to_hf) {
    float* m = hf_block(c, params, p);
    int hd = c.head_size();
    for (size_t r = 0; r < p.rows; r++) {
        // the HF row this row of ours lands in: rotated heads reorder theirs within each head
        size_t hf = r;
        if (p.rotated_heads) hf = r / hd * hd + hf_rotated_row((int)(r % hd), hd);
        for (size_t k = 0; k < p.cols; k++) {
            float& ours = m[(p.first + r) * p.cols + k];
            float& theirs = values[p.transpose ? k * p.rows + hf : hf * p.cols + k];
            if (to_hf) theirs = ours;
            else ours = theirs;
        }
    }
}

// the shortest decimal that reads back as the same float (1e-05, not 9.99999975e-06); a whole number in full
// (Qwen3's rope_theta 1000000, not 1e+06, as its config.json has it)
inline std::string hf_float(float v) {
    if (v == std::floor(v) && std::fabs(v) < 16777216.0f) return strfmt("%.0f", v);
    for (int digits = 6;; digits++) {
        std::string s = strfmt("%.*g", digits, v);
        if (strtof(s.c_str(), nullptr) == v || digits == 9) return s;
    }
}

// the transformers class that holds the model, and its model_type
inline const char* hf_architecture(const GPTConfig& c) {
    switch (hf_class(c)) {
        case HfClass::GPT2: return "GPT2LMHeadModel";
        case HfClass::Llama: return "LlamaForCausalLM";
        case HfClass::Qwen3: return "Qwen3ForCausalLM";
        case HfClass::Qwen3Moe: return "Qwen3MoeForCausalLM";
        case HfClass::Qwen2Moe: return "Qwen2MoeForCausalLM";
        case HfClass::Mixtral: return "MixtralForCausalLM";
    }
    return "";
}
inline const char* hf_model_type(const GPTConfig& c) {
    switch (hf_class(c)) {
        case HfClass::GPT2: return "gpt2";
        case HfClass::Llama: return "llama";
        case HfClass::Qwen3: return "qwen3";
        case HfClass::Qwen3Moe: return "qwen3_moe";
        case HfClass::Qwen2Moe: return "qwen2_moe";
        case HfClass::Mixtral: return "mixtral";
    }
    return "";
}

// config.json: what from_pretrained needs to build the model, HF's field names
inline std::string hf_config_json(const GPTConfig& c, const std::string& dtype) {
    std::string torch_dtype = dtype == "bf16" ? "bfloat16" : "float32";
    if (!c.llama())
        return strfmt(
            "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n  \"vocab_size\": %d,\n"
            "  \"n_positions\": %d,\n  \"n_ctx\": %d,\n  \"n_embd\": %d,\n  \"n_layer\": %d,\n  \"n_head\": %d,\n"
            "  \"n_inner\": null,\n  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n"
            "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"initializer_range\": 0.02,\n"
            "  \"bos_token_id\": 50256,\n  \"eos_token_id\": 50256,\n  \"tie_word_embeddings\": true,\n"
            "  \"torch_dtype\": \"%s\"\n}\n",
            c.vocab_size, c.max_seq_len, c.max_seq_len, c.channels, c.num_layers, c.num_heads, torch_dtype.c_str());
    std::string scaling = c.rope_scaling > 0 ? strfmt("{\n    \"rope_type\": \"llama3\",\n    \"factor\": %s,\n"
                                                      "    \"low_freq_factor\": 1.0,\n    \"high_freq_factor\": 4.0,\n"
                                                      "    \"original_max_position_embeddings\": 8192\n  }",
                                                      hf_float(c.rope_scaling).c_str())
                                             : "null";
    HfClass cls = hf_class(c);
    bool mixtral = cls == HfClass::Mixtral, qwen2 = cls == HfClass::Qwen2Moe;
    // what each architecture adds: Qwen's attention window (off), Llama's MLP bias (none), the experts
    std::string own = cls == HfClass::Llama ? "  \"mlp_bias\": false,\n"
                      : mixtral             ? "  \"sliding_window\": null,\n"
                                            : "  \"use_sliding_window\": false,\n  \"sliding_window\": null,\n";
    if (mixtral)
        own += strfmt("  \"num_local_experts\": %d,\n  \"num_experts_per_tok\": %d,\n", c.num_experts, c.top_k);
    else if (c.moe()) {  // the dense layers: the first ones, and those off the sparse step
        std::string dense;
        for (int l = 0; l < c.dense_layers; l++) dense += strfmt(l ? ", %d" : "%d", l);
        own += strfmt("  \"num_experts\": %d,\n  \"num_experts_per_tok\": %d,\n  \"moe_intermediate_size\": %d,\n"
                      "  \"norm_topk_prob\": %s,\n  \"decoder_sparse_step\": %d,\n  \"mlp_only_layers\": [%s],\n",
                      c.num_experts, c.top_k, c.expert_hidden(), c.norm_topk ? "true" : "false", c.sparse_step,
                      dense.c_str());
        if (qwen2)  // its shared expert, and its q, k and v biases (always on in Qwen2MoeAttention)
            own += strfmt("  \"shared_expert_intermediate_size\": %d,\n  \"qkv_bias\": true,\n", c.shared_size);
    }
    return strfmt(
        "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n  \"vocab_size\": %d,\n"
        "  \"max_position_embeddings\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n"
        "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n"
        "  \"head_dim\": %d,\n  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": %s,\n  \"rope_theta\": %s,\n"
        "  \"rope_scaling\": %s,\n%s%s"
        "  \"tie_word_embeddings\": %s,\n  \"initializer_range\": 0.02,\n  \"torch_dtype\": \"%s\"\n}\n",
        hf_architecture(c), hf_model_type(c), c.vocab_size, c.max_seq_len,
        c.channels, mixtral ? c.expert_hidden() : c.hidden(), c.num_layers, c.num_heads, c.kv_heads(), c.head_size(),
        hf_float(c.norm_eps).c_str(), hf_float(c.rope_theta).c_str(), scaling.c_str(),
        qwen2 ? "" : "  \"attention_bias\": false,\n", own.c_str(),
        c.tied_embeddings ? "true" : "false", torch_dtype.c_str());
}

// a directory with a config.json, as every Hugging Face model directory has
inline bool is_hf_dir(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && file_exists(path + "/config.json");
}

// The tokenizer files of a Hugging Face directory, which --convert --format hf copies beside the weights so that
// the directory loads whole (AutoTokenizer and generate read them): the paths of those present in `source` (the
// model's own directory, or the -e a checkpoint's run was started from). A missing one, or a source that is no
// Hugging Face directory (a descriptor, an llm.c file), is a note: the weights are written without it.
constexpr const char* HF_TOKENIZER_FILES[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                              "generation_config.json"};
inline std::vector<std::string> hf_tokenizer_files(const std::string& source) {
    std::vector<std::string> present;
    if (!is_hf_dir(source)) {
        printf("note: no tokenizer files copied: the model came from %s, not a Hugging Face directory\n",
               source.empty() ? "a checkpoint whose manifest does not name its source" : source.c_str());
        return present;
    }
    for (const char* name : HF_TOKENIZER_FILES) {
        std::string path = source + "/" + name;
        if (file_exists(path)) present.push_back(path);
        else printf("note: %s is absent, not copied\n", path.c_str());
    }
    return present;
}

// Writes the whole model (params: its flat buffer) as the Hugging Face directory `dir`, which must not exist:
// config.json and the tensors in float32 or bfloat16 (dtype "fp32" or "bf16"), in model.safetensors or, above
// shard_bytes, in shards of at most that size (a tensor is never split) with model.safetensors.index.json
// mapping each tensor to its shard. Everything goes into dir.tmp, renamed to dir when complete. Each file's
// metadata says "format": "pt", which transformers requires of a safetensors checkpoint. The files `copies`
// names (a tokenizer's) are copied in byte for byte, under their own names. Returns the shards.
inline int hf_save(const GPTConfig& c, const float* params, const std::string& dir, const std::string& dtype,
                   size_t shard_bytes = HF_SHARD_BYTES, const std::vector<std::string>& copies = {}) {
    std::vector<HfPlacement> placements = hf_placements(c);
    std::vector<std::vector<float>> values(placements.size());
    SafetensorsDtype type = dtype == "bf16" ? SafetensorsDtype::BF16 : SafetensorsDtype::F32;
    std::vector<std::vector<size_t>> shards(1);
    size_t in_shard = 0, total = 0;
    for (size_t i = 0; i < placements.size(); i++) {
        const HfPlacement& p = placements[i];
        values[i].resize(p.rows * p.cols);
        hf_move(c, const_cast<float*>(params), p, values[i].data(), true);  // reads params only
        size_t bytes = values[i].size() * dtype_bytes(type);
        if (in_shard > 0 && in_shard + bytes > shard_bytes) shards.emplace_back(), in_shard = 0;
        shards.back().push_back(i);
        in_shard += bytes, total += bytes;
    }
    std::string tmp = dir + ".tmp";
    remove_tree(tmp);  // what an interrupted conversion left
    make_dirs(tmp);
    auto write_text = [&](const std::string& name, const std::string& text) {
        File f(tmp + "/" + name, "wb");
        f.write(text.data(), text.size());
        f.close();
    };
    write_text("config.json", hf_config_json(c, dtype));
    for (const std::string& path : copies) {
        File from(path, "rb");
        size_t slash = path.rfind('/');
        write_text(slash == std::string::npos ? path : path.substr(slash + 1), from.read_all());
    }
    int n = (int)shards.size();
    std::string weight_map;
    for (int s = 0; s < n; s++) {
        std::string file = n == 1 ? "model.safetensors" : strfmt("model-%05d-of-%05d.safetensors", s + 1, n);
        SafetensorsWriter w;
        w.metadata("format", "pt");
        // what config.json has no field for, so that an llm.c Llama file comes back byte for byte
        if (c.arch == Arch::Llama3) {
            w.metadata("llmc_multiple_of", std::to_string(c.multiple_of));
            w.metadata("llmc_ffn_dim_multiplier", hf_float(c.ffn_dim_multiplier));
            w.metadata("llmc_version", strfmt("%d.%d", c.version_major, c.version_minor));
            if (c.moe()) w.metadata("llmc_expert_size", std::to_string(c.expert_size));
        }
        for (size_t i : shards[s]) {
            w.add(placements[i].name, type, placements[i].shape, values[i].data());
            weight_map += strfmt("%s\n    \"%s\": \"%s\"", weight_map.empty() ? "" : ",", placements[i].name.c_str(),
                                 file.c_str());
        }
        w.write(tmp + "/" + file);
    }
    if (n > 1)
        write_text("model.safetensors.index.json",
                   strfmt("{\n  \"metadata\": {\n    \"total_size\": %zu\n  },\n  \"weight_map\": {%s\n  }\n}\n", total,
                          weight_map.c_str()));
    if (rename(tmp.c_str(), dir.c_str()) != 0)
        fail("--to %s: cannot rename %s into place (%s)", dir.c_str(), tmp.c_str(), strerror(errno));
    return n;
}

// ----------------------------------------------------------------------------------------------------------
// import: -e DIR with a Hugging Face GPT-2 or Llama directory

inline std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) s += strfmt(i ? ", %lld" : "%lld", (long long)shape[i]);
    return s + "]";
}

// The tensors of an HF directory: model.safetensors, or the shards model.safetensors.index.json names
struct HfFiles {
    std::vector<SafetensorsFile> files;
    std::map<std::string, std::pair<size_t, const SafetensorsTensor*>> tensors;  // name -> (file, tensor)
};
inline HfFiles hf_open(const std::string& dir) {
    std::vector<std::string> names;
    if (file_exists(dir + "/model.safetensors.index.json")) {
        JsonDoc index = JsonDoc::from_file(dir + "/model.safetensors.index.json");
        const JsonValue& map = index.root.at("weight_map").as_object();
        for (const JsonValue& file : map.items)
            if (std::find(names.begin(), names.end(), file.as_string()) == names.end()) names.push_back(file.as_string());
    } else {
        names.push_back("model.safetensors");
    }
    HfFiles h;
    for (const std::string& name : names) h.files.push_back(read_safetensors(dir + "/" + name));
    for (size_t f = 0; f < h.files.size(); f++)
        for (const SafetensorsTensor& t : h.files[f].tensors) h.tensors[t.name] = {f, &t};
    return h;
}

// RoPE's scaling factor from config.json's rope_scaling (the Hub's) or rope_parameters (transformers 5's): 0 for
// none (null, or rope_type "default"), Llama 3's factor, or one line refusing any other scaling
inline float hf_rope_scaling(const JsonValue* scaling, const JsonValue* rope_parameters, const char* where) {
    const JsonValue* given = scaling && !scaling->is_null() ? scaling : rope_parameters;
    if (!given) return 0.0f;
    const JsonValue& s = given->as_object();
    const JsonValue* type = s.find("rope_type") ? s.find("rope_type") : s.find("type");
    if (type && type->as_string() == "default") return 0.0f;
    if (!type || type->as_string() != "llama3" || s.at("low_freq_factor").as_double() != 1 ||
        s.at("high_freq_factor").as_double() != 4 || s.at("original_max_position_embeddings").as_int64() != 8192)
        fail("%s: \"%s\": only Llama 3's (llama3, low 1, high 4, original 8192) is built", where,
             given == scaling ? "rope_scaling" : "rope_parameters");
    return (float)s.at("factor").as_double();
}

// the model config.json describes, or one line naming the field this model cannot represent
inline GPTConfig hf_read_config(const std::string& dir) {
    JsonDoc doc = JsonDoc::from_file(dir + "/config.json");
    const JsonValue& j = doc.root.as_object();
    const char* where = doc.where.c_str();
    auto integer = [&](const char* key) { return (int)j.at(key).as_int64(); };
    // a field that must hold `expected` when present: anything else is a model this trainer does not build
    auto require = [&](const char* key, auto expected, const char* why) {
        const JsonValue* v = j.find(key);
        if (!v || v->is_null()) return;
        bool same;
        if constexpr (std::is_same_v<decltype(expected), bool>) same = v->as_bool() == expected;
        else if constexpr (std::is_same_v<decltype(expected), const char*>) same = v->as_string() == expected;
        else same = v->as_double() == expected;
        if (!same) fail("%s: \"%s\": %s", where, key, why);
    };
    const std::vector<JsonValue>& archs = j.at("architectures").as_array();
    std::string arch = archs.empty() ? "" : archs[0].as_string();
    GPTConfig c;
    if (arch == "GPT2LMHeadModel") {
        c.channels = integer("n_embd"), c.num_heads = integer("n_head"), c.num_layers = integer("n_layer");
        c.max_seq_len = integer("n_positions"), c.vocab_size = integer("vocab_size");
        c.padded_vocab_size = pad_vocab(c.vocab_size);
        require("layer_norm_epsilon", 1e-5, "GPT-2's layernorm here has eps 1e-5");
        require("activation_function", "gelu_new", "GPT-2's MLP here is GELU's tanh form (gelu_new)");
        require("n_inner", 4.0 * c.channels, "GPT-2's MLP here has 4·n_embd hidden units");
        require("tie_word_embeddings", true, "GPT-2's classifier here is wte");
    } else if (arch == "LlamaForCausalLM" || arch == "Qwen3ForCausalLM" || arch == "MixtralForCausalLM" ||
               arch == "Qwen3MoeForCausalLM" || arch == "Qwen2MoeForCausalLM") {
        bool qwen = arch == "Qwen3ForCausalLM" || arch == "Qwen3MoeForCausalLM", mixtral = arch == "MixtralForCausalLM";
        bool qwen2 = arch == "Qwen2MoeForCausalLM";
        c.arch = qwen ? Arch::Qwen3 : Arch::Llama3;
        if (mixtral) c.num_experts = integer("num_local_experts"), c.top_k = integer("num_experts_per_tok");
        c.channels = integer("hidden_size"), c.num_heads = integer("num_attention_heads");
        c.num_layers = integer("num_hidden_layers"), c.max_seq_len = integer("max_position_embeddings");
        c.vocab_size = integer("vocab_size"), c.padded_vocab_size = pad_vocab(c.vocab_size);
        c.num_kv_heads = j.find("num_key_value_heads") ? integer("num_key_value_heads") : c.num_heads;
        c.norm_eps = (float)j.at("rms_norm_eps").as_double();
        // RoPE: the Hub's checkpoints give rope_theta and rope_scaling at the top level, transformers 5 writes
        // both inside rope_parameters (its rope_type "default" for none)
        const JsonValue* rope_parameters = j.find("rope_parameters");
        const JsonValue* rope = rope_parameters && !rope_parameters->is_null() ? rope_parameters : nullptr;
        const JsonValue* theta = j.find("rope_theta") ? j.find("rope_theta") : rope ? rope->as_object().find("rope_theta") : nullptr;
        if (!theta) fail("%s: no \"rope_theta\", at the top level or in \"rope_parameters\"", where);
        c.rope_theta = (float)theta->as_double();
        int H = integer("intermediate_size");
        // Qwen-MoE's experts (Qwen3MoeConfig's and Qwen2MoeConfig's fields)
        if (arch == "Qwen3MoeForCausalLM" || qwen2) {
            c.num_experts = integer("num_experts"), c.top_k = integer("num_experts_per_tok");
            int expert = integer("moe_intermediate_size");
            c.expert_size = expert == H ? 0 : expert;  // 0: the MLP's, as a descriptor without x<H> says
            const JsonValue* norm = j.find("norm_topk_prob");
            c.norm_topk = norm && !norm->is_null() && norm->as_bool();  // the configs' default: false
            // the dense layers: mlp_only_layers, a prefix here (DeepSeek's first_k_dense_replace), and those
            // off decoder_sparse_step (the configs' defaults: none, and 1)
            const JsonValue* dense = j.find("mlp_only_layers");
            if (dense && !dense->is_null()) {
                const std::vector<JsonValue>& layers = dense->as_array();
                for (size_t k = 0; k < layers.size(); k++)
                    if (layers[k].as_int64() != (int64_t)k)
                        fail("%s: \"mlp_only_layers\": dense layers are the first ones here (0, 1, ...), not "
                             "layer %lld at place %zu", where, (long long)layers[k].as_int64(), k);
                c.dense_layers = (int)layers.size();
            }
            const JsonValue* step = j.find("decoder_sparse_step");
            if (step && !step->is_null()) c.sparse_step = integer("decoder_sparse_step");
        }
        if (qwen2) {  // the gated shared expert, and q, k and v biases (Qwen2MoeAttention's, always on)
            c.shared_size = integer("shared_expert_intermediate_size"), c.shared_gate = true;
            c.attention_bias = true;
            require("qkv_bias", true, "Qwen2-MoE's q, k and v have biases");
            require("use_sliding_window", false, "sliding-window attention is not built");
            if (c.shared_size < 1) fail("%s: \"shared_expert_intermediate_size\": %d, not a shared expert", where, c.shared_size);
        }
        if (qwen) {  // the head size and the MLP's as given
            const JsonValue* head_dim = j.find("head_dim");
            c.head_dim = head_dim && !head_dim->is_null() ? (int)head_dim->as_int64() : 128;  // Qwen3Config's default
            c.intermediate_size = H;
            require("hidden_act", "silu", "Qwen3's MLP here is SwiGLU");
            require("attention_bias", false, "this Qwen3 has no biases");
            require("use_sliding_window", false, "sliding-window attention is not built");
            const JsonValue* tie = j.find("tie_word_embeddings");
            c.tied_embeddings = tie && !tie->is_null() && tie->as_bool();
            if (hf_rope_scaling(j.find("rope_scaling"), rope, where) > 0)
                fail("%s: Qwen3 here has unscaled RoPE (rope_scaling null, or rope_type default)", where);
            validate_config(c, dir);
            return c;
        }
        // the MLP's size: llm.c's own multiple_of and ffn_dim_multiplier where our export kept them (so that an
        // llm.c file comes back byte for byte), else H exactly as the descriptors make it
        // (Mixtral's intermediate_size is its experts', the MLP tensors' width: mlp_hidden)
        set_llama_hidden(c, H);
        HfFiles files = hf_open(dir);
        const std::map<std::string, std::string>& meta = files.files[0].metadata;
        if (meta.count("llmc_multiple_of") && meta.count("llmc_ffn_dim_multiplier") && meta.count("llmc_version")) {
            c.multiple_of = atoi(meta.at("llmc_multiple_of").c_str());
            c.ffn_dim_multiplier = strtof(meta.at("llmc_ffn_dim_multiplier").c_str(), nullptr);
            sscanf(meta.at("llmc_version").c_str(), "%d.%d", &c.version_major, &c.version_minor);
            if (meta.count("llmc_expert_size")) c.expert_size = atoi(meta.at("llmc_expert_size").c_str());
            if (c.multiple_of < 1 || (mixtral ? c.mlp_hidden() : c.hidden()) != H)
                fail("%s: \"intermediate_size\" %d disagrees with the safetensors metadata's llmc_multiple_of, "
                     "llmc_ffn_dim_multiplier and llmc_expert_size", where, H);
        }
        if (mixtral) require("sliding_window", 0.0, "sliding-window attention is not built (null: none)");
        require("hidden_act", "silu", "Llama's MLP here is SwiGLU");
        if (!qwen2) require("attention_bias", false, "this Llama has no biases");
        require("mlp_bias", false, "this Llama has no biases");
        const JsonValue* tie = j.find("tie_word_embeddings");
        c.tied_embeddings = tie && !tie->is_null() && tie->as_bool();
        require("head_dim", (double)c.channels / c.num_heads, "the head size must be hidden_size / num_attention_heads");
        c.rope_scaling = hf_rope_scaling(j.find("rope_scaling"), rope, where);
    } else {
        fail("%s: \"architectures\": %s is none of GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, "
             "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM", where, arch.empty() ? "none" : arch.c_str());
    }
    validate_config(c, dir);
    return c;
}

// Reads the whole model of an HF directory into params (its flat buffer, zero where HF has nothing: the padded
// vocab rows); a missing tensor, or one of another shape, is refused naming it
inline void hf_load(const GPTConfig& c, float* params, const std::string& dir) {
    HfFiles h = hf_open(dir);
    memset(params, 0, num_parameters(c) * sizeof(float));
    std::vector<float> values;
    for (const HfPlacement& p : hf_placements(c)) {
        auto it = h.tensors.find(p.name);
        if (it == h.tensors.end()) fail("%s: tensor \"%s\" is missing", dir.c_str(), p.name.c_str());
        const SafetensorsTensor& t = *it->second.second;
        if (t.shape != p.shape)
            fail("%s: tensor \"%s\" has shape %s, the config says %s", dir.c_str(), p.name.c_str(),
                 shape_string(t.shape).c_str(), shape_string(p.shape).c_str());
        values.resize(t.numel());
        h.files[it->second.first].read_floats(t, values.data());
        hf_move(c, params, p, values.data(), false);
    }
    size_t bad = first_non_finite(params, num_parameters(c));
    if (bad < num_parameters(c))
        fail("%s: %g in %s (a model must be finite)", dir.c_str(), params[bad], describe_param(c, bad).c_str());
}

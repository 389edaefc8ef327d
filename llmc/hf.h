// Hugging Face checkpoints at the edge: `--convert ... --format hf` writes what transformers' from_pretrained
// reads, a directory of config.json and model.safetensors (sharded above HF_SHARD_BYTES, with
// model.safetensors.index.json, as save_pretrained shards), from a whole model in llm5d's flat layout.
//
// The tensors take HF's names, shapes and layouts (GPT2LMHeadModel, LlamaForCausalLM):
//   GPT-2   transformer.wte (the padded vocab rows dropped; lm_head is tied to it, so it is not written),
//           transformer.wpe, transformer.h.{l}.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj,
//           transformer.ln_f. HF's Conv1D stores a weight [in, out], the transpose of ours [out, in].
//   Llama   model.embed_tokens, model.layers.{l}.input_layernorm, self_attn.{q,k,v,o}_proj,
//           post_attention_layernorm, mlp.{gate,up,down}_proj, model.norm, lm_head. Our fcw holds c_fc (HF's
//           up_proj) then c_fc2 (gate_proj, the one SwiGLU passes through silu). HF's Llama turns RoPE's pairs
//           (i, i + hd/2) (rotate_half), ours and Meta's (2i, 2i + 1): q_proj's and k_proj's rows are reordered
//           within each head so that HF's pair i is our pair i, which leaves every attention score unchanged.
#pragma once

#include <sys/stat.h>

#include <string>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/gpt.cuh"
#include "llmc/safetensors.h"

constexpr size_t HF_SHARD_BYTES = 5000000000ull;  // save_pretrained's default max_shard_size, "5GB"

// one tensor as HF names and lays it out
struct HfTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
};

// rows [first, first + n) of a row-major matrix with `cols` columns, optionally transposed ([cols, n])
inline std::vector<float> hf_rows(const float* m, size_t first, size_t n, size_t cols, bool transpose) {
    std::vector<float> out(n * cols);
    for (size_t r = 0; r < n; r++)
        for (size_t c = 0; c < cols; c++) out[transpose ? c * n + r : r * cols + c] = m[(first + r) * cols + c];
    return out;
}

// heads of hd rows each, their rows reordered from RoPE's interleaved pairs to HF's halves: HF's row i of a head
// is our row 2i, its row hd/2 + i our row 2i + 1
inline std::vector<float> hf_rotate_half_rows(const std::vector<float>& w, int heads, int hd, size_t cols) {
    std::vector<float> out(w.size());
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < hd; i++) {
            int ours = i < hd / 2 ? 2 * i : 2 * (i - hd / 2) + 1;
            std::copy_n(&w[((size_t)h * hd + ours) * cols], cols, &out[((size_t)h * hd + i) * cols]);
        }
    return out;
}

// the whole model's tensors (params: the flat buffer of the whole model) as HF has them, in HF's order
inline std::vector<HfTensor> hf_tensors(const GPTConfig& c, const float* params) {
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    ParamViews<const float> p = param_views<const float>(params, sizes);
    int64_t L = c.num_layers, C = c.channels, V = c.vocab_size, H = c.hidden();
    std::vector<HfTensor> out;
    auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<float> values) {
        out.push_back({std::move(name), std::move(shape), std::move(values)});
    };
    // layer l's block of a per-layer tensor: rows [first, first + n) of `cols`, transposed or not
    auto block = [&](int t, int64_t l, size_t first, size_t n, size_t cols, bool transpose) {
        return hf_rows(p[t] + l * (sizes[t] / L), first, n, cols, transpose);
    };
    if (!c.llama()) {
        add("transformer.wte.weight", {V, C}, hf_rows(p[WTE], 0, V, C, false));
        add("transformer.wpe.weight", {c.max_seq_len, C}, hf_rows(p[WPE], 0, c.max_seq_len, C, false));
        for (int64_t l = 0; l < L; l++) {
            std::string h = strfmt("transformer.h.%ld.", (long)l);
            add(h + "ln_1.weight", {C}, block(LN1W, l, 0, C, 1, false));
            add(h + "ln_1.bias", {C}, block(LN1B, l, 0, C, 1, false));
            add(h + "attn.c_attn.weight", {C, 3 * C}, block(QKVW, l, 0, 3 * C, C, true));
            add(h + "attn.c_attn.bias", {3 * C}, block(QKVB, l, 0, 3 * C, 1, false));
            add(h + "attn.c_proj.weight", {C, C}, block(ATTPROJW, l, 0, C, C, true));
            add(h + "attn.c_proj.bias", {C}, block(ATTPROJB, l, 0, C, 1, false));
            add(h + "ln_2.weight", {C}, block(LN2W, l, 0, C, 1, false));
            add(h + "ln_2.bias", {C}, block(LN2B, l, 0, C, 1, false));
            add(h + "mlp.c_fc.weight", {C, H}, block(FCW, l, 0, H, C, true));
            add(h + "mlp.c_fc.bias", {H}, block(FCB, l, 0, H, 1, false));
            add(h + "mlp.c_proj.weight", {H, C}, block(FCPROJW, l, 0, C, H, true));
            add(h + "mlp.c_proj.bias", {C}, block(FCPROJB, l, 0, C, 1, false));
        }
        add("transformer.ln_f.weight", {C}, hf_rows(p[LNFW], 0, C, 1, false));
        add("transformer.ln_f.bias", {C}, hf_rows(p[LNFB], 0, C, 1, false));
        return out;
    }
    int NH = c.num_heads, KV = c.kv_heads(), hd = c.head_size();
    int64_t Q = (int64_t)NH * hd, K = (int64_t)KV * hd;
    add("model.embed_tokens.weight", {V, C}, hf_rows(p[WTE], 0, V, C, false));
    for (int64_t l = 0; l < L; l++) {
        std::string h = strfmt("model.layers.%ld.", (long)l);
        add(h + "input_layernorm.weight", {C}, block(LN1W, l, 0, C, 1, false));
        add(h + "self_attn.q_proj.weight", {Q, C}, hf_rotate_half_rows(block(QKVW, l, 0, Q, C, false), NH, hd, C));
        add(h + "self_attn.k_proj.weight", {K, C}, hf_rotate_half_rows(block(QKVW, l, Q, K, C, false), KV, hd, C));
        add(h + "self_attn.v_proj.weight", {K, C}, block(QKVW, l, Q + K, K, C, false));
        add(h + "self_attn.o_proj.weight", {C, Q}, block(ATTPROJW, l, 0, C, Q, false));
        add(h + "post_attention_layernorm.weight", {C}, block(LN2W, l, 0, C, 1, false));
        add(h + "mlp.gate_proj.weight", {H, C}, block(FCW, l, H, H, C, false));
        add(h + "mlp.up_proj.weight", {H, C}, block(FCW, l, 0, H, C, false));
        add(h + "mlp.down_proj.weight", {C, H}, block(FCPROJW, l, 0, C, H, false));
    }
    add("model.norm.weight", {C}, hf_rows(p[LNFW], 0, C, 1, false));
    add("lm_head.weight", {V, C}, hf_rows(p[WPE], 0, V, C, false));
    return out;
}

// the shortest decimal that reads back as the same float (1e-05, not 9.99999975e-06)
inline std::string hf_float(float v) {
    for (int digits = 6;; digits++) {
        std::string s = strfmt("%.*g", digits, v);
        if (strtof(s.c_str(), nullptr) == v || digits == 9) return s;
    }
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
    std::string scaling = c.scaled_rope ? "{\n    \"rope_type\": \"llama3\",\n    \"factor\": 8.0,\n"
                                          "    \"low_freq_factor\": 1.0,\n    \"high_freq_factor\": 4.0,\n"
                                          "    \"original_max_position_embeddings\": 8192\n  }"
                                        : "null";
    return strfmt(
        "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n  \"vocab_size\": %d,\n"
        "  \"max_position_embeddings\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n"
        "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n"
        "  \"head_dim\": %d,\n  \"hidden_act\": \"silu\",\n  \"rms_norm_eps\": %s,\n  \"rope_theta\": %s,\n"
        "  \"rope_scaling\": %s,\n  \"attention_bias\": false,\n  \"mlp_bias\": false,\n"
        "  \"tie_word_embeddings\": false,\n  \"initializer_range\": 0.02,\n  \"torch_dtype\": \"%s\"\n}\n",
        c.vocab_size, c.max_seq_len, c.channels, c.hidden(), c.num_layers, c.num_heads, c.kv_heads(), c.head_size(),
        hf_float(c.norm_eps).c_str(), hf_float(c.rope_theta).c_str(), scaling.c_str(), torch_dtype.c_str());
}

// Writes the whole model (params: its flat buffer) as the Hugging Face directory `dir`, which must not exist:
// config.json and the tensors in float32 or bfloat16 (dtype "fp32" or "bf16"), in model.safetensors or, above
// shard_bytes, in shards of at most that size (a tensor is never split) with model.safetensors.index.json
// mapping each tensor to its shard. Everything goes into dir.tmp, renamed to dir when complete. Each file's
// metadata says "format": "pt", which transformers requires of a safetensors checkpoint. Returns the shards.
inline int hf_save(const GPTConfig& c, const float* params, const std::string& dir, const std::string& dtype,
                   size_t shard_bytes = HF_SHARD_BYTES) {
    std::vector<HfTensor> tensors = hf_tensors(c, params);
    SafetensorsDtype type = dtype == "bf16" ? SafetensorsDtype::BF16 : SafetensorsDtype::F32;
    std::vector<std::vector<const HfTensor*>> shards(1);
    size_t in_shard = 0, total = 0;
    for (const HfTensor& t : tensors) {
        size_t bytes = t.values.size() * dtype_bytes(type);
        if (in_shard > 0 && in_shard + bytes > shard_bytes) shards.emplace_back(), in_shard = 0;
        shards.back().push_back(&t);
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
    int n = (int)shards.size();
    std::string weight_map;
    for (int i = 0; i < n; i++) {
        std::string file = n == 1 ? "model.safetensors" : strfmt("model-%05d-of-%05d.safetensors", i + 1, n);
        SafetensorsWriter w;
        w.metadata("format", "pt");
        for (const HfTensor* t : shards[i]) {
            w.add(t->name, type, t->shape, t->values.data());
            weight_map += strfmt("%s\n    \"%s\": \"%s\"", weight_map.empty() ? "" : ",", t->name.c_str(), file.c_str());
        }
        w.write(tmp + "/" + file);
    }
    if (n > 1) {
        std::string index = strfmt("{\n  \"metadata\": {\n    \"total_size\": %zu\n  },\n  \"weight_map\": {%s\n  }\n}\n",
                                   total, weight_map.c_str());
        write_text("model.safetensors.index.json", index);
    }
    if (rename(tmp.c_str(), dir.c_str()) != 0)
        fail("--to %s: cannot rename %s into place (%s)", dir.c_str(), tmp.c_str(), strerror(errno));
    return n;
}

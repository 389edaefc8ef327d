// llm.c's model files, the format of -e FILE, of a checkpoint's model.bin and of --convert's llm.c files: fp32
// (version 3) or bf16 (version 5). GPT-2's: a header of 256 int32 (magic 20240326,
// version, maxT, V, L, NH, C, Vp, and llm5d's experts E and top-K, 0 in a dense file, then [10] each expert's
// hidden units where they are not the MLP's and [11] 1 when the gates are not renormalized, 0 otherwise), then
// the parameters in table order. Llama 3's (llm.c's llama3 branch): 256 int32 (magic 20240803, version, maxT, V, L, NH, KV, C,
// multiple_of, use_scaled_rope, major, minor; then llm5d's [12] and [13]: experts E and top-K, 0 in a dense
// file, [14]: 1 if the classifier is tied to wte, and [18], [19] as GPT-2's [10], [11]) and 256 float32 (ffn_dim_multiplier, norm_eps, rope_theta;
// then llm5d's [3]: RoPE's scaling factor where it is not llm.c's 8), then the tensors in GPT-2's slots: lm_head
// in wpe's (a tied model's wte again, so that llm.c reads it), and every bias slot present and zero (the table's
// file_rows). Each file keeps its format's vocab rows: GPT-2's the padded Vp its header gives, Llama 3's the V
// of the vocab (its header has no Vp), so reading a Llama file fills the padding rows memory adds with zeros,
// and writing one drops them. Qwen3's is llm5d's own, Llama 3's layout with int [15] 1, [16] the head size and
// [17] the MLP's hidden units ([8], [10] and [11] 0), and the QK-norm weights (L×hd for q, then for k) after
// lnfb's slot; llm.c reads none of it.
//
// Here: the header, read and written; where each tensor lies in the file and in the flat buffer (FileLayout);
// reading a file's runs into a rank's parameters, refusing a NaN or Inf and a value in a slot the model lacks;
// writing one in fp32 or bf16. Host code only: the values pass through fp32 host memory on their way to the model
// (gpt_set_params) and from it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/model_config.h"
#include "llmc/model_table.h"
#include "llmc/utils.h"

constexpr int MODEL_MAGIC = 20240326;
constexpr int MODEL_VERSION_FP32 = 3;
constexpr int MODEL_VERSION_BF16 = 5;

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
        size_t layers = table[t].holder == Holder::Layer ? held_layers(c, table[t].layers, whole_part(c), c.num_layers) : 1;
        size_t blocks = layers * (table[t].expert ? c.num_experts : 1);
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

// the nine header slots that describe the experts beyond E and K: their hidden units (0: the MLP's), 1 when the
// gates are not renormalized, the first dense layers, the step of the sparse layers (0: 1, every layer), the
// shared expert's hidden units (0: none), 1 when a gate scales it, 1 when the router's scores are sigmoids, the
// gates' scale as a float's bits (0: 1), and 1 when a bias chooses the experts
inline void read_expert_slots(GPTConfig& c, const int* slot, const std::string& path) {
    if (slot[1] != 0 && slot[1] != 1)
        fail("%s: header slot for the experts' gates is %d, not 0 (renormalized) or 1 (not)", path.c_str(), slot[1]);
    if (slot[5] != 0 && slot[5] != 1)
        fail("%s: header slot for the shared expert's gate is %d, not 0 (none) or 1", path.c_str(), slot[5]);
    c.expert_size = slot[0], c.norm_topk = slot[1] == 0;
    c.dense_layers = slot[2], c.sparse_step = slot[3] == 0 ? 1 : slot[3];
    c.shared_size = slot[4], c.shared_gate = slot[5] == 1;
    if (slot[6] != 0 && slot[6] != 1)
        fail("%s: header slot for the router's scores is %d, not 0 (softmax) or 1 (sigmoid)", path.c_str(), slot[6]);
    c.sigmoid_scores = slot[6] == 1;
    if (slot[7] != 0) memcpy(&c.routed_scale, &slot[7], sizeof(float));
    if (slot[8] != 0 && slot[8] != 1)
        fail("%s: header slot for the router's selection bias is %d, not 0 or 1", path.c_str(), slot[8]);
    c.router_bias = slot[8] == 1;
}
inline void write_expert_slots(const GPTConfig& c, int* slot) {
    slot[0] = c.expert_size, slot[1] = !c.norm_topk;
    slot[2] = c.dense_layers, slot[3] = c.sparse_step == 1 ? 0 : c.sparse_step;
    slot[4] = c.shared_size, slot[5] = c.shared_gate, slot[6] = c.sigmoid_scores;
    if (c.routed_scale != 1) memcpy(&slot[7], &c.routed_scale, sizeof(float));
    slot[8] = c.router_bias;
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
        read_expert_slots(c, h + 18, path);
        c.ffn_dim_multiplier = hf[0], c.norm_eps = hf[1], c.rope_theta = hf[2];
        if (h[9] == 0 && hf[3] != 0) fail("%s: header gives RoPE a scaling factor %g but use_scaled_rope 0", path.c_str(), hf[3]);
        c.rope_scaling = h[9] == 0 ? 0.0f : hf[3] != 0 ? hf[3] : 8.0f;
        if (h[14] != 0 && h[14] != 1) fail("%s: header slot 14 (tied embeddings) is %d, not 0 or 1", path.c_str(), h[14]);
        c.tied_embeddings = h[14] == 1;
        // header[28]: 1 when q, k and v have biases (Qwen2's), held in the slot llm.c's files keep for them
        if (h[28] != 0 && h[28] != 1) fail("%s: header slot 28 (attention biases) is %d, not 0 or 1", path.c_str(), h[28]);
        c.attention_bias = h[28] == 1;
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
        read_expert_slots(c, h + 10, path);
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
        write_expert_slots(c, h + 18);
        h[28] = c.attention_bias;
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
        write_expert_slots(c, h + 10);
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

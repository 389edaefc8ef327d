// The CPU model against PyTorch: test/reference/make_reference.py builds a small GPT-2 of an odd shape, and
// one whose MLPs are mixtures of experts (--moe), and records their logits, loss, every gradient and the
// losses of 10 AdamW steps; test/reference/make_llama_reference.py does the same for small Llama 3 models in
// float64 (grouped-query, multi-query and multi-head attention; RoPE scaled and not), whose 10 steps each
// accumulate two micro-batches, make_qwen3_reference.py a small Qwen3, from its file and its Hugging Face
// directories, and make_moe_reference.py small Qwen3-MoE and Mixtral models from their Hugging Face directories. `make test` writes them under build/ before running this.
#include "llmc/gpt.cuh"
#include "llmc/hf.h"
#include "test_helpers.h"

namespace test_model_reference {

struct ReferenceState {
    int B, T, V, Vp, steps, micro;  // micro: micro-batches per training step (B×T tokens each)
    float lr, weight_decay, grad_clip;
    float aux_weight, aux;  // with experts: the load-balancing loss's weight, and its value on the batch
    float bias_rate;        // with a router's selection bias: its step per update
    bool aux_batch;         // the load-balancing loss over the batch (--moe-aux-scope batch), not per sequence
    std::vector<int> inputs, targets;
    std::vector<float> logits, grads, losses;
    float loss;
};

float float_from_bits(int bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

ReferenceState read_state(const std::string& path, size_t num_parameters) {
    File f(path, "rb");
    int h[256];
    f.read(h, sizeof(h));
    REQUIRE(h[0] == 20240327);
    REQUIRE(h[1] == 3);
    ReferenceState s;
    s.B = h[2], s.T = h[3], s.V = h[4], s.Vp = h[5], s.steps = h[6];
    s.lr = float_from_bits(h[7]), s.weight_decay = float_from_bits(h[8]), s.grad_clip = float_from_bits(h[9]);
    s.aux_weight = float_from_bits(h[10]), s.aux = float_from_bits(h[11]);
    s.micro = std::max(h[12], 1);
    s.bias_rate = float_from_bits(h[13]);
    s.aux_batch = h[14] == 1;
    size_t BT = (size_t)s.B * s.T;
    s.inputs.resize(s.micro * BT);
    s.targets.resize(s.micro * BT);
    s.logits.resize(BT * s.V);
    s.grads.resize(num_parameters);
    s.losses.resize(s.steps);
    f.read(s.inputs.data(), s.inputs.size() * 4);
    f.read(s.targets.data(), s.targets.size() * 4);
    f.read(s.logits.data(), s.logits.size() * 4);
    f.read(&s.loss, 4);
    f.read(s.grads.data(), num_parameters * 4);
    f.read(s.losses.data(), s.steps * 4);
    return s;
}

// the reference in `dir` against the model read from `model` (default: its llm.c file; or a Hugging Face
// directory), every gradient within grad_tol of PyTorch's at its tensor's scale
void check_against_pytorch(const std::string& dir, std::string model_path = "", double grad_tol = 1e-4) {
    if (model_path.empty()) model_path = dir + "/model.bin";
    INFO("run `make test` (or make build/reference/model.bin) to generate " << model_path);
    REQUIRE((file_exists(model_path) || is_hf_dir(model_path)));
    int version;
    bool hf = is_hf_dir(model_path);
    GPTConfig config = hf ? hf_read_config(model_path) : read_model_header(model_path, &version);
    GPT m;
    ReferenceState ref;
    {
        // peek at the batch shape before allocating the model for it
        File f(dir + "/state.bin", "rb");
        int h[256];
        f.read(h, sizeof(h));
        gpt_allocate(m, config, h[2], h[3]);
    }
    if (hf) hf_load(m.config, m.params, model_path);
    else gpt_load_params(m.config, m.params, model_path);
    ref = read_state(dir + "/state.bin", m.num_parameters);
    m.moe.settings = ExpertSettings{ref.aux_weight, ref.bias_rate, ref.aux_batch ? AuxScope::Batch : AuxScope::Sequence};
    REQUIRE(ref.V == config.vocab_size);
    REQUIRE(ref.Vp == config.padded_vocab_size);
    long BT = (long)ref.B * ref.T;

    float loss = gpt_forward(m, ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    // relative to the largest logit, so that logits near zero are judged at the scale of the row they sit in
    float logit_scale = 0.0f;
    for (float x : ref.logits) logit_scale = std::max(logit_scale, fabsf(x));
    double logit_err = 0.0;
    for (long n = 0; n < BT; n++)
        logit_err = std::max(logit_err, max_rel_error(m.slots[0].acts.logits + n * ref.Vp, &ref.logits[n * ref.V], ref.V,
                                                      logit_scale));
    CHECK(logit_err < 1e-5);
    CHECK(fabs(loss - ref.loss) / ref.loss < 1e-5);
    if (config.moe()) {  // the aux loss: summed over the layers and sequences, the mean over the sequences
        INFO("aux loss: ours " << m.moe.aux_sum / ref.B << ", PyTorch " << ref.aux);
        CHECK(ref.aux > 0.0f);
        CHECK(fabs(m.moe.aux_sum / ref.B - ref.aux) / ref.aux < 1e-5);
    }

    gpt_zero_grad(m);
    gpt_backward(m, 1.0f / BT);
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        INFO("parameter tensor " << i);
        // relative to each tensor's largest gradient, so near-zero entries are judged at that tensor's scale
        float scale = 0.0f;
        for (size_t j = 0; j < m.param_sizes[i]; j++) scale = std::max(scale, fabsf(ref.grads[offset + j]));
        CHECK(max_rel_error(m.grads + offset, &ref.grads[offset], m.param_sizes[i], scale) < grad_tol);
        offset += m.param_sizes[i];
    }

    for (int step = 0; step < ref.steps; step++) {
        gpt_zero_grad(m);
        m.moe.reset_statistics();  // the step's loads, which move a router's selection bias after the update
        float l = 0.0f;
        for (int k = 0; k < ref.micro; k++) {  // the step's mean loss, over micro-batches of B×T tokens
            float dloss = 1.0f / (BT * ref.micro);  // training's fused loss and logits' gradient
            l += gpt_forward(m, &ref.inputs[k * BT], &ref.targets[k * BT], ref.B, ref.T, dloss) / ref.micro;
            gpt_backward(m, dloss);
        }
        INFO("step " << step << ": ours " << l << ", PyTorch " << ref.losses[step]);
        CHECK(fabs(l - ref.losses[step]) / ref.losses[step] < 1e-5);
        float scale = clip_scale(gpt_grad_norm(m), ref.grad_clip);
        gpt_update(m, ref.lr, ref.weight_decay, scale);
        if (config.router_bias)
            gpt_balance_experts(m, m.moe.load, [&](size_t at, const float* v, size_t n) { gpt_set_values(m, at, v, n); });
    }
}

TEST_CASE("CPU GPT-2 matches PyTorch: logits, loss, gradients and 10 AdamW steps", "[model][reference]") {
    check_against_pytorch("build/reference");
}

TEST_CASE("CPU GPT-2 with experts (E=4, K=2), with DeepSeek's always-on shared expert beside them, and with "
          "DeepSeek-V3's routing too (sigmoid scores, gates scaled by 2.5, a selection bias moved by each step's loads), "
          "matches PyTorch: logits, loss, aux loss, gradients and 10 AdamW steps",
          "[model][reference][moe]") {
    for (const char* dir : {"build/reference_moe", "build/reference_moe_shared", "build/reference_moe_deepseek"}) {
        INFO(dir);
        check_against_pytorch(dir);
    }
}

TEST_CASE("CPU Llama 3 from an llm.c Llama 3 file matches a float64 PyTorch Llama: logits, loss, gradients and 10 "
          "AdamW steps of 2 micro-batches, with grouped-query (KV=2, scaled RoPE), multi-query (KV=1, unscaled) and "
          "multi-head (KV=NH, scaled) attention, tied to wte with Llama 3.2's scaling (KV=3, factor 32), and with "
          "Mixtral's experts (4 SwiGLU experts, top 2, the load-balancing loss)",
          "[model][reference][llama]") {
    for (const char* dir : {"build/reference_llama_gqa", "build/reference_llama_mqa", "build/reference_llama_mha",
                            "build/reference_llama_tied", "build/reference_llama_moe"}) {
        INFO(dir);
        check_against_pytorch(dir);
    }
}

TEST_CASE("CPU Qwen3 matches a float64 PyTorch Qwen3 written from Hugging Face's modeling_qwen3 (QK-norm before "
          "rotate-half RoPE, heads of 16 in 48 channels): logits, loss, every gradient within 1e-5 and 10 AdamW steps, "
          "read from llm5d's Qwen3 file and from the Hugging Face directory in transformers 4's and 5's config forms, "
          "grouped-query (KV=2) and multi-query tied (KV=1)",
          "[model][reference][qwen3]") {
    for (const char* dir : {"build/reference_qwen3", "build/reference_qwen3_tied"}) {
        for (const char* from : {"model.bin", "hf", "hf5"}) {
            INFO(dir << " from " << from);
            check_against_pytorch(dir, std::string(dir) + "/" + from, 1e-5);
        }
    }
}

TEST_CASE("CPU Qwen3-MoE, Qwen2-MoE and Mixtral read from Hugging Face directories match float64 PyTorch models "
          "written from HF's modeling_qwen3_moe, modeling_qwen2_moe and modeling_mixtral (the softmax over all "
          "experts, its top 2 of 4 renormalized or not, experts of their own width; dense and sparse layers mixed by "
          "mlp_only_layers and decoder_sparse_step; Qwen2-MoE's q, k and v biases and gated shared expert; the "
          "load-balancing loss over the batch, its f counted over the step's micro-batches so far): logits, loss, aux "
          "loss, every gradient and 10 AdamW steps",
          "[model][reference][moe][hf]") {
    for (const char* dir : {"build/reference_qwen3_moe", "build/reference_qwen3_moe_raw", "build/reference_mixtral",
                            "build/reference_qwen3_moe_mixed", "build/reference_qwen2_moe",
                            "build/reference_qwen3_moe_batch"}) {
        INFO(dir);
        check_against_pytorch(dir, std::string(dir) + "/hf", 1e-5);
    }
}

}  // namespace test_model_reference

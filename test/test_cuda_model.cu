// The GPU model against the CPU model (the verification ladder's rung 5): the same weights and batch through
// GPTCuda (bf16 storage, fp32 master weights) and GPT (fp32): the loss and logits at step 0, every parameter
// tensor's gradient, and 20 AdamW steps' losses, each within a bf16 tolerance stated beside it, on the mma.sync
// attention and, on Hopper, the wgmma one (the default there; the tests that name neither run the default). GPT-2's
// backward runs its bias gradients and GELU's backward in cuBLASLt's epilogues here (a test without a GPU checks
// that its shapes take them). Without a GPU these print "skipped: no GPU". Also the GPU's memory plan against a
// count made by hand, which needs no GPU.
#include <catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include "llmc/gpt.cuh"
#include "llmc/plan.h"
#include "test/test_helpers.h"

namespace test_cuda_model {

// ‖a − b‖ / ‖b‖ over n values: the error of a whole tensor, which is what bf16 rounding bounds (single elements
// near zero can be off by far more, relatively)
double relative_l2(const float* a, const float* b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) num += (double)(a[i] - b[i]) * (a[i] - b[i]), den += (double)b[i] * b[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

const char* DENSE_MODEL = "d2c128h2t64v1000";  // head size 64, as the GPU kernels need
const char* MOE_MODEL = "d2c128h2t64v1000e4k2";  // ... with 4 experts in each MLP, top-2
// a Llama of the same size: two query heads sharing one key/value head, 344 hidden units (a multiple of 8, as
// SwiGLU's kernels need); and the same Llama with GPT-2's 50257 tokens, the descriptors' default, which memory
// pads to 50304 (a Llama's vocab was once unpadded, and its first GPU step refused 50257 columns)
const char* LLAMA_MODEL = "l2c128h2g1f344t64v1000";
const char* LLAMA_GPT2_VOCAB = "l2c128h2g1f344t64";
// a Qwen3 whose two query heads of 64 channels (one key/value head) make attention 128 wide in a model of 96
// channels, with QK-norm
const char* QWEN3_MODEL = "q2c96h2g1d64f344t64v1000";

struct Pair {
    GPTConfig config;
    int B = 4, T = 64;
    GPT cpu;
    GPTCuda gpu;
    std::vector<int> inputs, targets;  // MICRO_STEPS batches of B×T, back to back
    static constexpr int MICRO_STEPS = 2;

    // attention: the GPU's kernels (none: the GPU's default)
    Pair(uint64_t seed, const char* model, std::optional<AttentionKernels> attention = std::nullopt)
        : config(parse_model_descriptor(model)) {
        ModelLayout layout;
        layout.attention_kernels = attention;
        gpt_allocate(cpu, config, B, T);
        gpt_allocate(gpu, config, B, T, layout);
        gpt_init_random(config, cpu.params, seed);
        // the GPU's bf16 weights are the fp32 ones rounded; the CPU runs on those rounded values too, so the
        // comparison measures the arithmetic, not the rounding of the initialization
        gpt_set_params(gpu, cpu.params);
        download_as_float(cpu.params, gpu.params, cpu.num_parameters);
        gpt_set_params(gpu, cpu.params);
        cpu.seed = gpu.seed = seed;
        Rng rng(seed + 1);
        for (int i = 0; i < MICRO_STEPS * B * T; i++) inputs.push_back((int)rng.below(config.vocab_size));
        for (int i = 0; i < MICRO_STEPS * B * T; i++) targets.push_back((int)rng.below(config.vocab_size));
    }
};

// The loss, logits and every gradient at step 0, the GPU on the attention kernels given (none: its default);
// grad_tol bounds each tensor's relative L2 error, expert_tol (when given) that of the experts' tensors and the
// router's
void check_step_zero(const char* model, std::optional<AttentionKernels> attention, double grad_tol,
                     double expert_tol = 0) {
    Pair p(42, model, attention);
    float cpu_loss = gpt_forward(p.cpu, p.inputs.data(), p.targets.data(), p.B, p.T);
    float gpu_loss = gpt_forward(p.gpu, p.inputs.data(), p.targets.data(), p.B, p.T);
    INFO("loss cpu " << cpu_loss << " gpu " << gpu_loss);
    CHECK(std::fabs(gpu_loss - cpu_loss) / cpu_loss < 1e-2);  // bf16 activations through 2 layers: ~0.3% seen

    size_t n_logits = (size_t)p.B * p.T * p.config.padded_vocab_size;
    std::vector<float> gpu_logits(n_logits);
    download_as_float(gpu_logits.data(), p.gpu.slots[0].acts.logits, n_logits);
    CHECK(relative_l2(gpu_logits.data(), p.cpu.slots[0].acts.logits, n_logits) < 2e-2);

    float dloss = 1.0f / (p.B * p.T);
    gpt_zero_grad(p.cpu);
    gpt_zero_grad(p.gpu);
    gpt_backward(p.cpu, dloss);
    gpt_backward(p.gpu, dloss);
    std::vector<float> gpu_grads(p.cpu.num_parameters);
    download_as_float(gpu_grads.data(), p.gpu.grads, p.cpu.num_parameters);
    size_t offset = 0, padding_nonzero = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t n = p.cpu.param_sizes[t];
        double err = relative_l2(gpu_grads.data() + offset, p.cpu.grads + offset, n);
        bool routed = p.cpu.table[t].expert || strcmp(p.cpu.table[t].name, "routerw") == 0;
        double tol = routed && expert_tol > 0 ? expert_tol : grad_tol;
        INFO("tensor " << t << " (" << p.cpu.table[t].name << "): relative L2 error " << err << ", tolerance " << tol);
        CHECK(err < tol);
        // the vocab's padding rows (past V) get exactly zero gradient: the cross-entropy zeroes their logits' columns
        if (p.cpu.table[t].split == TPSplit::Vocab)
            for (size_t i = (size_t)p.config.vocab_size * p.config.channels; i < n; i++)
                padding_nonzero += gpu_grads[offset + i] != 0.0f;
        offset += n;
    }
    CHECK(padding_nonzero == 0);
    CHECK(std::fabs(sqrt(sum_of_squares(gpu_grads.data(), (long)gpu_grads.size())) - gpt_grad_norm(p.gpu)) <
          1e-3 * gpt_grad_norm(p.gpu));
}

// 20 AdamW steps of 2 micro-steps: the losses within 1e-2 of the CPU model's; each forward takes the logits'
// gradient in the pass of the loss, as training's do (the gradient test above runs them apart); the GPU on the
// attention kernels given (none: its default)
void check_training(const char* model, std::optional<AttentionKernels> attention) {
    Pair p(7, model, attention);
    const int micro_steps = Pair::MICRO_STEPS, BT = p.B * p.T;
    float dloss = 1.0f / (micro_steps * BT);  // gradients accumulate over the micro-steps (bf16 on the GPU)
    for (int step = 0; step < 20; step++) {
        float losses[2] = {};
        int i = 0;
        auto train = [&](auto& m) {
            gpt_zero_grad(m);
            for (int micro = 0; micro < micro_steps; micro++) {
                losses[i] += gpt_forward(m, &p.inputs[micro * BT], &p.targets[micro * BT], p.B, p.T, dloss) / micro_steps;
                gpt_backward(m, dloss);
            }
            i++;
            double norm = gpt_grad_norm(m);
            gpt_update(m, 1e-3f, 0.0f, clip_scale(norm, 1.0f));
        };
        train(p.cpu);
        train(p.gpu);
        INFO("step " << step << ": cpu " << losses[0] << " gpu " << losses[1]);
        CHECK(std::fabs(losses[1] - losses[0]) / losses[0] < 1e-2);
    }
}

// the GPU model's attention: the mma.sync kernels, the wgmma ones (Hopper), or the GPU's default
constexpr AttentionKernels MMA = AttentionKernels::MMA, WGMMA = AttentionKernels::WGMMA;
const std::optional<AttentionKernels> DEFAULT_ATTENTION = std::nullopt;

TEST_CASE("GPU model on the mma attention: loss, logits and every gradient against the CPU model at step 0",
          "[cuda][model]") {
    SKIP_WITHOUT_GPU_CASE();
    check_step_zero(DENSE_MODEL, MMA, 5e-2);  // bf16 gradients summed over 256 tokens: a few percent at most
}

TEST_CASE("GPU model on the mma attention: 20 AdamW steps of 2 micro-steps follow the CPU model's losses within 1e-2",
          "[cuda][model]") {
    SKIP_WITHOUT_GPU_CASE();
    check_training(DENSE_MODEL, MMA);
}

TEST_CASE("GPU model on the wgmma attention (Hopper): step 0 and 20 AdamW steps against the CPU model",
          "[cuda][model][wgmma]") {
    SKIP_WITHOUT_HOPPER_ATTENTION_CASE();
    check_step_zero(DENSE_MODEL, WGMMA, 5e-2);
    check_training(DENSE_MODEL, WGMMA);
}

// The tests above prove cuBLASLt's backward epilogues only if the model's matmuls take them: every matmul's C and
// OC (the MLP's projection with GELU's input, N×4C, and its bias gradient), and every parameter tensor's start in
// the flat buffers, whole 16-byte vectors (llmc/matmul.cuh's matmul_epilogues_fit)
TEST_CASE("GPU model: the dense test model's matmul backwards all take cuBLASLt's epilogues", "[cuda][model]") {
    GPTConfig c = parse_model_descriptor(DENSE_MODEL);
    long BT = 4 * 64, C = c.channels;
    for (auto [in, out] : {std::pair{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}}) {
        INFO("C " << in << " OC " << out);
        CHECK(matmul_epilogues_fit(BT, in, out, {}));
    }
    GPT cpu;
    gpt_allocate(cpu, c, 4, 64);
    size_t offset = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        INFO("tensor " << t << " at " << offset);
        CHECK(offset % 8 == 0);
        offset += cpu.param_sizes[t];
    }
}

TEST_CASE("GPU Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU): on the mma attention, loss, logits and every "
          "gradient against the CPU model at step 0, and 20 AdamW steps of 2 micro-steps",
          "[cuda][model][llama]") {
    SKIP_WITHOUT_GPU_CASE();
    check_step_zero(LLAMA_MODEL, MMA, 5e-2);
    check_training(LLAMA_MODEL, MMA);
}

TEST_CASE("GPU Llama with GPT-2's 50257 tokens (padded to 50304 in memory): loss, logits and every gradient against "
          "the CPU model at step 0, the padding rows' gradients zero, and 20 AdamW steps of 2 micro-steps",
          "[cuda][model][llama]") {
    SKIP_WITHOUT_GPU_CASE();
    REQUIRE(parse_model_descriptor(LLAMA_GPT2_VOCAB).padded_vocab_size == 50304);
    check_step_zero(LLAMA_GPT2_VOCAB, DEFAULT_ATTENTION, 5e-2);
    check_training(LLAMA_GPT2_VOCAB, DEFAULT_ATTENTION);
}

TEST_CASE("GPU Llama on the wgmma attention (Hopper): step 0 and 20 AdamW steps against the CPU model",
          "[cuda][model][llama][wgmma]") {
    SKIP_WITHOUT_HOPPER_ATTENTION_CASE();
    check_step_zero(LLAMA_MODEL, WGMMA, 5e-2);
    check_training(LLAMA_MODEL, WGMMA);
}

TEST_CASE("GPU Qwen3 (QK-norm, a head size of its own): on the mma attention, loss, logits and every gradient "
          "against the CPU model at step 0, and 20 AdamW steps of 2 micro-steps",
          "[cuda][model][qwen3]") {
    SKIP_WITHOUT_GPU_CASE();
    check_step_zero(QWEN3_MODEL, MMA, 5e-2);
    check_training(QWEN3_MODEL, MMA);
}

TEST_CASE("GPU model with experts (E=4, K=2): loss, logits and every gradient against the CPU model at step 0",
          "[cuda][model][moe]") {
    SKIP_WITHOUT_GPU_CASE();
    // the router sees bf16 inputs on the GPU: a token whose K-th and (K+1)-th logits are closer than that rounding
    // may go to another expert, so the experts' and the router's gradients are allowed more than the dense model's;
    // the other tensors see that token's changed output among 256 tokens' and keep the dense bound
    check_step_zero(MOE_MODEL, DEFAULT_ATTENTION, 5e-2, 1e-1);
}

TEST_CASE("GPU model with experts: 20 AdamW steps of 2 micro-steps follow the CPU model's losses within 1e-2",
          "[cuda][model][moe]") {
    SKIP_WITHOUT_GPU_CASE();
    check_training(MOE_MODEL, DEFAULT_ATTENTION);
}

TEST_CASE("GPU model: GPT-2's vocabulary at B·T = 1024 runs forward and backward in the workspace it allocates",
          "[cuda][model]") {
    // the classifier's matmul has 50304 columns and no bias; it once asked for bias-gradient scratch all the
    // same, ceil(BT/256)·50304 floats, more than the model allocates, and every d12 run stopped at its first
    // backward on an H100. Here that request would be 4·50304 floats against the layers' few thousand.
    SKIP_WITHOUT_GPU_CASE();
    GPTConfig config = parse_model_descriptor("d1c64h1t256");
    const int B = 4, T = 256;
    GPTCuda gpu;
    gpt_allocate(gpu, config, B, T);
    std::vector<float> params(gpu.num_parameters);
    gpt_init_random(config, params.data(), 3);
    gpt_set_params(gpu, params.data());
    Rng rng(4);
    std::vector<int> inputs(B * T), targets(B * T);
    for (int& t : inputs) t = (int)rng.below(config.vocab_size);
    for (int& t : targets) t = (int)rng.below(config.vocab_size);
    float loss = gpt_forward(gpu, inputs.data(), targets.data(), B, T);
    gpt_zero_grad(gpu);
    gpt_backward(gpu, 1.0f / (B * T));
    // a fresh model predicts nearly uniformly: the loss is close to ln V, and the gradients are finite
    CHECK(std::fabs(loss - std::log(50257.0)) < 0.5);
    CHECK(std::isfinite(gpt_grad_norm(gpu)));
}

TEST_CASE("GPU model: two runs from the same weights give the same bits, dense and with experts", "[cuda][model]") {
    SKIP_WITHOUT_GPU_CASE();
    for (const char* model : {DENSE_MODEL, MOE_MODEL}) {
        INFO(model);
        std::vector<float> losses[2], weights[2];
        for (int run = 0; run < 2; run++) {
            Pair p(3, model);
            for (int step = 0; step < 3; step++) {
                losses[run].push_back(gpt_forward(p.gpu, p.inputs.data(), p.targets.data(), p.B, p.T));
                gpt_zero_grad(p.gpu);
                gpt_backward(p.gpu, 1.0f / (p.B * p.T));
                gpt_update(p.gpu, 1e-3f, 0.1f, clip_scale(gpt_grad_norm(p.gpu), 1.0f));
            }
            weights[run].resize(p.gpu.num_parameters);
            gpt_get_params(p.gpu, weights[run].data());
        }
        CHECK(losses[0] == losses[1]);
        CHECK(weights[0] == weights[1]);
    }
}

TEST_CASE("--plan --device cuda: GPT-2 124M at B=4, T=1024 against a count by hand", "[plan]") {
    // Ψ = 50304·768 + 1024·768 + 12·(12·768² + 13·768) + 2·768 = 124,475,904
    GPTConfig c = parse_model_descriptor("d12");
    MemoryPlan p = plan_memory(c, 4, 1024, 1, ParallelPlan{}, Device::CUDA);
    CHECK(p.bytes[MEM_PARAMS] == 248951808ull);           // 2Ψ (bf16)
    CHECK(p.bytes[MEM_MASTER_WEIGHTS] == 497903616ull);   // 4Ψ (fp32)
    CHECK(p.bytes[MEM_GRADS] == 248951808ull);            // 2Ψ
    CHECK(p.bytes[MEM_OPTIMIZER] == 995807232ull);        // 8Ψ
    // bf16, per layer: 2 layernorm outputs 2·4096·768, qkv 3·4096·768, attention output 4096·768, MLP hidden
    // before and after GELU 2·4096·3072, 2 projections and 2 residuals 4·4096·768: 56,623,104 elements; around
    // the layers: embeddings and final layernorm 2·4096·768, logits 4096·50304: 212,336,640. fp32, per layer:
    // 4·4096 layernorm statistics and 12·4·1024 logsumexps: 65,536; around: 2·4096 + 4096 losses + 2·4096 tokens
    // and targets: 20,480. 2·(12·56,623,104 + 212,336,640) + 4·(12·65,536 + 20,480) = 1,786,855,424.
    CHECK(p.bytes[MEM_ACTIVATIONS] == 1786855424ull);
    // bf16 activation gradients: residual, layernorm input, qkv, attention output, MLP hidden: 31,457,280
    // elements; fp32 kernel scratch, the largest need being the layernorm backward's partial sums, 256 blocks of
    // 16 rows × 2·768: 393,216 floats. 2·31,457,280 + 4·393,216 = 64,487,424.
    CHECK(p.bytes[MEM_SCRATCH] == 64487424ull);
    CHECK(p.bytes[MEM_COMM] == 0);
    CHECK(p.total() == 3842957312ull);
}

}  // namespace test_cuda_model

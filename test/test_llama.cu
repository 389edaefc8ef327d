// Tests of the Llama 3 architecture around its layers (whose own tests are test_rmsnorm, test_rope, test_swiglu
// and the grouped-query cases of test_layers; the model against PyTorch is in test_model_reference): its
// names and descriptors, llm.c's Llama 3 files read and written byte for byte and refused when they hold what
// the model cannot be, the plan against the ledger, and training, checkpoints and an exact resume. Also the
// vocab padding memory adds (to a multiple of 128) and the files lack, against the same model without it.
#include <omp.h>

#include "llmc/checkpoint.h"
#include "llmc/gpt.cuh"
#include "llmc/hf.h"
#include "llmc/plan.h"
#include "mpi_helpers.h"

namespace test_llama {

// a small Llama on the tests' 301-token data: 2 layers, 32 channels, 4 query heads sharing 2 key/value heads,
// 80 hidden units
const char* MODEL = "l2c32h4g2f80t32v301";
const char* REFERENCE = "build/reference_llama_gqa/model.bin";  // make_llama_reference.py's, in llm.c's format
const char* TIED = "build/reference_llama_tied/model.bin";       // ... with the classifier tied to wte
const char* MOE = "build/reference_llama_moe/model.bin";         // ... with 4 SwiGLU experts, top 2

TEST_CASE("Llama names and descriptors give Meta's shapes and the asked ones; bad ones are refused", "[llama]") {
    GPTConfig c = parse_model_descriptor("llama3-8b");
    CHECK(c.llama());
    CHECK(c.num_layers == 32);
    CHECK(c.channels == 4096);
    CHECK(c.num_heads == 32);
    CHECK(c.kv_heads() == 8);
    CHECK(c.hidden() == 14336);  // 2/3 of 4C = 10922, times 1.3, rounded up to a multiple of 1024
    CHECK(c.vocab_size == 128256);
    CHECK(c.padded_vocab_size == 128256);  // a multiple of 128 already
    CHECK(c.rope_theta == 500000.0f);
    CHECK(c.rope_scaling == 8.0f);
    CHECK(!c.tied_embeddings);
    // Meta's published count for Llama 3.1 8B
    CHECK(num_parameters(c) == 8030261248ull);
    // Llama 3.2's small models: the classifier tied to wte, RoPE scaled by 32; Meta's counts (HF's
    // Llama-3.2-1B and -3B, whose safetensors hold 1235814400 and 3212749824 parameters)
    for (const char* name : {"llama3-1b", "llama3-3b"}) {
        GPTConfig s = parse_model_descriptor(name);
        CHECK(s.tied_embeddings);
        CHECK(s.rope_scaling == 32.0f);
        CHECK(classifier_tensor(s) == WTE);
    }
    CHECK(num_parameters(parse_model_descriptor("llama3-1b")) == 1235814400ull);
    CHECK(num_parameters(parse_model_descriptor("llama3-3b")) == 3212749824ull);
    CHECK(parse_model_descriptor("l2c32h4w").tied_embeddings);
    CHECK(!parse_model_descriptor("l2c32h4").tied_embeddings);
    CHECK(parse_model_descriptor("llama3-1b").hidden() == 8192);
    CHECK(parse_model_descriptor("llama3-3b").hidden() == 8192);
    CHECK(parse_model_descriptor("llama3-70b").hidden() == 28672);
    CHECK(parse_model_descriptor("llama3-405b").hidden() == 53248);
    // 70B: Meta's 70.55 billion
    CHECK(num_parameters(parse_model_descriptor("llama3-70b")) == 70553706496ull);

    GPTConfig small = parse_model_descriptor(MODEL);
    CHECK(small.llama());
    CHECK(small.num_layers == 2);
    CHECK(small.channels == 32);
    CHECK(small.kv_heads() == 2);
    CHECK(small.hidden() == 80);
    CHECK(small.max_seq_len == 32);
    CHECK(small.vocab_size == 301);
    CHECK(small.padded_vocab_size == 384);  // rounded up to a multiple of 128, as llm.c pads GPT-2's
    // every hidden size comes out exactly, through Meta's rule as the file stores it
    for (int H : {1, 7, 80, 85, 96, 1000, 4095})
        CHECK(parse_model_descriptor(strfmt("l1c64h4f%d", H)).hidden() == H);
    CHECK(parse_model_descriptor("l1c64h4").kv_heads() == 4);        // multi-head by default
    CHECK(parse_model_descriptor("l1c64h4").hidden() == 256);        // 170 rounded up to a multiple of 256
    CHECK(parse_model_descriptor("l2c32h4e4k2").num_experts == 4);  // Mixtral's shape
    CHECK(parse_model_descriptor("l2c32h4e4k2w").top_k == 2);
    for (const char* bad : {"l2c32h4g3", "l2c30h6", "l2c32h4e4", "l2c32h4e2k3", "llama3-2b", "l2c32", "l2c32h4g0",
                            "l2c32h4wg2", "d2c32h4w"}) {
        CommandResult r = single(strfmt("-e %s --plan", bad));
        INFO(bad << ": " << r.output);
        CHECK(r.status != 0);
        CHECK(lines_of(r.output).size() == 1);
    }
}

TEST_CASE("an llm.c Llama 3 file is read and written back byte for byte, fp32 and bf16", "[llama]") {
    INFO("run `make test` (or make " << REFERENCE << ") to generate it");
    REQUIRE(file_exists(REFERENCE));
    int version;
    GPTConfig c = read_model_header(REFERENCE, &version);
    CHECK(version == MODEL_VERSION_FP32);
    CHECK(c.llama());
    CHECK(c.kv_heads() == 2);
    CHECK(c.hidden() == 180);
    CHECK(c.rope_scaling == 8.0f);
    std::vector<float> params(num_parameters(c));
    gpt_load_params(c, params.data(), REFERENCE);
    TempDir dir;
    gpt_save_params(c, params.data(), dir / "again.bin");
    CHECK(read_file(dir / "again.bin") == read_file(REFERENCE));
    // tied, with Llama 3.2's scaling: llm5d's header slots, and wte repeated in lm_head's slot
    GPTConfig tied = read_model_header(TIED, &version);
    CHECK(tied.tied_embeddings);
    CHECK(tied.rope_scaling == 32.0f);
    GPTConfig untied = tied;
    untied.tied_embeddings = false;
    CHECK(num_parameters(tied) == num_parameters(untied) - (size_t)tied.padded_vocab_size * tied.channels);
    CHECK(file_layout(tied).file_size[WPE] == file_layout(tied).file_size[WTE]);
    std::vector<float> tied_params(num_parameters(tied));
    gpt_load_params(tied, tied_params.data(), TIED);
    gpt_save_params(tied, tied_params.data(), dir / "tied.bin");
    CHECK(read_file(dir / "tied.bin") == read_file(TIED));
    // with experts: E and K in header slots 12 and 13, the router after ln2's slots, the experts stacked
    GPTConfig moe = read_model_header(MOE, &version);
    CHECK(moe.num_experts == 4);
    CHECK(moe.top_k == 2);
    std::vector<float> moe_params(num_parameters(moe));
    gpt_load_params(moe, moe_params.data(), MOE);
    gpt_save_params(moe, moe_params.data(), dir / "moe.bin");
    CHECK(read_file(dir / "moe.bin") == read_file(MOE));
    // bf16: written, read, written again: the same bytes
    gpt_save_params(c, params.data(), dir / "half.bin", MODEL_VERSION_BF16);
    std::vector<float> halves(params.size());
    gpt_load_params(c, halves.data(), dir / "half.bin");
    gpt_save_params(c, halves.data(), dir / "half_again.bin", MODEL_VERSION_BF16);
    CHECK(read_file(dir / "half_again.bin") == read_file(dir / "half.bin"));
    CHECK(read_file(dir / "half.bin").size() == 2048 + 2 * (read_file(REFERENCE).size() - 2048) / 4);
}

TEST_CASE("a Llama file with a nonzero bias or a truncated tensor is refused in one line", "[llama]") {
    REQUIRE(file_exists(REFERENCE));
    int version;
    GPTConfig c = read_model_header(REFERENCE, &version);
    FileLayout layout = file_layout(c);
    std::string good = read_file(REFERENCE);
    Data data;
    TempDir dir;
    auto refused = [&](const std::string& bytes, const std::string& says) {
        std::string path = dir / "bad.bin";
        File f(path, "wb");
        f.write(bytes.data(), bytes.size());
        f.close();
        CommandResult r = single(data.flags(1, 16, 1, "'" + path + "'"));
        INFO(r.output);
        CHECK(r.status == 1);
        CHECK(lines_of(r.output).size() == 1);
        CHECK(r.output.find(path + ": " + says) != std::string::npos);
    };
    // element 3 of layer 1's qkv bias
    std::string bias = good;
    float one = 1.0f;
    size_t at = layout.header + 4 * (layout.file_start[QKVB] + layout.file_size[QKVB] / c.num_layers + 3);
    memcpy(&bias[at], &one, 4);
    refused(bias, "qkvb holds 1 at element");
    refused(good.substr(0, good.size() - 4), "size");
    // a tied file whose lm_head slot is not wte's copy, and a header slot 14 that is neither 0 nor 1
    REQUIRE(file_exists(TIED));
    GPTConfig t = read_model_header(TIED, &version);
    FileLayout tl = file_layout(t);
    std::string tied = read_file(TIED), untied = tied, slot = tied;
    memcpy(&untied[tl.header + 4 * (tl.file_start[WPE] + 5)], &one, 4);
    refused(untied, "lm_head differs from wte at element 5");
    int two = 2;
    memcpy(&slot[4 * 14], &two, 4);
    refused(slot, "header slot 14");
}

TEST_CASE("--plan predicts a Llama's ledger (and a Qwen3's: QK-norm's buffers, attention wider than C) on one "
          "rank, with recomputation and a split backward; --plan -e llama3-8b runs without allocating it",
          "[llama][plan]") {
    for (const char* model : {MODEL, "l3c48h6g1f100t24v97", "l1c64h8t16v50", "q3c48h6g2d12f100t24v97"})
        for (int recompute : {0, 1, 2})
            for (bool split : {false, true}) {
                INFO(model << " -r " << recompute << (split ? " split backward" : ""));
                GPTConfig c = parse_model_descriptor(model);
                int threads = omp_get_max_threads(), B = 3, T = 16;
                GPT m;
                ModelLayout layout;
                layout.split_backward = split, layout.recompute = recompute;
                gpt_allocate(m, c, B, T, layout);
                ParallelPlan par;
                par.recompute = recompute;
                if (split) par.pp = PPSpec{1, 0, 1, PPKind::ZeroBubble};
                MemoryPlan plan = plan_memory(c, B, T, threads, par);
                for (int i = 0; i < MEM_CATEGORIES; i++) {
                    INFO(mem_category_name(i));
                    CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                }
            }
    CommandResult r = single("-e llama3-8b -t 8192 -b 1 --plan --device cuda");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("8030261248 parameters") != std::string::npos);
    CHECK(r.output.find("KV=8 H=14336") != std::string::npos);
}

TEST_CASE("a small Llama trains on the CPU: its loss falls, -r 1 and 2 give the same bits, a checkpoint resumes "
          "bit-exactly and converts to llm.c's Llama 3 file, and -y 1 refuses another model",
          "[llama]") {
    Data data;
    TempDir out;
    std::string flags = data.flags(2, 64, 12, MODEL);
    std::string whole = train(1, flags + " -n 6", out / "whole");
    std::map<std::string, double> l = losses(out / "whole");  // main.log's s:S is the step after S steps
    CHECK(l.at("trl 11") < l.at("trl 0") - 0.5);
    for (int r : {1, 2}) {
        train(1, flags + strfmt(" -r %d", r), out / strfmt("r%d", r));
        CHECK(losses(out / strfmt("r%d", r)) == l);
    }
    // resumed from step 6 on a fresh directory holding that checkpoint only
    make_dirs(out / "resumed");
    CHECK(run_command("cp -r '" + (out / "whole/ckpt_00000006") + "' '" + (out / "resumed/") + "'").status == 0);
    std::string resumed = train(1, flags + " -y 1", out / "resumed");
    CHECK(resumed.find("resumed from") != std::string::npos);
    std::map<std::string, double> lr = losses(out / "resumed");
    CHECK(lr.count("trl 5") == 0);
    for (int s = 6; s < 12; s++) CHECK(lr.at(strfmt("trl %d", s)) == l.at(strfmt("trl %d", s)));
    // the checkpoint as an llm.c Llama 3 file, which trains as a model file
    CommandResult conv = single("--convert '" + (out / "whole/ckpt_00000012") + "' --to '" + (out / "final.bin") + "'");
    INFO(conv.output);
    REQUIRE(conv.status == 0);
    int version;
    GPTConfig c = read_model_header(out / "final.bin", &version);
    CHECK(c.llama());
    CHECK(same_model_shape(c, parse_model_descriptor(MODEL)));
    // another model in the same directory is refused
    CommandResult other = single(data.flags(2, 64, 14, "l2c32h4g4f80t32v301") + " -y 1 -o '" + (out / "whole") + "'");
    CHECK(other.status != 0);
}

// The same model with its vocab unpadded, as every Llama was laid out before memory padded it: wte and lm_head of
// V rows. The CPU model runs it as it runs any Vp >= V; it is the reference the padding must not change.
GPTConfig unpadded(GPTConfig c) {
    c.padded_vocab_size = c.vocab_size;
    return c;
}

// a padded model's flat buffer with the padding rows dropped by hand (each tensor's first elements, as many as
// the unpadded model's tensor has): the unpadded model's buffer
std::vector<float> drop_padding(const GPTConfig& c, const float* x) {
    size_t padded[NUM_PARAM_TENSORS], real[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, padded);
    param_tensor_sizes(unpadded(c), real);
    std::vector<float> out;
    for (int t = 0; t < NUM_PARAM_TENSORS; x += padded[t++]) out.insert(out.end(), x, x + real[t]);
    return out;
}

// how many elements of the padding rows (each tensor's elements past the unpadded model's) are not zero
size_t nonzero_padding(const GPTConfig& c, const float* x) {
    size_t padded[NUM_PARAM_TENSORS], real[NUM_PARAM_TENSORS], n = 0;
    param_tensor_sizes(c, padded);
    param_tensor_sizes(unpadded(c), real);
    for (int t = 0; t < NUM_PARAM_TENSORS; x += padded[t++])
        for (size_t i = real[t]; i < padded[t]; i++) n += x[i] != 0.0f;
    return n;
}

// how many of the n values of a and b differ (a count, so that a failure prints a number, not the buffers)
size_t differing(const float* a, const float* b, size_t n) {
    size_t d = 0;
    for (size_t i = 0; i < n; i++) d += a[i] != b[i];
    return d;
}
size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() ? differing(a.data(), b.data(), a.size()) : SIZE_MAX;
}

TEST_CASE("a Llama of an odd vocab pads wte and lm_head to a multiple of 128 in memory only: initialization, llm.c's "
          "and Hugging Face's files, 3 AdamW steps (losses, gradient norms, weights) and checkpoints, old ones "
          "included, are the unpadded model's bits",
          "[llama]") {
    // every way a Llama's shape arrives pads as llm.c pads GPT-2's (each file's own header is checked below)
    for (const char* d : {MODEL, "l2c32h4", "l2c32h4w", "l1c64h4t16v50", "llama3-1b"}) {
        GPTConfig c = parse_model_descriptor(d);
        INFO(d << ": V " << c.vocab_size << ", Vp " << c.padded_vocab_size);
        CHECK(c.padded_vocab_size % 128 == 0);
        CHECK(c.padded_vocab_size >= c.vocab_size);
        CHECK(c.padded_vocab_size - c.vocab_size < 128);
    }
    CHECK(parse_model_descriptor("l2c32h4").padded_vocab_size == 50304);  // GPT-2's 50257, as llm.c pads it
    GPTConfig c = parse_model_descriptor(MODEL), u = unpadded(c);  // 301 rows, padded to 384
    REQUIRE(c.padded_vocab_size == 384);
    REQUIRE(!c.tied());  // wte and lm_head both padded

    // initialization draws the unpadded model's numbers for the real rows; the padding rows are zero
    std::vector<float> params(num_parameters(c)), reference(num_parameters(u));
    gpt_init_random(c, params.data(), 5);
    gpt_init_random(u, reference.data(), 5);
    CHECK(nonzero_padding(c, params.data()) == 0);
    CHECK(differing(drop_padding(c, params.data()), reference) == 0);

    // llm.c's Llama 3 file holds V rows: the padded model writes the unpadded one's bytes, reads them back with
    // the padding rows zeroed (whatever they held), and writes the same bytes again; its header pads on reading
    TempDir dir;
    gpt_save_params(c, params.data(), dir / "padded.bin");
    gpt_save_params(u, reference.data(), dir / "unpadded.bin");
    CHECK(read_file(dir / "padded.bin") == read_file(dir / "unpadded.bin"));
    CHECK(file_layout(c).file_size[WTE] == 301 * 32);
    CHECK(file_layout(c).file_size[WPE] == 301 * 32);
    int version;
    GPTConfig from_file = read_model_header(dir / "padded.bin", &version);
    CHECK(from_file.padded_vocab_size == 384);
    std::vector<float> loaded(params.size(), 7.0f);
    gpt_load_params(c, loaded.data(), dir / "padded.bin");
    CHECK(nonzero_padding(c, loaded.data()) == 0);
    CHECK(differing(loaded, params) == 0);
    gpt_save_params(c, loaded.data(), dir / "again.bin");
    CHECK(read_file(dir / "again.bin") == read_file(dir / "padded.bin"));

    // Hugging Face's: embed_tokens and lm_head of V rows, vocab_size V; read back padded, the padding zero
    hf_save(c, params.data(), dir / "hf", "fp32");
    HfFiles hf = hf_open(dir / "hf");
    CHECK(hf.tensors.at("model.embed_tokens.weight").second->shape == std::vector<int64_t>{301, 32});
    CHECK(hf.tensors.at("lm_head.weight").second->shape == std::vector<int64_t>{301, 32});
    GPTConfig from_hf = hf_read_config(dir / "hf");
    CHECK(from_hf.vocab_size == 301);
    CHECK(from_hf.padded_vocab_size == 384);
    std::vector<float> hf_params(params.size(), 7.0f);
    hf_load(from_hf, hf_params.data(), dir / "hf");
    CHECK(differing(hf_params, params) == 0);

    // 3 AdamW steps of 2 micro-batches with weight decay and clipping: the same losses, gradient norms, real rows'
    // gradients and weights, bit for bit; the padding rows' gradients, weights and moments stay zero
    const int B = 2, T = 16, BT = B * T, micro = 2;
    GPT P, U;
    gpt_allocate(P, c, B, T);
    gpt_allocate(U, u, B, T);
    std::copy(params.begin(), params.end(), P.params);
    std::copy(reference.begin(), reference.end(), U.params);
    Rng rng(11);
    std::vector<int> inputs(micro * BT), targets(micro * BT);
    for (int& t : inputs) t = (int)rng.below(c.vocab_size);
    for (int& t : targets) t = (int)rng.below(c.vocab_size);
    for (int step = 0; step < 3; step++) {
        float loss[2] = {};
        double norm[2];
        GPT* models[2] = {&P, &U};
        for (int k = 0; k < 2; k++) {
            GPT& m = *models[k];
            gpt_zero_grad(m);
            for (int i = 0; i < micro; i++) {
                loss[k] += gpt_forward(m, &inputs[i * BT], &targets[i * BT], B, T) / micro;
                gpt_backward(m, 1.0f / (micro * BT));
            }
            norm[k] = gpt_grad_norm(m);
        }
        INFO("step " << step << ": padded loss " << loss[0] << " norm " << norm[0] << ", unpadded " << loss[1] << " "
                     << norm[1]);
        CHECK(loss[0] == loss[1]);
        CHECK(norm[0] == norm[1]);
        CHECK(nonzero_padding(c, P.grads) == 0);
        CHECK(differing(drop_padding(c, P.grads), std::vector<float>(U.grads, U.grads + U.num_parameters)) == 0);
        CHECK(clip_scale(norm[0], 0.5f) < 1.0f);  // the clipping is exercised
        gpt_update(P, 1e-2f, 0.1f, clip_scale(norm[0], 0.5f));
        gpt_update(U, 1e-2f, 0.1f, clip_scale(norm[1], 0.5f));
    }
    CHECK(differing(drop_padding(c, P.params), std::vector<float>(U.params, U.params + U.num_parameters)) == 0);
    for (const float* x : {P.params, P.adam_m, P.adam_v}) CHECK(nonzero_padding(c, x) == 0);

    // checkpoints: the padded model writes the unpadded one's model.bin, optimizer file and state byte for byte
    // (the manifest names the padded shape), and reads a checkpoint that the unpadded model wrote, as every
    // Llama's was written before the padding, into its own state, padding zero whatever it held
    Comm solo;
    RunLayout layout{B, T, 1, (long)micro * BT};
    RunInputs inputs_used{MODEL, 0, 7, true, "train", {}};
    TrainState state;
    state.step = 3;
    save_checkpoint(dir / "P", model_state(P), state, layout, inputs_used, 0, solo);
    save_checkpoint(dir / "U", model_state(U), state, layout, inputs_used, 0, solo);
    std::string padded_ckpt = dir / "P/" + checkpoint_name(3), unpadded_ckpt = dir / "U/" + checkpoint_name(3);
    for (const char* file : {"/model.bin", "/optimizer_rank0.bin", "/state_rank0.bin"}) {
        INFO(file);
        CHECK(read_file(padded_ckpt + file) == read_file(unpadded_ckpt + file));
    }
    GPT R;
    gpt_allocate(R, checkpoint_config(unpadded_ckpt), B, T);
    REQUIRE(R.num_parameters == P.num_parameters);
    for (float* x : {R.params, R.adam_m, R.adam_v}) std::fill(x, x + R.num_parameters, 7.0f);
    TrainState resumed;
    load_checkpoint(unpadded_ckpt, model_state(R), resumed);
    CHECK(resumed.step == 3);
    CHECK(R.adam_step == P.adam_step);
    CHECK(differing(R.params, P.params, P.num_parameters) == 0);
    CHECK(differing(R.adam_m, P.adam_m, P.num_parameters) == 0);
    CHECK(differing(R.adam_v, P.adam_v, P.num_parameters) == 0);
}

}  // namespace test_llama

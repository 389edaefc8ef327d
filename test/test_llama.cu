// Tests of the Llama 3 architecture around its layers (whose own tests are test_rmsnorm, test_rope, test_swiglu
// and the grouped-query cases of test_layers; the model against PyTorch is in test_model_reference): its
// names and descriptors, llm.c's Llama 3 files read and written byte for byte and refused when they hold what
// the model cannot be, the plan against the ledger, and training, checkpoints and an exact resume.
#include <omp.h>

#include "llmc/gpt.cuh"
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
    CHECK(c.padded_vocab_size == 128256);
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
    CHECK(small.padded_vocab_size == 301);
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
    CHECK(num_parameters(tied) == num_parameters(untied) - (size_t)tied.vocab_size * tied.channels);
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

TEST_CASE("--plan predicts a Llama's ledger on one rank, with recomputation and a split backward; --plan -e "
          "llama3-8b runs without allocating it",
          "[llama][plan]") {
    for (const char* model : {MODEL, "l3c48h6g1f100t24v97", "l1c64h8t16v50"})
        for (int recompute : {0, 1, 2})
            for (bool split : {false, true}) {
                INFO(model << " -r " << recompute << (split ? " split backward" : ""));
                GPTConfig c = parse_model_descriptor(model);
                int threads = omp_get_max_threads(), B = 3, T = 16;
                GPT m;
                gpt_allocate(m, c, B, T, ModelBuffers{}, TPSpec{}, recompute, CPSpec{}, ModelPart{}, 1, split);
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

}  // namespace test_llama

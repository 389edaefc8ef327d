// Tests of the Hugging Face export and import (llmc/hf.h): the PyTorch reference models of test/reference,
// exported by `train_gpt --convert FILE --to DIR --format hf`, read back by test/reference/hf_reference.py, an
// independent implementation of HF's GPT-2 and Llama (its tensor names, Conv1D layout, rotate-half RoPE, llama3
// rope scaling), whose logits and loss on the reference batch must be the reference's; sharded and bf16
// exports; round trips byte for byte; an HF directory training as its llm.c file does; and the refusals.
#include "llmc/hf.h"
#include "mpi_helpers.h"

namespace test_hf {

const std::string PYTHON = reference_python();  // test/reference needs torch and numpy

// hf_reference.py on an exported directory against a reference state; returns its output line
std::string check_export(const std::string& dir, const std::string& reference, const char* tol = "1e-5") {
    CommandResult r = run_command(strfmt("%s test/reference/hf_reference.py --hf '%s' --state build/%s/state.bin --tol %s",
                                         PYTHON.c_str(), dir.c_str(), reference.c_str(), tol));
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find(": PASS") != std::string::npos);
    return r.output;
}

TEST_CASE("GPT-2 and Llama exported to Hugging Face give the PyTorch reference's logits and loss in HF's own "
          "conventions: GPT-2, Llama with GQA and scaled RoPE, with MQA, with MHA, tied with Llama 3.2's scaling",
          "[hf]") {
    TempDir out;
    for (const char* reference :
         {"reference", "reference_llama_gqa", "reference_llama_mqa", "reference_llama_mha", "reference_llama_tied"}) {
        INFO(reference);
        std::string model = strfmt("build/%s/model.bin", reference), dir = out / reference;
        REQUIRE(file_exists(model));
        CommandResult r = single(strfmt("--convert '%s' --to '%s' --format hf", model.c_str(), dir.c_str()));
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(file_exists(dir + "/config.json"));
        CHECK(file_exists(dir + "/model.safetensors"));
        check_export(dir, reference);
        // the tensors hold what the model file holds: bf16 is the same model rounded
        std::string half = out / (std::string(reference) + "_bf16");
        REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf --dtype bf16", model.c_str(), half.c_str())).status == 0);
        check_export(half, reference, "2e-2");
    }
}

TEST_CASE("a Hugging Face export above the shard size is sharded with an index, and reads as the whole", "[hf]") {
    int version;
    GPTConfig c = read_model_header("build/reference_llama_gqa/model.bin", &version);
    std::vector<float> params(num_parameters(c));
    gpt_load_params(c, params.data(), "build/reference_llama_gqa/model.bin");
    TempDir out;
    std::string dir = out / "sharded";
    int shards = hf_save(c, params.data(), dir, "fp32", 100000);  // 100 kB: each shard a few layers' tensors
    CHECK(shards >= 3);
    CHECK(file_exists(dir + "/model.safetensors.index.json"));
    CHECK(!file_exists(dir + "/model.safetensors"));
    CHECK(file_exists(dir + strfmt("/model-00001-of-%05d.safetensors", shards)));
    // no shard above the limit unless one tensor is (the embeddings, 397 x 48 fp32 = 76 kB, are not)
    for (int i = 1; i <= shards; i++) {
        SafetensorsFile f = read_safetensors(dir + strfmt("/model-%05d-of-%05d.safetensors", i, shards));
        size_t bytes = 0;
        for (const SafetensorsTensor& t : f.tensors) bytes += t.end - t.begin;
        CHECK(bytes <= 100000);
        CHECK(f.metadata.at("format") == "pt");
    }
    check_export(dir, "reference_llama_gqa");
}

TEST_CASE("--convert --format hf refuses an existing --to and a source that is neither model nor checkpoint", "[hf]") {
    TempDir out;
    make_dirs(out / "there");
    check_one_line_error(single("--convert build/reference/model.bin --to '" + (out / "there") + "' --format hf"),
                         {"already exists"});
    check_one_line_error(single("--convert '" + (out / "missing.bin") + "' --to '" + (out / "x") + "' --format hf"),
                         {"missing.bin"});
    check_one_line_error(single("--format hf"), {"--format hf: only with --convert"});
}

TEST_CASE("--convert onto a full disk says so in one line and leaves neither --to nor its temporary file", "[hf]") {
    TempDir out;
    const std::string to = out / "model.bin";
    // the temporary file the conversion writes, on a full disk: every write to /dev/full fails with ENOSPC
    REQUIRE(symlink("/dev/full", (to + ".tmp").c_str()) == 0);
    check_one_line_error(single("--convert build/reference/model.bin --to '" + to + "'"),
                         {to + ".tmp: write failed (No space left on device)"});
    CHECK(access(to.c_str(), F_OK) != 0);
    struct stat st;  // the link itself is gone
    CHECK(lstat((to + ".tmp").c_str(), &st) != 0);
}

TEST_CASE("llm.c file -> Hugging Face -> llm.c file, and Hugging Face -> llm5d -> Hugging Face, byte for byte",
          "[hf]") {
    TempDir out;
    for (const char* reference :
         {"reference", "reference_llama_gqa", "reference_llama_mqa", "reference_llama_mha", "reference_llama_tied"}) {
        INFO(reference);
        std::string model = strfmt("build/%s/model.bin", reference), hf = out / (std::string(reference) + ".hf"),
                    back = out / (std::string(reference) + ".bin"), again = out / (std::string(reference) + ".hf2");
        REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", model.c_str(), hf.c_str())).status == 0);
        REQUIRE(single(strfmt("--convert '%s' --to '%s'", hf.c_str(), back.c_str())).status == 0);
        CHECK(read_file(back) == read_file(model));
        REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", back.c_str(), again.c_str())).status == 0);
        CHECK(read_file(again + "/model.safetensors") == read_file(hf + "/model.safetensors"));
        CHECK(read_file(again + "/config.json") == read_file(hf + "/config.json"));
    }
}

TEST_CASE("-e with a Hugging Face directory written by an independent Python converter (one file, or 3 shards) "
          "trains to the llm.c file's losses, equal to the last digit",
          "[hf]") {
    Data data;
    TempDir out;
    for (const char* reference : {"reference", "reference_llama_gqa", "reference_llama_mha", "reference_llama_tied"}) {
        INFO(reference);
        std::string model = strfmt("build/%s/model.bin", reference), hf = out / (std::string(reference) + ".hf");
        const char* shards = std::string(reference) == "reference_llama_mha" ? "3" : "1";
        CommandResult w = run_command(strfmt("%s test/reference/make_hf_reference.py '%s' '%s' --shards %s",
                                             PYTHON.c_str(), model.c_str(), hf.c_str(), shards));
        INFO(w.output);
        REQUIRE(w.status == 0);
        train(1, data.flags(2, 64, 10, "'" + model + "'"), out / (std::string(reference) + "_file"));
        train(1, data.flags(2, 64, 10, "'" + hf + "'"), out / (std::string(reference) + "_hf"));
        std::map<std::string, double> a = losses(out / (std::string(reference) + "_file"));
        CHECK(a.size() >= 10);
        CHECK(losses(out / (std::string(reference) + "_hf")) == a);
    }
}

TEST_CASE("a Hugging Face directory this trainer cannot represent, or a damaged one, is refused in one line naming "
          "the field or the tensor",
          "[hf]") {
    Data data;
    TempDir out;
    std::string gpt2 = out / "gpt2", llama = out / "llama";
    REQUIRE(single("--convert build/reference/model.bin --to '" + gpt2 + "' --format hf").status == 0);
    REQUIRE(single("--convert build/reference_llama_gqa/model.bin --to '" + llama + "' --format hf").status == 0);
    // a copy of `dir` with config.json's `from` replaced by `to`
    auto edited = [&](const std::string& dir, const std::string& from, const std::string& to) {
        std::string copy = dir + "_edited";
        remove_tree(copy);
        REQUIRE(run_command("cp -r '" + dir + "' '" + copy + "'").status == 0);
        std::string config = read_file(copy + "/config.json");
        size_t at = config.find(from);
        REQUIRE(at != std::string::npos);
        config.replace(at, from.size(), to);
        File f(copy + "/config.json", "wb");
        f.write(config.data(), config.size());
        f.close();
        return copy;
    };
    auto refused = [&](const std::string& dir, const std::vector<std::string>& words) {
        check_one_line_error(single("-e '" + dir + "' --plan"), words);
    };
    refused(edited(gpt2, "GPT2LMHeadModel", "BertModel"), {"architectures", "BertModel"});
    refused(edited(llama, "\"attention_bias\": false", "\"attention_bias\": true"), {"attention_bias", "no biases"});
    refused(edited(llama, "\"llama3\"", "\"dynamic\""), {"rope_scaling"});
    refused(edited(llama, "\"high_freq_factor\": 4.0", "\"high_freq_factor\": 2.0"), {"rope_scaling"});
    // a model with experts has no GPT2LMHeadModel or LlamaForCausalLM form
    for (const char* moe : {"build/reference_moe/model.bin", "build/reference_llama_moe/model.bin"})
        check_one_line_error(single(strfmt("--convert %s --to '%s' --format hf", moe, (out / "moe").c_str())),
                             {"--format hf", "experts"});
    // what only reading the tensors finds: a run, not a plan
    auto run_refused = [&](const std::string& dir, const std::vector<std::string>& words) {
        check_one_line_error(single(data.flags(1, 16, 1, "'" + dir + "'")), words);
    };
    run_refused(edited(gpt2, "\"n_layer\": 3", "\"n_layer\": 4"), {"transformer.h.3.ln_1.weight", "missing"});
    // a truncated safetensors file
    std::string cut = edited(llama, "\"mlp_bias\": false", "\"mlp_bias\": false");
    std::string bytes = read_file(cut + "/model.safetensors");
    File f(cut + "/model.safetensors", "wb");
    f.write(bytes.data(), bytes.size() - 100);
    f.close();
    run_refused(cut, {"model.safetensors"});
}

}  // namespace test_hf

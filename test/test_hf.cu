// Tests of the Hugging Face export and import (llmc/hf.h): the PyTorch reference models of test/reference,
// exported by `train_gpt --convert FILE --to DIR --format hf`, read back by test/reference/hf_reference.py, an
// independent implementation of HF's GPT-2, Llama and Qwen3 (its tensor names, Conv1D layout, rotate-half RoPE,
// llama3 rope scaling, QK-norm), whose logits and loss on the reference batch must be the reference's; sharded and bf16
// exports; round trips byte for byte; an HF directory training as its llm.c file does; the refusals; and the
// fine-tune path: a Llama 3 directory with its tokenizer, its own tokens, samples, and back to a directory that
// holds the tokenizer files.
#include "llmc/hf.h"
#include "llmc/tokenizer.h"
#include "mpi_helpers.h"

namespace test_hf {

const std::string PYTHON = reference_python();  // test/reference needs torch and numpy

// An exported directory, the reference whose state it must reproduce, and the tolerance
struct Export {
    std::string dir, reference;
    const char* tol = "1e-5";
};

// hf_reference.py on exported directories, each against its reference's state, in one process (importing torch
// is most of a check's time): a PASS line for each, in order
void check_exports(const std::vector<Export>& exports) {
    std::string args;
    for (const Export& e : exports)
        args += strfmt(" --hf '%s' --state build/%s/state.bin --tol %s", e.dir.c_str(), e.reference.c_str(), e.tol);
    CommandResult r = run_command(PYTHON + " test/reference/hf_reference.py" + args);
    INFO(r.output);
    CHECK(r.status == 0);
    std::vector<std::string> lines;
    for (const std::string& line : lines_of(r.output))
        if (line.rfind("hf_reference: ", 0) == 0) lines.push_back(line);
    REQUIRE(lines.size() == exports.size());
    for (size_t i = 0; i < exports.size(); i++) {
        INFO(exports[i].dir << " against " << exports[i].reference);
        CHECK(lines[i].find(": PASS") != std::string::npos);
    }
}
void check_export(const std::string& dir, const std::string& reference) { check_exports({{dir, reference}}); }

TEST_CASE("GPT-2, Llama and Qwen3 exported to Hugging Face give the PyTorch reference's logits and loss in HF's own "
          "conventions: GPT-2, Llama with GQA and scaled RoPE, with MQA, with MHA, tied with Llama 3.2's scaling, "
          "Qwen3 with GQA and tied with MQA",
          "[hf]") {
    TempDir out;
    std::vector<Export> exports;
    for (const char* reference :
         {"reference", "reference_llama_gqa", "reference_llama_mqa", "reference_llama_mha", "reference_llama_tied",
          "reference_qwen3", "reference_qwen3_tied"}) {
        INFO(reference);
        std::string model = strfmt("build/%s/model.bin", reference), dir = out / reference;
        REQUIRE(file_exists(model));
        CommandResult r = single(strfmt("--convert '%s' --to '%s' --format hf", model.c_str(), dir.c_str()));
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(file_exists(dir + "/config.json"));
        CHECK(file_exists(dir + "/model.safetensors"));
        exports.push_back({dir, reference});
        // the tensors hold what the model file holds: bf16 is the same model rounded
        std::string half = out / (std::string(reference) + "_bf16");
        REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf --dtype bf16", model.c_str(), half.c_str())).status == 0);
        exports.push_back({half, reference, "2e-2"});
    }
    check_exports(exports);
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
    std::vector<Export> exports;
    for (const char* reference :
         {"reference", "reference_llama_gqa", "reference_llama_mqa", "reference_llama_mha", "reference_llama_tied",
          "reference_qwen3", "reference_qwen3_tied"}) {
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

TEST_CASE("Qwen3-MoE (gates renormalized and not; dense layers among the sparse), Qwen2-MoE (q, k and v biases, a "
          "gated shared expert) and Mixtral: Hugging Face -> llm5d file -> Hugging Face gives every tensor back bit "
          "for bit with the config's fields, and the file comes back byte for byte",
          "[hf][moe]") {
    TempDir out;
    for (const char* reference : {"reference_qwen3_moe", "reference_qwen3_moe_raw", "reference_mixtral",
                                  "reference_qwen3_moe_mixed", "reference_qwen2_moe"}) {
        INFO(reference);
        std::string hf = strfmt("build/%s/hf", reference), file = out / (std::string(reference) + ".bin"),
                    again = out / (std::string(reference) + ".hf"), back = out / (std::string(reference) + "2.bin");
        REQUIRE(single(strfmt("--convert '%s' --to '%s'", hf.c_str(), file.c_str())).status == 0);
        REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", file.c_str(), again.c_str())).status == 0);
        SafetensorsFile theirs = read_safetensors(hf + "/model.safetensors");
        SafetensorsFile ours = read_safetensors(again + "/model.safetensors");
        CHECK(ours.tensors.size() == theirs.tensors.size());
        std::string their_bytes = read_file(theirs.path), our_bytes = read_file(ours.path);
        for (const SafetensorsTensor& t : theirs.tensors) {
            INFO(t.name);
            const SafetensorsTensor* o = ours.find(t.name);
            REQUIRE(o != nullptr);
            CHECK(o->shape == t.shape);
            CHECK(our_bytes.substr(ours.data_start + o->begin, o->end - o->begin) ==
                  their_bytes.substr(theirs.data_start + t.begin, t.end - t.begin));
        }
        // the fields that describe the experts, as the Hub's configs have them
        JsonDoc config = JsonDoc::from_file(again + "/config.json"), given = JsonDoc::from_file(hf + "/config.json");
        bool mixtral = std::string(reference) == "reference_mixtral";
        for (const char* key : mixtral ? std::vector<const char*>{"num_local_experts", "num_experts_per_tok", "intermediate_size"}
                                       : std::vector<const char*>{"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                                  "intermediate_size"})
            CHECK(config.root.at(key).as_int64() == given.root.at(key).as_int64());
        CHECK(config.root.at("architectures").as_array()[0].as_string() ==
              given.root.at("architectures").as_array()[0].as_string());
        if (!mixtral) {
            CHECK(config.root.at("norm_topk_prob").as_bool() == given.root.at("norm_topk_prob").as_bool());
            CHECK(config.root.at("decoder_sparse_step").as_int64() == given.root.at("decoder_sparse_step").as_int64());
            const std::vector<JsonValue>&dense = config.root.at("mlp_only_layers").as_array(),
                  &given_dense = given.root.at("mlp_only_layers").as_array();
            REQUIRE(dense.size() == given_dense.size());
            for (size_t k = 0; k < dense.size(); k++) CHECK(dense[k].as_int64() == given_dense[k].as_int64());
        }
        if (std::string(reference) == "reference_qwen2_moe")
            CHECK(config.root.at("shared_expert_intermediate_size").as_int64() ==
                  given.root.at("shared_expert_intermediate_size").as_int64());
        REQUIRE(single(strfmt("--convert '%s' --to '%s'", again.c_str(), back.c_str())).status == 0);
        CHECK(read_file(back) == read_file(file));
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
    // GPT-2 with experts has no Hugging Face form; Mixtral's gates are renormalized, always
    check_one_line_error(single(strfmt("--convert build/reference_moe/model.bin --to '%s' --format hf", (out / "moe").c_str())),
                         {"--format hf", "experts"});
    // a model of this shape, written as an llm.c file, then refused by --convert --format hf
    auto not_exported = [&](const char* descriptor, const std::vector<std::string>& words) {
        INFO(descriptor);
        GPTConfig c = parse_model_descriptor(descriptor);
        std::vector<float> params(num_parameters(c));
        gpt_init_random(c, params.data(), 1);
        std::string file = out / (std::string(descriptor) + ".bin"), hf = out / descriptor;
        gpt_save_params(c, params.data(), file);
        check_one_line_error(single(strfmt("--convert '%s' --to '%s' --format hf", file.c_str(), hf.c_str())), words);
    };
    not_exported("l2c48h4e4k2u", {"--format hf", "Mixtral renormalizes"});
    // ... and its layers are all sparse
    not_exported("l2c48h4e4k2n1", {"--format hf", "Mixtral has experts in every layer"});
    // the classes the properties name: DeepSeek's ungated shared expert and its routing have none here; Qwen2-MoE
    // has both q, k, v biases and a gated shared expert; Qwen3-MoE no shared expert
    not_exported("l2c48h4be4k2y24", {"--format hf", "without a gate"});
    not_exported("l2c48h4e4k2z24", {"--format hf", "Qwen2-MoE", "biases"});
    not_exported("l2c48h4be4k2", {"--format hf", "Qwen2ForCausalLM"});
    not_exported("l2c48h4b", {"--format hf", "Qwen2ForCausalLM"});
    not_exported("q2c48h4e4k2z24", {"--format hf", "Qwen3-MoE has no shared expert"});
    not_exported("l2c48h4be4k2z24i", {"--format hf", "DeepSeek-V3"});
    not_exported("l2c48h4be4k2z24a", {"--format hf", "DeepSeek-V3"});
    // Qwen3-MoE's dense layers: the first ones (not layer 1 alone), and at least one layer sparse (a step of 3 in 2
    // layers leaves none)
    std::string qwen_moe = "build/reference_qwen3_moe/hf";
    refused(edited(qwen_moe, "\"mlp_only_layers\": []", "\"mlp_only_layers\": [1]"), {"mlp_only_layers", "first"});
    refused(edited(qwen_moe, "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 3"), {"none of the 2 layers sparse"});
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

// The data step of the fine-tune path, as the user takes it: `lines` lines of "Hello world" in a text file,
//   node dev/data/prepare.js --tokenizer DIR --out D FILE
// which writes D/train.bin and D/val.bin in llm.c's Llama 3 format (uint32 tokens) and D/tokenizer.bin
void prepare_hello_world(const std::string& tokenizer_dir, const std::string& out, int lines) {
    std::string text;
    for (int i = 0; i < lines; i++) text += "Hello world\n";
    File f(out + ".txt", "wb");
    f.write(text.data(), text.size());
    f.close();
    CommandResult r = run_command("node dev/data/prepare.js --tokenizer '" + tokenizer_dir + "' --out '" + out + "' '" +
                                  out + ".txt'");
    INFO(r.output);
    REQUIRE(r.status == 0);
}

// well-formed UTF-8: no stray continuation byte, no truncated sequence, no overlong form, surrogate or code point
// past U+10FFFF
bool valid_utf8(const std::string& s) {
    const unsigned char* p = (const unsigned char*)s.data();
    for (size_t i = 0, n = s.size(); i < n;) {
        int len = p[i] < 0x80 ? 1 : p[i] >= 0xC2 && p[i] <= 0xDF ? 2 : p[i] >= 0xE0 && p[i] <= 0xEF ? 3
                  : p[i] >= 0xF0 && p[i] <= 0xF4 ? 4 : 0;
        if (len == 0 || i + len > n) return false;
        for (int k = 1; k < len; k++)
            if ((p[i + k] & 0xC0) != 0x80) return false;
        if ((p[i] == 0xE0 && p[i + 1] < 0xA0) || (p[i] == 0xED && p[i + 1] >= 0xA0) || (p[i] == 0xF0 && p[i + 1] < 0x90) ||
            (p[i] == 0xF4 && p[i + 1] >= 0x90))
            return false;
        i += len;
    }
    return true;
}

TEST_CASE("the fine-tune path: a Hugging Face Llama 3 directory with Llama 3's tokenizer -> its own tokens -> "
          "train_gpt -e DIR, its samples decoded with the directory's tokenizer.json -> --convert --format hf, "
          "which copies the tokenizer files beside the weights",
          "[hf][finetune]") {
    const std::string tokenizer = tokenizer_package("llama3");
    if (tokenizer.empty()) return;
    TempDir t;
    const std::string hf = t / "llama", data = t / "data", out = t / "out", back = t / "back";
    // a tiny random Llama of Llama 3's vocab (1 layer, C=64, tied), its tokenizer, and Llama 3's
    // generation_config.json
    GPTConfig c = parse_model_descriptor("l1c64h4g2t64v128256w");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 5);
    hf_save(c, params.data(), hf, "fp32");
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        REQUIRE(run_command(strfmt("cp '%s/%s' '%s/'", tokenizer.c_str(), name, hf.c_str())).status == 0);
    {
        const std::string generation = "{\n  \"bos_token_id\": 128000,\n  \"eos_token_id\": 128001\n}\n";
        File f(hf + "/generation_config.json", "wb");
        f.write(generation.data(), generation.size());
        f.close();
    }
    prepare_hello_world(hf, data, 2000);  // enough that a 5% validation split holds a global batch
    // the tokenizer file prepared beside the data is the directory's tokenizer, decoded
    Tokenizer prepared(data + "/tokenizer.bin"), own(hf);
    CHECK(prepared.tokens == own.tokens);
    CHECK(prepared.eot == 128001);

    std::string run = strfmt("-e '%s' -i '%s/train.bin' -j '%s/val.bin' -o '%s' -t 32 -b 4 -d 128 -x 20 -l 1e-2 -u 2 "
                             "-v 20 -m 1 -s 20 -g 16 -n 20 --seed 3",
                             hf.c_str(), data.c_str(), data.c_str(), out.c_str());
    CommandResult r = single(run);
    INFO(r.output);
    REQUIRE(r.status == 0);
    // from <|begin_of_text|>, as every document of the shards starts
    CHECK(r.output.find("samples: decoded with " + hf + "/tokenizer.json, starting from token 128000 (" + hf +
                        "/tokenizer_config.json's bos_token)") != std::string::npos);
    size_t open = r.output.find("---\n"), close = r.output.find("\n---", open + 4);
    REQUIRE(open != std::string::npos);
    REQUIRE(close != std::string::npos);
    std::string sample = r.output.substr(open + 4, close - open - 4);
    INFO("sample: " << sample);
    // bytes, not the tokenizer.json's spelling of them: a model that learned "Hello world\n" says it
    CHECK(valid_utf8(sample));
    CHECK(sample.find("\xc4\xa0") == std::string::npos);  // 'Ġ', the byte-level spelling of ' '
    CHECK(sample.find("\xc4\x8a") == std::string::npos);  // 'Ċ', of '\n'
    CHECK(sample.find("Hello world\n") != std::string::npos);

    // the converted directory holds the weights and the tokenizer files, byte for byte; the absent
    // special_tokens_map.json is a note
    CommandResult conv = single(strfmt("--convert '%s/ckpt_00000020' --to '%s' --format hf", out.c_str(), back.c_str()));
    INFO(conv.output);
    REQUIRE(conv.status == 0);
    CHECK(conv.output.find("note: " + hf + "/special_tokens_map.json is absent, not copied") != std::string::npos);
    CHECK(file_exists(back + "/model.safetensors"));
    CHECK(hf_read_config(back).vocab_size == 128256);
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
        CHECK(read_file(back + "/" + name) == read_file(hf + "/" + name));
    CHECK(!file_exists(back + "/special_tokens_map.json"));
    CHECK(Tokenizer(back).eot == 128001);
    // Hugging Face's own libraries load the directory as a whole where they are installed
    std::string lacks = python_lacks(PYTHON, {"transformers"});
    if (!lacks.empty()) {
        WARN("transformers not checked: " << lacks);
    } else {
        CommandResult py = run_command(strfmt(
            "%s -c \"from transformers import AutoTokenizer, AutoConfig; import sys; "
            "t = AutoTokenizer.from_pretrained(sys.argv[1]); c = AutoConfig.from_pretrained(sys.argv[1]); "
            "print(t.encode('Hello world', add_special_tokens=False), c.vocab_size)\" '%s'",
            PYTHON.c_str(), back.c_str()));
        INFO(py.output);
        CHECK(py.status == 0);
        CHECK(py.output.find("[9906, 1917] 128256") != std::string::npos);
    }
    // a model from an llm.c file has no tokenizer files to copy: a note, and the weights
    const std::string plain = t / "plain";
    CommandResult from_file = single("--convert build/reference_llama_gqa/model.bin --to '" + plain + "' --format hf");
    INFO(from_file.output);
    CHECK(from_file.status == 0);
    CHECK(from_file.output.find("note: no tokenizer files copied: the model came from "
                                "build/reference_llama_gqa/model.bin, not a Hugging Face directory") != std::string::npos);
    CHECK(!file_exists(plain + "/tokenizer.json"));
}

TEST_CASE("the fine-tune path for Qwen3-MoE: a Hugging Face directory (a dense layer, then a sparse one) with Qwen's "
          "tokenizer -> its own tokens -> train_gpt -e DIR under --ep 2, the same losses as one rank -> --convert "
          "--format hf, the tokenizer files beside the weights and the dense layer where HF has it",
          "[hf][finetune][moe]") {
    const std::string tokenizer = tokenizer_package("qwen3");
    if (tokenizer.empty()) return;
    TempDir t;
    const std::string hf = t / "qwen3_moe", data = t / "data", back = t / "back";
    // Qwen3-MoE's vocab and shape in small: 4 experts of 32, 2 per token, layer 0 dense (mlp_only_layers [0])
    GPTConfig c = parse_model_descriptor("q2c64h4g2d16f128t64v151936e4k2x32n1");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 5);
    hf_save(c, params.data(), hf, "fp32");
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        REQUIRE(run_command(strfmt("cp '%s/%s' '%s/'", tokenizer.c_str(), name, hf.c_str())).status == 0);
    prepare_hello_world(hf, data, 2000);
    // 10 steps at a real learning rate, 4 micro-steps of one sequence on one rank and 2 on each ep rank, the
    // default shuffle
    std::string run = strfmt("-e '%s' -i '%s/train.bin' -j '%s/val.bin' -t 16 -b 1 -d 64 -x 10 -l 1e-2 -v 0 -s 10 "
                             "-g 8 -n 10 --seed 3",
                             hf.c_str(), data.c_str(), data.c_str());
    std::string one_out, ep_out;
    REQUIRE(single_ok(run, t / "one", &one_out));
    REQUIRE(train_ok(2, run + " --ep 2", t / "ep2", &ep_out));
    INFO(ep_out);
    check_close(losses(t / "ep2"), losses(t / "one"), 1e-5);
    CHECK(ep_out.find("samples: decoded with " + hf + "/tokenizer.json") != std::string::npos);
    CHECK(ep_out.find("\n---\n") != std::string::npos);
    CHECK(ep_out.find("dense layers 1 (first 1, sparse every 1)") != std::string::npos);

    CommandResult conv = single(strfmt("--convert '%s/ckpt_00000010' --to '%s' --format hf", (t / "ep2").c_str(),
                                       back.c_str()));
    INFO(conv.output);
    REQUIRE(conv.status == 0);
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        CHECK(read_file(back + "/" + name) == read_file(hf + "/" + name));
    JsonDoc config = JsonDoc::from_file(back + "/config.json");
    CHECK(config.root.at("architectures").as_array()[0].as_string() == "Qwen3MoeForCausalLM");
    REQUIRE(config.root.at("mlp_only_layers").as_array().size() == 1);
    CHECK(config.root.at("mlp_only_layers").as_array()[0].as_int64() == 0);
    SafetensorsFile weights = read_safetensors(back + "/model.safetensors");
    CHECK(weights.find("model.layers.0.mlp.gate_proj.weight") != nullptr);
    CHECK(weights.find("model.layers.0.mlp.gate.weight") == nullptr);
    CHECK(weights.find("model.layers.1.mlp.experts.3.down_proj.weight") != nullptr);
}

TEST_CASE("a tokenizer of fewer ids than the model's rows named by --tokenizer (Qwen3's tokenizer.json, or "
          "prepare.js's tokenizer.bin of it beside the shards it wrote) samples, with one line saying the rest are "
          "padding; one of more ids than the model's rows is refused in one line",
          "[hf][tokenizer]") {
    const std::string qwen = tokenizer_package("qwen3");
    if (qwen.empty()) return;
    TempDir t;
    const std::string data = t / "data";
    prepare_hello_world(qwen, data, 2000);  // Qwen3's ids, its <|im_end|> (151645) after the document
    const std::string flags = strfmt("-i '%s/train.bin' -j '%s/val.bin' -t 32 -b 2 -x 2 -v 0 -s 1 -g 8 -l 1e-3 --seed 3",
                                     data.c_str(), data.c_str());
    // Qwen3's 151936 rows (Hugging Face's config) for the tokenizer's 151669 ids, as Megatron-LM pads a vocab
    const std::string padding =
        "tokenizer: 151669 ids for the model's 151936 rows; ids 151669..151935 are padding no text holds\n";
    for (const std::string& tokenizer : {data + "/tokenizer.bin", qwen + "/tokenizer.json"}) {
        CommandResult r = single("-e q1c64h4g2d16f128t64v151936w --tokenizer '" + tokenizer + "' " + flags);
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(r.output.find("samples: decoded with " + tokenizer + ", starting from token 151645") != std::string::npos);
        size_t at = r.output.find(padding);
        CHECK(at != std::string::npos);
        CHECK(r.output.find(padding, at + 1) == std::string::npos);  // said once
        CHECK(r.output.find("\n---\n") != std::string::npos);        // a sample printed
    }
    // one id fewer in the model than in the tokenizer: a tokenizer of another model (on tokens below 301)
    Data small;
    CommandResult more = single(small.flags(2, 32, 2, "q1c64h4g2d16f128t64v151668w") + " -s 1 -g 8 --tokenizer '" + qwen +
                                "/tokenizer.json'");
    INFO(more.output);
    CHECK(more.status != 0);
    CHECK(lines_of(more.output).size() == 1);
    CHECK(more.output.find("the tokenizer's 151669 ids are more than the model's 151668 rows") != std::string::npos);
}

// the path the file system resolves `path` to
std::string real(const std::string& path) {
    char* p = realpath(path.c_str(), nullptr);
    REQUIRE(p != nullptr);
    std::string s = p;
    free(p);
    return s;
}

TEST_CASE("a checkpoint's manifest records -e as its absolute path: a run started with -e DIR relative to its "
          "directory converts from another directory with DIR's tokenizer files; an older manifest's relative -e "
          "still resumes, and converts where it is found, with a note where it is not",
          "[hf][checkpoint]") {
    TempDir t;
    Data data;
    char repo[4096];
    REQUIRE(getcwd(repo, sizeof(repo)) != nullptr);
    // run ./train_gpt (the repository's) from `dir`
    auto from = [&](const std::string& dir, const std::string& args) {
        return run_command(strfmt("cd '%s' && %s '%s/train_gpt' %s", dir.c_str(), RUN_ENV, repo, args.c_str()));
    };
    const std::string start = t / "start", hf = start + "/llama", ckpt = start + "/out/ckpt_00000002";
    REQUIRE(run_command("mkdir -p '" + start + "'").status == 0);
    GPTConfig c = parse_model_descriptor("l1c32h2g1t32v301");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 5);
    hf_save(c, params.data(), hf, "fp32");
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
        const std::string text = strfmt("{\"%s\": \"of the llama directory\"}\n", name);
        File(hf + "/" + name, "wb").write(text.data(), text.size());
    }
    CommandResult run = from(start, data.flags(1, 16, 2, "llama") + " -n 2 -o out");
    INFO(run.output);
    REQUIRE(run.status == 0);
    const std::string manifest = read_file(ckpt + "/manifest.txt");
    CHECK(manifest.find(" " + real(hf) + "\n") != std::string::npos);
    CHECK(manifest.find(" llama\n") == std::string::npos);

    // from the run's parent directory, where "llama" names nothing
    CommandResult conv = from(t.path, "--convert start/out/ckpt_00000002 --to back --format hf");
    INFO(conv.output);
    REQUIRE(conv.status == 0);
    CHECK(conv.output.find("no tokenizer files copied") == std::string::npos);
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        CHECK(read_file(t / "back/" + name) == read_file(hf + "/" + name));

    // a manifest written before model_source was absolute: -e as the run was given it
    std::string old = manifest;
    old.replace(old.find(" " + real(hf) + "\n"), real(hf).size() + 2, " llama\n");
    size_t own = old.rfind("\nmanifest fnv1a64=") + 1;
    Fnv1a64 sum;
    sum.update(old.data(), own);
    old.replace(own + strlen("manifest fnv1a64="), 16, strfmt("%016llx", (unsigned long long)sum.value));
    File(ckpt + "/manifest.txt", "wb").write(old.data(), old.size());
    CommandResult lost = from(t.path, "--convert start/out/ckpt_00000002 --to lost --format hf");
    INFO(lost.output);
    REQUIRE(lost.status == 0);
    CHECK(lost.output.find("note: no tokenizer files copied: the model came from llama, relative to where its run was "
                           "started, which is not found from " + real(t.path) + "\n") != std::string::npos);
    CHECK(file_exists(t / "lost/model.safetensors"));
    CHECK(!file_exists(t / "lost/tokenizer.json"));
    CommandResult found = from(start, "--convert out/ckpt_00000002 --to ../found --format hf");
    INFO(found.output);
    REQUIRE(found.status == 0);
    CHECK(read_file(t / "found/tokenizer.json") == read_file(hf + "/tokenizer.json"));
    // -y 1 from where the run started: the relative -e and the absolute one name the same model
    CommandResult resumed = from(start, data.flags(1, 16, 4, "llama") + " -n 2 -o out -y 1");
    INFO(resumed.output);
    CHECK(resumed.status == 0);
    CHECK(resumed.output.find("resumed from out/ckpt_00000002 at step 2") != std::string::npos);
}

}  // namespace test_hf

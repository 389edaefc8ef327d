// Resuming under another layout (llmc/checkpoint.h): a run saved on one layout of ranks continues on another with
// the losses of the single-rank run that was never interrupted; where the state of each rank lies in the whole
// model (share_runs); what a checkpoint that lacks part of the state says; and Llama 3's uint32 token shards
// through all of it.
#include "llmc/checkpoint.h"
#include "mpi_helpers.h"

namespace test_reshard {

const char* DENSE = "d2c32h4t32v301";   // 4 heads and T=16: tp 2 and cp 2 divide it
const char* MOE = "d2c48h4t32v301e4k2";
const char* LLAMA_WIDE = "l2c32h4g2f80t32v65801w";  // a vocab above 65,536: its ids need Llama 3's uint32 shards
const uint32_t WIDE_OFFSET = 65400;                // Data's ids 0..300 moved here straddle 65,535

// Data's learnable tokens in Llama 3's format, each id moved up by WIDE_OFFSET; resumed with steps of 64 tokens,
// as the classifier of 65,801 rows is most of a step's time on the CPU
struct WideData : Data {
    WideData() {
        resume_tokens = 64;
        Rng rng(99);
        for (auto [name, n] : {std::make_pair("train.bin", 6000), std::make_pair("val.bin", 1200)}) {
            std::vector<uint32_t> wide;
            for (uint16_t t : learnable_tokens(n, rng)) wide.push_back(WIDE_OFFSET + t);
            write_shard(dir / name, wide);
        }
    }
};

TEST_CASE("a run resumes under another layout with the losses of the uninterrupted single-rank run", "[reshard]") {
    Data data;
    TempDir out;
    std::map<std::string, double> reference = resume_reference_losses(data, DENSE, out / "reference");
    struct Case {
        ResumeLayout from, to;
    } cases[] = {
        {{1, "-b 4"}, {3, "-b 2 -z 2"}},                      // 1 rank -> dp 3 ZeRO-2
        {{2, "-b 2 -z 1"}, {4, "-b 1 -z 3"}},                 // dp 2 ZeRO-1 -> dp 4 ZeRO-3
        {{2, "-b 4 --tp 2"}, {2, "-b 2"}},                    // tp 2 -> dp 2
        {{2, "-b 2"}, {4, "-b 3 --tp 2"}},                    // dp 2 -> tp 2 x dp 2, another -b
        {{2, "-b 2 --pp 2 --pp-schedule 1f1b"}, {2, "-b 6 --tp 2"}},  // pp 2 -> tp 2
        {{2, "-b 2 --cp 2"}, {1, "-b 4"}},                    // cp 2 -> 1 rank
        {{4, "-b 2 --tp 2 -z 1"}, {4, "-b 1 --pp 2 -z 1 --pp-schedule afab"}},  // tp 2 x dp 2 -> pp 2 x dp 2
    };
    int k = 0;
    for (const Case& c : cases) check_resume(data, DENSE, c.from, c.to, reference, out / strfmt("case%d", k++));
}

TEST_CASE("a mixture of experts saved under ep 2 resumes on one rank, and the other way", "[reshard]") {
    Data data;
    TempDir out;
    std::map<std::string, double> reference = resume_reference_losses(data, MOE, out / "reference");
    check_resume(data, MOE, {2, "-b 2 --ep 2"}, {1, "-b 4"}, reference, out / "ep2_to_1");
    check_resume(data, MOE, {1, "-b 4"}, {4, "-b 1 --ep 2 -z 1"}, reference, out / "1_to_ep2_z1");
}

TEST_CASE("Llama 3's uint32 shards, ids above 65,535: train, resume and reshard as GPT-2's shards do", "[reshard]") {
    WideData data;
    TempDir out;
    std::map<std::string, double> reference = resume_reference_losses(data, LLAMA_WIDE, out / "reference");
    // one dp rank reading whole global batches, then two reading half of each: every layout's ranks read their
    // batches through the one loader that test_dataloader proves alike on both formats
    check_resume(data, LLAMA_WIDE, {2, "-b 2 --tp 2"}, {2, "-b 2 -z 1"}, reference, out / "tp_to_dp");
}

TEST_CASE("a token at or above the vocab, or a run's shards in two formats, stop train_gpt with one line",
          "[reshard]") {
    WideData data;
    const std::string bad = data.dir / "bad.bin", narrow = data.dir / "narrow.bin";
    Rng rng(5);
    std::vector<uint32_t> tokens(3000);
    for (auto& t : tokens) t = WIDE_OFFSET + (uint32_t)rng.below(301);
    tokens[2345] = 65801;  // the model's vocab; its padded one, 65920, would take it
    write_shard(bad, tokens);
    write_shard(narrow, random_tokens(3000, 301, rng));
    auto run = [&](const std::string& train, const std::string& val) {
        return single(strfmt("-e %s -i '%s' -j '%s' -t 16 -b 4 -d 64 -x 2 -v 10 -m 2 -s 0 -o '%s'", LLAMA_WIDE,
                             train.c_str(), val.c_str(), (data.dir / "out").c_str()));
    };
    check_one_line_error(run(bad, data.dir / "val.bin"),
                         {bad + ": token 65801 at position 2345 is out of range for vocab size 65801"});
    check_one_line_error(run(data.dir / "train.bin", narrow),
                         {data.dir / "train.bin", "Llama 3 (uint32 tokens)", narrow, "GPT-2 (uint16 tokens)"});
}

TEST_CASE("a checkpoint missing one rank's optimizer file is refused with one line; the one before resumes",
          "[reshard]") {
    Data data;
    TempDir out;
    std::map<std::string, double> reference = resume_reference_losses(data, DENSE, out / "reference");
    const std::string dir = out / "run";
    REQUIRE(train_ok(2, resume_run_flags(data, DENSE, RESUME_SAVED_AT, {2, "-b 2 -z 1"}) + " -n 2", dir));
    REQUIRE(list_checkpoints(dir) == std::vector<int>{2, 4});
    REQUIRE(unlink((dir + "/ckpt_00000004/optimizer_rank1.bin").c_str()) == 0);
    std::string output;
    REQUIRE(train_ok(1, resume_run_flags(data, DENSE, RESUME_STEPS, {1, "-b 4"}) + " -n 2 -y 1", dir, &output));
    std::string newest = dir + "/ckpt_00000004";
    std::vector<std::string> said;
    for (const std::string& line : lines_of(output))
        if (line.find(newest + " fails verification") != std::string::npos) said.push_back(line);
    REQUIRE(said.size() == 1);
    CHECK(said[0] == "checkpoint " + newest + " fails verification, skipped and kept as " + newest + ".unverified: " +
                         newest + "/optimizer_rank1.bin: missing (the manifest lists it)");
    CHECK(output.find("resumed from " + dir + "/ckpt_00000002 at step 2") != std::string::npos);
    check_close(losses(dir), reference, 1e-5, RESUME_STEPS + 3);
}

TEST_CASE("the tp and ep shares of the model cover it: each tensor once per rank that holds it whole (dense and "
          "sparse layers mixed too)",
          "[reshard]") {
    for (const char* model : {"d3c48h4t32v301", "d1c48h4t32v301", "d3c48h4t32v301e4k2", "d3c48h4t32v301e4k2x40n1s2",
                              "q3c48h4d16f88t32v301e4k2x40n1s2"}) {
        GPTConfig c = parse_model_descriptor(model);
        for (int tp : {1, 2, 4})
            for (int ep : {1, 2, 4}) {
                if (ep > 1 && !c.moe()) continue;
                INFO(model << " tp " << tp << " ep " << ep);
                std::vector<int> times(num_parameters(c), 0);
                for (int t = 0; t < tp; t++)
                    for (int e = 0; e < ep; e++) {
                        std::vector<ShareRun> runs = share_runs(c, ShareSpec{tp, t, ep, e}, whole_part(c));
                        size_t local = 0;
                        for (const ShareRun& r : runs) {
                            CHECK(r.local >= local);  // in the share's order, never overlapping
                            local = r.local + r.count;
                            // a run stays inside one block of one tensor
                            ParamCoord first = param_coord(c, r.whole), last = param_coord(c, r.whole + r.count - 1);
                            CHECK(first.tensor == last.tensor);
                            CHECK(first.layer == last.layer);
                            CHECK(first.expert == last.expert);
                            CHECK(param_offset(c, first) == r.whole);
                            for (size_t i = r.whole; i < r.whole + r.count; i++) times[i]++;
                        }
                        CHECK(local <= num_parameters(c, tp, whole_part(c), ep));
                    }
                // an element is held by every tp rank of a replicated tensor, by one otherwise (wte's padded rows
                // too); by one ep rank of an expert tensor, by every ep rank otherwise
                size_t wrong = 0;
                for (size_t i = 0; i < times.size(); i++) {
                    ParamCoord p = param_coord(c, i);
                    const TensorSpec spec = model_table(c)[p.tensor];
                    int want = (spec.split == TPSplit::Replicated ? tp : 1) * (c.moe() && spec.expert ? 1 : ep);
                    wrong += times[i] != want;
                }
                CHECK(wrong == 0);
            }
    }
}

TEST_CASE("a checkpoint whose optimizer files lack part of the model is refused, naming the tensor", "[reshard]") {
    TempDir out;
    GPTConfig c = parse_model_descriptor("d2c32h4t32v301");
    GPT m;
    gpt_allocate(m, c, 1, 16);
    Rng rng(3);
    gpt_init_random(c, m.params, 3);
    for (size_t i = 0; i < m.num_parameters; i++) m.adam_m[i] = rng.normal(0.0f, 0.01f), m.adam_v[i] = rng.uniform();
    Comm solo;
    RunLayout layout{1, 16, 1, 16};
    ModelState whole = model_state(m), partial = whole;
    partial.optimizer_runs.pop_back();  // the file will lack the last run: lnfb
    REQUIRE(save_checkpoint(out.path, partial, TrainState{1}, layout, RunInputs{}, 0, solo));
    GPT loaded;
    gpt_allocate(loaded, c, 1, 16);
    TrainState s;
    CHECK_THROWS_WITH(load_checkpoint(out / "ckpt_00000001", model_state(loaded), s),
                      Catch::Contains("no optimizer file holds the state of lnfb, element 0"));
    // what it holds loads into a model that keeps only that much
    ModelState fewer = model_state(loaded);
    fewer.optimizer_runs.pop_back();
    CHECK_NOTHROW(load_checkpoint(out / "ckpt_00000001", fewer, s));
    CHECK(memcmp(loaded.adam_m, m.adam_m, (m.num_parameters - c.channels) * 4) == 0);
    CHECK(memcmp(loaded.params, m.params, m.num_parameters * 4) == 0);
}

TEST_CASE("--convert writes a checkpoint's model as an llm.c fp32 or bf16 file, never over an existing one",
          "[reshard]") {
    Data data;
    TempDir out;
    const std::string dir = out / "run";
    REQUIRE(train_ok(2, resume_run_flags(data, DENSE, RESUME_SAVED_AT, {2, "-b 2 -z 1"}) + " -n 4", dir));
    const std::string ckpt = dir + "/ckpt_00000004", fp32 = out / "model_fp32.bin", bf16 = out / "model_bf16.bin";
    CommandResult r = single("--convert '" + ckpt + "/' --to '" + fp32 + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(read_file(fp32) == read_file(ckpt + "/model.bin"));
    r = single("--convert '" + ckpt + "' --to '" + bf16 + "' --dtype bf16");
    REQUIRE(r.status == 0);
    CHECK(r.output.find("as an llm.c bf16 file (version 5)") != std::string::npos);

    // the bf16 file: llm.c's header with version 5, and every parameter rounded to nearest even by CUDA's rounding
    GPTConfig c = checkpoint_config(ckpt);
    std::string bytes = read_file(bf16), whole = read_file(fp32);
    REQUIRE(bytes.size() == 1024 + 2 * num_parameters(c));
    int header[256];
    memcpy(header, bytes.data(), sizeof(header));
    CHECK(header[0] == 20240326);
    CHECK(header[1] == 5);
    CHECK(memcmp(header + 2, whole.data() + 8, 1016) == 0);
    size_t differ = 0;
    for (size_t i = 0; i < num_parameters(c); i++) {
        float x;
        memcpy(&x, whole.data() + 1024 + 4 * i, 4);
        __nv_bfloat16 want = __float2bfloat16_rn(x);
        differ += memcmp(&want, bytes.data() + 1024 + 2 * i, 2) != 0;
    }
    CHECK(differ == 0);
    // and a run starts from it
    std::string started;
    CHECK(single_ok(resume_run_flags(data, ("'" + bf16 + "'").c_str(), 1, {1, "-b 4"}), out / "from_bf16", &started));

    // refused, one line each: an existing --to, a directory that is not a checkpoint, a damaged checkpoint
    check_one_line_error(single("--convert '" + ckpt + "' --to '" + fp32 + "'"), {"--to " + fp32, "already exists"});
    check_one_line_error(single("--convert '" + dir + "' --to '" + (out / "x.bin") + "'"),
                         {"neither a model file, a Hugging Face directory nor a checkpoint directory"});
    {
        std::string model = read_file(ckpt + "/model.bin");
        model[2000] ^= 1;
        File f(ckpt + "/model.bin", "wb");
        f.write(model.data(), model.size());
        f.close();
    }
    check_one_line_error(single("--convert '" + ckpt + "' --to '" + (out / "y.bin") + "'"), {"model.bin: checksum"});
    CHECK(!file_exists(out / "y.bin"));
}

}  // namespace test_reshard

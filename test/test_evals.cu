// Tests of the multiple-choice eval (--eval, llmc/evals.h): a synthetic file in llm.c's format scored by
// train_gpt equals test/reference/eval_reference.py's independent PyTorch scoring of the same model and file,
// example by example, with the labels planted where that scoring's loss is lowest (for two examples in three)
// so the accuracy is known; every layout gives the same accuracy; and a damaged file is refused in one line.
#include <functional>

#include "llmc/evals.h"
#include "mpi_helpers.h"

namespace test_evals {

struct Example {
    int label;
    std::vector<int> context;
    std::vector<std::vector<int>> completions;
};

// llm.c's dev/data/data_common.py write_evalfile, written out here on its own: Word uint16_t, version 1 (llm.c's);
// Word uint32_t, version 2 (the same stream in uint32 words, for vocabularies above 65,535)
template <typename Word = uint16_t>
void write_eval_file(const std::string& path, const std::vector<Example>& examples) {
    const Word start = (Word)~Word(0);
    std::vector<Word> stream;
    int longest = 0;
    for (size_t i = 0; i < examples.size(); i++) {
        const Example& e = examples[i];
        std::vector<Word> s{start, 0, (Word)i, (Word)e.label, (Word)e.completions.size(), (Word)e.context.size()};
        s.insert(s.end(), e.context.begin(), e.context.end());
        for (const std::vector<int>& c : e.completions) {
            s.push_back((Word)c.size());
            s.insert(s.end(), c.begin(), c.end());
        }
        s[1] = (Word)(sizeof(Word) * s.size());
        longest = std::max(longest, (int)s[1]);
        stream.insert(stream.end(), s.begin(), s.end());
    }
    int32_t header[256] = {20240522, sizeof(Word) == 2 ? 1 : 2, (int32_t)examples.size(), longest};
    File f(path, "wb");
    f.write(header, sizeof(header));
    f.write(stream.data(), stream.size() * sizeof(Word));
    f.close();
}

// random contexts of 1 to 6 tokens, 2 to 5 completions of 1 to 4 tokens (rows of at most 9 tokens), label 0
std::vector<Example> random_examples(int n, int vocab, Rng& rng) {
    std::vector<Example> examples(n);
    for (Example& e : examples) {
        e.label = 0;
        e.context.resize(1 + rng.below(6));
        for (int& t : e.context) t = (int)rng.below(vocab);
        e.completions.resize(2 + rng.below(4));
        for (std::vector<int>& c : e.completions) {
            c.resize(1 + rng.below(4));
            for (int& t : c) t = (int)rng.below(vocab);
        }
    }
    return examples;
}

// "INDEX LABEL ANSWER LOSS..." lines and the "accuracy C/N" line, as eval_reference.py and --debug-eval-scores
// write them
struct Scores {
    std::vector<int> labels, answers;
    std::vector<std::vector<double>> losses;
    std::string accuracy;
};
Scores parse_scores(const std::string& text) {
    Scores s;
    for (const std::string& line : lines_of(text)) {
        if (line.rfind("accuracy ", 0) == 0) {
            s.accuracy = line.substr(9);
            continue;
        }
        std::istringstream in(line);
        int index, label, answer;
        REQUIRE((in >> index >> label >> answer));
        REQUIRE(index == (int)s.labels.size());
        s.labels.push_back(label), s.answers.push_back(answer);
        s.losses.emplace_back();
        for (double loss; in >> loss;) s.losses.back().push_back(loss);
    }
    return s;
}

Scores reference_scores(const std::string& hf_dir, const std::string& eval) {
    std::string python = reference_python();
    CommandResult r = run_command(strfmt("%s test/reference/eval_reference.py --hf '%s' --eval '%s'", python.c_str(),
                                         hf_dir.c_str(), eval.c_str()));
    if (r.status != 0) REQUIRE_PYTHON_MODULES(python, "numpy", "torch");  // asked only on a failure: torch loads slowly
    INFO(r.output);
    REQUIRE(r.status == 0);
    return parse_scores(r.output);
}

// the same answers, and each completion's mean loss within tol (relative)
void check_same_scores(const Scores& got, const Scores& want, double tol) {
    REQUIRE(got.answers.size() == want.answers.size());
    CHECK(got.accuracy == want.accuracy);
    for (size_t i = 0; i < want.answers.size(); i++) {
        INFO("example " << i);
        CHECK(got.labels[i] == want.labels[i]);
        CHECK(got.answers[i] == want.answers[i]);
        REQUIRE(got.losses[i].size() == want.losses[i].size());
        for (size_t c = 0; c < want.losses[i].size(); c++) CHECK(rel_close(got.losses[i][c], want.losses[i][c], tol));
    }
}

// A model file of `descriptor`'s shape, and its Hugging Face export for eval_reference.py: the model after one
// step of training on the CPU (from a checkpoint, which is where a descriptor's model is first written)
std::pair<std::string, std::string> trained_model(const Data& data, const TempDir& dir, const std::string& descriptor) {
    std::string start = dir / "start", model = dir / "model.bin", hf = dir / "model_hf";
    REQUIRE(single_ok("--device cpu " + data.flags(4, 64, 1, descriptor) + " -n 1", start));
    REQUIRE(single(strfmt("--convert '%s/ckpt_00000001' --to '%s'", start.c_str(), model.c_str())).status == 0);
    REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", model.c_str(), hf.c_str())).status == 0);
    return {model, hf};
}

TEST_CASE("an eval file is scored as PyTorch scores it, example by example, with the same accuracy on one rank and "
          "under dp 2 (ZeRO-3), tp 2, cp 2, pp 2 and DualPipeV's pp 2 (the classifier on rank 0)",
          "[evals]") {
    Data data;
    TempDir dir;
    // the PyTorch reference GPT-2 and Llama (maxT 29: rows of -t 16), and a GPT-2 of maxT 128 scored with -t 128,
    // whose rows are cut to 64 tokens: that one runs on every layout
    auto [made, made_hf] = trained_model(data, dir, "d4c48h4t128v301");
    struct Model {
        std::string name, file, hf;
        int T;
    };
    std::vector<Model> models{{"reference", "build/reference/model.bin", dir / "reference_hf", 16},
                              {"reference_llama_gqa", "build/reference_llama_gqa/model.bin", dir / "llama_hf", 16},
                              {"trained", made, made_hf, 128}};
    for (const Model& m : models) {
        INFO(m.name);
        if (m.hf != made_hf)
            REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", m.file.c_str(), m.hf.c_str())).status == 0);
        // 13 examples: dp ranks get 7 and 6, with other numbers of rows
        Rng rng(31 + m.T + m.name.size());
        std::vector<Example> examples = random_examples(13, 301, rng);
        std::string eval = dir / (m.name + ".bin");
        write_eval_file(eval, examples);
        // the label where the reference's loss is lowest for two examples in three, the next completion else
        Scores first = reference_scores(m.hf, eval);
        REQUIRE(first.answers.size() == examples.size());
        int planted = 0;
        for (size_t i = 0; i < examples.size(); i++) {
            std::vector<double> sorted = first.losses[i];
            std::sort(sorted.begin(), sorted.end());
            REQUIRE(sorted[1] - sorted[0] > 1e-5);  // no answer that rounding could flip
            int n = (int)examples[i].completions.size();
            examples[i].label = i % 3 ? first.answers[i] : (first.answers[i] + 1) % n;
            planted += i % 3 != 0;
        }
        write_eval_file(eval, examples);
        Scores want = reference_scores(m.hf, eval);
        REQUIRE(want.accuracy == strfmt("%d/13", planted));

        auto flags = [&](const std::string& scores) {
            return data.flags(4, 4 * m.T * 2, 0, "'" + m.file + "'") +
                   strfmt(" -t %d -v 1 --eval '%s' --debug-eval-scores '%s'", m.T, eval.c_str(), scores.c_str());
        };
        std::string out = dir / (m.name + "_1"), scores = out + ".txt", output;
        REQUIRE(single_ok(flags(scores), out, &output));
        std::string line = strfmt("eval: %d/13 = %.4f (%s, ", planted, planted / 13.0, eval.c_str());
        CHECK(output.find(line) != std::string::npos);
        CHECK(read_file(out + "/main.log").find(strfmt("s:0 eval:%.4f\n", planted / 13.0)) != std::string::npos);
        Scores one = parse_scores(read_file(scores));
        check_same_scores(one, want, 1e-5);
        if (m.file != made) continue;  // the layouts once

        struct Layout {
            const char* name;
            std::string flags;
        };
        for (const Layout& l : {Layout{"dp2", "-b 2 -z 3"}, Layout{"tp2", "--tp 2"}, Layout{"cp2", "--cp 2"},
                                Layout{"pp2", "--pp 2"}, Layout{"pp2_dualpipev", "-b 2 --pp 2 --pp-schedule dualpipev"}}) {
            INFO(l.name);
            std::string run = dir / l.name, run_scores = run + ".txt";
            if (!train_ok(2, flags(run_scores) + " " + l.flags, run, &output)) continue;
            CHECK(output.find(strfmt("eval: %d/13 = ", planted)) != std::string::npos);
            check_same_scores(parse_scores(read_file(run_scores)), one, 1e-5);
        }
    }
}

// The GPU runs the eval through the same forward, in bf16: the scores agree with PyTorch's within bf16's
// rounding, and so do the answers wherever the reference's two lowest losses are further apart than that. The
// model has the GPU kernels' head size of 64; its rows are cut from -t 128 to 64 tokens.
TEST_CASE("on the GPU, an eval file is scored as PyTorch scores it, within bf16's precision", "[evals][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    Data data;
    TempDir dir;
    auto [model, hf] = trained_model(data, dir, "d2c128h2t128v1000");
    Rng rng(33);
    std::vector<Example> examples = random_examples(24, 1000, rng);
    std::string eval = dir / "eval.bin", scores = dir / "scores.txt";
    write_eval_file(eval, examples);
    Scores want = reference_scores(hf, eval);
    REQUIRE(single_ok("--device cuda " + data.flags(4, 512, 0, "'" + model + "'") +
                          strfmt(" -t 128 -v 1 --eval '%s' --debug-eval-scores '%s'", eval.c_str(), scores.c_str()),
                      dir / "gpu"));
    Scores got = parse_scores(read_file(scores));
    REQUIRE(got.answers.size() == want.answers.size());
    int compared = 0;
    for (size_t i = 0; i < want.answers.size(); i++) {
        INFO("example " << i);
        for (size_t c = 0; c < want.losses[i].size(); c++) CHECK(rel_close(got.losses[i][c], want.losses[i][c], 2e-2));
        std::vector<double> sorted = want.losses[i];
        std::sort(sorted.begin(), sorted.end());
        if (sorted[1] - sorted[0] < 0.1) continue;
        CHECK(got.answers[i] == want.answers[i]);
        compared++;
    }
    CHECK(compared >= 6);
}

TEST_CASE("a damaged eval file, or one that does not fit the model, is refused in one line naming the file",
          "[evals]") {
    TempDir dir;
    Rng rng(5);
    std::vector<Example> examples = random_examples(4, 301, rng);
    std::string good = dir / "good.bin";
    write_eval_file(good, examples);
    std::string bytes = read_file(good);
    EvalSet set = read_eval_file(good, 301, 16);
    CHECK(set.examples.size() == 4);
    CHECK(set.examples[2].context == examples[2].context);
    CHECK(set.examples[3].completions == examples[3].completions);
    // the rows are as long as the longest completion needs, in the layout's unit, at most -t
    int longest = 0;
    for (const Example& e : examples)
        for (const std::vector<int>& c : e.completions)
            longest = std::max(longest, (int)(e.context.size() + c.size()) - 1);
    CHECK(set.longest_row == longest);
    CHECK(set.row_tokens(128, 64) == 64);
    CHECK(set.row_tokens(16, 64) == 16);
    CHECK(set.row_tokens(1024, 4) == (longest + 3) / 4 * 4);

    // a copy of the good file with `edit` applied to its bytes, read with the vocab and T given
    auto refused = [&](const std::string& name, std::function<void(std::string&)> edit, const std::string& words,
                       int vocab = 301, int T = 16) {
        INFO(name);
        std::string changed = bytes, path = dir / (name + ".bin");
        edit(changed);
        File f(path, "wb");
        f.write(changed.data(), changed.size());
        f.close();
        CHECK_THROWS_WITH(read_eval_file(path, vocab, T), Catch::Contains(path) && Catch::Contains(words));
    };
    auto word = [](std::string& b, size_t i, uint16_t v) { memcpy(&b[1024 + 2 * i], &v, 2); };
    // the word the second example starts at: after the first one's six fields, context and completions
    size_t second = 6 + examples[0].context.size();
    for (const auto& c : examples[0].completions) second += 1 + c.size();
    refused("short", [](std::string& b) { b.resize(1000); }, "too short for an eval file's header");
    refused("magic", [](std::string& b) { b[0] ^= 1; }, "not an eval file's 20240522");
    refused("truncated", [](std::string& b) { b.resize(b.size() - 2); }, "which the file cannot hold");
    refused("trailing", [](std::string& b) { b += std::string(2, '\0'); }, "bytes after the last of the 4 examples");
    refused("delimiter", [&](std::string& b) { word(b, second, 7); }, "example 1 (word");
    refused("index", [&](std::string& b) { word(b, second + 2, 3); }, "its index is 3");
    refused("label", [&](std::string& b) { word(b, second + 3, 9); }, "label 9 of");
    refused("longest", [](std::string& b) { b[12] ^= 2; }, "the longest example has");
    refused("vocab", [](std::string&) {}, "outside the model's vocab of 100", 100);
    refused("too long for -t", [](std::string&) {}, "more than -t 4", 301, 4);

    // and train_gpt says so in one line
    Data data;
    std::string damaged = dir / "magic.bin";
    check_one_line_error(single(data.flags(4, 64, 1) + " -v 1 --eval '" + damaged + "'"), {damaged, "20240522"});
    check_one_line_error(single(data.flags(4, 64, 1) + " -v 0 --eval '" + good + "'"), {"--eval", "-v 0"});
}

TEST_CASE("version 2 of the eval file (uint32 words, for vocabularies above 65,535) reads as version 1 does, "
          "and carries token ids above 65,535",
          "[evals]") {
    TempDir dir;
    Rng rng(8);
    std::vector<Example> examples = random_examples(5, 301, rng);
    write_eval_file<uint16_t>(dir / "v1.bin", examples);
    write_eval_file<uint32_t>(dir / "v2.bin", examples);
    EvalSet v1 = read_eval_file(dir / "v1.bin", 301, 16), v2 = read_eval_file(dir / "v2.bin", 301, 16);
    REQUIRE(v2.examples.size() == examples.size());
    for (size_t i = 0; i < examples.size(); i++) {
        CHECK(v2.examples[i].label == v1.examples[i].label);
        CHECK(v2.examples[i].context == examples[i].context);
        CHECK(v2.examples[i].completions == examples[i].completions);
    }
    CHECK(v2.rows == v1.rows);
    CHECK(v2.longest_row == v1.longest_row);
    CHECK(v2.first_row == v1.first_row);

    // Llama 3's ids: the file holds them whole (a uint16 reading would keep their low bits)
    std::vector<Example> wide = random_examples(3, 128256, rng);
    wide[1].context[0] = 128255, wide[2].completions[1][0] = 65536;
    write_eval_file<uint32_t>(dir / "llama.bin", wide);
    EvalSet llama = read_eval_file(dir / "llama.bin", 128256, 16);
    for (size_t i = 0; i < wide.size(); i++) {
        CHECK(llama.examples[i].context == wide[i].context);
        CHECK(llama.examples[i].completions == wide[i].completions);
    }
    CHECK_THROWS_WITH(read_eval_file(dir / "llama.bin", 128000, 16),
                      Catch::Contains("llama.bin") && Catch::Contains("outside the model's vocab of 128000"));
    // a version-1 stream under a version-2 header: its first word is not version 2's delimiter
    std::string v1_as_v2 = read_file(dir / "v1.bin");
    v1_as_v2[4] = 2;
    {
        File f(dir / "mixed.bin", "wb");
        f.write(v1_as_v2.data(), v1_as_v2.size());
    }
    CHECK_THROWS_WITH(read_eval_file(dir / "mixed.bin", 301, 16), Catch::Contains("mixed.bin"));
}

}  // namespace test_evals

// Tests of train_gpt's command line, run as a separate process from the repo root: every bad flag value, model
// file, token shard and tokenizer must stop the run with exit status 1 and exactly one line of output,
// "train_gpt: <message>", naming the flag or file and saying what is wrong with it. Positive controls (a tiny
// valid run, model files in both llm.c formats, sampling, --help, main.log) show that the bad inputs fail for
// their own reason and not because the base command is broken. Each run uses a tiny model, so the whole file
// takes a few seconds.
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "llmc/options.h"
#include "test_helpers.h"

namespace test_cli {

// llm.c's file formats, written out here from their documentation rather than taken from the headers under
// test, so that a changed constant there shows up as a failure here
constexpr int32_t MODEL_FILE_MAGIC = 20240326;
constexpr int32_t SHARD_FILE_MAGIC = 20240520;
constexpr uint32_t TOKENIZER_FILE_MAGIC = 20240328;

// the tiny model every run uses: d1c16h2t32v300, B=2, T=8
constexpr int TINY_V = 300;

// ---------------------------------------------------------------------------------------------------------
// running train_gpt

std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

std::string joined(const std::vector<std::string>& args) {
    std::string s;
    for (const std::string& a : args) s += " " + shell_quote(a);
    return s;
}

void require_train_gpt() {
    INFO("./train_gpt not found: build it with `make train_gpt` (`make test` does) and run the tests from the "
         "repo root");
    REQUIRE(file_exists("./train_gpt"));
}

// runs ./train_gpt with the arguments, stdout and stderr together; `timeout` turns a hang into status 124
CommandResult train_gpt(const std::vector<std::string>& args) {
    require_train_gpt();
    return run_command("timeout 60 ./train_gpt" + joined(args));
}

std::vector<std::string> lines_of(const std::string& s) {
    std::vector<std::string> lines;
    std::istringstream in(s);
    std::string line;
    while (std::getline(in, line)) lines.push_back(line);
    return lines;
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// whether `word` occurs in s as a whole token: not glued to letters, digits, '_' or '-' on either side
// (so "-n" is not found inside "-nk", nor "1" inside "10")
bool mentions(const std::string& s, const std::string& word) {
    auto glue = [](char c) { return isalnum((unsigned char)c) || c == '_' || c == '-'; };
    for (size_t at = s.find(word); at != std::string::npos; at = s.find(word, at + 1)) {
        bool left = at == 0 || !glue(s[at - 1]);
        bool right = at + word.size() == s.size() || !glue(s[at + word.size()]);
        if (left && right) return true;
    }
    return false;
}

std::string lower(std::string s) {
    for (char& c : s) c = (char)tolower((unsigned char)c);
    return s;
}

// The contract for a bad input: exit status 1 (not a crash, which run_command reports as 128+signal, nor a
// timeout's 124), and the whole output is one line, "train_gpt: ...", that mentions every string in `names`
// and at least one of `reasons` (case-insensitive).
void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& names,
                  const std::vector<std::string>& reasons) {
    CommandResult r = train_gpt(args);
    INFO("command: ./train_gpt" << joined(args));
    INFO("exit status " << r.status << ", output:\n" << r.output);
    CHECK(r.status < 128);
    CHECK(r.status == 1);
    std::vector<std::string> lines = lines_of(r.output);
    CHECK(lines.size() == 1);
    // the checks below look at the error line wherever it is, so that they say something useful on their own
    std::string error;
    int error_lines = 0;
    for (const std::string& line : lines)
        if (line.rfind("train_gpt: ", 0) == 0) error = line, error_lines++;
    CHECK(error_lines == 1);
    if (error_lines != 1) return;
    for (const std::string& name : names) {
        INFO("the message should mention " << shell_quote(name));
        CHECK(mentions(error, name));
    }
    bool has_reason = false;
    for (const std::string& reason : reasons) has_reason = has_reason || lower(error).find(lower(reason)) != std::string::npos;
    std::string wanted;
    for (const std::string& reason : reasons) wanted += " " + shell_quote(reason);
    INFO("the message should give a reason, one of:" << wanted);
    CHECK(has_reason);
}

// ---------------------------------------------------------------------------------------------------------
// input files, each writable with one thing wrong

std::vector<uint16_t> random_tokens(size_t n, uint64_t seed, int vocab = TINY_V) {
    Rng rng(seed);
    return random_tokens(n, vocab, rng);
}

struct ModelShape {
    int L = 1, C = 16, NH = 2, maxT = 32, V = TINY_V;
    int Vp() const { return (V + 127) / 128 * 128; }
    // llm.c's layout: wte, wpe, then per layer 12C² weights and 13C biases and layernorm parameters, then lnf
    size_t parameters() const {
        size_t c = C;
        return (size_t)Vp() * c + (size_t)maxT * c + (size_t)L * (12 * c * c + 13 * c) + 2 * c;
    }
};

// an llm.c model file: 256 int32 header, then the parameters in fp32 (version 3) or bf16 (version 5);
// body_delta adds (or with a negative value removes) bytes at the end
void write_model(const std::string& path, const ModelShape& s, int32_t version = 3, int32_t magic = MODEL_FILE_MAGIC,
                 long body_delta = 0) {
    int32_t header[256] = {};
    header[0] = magic;
    header[1] = version;
    header[2] = s.maxT;
    header[3] = s.V;
    header[4] = s.L;
    header[5] = s.NH;
    header[6] = s.C;
    header[7] = s.Vp();
    Rng rng(7);
    std::vector<float> params(s.parameters());
    for (float& p : params) p = rng.normal(0.0f, 0.02f);
    std::string body;
    if (version == 5) {
        for (float p : params) {
            uint32_t bits;
            memcpy(&bits, &p, 4);
            uint16_t top = (uint16_t)(bits >> 16);
            body.append((const char*)&top, 2);
        }
    } else {
        body.assign((const char*)params.data(), params.size() * 4);
    }
    if (body_delta > 0) body.append((size_t)body_delta, '\0');
    if (body_delta < 0) body.resize(body.size() - (size_t)-body_delta);
    File f(path, "wb");
    f.write(header, sizeof(header));
    f.write(body.data(), body.size());
    f.close();
}

// an llm.c tokenizer file (version 2): 256 uint32 header, then per token a length byte and its bytes
void write_tokenizer(const std::string& path, int vocab, uint32_t magic = TOKENIZER_FILE_MAGIC) {
    uint32_t header[256] = {};
    header[0] = magic;
    header[1] = 2;
    header[2] = (uint32_t)vocab;
    header[3] = (uint32_t)(vocab - 1);  // EOT
    std::string body;
    for (int i = 0; i < vocab; i++) {
        std::string tok = i < 26 ? std::string(1, (char)('a' + i)) : strfmt(" w%d", i);
        body += (char)tok.size();
        body += tok;
    }
    File f(path, "wb");
    f.write(header, sizeof(header));
    f.write(body.data(), body.size());
    f.close();
}

// a scratch directory with a valid shard and tokenizer for the tiny model, and the arguments of a valid,
// quick run using them; each bad case appends its flags (a later flag overrides an earlier one)
struct TinyRun {
    TempDir dir;
    std::string shard = dir / "shard.bin";
    std::string tokenizer = dir / "tok300.bin";
    TinyRun() {
        write_shard(shard, random_tokens(200, 1));
        write_tokenizer(tokenizer, TINY_V);
    }
    std::vector<std::string> base() const {
        return {"-e", "d1c16h2t32v300", "-i", shard, "-j", shard, "-b", "2", "-t", "8", "-x", "3", "-v", "0", "-s", "0"};
    }
};

int count_matching(const std::vector<std::string>& lines, const std::regex& re) {
    int n = 0;
    for (const std::string& line : lines) n += std::regex_search(line, re) ? 1 : 0;
    return n;
}

// ---------------------------------------------------------------------------------------------------------
// positive controls

TEST_CASE("train_gpt --help and -h print the usage and exit 0", "[cli]") {
    for (const char* flag : {"--help", "-h"}) {
        CommandResult r = train_gpt({flag});
        INFO(flag << ": exit status " << r.status << ", output:\n" << r.output);
        CHECK(r.status == 0);
        CHECK(r.output.find("usage: train_gpt") != std::string::npos);
        CHECK(r.output.find("-e MODEL") != std::string::npos);
    }
}

TEST_CASE("--help lists every flag parse_options accepts, each with its default, in groups, and names its page of docs/",
          "[cli]") {
    // the flags as parse_options spells them: every string literal in its body that is a flag and nothing else
    std::ifstream source("llmc/options.h");
    REQUIRE(source.good());
    std::string text((std::istreambuf_iterator<char>(source)), std::istreambuf_iterator<char>());
    size_t body = text.find("inline Options parse_options(");
    REQUIRE(body != std::string::npos);
    std::set<std::string> flags;
    const std::regex literal("\"(--?[a-z][a-z-]*)\"");
    for (std::sregex_iterator it(text.begin() + body, text.end(), literal), end; it != end; ++it)
        flags.insert((*it)[1]);
    REQUIRE(flags.size() > 40);
    REQUIRE(flags.count("--plan") == 1);

    CommandResult r = train_gpt({"--help"});
    REQUIRE(r.status == 0);
    std::vector<std::string> lines = lines_of(r.output);
    // an entry is a line that starts "  -" and the more indented lines that continue it
    std::vector<std::string> entries;
    for (const std::string& line : lines) {
        if (line.rfind("  -", 0) == 0) entries.push_back(line);
        else if (line.rfind("      ", 0) == 0 && !entries.empty()) entries.back() += line;
    }
    for (const std::string& flag : flags) {
        INFO("flag " << flag);
        const std::regex named("(^|[ ,])" + flag + "([ ,]|$)");
        int found = 0;
        for (const std::string& entry : entries) {
            std::string head = entry.substr(0, entry.find("  ", 2));  // the flag column, before the description
            if (!std::regex_search(head, named)) continue;
            found++;
            INFO(entry);
            if (flag != "-h" && flag != "--help") CHECK(std::regex_search(entry, std::regex(R"(\[[^\]]+\]\s*$)")));
        }
        CHECK(found == 1);
    }
    // the experts' defaults it states are Options' own, where they are written once
    const Options defaults;
    for (auto [flag, value] : {std::make_pair("--moe-aux", defaults.moe_aux),
                               std::make_pair("--moe-bias-rate", defaults.moe_bias_rate)})
        for (const std::string& entry : entries)
            if (entry.rfind(strfmt("  %s ", flag), 0) == 0) {
                INFO(entry);
                CHECK(entry.substr(entry.rfind('[')) == strfmt("[%g]", value));
            }
    for (const char* group : {"data:", "model:", "optimization:", "evaluation and output:", "checkpoints:",
                              "parallelism", "planning and debugging:"})
        CHECK(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.rfind(group, 0) == 0; }) == 1);
    // the page it points to exists, under the title it gives
    CHECK(r.output.find("docs/usage.md, \"Using train_gpt\"") != std::string::npos);
    std::ifstream usage("docs/usage.md");
    std::string usage_text((std::istreambuf_iterator<char>(usage)), std::istreambuf_iterator<char>());
    CHECK(usage_text.rfind("# Using train_gpt\n", 0) == 0);
}

TEST_CASE("a valid tiny run exits 0 and prints one line per step", "[cli]") {
    TinyRun run;
    for (const std::vector<std::string>& extra : {std::vector<std::string>{}, {"--device", "cpu"}}) {
        CommandResult r = train_gpt(run.base() + extra);
        INFO("command: ./train_gpt" << joined(run.base() + extra));
        INFO("exit status " << r.status << ", output:\n" << r.output);
        REQUIRE(r.status == 0);
        std::vector<std::string> lines = lines_of(r.output);
        CHECK(count_matching(lines, std::regex(R"(^step\s+\d+/3 )")) == 3);
        for (int s = 1; s <= 3; s++) CHECK(count_matching(lines, std::regex(strfmt(R"(^step\s+%d/3 \| loss \d+\.\d+)", s))) == 1);
        CHECK(r.output.find("train_gpt: ") == std::string::npos);
    }
}

TEST_CASE("-o DIR writes DIR/main.log with one trl line per step and tel lines when validating", "[cli]") {
    TinyRun run;
    const std::regex trl(R"(^s:(\d+) trl:\d+\.\d{6} )"), tel(R"(^s:(\d+) tel:\d+\.\d{6}$)");

    SECTION("-v 0: training lines only") {
        std::string out = run.dir / "out_v0";
        CommandResult r = train_gpt(run.base() + std::vector<std::string>{"-o", out});
        INFO("exit status " << r.status << ", output:\n" << r.output);
        REQUIRE(r.status == 0);
        REQUIRE(file_exists(out + "/main.log"));
        std::ifstream in(out + "/main.log");
        std::stringstream ss;
        ss << in.rdbuf();
        std::vector<std::string> lines = lines_of(ss.str());
        INFO("main.log:\n" << ss.str());
        REQUIRE(lines.size() == 3);
        for (int s = 0; s < 3; s++) {
            std::smatch m;
            INFO("line " << s << ": " << lines[s]);
            REQUIRE(std::regex_search(lines[s], m, trl));
            CHECK(std::stoi(m[1]) == s);
        }
    }
    SECTION("-v 2: training lines for steps 0..2, validation at steps 0, 2 and the last, 3") {
        std::string out = run.dir / "out_v2";
        CommandResult r = train_gpt(run.base() + std::vector<std::string>{"-v", "2", "-m", "2", "-o", out});
        INFO("exit status " << r.status << ", output:\n" << r.output);
        REQUIRE(r.status == 0);
        std::ifstream in(out + "/main.log");
        std::stringstream ss;
        ss << in.rdbuf();
        INFO("main.log:\n" << ss.str());
        std::vector<int> trl_steps;
        std::set<int> tel_steps;
        for (const std::string& line : lines_of(ss.str())) {
            std::smatch m;
            INFO("line: " << line);
            if (std::regex_search(line, m, trl)) trl_steps.push_back(std::stoi(m[1]));
            else if (std::regex_search(line, m, tel)) tel_steps.insert(std::stoi(m[1]));
            else FAIL_CHECK("neither a trl nor a tel line");
        }
        CHECK(trl_steps == std::vector<int>{0, 1, 2});
        CHECK(tel_steps == std::set<int>{0, 2, 3});
    }
}

TEST_CASE("llm.c model files, fp32 (v3) and bf16 (v5), load and train", "[cli]") {
    TinyRun run;
    for (int version : {3, 5}) {
        std::string path = run.dir / strfmt("model_v%d.bin", version);
        write_model(path, ModelShape{}, version);
        std::vector<std::string> args = run.base() + std::vector<std::string>{"-e", path};
        CommandResult r = train_gpt(args);
        INFO("command: ./train_gpt" << joined(args));
        INFO("exit status " << r.status << ", output:\n" << r.output);
        CHECK(r.status == 0);
        CHECK(count_matching(lines_of(r.output), std::regex(R"(^step\s+\d+/3 )")) == 3);
    }
}

TEST_CASE("sampling with a tokenizer of the model's vocab size works", "[cli]") {
    TinyRun run;
    std::vector<std::string> args = run.base() + std::vector<std::string>{"-s", "2", "-g", "4", "--tokenizer", run.tokenizer};
    CommandResult r = train_gpt(args);
    INFO("command: ./train_gpt" << joined(args));
    INFO("exit status " << r.status << ", output:\n" << r.output);
    CHECK(r.status == 0);
    CHECK(count_matching(lines_of(r.output), std::regex("^---$")) >= 2);
}

// ---------------------------------------------------------------------------------------------------------
// bad flags

TEST_CASE("an unknown flag and a flag without its value are rejected", "[cli]") {
    TinyRun run;
    expect_error(run.base() + std::vector<std::string>{"--bogus", "1"}, {"--bogus"}, {"unknown"});
    expect_error(run.base() + std::vector<std::string>{"-w", "1"}, {"-w"}, {"unknown"});
    expect_error(run.base() + std::vector<std::string>{"stray", "1"}, {"stray"}, {"unknown"});
    for (const char* flag : {"-b", "-e", "-i", "-o", "--seed", "--tokenizer", "--device", "-nk"})
        expect_error(run.base() + std::vector<std::string>{flag}, {flag}, {"missing value", "needs a value", "expects a value"});
}

// an unknown flag is unknown whether or not anything follows it; "missing value" would send the user looking
// for the wrong problem
TEST_CASE("an unknown flag as the last argument is reported as unknown", "[cli]") {
    TinyRun run;
    expect_error(run.base() + std::vector<std::string>{"--bogus"}, {"--bogus"}, {"unknown"});
}

TEST_CASE("integer flags reject non-integers and values out of range", "[cli]") {
    TinyRun run;
    struct IntFlag {
        const char* flag;
        std::vector<const char*> not_integers, out_of_range;
    };
    const std::vector<IntFlag> flags = {
        {"-b", {"abc", "1.5", "", "2x"}, {"0", "-1", "1048577"}},
        {"-t", {"eight", "8.0"}, {"0", "-8", "1048577"}},
        {"-x", {"ten", "3e2"}, {"-2", "2147483648"}},
        {"-u", {"some"}, {"-1"}},
        {"-v", {"often"}, {"-1", "2147483648"}},
        {"-m", {"1/2"}, {"0", "-5"}},
        {"-s", {"0x"}, {"-1"}},
        {"-g", {"many"}, {"0", "1048577"}},
        {"-n", {"1,000"}, {"-1"}},
        {"-nk", {"all"}, {"-1"}},
        {"-y", {"yes", "true"}, {"2", "-1"}},
        {"-a", {"no"}, {"2", "-1"}},
        {"--seed", {"seed", "1.0"}, {"-1"}},
        {"--shuffle", {"on"}, {"2", "-1"}},
    };
    for (const IntFlag& f : flags) {
        for (const char* v : f.not_integers) {
            std::vector<std::string> names = {f.flag};
            if (*v) names.push_back(v);
            expect_error(run.base() + std::vector<std::string>{f.flag, v}, names, {"integer"});
        }
        for (const char* v : f.out_of_range)
            expect_error(run.base() + std::vector<std::string>{f.flag, v}, {f.flag, v}, {"between", "range"});
    }
    // beyond what a long holds: either reason will do
    for (const char* flag : {"-b", "--seed", "-x"})
        expect_error(run.base() + std::vector<std::string>{flag, "99999999999999999999"}, {flag, "99999999999999999999"},
                     {"integer", "between", "range"});
}

TEST_CASE("float flags, -k, --device and --attention reject bad values", "[cli]") {
    TinyRun run;
    struct FloatCase {
        const char* flag;
        const char* value;
        const char* reason;
    };
    const std::vector<FloatCase> cases = {
        {"-l", "fast", "number"}, {"-l", "nan", "number"},    {"-l", "inf", "number"},     {"-l", "", "number"},
        {"-l", "3e-4x", "number"}, {"-l", "-0.1", "between"}, {"-l", "11", "between"},     {"-q", "half", "number"},
        {"-q", "1.5", "between"}, {"-q", "-0.5", "between"}, {"-c", "x", "number"},       {"-c", "-1", "between"},
    };
    for (const FloatCase& c : cases) {
        std::vector<std::string> names = {c.flag};
        if (*c.value) names.push_back(c.value);
        expect_error(run.base() + std::vector<std::string>{c.flag, c.value}, names, {c.reason, "range"});
    }
    expect_error(run.base() + std::vector<std::string>{"-k", "bogus"}, {"-k", "bogus"}, {"cosine", "unknown"});
    expect_error(run.base() + std::vector<std::string>{"--device", "bogus"}, {"--device", "bogus"}, {"cpu"});
    expect_error(run.base() + std::vector<std::string>{"--device", "tpu"}, {"--device", "tpu"}, {"cpu"});
    expect_error(run.base() + std::vector<std::string>{"--attention", "bogus"}, {"--attention", "bogus"}, {"mma"});
    expect_error(run.base() + std::vector<std::string>{"--device", "cpu", "--attention", "wgmma"},
                 {"--attention", "wgmma"}, {"GPU"});
}

TEST_CASE("--device cuda without a GPU: one line saying so; with one, a head size the kernels lack is refused", "[cli]") {
    TinyRun run;
    std::vector<std::string> cuda = run.base() + std::vector<std::string>{"--device", "cuda"};
    if (!cuda_device_available()) {
        expect_error(cuda, {"--device", "cuda"}, {"no GPU"});
        return;
    }
    expect_error(cuda, {"head size"}, {"64 or 128"});  // the tiny model's heads are 8 wide
}

TEST_CASE("-d must be a positive multiple of b*t", "[cli]") {
    TinyRun run;  // b*t = 16
    expect_error(run.base() + std::vector<std::string>{"-d", "24"}, {"-d", "24"}, {"multiple"});
    expect_error(run.base() + std::vector<std::string>{"-d", "8"}, {"-d", "8"}, {"multiple"});
    expect_error(run.base() + std::vector<std::string>{"-d", "0"}, {"-d", "0"}, {"positive"});
    expect_error(run.base() + std::vector<std::string>{"-d", "-5"}, {"-d", "-5"}, {"positive", "between", "range"});
    expect_error(run.base() + std::vector<std::string>{"-d", "many"}, {"-d", "many"}, {"integer"});
}

// 16 * 2^31 tokens is a multiple of b*t, but 2^31 micro-steps do not fit the int that counts them: the run
// must refuse rather than wrap around to zero or negative accumulation and train on nothing
TEST_CASE("-d whose gradient accumulation count overflows is rejected", "[cli]") {
    TinyRun run;
    expect_error(run.base() + std::vector<std::string>{"-d", "34359738368"}, {"-d"}, {"too", "at most", "range", "between", "exceed"});
}

TEST_CASE("flag combinations: -t beyond the model's maxT, -g beyond -t, -n and -y without -o, --convert without --to, "
          "the planner's flags without what they need", "[cli]") {
    TinyRun run;
    expect_error(run.base() + std::vector<std::string>{"-t", "64"}, {"-t", "64", "32"},
                 {"maximum sequence length", "maxT", "max_seq_len"});
    expect_error(run.base() + std::vector<std::string>{"-t", "33"}, {"-t", "33", "32"},
                 {"maximum sequence length", "maxT", "max_seq_len"});
    expect_error(run.base() + std::vector<std::string>{"-s", "1", "-g", "9"}, {"-g", "9"}, {"-t", "more than", "at most"});
    expect_error(run.base() + std::vector<std::string>{"-n", "1"}, {"-n", "-o"}, {"output directory", "need"});
    expect_error(run.base() + std::vector<std::string>{"-y", "1"}, {"-y", "-o"}, {"output directory", "need"});
    expect_error({"--convert", "out/ckpt_00000001"}, {"--convert", "--to"}, {"needs"});
    expect_error(run.base() + std::vector<std::string>{"--to", "model.bin"}, {"--to", "--convert"}, {"only with"});
    expect_error(run.base() + std::vector<std::string>{"--dtype", "bf16"}, {"--dtype", "--convert"}, {"only with"});
    // the planner's flags
    expect_error(run.base() + std::vector<std::string>{"--search"}, {"--search", "--gpus"}, {"needs"});
    expect_error(run.base() + std::vector<std::string>{"--search", "--gpus", "4"}, {"--search", "-d"}, {"needs"});
    expect_error(run.base() + std::vector<std::string>{"--gpus", "4"}, {"--gpus", "--search"}, {"only with"});
    expect_error(run.base() + std::vector<std::string>{"--hardware", "dev/hardware/cpu.txt"}, {"--hardware", "--plan"},
                 {"only with"});
    expect_error(run.base() + std::vector<std::string>{"--gpus-per-node", "8"}, {"--gpus-per-node", "--plan"}, {"only with"});
    expect_error(run.base() + std::vector<std::string>{"--plan", "--search", "--gpus", "2", "-d", "256"}, {"--search", "--plan"},
                 {"drop"});
    expect_error(run.base() + std::vector<std::string>{"--plan", "--hardware", "no/such/profile.txt"},
                 {"no/such/profile.txt"}, {"cannot open"});
}

// ---------------------------------------------------------------------------------------------------------
// bad model descriptors and model files

TEST_CASE("bad -e descriptors are rejected", "[cli]") {
    TinyRun run;
    auto e = [&](const char* d) { return run.base() + std::vector<std::string>{"-e", d}; };
    expect_error(e("d13"), {"-e", "d13"}, {"d12", "GPT-2 sizes"});
    expect_error(e("d4c100h3"), {"-e", "d4c100h3"}, {"divisible"});
    expect_error(e("d4x"), {"-e", "d4x"}, {"unknown field", "'x'"});
    expect_error(e("d4c128"), {"-e", "d4c128"}, {"heads", "h<"});
    expect_error(e("d0c16h2"), {"-e", "d0c16h2"}, {"bad number", "positive"});
    expect_error(e("d1c16h2t0"), {"-e", "d1c16h2t0"}, {"bad number", "positive"});
}

TEST_CASE("bad -e model files are rejected", "[cli]") {
    TinyRun run;
    auto e = [&](const std::string& path) { return run.base() + std::vector<std::string>{"-e", path}; };
    ModelShape tiny;

    std::string missing = run.dir / "no_such_model.bin";
    expect_error(e(missing), {missing}, {"cannot open", "no such file"});

    std::string magic = run.dir / "bad_magic.bin";
    write_model(magic, tiny, 3, 12345678);
    expect_error(e(magic), {magic}, {"magic"});

    std::string version = run.dir / "bad_version.bin";
    write_model(version, tiny, 4);
    expect_error(e(version), {version}, {"version"});

    std::string longer = run.dir / "four_bytes_too_long.bin";
    write_model(longer, tiny, 3, MODEL_FILE_MAGIC, 4);
    expect_error(e(longer), {longer}, {"size"});

    std::string shorter = run.dir / "truncated.bin";
    write_model(shorter, tiny, 3, MODEL_FILE_MAGIC, -4);
    expect_error(e(shorter), {shorter}, {"size", "short"});

    std::string bf16 = run.dir / "bf16_with_fp32_body.bin";  // a v5 header over 4-byte parameters
    write_model(bf16, tiny, 5, MODEL_FILE_MAGIC, (long)tiny.parameters() * 2);
    expect_error(e(bf16), {bf16}, {"size"});

    std::string truncated = run.dir / "truncated_header.bin";  // shorter than the 1024-byte header
    File(truncated, "wb").write("llm.c", 5);
    expect_error(e(truncated), {truncated}, {"short", "size", "header"});

    std::string dir = run.dir / "a_directory";  // neither a model file nor a Hugging Face directory (no config.json)
    REQUIRE(mkdir(dir.c_str(), 0755) == 0);
    expect_error(e(dir), {dir}, {"not a regular file"});

    std::string shape = run.dir / "bad_shape.bin";  // 16 channels over 3 heads
    ModelShape odd;
    odd.NH = 3;
    write_model(shape, odd);
    expect_error(e(shape), {shape}, {"divisible"});
}

// A header that claims a model far larger than the file holds is refused (as implausible, or by the file
// size) before any memory is allocated for the claimed model, not reported as an allocation failure.
TEST_CASE("a model file whose header claims more parameters than it holds is rejected by size", "[cli]") {
    TinyRun run;
    std::string path = run.dir / "claims_huge.bin";
    int32_t header[256] = {MODEL_FILE_MAGIC, 3, 32, TINY_V, 1, 1, 1 << 24, 384};  // C = 2^24: petabytes of weights
    File f(path, "wb");
    f.write(header, sizeof(header));
    f.write(std::string(64, '\0').data(), 64);
    f.close();
    expect_error(run.base() + std::vector<std::string>{"-e", path}, {path}, {"size", "implausible"});
}

// ---------------------------------------------------------------------------------------------------------
// bad token shards

TEST_CASE("bad -i and -j token shards are rejected", "[cli]") {
    TinyRun run;
    auto i = [&](const std::string& pattern) { return run.base() + std::vector<std::string>{"-i", pattern}; };

    std::string nomatch = run.dir / "nothing_*.bin";
    expect_error(i(nomatch), {nomatch}, {"no files", "match"});
    std::string nofile = run.dir / "absent.bin";
    expect_error(i(nofile), {nofile}, {"no files", "match", "cannot open", "no such file"});

    std::string magic = run.dir / "magic.bin";
    write_shard(magic, random_tokens(200, 2), 20240326);
    expect_error(i(magic), {magic}, {"magic"});

    std::string version = run.dir / "version.bin";
    write_shard(version, random_tokens(200, 3), SHARD_FILE_MAGIC, 2);
    expect_error(i(version), {version}, {"version"});

    std::string size = run.dir / "size.bin";  // the header says 200 tokens, the file holds 199
    write_shard(size, random_tokens(199, 4), SHARD_FILE_MAGIC, 1, 200);
    expect_error(i(size), {size}, {"size"});

    std::string few = run.dir / "few.bin";  // one batch of 2x8 needs 17 tokens
    write_shard(few, random_tokens(16, 5));
    expect_error(i(few), {few}, {"fewer", "too few", "only", "not enough"});

    std::string token = run.dir / "token.bin";  // token 300 in a vocab of 300
    std::vector<uint16_t> tokens = random_tokens(200, 6);
    tokens[57] = TINY_V;
    write_shard(token, tokens);
    expect_error(i(token), {token, "300"}, {"out of range", "vocab"});

    // one bad shard among good ones is named
    write_shard(run.dir / "set_000.bin", random_tokens(200, 7));
    write_shard(run.dir / "set_001.bin", random_tokens(200, 8), SHARD_FILE_MAGIC, 7);
    write_shard(run.dir / "set_002.bin", random_tokens(200, 9));
    expect_error(i(run.dir / "set_*.bin"), {run.dir / "set_001.bin"}, {"version"});

    // the validation shards are checked as well when validating
    expect_error(run.base() + std::vector<std::string>{"-v", "1", "-j", magic}, {magic}, {"magic"});
    std::string val_nomatch = run.dir / "val_*.bin";
    expect_error(run.base() + std::vector<std::string>{"-v", "1", "-j", val_nomatch}, {val_nomatch}, {"no files", "match"});
}

// ---------------------------------------------------------------------------------------------------------
// bad tokenizers (needed only for sampling)

TEST_CASE("sampling needs a readable tokenizer of no more ids than the model's rows", "[cli]") {
    TinyRun run;
    auto t = [&](const std::string& path) {
        return run.base() + std::vector<std::string>{"-s", "1", "-g", "4", "--tokenizer", path};
    };
    std::string missing = run.dir / "no_such_tokenizer.bin";
    expect_error(t(missing), {missing}, {"cannot open", "no such file"});

    // more ids than the model has rows: a tokenizer of another model (one of fewer ids samples: test_hf.cu)
    std::string larger = run.dir / "tok301.bin";
    write_tokenizer(larger, TINY_V + 1);
    expect_error(t(larger), {larger, "301", "300"}, {"more than the model's"});

    std::string magic = run.dir / "tok_magic.bin";
    write_tokenizer(magic, TINY_V, 20240326);
    expect_error(t(magic), {magic}, {"magic"});
}

// ---------------------------------------------------------------------------------------------------------
// where the message goes

TEST_CASE("an error goes to stderr, and nothing to stdout", "[cli]") {
    TinyRun run;
    require_train_gpt();
    for (const std::vector<std::string>& bad : {std::vector<std::string>{"-b", "x"}, {"-e", "d13"}}) {
        std::vector<std::string> args = run.base() + bad;
        CommandResult out = run_command("{ timeout 60 ./train_gpt" + joined(args) + " 2>/dev/null; }");
        CommandResult err = run_command("{ timeout 60 ./train_gpt" + joined(args) + " >/dev/null; }");
        INFO("command: ./train_gpt" << joined(args));
        INFO("stdout:\n" << out.output << "\nstderr:\n" << err.output);
        CHECK(out.status == 1);
        CHECK(out.output.empty());
        CHECK(lines_of(err.output).size() == 1);
        CHECK(err.output.rfind("train_gpt: ", 0) == 0);
    }
}

}  // namespace test_cli

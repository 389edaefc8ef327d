// Helpers shared by the Catch2 tests: random inputs, tolerance checks and scratch directories.
#pragma once

#include <catch.hpp>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmc/utils.h"

inline std::vector<float> random_vector(size_t n, Rng& rng, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = rng.normal(0.0f, scale);
    return v;
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

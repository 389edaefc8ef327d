// Helpers for the tests that run train_gpt (or a check such as comm_check.h) under `mpirun
// --oversubscribe` on the CPU: launching, learnable token data, main.log's losses, and the "comm:" lines that
// compare the bytes a rank counted with the formula. Shared by the distributed, tp, cp and failure tests.
#pragma once

#include <catch.hpp>
#include <math.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "test_helpers.h"

namespace {

// every rank single-threaded and polite: the ranks share two cores
constexpr const char* RUN_ENV =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader "
    "OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive";

inline CommandResult mpirun(int ranks, const std::string& program, const std::string& args) {
    return run_command(strfmt("%s timeout 600 mpirun --oversubscribe --bind-to none -np %d %s %s", RUN_ENV, ranks,
                              program.c_str(), args.c_str()));
}
// runs a check (comm_check.h, cp_check.h: a hidden case of build/tests, tagged with its name) on `ranks` ranks: it
// exits 0 and its summary line, "NAME: N ranks, P passed, F failed", names all the ranks; returns the passed and
// failed counts
struct CheckCounts {
    int passed = 0, failed = -1;
};
inline CheckCounts run_check(int ranks, const std::string& name) {
    CommandResult r = mpirun(ranks, "build/tests", "'[" + name + "]'");
    INFO(r.output);
    CHECK(r.status == 0);
    CheckCounts counts;
    int n = 0;
    size_t at = r.output.find(name + ": ");
    REQUIRE(at != std::string::npos);
    std::string format = name + ": %d ranks, %d passed, %d failed";
    REQUIRE(sscanf(r.output.c_str() + at, format.c_str(), &n, &counts.passed, &counts.failed) == 3);
    CHECK(n == ranks);
    return counts;
}

// ./train_gpt as one process, without mpirun
inline CommandResult single(const std::string& args) { return run_command(std::string(RUN_ENV) + " ./train_gpt " + args); }

// The steps of an equivalence run (DESIGN.md's principle): at the tests' real learning rate (Data::flags) every
// step's loss and gradient norm is compared, and 10 of them are enough for a wrong gradient to move both.
constexpr int EQUIVALENCE_STEPS = 10;

// tokens for a vocab of 301, and the flags of a small run on them. The default model has an odd size in every
// tensor (C=33), so buckets need padding at every dp size; buckets of 0.06 MiB pack the final norm with the
// last two layers, then layer 0, then the embeddings.
struct Data {
    TempDir dir;
    int resume_tokens = 192;  // -d of the resume runs (resume_run_flags)
    Data() {
        Rng rng(99);
        write_shard(dir / "train.bin", learnable_tokens(6000, rng));
        write_shard(dir / "val.bin", learnable_tokens(1200, rng));
    }
    // mostly a fixed successor per token, sometimes a random one: a model learns it within a few steps, so the
    // losses move and a wrong gradient shows
    static std::vector<uint16_t> learnable_tokens(size_t n, Rng& rng) {
        std::vector<uint16_t> t(n);
        t[0] = 1;
        for (size_t i = 1; i < n; i++) t[i] = rng.uniform() < 0.8f ? (t[i - 1] * 7 + 3) % 301 : (uint16_t)rng.below(301);
        return t;
    }
    // b micro-batch per rank, global batch d tokens, x steps; `model` is a descriptor or a (quoted) model file
    std::string flags(int b, int d, int x, const std::string& model = "d3c33h3t32v301") const {
        return strfmt("-e %s -i '%s' -j '%s' -t 16 -b %d -d %d -x %d -v 10 -m 2 -s 0 -l 3e-3 -u 3 -q 0.1 "
                      "-c 0.1 --seed 7 --bucket-mb 0.06",
                      model.c_str(), (dir / "train.bin").c_str(), (dir / "val.bin").c_str(), b, d, x);
    }
};

inline std::string read_file(const std::string& path) {
    File f(path, "rb");
    std::string s(f.size(), '\0');
    if (!s.empty()) f.read(&s[0], s.size());
    return s;
}

inline std::vector<std::string> lines_of(const std::string& s) {
    std::vector<std::string> lines;
    std::istringstream in(s);
    std::string line;
    while (std::getline(in, line)) lines.push_back(line);
    return lines;
}

// the figures of main.log by kind and step: the training loss ("trl 3"), the gradient norm of the same step
// ("norm 3") and the validation loss ("tel 10"). The norm is compared with the losses: a reduction that sums
// where it should average barely moves the losses while clipping at 1.0 is active, but multiplies the norm.
inline std::map<std::string, double> losses(const std::string& out_dir) {
    std::map<std::string, double> v;
    for (const std::string& line : lines_of(read_file(out_dir + "/main.log"))) {
        int step;
        char kind[4];
        double loss, lr, norm;
        int fields = sscanf(line.c_str(), "s:%d %3[a-z]:%lf lr:%lf norm:%lf", &step, kind, &loss, &lr, &norm);
        if (fields < 3) continue;
        v[strfmt("%s %d", kind, step)] = loss;
        if (fields == 5) v[strfmt("norm %d", step)] = norm;
    }
    return v;
}

// a figure of main.log against the reference's within tol relative; main.log prints 6 decimals, so one unit of
// the last (1e-6) is allowed beside it: a norm of 0.05 equal to 1e-7 may print 0.050000 in one run and 0.050001
// in the other. A NaN is never close.
inline bool log_close(double got, double want, double tol) { return fabs(got - want) <= tol * fabs(want) + 1e-6; }

// how many of the figures are of `kind` ("trl", "norm", "tel")
inline size_t count_of(const std::map<std::string, double>& figures, const std::string& kind) {
    size_t n = 0;
    for (const auto& kv : figures) n += kv.first.compare(0, kind.size() + 1, kind + " ") == 0;
    return n;
}

// the same figures at the same steps, each within tol relative; at least min_entries of them, a norm for every
// training loss
inline void require_close(const std::map<std::string, double>& a, const std::map<std::string, double>& b, double tol,
                          size_t min_entries = 20) {
    REQUIRE(a.size() == b.size());
    REQUIRE(a.size() >= min_entries);
    REQUIRE(count_of(a, "norm") == count_of(a, "trl"));
    for (const auto& kv : a) {
        REQUIRE(b.count(kv.first) == 1);
        INFO(kv.first << ": " << kv.second << " vs " << b.at(kv.first));
        CHECK(log_close(kv.second, b.at(kv.first), tol));
    }
}

// runs train_gpt on `ranks` ranks into out_dir; returns the output
inline std::string train(int ranks, const std::string& flags, const std::string& out_dir) {
    CommandResult r = mpirun(ranks, "./train_gpt", flags + " -o '" + out_dir + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
    return r.output;
}

// the number after `prefix` on the first line that starts with it (a line, so that "communication per step per
// rank: " does not match "tensor-parallel communication per step per rank: "); -1 when there is none
inline double line_value(const std::string& output, const std::string& prefix) {
    for (const std::string& line : lines_of(output))
        if (line.compare(0, prefix.size(), prefix) == 0) {
            double v = -1;
            if (sscanf(line.c_str() + prefix.size(), "%lf", &v) == 1) return v;
        }
    return -1;
}

// what rank 0 printed after its first step about the bytes it sent on one group, and what the formula says:
//   comm: rank 0 sent X bytes on dp in this step; the formula for ZeRO-Z says Y
//   comm: rank 0 sent X bytes on tp in this step; the formula for tp=T sp=S says Y
struct CommLine {
    bool found = false;
    double sent = -1, formula = -2;
    int zero = -1, tp = -1, sp = -1;
};
inline CommLine dp_comm_line(const std::string& output) {
    CommLine c;
    for (const std::string& line : lines_of(output)) {
        const char* s = line.c_str();
        if (sscanf(s, "comm: rank 0 sent %lf bytes on dp in this step; the formula for ZeRO-%d says %lf", &c.sent, &c.zero,
                   &c.formula) == 3) {
            c.found = true;
            return c;
        }
    }
    return CommLine{};
}
inline CommLine tp_comm_line(const std::string& output) {
    CommLine c;
    for (const std::string& line : lines_of(output))
        if (sscanf(line.c_str(), "comm: rank 0 sent %lf bytes on tp in this step; the formula for tp=%d sp=%d says %lf",
                   &c.sent, &c.tp, &c.sp, &c.formula) == 4) {
            c.found = true;
            return c;
        }
    return CommLine{};
}

// the dp line is there and its count equals the formula for the stage
inline void require_counted_equals_formula(const std::string& output, int zero = -1) {
    CommLine c = dp_comm_line(output);
    INFO(output);
    REQUIRE(c.found);
    CHECK(c.sent > 0);
    CHECK(c.sent == c.formula);
    if (zero >= 0) CHECK(c.zero == zero);
}
// the tp line is there, names the layout and its count equals the formula
inline void require_tp_counted_equals_formula(const std::string& output, int tp, int sp) {
    CommLine c = tp_comm_line(output);
    INFO(output);
    REQUIRE(c.found);
    CHECK(c.tp == tp);
    CHECK(c.sp == sp);
    CHECK(c.sent > 0);
    CHECK(c.sent == c.formula);
}

// A run of `flags` (6 steps) with a checkpoint every 3 into `whole`, and the same run resumed into `resumed`, which
// holds only the step-3 checkpoint (what a run stopped after writing it leaves): the resumed run says where it
// resumed, its main.log is the uninterrupted run's from step 3 on (losses and gradient norms, bit for bit), and
// its step-6 checkpoint is the uninterrupted run's, file for file and byte for byte; its model.bin is llm.c's
// file of the whole model, 256 int32 of header and then every one of the model's `parameters` in fp32, whatever
// the layout. A resume that exits 0 without training leaves no main.log lines and no step-6 checkpoint.
inline void check_resumes_bit_exactly(int ranks, const std::string& flags, const std::string& whole,
                                      const std::string& resumed, size_t parameters) {
    train(ranks, flags + " -n 3", whole);
    const std::string step3 = "/ckpt_00000003", step6 = "/ckpt_00000006";
    REQUIRE(run_command(strfmt("mkdir -p '%s' && cp -r '%s%s' '%s%s'", resumed.c_str(), whole.c_str(), step3.c_str(),
                               resumed.c_str(), step3.c_str())).status == 0);
    std::string output = train(ranks, flags + " -n 3 -y 1", resumed);
    CHECK(output.find("resumed from " + resumed + step3 + " at step 3") != std::string::npos);
    std::map<std::string, double> a = losses(whole), b = losses(resumed);
    for (const char* kind : {"trl", "norm"})
        for (int step = 3; step < 6; step++) {
            std::string key = strfmt("%s %d", kind, step);
            INFO(key);
            REQUIRE(a.count(key) == 1);
            REQUIRE(b.count(key) == 1);
            CHECK(a[key] == b[key]);
        }
    std::vector<std::string> files = list_dir(whole + step6);
    REQUIRE(std::find(files.begin(), files.end(), "model.bin") != files.end());
    CHECK(list_dir(resumed + step6) == files);
    for (const std::string& name : files) {
        INFO(name);
        CHECK(read_file(resumed + step6 + "/" + name) == read_file(whole + step6 + "/" + name));
    }
    CHECK(read_file(resumed + step6 + "/model.bin").size() == 256 * 4 + parameters * 4);
}

// "comm: rank 0 sent X bytes on cp in this step; the formula for cp=N says Y": X equals Y, and is not 0
inline void require_cp_counted_equals_formula(const std::string& output, int cp) {
    double sent = -1, formula = -2;
    int n = 0;
    for (const std::string& line : lines_of(output))
        if (sscanf(line.c_str(), "comm: rank 0 sent %lf bytes on cp in this step; the formula for cp=%d says %lf", &sent,
                   &n, &formula) == 3)
            break;
    INFO(output);
    REQUIRE(n == cp);
    CHECK(sent > 0);
    CHECK(sent == formula);
}

// "comm: rank 0 sent X bytes on pp in this step; the formula for pp=N vpp=V says Y": X equals Y, and is not 0
inline void require_pp_counted_equals_formula(const std::string& output) {
    double sent = -1, formula = -2;
    int n = 0, v = 0;
    for (const std::string& line : lines_of(output))
        if (sscanf(line.c_str(), "comm: rank 0 sent %lf bytes on pp in this step; the formula for pp=%d vpp=%d says %lf",
                   &sent, &n, &v, &formula) == 4)
            break;
    INFO(output);
    CHECK(sent > 0);
    CHECK(sent == formula);
}

// "comm: rank 0 sent X bytes on ep in this step; ... says Y": X equals Y, and is not 0
inline void require_ep_counted_equals_formula(const std::string& output) {
    for (const std::string& line : lines_of(output))
        if (line.rfind("comm: rank 0 sent ", 0) == 0 && line.find(" on ep ") != std::string::npos) {
            double sent = -1, formula = -2;
            REQUIRE(sscanf(line.c_str(), "comm: rank 0 sent %lf", &sent) == 1);
            REQUIRE(sscanf(line.c_str() + line.find(" says ") + 6, "%lf", &formula) == 1);
            INFO(line);
            CHECK(sent > 0);
            CHECK(sent == formula);
            return;
        }
    FAIL("no ep comm line in:\n" << output);
}

// like train(), but a failed run is recorded and the test goes on with the next layout; false when it failed
inline bool train_ok(int ranks, const std::string& flags, const std::string& out_dir, std::string* output = nullptr) {
    CommandResult r = mpirun(ranks, "./train_gpt", flags + " -o '" + out_dir + "'");
    INFO(ranks << " ranks: ./train_gpt " << flags << "\n" << r.output);
    CHECK(r.status == 0);
    if (output) *output = r.output;
    return r.status == 0;
}
inline bool single_ok(const std::string& flags, const std::string& out_dir, std::string* output = nullptr) {
    CommandResult r = single(flags + " -o '" + out_dir + "'");
    INFO("./train_gpt " << flags << "\n" << r.output);
    CHECK(r.status == 0);
    if (output) *output = r.output;
    return r.status == 0;
}

// the same figures at the same steps within tol relative (at least min_entries); a mismatch is recorded and the
// test goes on
inline void check_close(const std::map<std::string, double>& a, const std::map<std::string, double>& b, double tol,
                 size_t min_entries = 20) {
    CHECK(a.size() == b.size());
    CHECK(a.size() >= min_entries);
    CHECK(count_of(a, "norm") == count_of(a, "trl"));
    for (const auto& kv : a) {
        auto other = b.find(kv.first);
        INFO(kv.first << ": " << kv.second);
        CHECK(other != b.end());
        if (other == b.end()) continue;
        INFO(kv.first << ": " << kv.second << " vs " << other->second << " (relative difference "
                      << fabs(kv.second - other->second) / fabs(other->second) << ")");
        CHECK(log_close(kv.second, other->second, tol));
    }
}

// Resuming under another layout: RESUME_SAVED_AT steps on one layout, the rest of RESUME_STEPS on another from
// its checkpoint, against the single-rank run that was never interrupted. Every run: -d data.resume_tokens per
// step (192 unless a test's data asks for fewer), validation every 4 steps. RESUME_SAVED_AT is the first step
// after the warmup (-u 3), so that the shorter first run's learning rates are the whole run's.
constexpr int RESUME_STEPS = 8, RESUME_SAVED_AT = 4;

struct ResumeLayout {
    int ranks;
    std::string flags;  // -b and the parallelism
};

inline std::string resume_run_flags(const Data& data, const char* model, int steps, const ResumeLayout& l) {
    return data.flags(4, data.resume_tokens, steps, model) + " -v 4 " + l.flags;
}

// the losses of the single-rank run of RESUME_STEPS steps
inline std::map<std::string, double> resume_reference_losses(const Data& data, const char* model, const std::string& dir) {
    REQUIRE(single_ok(resume_run_flags(data, model, RESUME_STEPS, {1, "-b 4"}), dir));
    return losses(dir);
}

// RESUME_SAVED_AT steps on layout a, the rest on layout b from a's checkpoint: every loss within 1e-5 of the
// reference
inline void check_resume(const Data& data, const char* model, const ResumeLayout& a, const ResumeLayout& b,
                         const std::map<std::string, double>& reference, const std::string& dir) {
    INFO(a.ranks << " ranks " << a.flags << " -> " << b.ranks << " ranks " << b.flags);
    if (!train_ok(a.ranks, resume_run_flags(data, model, RESUME_SAVED_AT, a) + " -n 4", dir)) return;
    std::string output;
    if (!train_ok(b.ranks, resume_run_flags(data, model, RESUME_STEPS, b) + " -n 4 -y 1", dir, &output)) return;
    std::string resumed = "resumed from " + dir + "/ckpt_00000004 at step 4: written on ";
    CHECK(output.find(resumed) != std::string::npos);
    check_close(losses(dir), reference, 1e-5, RESUME_STEPS + 3);
}
// One layout of an equivalence test: `ranks` ranks with `flags`, b sequences per micro-batch of a rank, for the
// global batch of `sequences` (of 16 tokens) of its model's single-rank run
struct EquivalenceLayout {
    const char* name;
    const char* model;
    int ranks, b;
    const char* flags;
    int sequences = 8;
};

// Each layout's EQUIVALENCE_STEPS steps against its model's single-rank run with the same global batch (micro-batches of 2),
// every loss within 1e-5, and the bytes it counted against the formulas of the groups its flags use (tp, dp under
// ZeRO, cp, ep, pp). Returns each layout's output by name, for the caller's own checks.
inline std::map<std::string, std::string> check_layouts(const Data& data, const TempDir& out,
                                                        const std::vector<EquivalenceLayout>& layouts) {
    std::map<std::string, std::map<std::string, double>> reference;  // by model and global batch
    std::map<std::string, std::string> outputs;
    auto single_run = [](const EquivalenceLayout& l) { return strfmt("%s_%d", l.model, l.sequences); };
    for (const EquivalenceLayout& l : layouts) {
        if (reference.count(single_run(l))) continue;
        REQUIRE(single_ok(data.flags(2, 16 * l.sequences, EQUIVALENCE_STEPS, l.model), out / single_run(l)));
        reference[single_run(l)] = losses(out / single_run(l));
    }
    for (const EquivalenceLayout& l : layouts) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(l.ranks, data.flags(l.b, 16 * l.sequences, EQUIVALENCE_STEPS, l.model) + l.flags, dir, &run)) continue;
        check_close(losses(dir), reference[single_run(l)], 1e-5);
        std::string flags = l.flags;
        auto has = [&](const char* flag) { return flags.find(flag) != std::string::npos; };
        if (has("--tp")) require_tp_counted_equals_formula(run, has("--tp 4") ? 4 : 2, !has("--sp 0"));
        if (has("-z") && run.find(" dp=1,") == std::string::npos) require_counted_equals_formula(run);
        if (has("--cp")) require_cp_counted_equals_formula(run, 2);
        if (has("--ep")) require_ep_counted_equals_formula(run);
        if (has("--pp")) require_pp_counted_equals_formula(run);
        outputs[l.name] = run;
    }
    return outputs;
}

// one loss of main.log, NAN when it is missing
inline double loss_at(const std::map<std::string, double>& v, const std::string& key) {
    auto it = v.find(key);
    return it == v.end() ? NAN : it->second;
}
inline bool rel_close(double a, double b, double tol) { return fabs(a - b) <= tol * fabs(b); }

// starts a shell command line in the background, its output going to `log`; the pid is the command's own (the
// shell execs it), so that signals reach it
inline pid_t start_command(const std::string& command, const std::string& log) {
    std::string line = "exec " + command + " > '" + log + "' 2>&1";
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", line.c_str(), (char*)nullptr);
        _exit(127);
    }
    REQUIRE(pid > 0);
    return pid;
}

// waits until the file `log` holds `text` (true) or `seconds` pass (false)
inline bool wait_for(const std::string& log, const std::string& text, double seconds = 120) {
    for (double waited = 0; waited < seconds; waited += 0.01) {
        if (file_exists(log) && read_file(log).find(text) != std::string::npos) return true;
        usleep(10000);
    }
    return false;
}

// the step after which a stopped run stopped: the last step line of its output (-1 when it has none)
inline int last_step(const std::string& output) {
    int step = -1;
    for (const std::string& line : lines_of(output)) sscanf(line.c_str(), "step %d/", &step);
    return step;
}

// the exit status of a started process, as the shell reports it (128 + the signal when one ended it)
inline int finish(pid_t pid) {
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// the contract for a refused layout: exit status 1 and one line, "train_gpt: ...", mentioning every word
inline void check_one_line_error(const CommandResult& r, const std::vector<std::string>& words) {
    INFO("exit status " << r.status << ", output:\n" << r.output);
    CHECK(r.status == 1);
    std::vector<std::string> lines = lines_of(r.output);
    CHECK(lines.size() == 1);
    if (lines.empty()) return;
    CHECK(lines[0].rfind("train_gpt: ", 0) == 0);
    for (const std::string& w : words) {
        INFO("the message should mention " << w);
        CHECK(lines[0].find(w) != std::string::npos);
    }
}

// "  <category>   <bytes> bytes   <MiB> MiB" of --plan's memory block; -1 when the category is missing
inline long long plan_category_bytes(const std::string& output, const std::string& name) {
    std::string prefix = "  " + name + " ";
    for (const std::string& line : lines_of(output))
        if (line.compare(0, prefix.size(), prefix) == 0) {
            long long v = -1;
            char unit[8] = {};
            if (sscanf(line.c_str() + prefix.size(), " %lld %7s", &v, unit) == 2 && std::string(unit) == "bytes") return v;
        }
    return -1;
}

}  // namespace

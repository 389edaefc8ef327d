// DIR/main.log in llm.c's line format, which scripts and tests parse: "s:STEP trl:LOSS lr:LR norm:NORM" per
// training step and "s:STEP tel:LOSS" per validation, losses with 6 decimals. With experts, a step's line adds
// "aux:LOSS" (and under a capacity "drop:N", the assignments dropped) and, every -v steps, a line
// "s:STEP load:MIN/MAX,..." (per layer). A step whose update was skipped
// (a non-finite loss or gradient norm, or a spike) adds "skipped:1", and for a spike its z-score, "zloss:Z" or
// "znorm:Z". A multiple-choice eval writes "s:STEP eval:ACC", the accuracy with 4 decimals (llm.c's line). A
// line that cannot be written stops the run.
#pragma once

#include <stdarg.h>
#include <unistd.h>

#include <string>

#include "llmc/spikes.h"
#include "llmc/utils.h"

struct Logger {
    FILE* f = nullptr;
    std::string path;
    // A fresh run starts the log anew. A resumed one first cuts it before the first line of step resume_step or
    // later (what a run that went further, or died before its next checkpoint, logged), so that no step appears
    // twice, then appends.
    void open(const std::string& dir, int resume_step) {
        path = dir + "/main.log";
        if (resume_step >= 0) cut_from(resume_step);
        f = fopen(path.c_str(), resume_step >= 0 ? "a" : "w");
        if (!f) fail("%s: cannot open for writing (%s)", path.c_str(), strerror(errno));
    }
    ~Logger() {
        if (f) fclose(f);
    }
    // aux: a mixture of experts' load-balancing loss (negative: a dense model, not written); dropped: the
    // assignments its experts' capacity dropped (negative: no capacity, not written)
    void train(int step, float loss, float lr, float norm, bool skipped, float aux = -1.0f, long dropped = -1,
               Spike spike = {}) {
        std::string extra = aux >= 0.0f ? strfmt(" aux:%.6f", aux) : "";
        if (dropped >= 0) extra += strfmt(" drop:%ld", dropped);
        if (skipped) extra += " skipped:1";
        if (spike.found()) extra += strfmt(" z%s:%.4f", spike.what, spike.z);
        line("s:%d trl:%.6f lr:%.6e norm:%.6f%s\n", step, loss, lr, norm, extra.c_str());
    }
    // each layer's expert load: the smallest and the largest share of the step's assignments
    void expert_load(int step, const std::string& shares) { line("s:%d load:%s\n", step, shares.c_str()); }
    void val(int step, float loss) { line("s:%d tel:%.6f\n", step, loss); }
    void eval(int step, double accuracy) { line("s:%d eval:%.4f\n", step, accuracy); }

   private:
    // a line that cannot be written (a full disk) stops the run: a run whose log is lost cannot be followed
    void line(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
        if (!f) return;
        va_list args;
        va_start(args, fmt);
        int n = vfprintf(f, fmt, args);
        va_end(args);
        if (n < 0 || fflush(f) != 0 || ferror(f)) fail("%s: cannot write (%s)", path.c_str(), strerror(errno));
    }
    void cut_from(int step) {
        FILE* in = fopen(path.c_str(), "rb");
        if (!in) return;  // no log yet (a checkpoint copied into a new directory)
        long keep = 0;
        char buf[4096];
        while (fgets(buf, sizeof(buf), in)) {
            int s;
            if (sscanf(buf, "s:%d", &s) == 1 && s >= step) break;
            keep = ftell(in);
        }
        fclose(in);
        if (truncate(path.c_str(), keep) != 0) fail("%s: cannot truncate (%s)", path.c_str(), strerror(errno));
    }
};

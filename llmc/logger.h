// DIR/main.log in llm.c's line format, which scripts and tests parse: "s:STEP trl:LOSS lr:LR norm:NORM" per
// training step and "s:STEP tel:LOSS" per validation, losses with 6 decimals. A step whose update was skipped
// (a non-finite loss or gradient norm) adds "skipped:1".
#pragma once

#include <string>

#include "llmc/utils.h"

struct Logger {
    FILE* f = nullptr;
    // a resumed run appends; a fresh one starts the log anew
    void open(const std::string& dir, bool append) {
        std::string path = dir + "/main.log";
        f = fopen(path.c_str(), append ? "a" : "w");
        if (!f) fail("%s: cannot open for writing (%s)", path.c_str(), strerror(errno));
    }
    ~Logger() {
        if (f) fclose(f);
    }
    void train(int step, float loss, float lr, float norm, bool skipped) {
        if (!f) return;
        fprintf(f, "s:%d trl:%.6f lr:%.6e norm:%.6f%s\n", step, loss, lr, norm, skipped ? " skipped:1" : "");
        fflush(f);
    }
    void val(int step, float loss) {
        if (!f) return;
        fprintf(f, "s:%d tel:%.6f\n", step, loss);
        fflush(f);
    }
};

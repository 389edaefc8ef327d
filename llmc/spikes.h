// Loss-spike skipping (llm.c's -sl and -sg): a step whose loss, or gradient norm, lies more than Z standard
// deviations above its mean over the last steps is taken for an outlier (a bad batch, an instability starting)
// and its update is skipped, as a step with a NaN is. The statistics are kept whether or not a threshold is set,
// over a window of the newest steps that updated (llm.c's window: 128); a skipped step never enters them, so one
// spike does not widen the band the next is measured against. Unlike llm.c's detector, which adds the new value
// to its window before scoring it, a step is scored against the steps before it alone.
//
// The values are the step's reduced loss and gradient norm, the same bits on every rank, so every rank keeps
// the same windows and takes the same decision. A checkpoint holds the windows (llmc/checkpoint.h), so a
// resumed run scores its next step exactly as the uninterrupted run would have.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "llmc/utils.h"

constexpr int MAX_SPIKE_WINDOW = 1 << 20;  // --spike-window's bound, and a checkpoint's

// the newest values, oldest first, at most `size` of them
struct ZWindow {
    std::vector<double> values;

    // how many standard deviations x lies above the window's mean (NaN until the window is full; 0 when its
    // values are all equal), from the values in order, so the same window always gives the same bits
    double zscore(double x, int size) const {
        if ((int)values.size() < size) return NAN;
        double mean = 0.0, var = 0.0;
        for (double v : values) mean += v;
        mean /= values.size();
        for (double v : values) var += (v - mean) * (v - mean);
        double sd = sqrt(var / values.size());
        return sd == 0.0 ? 0.0 : (x - mean) / sd;
    }
    void push(double x, int size) {
        values.push_back(x);
        if ((int)values.size() > size) values.erase(values.begin(), values.end() - size);
    }
};

// what a step's loss and norm make of it: skip it (`what` names the value, `flag` its limit's flag, z its score)
// or update
struct Spike {
    const char* what = nullptr;  // "loss" or "norm", or null: no spike
    const char* flag = nullptr;  // "-sl" or "-sg"
    double z = 0.0, limit = 0.0;
    bool found() const { return what != nullptr; }
};

struct SpikeGuard {
    float loss_limit = 0.0f, norm_limit = 0.0f;  // -sl, -sg: 0 is off
    int window = 128;                            // --spike-window
    ZWindow loss, norm;

    bool on() const { return loss_limit > 0.0f || norm_limit > 0.0f; }
    Spike check(double loss_value, double norm_value) const {
        double zl = loss.zscore(loss_value, window), zn = norm.zscore(norm_value, window);
        if (loss_limit > 0.0f && zl > loss_limit) return Spike{"loss", "-sl", zl, loss_limit};
        if (norm_limit > 0.0f && zn > norm_limit) return Spike{"norm", "-sg", zn, norm_limit};
        return Spike{};
    }
    // the windows a checkpoint held, their newest values when this run keeps fewer
    void restore(const std::vector<double>& losses, const std::vector<double>& norms) {
        loss.values.clear(), norm.values.clear();
        for (double v : losses) loss.push(v, window);
        for (double v : norms) norm.push(v, window);
    }
    // a step that updated
    void record(double loss_value, double norm_value) {
        loss.push(loss_value, window);
        norm.push(norm_value, window);
    }

    // the run's first lines: what a spike is, with the limits set
    std::string rule() const {
        std::string values = loss_limit > 0.0f && norm_limit > 0.0f ? "loss or gradient norm"
                             : loss_limit > 0.0f                   ? "loss"
                                                                   : "gradient norm";
        std::string limits = loss_limit > 0.0f && norm_limit > 0.0f
                                 ? strfmt("%g (-sl) or %g (-sg)", loss_limit, norm_limit)
                                 : strfmt("%g", loss_limit > 0.0f ? loss_limit : norm_limit);
        return strfmt("a step whose %s lies more than %s standard deviations above its mean over the newest %d steps "
                      "that updated skips its update", values.c_str(), limits.c_str(), window);
    }
    // why a step skipped its update, for its line
    std::string reason(const Spike& spike) const {
        return strfmt("%s %.2f standard deviations above its mean over the last %d steps (%s %g)", spike.what, spike.z,
                      window, spike.flag, spike.limit);
    }
};

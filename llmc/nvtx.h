// NVTX ranges: named spans of a run that Nsight Systems shows on its timeline (and that cost nothing when no
// profiler is attached). NVTX 3 is header-only, so the CPU build carries it too; a profile of the CPU path shows
// the same phases and layers a GPU profile will. During a step that --profile or --trace records, each range is
// also a span of llmc/profile.h's trace: a pass ("forward", "backward", "weight gradients", "optimizer step"),
// whose name the memory timeline takes as its phase, or a layer ("layer 3").
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <cstdio>

#include "llmc/profile.h"

struct NvtxRange {
    explicit NvtxRange(const char* name) {
        nvtxRangePushA(name);
        span = profile_span("pass", [&] { return std::make_pair(std::string(name), std::string()); });
    }
    // "name index", e.g. "layer 3", formatted on the stack: ranges sit on the hot path
    NvtxRange(const char* name, int index) {
        char text[64];
        snprintf(text, sizeof(text), "%s %d", name, index);
        nvtxRangePushA(text);
        span = profile_span(name, [&] { return std::make_pair(std::string(text), std::string()); });
    }
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
    ProfileScope span;
};

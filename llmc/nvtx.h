// NVTX ranges: named spans of a run that Nsight Systems shows on its timeline (and that cost nothing when no
// profiler is attached). NVTX 3 is header-only, so the CPU build carries it too; a profile of the CPU path shows
// the same phases and layers a GPU profile will.
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <cstdio>

struct NvtxRange {
    explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
    // "name index", e.g. "layer 3", formatted on the stack: ranges sit on the hot path
    NvtxRange(const char* name, int index) {
        char text[64];
        snprintf(text, sizeof(text), "%s %d", name, index);
        nvtxRangePushA(text);
    }
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
};

// NVTX ranges: named spans of a run that Nsight Systems shows on its timeline (and that cost nothing when no
// profiler is attached). NVTX 3 is header-only, so the CPU build carries it too; a profile of the CPU path shows
// the same phases and layers a GPU profile will.
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <string>

struct NvtxRange {
    explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
    explicit NvtxRange(const std::string& name) { nvtxRangePushA(name.c_str()); }
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
};

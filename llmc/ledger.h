// Every buffer the trainer allocates goes through a Ledger, tagged with what it is for. The totals per
// category are what `--plan` predicts, so the two can be compared exactly (tests do).
#pragma once

#include <cstdlib>
#include <cstring>
#include <vector>

#include "llmc/utils.h"

enum MemCategory { MEM_PARAMS, MEM_MASTER_WEIGHTS, MEM_GRADS, MEM_OPTIMIZER, MEM_ACTIVATIONS, MEM_COMM, MEM_SCRATCH,
                   MEM_CATEGORIES };

inline const char* mem_category_name(int c) {
    static const char* names[MEM_CATEGORIES] = {"params", "master weights", "grads", "optimizer state",
                                                "activations", "comm buffers", "scratch"};
    return names[c];
}

struct Ledger {
    size_t bytes[MEM_CATEGORIES] = {};
    std::vector<void*> blocks;

    Ledger() = default;
    Ledger(const Ledger&) = delete;
    Ledger& operator=(const Ledger&) = delete;
    ~Ledger() {
        for (void* p : blocks) free(p);
    }

    // zero-filled and 64-byte aligned, so vector loads never straddle cache lines
    float* alloc_floats(MemCategory category, size_t count) {
        size_t n = count * sizeof(float);
        size_t rounded = (n + 63) / 64 * 64;
        void* p = aligned_alloc(64, rounded ? rounded : 64);
        if (!p) fail("out of host memory allocating %zu bytes for %s", n, mem_category_name(category));
        memset(p, 0, rounded ? rounded : 64);
        blocks.push_back(p);
        bytes[category] += n;
        return (float*)p;
    }
    size_t total() const {
        size_t t = 0;
        for (size_t b : bytes) t += b;
        return t;
    }
};

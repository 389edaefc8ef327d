// Every buffer the trainer allocates goes through a Ledger, tagged with what it is for. The totals per
// category are what `--plan` predicts, so the two can be compared exactly (tests do). Host buffers come from
// aligned_alloc, device buffers from cudaMalloc; both start zeroed.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "llmc/device.cuh"
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
    std::vector<void*> blocks, device_blocks;

    Ledger() = default;
    Ledger(const Ledger&) = delete;
    Ledger& operator=(const Ledger&) = delete;
    ~Ledger() {
        for (void* p : blocks) free(p);
        for (void* p : device_blocks) cudaFree(p);  // no check: a failing driver at exit has nothing left to say
    }

    // zero-filled and 64-byte aligned, so vector loads never straddle cache lines
    float* alloc_floats(MemCategory category, size_t count) { return (float*)alloc_host(category, count * sizeof(float)); }
    void* alloc_host(MemCategory category, size_t n) {
        size_t rounded = (n + 63) / 64 * 64;
        void* p = aligned_alloc(64, rounded ? rounded : 64);
        if (!p) fail("out of host memory allocating %zu bytes for %s", n, mem_category_name(category));
        memset(p, 0, rounded ? rounded : 64);
        blocks.push_back(p);
        bytes[category] += n;
        return p;
    }
    // count elements of E on the device of the storage type T
    template <typename T, typename E>
    E* alloc(MemCategory category, size_t count) {
        if constexpr (device_of<T> == Device::CPU) {
            return static_cast<E*>(alloc_host(category, count * sizeof(E)));
        } else {
            size_t n = count * sizeof(E);
            void* p = nullptr;
            if (cudaMalloc(&p, n ? n : 256) != cudaSuccess) {
                (void)cudaGetLastError();
                fail("out of GPU memory allocating %zu bytes for %s (%.1f MiB allocated so far)", n,
                     mem_category_name(category), total() / 1048576.0);
            }
            cuda_check(cudaMemset(p, 0, n ? n : 256));
            device_blocks.push_back(p);
            bytes[category] += n;
            return static_cast<E*>(p);
        }
    }
    size_t total() const {
        size_t t = 0;
        for (size_t b : bytes) t += b;
        return t;
    }
};

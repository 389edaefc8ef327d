// Every buffer the trainer allocates goes through a Ledger, tagged with what it is for. Host buffers come from
// aligned_alloc, device buffers from cudaMalloc; both start zeroed.
//
// An allocation is first a list of buffers (BufferList: each one's name, category, bytes and the pointer it is
// allocated into), made from the sizes alone by the code that owns the buffers (llmc/gpt.cuh's gpt_buffers and
// what it calls); the Ledger walks that list to allocate it and records each entry. `--plan` (llmc/plan.h)
// reads the same list without allocating, so the plan and the ledger agree by construction, buffer by buffer.
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

// One buffer of an allocation. `shares`: the buffer takes the memory of an earlier one of the list (whose pointer
// that is) instead of its own, and counts no bytes: what -r recomputes, one buffer for every layer.
struct PlannedBuffer {
    const char* name;
    MemCategory category;
    size_t bytes;
    void** pointer;
    void** shares = nullptr;
};
using BufferList = std::vector<PlannedBuffer>;

// count elements of E into pointer p
template <typename E>
inline PlannedBuffer planned(const char* name, MemCategory category, E*& p, size_t count) {
    return {name, category, count * sizeof(E), reinterpret_cast<void**>(&p)};
}
inline void append(BufferList& to, const BufferList& more) { to.insert(to.end(), more.begin(), more.end()); }

// what a list of buffers takes, per category
inline void add_bytes(size_t bytes[MEM_CATEGORIES], const BufferList& list) {
    for (const PlannedBuffer& b : list) bytes[b.category] += b.bytes;
}

// what the ledger has allocated from lists, in order
struct LedgerEntry {
    const char* name;
    MemCategory category;
    size_t bytes;
};

struct Ledger {
    size_t bytes[MEM_CATEGORIES] = {};
    std::vector<LedgerEntry> entries;
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
        return static_cast<E*>(alloc_bytes<T>(category, count * sizeof(E)));
    }
    // n bytes on the device of the storage type T
    template <typename T>
    void* alloc_bytes(MemCategory category, size_t n) {
        if constexpr (device_of<T> == Device::CPU) {
            return alloc_host(category, n);
        } else {
            void* p = nullptr;
            if (cudaMalloc(&p, n ? n : 256) != cudaSuccess) {
                (void)cudaGetLastError();
                fail("out of GPU memory allocating %zu bytes for %s (%.1f MiB allocated so far)", n,
                     mem_category_name(category), total() / 1048576.0);
            }
            cuda_check(cudaMemset(p, 0, n ? n : 256));
            device_blocks.push_back(p);
            bytes[category] += n;
            return p;
        }
    }
    // every buffer of the list, in its order, on the device of the storage type T
    template <typename T>
    void allocate(const BufferList& list) {
        for (const PlannedBuffer& b : list) {
            if (b.shares) {
                *b.pointer = *b.shares;
                continue;
            }
            *b.pointer = alloc_bytes<T>(b.category, b.bytes);
            entries.push_back({b.name, b.category, b.bytes});
        }
    }
    size_t total() const {
        size_t t = 0;
        for (size_t b : bytes) t += b;
        return t;
    }
};

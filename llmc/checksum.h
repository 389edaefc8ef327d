// FNV-1a 64: the checksum of every checkpoint file, recorded in its manifest and verified before a resume.
// It is here rather than from a library because a dozen lines suffice: it has to catch flipped bytes and
// truncation on disk, not deliberate tampering, and updating it as bytes are written costs no second read.
#pragma once

#include <cstddef>
#include <cstdint>

struct Fnv1a64 {
    uint64_t value = 0xcbf29ce484222325ull;  // the offset basis
    void update(const void* data, size_t bytes) {
        const unsigned char* p = static_cast<const unsigned char*>(data);
        for (size_t i = 0; i < bytes; i++) value = (value ^ p[i]) * 0x100000001b3ull;
    }
};

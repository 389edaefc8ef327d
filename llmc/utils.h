// Small helpers every other header leans on: errors that carry a one-line message up to main(), checked
// file I/O, and the random number generator behind initialization, shuffling and sampling.
// Errors are exceptions so that tests can assert on them; main() prints the message and exits non-zero.
#pragma once

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <string>
#include <vector>

#include "llmc/checksum.h"

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void fail(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    throw Error(buf);
}

// ----------------------------------------------------------------------------------------------------------
// files

struct File {
    FILE* f = nullptr;
    std::string path;
    Fnv1a64 written;  // of every byte written, for a checkpoint's manifest
    File(const std::string& p, const char* mode) : path(p) {
        f = fopen(p.c_str(), mode);
        if (!f) fail("%s: cannot open (%s)", p.c_str(), strerror(errno));
        // fopen reads a directory without complaint, and its first read then fails as a short file would
        struct stat st;
        if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
            fclose(f);
            fail("%s: not a regular file", p.c_str());
        }
    }
    ~File() {
        if (f) fclose(f);
    }
    File(const File&) = delete;
    File& operator=(const File&) = delete;
    void read(void* dst, size_t bytes) {
        if (fread(dst, 1, bytes, f) != bytes) fail("%s: file is shorter than its header says", path.c_str());
    }
    // `bytes` from byte `offset` on, wherever the stream stands
    void read_at(void* dst, size_t bytes, long offset) {
        for (size_t done = 0; done < bytes;) {
            ssize_t got = pread(fileno(f), (char*)dst + done, bytes - done, offset + (long)done);
            if (got <= 0) fail("%s: file is shorter than its header says", path.c_str());
            done += (size_t)got;
        }
    }
    void write(const void* src, size_t bytes) {
        if (fwrite(src, 1, bytes, f) != bytes) fail("%s: write failed (%s)", path.c_str(), strerror(errno));
        written.update(src, bytes);
    }
    // the rest of the file from where the stream stands, as text
    std::string read_all() {
        std::string text;
        char buf[65536];
        for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) text.append(buf, n);
        if (ferror(f)) fail("%s: cannot read (%s)", path.c_str(), strerror(errno));
        return text;
    }
    // flushes and fsyncs so that a rename after close() publishes complete bytes
    void close();
    long size() {
        long here = ftell(f);
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, here, SEEK_SET);
        return n;
    }
};

// bf16 as its 16 bits (the collectives' staging, model files, safetensors): exact widening to fp32, and fp32
// rounded to the nearest bf16 (ties to even; a NaN stays NaN)
inline float bf16_bits_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}
inline uint16_t float_to_bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

inline void File::close() {
    if (!f) return;
    bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    f = nullptr;
    if (!ok) fail("%s: write failed (%s)", path.c_str(), strerror(errno));
}

// `bytes` written under PATH.tmp and renamed into place: a run that fails leaves no half file, and a file already
// at `path` stays whole until the new one replaces it
inline void write_file_whole(const std::string& path, const void* bytes, size_t size) {
    std::string tmp = path + ".tmp";
    File f(tmp, "wb");
    f.write(bytes, size);
    f.close();
    if (rename(tmp.c_str(), path.c_str()) != 0) fail("%s: cannot rename %s into place (%s)", path.c_str(), tmp.c_str(), strerror(errno));
}
inline void write_file_whole(const std::string& path, const std::string& text) {
    write_file_whole(path, text.data(), text.size());
}

inline bool file_exists(const std::string& p) {
    FILE* f = fopen(p.c_str(), "rb");
    if (f) fclose(f);
    return f != nullptr;
}

// seconds on the monotonic clock, for timing and deadlines
inline double now_seconds() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ----------------------------------------------------------------------------------------------------------
// random numbers: a 64-bit xorshift* generator whose whole state is one integer, so checkpoints can save
// and restore it exactly.

struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed = 1337) { reseed(seed); }
    void reseed(uint64_t seed) {
        // splitmix64 scrambles small seeds so that seeds 1, 2, 3 give unrelated streams
        uint64_t z = seed + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        state = (z ^ (z >> 31)) | 1;
    }
    uint64_t next_u64() {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        return state * 0x2545F4914F6CDD1Dull;
    }
    float uniform() { return (next_u64() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
    uint64_t below(uint64_t n) { return next_u64() % n; }
    float normal(float mean, float std) {
        // Box-Muller; 1 - uniform() keeps the log's argument in (0, 1]
        float u1 = 1.0f - uniform(), u2 = uniform();
        return mean + std * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
    }
    template <typename T>
    void shuffle(std::vector<T>& v) {
        for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[below(i)]);
    }
};

inline std::string strfmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string strfmt(const char* fmt, ...) {
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

// Decodes token ids back to bytes with llm.c's tokenizer file (256 x uint32 header: magic 20240328,
// version 2, vocab size, EOT id; then per token a uint8 length and that many raw bytes), which is how the
// trainer prints samples. Tokens are byte strings, not necessarily valid UTF-8 on their own: a multi-byte
// character may be split across tokens, so callers concatenate before printing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "llmc/utils.h"

constexpr uint32_t TOKENIZER_MAGIC = 20240328;
constexpr uint32_t TOKENIZER_VERSION = 2;
constexpr int TOKENIZER_HEADER_INTS = 256;

struct Tokenizer {
    int vocab_size = 0;
    int eot = 0;
    std::string path;
    std::vector<std::string> tokens;

    explicit Tokenizer(const std::string& path_) : path(path_) {
        File f(path, "rb");
        const long size = f.size();
        const long header_bytes = TOKENIZER_HEADER_INTS * sizeof(uint32_t);
        if (size < header_bytes)
            fail("%s: truncated: %ld bytes, too short for the %ld-byte tokenizer header", path.c_str(), size,
                 header_bytes);
        uint32_t header[TOKENIZER_HEADER_INTS];
        f.read(header, sizeof(header));
        if (header[0] != TOKENIZER_MAGIC)
            fail("%s: bad magic number %u (expected %u): not a tokenizer file", path.c_str(), header[0],
                 TOKENIZER_MAGIC);
        if (header[1] != TOKENIZER_VERSION)
            fail("%s: unsupported version %u (expected %u)", path.c_str(), header[1], TOKENIZER_VERSION);
        if (header[2] == 0 || header[2] > (uint32_t)INT32_MAX)
            fail("%s: invalid vocab size %u", path.c_str(), header[2]);
        vocab_size = (int)header[2];
        if (header[3] >= header[2])
            fail("%s: EOT id %u is out of range for vocab size %d", path.c_str(), header[3], vocab_size);
        eot = (int)header[3];

        // one read of the body; a per-token fread would make a 50k-token file a 100k-call affair
        std::vector<unsigned char> body((size_t)(size - header_bytes));
        if (!body.empty()) f.read(body.data(), body.size());
        tokens.resize(vocab_size);
        size_t at = 0;
        for (int id = 0; id < vocab_size; id++) {
            if (at >= body.size()) fail("%s: truncated: ends after %d of %d tokens", path.c_str(), id, vocab_size);
            const size_t len = body[at++];
            if (len == 0) fail("%s: token %d has zero length", path.c_str(), id);
            if (at + len > body.size())
                fail("%s: truncated: token %d needs %zu bytes, %zu are left", path.c_str(), id, len, body.size() - at);
            tokens[id].assign(reinterpret_cast<const char*>(body.data() + at), len);
            at += len;
        }
        // leftover bytes mean the header's vocab size does not describe this file
        if (at != body.size())
            fail("%s: %zu bytes after the last of %d tokens (vocab size wrong?)", path.c_str(), body.size() - at,
                 vocab_size);
    }

    const std::string& decode(int id) const {
        if (id < 0 || id >= vocab_size)
            fail("%s: cannot decode token id %d: out of range for vocab size %d", path.c_str(), id, vocab_size);
        return tokens[id];
    }

    std::string decode(const std::vector<int>& ids) const {
        std::string out;
        for (int id : ids) out += decode(id);
        return out;
    }
};

// Reads training batches from token shards in llm.c's formats: a 256 x int32 header (magic, version, token
// count), then the tokens, uint16 in GPT-2's format (magic 20240520, version 1) and uint32 in Llama 3's (magic
// 20240801, version 7: a vocab of 128,256 does not fit 16 bits). Each shard's header says its format; the shards
// of one run share one, since two formats mean two tokenizers. The unit of the read order is the global batch: -d
// consecutive tokens (plus one for the last target), cut into rows of T. Shuffling permutes whole global batches
// (and shards), and each global batch is then sliced the same fixed way among micro-steps and data-parallel ranks,
// so the tokens an optimizer step sees depend on the data, the seed, T and the global batch size alone, never on B
// or the number of ranks. The order is a pure function of (seed, epoch, shard, global batch), so the loader's whole
// position is three integers: a checkpoint saves them and a restored loader continues with exactly the batches an
// uninterrupted one would have produced, on every rank.
#pragma once

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "llmc/utils.h"

// llm.c's two token-shard formats (its dev/data/data_common.py's HEADERS_INFO)
struct ShardFormat {
    int32_t magic, version;
    int token_bytes;
    const char* name;
};
inline constexpr ShardFormat GPT2_SHARDS{20240520, 1, 2, "GPT-2 (uint16 tokens)"};
inline constexpr ShardFormat LLAMA3_SHARDS{20240801, 7, 4, "Llama 3 (uint32 tokens)"};
constexpr int SHARD_HEADER_INTS = 256;
constexpr long SHARD_HEADER_BYTES = SHARD_HEADER_INTS * sizeof(int32_t);

// The position of the next micro-batch: epoch, index into that epoch's shard order, and index of the micro-batch
// within that shard: global batch sample_pos / micro_steps of the shard's global-batch order, micro-step
// sample_pos % micro_steps. Always points at a micro-batch that exists (the loader rolls over eagerly).
struct DataLoaderState {
    uint64_t epoch = 0, shard_pos = 0, sample_pos = 0;
    bool operator==(const DataLoaderState& o) const {
        return epoch == o.epoch && shard_pos == o.shard_pos && sample_pos == o.sample_pos;
    }
    bool operator!=(const DataLoaderState& o) const { return !(*this == o); }
};

// Where a run stands in its data between optimizer steps, in units no layout changes: the epoch, the index into
// that epoch's shard order, and the global batch of the shard's order that the next step reads. What a
// checkpoint records, so that a run resumed with another -b or number of ranks reads the same batches.
struct DataPosition {
    uint64_t epoch = 0, shard_pos = 0, batch_pos = 0;
    bool operator==(const DataPosition& o) const {
        return epoch == o.epoch && shard_pos == o.shard_pos && batch_pos == o.batch_pos;
    }
};

// mixes a value into a hash; finalizer from splitmix64, so neighbouring epochs and shards get unrelated seeds
inline uint64_t dataloader_mix(uint64_t h, uint64_t v) {
    uint64_t z = h ^ (v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// the files a shard pattern (-i, -j) matches, in the order the loader numbers them
inline std::vector<std::string> shard_paths(const std::string& pat) {
    glob_t g;
    int rc = glob(pat.c_str(), 0, nullptr, &g);
    if (rc == GLOB_NOMATCH) fail("%s: no files match", pat.c_str());
    if (rc != 0) {
        globfree(&g);
        fail("%s: cannot expand the pattern (glob error %d)", pat.c_str(), rc);
    }
    std::vector<std::string> paths(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    // glob sorts already; sorting again makes the order independent of the locale's collation
    std::sort(paths.begin(), paths.end());
    return paths;
}

struct DataLoader {
    struct Shard {
        std::string path;
        const ShardFormat* format;
        size_t num_tokens;
        size_t num_samples;  // global batches this shard holds
    };

    int B, T, rank, world;
    size_t global_batch;  // tokens per global batch (-d): world * B * T * micro_steps
    size_t micro_steps;   // next_batch() calls per global batch on each rank
    bool shuffle;
    uint64_t seed;
    int vocab_size;
    std::string pattern;
    std::vector<Shard> shards;  // in sorted file order
    size_t total_tokens = 0;
    size_t batches_per_epoch = 0;

    std::vector<int> inputs, targets;  // B*T each, filled by next_batch()

    DataLoader(const std::string& glob_pattern, int B_, int T_, long global_batch_, int rank_, int world_, bool shuffle_,
               uint64_t seed_, int vocab_size_)
        : B(B_),
          T(T_),
          rank(rank_),
          world(world_),
          global_batch((size_t)global_batch_),
          micro_steps(0),
          shuffle(shuffle_),
          seed(seed_),
          vocab_size(vocab_size_),
          pattern(glob_pattern) {
        if (B < 1 || T < 1) fail("dataloader: batch size B=%d and sequence length T=%d must be >= 1", B, T);
        if (world < 1) fail("dataloader: world size %d must be >= 1", world);
        if (rank < 0 || rank >= world) fail("dataloader: rank %d is out of range for world size %d", rank, world);
        if (vocab_size < 1) fail("dataloader: vocab size %d must be >= 1", vocab_size);
        const size_t micro_batch = (size_t)world * B * T;
        if (global_batch_ < 1 || global_batch % micro_batch != 0)
            fail("dataloader: global batch %ld tokens must be a positive multiple of world*B*T = %d*%d*%d", global_batch_,
                 world, B, T);
        micro_steps = global_batch / micro_batch;
        for (const std::string& path : shard_paths(glob_pattern)) shards.push_back(read_shard_header(path));
        for (const Shard& s : shards) {
            require_same_format(shards[0], s);
            total_tokens += s.num_tokens;
            batches_per_epoch += s.num_samples;
        }
        inputs.assign((size_t)B * T, 0);
        targets.assign((size_t)B * T, 0);
        reset();
    }

    // the format of every shard (the constructor refuses a mix)
    const ShardFormat& format() const { return *shards[0].format; }
    // two formats in one run are two tokenizers' ids, a mistake: refused with one line naming a file of each
    static void require_same_format(const Shard& a, const Shard& b) {
        if (a.format != b.format)
            fail("%s holds %s but %s holds %s: the shards of one run share one format (one tokenizer)", a.path.c_str(),
                 a.format->name, b.path.c_str(), b.format->name);
    }

    void reset() { restore(DataLoaderState{}); }
    // the position between steps (after a whole number of global batches), and a restore to one
    DataPosition position() const {
        if (pos.sample_pos % micro_steps != 0)
            fail("dataloader: at micro-step %llu of a global batch, not between steps",
                 (unsigned long long)(pos.sample_pos % micro_steps));
        return {pos.epoch, pos.shard_pos, pos.sample_pos / micro_steps};
    }
    void seek(const DataPosition& p) { restore(DataLoaderState{p.epoch, p.shard_pos, p.batch_pos * micro_steps}); }

    DataLoaderState state() const { return pos; }

    void restore(const DataLoaderState& s) {
        if (s.shard_pos >= shards.size())
            fail("dataloader state: shard position %llu is out of range (%s matches %zu shards)",
                 (unsigned long long)s.shard_pos, pattern.c_str(), shards.size());
        // checked before anything changes, so a rejected state leaves the loader where it was
        std::vector<size_t> order = shard_order_for(s.epoch);
        const Shard& shard = shards[order[s.shard_pos]];
        if (s.sample_pos >= shard.num_samples * micro_steps)
            fail("dataloader state: sample position %llu is out of range (%s holds %zu micro-batches)",
                 (unsigned long long)s.sample_pos, shard.path.c_str(), shard.num_samples * micro_steps);
        // the shard is read (and its tokens checked) now, so a bad file stops the run before training starts
        load_tokens(order[s.shard_pos]);
        pos = s;
        shard_order = std::move(order);
        make_sample_order();
    }

    // this rank's B rows of the next micro-step: micro-step m gives rank r rows (m*world + r)*B onwards of the
    // global batch, so the micro-steps and ranks of one step together read each of its rows once
    void next_batch() {
        const size_t shard_index = shard_order[pos.shard_pos];
        load_tokens(shard_index);
        const size_t sample = sample_order[pos.sample_pos / micro_steps], micro = pos.sample_pos % micro_steps;
        const size_t bt = (size_t)B * T;
        const size_t window = sample * global_batch + (micro * world + rank) * bt;
        for (size_t i = 0; i < bt; i++) {
            inputs[i] = (int)loaded_token(window + i);
            targets[i] = (int)loaded_token(window + i + 1);
        }
        advance();
    }

    // ------------------------------------------------------------------------------------------------------
   private:
    DataLoaderState pos;
    std::vector<size_t> shard_order;   // this epoch's permutation of shard indices
    std::vector<size_t> sample_order;  // the current shard's permutation of sample indices
    std::vector<unsigned char> loaded_bytes;  // the loaded shard's tokens as its file stores them
    size_t loaded_shard = SIZE_MAX;

    // token i of the loaded shard, in the width of its format (memcpy: the bytes are not an array of that type)
    uint32_t loaded_token(size_t i) const {
        if (format().token_bytes == 2) {
            uint16_t t;
            memcpy(&t, loaded_bytes.data() + 2 * i, 2);
            return t;
        }
        uint32_t t;
        memcpy(&t, loaded_bytes.data() + 4 * i, 4);
        return t;
    }

    Shard read_shard_header(const std::string& path) const {
        struct stat st;
        if (stat(path.c_str(), &st) != 0) fail("%s: cannot open (%s)", path.c_str(), strerror(errno));
        if (!S_ISREG(st.st_mode)) fail("%s: not a regular file", path.c_str());
        File f(path, "rb");
        long size = f.size();
        if (size < SHARD_HEADER_BYTES)
            fail("%s: too short for a shard header (%ld bytes, need %ld)", path.c_str(), size, SHARD_HEADER_BYTES);
        int32_t header[SHARD_HEADER_INTS];
        f.read(header, sizeof(header));
        const ShardFormat* format = header[0] == GPT2_SHARDS.magic     ? &GPT2_SHARDS
                                    : header[0] == LLAMA3_SHARDS.magic ? &LLAMA3_SHARDS
                                                                       : nullptr;
        if (!format)
            fail("%s: bad magic number %d (expected %d, GPT-2's, or %d, Llama 3's): not a token shard", path.c_str(),
                 header[0], GPT2_SHARDS.magic, LLAMA3_SHARDS.magic);
        if (header[1] != format->version)
            fail("%s: unsupported version %d (expected %d for magic %d)", path.c_str(), header[1], format->version,
                 format->magic);
        const long long count = header[2];
        const long long expected = SHARD_HEADER_BYTES + format->token_bytes * count;
        if (count < 0 || expected != size)
            fail("%s: file size %ld bytes disagrees with the header's token count %lld (expected %lld bytes)",
                 path.c_str(), size, count, expected);
        if ((size_t)count < global_batch + 1)
            fail("%s: only %lld tokens, fewer than one global batch needs (%zu: -d %zu plus one for the last target)",
                 path.c_str(), count, global_batch + 1, global_batch);
        return Shard{path, format, (size_t)count, ((size_t)count - 1) / global_batch};
    }

    std::vector<size_t> shard_order_for(uint64_t epoch) const {
        std::vector<size_t> order(shards.size());
        std::iota(order.begin(), order.end(), size_t(0));
        if (shuffle) {
            // the all-ones tag keeps this stream apart from the per-shard sample streams below
            Rng rng(dataloader_mix(dataloader_mix(seed, epoch), ~0ull));
            rng.shuffle(order);
        }
        return order;
    }

    void make_sample_order() {
        const size_t shard_index = shard_order[pos.shard_pos];
        sample_order.resize(shards[shard_index].num_samples);
        std::iota(sample_order.begin(), sample_order.end(), size_t(0));
        if (shuffle) {
            Rng rng(dataloader_mix(dataloader_mix(seed, pos.epoch), shard_index));
            rng.shuffle(sample_order);
        }
    }

    // reads the whole shard (random sample order makes seeking per batch no cheaper) and checks every token
    // once, so a bad token is reported with its position instead of surfacing as a wild embedding lookup
    void load_tokens(size_t shard_index) {
        if (loaded_shard == shard_index) return;
        loaded_shard = SIZE_MAX;
        const Shard& shard = shards[shard_index];
        File f(shard.path, "rb");
        int32_t header[SHARD_HEADER_INTS];
        f.read(header, sizeof(header));
        if (header[0] != shard.format->magic || header[1] != shard.format->version ||
            header[2] != (int32_t)shard.num_tokens)
            fail("%s: header changed since the dataloader opened it", shard.path.c_str());
        loaded_bytes.resize(shard.num_tokens * shard.format->token_bytes);
        f.read(loaded_bytes.data(), loaded_bytes.size());
        for (size_t i = 0; i < shard.num_tokens; i++)
            if (loaded_token(i) >= (uint32_t)vocab_size)
                fail("%s: token %u at position %zu is out of range for vocab size %d", shard.path.c_str(),
                     loaded_token(i), i, vocab_size);
        loaded_shard = shard_index;
    }

    void advance() {
        pos.sample_pos++;
        if (pos.sample_pos < sample_order.size() * micro_steps) return;
        pos.sample_pos = 0;
        pos.shard_pos++;
        if (pos.shard_pos == shards.size()) {
            pos.shard_pos = 0;
            pos.epoch++;
            shard_order = shard_order_for(pos.epoch);
        }
        make_sample_order();
    }
};

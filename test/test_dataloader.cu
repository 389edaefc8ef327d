// Tests of the token-shard dataloader: headers and totals, how a global batch is sliced across ranks and
// micro-steps, an order that does not depend on B or the ranks, deterministic shuffling with exact resume from
// state(), GPT-2's uint16 shards and Llama 3's uint32 ones read alike, and a clear error for every kind of bad
// shard.
#include <climits>
#include <map>
#include <set>
#include <tuple>

#include "llmc/dataloader.h"
#include "test_helpers.h"

namespace test_dataloader {

const int GPT2_VOCAB = 50257;
const int LLAMA3_VOCAB = 128256;

// shards whose tokens are all distinct (a shuffled range of ids from `first` on), so any window identifies where
// it was read from; written in Llama 3's format (uint32) when `wide`, else GPT-2's (uint16)
struct DistinctShards {
    std::vector<std::vector<uint32_t>> tokens;       // per shard, in file order: what the files hold
    std::map<int, std::pair<size_t, size_t>> where;  // token -> (shard, position)
    int vocab;                                       // the format's vocab: every id is below it
    DistinctShards(const TempDir& dir, const std::vector<size_t>& sizes, uint64_t seed, bool wide = false,
                   uint32_t first = 0)
        : vocab(wide ? LLAMA3_VOCAB : GPT2_VOCAB) {
        size_t total = 0;
        for (size_t n : sizes) total += n;
        REQUIRE(first + total <= (size_t)vocab);
        std::vector<uint32_t> values(total);
        for (size_t i = 0; i < total; i++) values[i] = first + (uint32_t)i;
        Rng rng(seed);
        rng.shuffle(values);
        size_t at = 0;
        for (size_t s = 0; s < sizes.size(); s++) {
            tokens.emplace_back(values.begin() + at, values.begin() + at + sizes[s]);
            for (size_t i = 0; i < sizes[s]; i++) where[tokens[s][i]] = {s, i};
            at += sizes[s];
            const std::string path = dir / strfmt("shard_%03zu.bin", s);
            if (wide) write_shard(path, tokens[s]);
            else write_shard(path, std::vector<uint16_t>(tokens[s].begin(), tokens[s].end()));
        }
    }
};

// where the loader's current batch was read from: (shard, first token's position)
std::pair<size_t, size_t> locate(const DataLoader& dl, const DistinctShards& data) {
    auto it = data.where.find(dl.inputs[0]);
    REQUIRE(it != data.where.end());
    const size_t shard = it->second.first, start = it->second.second;
    const size_t bt = (size_t)dl.B * dl.T;
    const std::vector<uint32_t>& raw = data.tokens[shard];
    REQUIRE(start + bt + 1 <= raw.size());
    for (size_t i = 0; i < bt; i++) {
        REQUIRE((uint32_t)dl.inputs[i] == raw[start + i]);
        REQUIRE((uint32_t)dl.targets[i] == raw[start + i + 1]);
    }
    return {shard, start};
}

std::vector<std::pair<size_t, size_t>> read_order(DataLoader& dl, const DistinctShards& data, size_t steps) {
    std::vector<std::pair<size_t, size_t>> order;
    for (size_t i = 0; i < steps; i++) {
        dl.next_batch();
        order.push_back(locate(dl, data));
    }
    return order;
}

std::vector<std::vector<int>> read_batches(DataLoader& dl, size_t steps) {
    std::vector<std::vector<int>> out;
    for (size_t i = 0; i < steps; i++) {
        dl.next_batch();
        out.push_back(dl.inputs);
        out.push_back(dl.targets);
    }
    return out;
}

TEST_CASE("dataloader: headers, totals and batches per epoch", "[dataloader]") {
    TempDir dir;
    Rng rng(1);
    // written out of order to check that the loader sorts the file names
    write_shard(dir / "train_002.bin", random_tokens(513, GPT2_VOCAB, rng));
    write_shard(dir / "train_000.bin", random_tokens(1000, GPT2_VOCAB, rng));
    write_shard(dir / "train_001.bin", random_tokens(777, GPT2_VOCAB, rng));
    write_shard(dir / "val_000.bin", random_tokens(300, GPT2_VOCAB, rng));

    DataLoader dl(dir / "train_*.bin", 2, 8, 16, 0, 1, false, 0, GPT2_VOCAB);
    REQUIRE(dl.shards.size() == 3);
    REQUIRE(dl.shards[0].path == dir / "train_000.bin");
    REQUIRE(dl.shards[1].path == dir / "train_001.bin");
    REQUIRE(dl.shards[2].path == dir / "train_002.bin");
    REQUIRE(dl.total_tokens == 1000 + 777 + 513);
    // a sample needs 16 tokens plus one for the last target
    REQUIRE(dl.shards[0].num_samples == 999 / 16);
    REQUIRE(dl.batches_per_epoch == 999 / 16 + 776 / 16 + 512 / 16);
    REQUIRE(dl.inputs.size() == 16);
    REQUIRE(dl.targets.size() == 16);

    DataLoader dl4(dir / "train_*.bin", 2, 8, 64, 3, 4, true, 7, GPT2_VOCAB);
    REQUIRE(dl4.batches_per_epoch == 999 / 64 + 776 / 64 + 512 / 64);
    REQUIRE(dl4.global_batch == 64);
    REQUIRE(dl4.micro_steps == 1);

    // exactly one global batch plus one token is the smallest shard that works
    write_shard(dir / "tiny.bin", random_tokens(4 * 2 * 8 + 1, GPT2_VOCAB, rng));
    DataLoader tiny(dir / "tiny.bin", 2, 8, 64, 3, 4, false, 0, GPT2_VOCAB);
    REQUIRE(tiny.batches_per_epoch == 1);
}

TEST_CASE("dataloader: one pass reads every window of every global batch exactly once across ranks and micro-steps",
          "[dataloader]") {
    // GPT-2's format, and Llama 3's with ids on both sides of 65,535 (a 16-bit read would wrap the ones above)
    const bool wide = GENERATE(false, true);
    INFO((wide ? "Llama 3's" : "GPT-2's") << " format");
    TempDir dir;
    // sizes leave a ragged tail in each shard that no global batch covers
    DistinctShards data(dir, {1201, 950, 2048, 613}, 42, wide, wide ? 63000 : 0);
    const int B = 2, T = 5;
    const size_t bt = (size_t)B * T;
    for (int world : {1, 2, 3, 4}) {
        for (size_t micro_steps : {1, 2, 3}) {
            for (bool shuffle : {false, true}) {
                INFO("world " << world << ", " << micro_steps << " micro-steps, shuffle " << shuffle);
                const size_t global = micro_steps * world * bt;
                std::vector<DataLoader> ranks;
                for (int r = 0; r < world; r++)
                    ranks.emplace_back(dir / "shard_*.bin", B, T, (long)global, r, world, shuffle, 99, data.vocab);
                std::set<std::pair<size_t, size_t>> seen;
                for (size_t step = 0; step < ranks[0].batches_per_epoch; step++) {
                    size_t batch_shard = 0, batch_start = 0;
                    for (size_t m = 0; m < micro_steps; m++)
                        for (int r = 0; r < world; r++) {
                            ranks[r].next_batch();
                            auto [shard, start] = locate(ranks[r], data);
                            // every rank and micro-step reads its fixed slice of the same global batch
                            const size_t slice = (m * world + r) * bt;
                            if (m == 0 && r == 0) {
                                REQUIRE(start % global == 0);
                                batch_shard = shard;
                                batch_start = start;
                            }
                            REQUIRE(shard == batch_shard);
                            REQUIRE(start == batch_start + slice);
                            REQUIRE(seen.insert({shard, start}).second);
                        }
                }
                std::set<std::pair<size_t, size_t>> expected;
                for (size_t s = 0; s < data.tokens.size(); s++)
                    for (size_t k = 0; k < (data.tokens[s].size() - 1) / global; k++)
                        for (size_t w = 0; w < global / bt; w++) expected.insert({s, k * global + w * bt});
                REQUIRE(seen == expected);
                for (auto& dl : ranks) REQUIRE(dl.state() == DataLoaderState{1, 0, 0});
            }
        }
    }
}

TEST_CASE("dataloader: the rows of every step depend on the data, seed, T and global batch alone, not on B or ranks",
          "[dataloader]") {
    TempDir dir;
    DistinctShards data(dir, {700, 455, 981}, 8);
    const int T = 5;
    // the rows of `steps` steps in the global batch's order: micro-step m, rank r, row b is row (m*world + r)*B + b
    auto rows_of = [&](int B, int world, bool shuffle, size_t steps, long global) {
        std::vector<DataLoader> ranks;
        for (int r = 0; r < world; r++) ranks.emplace_back(dir / "shard_*.bin", B, T, global, r, world, shuffle, 5, GPT2_VOCAB);
        std::vector<std::pair<size_t, size_t>> rows;
        for (size_t step = 0; step < steps; step++)
            for (size_t m = 0; m < ranks[0].micro_steps; m++)
                for (DataLoader& dl : ranks) {
                    dl.next_batch();
                    auto [shard, start] = locate(dl, data);
                    for (int b = 0; b < B; b++) rows.push_back({shard, start + (size_t)b * T});
                }
        return rows;
    };
    const size_t steps = 2 * (699 / 60 + 454 / 60 + 980 / 60) + 3;  // two epochs of 60-token steps, and more
    for (bool shuffle : {true, false}) {
        INFO("shuffle " << shuffle);
        const auto reference = rows_of(1, 1, shuffle, steps, 60);  // 12 micro-steps of one row
        for (auto [B, world] : std::vector<std::pair<int, int>>{{2, 1}, {12, 1}, {3, 2}, {6, 2}, {2, 3}, {1, 4}, {3, 4}}) {
            INFO("B " << B << ", " << world << " ranks");
            REQUIRE(rows_of(B, world, shuffle, steps, 60) == reference);
        }
    }
    // the shuffle does move the rows, and another global batch size shuffles other units
    REQUIRE(rows_of(1, 1, true, steps, 60) != rows_of(1, 1, false, steps, 60));
    REQUIRE(rows_of(1, 1, true, 2 * steps, 30) != rows_of(1, 1, true, steps, 60));
}

TEST_CASE("dataloader: order, shuffling and exact resume", "[dataloader]") {
    TempDir dir;
    DistinctShards data(dir, {400, 333, 520, 275, 610}, 5);
    const std::string pattern = dir / "shard_*.bin";
    const int B = 3, T = 4;  // 12 tokens per sample: 33 + 27 + 43 + 22 + 50 samples
    DataLoader probe(pattern, B, T, B * T, 0, 1, false, 0, GPT2_VOCAB);
    const size_t epoch = probe.batches_per_epoch;
    REQUIRE(epoch == 33 + 27 + 43 + 22 + 50);

    SECTION("shuffle off reads files in order and samples in order, every epoch") {
        DataLoader dl(pattern, B, T, B * T, 0, 1, false, 1234, GPT2_VOCAB);
        auto order = read_order(dl, data, 2 * epoch);
        size_t i = 0;
        for (int e = 0; e < 2; e++)
            for (size_t s = 0; s < data.tokens.size(); s++)
                for (size_t k = 0; k < dl.shards[s].num_samples; k++, i++)
                    REQUIRE(order[i] == std::make_pair(s, k * B * T));
    }

    SECTION("same seed gives the same sequence, another seed another order") {
        DataLoader a(pattern, B, T, B * T, 0, 1, true, 1234, GPT2_VOCAB);
        DataLoader b(pattern, B, T, B * T, 0, 1, true, 1234, GPT2_VOCAB);
        DataLoader c(pattern, B, T, B * T, 0, 1, true, 4321, GPT2_VOCAB);
        DataLoader off(pattern, B, T, B * T, 0, 1, false, 1234, GPT2_VOCAB);
        auto oa = read_order(a, data, 2 * epoch);
        auto ob = read_order(b, data, 2 * epoch);
        auto oc = read_order(c, data, 2 * epoch);
        auto ooff = read_order(off, data, 2 * epoch);
        REQUIRE(oa == ob);
        REQUIRE(oa != oc);
        REQUIRE(oa != ooff);
        // each epoch is a permutation of the same samples, drawn afresh
        std::vector<std::pair<size_t, size_t>> e0(oa.begin(), oa.begin() + epoch), e1(oa.begin() + epoch, oa.end());
        REQUIRE(e0 != e1);
        std::sort(e0.begin(), e0.end());
        std::sort(e1.begin(), e1.end());
        std::vector<std::pair<size_t, size_t>> in_order(ooff.begin(), ooff.begin() + epoch);
        REQUIRE(e0 == in_order);
        REQUIRE(e1 == in_order);
        // the shard order is shuffled too, not just the samples inside each shard
        std::vector<size_t> shard_sequence;
        for (auto& w : std::vector<std::pair<size_t, size_t>>(oa.begin(), oa.begin() + epoch))
            if (shard_sequence.empty() || shard_sequence.back() != w.first) shard_sequence.push_back(w.first);
        REQUIRE(shard_sequence.size() == data.tokens.size());  // each shard is read in one stretch
        std::vector<std::vector<size_t>> shard_orders;
        for (uint64_t seed = 0; seed < 8; seed++) {
            DataLoader d(pattern, B, T, B * T, 0, 1, true, seed, GPT2_VOCAB);
            std::vector<size_t> seq;
            for (auto& w : read_order(d, data, epoch))
                if (seq.empty() || seq.back() != w.first) seq.push_back(w.first);
            shard_orders.push_back(seq);
        }
        REQUIRE(std::set<std::vector<size_t>>(shard_orders.begin(), shard_orders.end()).size() > 1);
    }

    SECTION("restore continues exactly like an uninterrupted loader") {
        for (bool shuffle : {true, false}) {
            DataLoader reference(pattern, B, T, B * T, 0, 1, shuffle, 77, GPT2_VOCAB);
            const size_t total = 2 * epoch + 10;
            auto expected = read_batches(reference, total);
            // mid-shard, the first shard boundary, the last batch of an epoch, the epoch boundary, beyond it
            for (size_t k : {size_t(0), size_t(5), size_t(33), epoch - 1, epoch, epoch + 1, epoch + 40}) {
                INFO("shuffle " << shuffle << ", restored after " << k << " batches");
                DataLoader first(pattern, B, T, B * T, 0, 1, shuffle, 77, GPT2_VOCAB);
                read_batches(first, k);
                const DataLoaderState saved = first.state();
                REQUIRE(saved.epoch == k / epoch);
                DataLoader resumed(pattern, B, T, B * T, 0, 1, shuffle, 77, GPT2_VOCAB);
                resumed.next_batch();  // a loader that has already moved on is restored just the same
                resumed.restore(saved);
                REQUIRE(resumed.state() == saved);
                auto rest = read_batches(resumed, total - k);
                REQUIRE(std::equal(rest.begin(), rest.end(), expected.begin() + 2 * k));
            }
        }
    }

    SECTION("with micro-steps, restore continues exactly, also between the micro-steps of a global batch") {
        const long global = 3 * B * T;
        DataLoader reference(pattern, B, T, global, 0, 1, true, 77, GPT2_VOCAB);
        const size_t micro_epoch = reference.batches_per_epoch * 3;
        const size_t total = micro_epoch + 10;
        auto expected = read_batches(reference, total);
        for (size_t k : {size_t(1), size_t(2), size_t(3), micro_epoch - 1, micro_epoch, micro_epoch + 4}) {
            INFO("restored after " << k << " micro-batches");
            DataLoader first(pattern, B, T, global, 0, 1, true, 77, GPT2_VOCAB);
            read_batches(first, k);
            DataLoader resumed(pattern, B, T, global, 0, 1, true, 77, GPT2_VOCAB);
            resumed.restore(first.state());
            auto rest = read_batches(resumed, total - k);
            REQUIRE(std::equal(rest.begin(), rest.end(), expected.begin() + 2 * k));
        }
    }

    SECTION("reset goes back to the start of epoch 0") {
        DataLoader dl(pattern, B, T, B * T, 0, 1, true, 9, GPT2_VOCAB);
        auto first = read_batches(dl, epoch + 3);
        REQUIRE(dl.state().epoch == 1);
        dl.reset();
        REQUIRE(dl.state() == DataLoaderState{0, 0, 0});
        auto again = read_batches(dl, epoch + 3);
        REQUIRE(first == again);
    }

    SECTION("a state that does not fit the data is rejected") {
        DataLoader dl(pattern, B, T, B * T, 0, 1, true, 9, GPT2_VOCAB);
        REQUIRE_THROWS_WITH(dl.restore(DataLoaderState{0, 5, 0}), Catch::Contains("shard position 5"));
        REQUIRE_THROWS_WITH(dl.restore(DataLoaderState{3, 0, 1000}), Catch::Contains("sample position 1000"));
        // and leaves the loader where it was
        REQUIRE(dl.state() == DataLoaderState{0, 0, 0});
        DataLoader fresh(pattern, B, T, B * T, 0, 1, true, 9, GPT2_VOCAB);
        REQUIRE(read_batches(dl, epoch + 2) == read_batches(fresh, epoch + 2));
    }
}

TEST_CASE("dataloader: GPT-2's and Llama 3's shards of the same ids give the same batches on every layout, and "
          "resume alike",
          "[dataloader]") {
    TempDir narrow_dir, wide_dir;
    // the same ids in both formats: below 65,536 so that GPT-2's holds them, above 32,767 so that a signed read shows
    DistinctShards narrow(narrow_dir, {700, 455, 981}, 8, false, 40000), wide(wide_dir, {700, 455, 981}, 8, true, 40000);
    REQUIRE(narrow.tokens == wide.tokens);
    const int T = 5;
    struct Layout {
        int B, world;
        size_t micro_steps;
    };
    for (Layout l : {Layout{2, 1, 1}, Layout{2, 2, 3}, Layout{1, 4, 2}, Layout{3, 3, 1}})
        for (bool shuffle : {false, true}) {
            INFO("B " << l.B << ", " << l.world << " ranks, " << l.micro_steps << " micro-steps, shuffle " << shuffle);
            const long global = (long)l.micro_steps * l.world * l.B * T;
            std::vector<DataLoader> a, b;
            for (int r = 0; r < l.world; r++) {
                a.emplace_back(narrow_dir / "shard_*.bin", l.B, T, global, r, l.world, shuffle, 3, LLAMA3_VOCAB);
                b.emplace_back(wide_dir / "shard_*.bin", l.B, T, global, r, l.world, shuffle, 3, LLAMA3_VOCAB);
            }
            REQUIRE(&a[0].format() == &GPT2_SHARDS);
            REQUIRE(&b[0].format() == &LLAMA3_SHARDS);
            REQUIRE(a[0].batches_per_epoch == b[0].batches_per_epoch);
            // a pass and more, every batch checked against the tokens written to the files
            for (size_t k = 0; k < (a[0].batches_per_epoch + 3) * l.micro_steps; k++)
                for (int r = 0; r < l.world; r++) {
                    a[r].next_batch();
                    b[r].next_batch();
                    REQUIRE(locate(a[r], narrow) == locate(b[r], wide));
                    REQUIRE(a[r].state() == b[r].state());
                }
        }
    // a Llama 3 loader restored from a GPT-2 loader's state continues as the GPT-2 one does
    DataLoader whole(narrow_dir / "shard_*.bin", 2, T, 20, 0, 1, true, 11, LLAMA3_VOCAB);
    const size_t total = 2 * whole.batches_per_epoch * 2 + 5;
    auto expected = read_batches(whole, total);
    for (size_t k : {size_t(7), whole.batches_per_epoch * 2 + 1}) {
        INFO("restored after " << k << " micro-batches");
        DataLoader first(narrow_dir / "shard_*.bin", 2, T, 20, 0, 1, true, 11, LLAMA3_VOCAB);
        read_batches(first, k);
        DataLoader resumed(wide_dir / "shard_*.bin", 2, T, 20, 0, 1, true, 11, LLAMA3_VOCAB);
        resumed.restore(first.state());
        auto rest = read_batches(resumed, total - k);
        REQUIRE(std::equal(rest.begin(), rest.end(), expected.begin() + 2 * k));
    }
}

TEST_CASE("dataloader: bad inputs give one-line errors naming the file and the reason", "[dataloader]") {
    TempDir dir;
    Rng rng(3);
    const std::string path = dir / "shard.bin";
    auto load = [&](const std::string& pattern, int vocab = GPT2_VOCAB) {
        return DataLoader(pattern, 2, 4, 8, 0, 1, false, 0, vocab);
    };

    SECTION("no files match") {
        const std::string pattern = dir / "nothing_*.bin";
        REQUIRE_THROWS_WITH(load(pattern), Catch::Contains(pattern) && Catch::Contains("no files match"));
    }
    SECTION("wrong magic") {
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng), 20240326);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("bad magic number 20240326"));
    }
    SECTION("wrong version") {
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng), GPT2_SHARDS.magic, 2);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("unsupported version 2"));
    }
    SECTION("file size disagrees with the token count") {
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng), GPT2_SHARDS.magic, GPT2_SHARDS.version, 101);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("file size 1224 bytes") &&
                                            Catch::Contains("token count 101"));
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng), GPT2_SHARDS.magic, GPT2_SHARDS.version, 99);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains("disagrees") && Catch::Contains("token count 99"));
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng), GPT2_SHARDS.magic, GPT2_SHARDS.version, -5);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains("disagrees") && Catch::Contains("token count -5"));
    }
    SECTION("too short for a header") {
        File f(path, "wb");
        f.write("abcdef", 6);
        f.close();
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("too short for a shard header"));
    }
    SECTION("fewer tokens than one global batch") {
        write_shard(path, random_tokens(3 * 2 * 4, GPT2_VOCAB, rng));  // world*B*T, one short
        REQUIRE_THROWS_WITH(
            DataLoader(path, 2, 4, 24, 1, 3, false, 0, GPT2_VOCAB),
            Catch::Contains(path) && Catch::Contains("fewer than one global batch") && Catch::Contains("25"));
        // the same file is fine for a single rank
        REQUIRE_NOTHROW(DataLoader(path, 2, 4, 8, 0, 1, false, 0, GPT2_VOCAB));
    }
    SECTION("a token outside the vocabulary") {
        auto tokens = random_tokens(100, GPT2_VOCAB, rng);
        tokens[37] = 50257;
        write_shard(path, tokens);
        // the first shard is read when the loader is made, so the run stops before it starts
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("token 50257 at position 37") &&
                                            Catch::Contains("vocab size 50257"));
        // in a later shard it is caught when that shard is first read
        write_shard(dir / "a_good.bin", random_tokens(9, GPT2_VOCAB, rng));  // one sample for B=2, T=4
        DataLoader two = load(dir / "*.bin");
        two.next_batch();
        REQUIRE_THROWS_WITH(two.next_batch(), Catch::Contains(path) && Catch::Contains("token 50257 at position 37"));
        // a bigger vocabulary accepts it
        DataLoader wide(path, 2, 4, 8, 0, 1, false, 0, 50304);
        REQUIRE_NOTHROW(wide.next_batch());
    }
    SECTION("a Llama 3 shard: its version, its size in 4-byte tokens, its tokens against the vocab") {
        std::vector<uint32_t> tokens(100);
        for (auto& t : tokens) t = 65536 + (uint32_t)rng.below(LLAMA3_VOCAB - 65536);
        write_shard(path, tokens, LLAMA3_SHARDS.magic, 1);
        REQUIRE_THROWS_WITH(load(path, LLAMA3_VOCAB), Catch::Contains(path) && Catch::Contains("unsupported version 1") &&
                                                          Catch::Contains("magic 20240801"));
        write_shard(path, tokens, LLAMA3_SHARDS.magic, LLAMA3_SHARDS.version, 101);
        REQUIRE_THROWS_WITH(load(path, LLAMA3_VOCAB), Catch::Contains(path) && Catch::Contains("file size 1424 bytes") &&
                                                          Catch::Contains("token count 101"));
        // the file as written: its first window is its first tokens, every one above 65,535
        write_shard(path, tokens);
        DataLoader dl = load(path, LLAMA3_VOCAB);
        dl.next_batch();
        for (size_t i = 0; i < 8; i++) {
            REQUIRE((uint32_t)dl.inputs[i] == tokens[i]);
            REQUIRE((uint32_t)dl.targets[i] == tokens[i + 1]);
        }
        tokens[37] = LLAMA3_VOCAB;
        write_shard(path, tokens);
        REQUIRE_THROWS_WITH(load(path, LLAMA3_VOCAB), Catch::Contains(path) &&
                                                          Catch::Contains("token 128256 at position 37") &&
                                                          Catch::Contains("vocab size 128256"));
        tokens[0] = UINT32_MAX;
        write_shard(path, tokens);
        REQUIRE_THROWS_WITH(load(path, LLAMA3_VOCAB), Catch::Contains("token 4294967295 at position 0"));
        // GPT-2's ids in Llama 3's format, one of them 65541: a 16-bit read would take it for 5
        std::vector<uint32_t> small(100);
        for (auto& t : small) t = (uint32_t)rng.below(GPT2_VOCAB);
        small[12] = 65541;
        write_shard(path, small);
        REQUIRE_THROWS_WITH(load(path), Catch::Contains(path) && Catch::Contains("token 65541 at position 12") &&
                                            Catch::Contains("vocab size 50257"));
    }
    SECTION("shards of both formats in one pattern") {
        write_shard(dir / "a.bin", random_tokens(100, GPT2_VOCAB, rng));
        write_shard(dir / "b.bin", std::vector<uint32_t>(100, 7));
        REQUIRE_THROWS_WITH(load(dir / "*.bin"), Catch::Contains(dir / "a.bin") && Catch::Contains("GPT-2 (uint16") &&
                                                     Catch::Contains(dir / "b.bin") && Catch::Contains("Llama 3 (uint32") &&
                                                     Catch::Contains("share one format"));
    }
    SECTION("a shard that disappears after the loader opened it") {
        write_shard(dir / "a.bin", random_tokens(9, GPT2_VOCAB, rng));  // one sample
        write_shard(dir / "b.bin", random_tokens(9, GPT2_VOCAB, rng));
        DataLoader dl = load(dir / "*.bin");
        dl.next_batch();
        REQUIRE(remove((dir / "b.bin").c_str()) == 0);
        REQUIRE_THROWS_WITH(dl.next_batch(), Catch::Contains(dir / "b.bin") && Catch::Contains("cannot open"));
    }
    SECTION("a directory that matches the pattern") {
        write_shard(dir / "a.bin", random_tokens(100, GPT2_VOCAB, rng));
        REQUIRE(mkdir((dir / "b.bin").c_str(), 0755) == 0);
        REQUIRE_THROWS_WITH(load(dir / "*.bin"),
                            Catch::Contains(dir / "b.bin") && Catch::Contains("not a regular file"));
    }
    SECTION("bad batch geometry or rank") {
        write_shard(path, random_tokens(100, GPT2_VOCAB, rng));
        REQUIRE_THROWS_WITH(DataLoader(path, 0, 4, 0, 0, 1, false, 0, GPT2_VOCAB), Catch::Contains("B=0"));
        REQUIRE_THROWS_WITH(DataLoader(path, 2, 0, 0, 0, 1, false, 0, GPT2_VOCAB), Catch::Contains("T=0"));
        REQUIRE_THROWS_WITH(DataLoader(path, 2, 4, 0, 0, 0, false, 0, GPT2_VOCAB), Catch::Contains("world size 0"));
        REQUIRE_THROWS_WITH(DataLoader(path, 2, 4, 16, -1, 2, false, 0, GPT2_VOCAB), Catch::Contains("rank -1"));
        REQUIRE_THROWS_WITH(DataLoader(path, 2, 4, 16, 2, 2, false, 0, GPT2_VOCAB), Catch::Contains("rank 2"));
        REQUIRE_THROWS_WITH(DataLoader(path, 2, 4, 8, 0, 1, false, 0, 0), Catch::Contains("vocab size 0"));
        for (long global : {0L, 12L, 24L})
            REQUIRE_THROWS_WITH(DataLoader(path, 2, 4, global, 0, 2, false, 0, GPT2_VOCAB),
                                Catch::Contains("global batch") && Catch::Contains("multiple of world*B*T"));
    }
}

}  // namespace test_dataloader

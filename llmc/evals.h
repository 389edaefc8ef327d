// Multiple-choice evals (HellaSwag, MMLU) as llm.c runs them during training: the file format its
// dev/data/data_common.py writes, the rows the model reads, and the scoring. An example is a context and a few
// completions, one of them right (the label). Each completion is scored by the mean loss of its tokens, each
// predicted from the context and the completion's tokens before it; the lowest loss is the model's answer.
//
// The file, little-endian: a header of 256 int32 [20240522, 1, number of examples, longest example in bytes],
// then every example as uint16s: 65535 (its start), its length in bytes (these fields included), its index
// (0, 1, ... in file order), the label, the number of completions, the context's token count and tokens, then
// each completion's token count and tokens. (data_common.py's comment calls the longest example's length
// uint16s; the value it writes, which this reader checks, is bytes.) Version 2, llm5d's own for vocabularies of
// more than 65,535 ids (Llama 3), where llm.c has none: the same stream in uint32 words, 0xffffffff its start.
//
// Every completion becomes one row: the context, then the completion, then padding. The row's targets at the
// positions that predict the completion's tokens carry them and are counted (the mask); the rest are ignored.
// The rows go through the model B at a time as validation batches do, so every layout scores them with the
// same forward; this file knows nothing of the model, only of rows and their losses. A row is as long as the
// longest example needs, rounded up to what the layout divides, not -t: multiple-choice examples are a few
// sentences, far shorter than GPT-2's 1024 positions, and causal attention makes the padding after a
// completion irrelevant to it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/utils.h"

constexpr int EVAL_MAGIC = 20240522;
constexpr int EVAL_VERSION = 1;       // llm.c's: uint16 words
constexpr int EVAL_VERSION_WIDE = 2;  // uint32 words
constexpr int EVAL_HEADER_INTS = 256;

struct EvalExample {
    int label;
    std::vector<int> context;
    std::vector<std::vector<int>> completions;
    // the row positions a completion takes: its context, and each of its tokens but the last as an input
    int row_length(int completion) const { return (int)(context.size() + completions[completion].size()) - 1; }
};

struct EvalSet {
    std::string path;
    std::vector<EvalExample> examples;
    std::vector<size_t> first_row;  // each example's first row, in the rows of the whole set
    size_t rows = 0;                // completions, all examples together
    int longest_row = 0;            // the most positions a completion takes

    // the row length to score with: longest_row rounded up to a multiple of `unit`, at most T
    int row_tokens(int T, int unit) const { return std::min(T, (longest_row + unit - 1) / unit * unit); }
};

// Reads and checks a whole eval file (HellaSwag's validation set is 3.6 MB): any damage, a token outside the
// model's vocab, or a completion that does not fit a row of T tokens is refused in one line naming the file
inline EvalSet read_eval_file(const std::string& path, int vocab_size, int T) {
    File f(path, "rb");
    long size = f.size();
    if (size < (long)(EVAL_HEADER_INTS * sizeof(int32_t)))
        fail("%s: %ld bytes, too short for an eval file's header of %zu", path.c_str(), size,
             EVAL_HEADER_INTS * sizeof(int32_t));
    int32_t header[EVAL_HEADER_INTS];
    f.read(header, sizeof(header));
    if (header[0] != EVAL_MAGIC)
        fail("%s: magic number %d, not an eval file's %d (a token shard is read with -i or -j)", path.c_str(),
             header[0], EVAL_MAGIC);
    if (header[1] != EVAL_VERSION && header[1] != EVAL_VERSION_WIDE)
        fail("%s: eval file version %d, not %d (uint16) or %d (uint32)", path.c_str(), header[1], EVAL_VERSION,
             EVAL_VERSION_WIDE);
    const size_t width = header[1] == EVAL_VERSION ? 2 : 4;  // bytes a word
    const uint32_t start = header[1] == EVAL_VERSION ? 0xffffu : 0xffffffffu;
    int count = header[2], longest = header[3];
    if (count < 1) fail("%s: the header says %d examples", path.c_str(), count);
    if ((size - sizeof(header)) % width)
        fail("%s: %ld bytes after the header, not whole %zu-byte words", path.c_str(), size - (long)sizeof(header),
             width);
    std::vector<uint32_t> words((size - sizeof(header)) / width);
    if (width == 2) {
        std::vector<uint16_t> narrow(words.size());
        f.read(narrow.data(), narrow.size() * 2);
        std::copy(narrow.begin(), narrow.end(), words.begin());
    } else {
        f.read(words.data(), words.size() * 4);
    }

    EvalSet set{path, {}, {}, 0, 0};
    size_t at = 0;
    int longest_seen = 0;
    for (int i = 0; i < count; i++) {
        auto where = [&] { return strfmt("%s: example %d (word %zu after the header)", path.c_str(), i, at); };
        if (at + 5 > words.size())
            fail("%s: the file ends after %d of the %d examples its header counts", path.c_str(), i, count);
        if (words[at] != start) fail("%s: starts with %u, not %u", where().c_str(), words[at], start);
        size_t length = words[at + 1] / width, end = at + length;
        if (words[at + 1] % width || length < 8 || end > words.size())
            fail("%s: a length of %u bytes, which the file cannot hold", where().c_str(), words[at + 1]);
        if (words[at + 2] != (uint32_t)i) fail("%s: its index is %u", where().c_str(), words[at + 2]);
        EvalExample e;
        uint32_t label = words[at + 3], completions = words[at + 4];
        if (completions < 1 || label >= completions || completions > (uint32_t)length)
            fail("%s: label %u of %u completions", where().c_str(), label, completions);
        e.label = (int)label;
        size_t next = at + 5;
        // a count and that many tokens, within the example; every token in the vocab
        auto tokens = [&](const char* what) {
            if (next < end && words[next] == 0) fail("%s: an empty %s", where().c_str(), what);
            if (next >= end || next + 1 + words[next] > end)
                fail("%s: the %s's token count runs past the example's %zu bytes", where().c_str(), what,
                     length * width);
            for (size_t k = next + 1; k < next + 1 + words[next]; k++)
                if (words[k] >= (uint32_t)vocab_size)
                    fail("%s: token %u in a %s, outside the model's vocab of %d", where().c_str(), words[k], what,
                         vocab_size);
            std::vector<int> out(words.begin() + next + 1, words.begin() + next + 1 + words[next]);
            next += 1 + words[next];
            return out;
        };
        e.context = tokens("context");
        for (uint32_t c = 0; c < completions; c++) {
            e.completions.push_back(tokens("completion"));
            set.longest_row = std::max(set.longest_row, e.row_length(c));
            if (e.row_length(c) > T)
                fail("%s: completion %u needs a row of %d tokens, more than -t %d", where().c_str(), c, e.row_length(c),
                     T);
        }
        if (next != end)
            fail("%s: %zu bytes in all, %zu more than its context and completions", where().c_str(), length * width,
                 (end - next) * width);
        longest_seen = std::max(longest_seen, (int)(length * width));
        set.first_row.push_back(set.rows);
        set.rows += completions;
        set.examples.push_back(std::move(e));
        at = end;
    }
    if (at != words.size())
        fail("%s: %zu bytes after the last of the %d examples its header counts", path.c_str(),
             (words.size() - at) * width, count);
    if (longest != longest_seen)
        fail("%s: the header says the longest example has %d bytes, the longest has %d", path.c_str(), longest,
             longest_seen);
    return set;
}

// dp rank `rank`'s share of the examples, [first, last): consecutive examples, as llm.c deals them
inline std::pair<int, int> eval_share(int examples, int rank, int ranks) {
    int per_rank = (examples + ranks - 1) / ranks;
    return {std::min(examples, rank * per_rank), std::min(examples, (rank + 1) * per_rank)};
}

// The losses of every row of the set, summed over the tokens of its completion, from `forward`: it runs B rows of
// T tokens (inputs, targets and the 0/1 mask of the positions to count, B×T each) and returns each row's sum of
// the counted losses. This rank runs the rows of its share, B at a time; every rank runs as many batches as the
// largest share needs (padding rows count nothing), since the ranks' forwards may be collective (ZeRO-3 gathers
// the parameters over dp). The rows of other shares stay 0: summed over the ranks, every row is filled once.
template <typename Forward>
inline std::vector<double> eval_row_losses(const EvalSet& set, int B, int T, int rank, int ranks, Forward forward) {
    int n = (int)set.examples.size();
    auto rows_of = [&](std::pair<int, int> share) {
        size_t end = share.second < n ? set.first_row[share.second] : set.rows;
        return share.first < share.second ? end - set.first_row[share.first] : 0;
    };
    size_t batches = 0;
    for (int r = 0; r < ranks; r++) batches = std::max(batches, (rows_of(eval_share(n, r, ranks)) + B - 1) / B);
    std::pair<int, int> mine = eval_share(n, rank, ranks);
    std::vector<std::pair<int, int>> rows;  // this rank's rows: (example, completion)
    for (int i = mine.first; i < mine.second; i++)
        for (int c = 0; c < (int)set.examples[i].completions.size(); c++) rows.push_back({i, c});

    std::vector<double> losses(set.rows, 0.0);
    std::vector<int> inputs((size_t)B * T), targets((size_t)B * T), mask((size_t)B * T);
    for (size_t batch = 0; batch < batches; batch++) {
        std::fill(inputs.begin(), inputs.end(), 0);
        std::fill(targets.begin(), targets.end(), 0);
        std::fill(mask.begin(), mask.end(), 0);
        for (int b = 0; b < B && batch * B + b < rows.size(); b++) {
            auto [i, c] = rows[batch * B + b];
            const EvalExample& e = set.examples[i];
            std::vector<int> tokens = e.context;
            tokens.insert(tokens.end(), e.completions[c].begin(), e.completions[c].end());
            int* in = &inputs[(size_t)b * T];
            for (int t = 0; t + 1 < (int)tokens.size(); t++) {
                in[t] = tokens[t];
                targets[(size_t)b * T + t] = tokens[t + 1];
                mask[(size_t)b * T + t] = t + 1 >= (int)e.context.size();  // the target is a completion token
            }
        }
        std::vector<double> sums = forward(inputs, targets, mask);
        for (int b = 0; b < B && batch * B + b < rows.size(); b++) {
            auto [i, c] = rows[batch * B + b];
            losses[set.first_row[i] + c] = sums[b];
        }
    }
    return losses;
}

// Each example's completions' mean losses, the model's answer (the lowest; the first of equals), and the
// accuracy, from the summed losses of every row of the set
struct EvalResult {
    std::vector<std::vector<double>> losses;
    std::vector<int> answers;
    int correct = 0;
    double accuracy() const { return (double)correct / answers.size(); }
};
inline EvalResult eval_score(const EvalSet& set, const std::vector<double>& row_losses) {
    EvalResult r;
    for (size_t i = 0; i < set.examples.size(); i++) {
        const EvalExample& e = set.examples[i];
        std::vector<double> mean;
        for (size_t c = 0; c < e.completions.size(); c++)
            mean.push_back(row_losses[set.first_row[i] + c] / e.completions[c].size());
        int answer = (int)(std::min_element(mean.begin(), mean.end()) - mean.begin());
        r.correct += answer == e.label;
        r.losses.push_back(mean);
        r.answers.push_back(answer);
    }
    return r;
}

// the scores example by example, as test/reference/eval_reference.py prints them: "INDEX LABEL ANSWER LOSS..."
// per example, then "accuracy CORRECT/N"
inline std::string eval_score_lines(const EvalSet& set, const EvalResult& r) {
    std::string text;
    for (size_t i = 0; i < set.examples.size(); i++) {
        text += strfmt("%zu %d %d", i, set.examples[i].label, r.answers[i]);
        for (double loss : r.losses[i]) text += strfmt(" %.9g", loss);
        text += "\n";
    }
    return text + strfmt("accuracy %d/%zu\n", r.correct, set.examples.size());
}

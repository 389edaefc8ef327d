// Command-line flags, llm.c-compatible where llm.c has them, each parsed and validated here so that a bad
// value stops the run before anything is allocated, with one line naming the flag.
#pragma once

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <type_traits>

#include "llmc/schedule.h"
#include "llmc/utils.h"

struct Options {
    std::string train_pattern = "data/sotu/train.bin";  // -i
    std::string val_pattern = "data/sotu/val.bin";      // -j
    std::string model = "d12";                          // -e: a model file or a descriptor
    std::string out_dir;                                // -o
    std::string tokenizer = "data/gpt2_tokenizer.bin";  // --tokenizer
    std::string device;                                 // --device: "" picks the best available
    int B = 4;                                          // -b
    int T = 1024;                                       // -t
    long total_batch = -1;                              // -d: tokens per optimizer step; -1 = B*T*ranks
    int max_steps = -1;                                 // -x: -1 = one epoch
    LRSchedule schedule;                                // -l -u -q -k
    float weight_decay = 0.0f;                          // -c
    int val_every = 20;                                 // -v
    int val_batches = 20;                               // -m
    int sample_every = 20;                              // -s
    int gen_tokens = 64;                                // -g
    int checkpoint_every = 0;                           // -n
    int checkpoints_keep = 0;                           // -nk
    bool resume = false;                                // -y
    bool overfit = false;                               // -a
    uint64_t seed = 1337;                               // --seed
    bool shuffle = true;                                // --shuffle
    bool plan = false;                                  // --plan
};

inline const char* USAGE =
    "usage: train_gpt [flags]\n"
    "  -i PATTERN   train token shards (glob)                 [data/sotu/train.bin]\n"
    "  -j PATTERN   val token shards (glob)                   [data/sotu/val.bin]\n"
    "  -e MODEL     llm.c model file (.bin, fp32 v3 or bf16 v5) or descriptor: d12 d24 d36 d48,\n"
    "               or d<L>c<C>h<NH>[t<maxT>][v<V>] e.g. d4c128h4            [d12]\n"
    "  -o DIR       output directory: main.log and checkpoints             [none]\n"
    "  -b N         micro-batch size per rank                              [4]\n"
    "  -t N         sequence length                                        [1024]\n"
    "  -d N         total batch size in tokens; gradient accumulation follows [b*t*ranks]\n"
    "  -x N         training steps; -1 = one epoch                         [-1]\n"
    "  -l LR        learning rate                                          [3e-4]\n"
    "  -u N         warmup steps                                           [0]\n"
    "  -q F         final learning rate as a fraction of -l                [1.0]\n"
    "  -k KIND      schedule: cosine, linear, constant                     [cosine]\n"
    "  -c WD        weight decay (2-D weights only)                        [0]\n"
    "  -v N         validate every N steps; 0 = never                      [20]\n"
    "  -m N         validation batches                                     [20]\n"
    "  -s N         sample every N steps; 0 = never                        [20]\n"
    "  -g N         tokens to generate when sampling (at most -t)          [64]\n"
    "  -n N         checkpoint every N steps; 0 = never (needs -o)         [0]\n"
    "  -nk N        keep the newest N checkpoints; 0 = all                 [0]\n"
    "  -y 0|1       resume from the newest complete checkpoint in -o       [0]\n"
    "  -a 0|1       overfit a single batch                                 [0]\n"
    "  --seed N     initialization, shuffling and sampling seed            [1337]\n"
    "  --shuffle 0|1  shuffle shard and batch order per epoch              [1]\n"
    "  --tokenizer PATH  tokenizer for decoding samples                    [data/gpt2_tokenizer.bin]\n"
    "  --device cpu|cuda  compute device                                   [cuda if a GPU is visible, else cpu]\n"
    "  --plan       print the predicted memory per category and exit\n"
    "  -h, --help   this text\n";

inline long parse_long(const std::string& flag, const char* s, long lo, long hi) {
    char* end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno == ERANGE) fail("%s %s: expected an integer", flag.c_str(), s);
    if (v < lo || v > hi) fail("%s %s: must be between %ld and %ld", flag.c_str(), s, lo, hi);
    return v;
}

inline float parse_float(const std::string& flag, const char* s, float lo, float hi) {
    char* end;
    float v = strtof(s, &end);
    if (*s == '\0' || *end != '\0' || !std::isfinite(v)) fail("%s %s: expected a number", flag.c_str(), s);
    if (v < lo || v > hi) fail("%s %s: must be between %g and %g", flag.c_str(), s, lo, hi);
    return v;
}

inline Options parse_options(int argc, char** argv) {
    Options o;
    using Setter = std::function<void(const std::string&, const char*)>;
    auto integer = [](auto* field, long lo, long hi) -> Setter {
        using Field = std::remove_pointer_t<decltype(field)>;
        return [=](const std::string& f, const char* v) { *field = (Field)parse_long(f, v, lo, hi); };
    };
    auto real = [](float* field, float lo, float hi) -> Setter {
        return [=](const std::string& f, const char* v) { *field = parse_float(f, v, lo, hi); };
    };
    auto text = [](std::string* field) -> Setter { return [=](const std::string&, const char* v) { *field = v; }; };
    // every flag that takes a value, and how it is parsed and bounded
    const std::map<std::string, Setter> setters = {
        {"-i", text(&o.train_pattern)},
        {"-j", text(&o.val_pattern)},
        {"-e", text(&o.model)},
        {"-o", text(&o.out_dir)},
        {"--tokenizer", text(&o.tokenizer)},
        {"--device",
         [&](const std::string&, const char* v) {
             o.device = v;
             if (o.device != "cpu" && o.device != "cuda") fail("--device %s: expected cpu or cuda", v);
         }},
        {"-b", integer(&o.B, 1, 1 << 20)},
        {"-t", integer(&o.T, 1, 1 << 20)},
        {"-d", integer(&o.total_batch, -1, LONG_MAX)},
        {"-x", integer(&o.max_steps, -1, INT_MAX)},
        {"-l", real(&o.schedule.lr, 0.0f, 10.0f)},
        {"-u", integer(&o.schedule.warmup, 0, INT_MAX)},
        {"-q", real(&o.schedule.final_fraction, 0.0f, 1.0f)},
        {"-k",
         [&](const std::string&, const char* v) {
             o.schedule.kind = v;
             if (!LRSchedule::known(o.schedule.kind)) fail("-k %s: expected cosine, linear or constant", v);
         }},
        {"-c", real(&o.weight_decay, 0.0f, 10.0f)},
        {"-v", integer(&o.val_every, 0, INT_MAX)},
        {"-m", integer(&o.val_batches, 1, INT_MAX)},
        {"-s", integer(&o.sample_every, 0, INT_MAX)},
        {"-g", integer(&o.gen_tokens, 1, 1 << 20)},
        {"-n", integer(&o.checkpoint_every, 0, INT_MAX)},
        {"-nk", integer(&o.checkpoints_keep, 0, INT_MAX)},
        {"-y", integer(&o.resume, 0, 1)},
        {"-a", integer(&o.overfit, 0, 1)},
        {"--seed", integer(&o.seed, 0, LONG_MAX)},
        {"--shuffle", integer(&o.shuffle, 0, 1)},
    };
    for (int i = 1; i < argc; i++) {
        std::string flag = argv[i];
        if (flag == "-h" || flag == "--help") {
            fputs(USAGE, stdout);
            exit(0);
        }
        if (flag == "--plan") {
            o.plan = true;
            continue;
        }
        auto handler = setters.find(flag);
        if (handler == setters.end()) fail("%s: unknown flag (see --help)", flag.c_str());
        if (i + 1 >= argc) fail("%s: missing value (see --help)", flag.c_str());
        handler->second(flag, argv[++i]);
    }
    if (o.total_batch == 0 || o.total_batch < -1) fail("-d %ld: must be positive, or -1 for one micro-batch", o.total_batch);
    if ((o.checkpoint_every > 0 || o.resume) && o.out_dir.empty()) fail("-n and -y need an output directory (-o)");
    if (o.sample_every > 0 && o.gen_tokens > o.T) fail("-g %d: cannot generate more than -t %d tokens", o.gen_tokens, o.T);
    return o;
}

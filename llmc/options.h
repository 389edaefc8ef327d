// Command-line flags, llm.c-compatible where llm.c has them, each parsed and validated here so that a bad
// value stops the run before anything is allocated, with one line naming the flag.
#pragma once

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

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
        static const char* valued[] = {"-i", "-j", "-e", "-o", "--tokenizer", "--device", "-b", "-t", "-d", "-x",
                                       "-l", "-u", "-q", "-k", "-c", "-v", "-m", "-s", "-g", "-n", "-nk", "-y",
                                       "-a", "--seed", "--shuffle"};
        if (std::find(std::begin(valued), std::end(valued), flag) == std::end(valued))
            fail("%s: unknown flag (see --help)", flag.c_str());
        if (i + 1 >= argc) fail("%s: missing value (see --help)", flag.c_str());
        const char* v = argv[++i];
        if (flag == "-i") o.train_pattern = v;
        else if (flag == "-j") o.val_pattern = v;
        else if (flag == "-e") o.model = v;
        else if (flag == "-o") o.out_dir = v;
        else if (flag == "--tokenizer") o.tokenizer = v;
        else if (flag == "--device") {
            o.device = v;
            if (o.device != "cpu" && o.device != "cuda") fail("--device %s: expected cpu or cuda", v);
        }
        else if (flag == "-b") o.B = (int)parse_long(flag, v, 1, 1 << 20);
        else if (flag == "-t") o.T = (int)parse_long(flag, v, 1, 1 << 20);
        else if (flag == "-d") o.total_batch = parse_long(flag, v, -1, LONG_MAX);
        else if (flag == "-x") o.max_steps = (int)parse_long(flag, v, -1, INT_MAX);
        else if (flag == "-l") o.schedule.lr = parse_float(flag, v, 0.0f, 10.0f);
        else if (flag == "-u") o.schedule.warmup = (int)parse_long(flag, v, 0, INT_MAX);
        else if (flag == "-q") o.schedule.final_fraction = parse_float(flag, v, 0.0f, 1.0f);
        else if (flag == "-k") {
            o.schedule.kind = v;
            if (!LRSchedule::known(o.schedule.kind)) fail("-k %s: expected cosine, linear or constant", v);
        }
        else if (flag == "-c") o.weight_decay = parse_float(flag, v, 0.0f, 10.0f);
        else if (flag == "-v") o.val_every = (int)parse_long(flag, v, 0, INT_MAX);
        else if (flag == "-m") o.val_batches = (int)parse_long(flag, v, 1, INT_MAX);
        else if (flag == "-s") o.sample_every = (int)parse_long(flag, v, 0, INT_MAX);
        else if (flag == "-g") o.gen_tokens = (int)parse_long(flag, v, 1, 1 << 20);
        else if (flag == "-n") o.checkpoint_every = (int)parse_long(flag, v, 0, INT_MAX);
        else if (flag == "-nk") o.checkpoints_keep = (int)parse_long(flag, v, 0, INT_MAX);
        else if (flag == "-y") o.resume = parse_long(flag, v, 0, 1);
        else if (flag == "-a") o.overfit = parse_long(flag, v, 0, 1);
        else if (flag == "--seed") o.seed = (uint64_t)parse_long(flag, v, 0, LONG_MAX);
        else if (flag == "--shuffle") o.shuffle = parse_long(flag, v, 0, 1);
    }
    if (o.total_batch == 0 || o.total_batch < -1) fail("-d %ld: must be positive, or -1 for one micro-batch", o.total_batch);
    if ((o.checkpoint_every > 0 || o.resume) && o.out_dir.empty()) fail("-n and -y need an output directory (-o)");
    if (o.sample_every > 0 && o.gen_tokens > o.T) fail("-g %d: cannot generate more than -t %d tokens", o.gen_tokens, o.T);
    return o;
}

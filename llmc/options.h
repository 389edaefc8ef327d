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
#include <vector>

#include "llmc/expert_settings.h"
#include "llmc/pp_schedules.h"
#include "llmc/schedule.h"
#include "llmc/spikes.h"
#include "llmc/utils.h"

// the tokenizer that decodes samples unless --tokenizer names another: GPT-2's, which make train prepares
constexpr const char* DEFAULT_TOKENIZER = "data/gpt2_tokenizer.bin";

struct Options {
    std::string train_pattern = "data/sotu/train.bin";  // -i
    std::string val_pattern = "data/sotu/val.bin";      // -j
    std::string model = "d12";                          // -e: a model file or a descriptor
    std::string out_dir;                                // -o
    std::string tokenizer;                              // --tokenizer: empty: -e DIR's tokenizer.json, or GPT-2's
    std::string device;                                 // --device: "" picks the best available
    std::string attention;                              // --attention: "" is the GPU's default (llmc/attention.cuh)
    int B = 4;                                          // -b
    int T = 1024;                                       // -t
    long total_batch = -1;                              // -d: tokens per optimizer step; -1 = B*T*ranks
    int max_steps = -1;                                 // -x: -1 = one epoch
    LRSchedule schedule;                                // -l -u -q -k
    float weight_decay = 0.0f;                          // -c
    int val_every = 20;                                 // -v
    int val_batches = 20;                               // -m
    std::string eval_file;                              // --eval: a multiple-choice eval in llm.c's format
    int sample_every = 20;                              // -s
    int gen_tokens = 64;                                // -g
    int checkpoint_every = 0;                           // -n
    int checkpoints_keep = 0;                           // -nk
    bool resume = false;                                // -y
    bool overwrite = false;                             // --overwrite
    int max_bad_steps = 3;                              // --max-bad-steps
    float spike_loss = 0.0f, spike_norm = 0.0f;         // -sl -sg: z-score limits; 0 is off
    int spike_window = 128;                             // --spike-window
    bool overfit = false;                               // -a
    uint64_t seed = 1337;                               // --seed
    bool shuffle = true;                                // --shuffle
    bool plan = false;                                  // --plan
    int plan_world = 0;                                 // --world: ranks to plan for (0: this job's)
    std::string hardware;                               // --hardware: the profile a plan's time is priced with
    int gpus_per_node = 0;                              // --gpus-per-node: 0 = the profile's
    bool search = false;                                // --search
    int search_gpus = 0;                                // --gpus: the devices --search lays a run out on
    std::string calibrate;                              // --calibrate: the profile file to write
    std::string from_profile;                           // --from-profile: fit --calibrate's rates to a --profile file
    std::string convert;                                // --convert: a checkpoint directory or a model file
    std::string convert_to;                             // --to: the llm.c model file, or HF directory, it becomes
    std::string convert_dtype = "fp32";                 // --dtype
    std::string convert_format = "llmc";                // --format: llm.c's model file, or Hugging Face's
    // parallelism and communication
    int tp = 1, cp = 1, pp = 1, ep = 1;                 // --tp --cp --pp --ep
    int sp = -1;                                        // --sp: -1 = on when tp > 1
    std::string cp_split = "zigzag";                    // --cp-split
    std::string pp_schedule = "1f1b";                   // --pp-schedule
    int vpp = 1;                                        // --vpp
    float moe_aux = ExpertSettings{}.aux_weight;        // --moe-aux: with experts
    std::string moe_aux_scope;                          // --moe-aux-scope; "": sequence with experts
    float moe_capacity = 0.0f;                          // --moe-capacity; 0: dropless
    float moe_bias_rate = ExpertSettings{}.bias_rate;   // --moe-bias-rate: with a router's selection bias
    std::string trace;                                  // --trace
    std::string profile;                                // --profile
    int profile_step = 3;                               // --profile-step
    int zero = 0;                                       // -z
    int recompute = 0;                                  // -r
    int fp8 = 0;                                        // --fp8
    std::string fp8_recipe;                             // --fp8-recipe; "": tensorwise
    int fp8_param_gather = 0;                           // --fp8-param-gather
    float bucket_mb = 25.0f;                            // --bucket-mb
    std::string comm;                                   // --comm: "" picks nccl on cuda, mpi on cpu
    std::string comm_init = "mpi";                      // --comm-init
    std::string comm_address;                           // --comm-address
    std::string comm_dir;                               // --comm-dir
    float comm_timeout = 600.0f;                        // --comm-timeout
    int debug_stall_rank = -1;                          // --debug-stall-rank (tests only)
    bool debug_check_replicas = false;                  // --debug-check-replicas (tests only)
    int debug_nan_step = -1;                            // --debug-nan-step (tests only)
    int debug_sigterm_step = -1;                        // --debug-sigterm-step (tests only)
    std::string debug_eval_scores;                      // --debug-eval-scores (tests only)
    // every flag the command line gave, with its value as written ("" for --plan and --search): what a flag's
    // default would otherwise decide, it decides (--search holds it fixed)
    std::map<std::string, std::string> given;

    bool planning() const { return plan || search; }    // predicting only: no data, no ranks, no GPU needed
    size_t bucket_floats() const { return (size_t)(bucket_mb * 1048576.0 / 4.0); }  // --bucket-mb as fp32 elements
};

// --help: every flag parse_options accepts, by group, with its default in brackets (a test holds the two equal)
inline const char* USAGE =
    "usage: train_gpt [flags]            (mpirun -np N ./train_gpt [flags] for N ranks)\n"
    "data:\n"
    "  -i PATTERN        train token shards (glob)                                 [data/sotu/train.bin]\n"
    "  -j PATTERN        validation token shards (glob)                            [data/sotu/val.bin]\n"
    "  -t N              sequence length                                           [1024]\n"
    "  -d N              global batch: tokens per optimizer step; gradient accumulation makes up\n"
    "                    what -b, -t and the ranks do not cover                    [b*t*dp]\n"
    "  -b N              micro-batch: sequences per rank per micro-step            [4]\n"
    "  --shuffle 0|1     shuffle the shards and the global batches, anew each epoch; the order depends\n"
    "                    on the data, --seed, -t and -d only, never on -b or the ranks [1]\n"
    "  --seed N          seed of the initialization, the data order and sampling  [1337]\n"
    "model:\n"
    "  -e MODEL          llm.c model file (.bin, fp32 v3 or bf16 v5) or descriptor: d12 d24 d36 d48,\n"
    "                    or d<L>c<C>h<NH>[t<maxT>][v<V>], e.g. d4c128h4             [d12]\n"
    "  --device cpu|cuda  compute device                                [cuda if a GPU is visible, else cpu]\n"
    "  --attention mma|wgmma  the GPU's flash attention: mma.sync (any GPU), or wgmma (Hopper, a build with\n"
    "                    sm_90a)                  [wgmma where it can run, else mma]\n"
    "  -r 0|1|2          activation recomputation: none, GELU, GELU and layernorm  [0]\n"
    "  --fp8 0|1         FP8 matmuls in the transformer layers but the first and the last: E4M3\n"
    "                    activations and weights, E5M2 gradients, a scale per tensor (a GPU of compute\n"
    "                    capability 8.9+; emulated on the CPU)                     [0]\n"
    "  --fp8-recipe tensorwise|blockwise|mxfp8  with --fp8 1, how the casts scale: one scale per tensor;\n"
    "                    DeepSeek-V3's 1x128 tiles and 128x128 weight blocks, E4M3 throughout (compute\n"
    "                    capability 9.0); or MXFP8's power-of-two scale per 32 values (10.0+)  [tensorwise]\n"
    "  --fp8-param-gather 0|1  with --fp8 1 and -z 1..3: the FP8 layers' weights gathered as their FP8\n"
    "                    codes, a byte each (Megatron-LM's fp8_param_gather; tensorwise, blockwise)  [0]\n"
    "optimization:\n"
    "  -x N              training steps; -1 = one epoch                            [-1]\n"
    "  -l LR             peak learning rate                                        [3e-4]\n"
    "  -u N              warmup steps                                              [0]\n"
    "  -k KIND           schedule after warmup: cosine, linear, constant           [cosine]\n"
    "  -q F              final learning rate as a fraction of -l                   [1.0]\n"
    "  -c WD             weight decay (2-D weights only)                           [0]\n"
    "evaluation and output:\n"
    "  -o DIR            output directory: main.log and checkpoints; a fresh run refuses one that\n"
    "                    holds another run's                                       [none]\n"
    "  -v N              validate every N steps; 0 = never                         [20]\n"
    "  -m N              validation batches, each of -d tokens                     [20]\n"
    "  --eval FILE       a multiple-choice eval in llm.c's format (HellaSwag, MMLU; dev/data/prepare.js\n"
    "                    --eval makes one), scored at every validation: the accuracy to the console\n"
    "                    and main.log (needs -v)                                   [none]\n"
    "  -s N              sample every N steps; 0 = never                           [20]\n"
    "  -g N              tokens to generate when sampling (at most -t)             [64]\n"
    "  --tokenizer PATH  decodes samples: llm.c's tokenizer file, or a Hugging Face tokenizer.json (or its\n"
    "                    directory)       [-e DIR's tokenizer.json, else data/gpt2_tokenizer.bin]\n"
    "checkpoints:\n"
    "  -n N              checkpoint every N steps and at the end; 0 = never (needs -o) [0]\n"
    "  -nk N             keep the newest N checkpoints; 0 = all                    [0]\n"
    "  -y 0|1            resume from the newest checkpoint in -o that verifies, on any layout; -e,\n"
    "                    --seed, --shuffle, -i, -t and -d must be those it recorded, -x beyond its step [0]\n"
    "  --overwrite 0|1   a fresh run first removes another run's main.log and checkpoints from -o [0]\n"
    "  --convert SRC     write the model of checkpoint directory or model file SRC as --to, and exit [none]\n"
    "  --to PATH         with --convert: the llm.c file, or with --format hf the directory, to write\n"
    "                    (never an existing one)                                   [none]\n"
    "  --format llmc|hf  with --convert: an llm.c model file, or a Hugging Face directory (config.json,\n"
    "                    model.safetensors, and the tokenizer files of the HF directory the model came\n"
    "                    from) that transformers' from_pretrained reads            [llmc]\n"
    "  --dtype fp32|bf16  with --convert: llm.c's version 3 (fp32) or 5 (bf16); HF's float32 or bfloat16 [fp32]\n"
    "failures (the first SIGTERM or SIGINT ends the run after the current step, with a checkpoint when -o\n"
    "is given, exit code 5; a second one ends it at once):\n"
    "  --max-bad-steps N  a step with a non-finite loss or gradient norm skips its update (as -sl and -sg\n"
    "                    skip spikes); N skipped updates in a row stop the run (exit code 4) [3]\n"
    "  -sl Z             skip the update of a step whose loss lies more than Z standard deviations\n"
    "                    above its mean over the window; 0 = off                   [0]\n"
    "  -sg Z             the same for the gradient norm; 0 = off                   [0]\n"
    "  --spike-window N  what -sl and -sg measure against: the newest N steps that updated; no step is\n"
    "                    skipped for a spike before N have                         [128]\n"
    "parallelism (dp = ranks / (tp*cp*pp)):\n"
    "  -z 0|1|2|3        ZeRO stage: shard optimizer state (1), and gradients (2), and parameters (3) [0]\n"
    "  --bucket-mb F     gradient reduction bucket size in MiB                     [25]\n"
    "  --tp N            tensor-parallel size: divides the heads; a group shares a node [1]\n"
    "  --sp 0|1          sequence parallelism between the tensor-parallel regions  [1 when --tp > 1]\n"
    "  --cp N            context-parallel size: splits every sequence, 2N chunks of -t/(2N) tokens [1]\n"
    "  --cp-split zigzag|contiguous  rank r holds chunks r and 2N-1-r, or 2r and 2r+1 [zigzag]\n"
    "  --pp N            pipeline-parallel size: stages of consecutive layers      [1]\n"
    "  --pp-schedule afab|1f1b|interleaved|zb|dualpipev  the order of the micro-batches' passes [1f1b]\n"
    "  --vpp V           with interleaved: virtual stages (chunks of layers) per rank [1]\n"
    "  --profile FILE    measure one step: each op family, the components beside the planner's prediction,\n"
    "                    the live memory through the step; a table, and FILE as JSON (rank 0)       [none]\n"
    "  --trace FILE      write that step's timeline of every rank's ops (Chrome trace JSON)        [none]\n"
    "  --profile-step N  the step --profile and --trace record (the last when the run is shorter)  [3]\n"
    "  --ep N            expert-parallel size: the experts split over N ranks of dp  [1]\n"
    "  --moe-aux F       with experts: the load-balancing loss's weight            [0.01]\n"
    "  --moe-aux-scope sequence|batch  f per sequence, or the step's over all dp ranks (Megatron's) [sequence]\n"
    "  --moe-capacity F  with experts: each takes at most ceil(F*K*T/E) of a sequence's tokens; 0 drops none [0]\n"
    "  --moe-bias-rate F with a router's selection bias (a): its step per update   [0.001]\n"
    "  --comm mpi|nccl   communication backend                                     [nccl on cuda, mpi on cpu]\n"
    "  --comm-init mpi|tcp|file  how NCCL ranks find each other                    [mpi]\n"
    "  --comm-address HOST:PORT  with --comm-init tcp: where rank 0 listens        [none]\n"
    "  --comm-dir DIR    with --comm-init file: a directory all ranks share, fresh for each job [none]\n"
    "  --comm-timeout S  abort the job when a collective waits longer than S seconds [600]\n"
    "planning and debugging:\n"
    "  --plan            print the predicted memory and communication per rank, and exit [off]\n"
    "  --world N         with --plan: the number of ranks to plan for              [this job's]\n"
    "  --hardware FILE   with --plan, --search, --calibrate or --profile: the hardware profile that prices a step\n"
    "                    (dev/hardware/)                 [dev/hardware/h100.txt on cuda, cpu.txt on cpu]\n"
    "  --gpus-per-node G  with --plan or --search: devices per node, which groups fit in [the profile's]\n"
    "  --search          with --gpus N and -d: the best layouts of N devices, predicted, and exit; it\n"
    "                    tries every -b, --tp, --sp, --cp, --pp, --pp-schedule, --vpp, --ep, -z, -r,\n"
    "                    --fp8 and --fp8-recipe (the recipes the profile's GPU runs) that the command\n"
    "                    line does not give, and holds those it gives fixed        [off]\n"
    "  --gpus N          with --search: the devices to lay the run out on          [none]\n"
    "  --calibrate FILE  measure this machine's profile (matmul, attention, memory, and the collectives\n"
    "                    under mpirun) into FILE, starting from --hardware's figures, and exit [none]\n"
    "  --from-profile P  with --calibrate: fit the profile P was predicted with to what P measured instead\n"
    "                    (a --profile file: its compute, optimizer and communication)      [none]\n"
    "  -a 0|1            overfit a single batch                                    [0]\n"
    "  --debug-stall-rank R        (testing) rank R stops answering before its first step [-1]\n"
    "  --debug-check-replicas 0|1  (testing) at the end, compare the replicated tensors across tp [0]\n"
    "  --debug-nan-step S  (testing) rank 0's gradients of step S (main.log's s:S) are NaN [-1]\n"
    "  --debug-sigterm-step S  (testing) the last rank sends itself SIGTERM during step S [-1]\n"
    "  --debug-eval-scores FILE  (testing) with --eval, each example's completion losses to FILE [none]\n"
    "  -h, --help        this text\n"
    "docs/usage.md, \"Using train_gpt\", and the other pages of docs/ tell the rest: the log lines, ZeRO, tp and\n"
    "sp, the launch scripts, checkpoints and the data order.\n";

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
    auto choice = [](std::string* field, std::vector<std::string> allowed) -> Setter {
        return [=](const std::string& f, const char* v) {
            std::string list;
            for (const std::string& a : allowed) {
                if (a == v) return (void)(*field = v);
                list += (list.empty() ? "" : ", ") + a;
            }
            fail("%s %s: expected one of %s", f.c_str(), v, list.c_str());
        };
    };
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
        {"--attention", choice(&o.attention, {"mma", "wgmma"})},
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
        {"--eval", text(&o.eval_file)},
        {"-sl", real(&o.spike_loss, 0.0f, 1e6f)},
        {"-sg", real(&o.spike_norm, 0.0f, 1e6f)},
        {"--spike-window", integer(&o.spike_window, 2, MAX_SPIKE_WINDOW)},
        {"--debug-eval-scores", text(&o.debug_eval_scores)},
        {"-s", integer(&o.sample_every, 0, INT_MAX)},
        {"-g", integer(&o.gen_tokens, 1, 1 << 20)},
        {"-n", integer(&o.checkpoint_every, 0, INT_MAX)},
        {"-nk", integer(&o.checkpoints_keep, 0, INT_MAX)},
        {"-y", integer(&o.resume, 0, 1)},
        {"--overwrite", integer(&o.overwrite, 0, 1)},
        {"-a", integer(&o.overfit, 0, 1)},
        {"--seed", integer(&o.seed, 0, LONG_MAX)},
        {"--shuffle", integer(&o.shuffle, 0, 1)},
        {"--world", integer(&o.plan_world, 1, 1 << 20)},
        {"--hardware", text(&o.hardware)},
        {"--gpus-per-node", integer(&o.gpus_per_node, 1, 1 << 16)},
        {"--gpus", integer(&o.search_gpus, 1, 1 << 20)},
        {"--calibrate", text(&o.calibrate)},
        {"--from-profile", text(&o.from_profile)},
        {"--convert", text(&o.convert)},
        {"--to", text(&o.convert_to)},
        {"--dtype", choice(&o.convert_dtype, {"fp32", "bf16"})},
        {"--format", choice(&o.convert_format, {"llmc", "hf"})},
        {"--tp", integer(&o.tp, 1, 1 << 16)},
        {"--cp", integer(&o.cp, 1, 1 << 16)},
        {"--pp", integer(&o.pp, 1, 1 << 16)},
        {"--ep", integer(&o.ep, 1, 1 << 16)},
        {"--moe-aux", real(&o.moe_aux, 0.0f, 100.0f)},
        {"--moe-aux-scope", choice(&o.moe_aux_scope, {"sequence", "batch"})},
        {"--moe-capacity", real(&o.moe_capacity, 0.0f, 1000.0f)},
        {"--moe-bias-rate", real(&o.moe_bias_rate, 0.0f, 1.0f)},
        {"-z", integer(&o.zero, 0, 3)},
        {"-r", integer(&o.recompute, 0, 2)},
        {"--fp8", integer(&o.fp8, 0, 1)},
        {"--fp8-recipe", choice(&o.fp8_recipe, {"tensorwise", "blockwise", "mxfp8"})},
        {"--fp8-param-gather", integer(&o.fp8_param_gather, 0, 1)},
        {"--sp", integer(&o.sp, 0, 1)},
        {"--cp-split", choice(&o.cp_split, {"zigzag", "contiguous"})},
        {"--pp-schedule", choice(&o.pp_schedule, {"afab", "1f1b", "interleaved", "zb", "dualpipev"})},
        {"--vpp", integer(&o.vpp, 1, 1 << 10)},
        {"--trace", text(&o.trace)},
        {"--profile", text(&o.profile)},
        {"--profile-step", integer(&o.profile_step, 1, INT_MAX)},
        {"--debug-check-replicas", integer(&o.debug_check_replicas, 0, 1)},
        {"--bucket-mb", real(&o.bucket_mb, 1e-4f, 65536.0f)},
        {"--comm", choice(&o.comm, {"mpi", "nccl"})},
        {"--comm-init", choice(&o.comm_init, {"mpi", "tcp", "file"})},
        {"--comm-address", text(&o.comm_address)},
        {"--comm-dir", text(&o.comm_dir)},
        {"--comm-timeout", real(&o.comm_timeout, 0.1f, 1e7f)},
        {"--debug-stall-rank", integer(&o.debug_stall_rank, -1, 1 << 20)},
        {"--max-bad-steps", integer(&o.max_bad_steps, 1, INT_MAX)},
        {"--debug-nan-step", integer(&o.debug_nan_step, -1, INT_MAX)},
        {"--debug-sigterm-step", integer(&o.debug_sigterm_step, -1, INT_MAX)},
    };
    for (int i = 1; i < argc; i++) {
        std::string flag = argv[i];
        if (flag == "-h" || flag == "--help") {
            fputs(USAGE, stdout);
            exit(0);
        }
        if (flag == "--plan" || flag == "--search") {
            (flag == "--plan" ? o.plan : o.search) = true;
            o.given[flag] = "";
            continue;
        }
        auto handler = setters.find(flag);
        if (handler == setters.end()) fail("%s: unknown flag (see --help)", flag.c_str());
        if (i + 1 >= argc) fail("%s: missing value (see --help)", flag.c_str());
        handler->second(flag, argv[++i]);
        o.given[flag] = argv[i];
    }
    if (o.total_batch == 0 || o.total_batch < -1) fail("-d %ld: must be positive, or -1 for one micro-batch", o.total_batch);
    if ((o.checkpoint_every > 0 || o.resume) && o.out_dir.empty()) fail("-n and -y need an output directory (-o)");
    if (o.overwrite && o.resume) fail("--overwrite 1: -y 1 continues the run in -o, which overwriting would remove");
    if (o.overwrite && o.out_dir.empty()) fail("--overwrite 1: needs an output directory (-o)");
    if (o.comm_init == "tcp" && o.comm_address.empty()) fail("--comm-init tcp needs --comm-address HOST:PORT");
    if (o.comm_init == "file" && o.comm_dir.empty()) fail("--comm-init file needs --comm-dir DIR");
    if (o.comm_init != "mpi" && o.comm != "nccl") fail("--comm-init %s: only NCCL bootstraps without MPI; add --comm nccl", o.comm_init.c_str());
    if (o.vpp > 1 && o.pp_schedule != "interleaved")
        fail("--vpp %d: only the interleaved schedule runs virtual stages (--pp-schedule interleaved)", o.vpp);
    if (o.given.count("--profile-step") && o.profile.empty() && o.trace.empty())
        fail("--profile-step %d: only with --profile or --trace", o.profile_step);
    if (o.sp == -1) o.sp = o.tp > 1;
    if (!o.convert.empty() && o.convert_to.empty()) fail("--convert %s: needs --to FILE", o.convert.c_str());
    if (o.convert.empty() && !o.convert_to.empty()) fail("--to %s: only with --convert", o.convert_to.c_str());
    if (o.convert.empty() && o.convert_dtype != "fp32") fail("--dtype %s: only with --convert", o.convert_dtype.c_str());
    if (o.convert.empty() && o.convert_format != "llmc") fail("--format %s: only with --convert", o.convert_format.c_str());
    if (o.search && o.plan) fail("--search: prints its own plans; drop --plan");
    if (o.search && o.search_gpus == 0) fail("--search: needs --gpus N, the devices to lay the run out on");
    if (o.search_gpus > 0 && !o.search) fail("--gpus %d: only with --search (a run's devices are the ranks launched)", o.search_gpus);
    if (o.search && o.total_batch == -1) fail("--search: needs -d, the global batch every layout must train with");
    if (!o.hardware.empty() && !o.plan && !o.search && o.calibrate.empty() && o.profile.empty())
        fail("--hardware %s: only with --plan, --search, --calibrate or --profile", o.hardware.c_str());
    if (o.gpus_per_node > 0 && !o.plan && !o.search) fail("--gpus-per-node %d: only with --plan or --search", o.gpus_per_node);
    if (!o.from_profile.empty() && o.calibrate.empty()) fail("--from-profile %s: only with --calibrate FILE", o.from_profile.c_str());
    if (!o.calibrate.empty() && (o.plan || o.search)) fail("--calibrate %s: measures and exits; drop --plan and --search", o.calibrate.c_str());
    if (o.plan_world > 0 && !o.plan) fail("--world %d: only with --plan (a run's world is the number of ranks launched)", o.plan_world);
    if (!o.eval_file.empty() && o.val_every == 0)
        fail("--eval %s: is scored at every validation; -v 0 turns validation off", o.eval_file.c_str());
    if (!o.debug_eval_scores.empty() && o.eval_file.empty()) fail("--debug-eval-scores: only with --eval FILE");
    if (!o.planning() && o.sample_every > 0 && o.gen_tokens > o.T) fail("-g %d: cannot generate more than -t %d tokens", o.gen_tokens, o.T);
    return o;
}

// train_gpt: trains a GPT-2 or a Llama 3 (with or without experts) on token shards, on one rank or many
// (launched with mpirun). The story of a run, top to bottom (run(), then train()): read the flags, pick the
// device, join the other ranks and lay them out on the process grid, build the model (fresh, from an llm.c file or
// a Hugging Face directory, or from the newest checkpoint) with its data-parallel runtime, open this rank's slice
// of the data, then loop: checkpoint, validate (and score the eval), sample, and take one optimizer step over a
// global batch of micro-batches (skipped when its loss or gradient norm is not finite, or spikes), until the last
// step, too many skipped steps in a row, or a stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) to any rank.
// The other commands have their own headers: --convert (llmc/convert.h), --calibrate (llmc/calibrate.cuh),
// --plan and --search (llmc/planner.h).
#include <cuda_runtime.h>
#include <omp.h>
#include <time.h>

#include <memory>
#include <numeric>

#include "llmc/calibrate.cuh"
#include "llmc/checkpoint.h"
#include "llmc/comm.cuh"
#include "llmc/convert.h"
#include "llmc/dataloader.h"
#include "llmc/evals.h"
#include "llmc/gpt.cuh"
#include "llmc/grid.cuh"
#include "llmc/hf.h"
#include "llmc/logger.h"
#include "llmc/options.h"
#include "llmc/parallel.cuh"
#include "llmc/planner.h"
#include "llmc/pp.cuh"
#include "llmc/profile_report.h"
#include "llmc/resume.h"
#include "llmc/run_guard.h"
#include "llmc/run_hooks.h"
#include "llmc/sampler.h"
#include "llmc/tokenizer.h"
#include "llmc/zero.cuh"

// exit codes besides 0 (done) and 1 (a refused input or an error; 3 is a comm timeout, llmc/comm.cuh): docs/failures.md
// lists them all, for the scripts that restart runs
constexpr int EXIT_NON_FINITE = 4;  // --max-bad-steps steps in a row were skipped, or the state was not finite
constexpr int EXIT_STOPPED = 5;     // a stop signal: stopped after a step, with a checkpoint when -o is given

// --device, or cuda when a GPU is visible; with --plan or --search a GPU need not exist
static Device pick_device(const Options& o) {
    if (o.device == "cpu") return Device::CPU;
    if (o.device == "cuda") {
        if (!o.planning() && !cuda_device_available()) fail("--device cuda: no GPU is visible (use --device cpu)");
        return Device::CUDA;
    }
    return cuda_device_available() ? Device::CUDA : Device::CPU;
}

static CommSettings comm_settings(const Options& o, Device dev) {
    std::string backend = !o.comm.empty() ? o.comm : dev == Device::CUDA ? "nccl" : "mpi";
    return CommSettings{backend, o.comm_init, o.comm_address, o.comm_dir, o.comm_timeout};
}

// the first line of a run: which device, and on the GPU which one (picked by the launcher's local rank) and which
// attention kernels its layers run
static std::string device_line(Device dev, bool plan, AttentionKernels attention) {
    if (dev == Device::CPU) return strfmt("device: cpu, %d threads", omp_get_max_threads());
    if (plan) return "device: cuda (planned)";
    std::string gpu = gpu_description(select_gpu());
    return "device: " + gpu + "; attention: " + attention_kernels_name(attention);
}

static GPTConfig model_config(const Options& o, const std::string& checkpoint_dir) {
    if (!checkpoint_dir.empty()) return checkpoint_config(checkpoint_dir);
    if (is_model_descriptor(o.model)) return parse_model_descriptor(o.model);
    if (is_hf_dir(o.model)) return hf_read_config(o.model);
    int version;
    return read_model_header(o.model, &version);
}

// the mean loss over `batches` global batches of the validation data, each read and passed through the stages
// as a training step's micro-batches are; in double, as the training loss, so that the mean over dp rounds once
// and one rank and dp over the same batches log the same bits
template <typename floatX>
static double validation_loss(GPTModel<floatX>& model, Pipeline<floatX>& pipeline, ParallelState<floatX>& parallel,
                              DataLoader& val, int batches) {
    val.reset();
    std::vector<std::vector<int>> inputs(1), targets(1);
    double total = 0.0;
    for (int i = 0; i < batches; i++) {
        val.next_batch();
        inputs[0] = val.inputs, targets[0] = val.targets;
        total += pipeline.run(model, nullptr, pp_forward_only(parallel.pp, 1), inputs, targets, val.B, val.T, 0.0f);
    }
    return parallel.from_head_stage(total) / batches;
}

// The multiple-choice eval: this dp rank's share of its rows, B at a time through the stages as validation
// batches go, each row's summed completion losses read on the classifier's stage (from its cp group), summed over dp
// and given to the other stages; every rank scores the same sums. The rows are as long as the set needs, in
// the layout's unit (cp's 2·cp chunks, each split over tp under sp) and in whole 64-token tiles, at most -t.
template <typename floatX>
static EvalResult evaluate(GPTModel<floatX>& model, Pipeline<floatX>& pipeline, ParallelState<floatX>& parallel,
                           const EvalSet& set, int B, int max_T) {
    Grid& grid = parallel.grid;
    int T = set.row_tokens(max_T, std::lcm(64, 2 * grid.cp * grid.tp));
    std::vector<std::vector<int>> inputs(1), targets(1);
    auto forward = [&](const std::vector<int>& in, const std::vector<int>& out, const std::vector<int>& mask) {
        inputs[0] = in, targets[0] = out;
        pipeline.run(model, nullptr, pp_forward_only(parallel.pp, 1), inputs, targets, B, T, 0.0f);
        return model.part.last ? gpt_row_losses(model, mask, pipeline.head_slot) : std::vector<double>(B, 0.0);
    };
    std::vector<double> losses = eval_row_losses(set, B, T, grid.at.dp, grid.dp, forward), summed(losses.size());
    grid.dp_comm.wait(grid.dp_comm.all_reduce(losses.data(), summed.data(), losses.size(), DType::F64));
    parallel.from_head_stage(summed);
    return eval_score(set, summed);
}

// the logits at position t of the model run on one sequence of T tokens, on every rank: computed through the
// stages, read on the classifier's (from its cp and tp groups), and given to the others
template <typename floatX>
static std::vector<float> logits_at(GPTModel<floatX>& model, Pipeline<floatX>& pipeline, ParallelState<floatX>& parallel,
                                    const int* tokens, int T, int t) {
    std::vector<std::vector<int>> inputs{std::vector<int>(tokens, tokens + T)};
    pipeline.run(model, nullptr, pp_forward_only(parallel.pp, 1), inputs, {}, 1, T, 0.0f);
    std::vector<float> row(model.config.vocab_size);
    if (model.part.last) row = gpt_logits_row(model, 0, t, pipeline.head_slot);
    parallel.from_head_stage(row);
    return row;
}

// the layout a checkpoint records, and a resumed run compares with its own
static RunLayout run_layout(const Options& o, int world, int dp, long total_batch, size_t bucket_floats, Device dev) {
    return RunLayout{o.B, o.T, world, total_batch, dp, o.zero, o.zero >= 1 ? bucket_floats : 0, o.tp, o.sp, o.cp,
                     o.cp_split, o.pp, o.vpp, o.ep, dev == Device::CUDA ? "cuda" : "cpu"};
}

// what run() decided from the flags, for the training run
struct RunSetup {
    GPTConfig config;
    std::string resume_dir;  // the newest checkpoint whose manifest verifies
    std::vector<ResumeCandidate> candidates;  // under -y 1: every checkpoint, newest first
    RunInputs inputs;  // recorded in every checkpoint's manifest
    int accumulation;
    long tokens_per_micro_step, total_batch;
    size_t bucket_floats;
    AttentionKernels attention;  // the GPU's attention kernels (--attention, or the GPU's default)
};

// what one step did, for its line and main.log
struct StepResult {
    double loss, norm;  // the mean loss over the global batch, and the gradient norm, the same on every rank
    float lr;
    double ms;
    bool skipped;  // the update was: a non-finite loss or norm, or a spike
    Spike spike;
};

// One rank's part of a training run on the device whose storage type is floatX (llmc/device.cuh): its part of the
// model and the parallel layout that holds its share (the grid, the data-parallel runtime, the optimizer state:
// llmc/parallel.cuh), the pipeline's schedule, the data; set up by train() in the order of its methods, then used
// by the step loop, one method for each thing a step does besides the hooks (llmc/run_hooks.h).
template <typename floatX>
struct Trainer {
    static constexpr bool on_gpu = device_of<floatX> == Device::CUDA;
    const Options& o;
    const RunSetup& run;
    const GPTConfig& config;
    const int accumulation;
    std::string device = device_line(device_of<floatX>, false, run.attention);
    size_t gpu_baseline = on_gpu ? gpu_memory_used() : 0;  // the CUDA context and whatever else holds the GPU
    CommSettings cs = comm_settings(o, device_of<floatX>);
    Comm world_comm;
    GPTModel<floatX> model;  // this rank's part of the model: declared before the layout, whose runtime refers to it
    ParallelState<floatX> parallel;  // the grid, the data-parallel runtime, and where the model's share lies
    Grid& grid = parallel.grid;
    const PPSpec& pp = parallel.pp;
    bool lead = false;  // rank 0 prints, logs and writes the shared files
    RunLayout layout;
    std::string resume_dir;  // the checkpoint the run goes on from; "" for a fresh run
    RunLayout resumed_from;
    double verify_seconds = 0.0, load_seconds = 0.0;
    std::pair<double, double> verified, loaded;  // the resume's seconds, on the fastest and the slowest rank
    std::vector<PPAction> actions;  // this stage's passes of a step's micro-batches, in the schedule's order
    ParallelPlan par;
    Pipeline<floatX> pipeline;
    TrainState state;
    Rng sampler_rng;
    std::unique_ptr<DataLoader> train_data, val;
    int val_batches = 0;
    std::unique_ptr<EvalSet> evals;
    std::unique_ptr<Tokenizer> tokenizer;
    int steps = 0;
    int profiled_step = -1;  // the step --profile and --trace record, or -1
    LRSchedule schedule;
    Logger log;
    SpikeGuard spikes;
    int bad_steps = 0;  // steps in a row whose update was skipped (a non-finite loss or gradient norm, a spike)
    std::vector<std::vector<int>> inputs, targets;  // a step's micro-batches

    Trainer(const Options& o_, const RunSetup& run_)
        : o(o_), run(run_), config(run_.config), accumulation(run_.accumulation), sampler_rng(o_.seed),
          spikes{o_.spike_loss, o_.spike_norm, o_.spike_window}, inputs(run_.accumulation),
          targets(run_.accumulation) {}

    // the ranks: one world, laid out on the grid; then the checkpoint to resume from, its files checksummed by
    // every rank (an older one than run() checked the settings against, when the newest one's files fail)
    void join_ranks() {
        world_comm = comm_world(cs);
        if (on_gpu) world_comm.compute_stream = main_stream();  // NCCL ops start after the kernels queued before them
        install_stop_handlers();  // from here on a signal stops the run between steps (llmc/run_guard.h)
        parallel.join(world_comm, grid_shape(o), o.zero, o.vpp, parse_pp_schedule(o.pp_schedule));
        lead = grid.rank == 0;
        layout = run_layout(o, grid.world, grid.dp, run.total_batch, run.bucket_floats, device_of<floatX>);
        verify_seconds = now_seconds();
        resume_dir = choose_checkpoint(o.out_dir, run.candidates, &world_comm);
        if (!resume_dir.empty() && resume_dir != run.resume_dir) check_resume_from(run.inputs, layout, resume_dir);
        verify_seconds = now_seconds() - verify_seconds;
    }

    // The step's schedule: the order in which this pipeline stage runs its passes of the micro-batches (with one
    // stage, forward and backward of each micro-batch in turn). The model: this rank's tensor-parallel share of
    // its stage's layers, with a slot for each micro-batch the schedule keeps in flight, and its data-parallel
    // runtime.
    void build_model() {
        PPSchedule passes = pp_schedule(pp.kind, grid.pp, accumulation, pp.virtual_stages);
        bool split_backward = pp_kind_splits_backward(pp.kind);  // B now, W where the schedule has a bubble
        check_pp_schedule(passes, pp.placement(), accumulation, split_backward);
        actions = passes[grid.at.pp];
        pipeline.comm = &grid.pp_comm;
        pipeline.spec = pp;
        par = parallel_plan(o, grid.dp, accumulation);
        ModelLayout rank_layout = parallel.model_layout(o.sp == 1, cp_split(o));  // how this rank holds the model
        rank_layout.capacity = o.moe_capacity;
        rank_layout.part = stage_part(config, pp), rank_layout.slots = Pipeline<floatX>::slots_needed(actions, pp);
        rank_layout.split_backward = split_backward, rank_layout.recompute = o.recompute;
        rank_layout.accumulation = accumulation, rank_layout.attention_kernels = run.attention;
        rank_layout.experts = ExpertSettings{o.moe_aux, o.moe_bias_rate,
                                             o.moe_aux_scope == "batch" ? AuxScope::Batch : AuxScope::Sequence};
        gpt_allocate(model, config, o.B, o.T, rank_layout);
        model.seed = o.seed;
        if (o.fp8) gpt_allocate_fp8(model, fp8_recipe_named(o.fp8_recipe));
        parallel.attach(model, run.bucket_floats, o.fp8_param_gather == 1, layout);
    }

    // the fastest and the slowest rank's seconds for something every rank did (a collective)
    std::pair<double, double> seconds_over_ranks(double mine) {
        std::vector<double> all(grid.world);
        world_comm.wait(world_comm.all_gather(&mine, all.data(), 1, DType::F64));
        return std::make_pair(*std::min_element(all.begin(), all.end()), *std::max_element(all.begin(), all.end()));
    }

    // the parameters and the optimizer state: the checkpoint's, or a fresh model's (random, an llm.c file, a
    // Hugging Face directory); the whole model exists only while it is initialized, loaded or saved, and every
    // rank keeps its share of it
    void load() {
        load_seconds = now_seconds();
        std::vector<float> storage;
        float* mine = parallel.share_buffer(storage);
        if (!resume_dir.empty()) {
            resumed_from = load_checkpoint(resume_dir, parallel.checkpoint_state(mine), state);
            sampler_rng.state = state.rng_state;
            parallel.upload_moments();
        } else {
            parallel.make_share(mine, [&](float* whole) {
                if (is_model_descriptor(o.model)) gpt_init_random(config, whole, o.seed);
                else if (is_hf_dir(o.model)) hf_load(config, whole, o.model);
                else gpt_load_params(config, whole, o.model);
            });
        }
        parallel.install_share(mine);
        load_seconds = now_seconds() - load_seconds;
        if (!resume_dir.empty()) verified = seconds_over_ranks(verify_seconds), loaded = seconds_over_ranks(load_seconds);
        spikes.restore(state.loss_window, state.norm_window);
    }

    // The data: this dp rank's slice of every micro-step of every global batch; the order of the global batches
    // depends on -t and -d, not on -b or dp. Validation reads -m global batches of -d tokens, each as the training
    // steps read theirs: the same tokens on any layout.
    void open_data() {
        train_data.reset(new DataLoader(o.train_pattern, o.B, o.T, run.total_batch, grid.at.dp, grid.dp, o.shuffle,
                                        o.seed, config.vocab_size));
        if (!resume_dir.empty()) train_data->seek(state.data);
        if (o.val_every > 0) {
            val.reset(new DataLoader(o.val_pattern, o.B, o.T, run.total_batch, grid.at.dp, grid.dp, false, o.seed,
                                     config.vocab_size));
            DataLoader::require_same_format(train_data->shards[0], val->shards[0]);
            val_batches = (int)std::min<size_t>(o.val_batches, val->batches_per_epoch) * accumulation;
        }
        if (!o.eval_file.empty()) evals.reset(new EvalSet(read_eval_file(o.eval_file, config.vocab_size, o.T)));
        if (o.sample_every > 0) open_tokenizer();
        steps = o.max_steps >= 0 ? o.max_steps : (int)(train_data->total_tokens / run.total_batch);
        schedule = o.schedule;
        schedule.total_steps = steps;
        if (!o.profile.empty() || !o.trace.empty()) choose_profiled_step();
        if (o.overfit) train_data->next_batch();  // the one batch every step will see
    }

    // --profile-step counts from the run's start (the last step when the run is shorter); a run resumed after it
    // profiles the third step it takes (or its last), and print_run says so
    void choose_profiled_step() {
        profiled_step = std::min(o.profile_step, steps) - 1;
        if (profiled_step < state.step) profiled_step = std::min(state.step + 2, steps - 1);
    }

    // Samples are decoded with the tokenizer: --tokenizer's, else the tokenizer.json of the Hugging Face directory -e
    // names, else GPT-2's. A named or found one may have fewer ids than the model has rows (Qwen3's 151669 tokens in
    // 151936 rows; Megatron-LM pads a vocab so): the rest pad the embedding, no text holds them, samples are drawn
    // among the tokenizer's ids, and the run says so in one line. One with more ids than the model is a mistake (a
    // tokenizer of another model), refused. GPT-2's, the default, does not fit every model (a Llama 3 of 128256
    // tokens): the run says why it does not sample, once, and trains.
    void open_tokenizer() {
        std::string path = o.tokenizer;
        if (path.empty() && is_hf_dir(o.model) && file_exists(o.model + "/tokenizer.json")) path = o.model + "/tokenizer.json";
        const bool chosen = !path.empty();
        if (!chosen) path = DEFAULT_TOKENIZER;
        tokenizer.reset(new Tokenizer(path));
        if (!chosen && tokenizer->vocab_size != config.vocab_size) {
            if (grid.rank == 0)
                printf("sampling off: the model's %d tokens are not GPT-2's %d (--tokenizer names one of its vocab)\n",
                       config.vocab_size, tokenizer->vocab_size);
            tokenizer.reset();
            return;
        }
        std::string padding = tokenizer_padding(tokenizer->path, tokenizer->vocab_size, config.vocab_size);
        if (chosen && grid.rank == 0) {
            printf("samples: decoded with %s, starting from token %d (%s)\n", tokenizer->path.c_str(), tokenizer->start,
                   tokenizer->start_from.c_str());
            if (!padding.empty()) printf("%s\n", padding.c_str());
        }
    }

    // what runs where, on rank 0's console; and main.log opened (cut back to the checkpoint's step on a resume)
    void print_run() {
        if (!lead) return;
        printf("%s\n", device.c_str());
        if (grid.world > 1)
            printf("%d ranks over %s: dp=%d, tp=%d (sp %s), cp=%d (%s), pp=%d (%s, vpp %d), ZeRO-%d over %d ranks, "
                   "buckets of %zu floats (%zu buckets)\n", grid.world, cs.backend.c_str(), grid.dp, grid.tp,
                   o.sp ? "on" : "off", grid.cp, o.cp_split.c_str(), grid.pp, o.pp_schedule.c_str(), o.vpp, o.zero,
                   grid.dp_cp().size, run.bucket_floats, parallel.dpr->num_buckets());
        if (o.resume && resume_dir.empty()) printf("no checkpoint in %s; starting from scratch\n", o.out_dir.c_str());
        if (!resume_dir.empty()) {
            printf("resumed from %s at step %d: written on %s, continuing on %s\n", resume_dir.c_str(), state.step,
                   resumed_from.describe().c_str(), layout.describe().c_str());
            printf("checkpoint verified in %.3f to %.3f s and read in %.3f to %.3f s per rank\n", verified.first,
                   verified.second, loaded.first, loaded.second);
            if (profiled_step >= 0 && o.profile_step - 1 < state.step)
                printf("profile: step %d came before this run; step %d is profiled instead\n", o.profile_step,
                       profiled_step + 1);
        }
        printf("model L=%d C=%d NH=%d V=%d (padded %d) maxT=%d%s%s: %zu parameters (%zu on rank 0), %.1f MiB in all on "
               "rank 0\n", config.num_layers, config.channels, config.num_heads, config.vocab_size,
               config.padded_vocab_size, config.max_seq_len, family_shape(config).c_str(),
               config.moe() ? strfmt("%s (aux %g, ep %d)", experts_shape(config).c_str(), o.moe_aux, grid.ep).c_str() : "",
               num_parameters(config), model.num_parameters, model.ledger.total() / 1048576.0);
        if (pp.on()) print_stage_layers(config, pp);
        if (o.fp8)
            printf("fp8: the matmuls of layers 1 to %d in %s; layers 0 and %d, attention, the embeddings and the "
                   "classifier in %s%s\n", config.num_layers - 2, fp8_recipe_terms(fp8_recipe_named(o.fp8_recipe)),
                   config.num_layers - 1, on_gpu ? "bf16" : "fp32",
                   o.fp8_param_gather ? "; their weights gathered over dp as E4M3 codes (--fp8-param-gather 1)" : "");
        printf("train: %zu tokens in %s; batch %d x %d on %d dp ranks, %d micro-steps per step (%ld tokens); %d steps\n",
               train_data->total_tokens, o.train_pattern.c_str(), o.B, o.T, grid.dp, accumulation, run.total_batch, steps);
        if (evals)
            printf("eval: %zu examples (%zu completions) in %s, scored at every validation\n", evals->examples.size(),
                   evals->rows, o.eval_file.c_str());
        if (spikes.on()) printf("spikes: %s\n", spikes.rule().c_str());
        if (!o.out_dir.empty()) {
            make_dirs(o.out_dir);
            log.open(o.out_dir, resume_dir.empty() ? -1 : state.step);
        }
    }

    // writes the checkpoint of the state before `step`; false when the state is not finite (nothing written)
    bool checkpoint(int step) {
        double started = now_seconds();
        // under -a every step reads the first batch again, which a resumed run reads first too
        TrainState now{step, o.overfit ? DataPosition{} : train_data->position(), sampler_rng.state,
                       spikes.loss.values, spikes.norm.values};
        std::vector<float> storage;
        float* whole = parallel.whole_model(storage);
        parallel.download_moments();
        bool saved = save_checkpoint(o.out_dir, parallel.checkpoint_state(whole), now, layout, run.inputs,
                                     o.checkpoints_keep, grid.world_comm, parallel.optimizer_file);
        auto [fastest, slowest] = seconds_over_ranks(now_seconds() - started);
        if (saved && lead)
            printf("checkpoint %s/%s written in %.3f to %.3f s per rank\n", o.out_dir.c_str(),
                   checkpoint_name(step).c_str(), fastest, slowest);
        return saved;
    }

    // the validation loss, and the eval's accuracy: to the console and main.log (collectives)
    void validate(int step, RunHooks& hooks) {
        float loss = (float)parallel.dpr->mean(validation_loss(model, pipeline, parallel, *val, val_batches));
        if (lead) printf("val loss %.6f\n", loss);
        if (lead) log.val(step, loss);
        if (!evals) return;
        double started = now_seconds();
        EvalResult r = evaluate(model, pipeline, parallel, *evals, o.B, o.T);
        if (!lead) return;
        printf("eval: %d/%zu = %.4f (%s, %.1f s)\n", r.correct, r.answers.size(), r.accuracy(), o.eval_file.c_str(),
               now_seconds() - started);
        log.eval(step, r.accuracy());
        hooks.at_eval(*evals, r);
    }

    // every rank samples (under ZeRO-3 forward is collective); the same seed gives every rank the same text
    void sample() {
        auto at = [&](const int* tokens, int t) { return logits_at(model, pipeline, parallel, tokens, o.T, t); };
        std::vector<int> tokens = sample_tokens(at, tokenizer->vocab_size, tokenizer->start, o.gen_tokens, o.T, sampler_rng);
        if (lead) printf("---\n%s\n---\n", tokenizer->decode(tokens).c_str());
    }

    // the gradient of the mean loss over the global batch with respect to one token's loss
    float loss_gradient() const { return 1.0f / (float)(run.tokens_per_micro_step * accumulation); }

    // One optimizer step: the mean loss over the global batch, accumulated over micro-batches that pass through
    // the pipeline's stages in the schedule's order; gradient buckets are reduced across dp while backward runs.
    // A NaN or Inf in the loss or the gradient norm, or a spike in either, skips the update, leaving the parameters
    // and the optimizer state as they were; both values are reduced already, so every rank takes the same decision.
    StepResult take_step(int step, float dloss) {
        for (int micro = 0; micro < accumulation; micro++) {
            if (!o.overfit) train_data->next_batch();
            inputs[micro] = train_data->inputs, targets[micro] = train_data->targets;
        }
        pipeline.timing = step == state.step && pp.on();
        bool profiled = step == profiled_step;
        if (pipeline.timing || profiled) grid.world_comm.wait(grid.world_comm.barrier());  // the ranks start together
        if (profiled) profile_begin(on_gpu);
        double t0 = now_seconds();
        parallel.dpr->zero_grad();
        model.moe.reset_statistics();
        StepResult r;
        double loss = pipeline.run(model, parallel.dpr.get(), actions, inputs, targets, o.B, o.T, dloss);
        r.loss = parallel.from_head_stage(loss / accumulation);
        r.lr = schedule.at(step);
        r.norm = parallel.dpr->grad_norm();
        r.loss = parallel.dpr->mean(r.loss);
        bool finite = std::isfinite(r.loss) && std::isfinite(r.norm);
        r.spike = finite ? spikes.check(r.loss, r.norm) : Spike{};
        r.skipped = !finite || r.spike.found();
        bad_steps = r.skipped ? bad_steps + 1 : 0;
        if (!r.skipped) {
            NvtxRange update("optimizer step");
            parallel.dpr->update(r.lr, o.weight_decay, r.norm);
            if (config.router_bias) parallel.balance_experts();
            spikes.record(r.loss, r.norm);
        }
        r.ms = (now_seconds() - t0) * 1000.0;
        if (profiled) profiler().end_step();
        return r;
    }

    // the step's line and main.log's; after the first step, what it sent, its memory, its cp balance and its
    // pipeline's bubble against the formulas (collectives)
    void report(int step, const StepResult& r, const BytesSent& sent) {
        ExpertStatistics experts = config.moe() ? parallel.expert_statistics((long)o.B * accumulation * grid.dp)
                                                : ExpertStatistics{};
        double aux = experts.aux;
        long dropped = o.moe_capacity > 0.0f ? experts.dropped : -1;
        bool first = step == state.step;
        if (lead) {
            printf("step %5d/%d | loss %.6f%s%s | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s%s\n", step + 1, steps, r.loss,
                   aux >= 0.0 ? strfmt(" | aux %.6f", aux).c_str() : "",
                   dropped >= 0 ? strfmt(" | dropped %ld", dropped).c_str() : "", r.lr, r.norm, r.ms,
                   run.total_batch / (r.ms / 1000.0),
                   r.skipped ? strfmt(" | update skipped: %s (%d in a row)",
                                      r.spike.found() ? spikes.reason(r.spike).c_str() : "not finite", bad_steps).c_str()
                             : "");
            if (first) report_against_plan(sent);
            fflush(stdout);
            log.train(step, (float)r.loss, r.lr, (float)r.norm, r.skipped, (float)aux, dropped, r.spike);
            if (config.moe() && o.val_every > 0 && step % o.val_every == 0) {
                printf("experts: min/max share of the assignments per layer: %s\n", experts.shares.c_str());
                log.expert_load(step, experts.shares);
            }
        }
        if (first && grid.cp > 1) report_cp_balance(r.ms);
        if (pipeline.timing) report_pipeline();
        if (step == profiled_step) report_profile();
    }

    // what the formulas of llmc/plan.h say this rank sends in a step on each group; ep's at the step's routing (the
    // rows it sent to or took from other ranks)
    BytesSent planned_sent() const {
        Device dev = device_of<floatX>;
        return BytesSent{planned_comm_bytes(config, par, dev), planned_tp_comm_bytes(config, par, o.B, o.T, dev),
                         planned_cp_comm_bytes(config, par, o.B, o.T, dev), planned_pp_comm_bytes(config, par, o.B, o.T, dev),
                         grid.ep > 1 ? ep_bytes_sent(model.moe.rows_crossing, model.moe.count_exchanges, config, grid.ep, dev)
                                     : 0.0};
    }

    // after the first step: what rank 0 sent and the memory in use, beside what the formulas and the plan say
    void report_against_plan(const BytesSent& sent) {
        BytesSent planned = planned_sent();
        if (grid.dp_cp().size > 1)
            printf("comm: rank 0 sent %.0f bytes on dp in this step; the formula for ZeRO-%d says %.0f\n", sent.dp, o.zero,
                   planned.dp);
        if (on_gpu)
            printf("memory: planned %.1f MiB, measured %.1f MiB (device memory in use after the first step, "
                   "cudaMemGetInfo)\n", (plan_memory(config, o.B, o.T, omp_get_max_threads(), par, Device::CUDA).total() +
                   CUBLASLT_WORKSPACE_BYTES) / 1048576.0, (gpu_memory_used() - gpu_baseline) / 1048576.0);
        if (grid.tp > 1)
            printf("comm: rank 0 sent %.0f bytes on tp in this step; the formula for tp=%d sp=%d says %.0f\n", sent.tp,
                   grid.tp, o.sp, planned.tp);
        if (grid.cp > 1)
            printf("comm: rank 0 sent %.0f bytes on cp in this step; the formula for cp=%d says %.0f\n", sent.cp, grid.cp,
                   planned.cp);
        if (grid.pp > 1)
            printf("comm: rank 0 sent %.0f bytes on pp in this step; the formula for pp=%d vpp=%d says %.0f\n", sent.pp,
                   grid.pp, o.vpp, planned.pp);
        if (grid.ep > 1)
            printf("comm: rank 0 sent %.0f bytes on ep in this step; the formula for ep=%d (4 all-to-alls per layer of "
                   "the %ld rows it routed to or took from other ranks, and the counts) says %.0f\n", sent.ep, grid.ep,
                   model.moe.rows_crossing, planned.ep);
    }

    // after the first step: the pipeline's idle time against its schedule's formula (a collective of the pp group)
    void report_pipeline() {
        double mine[2] = {pipeline.span, pipeline.busy};
        std::vector<double> all(2 * grid.pp);
        grid.pp_comm.wait(grid.pp_comm.all_gather(mine, all.data(), 2, DType::F64));
        double span = 0.0, busy = 0.0;
        for (int r = 0; r < grid.pp; r++) span = std::max(span, all[2 * r]), busy += all[2 * r + 1] / grid.pp;
        if (lead)
            printf("pp: bubble %.3f measured (idle over compute time, mean of the %d stages: %.1f ms of %.1f ms "
                   "busy); the %s formula says %.3f\n", (span - busy) / busy, grid.pp, busy * 1e3, span * 1e3,
                   o.pp_schedule.c_str(), pp_bubble_formula(pp.kind, grid.pp, accumulation, o.vpp));
    }

    // after the profiled step: what it measured beside the plan and the step model's prediction, and the trace
    // (collectives of the world)
    void report_profile() {
        MeasuredStep measured = measure_step(profiler());
        BytesSent planned = planned_sent();
        ParallelPlan stage = par;
        stage.pp.rank = grid.at.pp;
        ProfileSetting s{profiled_step + 1, on_gpu ? "cuda" : "cpu", layout.describe(),
                         plan_memory(config, o.B, o.T, omp_get_max_threads(), stage, device_of<floatX>), nullptr, "",
                         profile_kernels(), {planned.dp, planned.tp, planned.cp, planned.pp, planned.ep}};
        HardwareProfile hw;
        StepTime predicted;
        if (plan_hardware(o, device_of<floatX>, hw, s.hardware)) {
            predicted = predict_step(config, o.B, o.T, par, device_of<floatX>, hw, devices_per_node(o, hw));
            s.predicted = &predicted;
        }
        if (!o.profile.empty()) write_profile(o.profile, grid.world_comm, measured, s);
        std::string label = strfmt("rank %d", grid.rank) + (pp.on() ? " (" + stage_names(pp) + ")" : "");
        if (!o.trace.empty()) write_trace(o.trace, grid.world_comm, measured, label, pp.on() ? o.pp_schedule : "");
    }

    // after the first step, the attention work of each rank of rank 0's cp group and its step time: equal work
    // under zig-zag, and under a contiguous split the imbalance and what it costs (a collective of every cp group)
    void report_cp_balance(double ms) {
        CPLayout l = cp_layout(o.T, grid.cp, grid.at.cp, cp_split(o));
        long pairs = cp_attention_pairs(l);
        // per pair and channel: 4 FLOPs forward (Q·K and P·V), 8 backward (dQ, dK, dV and dP)
        double mine[3] = {(double)pairs, 12.0 * pairs * o.B * (config.channels / grid.tp) * config.num_layers * accumulation,
                          ms};
        std::vector<double> all(3 * grid.cp);
        grid.cp_comm.wait(grid.cp_comm.all_gather(mine, all.data(), 3, DType::F64));
        for (int r = 0; lead && r < grid.cp; r++)
            printf("cp: rank %d (%s) scores %.0f query-key pairs per sequence and head; attention %.4f GFLOP in this "
                   "step; step %.1f ms\n", r, o.cp_split.c_str(), all[3 * r], all[3 * r + 1] / 1e9, all[3 * r + 2]);
    }

    // The ends of a run besides the last step, each with its line on stderr and its exit code: a checkpoint that
    // found the state not finite (a finite update that overflowed: every later step would be skipped), a stop
    // signal, or --max-bad-steps skipped updates in a row
    int end(int code) {
        comm_finalize(world_comm);
        return code;
    }
    int end_not_finite(int step) {
        if (lead)
            fprintf(stderr, "train_gpt: step %d: the parameters or the optimizer state hold a NaN or Inf; no "
                    "checkpoint written (%s), stopping\n", step, newest_checkpoint(o.out_dir).c_str());
        return end(EXIT_NON_FINITE);
    }
    int end_stopped(int step) {
        if (lead && step == state.step)
            fprintf(stderr, "train_gpt: stopped before step %d on %s; no step taken, nothing written\n", step + 1,
                    stop_reason());
        else if (lead)
            fprintf(stderr, "train_gpt: stopped after step %d on %s; %s\n", step, stop_reason(),
                    o.out_dir.empty() ? "no checkpoint (no -o)"
                                      : ("checkpoint " + o.out_dir + "/" + checkpoint_name(step) +
                                         " written; resume with -y 1").c_str());
        return end(EXIT_STOPPED);
    }
    int end_bad_steps(int step, const Spike& spike) {
        if (lead)
            fprintf(stderr, "train_gpt: stopped after step %d: %d steps in a row skipped their update, the last "
                    "for %s (--max-bad-steps %d)\n", step + 1, bad_steps,
                    spike.found() ? ("a " + std::string(spike.what) + " spike").c_str()
                                  : "a non-finite loss or gradient norm", o.max_bad_steps);
        return end(EXIT_NON_FINITE);
    }
};

// The training run: set up this rank's part, resume or start, then step until the last step, too many skipped
// updates in a row, or a stop signal to any rank. Each step first checkpoints, validates and samples when due.
template <typename floatX>
static int train(const Options& o, const RunSetup& setup) {
    Trainer<floatX> t(o, setup);
    t.join_ranks();
    t.build_model();
    t.load();
    t.open_data();
    t.print_run();
    RunHooks hooks{o, t.grid, {}};  // the test aids of the --debug-* flags, and the bytes sent in a step
    bool stopping = stop_requested(t.grid.world_comm);  // some rank was signalled to stop: checkpoint, then end

    for (int step = t.state.step; step <= t.steps; step++) {
        bool last_step = step == t.steps;
        bool scheduled = o.checkpoint_every > 0 && (step % o.checkpoint_every == 0 || last_step);
        bool save = step > t.state.step && (scheduled || (stopping && !o.out_dir.empty()));
        if (save && !t.checkpoint(step)) return t.end_not_finite(step);
        if (stopping) return t.end_stopped(step);
        if (t.val && (step % o.val_every == 0 || last_step)) t.validate(step, hooks);
        if (t.tokenizer && ((step > 0 && step % o.sample_every == 0) || last_step)) t.sample();
        if (last_step) break;

        hooks.before_step(step, step == t.state.step);
        StepResult r = t.take_step(step, hooks.loss_gradient(step, t.loss_gradient()));
        t.report(step, r, hooks.after_step());
        if (t.bad_steps == o.max_bad_steps) return t.end_bad_steps(step, r.spike);
        stopping = stop_requested(t.grid.world_comm);
    }
    hooks.at_end([&] { t.parallel.check_replicas(); });
    return t.end(0);
}

// Rank 0 makes -o, refuses it in one line when it is not a writable directory, another run holds it, or (for a
// fresh run) an earlier run left its log or checkpoints there, and takes the lock. Then, under the lock, it
// removes the incomplete checkpoint directories an interrupted run leaves, saying so: a ckpt_STEP.tmp being
// written, or a ckpt_STEP being deleted (its manifest, which marks it complete, goes first).
static void open_out_dir(const Options& o, RunLock& lock) {
    const char* dir = o.out_dir.c_str();
    struct stat st;
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode)) fail("-o %s: not a directory", dir);
    make_dirs(o.out_dir);
    if (access(dir, W_OK | X_OK) != 0) fail("-o %s: not writable (%s)", dir, strerror(errno));
    lock.acquire(o.out_dir);
    // a fresh run never mixes with another run's files: pruning could delete its checkpoints, and a later -y 1
    // would resume the other run. Told to overwrite, it removes them first (checkpoints kept aside as
    // .unverified stay: they are evidence, and no run lists them)
    std::string log = o.out_dir + "/main.log";
    std::vector<int> checkpoints = list_checkpoints(o.out_dir);
    bool has_log = file_exists(log);
    if (!o.resume && (has_log || !checkpoints.empty()) && !o.overwrite)
        fail("-o %s: already holds %s of another run; resume that run with -y 1, choose another directory, or "
             "remove them (--overwrite 1)", dir,
             has_log && !checkpoints.empty() ? "checkpoints and the main.log" : has_log ? "the main.log" : "checkpoints");
    if (o.overwrite) {
        for (int step : checkpoints) {
            remove_checkpoint(o.out_dir, step);
            printf("removed %s/%s: --overwrite 1\n", dir, checkpoint_name(step).c_str());
        }
        if (has_log && unlink(log.c_str()) != 0) fail("%s: cannot remove (%s)", log.c_str(), strerror(errno));
        if (has_log) printf("removed %s: --overwrite 1\n", log.c_str());
    }
    for (const std::string& removed : remove_incomplete_checkpoints(o.out_dir))
        printf("removed %s: an incomplete checkpoint, left by a run interrupted while writing or deleting it\n",
               removed.c_str());
}

// Everything that can be refused (flags, -o, model, data, tokenizer) is checked before the first line is
// printed, so a bad input gets exactly one line; only the lines that name what was removed from -o or skipped
// there (open_out_dir, and the checkpoints that fail verification) may come before it.
static int run(const Options& o) {
    if (!o.convert.empty()) return convert_model(o);
    if (!o.from_profile.empty()) return calibrate_from_profile(o);
    Device dev = pick_device(o);
    if (o.attention == "wgmma" && dev == Device::CPU)
        fail("--attention wgmma: a GPU kernel; the cpu device has its own attention (use --device cuda)");
    AttentionKernels attention = AttentionKernels::MMA;  // the cpu device has its own attention
    if (dev == Device::CUDA && !o.planning()) {
        select_gpu();
        attention = attention_select(o.attention);  // without the flag the device's: wgmma on a Hopper, else mma
    }
    if (!o.calibrate.empty()) return calibrate(o, dev, comm_settings(o, dev), attention);
    if (o.comm == "nccl" && dev == Device::CPU)
        fail("--comm nccl: NCCL moves device buffers; the cpu device communicates with --comm mpi");

    // one run per output directory: rank 0 holds the lock for the whole run, from before it reads the directory
    RunLock lock;
    if (!o.out_dir.empty() && !o.planning() && detect_launch().rank == 0) open_out_dir(o, lock);
    std::string resume_dir;
    int resume_step = 0;
    std::vector<ResumeCandidate> candidates;
    if (o.resume) {
        // the run's settings are checked against the newest checkpoint whose manifest verifies, and train()
        // checksums its files; where none verifies, choose_checkpoint names each and refuses the run
        candidates = resume_candidates(o.out_dir);
        for (const ResumeCandidate& c : candidates)
            if (c.why.empty() && resume_dir.empty()) resume_dir = o.out_dir + "/" + checkpoint_name(c.step), resume_step = c.step;
        if (!candidates.empty() && resume_dir.empty()) choose_checkpoint(o.out_dir, candidates, nullptr);
    }
    // the run goes on from the checkpoint only with what it was started from and on, and only forward
    RunInputs inputs;
    if (!o.planning()) inputs = run_inputs(o.model, o.seed, o.shuffle, o.train_pattern);
    if (!o.planning() && !resume_dir.empty() && o.max_steps >= 0 && o.max_steps <= resume_step)
        fail("-x %d: %s has done %d steps already; -x counts the steps from the start of the run, so resume with "
             "a larger -x", o.max_steps, resume_dir.c_str(), resume_step);
    GPTConfig config = model_config(o, resume_dir);
    if (o.search) return print_search(o, config, dev), 0;
    int world = o.plan && o.plan_world > 0 ? o.plan_world : detect_launch().world;
    CheckedLayout layout = check_layout(o, config, world);
    int dp = layout.dp, accumulation = layout.accumulation;
    long tokens_per_micro_step = layout.tokens_per_micro_step, total_batch = layout.total_batch;
    size_t bucket_floats = o.bucket_floats();
    if (!o.plan && !resume_dir.empty())
        check_resume_from(inputs, run_layout(o, world, dp, total_batch, bucket_floats, dev), resume_dir);
    if (o.plan) return print_plan(o, config, device_line(dev, true, attention), dev, world, accumulation), 0;
    for (auto [flag, path] : {std::make_pair("--profile", o.profile), std::make_pair("--trace", o.trace)}) {
        if (path.empty() || detect_launch().rank != 0) continue;
        // refused now rather than after the profiled step, by the temporary name it is written under
        // (write_file_whole): a file already there stays as it is until the new one replaces it
        std::string tmp = path + ".tmp";
        FILE* f = fopen(tmp.c_str(), "w");
        if (!f) fail("%s %s: cannot write (%s)", flag, path.c_str(), strerror(errno));
        fclose(f);
        remove(tmp.c_str());
    }
    RunSetup run{config, resume_dir, candidates, inputs, accumulation, tokens_per_micro_step, total_batch, bucket_floats,
                 attention};
    return dev == Device::CUDA ? train<bf16>(o, run) : train<float>(o, run);
}
int main(int argc, char** argv) {
    try {
        return run(parse_options(argc, argv));
    } catch (const std::exception& e) {
        fprintf(stderr, "train_gpt: %s\n", e.what());
        fflush(stderr);
        comm_abort_job(1);
        return 1;
    }
}

// train_gpt: trains a GPT-2 on token shards, on one rank or many (launched with mpirun). The story of a run,
// top to bottom: read the flags, pick the device, join the other ranks and lay them out on the process grid,
// build the model (fresh, from an llm.c file, or from the newest checkpoint) with its data-parallel runtime,
// open this rank's slice of the data, then loop: checkpoint, validate, sample, and take one optimizer step
// over a global batch of micro-batches.
#include <cuda_runtime.h>
#include <omp.h>
#include <time.h>

#include <memory>

#include "llmc/checkpoint.h"
#include "llmc/comm.cuh"
#include "llmc/dataloader.h"
#include "llmc/gpt.cuh"
#include "llmc/grid.cuh"
#include "llmc/logger.h"
#include "llmc/options.h"
#include "llmc/plan.h"
#include "llmc/sampler.h"
#include "llmc/tokenizer.h"
#include "llmc/zero.cuh"

static double now_seconds() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// the CUDA backend is not built yet: --device cuda is refused, and a visible GPU is mentioned
static std::string device_line(const std::string& requested) {
    if (requested == "cuda") fail("--device cuda: the CUDA backend is not implemented yet; use --device cpu");
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    return strfmt("device cpu (%d OpenMP threads)%s", omp_get_max_threads(),
                  gpus > 0 && requested.empty() ? "; a GPU is visible, but the CUDA backend is not implemented yet" : "");
}

static GPTConfig model_config(const Options& o, const std::string& checkpoint_dir) {
    if (!checkpoint_dir.empty()) return checkpoint_config(checkpoint_dir);
    if (is_model_descriptor(o.model)) return parse_model_descriptor(o.model);
    int version;
    return read_model_header(o.model, &version);
}

static float validation_loss(GPT& model, DataLoader& val, int batches) {
    val.reset();
    double total = 0.0;
    for (int i = 0; i < batches; i++) {
        val.next_batch();
        total += gpt_forward(model, val.inputs.data(), val.targets.data(), val.B, val.T);
    }
    return (float)(total / batches);
}

static GridShape grid_shape(const Options& o) { return GridShape{o.tp, o.cp, o.pp, o.ep}; }

// the parallelisms whose issues have not landed are refused, after the grid has checked that they would fit
static void refuse_unbuilt_parallelism(const Options& o) {
    const char* names[] = {"--cp", "--pp", "--ep"};
    const char* what[] = {"context", "pipeline", "expert"};
    int sizes[] = {o.cp, o.pp, o.ep};
    for (int i = 0; i < 3; i++)
        if (sizes[i] > 1) fail("%s %d: %s parallelism is not implemented yet", names[i], sizes[i], what[i]);
}

static ParallelPlan parallel_plan(const Options& o, int dp, int accumulation) {
    return ParallelPlan{dp, o.zero, (size_t)(o.bucket_mb * 1048576.0 / 4.0), accumulation, o.tp, o.sp == 1, o.recompute};
}

// every tp rank's share of the parameters, rank after rank (a collective: over dp first under ZeRO-3)
static std::vector<float> gather_tp_shares(GPT& m, DataParallel& dpr, Grid& grid, int zero) {
    std::vector<float> local(m.num_parameters), all(m.num_parameters * grid.tp);
    if (zero == 3) dpr.all_gather_params(local.data());
    else std::copy(m.params, m.params + m.num_parameters, local.begin());
    grid.tp_comm.wait(grid.tp_comm.all_gather(local.data(), all.data(), m.num_parameters, DType::F32));
    return all;
}

// whether this rank's own parameter buffer is the whole model (no tp, no ZeRO-3): then nothing is copied to
// initialize, load or save it
static bool holds_whole_model(const Grid& grid, int zero) { return grid.tp == 1 && zero < 3; }

// The whole model in llm.c's layout: this rank's own buffer, or gathered into `storage` from every rank's
// share (a collective). Valid on every rank.
static float* whole_model(GPT& m, DataParallel& dpr, Grid& grid, int zero, std::vector<float>& storage) {
    if (holds_whole_model(grid, zero)) return m.params;
    std::vector<float> shares = gather_tp_shares(m, dpr, grid, zero);
    storage.resize(num_parameters(m.config));
    for (int r = 0; r < grid.tp; r++)
        tp_copy_params(m.config, grid.tp, r, storage.data(), &shares[r * m.num_parameters], false);
    return storage.data();
}

// every tensor that all tp ranks hold whole must hold the same bits on each (a test aid: --debug-check-replicas)
static void check_replicas(GPT& m, DataParallel& dpr, Grid& grid, int zero) {
    std::vector<float> shares = gather_tp_shares(m, dpr, grid, zero);
    ParamViews mine = param_views(&shares[grid.at.tp * m.num_parameters], m.param_sizes);
    for (int r = 0; r < grid.tp; r++) {
        ParamViews theirs = param_views(&shares[r * m.num_parameters], m.param_sizes);
        for (int t = 0; t < NUM_PARAM_TENSORS; t++)
            if (is_replicated(t) && memcmp(mine[t], theirs[t], m.param_sizes[t] * sizeof(float)) != 0)
                fail("replicas: differ: tensor %d on tp rank %d and tp rank %d", t, grid.at.tp, r);
    }
    if (grid.rank == 0) printf("replicas: identical across tp\n");
}

static void print_plan(const Options& o, const GPTConfig& config, const std::string& device, int world, int accumulation) {
    int dp = grid_dp(world, grid_shape(o));
    ParallelPlan par = parallel_plan(o, dp, accumulation);
    printf("%s\n", device.c_str());
    MemoryPlan plan = plan_memory(config, o.B, o.T, omp_get_max_threads(), par);
    size_t psi = count_parameters(config);
    printf("model L=%d C=%d NH=%d V=%d Vp=%d maxT=%d: %zu parameters\n", config.num_layers, config.channels,
           config.num_heads, config.vocab_size, config.padded_vocab_size, config.max_seq_len, psi);
    printf("layout: %d ranks, dp=%d, tp=%d (sp %s), ZeRO-%d, %d micro-steps per step, recompute %d\n", world, dp,
           o.tp, o.sp ? "on" : "off", o.zero, accumulation, o.recompute);
    print_memory(strfmt("predicted memory per rank, B=%d T=%d, fp32 on cpu:", o.B, o.T).c_str(), plan.bytes, plan.total());
    size_t local = num_parameters(config, o.tp), shard = bucket_layout(config, dp, par.bucket_floats, o.tp).shard_size;
    size_t mixed[MEM_CATEGORIES] = {};
    plan_model_states(mixed, local, shard, o.zero, BF16_MIXED);
    printf("model states per rank in bf16 mixed precision: params %.1f MiB, master weights %.1f MiB, grads %.1f MiB, "
           "optimizer %.1f MiB\n", mixed[MEM_PARAMS] / 1048576.0, mixed[MEM_MASTER_WEIGHTS] / 1048576.0,
           mixed[MEM_GRADS] / 1048576.0, mixed[MEM_OPTIMIZER] / 1048576.0);
    printf("communication per step per rank: %.0f bytes\n", planned_comm_bytes(config, par));
    printf("tensor-parallel communication per step per rank: %.0f bytes\n", planned_tp_comm_bytes(config, par, o.B, o.T));
}

// Everything that can be refused (flags, model, data, tokenizer) is checked before the first line is
// printed, so a bad input gets exactly one line.
static int run(const Options& o) {
    std::string device = device_line(o.device);
    if (o.comm == "nccl") fail("--comm nccl: NCCL moves device buffers; the cpu device communicates with --comm mpi");

    std::string resume_dir;
    if (o.resume) {
        std::vector<int> steps = list_checkpoints(o.out_dir);
        if (!steps.empty()) resume_dir = o.out_dir + "/" + checkpoint_name(steps.back());
    }
    // a fresh run never mixes its checkpoints with another run's (pruning could delete the new ones)
    if (o.checkpoint_every > 0 && !o.resume && !list_checkpoints(o.out_dir).empty())
        fail("-o %s: already holds checkpoints; resume with -y 1 or choose another directory", o.out_dir.c_str());
    GPTConfig config = model_config(o, resume_dir);
    if (o.T > config.max_seq_len) fail("-t %d: longer than the model's maximum sequence length %d", o.T, config.max_seq_len);
    int world = o.plan && o.plan_world > 0 ? o.plan_world : detect_launch().world;
    int dp = grid_dp(world, grid_shape(o));
    if (config.num_heads % o.tp != 0) fail("--tp %d: must divide the number of heads (%d)", o.tp, config.num_heads);
    if (o.sp && o.T % o.tp != 0)
        fail("--sp 1: the sequence length -t %d must be divisible by --tp %d (each rank keeps T/tp positions)", o.T, o.tp);
    long tokens_per_micro_step = (long)o.B * o.T * dp;
    long total_batch = o.total_batch == -1 ? tokens_per_micro_step : o.total_batch;
    if (total_batch % tokens_per_micro_step != 0)
        fail("-d %ld: must be a multiple of b*t*dp = %ld", total_batch, tokens_per_micro_step);
    if (total_batch / tokens_per_micro_step > (1 << 20))
        fail("-d %ld: needs %ld micro-steps of b*t*dp = %ld tokens; at most %d", total_batch,
             total_batch / tokens_per_micro_step, tokens_per_micro_step, 1 << 20);
    int accumulation = (int)(total_batch / tokens_per_micro_step);
    size_t bucket_floats = (size_t)(o.bucket_mb * 1048576.0 / 4.0);
    if (o.plan) return print_plan(o, config, device, world, accumulation), 0;
    refuse_unbuilt_parallelism(o);

    // the ranks: one world, laid out on the grid (dp and tp, so far)
    CommSettings cs{o.comm.empty() ? "mpi" : o.comm, o.comm_init, o.comm_address, o.comm_dir, o.comm_timeout};
    Comm world_comm = comm_world(cs);
    Grid grid = make_grid(world_comm, grid_shape(o));
    const bool lead = grid.rank == 0;  // rank 0 prints, logs and writes the shared files

    // the model (this rank's tensor-parallel share) and its data-parallel runtime
    GPT model;
    gpt_allocate(model, config, o.B, o.T, DataParallel::model_buffers(o.zero), TPSpec{grid.tp, grid.at.tp, o.sp == 1},
                 o.recompute);
    model.tp.comm = &grid.tp_comm;
    DataParallel dpr(model, grid.dp_comm, o.zero, bucket_floats);
    TrainState state;
    Rng sampler_rng(o.seed);
    RunLayout layout{o.B, o.T, grid.world, total_batch, grid.dp, o.zero, o.zero >= 1 ? bucket_floats : 0, grid.tp, o.sp};
    int optimizer_file = layout.optimizer_file(grid.rank, grid.at.tp);
    // the optimizer state a checkpoint holds for this rank; the whole model exists only while it is
    // initialized, loaded or saved, and every rank keeps its share of it
    auto model_state_with = [&](float* whole_params) {
        return ModelState{config, whole_params, o.zero >= 1 ? dpr.shard_m : model.adam_m,
                          o.zero >= 1 ? dpr.shard_v : model.adam_v,
                          o.zero >= 1 ? dpr.layout.shard_size : model.num_parameters, &model.adam_step};
    };
    {
        bool mine = holds_whole_model(grid, o.zero);
        std::vector<float> storage(mine ? 0 : num_parameters(config));
        float* whole = mine ? model.params : storage.data();
        if (!resume_dir.empty()) {
            load_checkpoint(resume_dir, model_state_with(whole), state, layout, optimizer_file);
            sampler_rng.state = state.rng_state;
        } else if (is_model_descriptor(o.model)) {
            gpt_init_random(config, whole, o.seed);
        } else {
            gpt_load_params(config, whole, o.model);
        }
        if (!mine) {
            std::vector<float> share(o.zero == 3 ? model.num_parameters : 0);
            float* local = o.zero == 3 ? share.data() : model.params;
            tp_copy_params(config, grid.tp, grid.at.tp, whole, local, true);
            if (o.zero == 3) dpr.scatter_params(local);
        }
    }

    // the data: this dp rank's slice of every micro-step of every global batch; the order of the global batches
    // depends on -t and -d, not on -b or dp
    DataLoader train(o.train_pattern, o.B, o.T, total_batch, grid.at.dp, grid.dp, o.shuffle, o.seed, config.vocab_size);
    if (!resume_dir.empty()) train.restore(state.loader);
    std::unique_ptr<DataLoader> val;
    int val_batches = 0;
    if (o.val_every > 0) {
        // -m global batches of -d tokens, each read as the training steps read theirs: the same tokens on any layout
        val.reset(new DataLoader(o.val_pattern, o.B, o.T, total_batch, grid.at.dp, grid.dp, false, o.seed, config.vocab_size));
        val_batches = (int)std::min<size_t>(o.val_batches, val->batches_per_epoch) * accumulation;
    }
    std::unique_ptr<Tokenizer> tokenizer;
    if (o.sample_every > 0) {
        tokenizer.reset(new Tokenizer(o.tokenizer));
        if (tokenizer->vocab_size != config.vocab_size)
            fail("%s: vocab size %d differs from the model's %d", o.tokenizer.c_str(), tokenizer->vocab_size, config.vocab_size);
    }
    int steps = o.max_steps >= 0 ? o.max_steps : (int)(train.total_tokens / total_batch);
    LRSchedule schedule = o.schedule;
    schedule.total_steps = steps;
    Logger log;
    if (lead) {
        printf("%s\n", device.c_str());
        if (grid.world > 1)
            printf("%d ranks over %s: dp=%d, tp=%d (sp %s), ZeRO-%d, buckets of %zu floats (%zu buckets)\n", grid.world,
                   o.comm.empty() ? "mpi" : o.comm.c_str(), grid.dp, grid.tp, o.sp ? "on" : "off", o.zero, bucket_floats,
                   dpr.layout.buckets.size());
        if (o.resume && resume_dir.empty()) printf("no checkpoint in %s; starting from scratch\n", o.out_dir.c_str());
        if (!resume_dir.empty()) printf("resumed from %s at step %d\n", resume_dir.c_str(), state.step);
        printf("model L=%d C=%d NH=%d V=%d (padded %d) maxT=%d: %zu parameters (%zu on each tp rank), %.1f MiB in all on "
               "each rank\n", config.num_layers, config.channels, config.num_heads, config.vocab_size,
               config.padded_vocab_size, config.max_seq_len, num_parameters(config), model.num_parameters,
               model.ledger.total() / 1048576.0);
        printf("train: %zu tokens in %s; batch %d x %d on %d dp ranks, %d micro-steps per step (%ld tokens); %d steps\n",
               train.total_tokens, o.train_pattern.c_str(), o.B, o.T, grid.dp, accumulation, total_batch, steps);
        if (!o.out_dir.empty()) {
            make_dirs(o.out_dir);
            log.open(o.out_dir, !resume_dir.empty());
        }
    }
    if (o.overfit) train.next_batch();  // the one batch every step will see
    ParallelPlan par = parallel_plan(o, grid.dp, accumulation);

    for (int step = state.step; step <= steps; step++) {
        bool last_step = step == steps;
        if (o.checkpoint_every > 0 && step > state.step && (step % o.checkpoint_every == 0 || last_step)) {
            TrainState now{step, train.state(), sampler_rng.state};
            std::vector<float> storage;
            float* whole = whole_model(model, dpr, grid, o.zero, storage);
            bool writes_optimizer = o.zero >= 1 || grid.at.dp == 0;
            save_checkpoint(o.out_dir, model_state_with(whole), now, layout, o.checkpoints_keep, grid.world_comm,
                            writes_optimizer ? optimizer_file : -1);
        }
        if (val && (step % o.val_every == 0 || last_step)) {
            float loss = (float)dpr.mean(validation_loss(model, *val, val_batches));
            if (lead) printf("val loss %.6f\n", loss);
            if (lead) log.val(step, loss);
        }
        // every rank samples (under ZeRO-3 forward is collective); the same seed gives every rank the same text
        if (tokenizer && ((step > 0 && step % o.sample_every == 0) || last_step)) {
            std::vector<int> tokens = sample_tokens(model, tokenizer->eot, o.gen_tokens, o.T, sampler_rng);
            if (lead) printf("---\n%s\n---\n", tokenizer->decode(tokens).c_str());
        }
        if (last_step) break;
        if (step == state.step && grid.rank == o.debug_stall_rank) sleep(1000000);

        // one optimizer step: the mean loss over the global batch, accumulated over micro-batches; gradient
        // buckets are reduced across dp while backward runs
        double t0 = now_seconds(), sent0 = grid.dp_comm.bytes_sent, tp_sent0 = grid.tp_comm.bytes_sent;
        dpr.zero_grad();
        double loss = 0.0;
        for (int micro = 0; micro < accumulation; micro++) {
            dpr.begin_micro_step(micro == accumulation - 1);
            if (!o.overfit) train.next_batch();
            loss += gpt_forward(model, train.inputs.data(), train.targets.data(), o.B, o.T) / accumulation;
            gpt_backward(model, 1.0f / (float)(tokens_per_micro_step * accumulation));
        }
        float lr = schedule.at(step);
        double norm;
        {
            NvtxRange update("optimizer step");
            norm = dpr.step(lr, o.weight_decay);
        }
        loss = dpr.mean(loss);
        double ms = (now_seconds() - t0) * 1000.0, sent = grid.dp_comm.bytes_sent - sent0;
        double tp_sent = grid.tp_comm.bytes_sent - tp_sent0;
        if (!lead) continue;
        printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", step + 1, steps, loss, lr,
               norm, ms, total_batch / (ms / 1000.0));
        if (step == state.step && grid.dp > 1)
            printf("comm: rank 0 sent %.0f bytes on dp in this step; the formula for ZeRO-%d says %.0f\n", sent, o.zero,
                   planned_comm_bytes(config, par));
        if (step == state.step && grid.tp > 1)
            printf("comm: rank 0 sent %.0f bytes on tp in this step; the formula for tp=%d sp=%d says %.0f\n", tp_sent,
                   grid.tp, o.sp, planned_tp_comm_bytes(config, par, o.B, o.T));
        fflush(stdout);
        log.train(step, (float)loss, lr, (float)norm);
    }
    if (o.debug_check_replicas && grid.tp > 1) check_replicas(model, dpr, grid, o.zero);
    comm_finalize(world_comm);
    return 0;
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

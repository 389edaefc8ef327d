// train_gpt: trains a GPT-2 on token shards. The story of a run, top to bottom: read the flags, pick the
// device, build the model (fresh, from an llm.c file, or from the newest checkpoint), open the data, then
// loop: checkpoint, validate, sample, and take one optimizer step over a global batch of micro-batches.
#include <cuda_runtime.h>
#include <omp.h>
#include <time.h>

#include <memory>

#include "llmc/checkpoint.h"
#include "llmc/dataloader.h"
#include "llmc/gpt.cuh"
#include "llmc/logger.h"
#include "llmc/options.h"
#include "llmc/plan.h"
#include "llmc/sampler.h"
#include "llmc/tokenizer.h"

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

// Everything that can be refused (flags, model, data, tokenizer) is checked before the first line is
// printed, so a bad input gets exactly one line.
static int run(const Options& o) {
    std::string device = device_line(o.device);
    const int rank = 0, world = 1;

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
    long tokens_per_micro_step = (long)o.B * o.T * world;
    long total_batch = o.total_batch == -1 ? tokens_per_micro_step : o.total_batch;
    if (total_batch % tokens_per_micro_step != 0)
        fail("-d %ld: must be a multiple of b*t*ranks = %ld", total_batch, tokens_per_micro_step);
    if (total_batch / tokens_per_micro_step > (1 << 20))
        fail("-d %ld: needs %ld micro-steps of b*t*ranks = %ld tokens; at most %d", total_batch,
             total_batch / tokens_per_micro_step, tokens_per_micro_step, 1 << 20);
    int accumulation = (int)(total_batch / tokens_per_micro_step);

    if (o.plan) {
        printf("%s\n", device.c_str());
        MemoryPlan plan = plan_memory(config, o.B, o.T, omp_get_max_threads());
        printf("model L=%d C=%d NH=%d V=%d Vp=%d maxT=%d: %zu parameters\n", config.num_layers, config.channels,
               config.num_heads, config.vocab_size, config.padded_vocab_size, config.max_seq_len, count_parameters(config));
        print_memory(strfmt("predicted memory per rank, B=%d T=%d, fp32 on cpu:", o.B, o.T).c_str(), plan.bytes, plan.total());
        return 0;
    }

    // the model: from a checkpoint, an llm.c file, or freshly initialized
    GPT model;
    gpt_allocate(model, config, o.B, o.T);
    TrainState state;
    Rng sampler_rng(o.seed);
    RunLayout layout{o.B, o.T, world, total_batch};
    if (!resume_dir.empty()) {
        load_checkpoint(resume_dir, model, state, layout);
        sampler_rng.state = state.rng_state;
    } else if (is_model_descriptor(o.model)) {
        gpt_init_random(model, o.seed);
    } else {
        gpt_load_params(model, o.model);
    }

    // the data
    DataLoader train(o.train_pattern, o.B, o.T, rank, world, o.shuffle, o.seed, config.vocab_size);
    if (!resume_dir.empty()) train.restore(state.loader);
    std::unique_ptr<DataLoader> val;
    int val_batches = 0;
    if (o.val_every > 0) {
        val.reset(new DataLoader(o.val_pattern, o.B, o.T, rank, world, false, o.seed, config.vocab_size));
        val_batches = (int)std::min<size_t>(o.val_batches, val->batches_per_epoch);
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
    printf("%s\n", device.c_str());
    if (o.resume && resume_dir.empty()) printf("no checkpoint in %s; starting from scratch\n", o.out_dir.c_str());
    if (!resume_dir.empty()) printf("resumed from %s at step %d\n", resume_dir.c_str(), state.step);
    printf("model L=%d C=%d NH=%d V=%d (padded %d) maxT=%d: %zu parameters, %.1f MiB in all\n", config.num_layers,
           config.channels, config.num_heads, config.vocab_size, config.padded_vocab_size, config.max_seq_len,
           model.num_parameters, model.ledger.total() / 1048576.0);
    printf("train: %zu tokens in %s; batch %d x %d, %d micro-steps per step (%ld tokens); %d steps\n",
           train.total_tokens, o.train_pattern.c_str(), o.B, o.T, accumulation, total_batch, steps);

    Logger log;
    if (!o.out_dir.empty()) {
        make_dirs(o.out_dir);
        log.open(o.out_dir, !resume_dir.empty());
    }
    if (o.overfit) train.next_batch();  // the one batch every step will see

    for (int step = state.step; step <= steps; step++) {
        bool last_step = step == steps;
        if (o.checkpoint_every > 0 && step > state.step && (step % o.checkpoint_every == 0 || last_step)) {
            TrainState now{step, train.state(), sampler_rng.state};
            save_checkpoint(o.out_dir, model, now, layout, o.checkpoints_keep);
        }
        if (val && (step % o.val_every == 0 || last_step)) {
            float loss = validation_loss(model, *val, val_batches);
            printf("val loss %.6f\n", loss);
            log.val(step, loss);
        }
        if (tokenizer && ((step > 0 && step % o.sample_every == 0) || last_step)) {
            std::vector<int> tokens = sample_tokens(model, tokenizer->eot, o.gen_tokens, o.T, sampler_rng);
            printf("---\n%s\n---\n", tokenizer->decode(tokens).c_str());
        }
        if (last_step) break;

        // one optimizer step: the mean loss over the global batch, accumulated over micro-batches
        double t0 = now_seconds();
        gpt_zero_grad(model);
        double loss = 0.0;
        for (int micro = 0; micro < accumulation; micro++) {
            if (!o.overfit) train.next_batch();
            loss += gpt_forward(model, train.inputs.data(), train.targets.data(), o.B, o.T) / accumulation;
            gpt_backward(model, 1.0f / (float)(tokens_per_micro_step * accumulation));
        }
        double norm = gpt_grad_norm(model);
        float lr = schedule.at(step);
        gpt_update(model, lr, o.weight_decay, clip_scale(norm, 1.0f));
        double ms = (now_seconds() - t0) * 1000.0;
        printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s\n", step + 1, steps, loss, lr,
               norm, ms, total_batch / (ms / 1000.0));
        fflush(stdout);
        log.train(step, (float)loss, lr, (float)norm);
    }
    return 0;
}

int main(int argc, char** argv) {
    try {
        return run(parse_options(argc, argv));
    } catch (const std::exception& e) {
        fprintf(stderr, "train_gpt: %s\n", e.what());
        return 1;
    }
}

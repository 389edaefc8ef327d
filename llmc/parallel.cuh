// The parallel layout of a training run as one object (Megatron-core's parallel_state, torchtitan's ParallelDims):
// the process grid with its communicators (llmc/grid.cuh), this rank's pipeline stage, and the data-parallel
// runtime (llmc/zero.cuh), with everything that depends on where this rank's share of the model lies:
//   - the model's communicators, handed to gpt_allocate (ModelLinks) with this rank's places in the groups;
//   - the share: assembled on the host to initialize or load the model, installed as the rank's parameters
//     (the CPU's own buffer, the GPU's master weights, ZeRO's shards), gathered back into llm.c's layout of the
//     whole model for a checkpoint, and compared across its replicas (--debug-check-replicas);
//   - the optimizer state a checkpoint holds for this rank, and which of the checkpoint's files this rank writes;
//   - the sums over ranks that a step's log and the experts' balancing need.
// The trainer (train_gpt.cu) asks it; no function there touches a shard. The CPU and GPU models differ only in what
// their storage holds (the CPU's parameters are fp32, the GPU's bf16 beside fp32 master weights), which the small
// overloads below say once each.
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/gpt.cuh"
#include "llmc/grid.cuh"
#include "llmc/pp.cuh"
#include "llmc/zero.cuh"

// this rank's tp share of the parameters, fp32 on the host: the CPU's own (gathered over dp under ZeRO-3), or
// the GPU's master weights (gathered over dp under ZeRO >= 1). A collective under ZeRO.
inline std::vector<float> local_share(GPT& m, DataParallel<float>& dpr, int zero) {
    std::vector<float> local(m.num_parameters);
    if (zero == 3) dpr.all_gather_params(local.data());
    dpr.refresh_params();
    if (zero < 3) std::copy(m.params, m.params + m.num_parameters, local.begin());
    return local;
}
inline std::vector<float> local_share(GPTCuda& m, DataParallel<bf16>& dpr, int zero) {
    std::vector<float> local(m.num_parameters);
    if (zero >= 1) dpr.get_master(local.data());
    else gpt_get_params(m, local.data());
    return local;
}

// Where this rank's share of the parameters (fp32, on the host) is assembled for initializing or loading: the CPU
// rank's own buffer unless ZeRO-3 shards it, else `storage`. The GPU model always stages it.
inline float* share_buffer(GPT& m, int zero, std::vector<float>& storage) {
    if (zero < 3) return m.params;
    storage.resize(m.num_parameters);
    return storage.data();
}
inline float* share_buffer(GPTCuda& m, int, std::vector<float>& storage) {
    storage.resize(m.num_parameters);
    return storage.data();
}

// The share, filled in share_buffer(), becomes this rank's parameters: under ZeRO-3 its shard of them
inline void install_share(GPT&, DataParallel<float>& dpr, int zero, float* share) {
    if (zero == 3) dpr.scatter_params(share);
}
// on the GPU: the master weights (sharded under ZeRO >= 1) take the fp32 values, the bf16 parameters (sharded
// under ZeRO-3) their rounding
inline void install_share(GPTCuda& m, DataParallel<bf16>& dpr, int zero, float* share) {
    if (zero >= 1) dpr.set_master(share);
    if (zero < 3) gpt_set_params(m, share);
}

// With experts: the step's load-balancing loss (its mean over the global batch's sequences), the assignments
// dropped at capacity and each layer's smallest and largest share of the assignments chosen ("min/max,...")
struct ExpertStatistics {
    double aux = -1.0;  // negative: a model without experts
    long dropped = 0;
    std::string shares;
};

// One rank's place in the run's layout, on the device whose storage type is floatX (llmc/device.cuh). Set up in
// the order of its methods: join() lays the world out on the grid, model_layout() says how the rank holds the
// model for gpt_allocate, attach() starts the data-parallel runtime on the allocated model.
template <typename floatX>
struct ParallelState {
    static constexpr bool on_gpu = device_of<floatX> == Device::CUDA;
    Grid grid;
    PPSpec pp;  // this rank's pipeline stage
    int zero = 0;
    GPTModel<floatX>* model = nullptr;
    std::unique_ptr<DataParallel<floatX>> dpr;
    // where this rank's parameters and moments lie in the whole model, which a checkpoint's files are cut by
    std::vector<ShareRun> share, optimizer_runs;
    // the checkpoint's optimizer file this rank writes; -1 where another rank holds the same state (a cp or dp
    // replica under ZeRO-0)
    int optimizer_file = -1;
    // the optimizer state a checkpoint holds for this rank, as fp32 on the host: the CPU's own buffers, or the
    // GPU's moments staged through host memory
    float *adam_m = nullptr, *adam_v = nullptr;
    size_t moments = 0;
    std::vector<float> staged_m, staged_v;

    // the world's ranks on the grid, and this rank's stage of the pipeline's schedule
    void join(Comm& world, const GridShape& shape, int zero_stage, int virtual_stages, PPKind kind) {
        grid = make_grid(world, shape);
        pp = PPSpec{grid.pp, grid.at.pp, virtual_stages, kind};
        zero = zero_stage;
    }

    // how this rank holds the model: the states ZeRO leaves it, its places in the tp, cp and ep groups, and the
    // communicators of its collectives (the rest of the layout is the run's: its part, slots, recomputation)
    ModelLayout model_layout(bool sp, CPSplit cp_split) {
        ModelLayout l;
        l.own = DataParallel<floatX>::model_buffers(zero);
        l.tp = TPSpec{grid.tp, grid.at.tp, sp};
        l.cp = CPSpec{grid.cp, grid.at.cp, cp_split}, l.ep = grid.ep;
        // a tensor split over tp or cp is scaled as a whole: its pieces' amaxes are shared
        l.links = ModelLinks{&grid.tp_comm, &grid.cp_comm, &grid.ep_comm, grid.at.ep,
                             grid.dp_cp().size > 1 ? &grid.dp_cp() : nullptr, &grid.tp_cp(), &grid.tp_comm,
                             grid.rank == 0};
        return l;
    }

    // The data-parallel runtime on the allocated model. The ranks of a cp group saw other tokens of the same
    // sequences: gradients are reduced over dp × cp; with experts split over ep, theirs over the ranks that hold
    // the same experts. Then the runs of the rank's share and optimizer state in the whole model, and its file.
    void attach(GPTModel<floatX>& m, size_t bucket_floats, bool fp8_param_gather, const RunLayout& run) {
        model = &m;
        StageLinks stages{pp.on() ? &grid.pp_comm : nullptr, m.part.tied_across_stages() ? &grid.tied_comm : nullptr};
        ExpertLinks experts{grid.ep > 1 ? &grid.expert_replicas() : nullptr, &grid.ep_comm};
        dpr.reset(new DataParallel<floatX>(m, grid.dp_cp(), zero, bucket_floats, stages, experts, fp8_param_gather));
        adam_m = zero >= 1 ? dpr->shard.m : m.adam_m;
        adam_v = zero >= 1 ? dpr->shard.v : m.adam_v;
        moments = zero >= 1 ? dpr->shard_size() : m.num_parameters;
        staged_m.resize(on_gpu ? moments : 0), staged_v.resize(on_gpu ? moments : 0);
        share = share_runs(m.config, share_spec(), m.part);
        optimizer_runs = zero >= 1 ? dpr->shard_runs(share) : share;
        bool writes_optimizer = zero >= 1 || (grid.at.dp < grid.ep && grid.at.cp == 0);
        optimizer_file = writes_optimizer ? run.optimizer_file(grid.rank, grid.at.tp, grid.at.pp, grid.at.ep) : -1;
    }

    // this rank's place in the groups that split the parameters
    ShareSpec share_spec() const { return ShareSpec{grid.tp, grid.at.tp, grid.ep, grid.at.ep}; }

    // whether this rank's own parameter buffer is the whole model (no tp, pp or ep, no ZeRO-3): then nothing is
    // copied to initialize, load or save it on the CPU
    bool holds_whole_model() const { return grid.tp == 1 && grid.pp == 1 && grid.ep == 1 && zero < 3; }

    // what a checkpoint saves or restores for this rank, with `params` the whole model (saving) or the share (loading)
    ModelState checkpoint_state(float* params) {
        return ModelState{model->config, params, share, on_gpu ? staged_m.data() : adam_m,
                          on_gpu ? staged_v.data() : adam_v, moments, optimizer_runs, &model->adam_step};
    }
    // the GPU's moments from and to their host staging (the CPU's are their own buffers)
    void download_moments() {
        if (!on_gpu) return;
        device_download<floatX>(staged_m.data(), adam_m, moments);
        device_download<floatX>(staged_v.data(), adam_v, moments);
    }
    void upload_moments() {
        if (!on_gpu) return;
        device_upload<floatX>(adam_m, staged_m.data(), moments);
        device_upload<floatX>(adam_v, staged_v.data(), moments);
    }

    // where this rank's share is assembled for initializing or loading (share_buffer above)
    float* share_buffer(std::vector<float>& storage) { return ::share_buffer(*model, zero, storage); }

    // A fresh model's share: `make` writes the whole model, in place when the share is all of it (no second copy
    // of a big model's parameters in memory), else in a temporary the share is cut from
    template <typename Make>
    void make_share(float* mine, Make&& make) {
        bool in_place = holds_whole_model();
        std::vector<float> temporary(in_place ? 0 : num_parameters(model->config));
        float* whole = in_place ? mine : temporary.data();
        make(whole);
        if (!in_place) copy_share_params(model->config, share_spec(), model->part, whole, mine, true);
    }

    // the share, assembled in share_buffer(), becomes this rank's parameters, and the routing's selection bias
    void install_share(float* mine) {
        ::install_share(*model, *dpr, zero, mine);
        dpr->params_changed();
        if (model->config.router_bias) gpt_read_expert_bias(*model, mine);
    }

    // every tp rank's share of the parameters, rank after rank (a collective)
    std::vector<float> gather_tp_shares() {
        std::vector<float> local = local_share(*model, *dpr, zero), all(model->num_parameters * grid.tp);
        grid.tp_comm.wait(grid.tp_comm.all_gather(local.data(), all.data(), model->num_parameters, DType::F32));
        return all;
    }

    // The whole model in llm.c's layout: this rank's own buffer, or gathered into `storage` from every rank's
    // share (a collective; on the GPU the master weights): each stage's tp shares, its ep group's (their experts),
    // then every stage's, padded to the largest stage's. Valid on every rank.
    float* whole_model(std::vector<float>& storage) {
        GPTModel<floatX>& m = *model;
        if constexpr (!on_gpu)
            if (holds_whole_model()) return dpr->refresh_params(), m.params;
        std::vector<ModelPart> parts;
        size_t largest = 0;
        for (int s = 0; s < grid.pp; s++) {
            parts.push_back(stage_part(m.config, PPSpec{pp.size, s, pp.virtual_stages, pp.kind}));
            largest = std::max(largest, num_parameters(m.config, grid.tp, parts.back(), grid.ep) * grid.tp * grid.ep);
        }
        std::vector<float> tp_shares = gather_tp_shares(), shares(tp_shares.size() * grid.ep), stages(largest * grid.pp);
        grid.ep_comm.wait(grid.ep_comm.all_gather(tp_shares.data(), shares.data(), tp_shares.size(), DType::F32));
        shares.resize(largest);
        grid.pp_comm.wait(grid.pp_comm.all_gather(shares.data(), stages.data(), largest, DType::F32));
        storage.resize(num_parameters(m.config));
        for (int s = 0; s < grid.pp; s++) {
            size_t n = num_parameters(m.config, grid.tp, parts[s], grid.ep);
            for (int e = 0; e < grid.ep; e++)
                for (int r = 0; r < grid.tp; r++)
                    copy_share_params(m.config, ShareSpec{grid.tp, r, grid.ep, e}, parts[s], storage.data(),
                                      &stages[s * largest + (e * grid.tp + r) * n], false);
        }
        return storage.data();
    }

    // every element that several tp ranks hold (the tensors all hold whole, the key/value heads several hold when
    // tp exceeds them) must hold the same bits on each (a test aid: --debug-check-replicas; on the GPU the master
    // weights are compared)
    void check_replicas() {
        GPTModel<floatX>& m = *model;
        std::vector<float> shares = gather_tp_shares();
        float* mine = &shares[grid.at.tp * m.num_parameters];
        auto tensor_at = [&](size_t offset) {
            int t = 0;
            while (offset >= m.param_sizes[t]) offset -= m.param_sizes[t++];
            return m.table[t].name;
        };
        for (int r = 0; r < grid.tp; r++) {
            if (r == grid.at.tp) continue;
            const float* theirs = &shares[r * m.num_parameters];
            for (const ShareRange& c : common_ranges(m.table, m.param_sizes, grid.tp, grid.at.tp, r))
                if (memcmp(mine + c.offset, theirs + c.offset, c.count * sizeof(float)) != 0)
                    fail("replicas: differ: %s on tp rank %d and tp rank %d", tensor_at(c.offset), grid.at.tp, r);
        }
        if (grid.rank == 0 && grid.tp > 1) printf("replicas: identical across tp\n");
        // the tied embeddings (wte and wpe, at the front of the share) of the first and the last stage
        if (grid.pp > 1 && m.part.tied_across_stages()) {
            size_t n = m.param_sizes[WTE] + m.param_sizes[WPE];
            std::vector<float> pair(2 * n);
            grid.tied_comm.wait(grid.tied_comm.all_gather(mine, pair.data(), n, DType::F32));
            if (memcmp(pair.data(), pair.data() + n, n * sizeof(float)) != 0)
                fail("replicas: the embeddings differ between the first and the last stage (tp rank %d)", grid.at.tp);
            if (grid.rank == 0) printf("replicas: the embeddings are identical on the first and the last stage\n");
        }
    }

    // a value the stage with the classifier holds (a loss, a row of logits, the eval's sums), given to every stage
    // (a collective of the pp group)
    double from_head_stage(double value) {
        grid.pp_comm.wait(grid.pp_comm.broadcast(&value, 1, DType::F64, pp.head_rank()));
        return value;
    }
    void from_head_stage(std::vector<double>& values) {
        grid.pp_comm.wait(grid.pp_comm.broadcast(values.data(), values.size(), DType::F64, pp.head_rank()));
    }
    void from_head_stage(std::vector<float>& values) {
        grid.pp_comm.wait(grid.pp_comm.broadcast(values.data(), values.size(), DType::F32, pp.head_rank()));
    }

    // The experts' statistics of the step's forward passes, summed over the ranks that saw other tokens (dp × cp)
    // and the stages that hold other layers (a collective); the aux loss as a mean over `sequences`
    ExpertStatistics expert_statistics(long sequences) {
        const MixtureOfExperts<floatX>& moe = model->moe;
        std::vector<double> sums(2 + moe.load.size());
        sums[0] = moe.aux_sum, sums[1] = (double)moe.dropped;
        std::copy(moe.load.begin(), moe.load.end(), sums.begin() + 2);
        for (Comm* group : {&grid.dp_cp(), &grid.pp_comm})
            group->wait(group->all_reduce(sums.data(), sums.data(), sums.size(), DType::F64));
        ExpertStatistics s{sums[0] / sequences, (long)sums[1], ""};
        int E = model->config.num_experts;
        for (int l = 0; l < model->config.num_layers; l++) {
            const double* load = &sums[2 + (size_t)l * E];
            double total = std::accumulate(load, load + E, 0.0);
            s.shares += strfmt("%s%.3f/%.3f", l ? "," : "", *std::min_element(load, load + E) / total,
                               *std::max_element(load, load + E) / total);
        }
        return s;
    }

    // DeepSeek-V3's balancing after an update: the step's loads summed over every rank (the tp group's first rank
    // counts them, dp × cp ranks routed other tokens, stages hold other layers; a collective) move each sparse
    // layer's selection bias, the same on every rank, in the routing and wherever the rank keeps the parameter
    void balance_experts() {
        std::vector<double> load = model->moe.load;
        for (Comm* group : {&grid.tp_comm, &grid.dp_cp(), &grid.pp_comm})
            group->wait(group->all_reduce(load.data(), load.data(), load.size(), DType::F64));
        gpt_balance_experts(*model, load, [&](size_t at, const float* values, size_t n) { dpr->set_values(at, values, n); });
    }
};

// Checkpoints: one directory per step under the output directory, holding everything needed to continue the
// run exactly: the model (llm.c format), the optimizer state, the training position (dataloader and RNG),
// and a manifest of the layout. A checkpoint is written under a temporary name and renamed only when every
// file is complete and synced, so a crash mid-write never damages or replaces a good checkpoint.
//
// The model file is always the whole model (gathered over tensor parallelism by the caller), so any layout can
// start from it. Every rank that holds distinct optimizer state writes it (optimizer_rankR.bin, R its world
// rank: every rank under ZeRO-1/2/3; under ZeRO-0 the ranks of dp rank 0, one per tp rank), rank 0 writes the
// model and the training position, and renames the directory into place only after every rank has finished.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/dataloader.h"
#include "llmc/gpt.cuh"
#include "llmc/utils.h"

constexpr int OPTIMIZER_MAGIC = 20261122;
constexpr int TRAIN_STATE_MAGIC = 20261123;
constexpr int CHECKPOINT_VERSION = 1;

// where training stands between steps
struct TrainState {
    int step = 0;  // steps completed
    DataLoaderState loader;
    uint64_t rng_state = 0;  // the sampler's generator
};

// the settings a resumed run must share with the run that wrote the checkpoint
struct RunLayout {
    int B = 0, T = 0, world = 1;
    long total_batch = 0;
    int dp = 1, zero = 0;
    size_t bucket_floats = 0;  // decides which rank owns which elements under ZeRO
    int tp = 1, sp = 0;
    bool operator==(const RunLayout& o) const {
        return B == o.B && T == o.T && world == o.world && total_batch == o.total_batch && dp == o.dp &&
               zero == o.zero && bucket_floats == o.bucket_floats && tp == o.tp && sp == o.sp;
    }
    // how many optimizer files a checkpoint holds, and which one a rank (by world, dp and tp rank) reads
    int optimizer_files() const { return zero >= 1 ? world : tp; }
    int optimizer_file(int world_rank, int tp_rank) const { return zero >= 1 ? world_rank : tp_rank; }
};

// what one rank saves and restores: the whole flat parameters (read by every rank, written by rank 0) and its
// optimizer state (all of it under ZeRO-0, its shard otherwise)
struct ModelState {
    GPTConfig config;
    float* params;
    float *adam_m, *adam_v;
    size_t optimizer_count;
    int* adam_step;
};

// the CPU model's own buffers, which hold fp32 on the host (a GPU model stages them: see train_gpt.cu)
inline ModelState model_state(GPT& m) { return {m.config, m.params, m.adam_m, m.adam_v, m.num_parameters, &m.adam_step}; }

inline std::string checkpoint_name(int step) { return strfmt("ckpt_%08d", step); }

inline void make_dirs(const std::string& path) {
    std::string partial;
    for (size_t i = 0; i <= path.size(); i++) {
        if (i == path.size() || path[i] == '/') {
            if (!partial.empty() && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
                fail("%s: cannot create directory (%s)", partial.c_str(), strerror(errno));
        }
        if (i < path.size()) partial += path[i];
    }
}

inline void remove_tree(const std::string& path) {
    DIR* d = opendir(path.c_str());
    if (!d) {
        unlink(path.c_str());
        return;
    }
    while (struct dirent* e = readdir(d)) {
        std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        remove_tree(path + "/" + name);
    }
    closedir(d);
    rmdir(path.c_str());
}

inline void fsync_dir(const std::string& path) {
    DIR* d = opendir(path.c_str());
    if (!d) return;
    fsync(dirfd(d));
    closedir(d);
}

// deletes a checkpoint so that no crash can leave it half-deleted yet still listed: the manifest, which is
// what marks it complete, goes first
inline void remove_checkpoint(const std::string& out_dir, int step) {
    std::string dir = out_dir + "/" + checkpoint_name(step);
    unlink((dir + "/manifest.txt").c_str());
    fsync_dir(dir);
    remove_tree(dir);
}

// the steps of the complete checkpoints in out_dir, oldest first (temporary directories are not complete)
inline std::vector<int> list_checkpoints(const std::string& out_dir) {
    std::vector<int> steps;
    DIR* d = opendir(out_dir.c_str());
    if (!d) return steps;
    while (struct dirent* e = readdir(d)) {
        int step;
        char tail;
        if (sscanf(e->d_name, "ckpt_%d%c", &step, &tail) == 1 && checkpoint_name(step) == e->d_name &&
            file_exists(out_dir + "/" + e->d_name + "/manifest.txt"))
            steps.push_back(step);
    }
    closedir(d);
    std::sort(steps.begin(), steps.end());
    return steps;
}

inline void write_manifest(const std::string& path, const GPTConfig& c, const TrainState& s, const RunLayout& r) {
    std::string optimizer_files;
    for (int i = 0; i < r.optimizer_files(); i++) optimizer_files += strfmt(" optimizer_rank%d.bin", i);
    std::string text = strfmt(
        "format llm5d-checkpoint %d\nstep %d\nnum_parameters %zu\nmodel L=%d C=%d NH=%d V=%d Vp=%d maxT=%d\n"
        "batch B=%d T=%d total=%ld\nlayout world=%d dp=%d tp=%d sp=%d cp=1 pp=1 ep=1 zero=%d bucket_floats=%zu\n"
        "files model.bin state_rank0.bin%s\n",
        CHECKPOINT_VERSION, s.step, num_parameters(c), c.num_layers, c.channels, c.num_heads, c.vocab_size,
        c.padded_vocab_size, c.max_seq_len, r.B, r.T, r.total_batch, r.world, r.dp, r.tp, r.sp, r.zero, r.bucket_floats,
        optimizer_files.c_str());
    File f(path, "wb");
    f.write(text.data(), text.size());
    f.close();
}

inline RunLayout read_manifest_layout(const std::string& path) {
    File f(path, "rb");
    std::string text(f.size(), '\0');
    f.read(&text[0], text.size());
    RunLayout r;
    const char* b = strstr(text.c_str(), "\nbatch ");
    const char* l = strstr(text.c_str(), "\nlayout ");
    if (!b || !l || sscanf(b, "\nbatch B=%d T=%d total=%ld", &r.B, &r.T, &r.total_batch) != 3 ||
        sscanf(l, "\nlayout world=%d dp=%d tp=%d sp=%d cp=1 pp=1 ep=1 zero=%d bucket_floats=%zu", &r.world, &r.dp,
               &r.tp, &r.sp, &r.zero, &r.bucket_floats) != 6)
        fail("%s: malformed manifest", path.c_str());
    return r;
}

inline void write_optimizer(const std::string& path, const ModelState& m) {
    File f(path, "wb");
    int h[256] = {OPTIMIZER_MAGIC, CHECKPOINT_VERSION, *m.adam_step};
    uint64_t n = m.optimizer_count;
    memcpy(&h[4], &n, 8);
    f.write(h, sizeof(h));
    f.write(m.adam_m, n * 4);
    f.write(m.adam_v, n * 4);
    f.close();
}

// A NaN or Inf in the moments is refused, named by parameter tensor where the file holds the whole model's
// moments in its flat order (`flat`: ZeRO-0 without tp), else by its place in this rank's share.
inline void read_optimizer(const std::string& path, const ModelState& m, bool flat) {
    File f(path, "rb");
    int h[256];
    if (f.size() < (long)sizeof(h)) fail("%s: not an optimizer state file", path.c_str());
    f.read(h, sizeof(h));
    uint64_t n;
    memcpy(&n, &h[4], 8);
    if (h[0] != OPTIMIZER_MAGIC || h[1] != CHECKPOINT_VERSION) fail("%s: not an optimizer state file", path.c_str());
    if (n != m.optimizer_count)
        fail("%s: holds state for %llu parameters, this rank keeps %zu", path.c_str(), (unsigned long long)n, m.optimizer_count);
    if (f.size() != (long)(sizeof(h) + 8 * n)) fail("%s: size disagrees with its header", path.c_str());
    *m.adam_step = h[2];
    f.read(m.adam_m, n * 4);
    f.read(m.adam_v, n * 4);
    const char* moment_names[2] = {"first moment (m)", "second moment (v)"};
    const float* moments[2] = {m.adam_m, m.adam_v};
    for (int k = 0; k < 2; k++) {
        size_t bad = first_non_finite(moments[k], n);
        if (bad == n) continue;
        std::string where =
            flat ? "of " + describe_param(m.config, bad) : strfmt("at element %zu of this rank's share", bad);
        fail("%s: %g in the %s %s (the optimizer state must be finite)", path.c_str(), moments[k][bad],
             moment_names[k], where.c_str());
    }
}

// whether the state a checkpoint would hold is finite on every rank: rank 0's whole parameters and every rank's
// optimizer state (collective over `world`, so that every rank agrees)
inline bool state_is_finite(const ModelState& m, Comm& world) {
    int bad = first_non_finite(m.adam_m, m.optimizer_count) < m.optimizer_count ||
              first_non_finite(m.adam_v, m.optimizer_count) < m.optimizer_count;
    if (world.rank == 0) bad |= first_non_finite(m.params, num_parameters(m.config)) < num_parameters(m.config);
    int total = 0;
    world.wait(world.all_reduce(&bad, &total, 1, DType::I32));
    return total == 0;
}

// Writes out_dir/ckpt_STEP atomically, then keeps only the newest `keep` checkpoints (0 keeps all).
// Collective over `world`: rank 0's m.params must hold the whole model; optimizer_file is the file this rank
// writes its optimizer state to, or -1 when another rank holds the same state.
// A state with a NaN or Inf is not written, and nothing is pruned: returns false. So every checkpoint on disk is
// finite, and pruning, which follows only a successful save, never removes the newest finite one.
inline bool save_checkpoint(const std::string& out_dir, const ModelState& m, const TrainState& s, const RunLayout& r,
                            int keep, Comm& world, int optimizer_file = 0) {
    if (!state_is_finite(m, world)) return false;
    std::string final_dir = out_dir + "/" + checkpoint_name(s.step);
    std::string tmp_dir = final_dir + ".tmp";
    bool lead = world.rank == 0;
    if (lead) {
        remove_tree(tmp_dir);
        make_dirs(tmp_dir);
        gpt_save_params(m.config, m.params, tmp_dir + "/model.bin");
        File f(tmp_dir + "/state_rank0.bin", "wb");
        int h[256] = {TRAIN_STATE_MAGIC, CHECKPOINT_VERSION, s.step};
        uint64_t fields[4] = {s.loader.epoch, s.loader.shard_pos, s.loader.sample_pos, s.rng_state};
        memcpy(&h[4], fields, sizeof(fields));
        f.write(h, sizeof(h));
        f.close();
    }
    world.wait(world.barrier());  // the directory exists
    if (optimizer_file >= 0) write_optimizer(tmp_dir + strfmt("/optimizer_rank%d.bin", optimizer_file), m);
    world.wait(world.barrier());  // every rank's files are complete and synced
    if (lead) {
        // the manifest goes last: its presence is what marks a checkpoint directory complete
        write_manifest(tmp_dir + "/manifest.txt", m.config, s, r);
        fsync_dir(tmp_dir);
        if (file_exists(final_dir + "/manifest.txt")) {
            // the same step again: swap the new directory in atomically, so one complete ckpt_STEP exists at
            // every moment, then remove the old one (now under the temporary name)
            if (renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
                fail("%s: cannot swap into place (%s)", tmp_dir.c_str(), strerror(errno));
            fsync_dir(out_dir);
            remove_tree(tmp_dir);
        } else {
            remove_tree(final_dir);  // an incomplete directory of that name, left by a crash
            if (rename(tmp_dir.c_str(), final_dir.c_str()) != 0)
                fail("%s: cannot rename into place (%s)", tmp_dir.c_str(), strerror(errno));
            fsync_dir(out_dir);
        }
        if (keep > 0) {
            std::vector<int> steps = list_checkpoints(out_dir);
            for (size_t i = 0; i + keep < steps.size(); i++) remove_checkpoint(out_dir, steps[i]);
        }
    }
    world.wait(world.barrier());
    return true;
}

// the model shape stored in a checkpoint, to allocate the model before load_checkpoint
inline GPTConfig checkpoint_config(const std::string& dir) {
    int version;
    return read_model_header(dir + "/model.bin", &version);
}

// restores the whole parameters into m.params, this rank's optimizer state and the training position
inline void load_checkpoint(const std::string& dir, const ModelState& m, TrainState& s, const RunLayout& expected,
                            int optimizer_file) {
    RunLayout r = read_manifest_layout(dir + "/manifest.txt");
    if (!(r == expected))
        fail("%s: written with -b %d -t %d -d %ld on %d ranks (dp %d, tp %d, sp %d, -z %d, bucket %zu floats); resume with "
             "the same settings (or start from its model.bin with -e)", dir.c_str(), r.B, r.T, r.total_batch, r.world,
             r.dp, r.tp, r.sp, r.zero, r.bucket_floats);
    gpt_load_params(m.config, m.params, dir + "/model.bin");
    read_optimizer(dir + strfmt("/optimizer_rank%d.bin", optimizer_file), m, r.zero == 0 && r.tp == 1);
    std::string path = dir + "/state_rank0.bin";
    File f(path, "rb");
    int h[256];
    if (f.size() < (long)sizeof(h)) fail("%s: not a training state file", path.c_str());
    f.read(h, sizeof(h));
    if (h[0] != TRAIN_STATE_MAGIC || h[1] != CHECKPOINT_VERSION) fail("%s: not a training state file", path.c_str());
    uint64_t fields[4];
    memcpy(fields, &h[4], sizeof(fields));
    s.step = h[2];
    s.loader = DataLoaderState{fields[0], fields[1], fields[2]};
    s.rng_state = fields[3];
}

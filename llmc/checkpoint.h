// Checkpoints: one directory per step under the output directory, holding everything needed to continue the
// run exactly: the model (llm.c format), the optimizer state, the training position (dataloader and RNG),
// and a manifest of the layout. A checkpoint is written under a temporary name and renamed only when every
// file is complete and synced, so a crash mid-write never damages or replaces a good checkpoint.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

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
    bool operator==(const RunLayout& o) const {
        return B == o.B && T == o.T && world == o.world && total_batch == o.total_batch;
    }
};

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

inline void write_manifest(const std::string& path, const GPT& m, const TrainState& s, const RunLayout& r) {
    const GPTConfig& c = m.config;
    std::string text = strfmt(
        "format llm5d-checkpoint %d\nstep %d\nnum_parameters %zu\nmodel L=%d C=%d NH=%d V=%d Vp=%d maxT=%d\n"
        "batch B=%d T=%d total=%ld\nlayout world=%d dp=%d tp=1 cp=1 pp=1 ep=1 zero=0\n"
        "files model.bin optimizer_rank0.bin state_rank0.bin\n",
        CHECKPOINT_VERSION, s.step, m.num_parameters, c.num_layers, c.channels, c.num_heads, c.vocab_size,
        c.padded_vocab_size, c.max_seq_len, r.B, r.T, r.total_batch, r.world, r.world);
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
        sscanf(l, "\nlayout world=%d", &r.world) != 1)
        fail("%s: malformed manifest", path.c_str());
    return r;
}

// writes out_dir/ckpt_STEP atomically, then keeps only the newest `keep` checkpoints (0 keeps all)
inline void save_checkpoint(const std::string& out_dir, const GPT& m, const TrainState& s, const RunLayout& r,
                            int keep) {
    std::string final_dir = out_dir + "/" + checkpoint_name(s.step);
    std::string tmp_dir = final_dir + ".tmp";
    remove_tree(tmp_dir);
    make_dirs(tmp_dir);

    gpt_save_params(m, tmp_dir + "/model.bin");
    {
        File f(tmp_dir + "/optimizer_rank0.bin", "wb");
        int h[256] = {OPTIMIZER_MAGIC, CHECKPOINT_VERSION, m.adam_step};
        uint64_t n = m.num_parameters;
        memcpy(&h[4], &n, 8);
        f.write(h, sizeof(h));
        f.write(m.adam_m, n * 4);
        f.write(m.adam_v, n * 4);
        f.close();
    }
    {
        File f(tmp_dir + "/state_rank0.bin", "wb");
        int h[256] = {TRAIN_STATE_MAGIC, CHECKPOINT_VERSION, s.step};
        uint64_t fields[4] = {s.loader.epoch, s.loader.shard_pos, s.loader.sample_pos, s.rng_state};
        memcpy(&h[4], fields, sizeof(fields));
        f.write(h, sizeof(h));
        f.close();
    }
    // the manifest goes last: its presence is what marks a checkpoint directory complete
    write_manifest(tmp_dir + "/manifest.txt", m, s, r);
    fsync_dir(tmp_dir);

    if (file_exists(final_dir + "/manifest.txt")) {
        // the same step again: swap the new directory in atomically, so one complete ckpt_STEP exists at every
        // moment, then remove the old one (now under the temporary name)
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

// the model shape stored in a checkpoint, to allocate the model before load_checkpoint
inline GPTConfig checkpoint_config(const std::string& dir) {
    int version;
    return read_model_header(dir + "/model.bin", &version);
}

inline void load_checkpoint(const std::string& dir, GPT& m, TrainState& s, const RunLayout& expected) {
    RunLayout r = read_manifest_layout(dir + "/manifest.txt");
    if (!(r == expected))
        fail("%s: written with -b %d -t %d -d %ld on %d ranks; resume with the same settings", dir.c_str(), r.B, r.T,
             r.total_batch, r.world);
    gpt_load_params(m, dir + "/model.bin");
    {
        std::string path = dir + "/optimizer_rank0.bin";
        File f(path, "rb");
        int h[256];
        f.read(h, sizeof(h));
        uint64_t n;
        memcpy(&n, &h[4], 8);
        if (h[0] != OPTIMIZER_MAGIC || h[1] != CHECKPOINT_VERSION) fail("%s: not an optimizer state file", path.c_str());
        if (n != m.num_parameters) fail("%s: holds %llu parameters, the model has %zu", path.c_str(), (unsigned long long)n, m.num_parameters);
        if (f.size() != (long)(sizeof(h) + 8 * n)) fail("%s: size disagrees with its header", path.c_str());
        m.adam_step = h[2];
        f.read(m.adam_m, n * 4);
        f.read(m.adam_v, n * 4);
    }
    {
        std::string path = dir + "/state_rank0.bin";
        File f(path, "rb");
        int h[256];
        f.read(h, sizeof(h));
        if (h[0] != TRAIN_STATE_MAGIC || h[1] != CHECKPOINT_VERSION) fail("%s: not a training state file", path.c_str());
        uint64_t fields[4];
        memcpy(fields, &h[4], sizeof(fields));
        s.step = h[2];
        s.loader = DataLoaderState{fields[0], fields[1], fields[2]};
        s.rng_state = fields[3];
    }
}

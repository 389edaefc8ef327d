// Checkpoints: one directory per step under the output directory, holding everything needed to continue the
// run: the model (llm.c format), the optimizer state, the training position (data and the sampler's RNG), and
// a manifest of the layout. A checkpoint is written under a temporary name and renamed only when every file is
// complete and synced, so a crash mid-write never damages or replaces a good checkpoint.
//
// Everything is in the model's own coordinates, so that a run saved on one layout continues on any other (another
// number of ranks, dp, ZeRO stage, tp, cp, pp, ep, -b or device) with the same -t and -d:
//   model.bin            the whole model, fp32 (llm.c's file): the master weights. Rank 0 writes it; a resuming
//                        rank reads only the ranges of its share (share_runs).
//   optimizer_rankR.bin  the AdamW moments of the elements rank R keeps (its share under ZeRO-0, where the ranks
//                        of one dp rank, one per tp, ep and pp rank, write; its shard under ZeRO >= 1, where
//                        every rank writes), in parallel: a header, the first moments, the second moments, then
//                        the index, one entry per slice: (tensor, layer, expert, first element, count) of the
//                        model's tensors. A resuming rank reads every index and takes exactly its elements.
//                        Neither file holds the padding rows a Llama's vocab has in memory only (zero, with
//                        zero moments), so a Llama's checkpoints read the same with and without them.
//   state_rank0.bin      the step, the data position in global batches (DataPosition), the sampler's RNG and
//                        the spike statistics (llmc/spikes.h).
//   manifest.txt         the layout that wrote it, the run's inputs and every file's checksum.
//
// The manifest records each file's checksum, taken as it is written, and the steps; -y 1 resumes only from a
// checkpoint whose files match them (verify_checkpoint), since a damaged file can otherwise load without error.
// Its last line is its own checksum, so that an edited or truncated manifest fails verification too. It also
// records what the run was started from and on (RunInputs), which a resumed run must name again.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/dataloader.h"
#include "llmc/gpt.cuh"
#include "llmc/spikes.h"
#include "llmc/utils.h"

constexpr int OPTIMIZER_MAGIC = 20261122;
constexpr int TRAIN_STATE_MAGIC = 20261123;
constexpr int CHECKPOINT_VERSION = 2;

// one entry of an optimizer file's index: `count` elements from `element` on, of a tensor's block for one layer
// and one expert (0 where the tensor has none): ParamCoord, on disk
struct OptimizerSlice {
    int32_t tensor, layer, expert, reserved;
    uint64_t element, count;
};

// where training stands between steps
struct TrainState {
    int step = 0;  // steps completed
    DataPosition data;
    uint64_t rng_state = 0;  // the sampler's generator
    // the spike statistics (llmc/spikes.h): the losses and gradient norms of the newest steps that updated
    std::vector<double> loss_window, norm_window;
};

// the layout that writes or resumes a checkpoint: what may change between the two, except T and the global batch
struct RunLayout {
    int B = 0, T = 0, world = 1;
    long total_batch = 0;
    int dp = 1, zero = 0;
    size_t bucket_floats = 0;  // decides which rank owns which elements under ZeRO
    int tp = 1, sp = 0;
    int cp = 1;
    std::string cp_split = "zigzag";
    int pp = 1, vpp = 1;  // stages, and virtual stages per rank: together they say which layers a rank holds
    int ep = 1;           // the experts' split
    std::string device = "cpu";
    // how many optimizer files a checkpoint holds, and which one a rank writes: each rank's shard under ZeRO,
    // else one per tp rank and ep rank (its experts) of each stage
    int optimizer_files() const { return zero >= 1 ? world : tp * ep * pp; }
    int optimizer_file(int world_rank, int tp_rank, int pp_rank, int ep_rank = 0) const {
        return zero >= 1 ? world_rank : tp_rank + tp * (ep_rank + ep * pp_rank);
    }
    // "2 ranks (dp 2, ZeRO-1, -b 4) on cpu", naming only the parallelisms in use
    std::string describe() const {
        std::string s = strfmt("%d rank%s (dp %d", world, world == 1 ? "" : "s", dp);
        if (tp > 1) s += strfmt(", tp %d%s", tp, sp ? " with sp" : "");
        if (cp > 1) s += strfmt(", cp %d %s", cp, cp_split.c_str());
        if (pp > 1) s += strfmt(", pp %d", pp) + (vpp > 1 ? strfmt(" vpp %d", vpp) : "");
        if (ep > 1) s += strfmt(", ep %d", ep);
        return s + strfmt(", ZeRO-%d, -b %d) on %s", zero, B, device.c_str());
    }
};

// Fails with one line unless a run of layout `now` can continue a checkpoint that `was` wrote: any layout reads
// the model's own coordinates, but another -t or -d would make other global batches, so another run.
inline void check_resumable(const RunLayout& now, const RunLayout& was, const std::string& dir) {
    if (now.T != was.T)
        fail("-y 1: -t %d differs from the checkpoint's -t %d (%s); the layout may change, the sequence length may "
             "not (or start from its model.bin with -e)", now.T, was.T, dir.c_str());
    if (now.total_batch != was.total_batch)
        fail("-y 1: -d %ld differs from the checkpoint's -d %ld (%s); the layout may change, the global batch may "
             "not (or start from its model.bin with -e)", now.total_batch, was.total_batch, dir.c_str());
}

// What a run is started from and trained on, besides its layout: the model (-e), --seed, --shuffle and the
// train data (-i). A resumed run that names other ones would go on training another run under this one's name, so
// -y 1 refuses it (check_run_inputs).
struct RunInputs {
    std::string model;            // -e: a descriptor, or a model file's or directory's absolute path
    uint64_t model_checksum = 0;  // the model file's FNV-1a 64; 0 for a descriptor
    uint64_t seed = 0;
    bool shuffle = true;
    std::string train_pattern;  // -i
    struct Shard {
        std::string path;
        long bytes;
        uint64_t header_checksum;  // FNV-1a 64 of its 1024-byte header, which holds the token count
    };
    std::vector<Shard> shards;  // the files -i matches, in the loader's order
};

// the FNV-1a 64 of a file's first `limit` bytes (all of them by default), read back
inline uint64_t file_checksum(const std::string& path, size_t limit = SIZE_MAX) {
    File f(path, "rb");
    Fnv1a64 sum;
    std::vector<char> buf(1 << 20);
    for (size_t got; limit > 0 && (got = fread(buf.data(), 1, std::min(buf.size(), limit), f.f)) > 0; limit -= got)
        sum.update(buf.data(), got);
    return sum.value;
}

// a model's checksum: its file's, or a model directory's (Hugging Face's) files' names and bytes in name order
inline uint64_t model_source_checksum(const std::string& path) {
    DIR* d = opendir(path.c_str());
    if (!d) return file_checksum(path);
    std::vector<std::string> names;
    while (struct dirent* e = readdir(d))
        if (e->d_name[0] != '.') names.push_back(e->d_name);
    closedir(d);
    std::sort(names.begin(), names.end());
    Fnv1a64 sum;
    for (const std::string& name : names) {
        uint64_t file = file_checksum(path + "/" + name);
        sum.update(name.data(), name.size());
        sum.update(&file, sizeof(file));
    }
    return sum.value;
}

// -e as the manifest records it: a file's or directory's absolute path (links resolved), so that --convert finds a
// Hugging Face directory's tokenizer files from wherever it runs; a descriptor, or a path not there, as given. A
// manifest written before model_source was absolute holds -e as the run was given it, relative to where it started.
inline std::string absolute_model_path(const std::string& model) {
    if (is_model_descriptor(model)) return model;
    char* real = realpath(model.c_str(), nullptr);
    if (!real) return model;
    std::string path = real;
    free(real);
    return path;
}

// reads the model file (or directory) and every shard header (the descriptor of a model needs nothing read)
inline RunInputs run_inputs(const std::string& model, uint64_t seed, bool shuffle, const std::string& train_pattern) {
    RunInputs in{absolute_model_path(model), is_model_descriptor(model) ? 0 : model_source_checksum(model), seed, shuffle,
                 train_pattern, {}};
    for (const std::string& path : shard_paths(train_pattern)) {
        File f(path, "rb");
        in.shards.push_back({path, f.size(), file_checksum(path, SHARD_HEADER_BYTES)});
    }
    return in;
}

// What one rank saves and restores, with where each run of it lies in the whole model (llmc/model_table.h's
// share_runs, and llmc/zero.cuh's shard_runs under ZeRO): the parameters, which are the whole model when saving
// (rank 0 writes them) and this rank's share when loading, and its optimizer state, all of it under ZeRO-0 and
// its shard otherwise.
struct ModelState {
    GPTConfig config;
    float* params;
    std::vector<ShareRun> params_runs;  // loading: where each run of params lies in the whole model
    float *adam_m, *adam_v;
    size_t optimizer_count;
    std::vector<ShareRun> optimizer_runs;  // where each run of the moments lies in the whole model (files keep this order)
    int* adam_step;
};

// the CPU model's own buffers, which hold the whole model in fp32 on the host (a GPU model, or a rank holding a
// share, stages them: llmc/parallel.cuh's checkpoint_state)
inline ModelState model_state(GPT& m) {
    std::vector<ShareRun> whole = whole_runs(m.config);
    return {m.config, m.params, whole, m.adam_m, m.adam_v, m.num_parameters, whole, &m.adam_step};
}

inline std::string checkpoint_name(int step) { return strfmt("ckpt_%08d", step); }
// whether `name` is a checkpoint directory's name, and of which step
inline bool is_checkpoint_name(const std::string& name, int* step) {
    char tail;
    return sscanf(name.c_str(), "ckpt_%d%c", step, &tail) == 1 && checkpoint_name(*step) == name;
}

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
        if (is_checkpoint_name(e->d_name, &step) && file_exists(out_dir + "/" + e->d_name + "/manifest.txt"))
            steps.push_back(step);
    }
    closedir(d);
    std::sort(steps.begin(), steps.end());
    return steps;
}

// Removes what an interrupted run can leave besides complete checkpoints: ckpt_STEP.tmp, being written, and
// ckpt_STEP without its manifest, being deleted. Neither can be resumed from. Returns the directories removed.
inline std::vector<std::string> remove_incomplete_checkpoints(const std::string& out_dir) {
    std::vector<std::string> removed;
    DIR* d = opendir(out_dir.c_str());
    if (!d) return removed;
    while (struct dirent* e = readdir(d)) {
        int step;
        char tail[8] = {};
        std::string name = e->d_name, path = out_dir + "/" + name;
        int fields = sscanf(e->d_name, "ckpt_%d%7s", &step, tail);
        bool writing = fields == 2 && name == checkpoint_name(step) + ".tmp";
        bool deleting = fields == 1 && name == checkpoint_name(step) && !file_exists(path + "/manifest.txt");
        if (writing || deleting) removed.push_back(path);
    }
    closedir(d);
    std::sort(removed.begin(), removed.end());
    for (const std::string& path : removed) remove_tree(path);
    return removed;
}

// `checksums` holds each file's name and checksum, model.bin and the state first, then the optimizer files.
// Paths go last on their lines, so that they may hold spaces.
inline void write_manifest(const std::string& path, const GPTConfig& c, const TrainState& s, int adam_step,
                           const RunLayout& r, const RunInputs& in,
                           const std::vector<std::pair<std::string, uint64_t>>& checksums) {
    std::string optimizer_files;
    for (int i = 0; i < r.optimizer_files(); i++) optimizer_files += strfmt(" optimizer_rank%d.bin", i);
    std::string text = strfmt(
        "format llm5d-checkpoint %d\nstep %d\nadam_step %d\nnum_parameters %zu\n"
        "model L=%d C=%d NH=%d V=%d Vp=%d maxT=%d%s\n"
        "batch B=%d T=%d total=%ld\nlayout world=%d dp=%d tp=%d sp=%d cp=%d cp_split=%s pp=%d vpp=%d ep=%d "
        "zero=%d bucket_floats=%zu device=%s\nfiles model.bin state_rank0.bin%s\n",
        CHECKPOINT_VERSION, s.step, adam_step, num_parameters(c), c.num_layers, c.channels, c.num_heads, c.vocab_size,
        c.padded_vocab_size, c.max_seq_len, family_shape(c).c_str(), r.B, r.T, r.total_batch, r.world, r.dp, r.tp, r.sp, r.cp, r.cp_split.c_str(),
        r.pp, r.vpp, r.ep, r.zero, r.bucket_floats, r.device.c_str(), optimizer_files.c_str());
    if (is_model_descriptor(in.model)) text += "model_source descriptor " + in.model + "\n";
    else text += strfmt("model_source file fnv1a64=%016llx ", (unsigned long long)in.model_checksum) + in.model + "\n";
    text += strfmt("seed %llu\nshuffle %d\n", (unsigned long long)in.seed, (int)in.shuffle);
    text += "train_pattern " + in.train_pattern + "\n";
    for (const RunInputs::Shard& sh : in.shards)
        text += strfmt("train_shard bytes=%ld header_fnv1a64=%016llx ", sh.bytes,
                       (unsigned long long)sh.header_checksum) + sh.path + "\n";
    for (const auto& [name, sum] : checksums) text += strfmt("checksum %s fnv1a64=%016llx\n", name.c_str(), (unsigned long long)sum);
    Fnv1a64 own;
    own.update(text.data(), text.size());
    text += strfmt("manifest fnv1a64=%016llx\n", (unsigned long long)own.value);
    File f(path, "wb");
    f.write(text.data(), text.size());
    f.close();
}

// the values of a manifest's lines that start with `key` and a space, in order
inline std::vector<std::string> manifest_values(const std::string& text, const std::string& key) {
    std::vector<std::string> values;
    for (size_t at = 0; at < text.size();) {
        size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        size_t from = at + key.size() + 1;
        if (text.compare(at, key.size() + 1, key + " ") == 0) values.push_back(text.substr(from, end - from));
        at = end + 1;
    }
    return values;
}

// the run inputs a manifest records; fails naming the first field it lacks (a manifest written before they were
// recorded lacks them all) or cannot read
inline RunInputs read_manifest_inputs(const std::string& path) {
    File f(path, "rb");
    std::string text = f.read_all();
    auto one = [&](const char* key) {
        std::vector<std::string> v = manifest_values(text, key);
        if (v.size() != 1)
            fail("%s: malformed manifest (%s %s line)", path.c_str(), v.empty() ? "no" : "more than one", key);
        return v[0];
    };
    auto malformed = [&](const char* key, const std::string& value) {
        fail("%s: malformed manifest (%s %s)", path.c_str(), key, value.c_str());
    };
    RunInputs in;
    std::string source = one("model_source"), seed = one("seed"), shuffle = one("shuffle");
    unsigned long long sum;
    int n = 0;
    if (source.rfind("descriptor ", 0) == 0) in.model = source.substr(11);
    else if (sscanf(source.c_str(), "file fnv1a64=%llx %n", &sum, &n) == 1 && n > 0)
        in.model = source.substr(n), in.model_checksum = sum;
    if (in.model.empty()) malformed("model_source", source);
    unsigned long long seed_value;
    if (sscanf(seed.c_str(), "%llu%n", &seed_value, &n) != 1 || n != (int)seed.size()) malformed("seed", seed);
    in.seed = seed_value;
    if (shuffle != "0" && shuffle != "1") malformed("shuffle", shuffle);
    in.shuffle = shuffle == "1";
    in.train_pattern = one("train_pattern");
    for (const std::string& shard : manifest_values(text, "train_shard")) {
        long bytes;
        n = 0;
        if (sscanf(shard.c_str(), "bytes=%ld header_fnv1a64=%llx %n", &bytes, &sum, &n) != 2 || n == 0 ||
            n == (int)shard.size())
            malformed("train_shard", shard);
        in.shards.push_back({shard.substr(n), bytes, sum});
    }
    if (in.shards.empty()) fail("%s: malformed manifest (no train_shard line)", path.c_str());
    return in;
}

// Fails with one line naming the flag, its value and the checkpoint's, unless `now` names what `was` recorded.
inline void check_run_inputs(const RunInputs& now, const RunInputs& was, const std::string& dir) {
    const char* d = dir.c_str();
    // an older manifest's relative -e names the same model when it resolves, from here, to the same path
    if (now.model != was.model && now.model != absolute_model_path(was.model))
        fail("-y 1: -e %s differs from the checkpoint's %s (%s)", now.model.c_str(), was.model.c_str(), d);
    if (now.model_checksum != was.model_checksum)
        fail("-y 1: -e %s: its checksum fnv1a64=%016llx differs from the checkpoint's %016llx: the file changed since "
             "the run began (%s)", now.model.c_str(), (unsigned long long)now.model_checksum,
             (unsigned long long)was.model_checksum, d);
    if (now.seed != was.seed)
        fail("-y 1: --seed %llu differs from the checkpoint's %llu (%s)", (unsigned long long)now.seed,
             (unsigned long long)was.seed, d);
    if (now.shuffle != was.shuffle)
        fail("-y 1: --shuffle %d differs from the checkpoint's %d (%s)", (int)now.shuffle, (int)was.shuffle, d);
    if (now.train_pattern != was.train_pattern)
        fail("-y 1: -i %s differs from the checkpoint's %s (%s)", now.train_pattern.c_str(), was.train_pattern.c_str(),
             d);
    if (now.shards.size() != was.shards.size())
        fail("-y 1: -i %s matches %zu files, the checkpoint's %zu (%s)", now.train_pattern.c_str(), now.shards.size(),
             was.shards.size(), d);
    for (size_t i = 0; i < now.shards.size(); i++) {
        const RunInputs::Shard &a = now.shards[i], &b = was.shards[i];
        if (a.path != b.path)
            fail("-y 1: -i %s: shard %zu is %s, the checkpoint's %s (%s)", now.train_pattern.c_str(), i, a.path.c_str(),
                 b.path.c_str(), d);
        if (a.bytes != b.bytes)
            fail("-y 1: -i shard %s: %ld bytes differs from the checkpoint's %ld (%s)", a.path.c_str(), a.bytes,
                 b.bytes, d);
        if (a.header_checksum != b.header_checksum)
            fail("-y 1: -i shard %s: its header's checksum fnv1a64=%016llx differs from the checkpoint's %016llx (%s)",
                 a.path.c_str(), (unsigned long long)a.header_checksum, (unsigned long long)b.header_checksum, d);
    }
}

inline RunLayout read_manifest_layout(const std::string& path) {
    File f(path, "rb");
    std::string text = f.read_all();
    RunLayout r;
    char split[16] = {}, device[16] = {};
    const char* b = strstr(text.c_str(), "\nbatch ");
    const char* l = strstr(text.c_str(), "\nlayout ");
    if (!b || !l || sscanf(b, "\nbatch B=%d T=%d total=%ld", &r.B, &r.T, &r.total_batch) != 3 ||
        sscanf(l, "\nlayout world=%d dp=%d tp=%d sp=%d cp=%d cp_split=%15[a-z] pp=%d vpp=%d ep=%d zero=%d bucket_floats=%zu "
               "device=%15[a-z]", &r.world, &r.dp, &r.tp, &r.sp, &r.cp, split, &r.pp, &r.vpp, &r.ep, &r.zero,
               &r.bucket_floats, device) != 12)
        fail("%s: malformed manifest", path.c_str());
    r.cp_split = split;
    r.device = device;
    return r;
}

// The moments of the elements this rank keeps, in the order of its runs, then the index of the slices they form;
// returns the checksum of the bytes written. Like model.bin, the file holds no padding rows that the model file
// lacks (a Llama's vocab rows past V, whose moments are zero), so its index is the same with or without them.
inline uint64_t write_optimizer(const std::string& path, const ModelState& m) {
    const std::vector<ShareRun> runs = stored_runs(m.config, m.optimizer_runs);
    std::vector<OptimizerSlice> index;
    uint64_t elements = 0;
    for (const ShareRun& r : runs) {
        ParamCoord p = param_coord(m.config, r.whole);
        index.push_back({p.tensor, p.layer, p.expert, 0, p.element, r.count});
        elements += r.count;
    }
    File f(path, "wb");
    int h[256] = {OPTIMIZER_MAGIC, CHECKPOINT_VERSION, *m.adam_step};
    uint64_t counts[2] = {elements, index.size()};
    memcpy(&h[4], counts, sizeof(counts));
    f.write(h, sizeof(h));
    for (const float* moment : {m.adam_m, m.adam_v})
        for (const ShareRun& r : runs) f.write(moment + r.local, r.count * 4);
    f.write(index.data(), index.size() * sizeof(OptimizerSlice));
    f.close();
    return f.written.value;
}

// Restores this rank's moments (m.optimizer_runs) from every optimizer file of a checkpoint (`files` of them),
// whatever layout wrote them: each file's index says which elements of the model it holds. An element no file
// holds, a malformed index, and a NaN or Inf (named by its tensor) are refused. One file is open at a time. The
// padding rows no file holds (write_optimizer) get zero moments, as they have in a run that never stopped.
inline void read_optimizer(const std::string& dir, int files, const ModelState& m) {
    struct Piece {
        size_t whole, count;  // in the whole model
        int file;
        size_t at;  // its first element's place among the file's
    };
    std::vector<size_t> elements_of;
    std::vector<Piece> pieces;
    for (int k = 0; k < files; k++) {
        std::string path = dir + strfmt("/optimizer_rank%d.bin", k);
        File f(path, "rb");
        int h[256];
        if (f.size() < (long)sizeof(h)) fail("%s: not an optimizer state file", path.c_str());
        f.read(h, sizeof(h));
        uint64_t counts[2];
        memcpy(counts, &h[4], sizeof(counts));
        if (h[0] != OPTIMIZER_MAGIC || h[1] != CHECKPOINT_VERSION)
            fail("%s: not an optimizer state file of this version (%d)", path.c_str(), CHECKPOINT_VERSION);
        if (counts[1] > (uint64_t)f.size() / sizeof(OptimizerSlice) ||
            (uint64_t)f.size() != sizeof(h) + 8 * counts[0] + counts[1] * sizeof(OptimizerSlice))
            fail("%s: size disagrees with its header", path.c_str());
        *m.adam_step = h[2];
        std::vector<OptimizerSlice> index(counts[1]);
        f.read_at(index.data(), index.size() * sizeof(OptimizerSlice), sizeof(h) + 8 * counts[0]);
        size_t at = 0;
        for (size_t i = 0; i < index.size(); i++) {
            const OptimizerSlice& s = index[i];
            bool valid = s.tensor >= 0 && s.tensor < NUM_PARAM_TENSORS &&
                         param_block_exists(m.config, s.tensor, s.layer, s.expert) &&
                         s.count <= param_block_size(m.config, s.tensor) &&
                         s.element <= param_block_size(m.config, s.tensor) - s.count;
            if (!valid) fail("%s: slice %zu of its index lies outside the model", path.c_str(), i);
            pieces.push_back({param_offset(m.config, {s.tensor, s.layer, s.expert, s.element}), s.count, k, at});
            at += s.count;
        }
        if (at != counts[0]) fail("%s: its index covers %zu elements, its header says %llu", path.c_str(), at,
                                  (unsigned long long)counts[0]);
        elements_of.push_back(at);
    }
    // the pieces in model order, each cut to what the ones before it do not hold (ranks that keep the same
    // elements, such as the tensor-parallel replicas, wrote the same values)
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.whole < b.whole; });
    std::vector<Piece> cover;
    size_t covered = 0;
    for (Piece p : pieces) {
        if (p.whole + p.count <= covered) continue;
        if (p.whole < covered) p.at += covered - p.whole, p.count -= covered - p.whole, p.whole = covered;
        cover.push_back(p);
        covered = p.whole + p.count;
    }
    // what to read from which file, gathered first so that each file is opened once
    struct Read {
        int file;
        size_t at, whole, local, count;  // `count` elements from `at` in the file: `whole` in the model, `local` here
    };
    std::vector<Read> reads;
    for (const ShareRun& r : m.optimizer_runs) {
        std::fill(m.adam_m + r.local, m.adam_m + r.local + r.count, 0.0f);
        std::fill(m.adam_v + r.local, m.adam_v + r.local + r.count, 0.0f);
    }
    for (const ShareRun& r : stored_runs(m.config, m.optimizer_runs)) {
        for (size_t g = r.whole; g < r.whole + r.count;) {
            auto it = std::upper_bound(cover.begin(), cover.end(), g, [](size_t at, const Piece& p) { return at < p.whole; });
            if (it == cover.begin() || g >= std::prev(it)->whole + std::prev(it)->count)
                fail("%s: no optimizer file holds the state of %s (a file of the checkpoint is missing its part)",
                     dir.c_str(), describe_param(m.config, g).c_str());
            const Piece& p = *std::prev(it);
            size_t n = std::min(r.whole + r.count, p.whole + p.count) - g;
            reads.push_back({p.file, p.at + (g - p.whole), g, r.local + (g - r.whole), n});
            g += n;
        }
    }
    std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
        return a.file != b.file ? a.file < b.file : a.at < b.at;
    });
    const char* moment_names[2] = {"first moment (m)", "second moment (v)"};
    float* moments[2] = {m.adam_m, m.adam_v};
    std::unique_ptr<File> f;
    for (const Read& r : reads) {
        std::string path = dir + strfmt("/optimizer_rank%d.bin", r.file);
        if (!f || f->path != path) f.reset(new File(path, "rb"));
        for (int k = 0; k < 2; k++) {
            float* dst = moments[k] + r.local;
            f->read_at(dst, r.count * 4, 1024 + 4 * (long)(k * elements_of[r.file] + r.at));
            size_t bad = first_non_finite(dst, r.count);
            if (bad < r.count)
                fail("%s: %g in the %s of %s (the optimizer state must be finite)", path.c_str(), dst[bad],
                     moment_names[k], describe_param(m.config, r.whole + bad).c_str());
        }
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
                            const RunInputs& inputs, int keep, Comm& world, int optimizer_file = 0) {
    if (!state_is_finite(m, world)) return false;
    std::string final_dir = out_dir + "/" + checkpoint_name(s.step);
    std::string tmp_dir = final_dir + ".tmp";
    bool lead = world.rank == 0;
    uint64_t model_sum = 0, state_sum = 0;
    if (lead) {
        remove_tree(tmp_dir);
        make_dirs(tmp_dir);
        model_sum = gpt_save_params(m.config, m.params, tmp_dir + "/model.bin");
        File f(tmp_dir + "/state_rank0.bin", "wb");
        int h[256] = {TRAIN_STATE_MAGIC, CHECKPOINT_VERSION, s.step};
        uint64_t fields[4] = {s.data.epoch, s.data.shard_pos, s.data.batch_pos, s.rng_state};
        memcpy(&h[4], fields, sizeof(fields));
        h[12] = (int)s.loss_window.size(), h[13] = (int)s.norm_window.size();
        f.write(h, sizeof(h));
        f.write(s.loss_window.data(), s.loss_window.size() * sizeof(double));
        f.write(s.norm_window.data(), s.norm_window.size() * sizeof(double));
        f.close();
        state_sum = f.written.value;
    }
    world.wait(world.barrier());  // the directory exists
    // each optimizer file's checksum travels to rank 0 as two 32-bit halves in its own slots, zero elsewhere,
    // so a sum over the ranks delivers every one exactly
    std::vector<int> mine(2 * r.optimizer_files(), 0), sums(mine.size(), 0);
    if (optimizer_file >= 0) {
        uint64_t sum = write_optimizer(tmp_dir + strfmt("/optimizer_rank%d.bin", optimizer_file), m);
        memcpy(&mine[2 * optimizer_file], &sum, 8);
    }
    // every rank's files are complete and synced once their checksums have arrived
    world.wait(world.all_reduce(mine.data(), sums.data(), (int)mine.size(), DType::I32));
    if (lead) {
        std::vector<std::pair<std::string, uint64_t>> checksums{{"model.bin", model_sum}, {"state_rank0.bin", state_sum}};
        for (int i = 0; i < r.optimizer_files(); i++) {
            uint64_t sum;
            memcpy(&sum, &sums[2 * i], 8);
            checksums.push_back({strfmt("optimizer_rank%d.bin", i), sum});
        }
        // the manifest goes last: its presence is what marks a checkpoint directory complete
        write_manifest(tmp_dir + "/manifest.txt", m.config, s, *m.adam_step, r, inputs, checksums);
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

// the step a checkpoint file records in its header (word 2 of the 256-int header, after magic and version)
inline int header_step(const std::string& path, int magic, const char* kind) {
    File f(path, "rb");
    int h[256];
    if (f.size() < (long)sizeof(h)) fail("%s: not %s file", path.c_str(), kind);
    f.read(h, sizeof(h));
    if (h[0] != magic || h[1] != CHECKPOINT_VERSION) fail("%s: not %s file", path.c_str(), kind);
    return h[2];
}

// a file a manifest lists, with the checksum it records
struct ListedFile {
    std::string name;
    uint64_t checksum;
};

// Fails with one line naming the file and the reason unless the manifest of out_dir/ckpt_STEP matches its own
// checksum and records the run's inputs, it lists exactly the files its layout implies, every one exists, and
// the directory name, the manifest, the state and the optimizer files agree on the step (the optimizer files on
// AdamW's, which trails the step by the skipped updates). Reads the manifest and the files' headers only; returns
// the files it lists, whose contents verify_files checks.
inline std::vector<ListedFile> verify_manifest(const std::string& out_dir, int step) {
    std::string dir = out_dir + "/" + checkpoint_name(step);
    std::string manifest = dir + "/manifest.txt";
    File f(manifest, "rb");
    std::string text = f.read_all();
    size_t own = text.rfind("manifest fnv1a64=");
    unsigned long long own_want;
    if (own == std::string::npos || (own > 0 && text[own - 1] != '\n') ||
        text.size() != own + strlen("manifest fnv1a64=0123456789abcdef\n") ||
        sscanf(text.c_str() + own, "manifest fnv1a64=%llx", &own_want) != 1)
        fail("%s: malformed manifest (its last line is not its own checksum: cut short, or written by an older "
             "train_gpt?)", manifest.c_str());
    Fnv1a64 own_got;
    own_got.update(text.data(), own);
    if (own_got.value != own_want)
        fail("%s: its checksum fnv1a64=%016llx differs from the one it records, %016llx (the manifest is damaged)",
             manifest.c_str(), (unsigned long long)own_got.value, own_want);
    read_manifest_inputs(manifest);
    int manifest_step, adam_step;
    const char* st = strstr(text.c_str(), "\nstep ");
    const char* ad = strstr(text.c_str(), "\nadam_step ");
    if (!st || !ad || sscanf(st, "\nstep %d", &manifest_step) != 1 || sscanf(ad, "\nadam_step %d", &adam_step) != 1)
        fail("%s: malformed manifest (no step or adam_step)", manifest.c_str());
    if (manifest_step != step)
        fail("%s: records step %d, its directory is named for step %d", manifest.c_str(), manifest_step, step);
    std::vector<ListedFile> files;
    for (const char* at = strstr(text.c_str(), "\nchecksum "); at; at = strstr(at + 1, "\nchecksum ")) {
        char name[256];
        unsigned long long want;
        if (sscanf(at, "\nchecksum %255s fnv1a64=%llx", name, &want) != 2)
            fail("%s: malformed checksum line", manifest.c_str());
        files.push_back({name, want});
    }
    // the files a resume opens are those the layout implies: each must have its checksum here, and only they may
    std::vector<std::string> implied{"model.bin", "state_rank0.bin"};
    for (int i = 0; i < read_manifest_layout(manifest).optimizer_files(); i++)
        implied.push_back(strfmt("optimizer_rank%d.bin", i));
    for (size_t i = 0; i < std::max(implied.size(), files.size()); i++) {
        if (i < files.size() && i < implied.size() && files[i].name == implied[i]) continue;
        if (i >= files.size())
            fail("%s: no checksum of %s, which its layout implies", manifest.c_str(), implied[i].c_str());
        fail("%s: a checksum of %s where its layout implies %s", manifest.c_str(), files[i].name.c_str(),
             i < implied.size() ? implied[i].c_str() : "no more files");
    }
    for (const ListedFile& file : files)
        if (!file_exists(dir + "/" + file.name))
            fail("%s/%s: missing (the manifest lists it)", dir.c_str(), file.name.c_str());
    int state_step = header_step(dir + "/state_rank0.bin", TRAIN_STATE_MAGIC, "a training state");
    if (state_step != step)
        fail("%s: records step %d, the manifest step %d", (dir + "/state_rank0.bin").c_str(), state_step, step);
    for (size_t i = 2; i < files.size(); i++) {
        std::string path = dir + "/" + files[i].name;
        int file_adam_step = header_step(path, OPTIMIZER_MAGIC, "an optimizer state");
        if (file_adam_step != adam_step)
            fail("%s: records AdamW step %d, the manifest %d", path.c_str(), file_adam_step, adam_step);
    }
    return files;
}

// Fails with one line naming the file unless each of `files` (in out_dir/ckpt_STEP) that falls to `rank` of
// `ranks` matches the checksum its manifest records. The files are dealt out by size, the largest first to the
// rank with the fewest bytes so far, so that the ranks of a job share the reading; every rank deals the same way.
inline void verify_files(const std::string& dir, const std::vector<ListedFile>& files, int rank = 0, int ranks = 1) {
    std::vector<size_t> order(files.size());
    std::vector<long> sizes(files.size()), load(ranks, 0);
    for (size_t i = 0; i < files.size(); i++) {
        order[i] = i;
        File f(dir + "/" + files[i].name, "rb");
        sizes[i] = f.size();
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
    for (size_t i : order) {
        int to = (int)(std::min_element(load.begin(), load.end()) - load.begin());
        load[to] += sizes[i];
        if (to != rank) continue;
        std::string path = dir + "/" + files[i].name;
        unsigned long long got = file_checksum(path), want = files[i].checksum;
        if (got != want)
            fail("%s: checksum fnv1a64=%016llx, the manifest records %016llx (the file is damaged)", path.c_str(), got,
                 want);
    }
}

// the whole check on one process: the manifest, then every file
inline void verify_checkpoint(const std::string& out_dir, int step) {
    verify_files(out_dir + "/" + checkpoint_name(step), verify_manifest(out_dir, step));
}

// the model shape stored in a checkpoint, to allocate the model before load_checkpoint
inline GPTConfig checkpoint_config(const std::string& dir) {
    int version;
    return read_model_header(dir + "/model.bin", &version);
}

// Restores this rank's share of the parameters (m.params, placed by m.params_runs), its optimizer state and the
// training position from a checkpoint that any layout wrote (check_resumable says whether this run may go on from
// it); returns the layout that wrote it.
inline RunLayout load_checkpoint(const std::string& dir, const ModelState& m, TrainState& s) {
    RunLayout was = read_manifest_layout(dir + "/manifest.txt");
    gpt_read_params(m.config, m.params, m.params_runs, dir + "/model.bin");
    read_optimizer(dir, was.optimizer_files(), m);
    std::string path = dir + "/state_rank0.bin";
    File f(path, "rb");
    int h[256];
    if (f.size() < (long)sizeof(h)) fail("%s: not a training state file", path.c_str());
    f.read(h, sizeof(h));
    if (h[0] != TRAIN_STATE_MAGIC || h[1] != CHECKPOINT_VERSION) fail("%s: not a training state file", path.c_str());
    uint64_t fields[4];
    memcpy(fields, &h[4], sizeof(fields));
    s.step = h[2];
    s.data = DataPosition{fields[0], fields[1], fields[2]};
    s.rng_state = fields[3];
    // words 12 and 13 count the spike windows' values, which follow the header (0 in files that predate them)
    if (h[12] < 0 || h[13] < 0 || h[12] > MAX_SPIKE_WINDOW || h[13] > MAX_SPIKE_WINDOW)
        fail("%s: spike windows of %d and %d values, not a training state", path.c_str(), h[12], h[13]);
    s.loss_window.resize(h[12]);
    s.norm_window.resize(h[13]);
    f.read(s.loss_window.data(), s.loss_window.size() * sizeof(double));
    f.read(s.norm_window.data(), s.norm_window.size() * sizeof(double));
    return was;
}

// Tests of checkpoints: a resumed run continues bit for bit like an uninterrupted one (losses in main.log, the
// final model and optimizer state), -nk keeps only the newest checkpoints, a crash mid-write (simulated and real,
// by SIGKILL) always leaves the previous checkpoint loadable and resumable, a checkpoint from a different batch
// layout is refused with one line, and saving the same step twice replaces the checkpoint atomically.
// The binary tests run ./train_gpt from the repository root (`make test` builds it first).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <set>
#include <sstream>

#include "llmc/checkpoint.h"
#include "test_helpers.h"

extern char** environ;

namespace test_checkpoint {

const char* TRAIN_GPT = "./train_gpt";

// every run of the binary gets this: libgomp's default active waiting turns each parallel region into a
// scheduler time slice when the two cores are shared with another process, which makes tiny runs take seconds
const char* OMP_ENV = "OMP_WAIT_POLICY=passive";

void require_binary() {
    INFO("./train_gpt not found: build it with `make train_gpt` (`make test` does) and run the tests from the "
         "repository root");
    REQUIRE(access(TRAIN_GPT, X_OK) == 0);
}

CommandResult train_gpt(const std::string& args) {
    return run_command(std::string(OMP_ENV) + " " + TRAIN_GPT + " " + args);
}

// a tokenizer for a made-up vocabulary, so that samples can be printed (and compared) for a tiny model
void write_tokenizer(const std::string& path, int vocab) {
    uint32_t header[256] = {};
    header[0] = 20240328;
    header[1] = 2;
    header[2] = (uint32_t)vocab;
    header[3] = (uint32_t)vocab - 1;
    File f(path, "wb");
    f.write(header, sizeof(header));
    for (int i = 0; i < vocab; i++) {
        std::string s = strfmt("<%d>", i);
        uint8_t len = (uint8_t)s.size();
        f.write(&len, 1);
        f.write(s.data(), s.size());
    }
    f.close();
}

std::string read_bytes(const std::string& path) {
    File f(path, "rb");
    std::string s((size_t)f.size(), '\0');
    if (!s.empty()) f.read(&s[0], s.size());
    return s;
}

std::vector<std::string> split_lines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
}

// main.log lines ("s:STEP ...") of steps >= first
std::vector<std::string> log_lines_from(const std::string& path, int first) {
    std::vector<std::string> out;
    for (const std::string& line : split_lines(read_bytes(path))) {
        int step;
        if (sscanf(line.c_str(), "s:%d", &step) == 1 && step >= first) out.push_back(line);
    }
    return out;
}

std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& x : v) s += (s.empty() ? "" : " ") + x;
    return s;
}

std::string tail(const std::string& s, size_t n) { return s.size() > n ? s.substr(s.size() - n) : s; }

void copy_tree(const std::string& from, const std::string& to) {
    CommandResult r = run_command("cp -r '" + from + "' '" + to + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
}

// the files of two checkpoint directories hold the same bytes, file by file
void require_same_checkpoint(const std::string& a, const std::string& b) {
    std::vector<std::string> names = list_dir(a);
    REQUIRE(names == std::vector<std::string>{"manifest.txt", "model.bin", "optimizer_rank0.bin", "state_rank0.bin"});
    REQUIRE(list_dir(b) == names);
    for (const std::string& n : names) {
        INFO(a << "/" << n << " vs " << b << "/" << n);
        CHECK(read_bytes(a + "/" + n) == read_bytes(b + "/" + n));
    }
}

// token shards for the tiny model (vocab 300): two train shards of 6 and 9 samples of b*t = 32 tokens, so that
// 15 micro-batches make an epoch and a 12-step run with 2 micro-batches per step crosses into the second epoch
struct TinyData {
    TempDir dir;
    std::string train, val, tokenizer;
    TinyData() {
        Rng rng(2024);
        write_shard(dir / "train_000.bin", random_tokens(6 * 32 + 1 + 7, 300, rng));
        write_shard(dir / "train_001.bin", random_tokens(9 * 32 + 1 + 20, 300, rng));
        write_shard(dir / "val_000.bin", random_tokens(3 * 32 + 1, 300, rng));
        train = dir / "train_*.bin";
        val = dir / "val_*.bin";
        tokenizer = dir / "tok.bin";
        write_tokenizer(tokenizer, 300);
    }
    // a schedule with warmup and decay, and weight decay, so that the step number and the optimizer state matter
    std::string flags(int steps) const {
        return strfmt("-e d2c32h2t32v300 -i '%s' -j '%s' -b 2 -t 16 -d 64 -x %d -v 3 -m 2 -s 0 -l 3e-3 -u 3 -q 0.1 "
                      "-c 0.1 --seed 7",
                      train.c_str(), val.c_str(), steps);
    }
};

const RunLayout TINY_LAYOUT{2, 16, 1, 64};
Comm solo;  // checkpoints of a single-process run

GPTConfig tiny_config() { return parse_model_descriptor("d2c32h2t32v300"); }

// a model with random parameters and a non-trivial optimizer state
void init_model(GPT& m, uint64_t seed) {
    gpt_init_random(m.config, m.params, seed);
    Rng rng(seed + 1);
    for (size_t i = 0; i < m.num_parameters; i++) {
        m.adam_m[i] = rng.normal(0.0f, 0.01f);
        m.adam_v[i] = rng.uniform() * 1e-4f;
    }
    m.adam_step = (int)seed % 100 + 1;
}

void require_same_model(const GPT& a, const GPT& b) {
    REQUIRE(a.num_parameters == b.num_parameters);
    size_t bytes = a.num_parameters * sizeof(float);
    CHECK(memcmp(a.params, b.params, bytes) == 0);
    CHECK(memcmp(a.adam_m, b.adam_m, bytes) == 0);
    CHECK(memcmp(a.adam_v, b.adam_v, bytes) == 0);
    CHECK(a.adam_step == b.adam_step);
}

std::string resumed_line(const std::string& out_dir, int step) {
    return strfmt("resumed from %s/%s at step %d", out_dir.c_str(), checkpoint_name(step).c_str(), step);
}

TEST_CASE("a resumed run continues bit-exactly like an uninterrupted one", "[checkpoint]") {
    require_binary();
    TinyData data;
    TempDir runs;
    const std::string A = runs / "A", B = runs / "B", C = runs / "C";

    // A: 12 steps, checkpoints at 5, 10 and the last step 12
    CommandResult a = train_gpt(data.flags(12) + " -n 5 -o '" + A + "'");
    INFO(a.output);
    REQUIRE(a.status == 0);
    REQUIRE(list_checkpoints(A) == std::vector<int>{5, 10, 12});
    // 12 training lines and validation at 0, 3, 6, 9, 12
    REQUIRE(log_lines_from(A + "/main.log", 0).size() == 17);

    // the checkpoint at step 10 is past the epoch boundary (15 micro-batches), so the shuffle of epoch 1 is resumed
    {
        GPT m;
        gpt_allocate(m, checkpoint_config(A + "/ckpt_00000010"), 2, 16);
        TrainState s;
        load_checkpoint(A + "/ckpt_00000010", model_state(m), s);
        CHECK(s.step == 10);
        CHECK(s.data.epoch == 1);
        CHECK(m.adam_step == 10);
    }

    SECTION("checkpointing does not change the run") {
        CommandResult c = train_gpt(data.flags(12) + " -o '" + C + "'");
        INFO(c.output);
        REQUIRE(c.status == 0);
        CHECK(list_checkpoints(C).empty());
        CHECK(read_bytes(C + "/main.log") == read_bytes(A + "/main.log"));
    }

    SECTION("resuming from step 5 or step 10 reproduces the rest of the run") {
        CommandResult b = train_gpt(data.flags(12) + " -n 5 -o '" + B + "'");
        INFO(b.output);
        REQUIRE(b.status == 0);
        CHECK(read_bytes(B + "/main.log") == read_bytes(A + "/main.log"));

        for (int from : {5, 10}) {
            // the state a run interrupted after writing ckpt_<from> leaves: only that checkpoint, no log
            const std::string R = runs / strfmt("R%d", from);
            make_dirs(R);
            copy_tree(B + "/" + checkpoint_name(from), R + "/" + checkpoint_name(from));
            CommandResult r = train_gpt(data.flags(12) + " -n 5 -y 1 -o '" + R + "'");
            INFO("resumed from step " << from << ":\n" << r.output);
            REQUIRE(r.status == 0);
            CHECK(r.output.find(resumed_line(R, from)) != std::string::npos);

            std::vector<std::string> expected = log_lines_from(A + "/main.log", from);
            std::vector<std::string> got = log_lines_from(R + "/main.log", 0);
            REQUIRE(!expected.empty());
            CHECK(got == expected);

            std::vector<int> want_ckpts = from == 5 ? std::vector<int>{5, 10, 12} : std::vector<int>{10, 12};
            CHECK(list_checkpoints(R) == want_ckpts);
            if (from == 5) require_same_checkpoint(A + "/ckpt_00000010", R + "/ckpt_00000010");
            require_same_checkpoint(A + "/ckpt_00000012", R + "/ckpt_00000012");
        }
    }
}

TEST_CASE("a resumed run draws the same samples (the sampler's RNG is restored)", "[checkpoint]") {
    require_binary();
    TinyData data;
    TempDir runs;
    const std::string A = runs / "A", R = runs / "R";
    std::string flags = data.flags(12) + " -s 4 -g 8 --tokenizer '" + data.tokenizer + "'";
    // the samples a run prints: the text between "---" lines
    auto samples = [](const std::string& out) {
        std::vector<std::string> s;
        std::vector<std::string> lines = split_lines(out);
        for (size_t i = 0; i + 2 < lines.size(); i++)
            if (lines[i] == "---" && lines[i + 2] == "---") s.push_back(lines[++i]), i++;
        return s;
    };
    CommandResult a = train_gpt(flags + " -n 6 -o '" + A + "'");
    INFO(a.output);
    REQUIRE(a.status == 0);
    std::vector<std::string> sa = samples(a.output);
    REQUIRE(sa.size() == 3);  // steps 4, 8, 12

    make_dirs(R);
    copy_tree(A + "/ckpt_00000006", R + "/ckpt_00000006");
    CommandResult r = train_gpt(flags + " -n 6 -y 1 -o '" + R + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find(resumed_line(R, 6)) != std::string::npos);
    CHECK(samples(r.output) == std::vector<std::string>(sa.begin() + 1, sa.end()));
    CHECK(log_lines_from(R + "/main.log", 0) == log_lines_from(A + "/main.log", 6));
}

TEST_CASE("-nk keeps only the newest checkpoints", "[checkpoint]") {
    require_binary();
    TinyData data;
    TempDir runs;

    SECTION("-n 2 -nk 2 over 8 steps leaves steps 6 and 8") {
        CommandResult r = train_gpt(data.flags(8) + " -n 2 -nk 2 -o '" + runs.path + "'");
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(list_dir(runs.path) ==
              std::vector<std::string>{"ckpt_00000006", "ckpt_00000008", "main.log", "train_gpt.lock"});
        CHECK(list_checkpoints(runs.path) == std::vector<int>{6, 8});
    }
    SECTION("without -nk every checkpoint stays") {
        CommandResult r = train_gpt(data.flags(8) + " -n 3 -o '" + runs.path + "'");
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(list_dir(runs.path) ==
              std::vector<std::string>{"ckpt_00000003", "ckpt_00000006", "ckpt_00000008", "main.log", "train_gpt.lock"});
    }
}

TEST_CASE("a fresh run refuses a directory that holds another run's checkpoints", "[checkpoint]") {
    require_binary();
    TinyData data;
    TempDir runs;
    CommandResult first = train_gpt(data.flags(6) + " -n 3 -o '" + runs.path + "'");
    REQUIRE(first.status == 0);
    std::vector<std::string> before = list_dir(runs.path);
    // without -y its checkpoints would mix with the old ones, and -nk could prune the new ones away
    CommandResult again = train_gpt(data.flags(4) + " -n 2 -nk 1 -o '" + runs.path + "'");
    INFO(again.output);
    CHECK(again.status == 1);
    CHECK(split_lines(again.output).size() == 1);
    CHECK(again.output.find("already holds checkpoints") != std::string::npos);
    CHECK(list_dir(runs.path) == before);
}

TEST_CASE("a checkpoint interrupted mid-write leaves the previous one loadable", "[checkpoint]") {
    TinyData data;
    TempDir out;
    GPT saved;
    gpt_allocate(saved, tiny_config(), 2, 16);
    init_model(saved, 3);
    TrainState state{3, DataPosition{0, 1, 2}, 0x1234567890abcdefull};
    // recording what data.flags() names, so that the binary resumes from it below
    save_checkpoint(out.path, model_state(saved), state, TINY_LAYOUT, run_inputs("d2c32h2t32v300", 7, true, data.train),
                    0, solo);
    const std::string good = out / "ckpt_00000003";
    REQUIRE(list_checkpoints(out.path) == std::vector<int>{3});

    // what a process killed while writing later checkpoints leaves behind: a temporary directory with a
    // truncated model and no manifest; and a final-named directory without a manifest
    std::string model = read_bytes(good + "/model.bin");
    make_dirs(out / "ckpt_00000006.tmp");
    {
        File f(out / "ckpt_00000006.tmp/model.bin", "wb");
        f.write(model.data(), model.size() / 2);
        f.close();
    }
    copy_tree(good, out / "ckpt_00000009");
    REQUIRE(unlink((out / "ckpt_00000009/manifest.txt").c_str()) == 0);
    // and a complete temporary directory whose rename never happened
    copy_tree(good, out / "ckpt_00000012.tmp");

    CHECK(list_checkpoints(out.path) == std::vector<int>{3});

    GPT loaded;
    gpt_allocate(loaded, checkpoint_config(good), 2, 16);
    TrainState got;
    load_checkpoint(good, model_state(loaded), got);
    require_same_model(loaded, saved);
    CHECK(got.step == 3);
    CHECK(got.data == state.data);
    CHECK(got.rng_state == state.rng_state);

    // the binary resumes from step 3, ignoring the incomplete directories
    require_binary();
    CommandResult r = train_gpt(data.flags(5) + " -y 1 -n 10 -o '" + out.path + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find(resumed_line(out.path, 3)) != std::string::npos);
    CHECK(r.output.find("step     5/5") != std::string::npos);
    // its last step wrote a checkpoint
    CHECK(list_checkpoints(out.path) == std::vector<int>{3, 5});
}

TEST_CASE("SIGKILL at any point of checkpointing leaves every complete checkpoint loadable", "[checkpoint]") {
    require_binary();
    // a model big enough (14.5M parameters: 58 MB model, 116 MB optimizer state) that writing a checkpoint
    // takes a noticeable time, on a few hundred tokens
    TempDir dir;
    Rng rng(99);
    write_shard(dir / "train.bin", random_tokens(400, 50257, rng));
    const std::string out = dir / "out";
    const std::string base = "-e d2c256h4t64 -i " + (dir / "train.bin") + " -j " + (dir / "train.bin") +
                             " -b 1 -t 8 -v 0 -s 0 -o " + out;

    std::vector<std::string> env;
    for (char** e = environ; *e; e++)
        if (strncmp(*e, "OMP_WAIT_POLICY=", 16) != 0) env.push_back(*e);
    env.push_back(OMP_ENV);
    std::vector<char*> envp;
    for (std::string& s : env) envp.push_back(&s[0]);
    envp.push_back(nullptr);

    auto spawn = [&](const std::string& args) {
        std::vector<std::string> words{TRAIN_GPT};
        std::istringstream in(args);
        for (std::string w; in >> w;) words.push_back(w);
        std::vector<char*> argv;
        for (std::string& w : words) argv.push_back(&w[0]);
        argv.push_back(nullptr);
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        std::string log = dir / "spawned.log";
        posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        posix_spawn_file_actions_adddup2(&fa, 1, 2);
        pid_t pid;
        int rc = posix_spawn(&pid, TRAIN_GPT, &fa, nullptr, argv.data(), envp.data());
        posix_spawn_file_actions_destroy(&fa);
        REQUIRE(rc == 0);
        return pid;
    };

    // the kill points, each watched for by polling the output directory; `from` is the first step whose
    // checkpoint may trigger it, so that the run has completed one checkpoint of its own before
    enum Point { TMP_CREATED, WRITING_OPTIMIZER, MANIFEST_WRITTEN, DELETING_OLDEST, AFTER_DELAY };
    const char* point_names[] = {"temporary directory created", "optimizer state being written",
                                 "manifest written, before the rename", "oldest checkpoint being deleted",
                                 "1.5 s after start"};
    // DELETING_OLDEST fires when a checkpoint seen complete during this run is no longer intact (a file or the
    // whole directory gone), which -nk's deletion of the oldest does, however it goes about it
    const std::vector<std::string> FILES{"manifest.txt", "model.bin", "optimizer_rank0.bin", "state_rank0.bin"};
    std::set<int> seen_complete;
    auto reached = [&](Point p, int from, double elapsed) {
        if (p == AFTER_DELAY) return elapsed > 1.5;
        if (p == DELETING_OLDEST) {
            for (int step : seen_complete)
                for (const std::string& f : FILES)
                    if (!file_exists(out + "/" + checkpoint_name(step) + "/" + f)) return true;
            for (int step : list_checkpoints(out)) seen_complete.insert(step);
            return false;
        }
        for (const std::string& name : list_dir(out)) {
            int step;
            char suffix[8] = {};
            if (sscanf(name.c_str(), "ckpt_%d%7s", &step, suffix) != 2 || strcmp(suffix, ".tmp") != 0 || step < from)
                continue;
            const std::string d = out + "/" + name;
            if (p == TMP_CREATED) return true;
            if (p == WRITING_OPTIMIZER && file_exists(d + "/optimizer_rank0.bin")) return true;
            if (p == MANIFEST_WRITTEN && file_exists(d + "/manifest.txt")) return true;
        }
        return false;
    };
    auto seconds = [] {
        timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
    };

    GPT model;  // allocated at the first load
    int newest = 0;
    for (Point p : {TMP_CREATED, WRITING_OPTIMIZER, MANIFEST_WRITTEN, DELETING_OLDEST, AFTER_DELAY}) {
        INFO("kill point: " << point_names[p]);
        // runs "forever" (1000 steps), checkpointing every step and keeping two; resumes what earlier rounds left
        pid_t pid = spawn(base + " -x 1000 -n 1 -nk 2 -y 1");
        double t0 = seconds();
        bool hit = false;
        seen_complete.clear();
        int status = 0;
        while (seconds() - t0 < 30) {
            if ((hit = reached(p, newest + 2, seconds() - t0))) break;
            if (waitpid(pid, &status, WNOHANG) == pid) {
                pid = -1;
                break;
            }
            usleep(100);
        }
        if (pid > 0) {
            kill(pid, SIGKILL);
            REQUIRE(waitpid(pid, &status, 0) == pid);
        }
        INFO("its output, last part:\n" << tail(read_bytes(dir / "spawned.log"), 2000));
        REQUIRE(hit);
        REQUIRE(WIFSIGNALED(status));

        // whatever the kill left: every checkpoint that looks complete loads, and the newest is at least as
        // new as the one before the checkpoint the kill interrupted
        std::vector<int> steps = list_checkpoints(out);
        INFO("directory after the kill: " << join(list_dir(out)));
        REQUIRE(!steps.empty());
        CHECK(steps.back() >= newest);
        for (int s : steps) {
            const std::string d = out + "/" + checkpoint_name(s);
            INFO("loading " << d);
            if (model.num_parameters == 0) gpt_allocate(model, checkpoint_config(d), 1, 8);
            TrainState st;
            CHECK_NOTHROW(load_checkpoint(d, model_state(model), st));
            CHECK(st.step == s);
        }
        newest = steps.back();

        // and a run resumes from the newest and takes one more step
        CommandResult r = train_gpt(base + strfmt(" -x %d -y 1", newest + 1));
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(r.output.find(resumed_line(out, newest)) != std::string::npos);
        CHECK(r.output.find(strfmt("step %5d/%d", newest + 1, newest + 1)) != std::string::npos);
    }
}

TEST_CASE("a checkpoint is refused with one line under another -t or -d (the layout and -b may change)", "[checkpoint]") {
    require_binary();
    TinyData data;
    TempDir out;
    CommandResult w = train_gpt(data.flags(2) + " -n 2 -o '" + out.path + "'");
    INFO(w.output);
    REQUIRE(w.status == 0);
    REQUIRE(list_checkpoints(out.path) == std::vector<int>{2});
    const std::string log_before = read_bytes(out / "main.log");

    struct Change {
        const char* flags;
        const char* says;
    } changes[] = {{"-t 8", "-t 8 differs from the checkpoint's -t 16"}, {"-d 128", "-d 128 differs from the checkpoint's -d 64"}};
    for (const Change& change : changes) {
        // the same flags with one of -t, -d changed (later flags win)
        CommandResult r = train_gpt(data.flags(4) + " " + change.flags + " -y 1 -o '" + out.path + "'");
        INFO("changed " << change.flags << ":\n" << r.output);
        CHECK(r.status == 1);
        std::vector<std::string> errors;
        for (const std::string& line : split_lines(r.output))
            if (line.rfind("train_gpt:", 0) == 0) errors.push_back(line);
        REQUIRE(errors.size() == 1);
        CHECK(errors[0].find(change.says) != std::string::npos);
        CHECK(errors[0].find("ckpt_00000002") != std::string::npos);
        CHECK(r.output.find("resumed from") == std::string::npos);
        CHECK(r.output.find("step ") == std::string::npos);
    }
    // nothing was written
    CHECK(read_bytes(out / "main.log") == log_before);
    CHECK(list_dir(out.path) == std::vector<std::string>{"ckpt_00000002", "main.log", "train_gpt.lock"});

    // the same check in process, on the layout the manifest records: another -b, world or ZeRO stage passes
    RunLayout was = read_manifest_layout(out / "ckpt_00000002/manifest.txt");
    CHECK(was.B == 2);
    CHECK(was.T == 16);
    CHECK(was.total_batch == 64);
    CHECK_NOTHROW(check_resumable(RunLayout{4, 16, 2, 64, 2, 3}, was, "ckpt"));
    CHECK_THROWS_WITH(check_resumable(RunLayout{2, 32, 1, 64}, was, "ckpt"), Catch::Contains("-t 32 differs"));
}

TEST_CASE("saving the same step twice replaces the checkpoint atomically", "[checkpoint]") {
    TempDir out;
    GPT first, second;
    gpt_allocate(first, tiny_config(), 2, 16);
    gpt_allocate(second, tiny_config(), 2, 16);
    init_model(first, 11);
    init_model(second, 12);
    TrainState s1{4, DataPosition{0, 0, 1}, 111}, s2{4, DataPosition{1, 1, 0}, 222};
    const std::string dir = out / "ckpt_00000004";

    // exactly one checkpoint, holding the second save; nothing temporary left
    auto require_second = [&] {
        CHECK(list_dir(out.path) == std::vector<std::string>{"ckpt_00000004"});
        REQUIRE(list_checkpoints(out.path) == std::vector<int>{4});
        GPT loaded;
        gpt_allocate(loaded, checkpoint_config(dir), 2, 16);
        TrainState got;
        load_checkpoint(dir, model_state(loaded), got);
        require_same_model(loaded, second);
        CHECK(got.data == s2.data);
        CHECK(got.rng_state == s2.rng_state);
    };

    SECTION("a second save replaces the first") {
        save_checkpoint(out.path, model_state(first), s1, TINY_LAYOUT, RunInputs{}, 0, solo);
        save_checkpoint(out.path, model_state(second), s2, TINY_LAYOUT, RunInputs{}, 0, solo);
        require_second();
    }
    SECTION("a stale temporary directory from a crash is replaced") {
        save_checkpoint(out.path, model_state(first), s1, TINY_LAYOUT, RunInputs{}, 0, solo);
        copy_tree(dir, dir + ".tmp");
        REQUIRE(unlink((dir + ".tmp/manifest.txt").c_str()) == 0);
        save_checkpoint(out.path, model_state(second), s2, TINY_LAYOUT, RunInputs{}, 0, solo);
        require_second();
    }
    SECTION("an incomplete directory of that step (no manifest) is replaced") {
        save_checkpoint(out.path, model_state(first), s1, TINY_LAYOUT, RunInputs{}, 0, solo);
        REQUIRE(unlink((dir + "/manifest.txt").c_str()) == 0);
        REQUIRE(list_checkpoints(out.path).empty());
        save_checkpoint(out.path, model_state(second), s2, TINY_LAYOUT, RunInputs{}, 0, solo);
        require_second();
    }
}

}  // namespace test_checkpoint

// Tests of what a run does when something goes wrong, each with the failure planted: a NaN or Inf in a model
// file or a checkpoint is refused, naming the file and the tensor; a step with a NaN gradient skips its update
// (on one rank and on two, under ZeRO-1 and 3, every rank alike) and the run goes on; --max-bad-steps such steps
// in a row stop the run with exit code 4; a state that turned non-finite is never saved, and never pruned to.
// A checkpoint that fails verification (flipped bytes, steps that disagree, a manifest cut short or edited) is
// named, kept and skipped by -y 1, which resumes from the newest one that verifies (on every rank alike), or, when
// none does, stops with one line. -y 1 refuses, in one line, a model, seed, shuffle or train data other than the
// checkpoint recorded, and an -x it has reached.
// One run per output directory: a second run on the same -o, started later or at the same moment, stops at once; a
// fresh run refuses an -o holding another run's main.log, or one that is a file; incomplete checkpoint directories
// left by an interrupted run are removed, one line each.
// SIGTERM (from the run itself on its last rank, or from outside) stops the run after its step with a checkpoint
// from which -y 1 continues bit-exactly, on one rank and on two; the same request repeated (SIGTERM, SIGUSR1,
// SIGUSR2) changes nothing, a SIGINT after it ends the run at once (test_stop.cu stops runs of 2 ranks). main.log: a
// write error (a full disk) stops the run, and a resumed run cuts the log back to its checkpoint's step.
// The binary tests run ./train_gpt from the repository root (`make test` builds it first).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>

#include "llmc/checkpoint.h"
#include "mpi_helpers.h"

namespace test_failures {

// a manifest's text with its last line, its own checksum, recomputed for what precedes it
void rerecord_own_checksum(std::string& text) {
    size_t own = text.rfind("\nmanifest fnv1a64=") + 1;
    Fnv1a64 sum;
    sum.update(text.data(), own);
    text.replace(own + strlen("manifest fnv1a64="), 16, strfmt("%016llx", (unsigned long long)sum.value));
}

// the manifest of a checkpoint file's directory records the file's present checksum (and its own, anew): a
// planted change is then as if the run had written it, so that the check after the checksum is what must refuse it
void rerecord_checksum(const std::string& path) {
    size_t slash = path.rfind('/');
    const std::string manifest = path.substr(0, slash) + "/manifest.txt", name = path.substr(slash + 1);
    std::string text = read_file(manifest);
    size_t line = text.find("\nchecksum " + name + " fnv1a64=");
    REQUIRE(line != std::string::npos);
    size_t hex = text.find('=', line) + 1;
    text.replace(hex, 16, strfmt("%016llx", (unsigned long long)file_checksum(path)));
    rerecord_own_checksum(text);
    File m(manifest, "wb");
    m.write(text.data(), text.size());
    m.close();
}

// a checkpoint file with one float changed, at element i after the file's 1024-byte header, its checksum
// re-recorded
void plant_float(const std::string& path, size_t i, float value) {
    std::string bytes = read_file(path);
    REQUIRE(1024 + 4 * (i + 1) <= bytes.size());
    memcpy(&bytes[1024 + 4 * i], &value, 4);
    File f(path, "wb");
    f.write(bytes.data(), bytes.size());
    f.close();
    rerecord_checksum(path);
}

// a checkpoint file with each byte from `at` on xor-ed with one of `mask`, its checksum left as it was: damage
// on disk
void damage(const std::string& path, size_t at, const std::string& mask) {
    std::string content = read_file(path);
    REQUIRE(at + mask.size() <= content.size());
    for (size_t i = 0; i < mask.size(); i++) content[at + i] ^= mask[i];
    File f(path, "wb");
    f.write(content.data(), content.size());
    f.close();
}

// the losses of main.log from step `first` on
std::map<std::string, double> losses_from(const std::string& out_dir, int first) {
    std::map<std::string, double> v;
    for (const auto& [key, loss] : losses(out_dir))
        if (atoi(key.c_str() + key.find(' ')) >= first) v[key] = loss;
    return v;
}

// the lines of an output that start with "train_gpt:" (the errors)
std::vector<std::string> error_lines(const std::string& output) {
    std::vector<std::string> errors;
    for (const std::string& line : lines_of(output))
        if (line.rfind("train_gpt:", 0) == 0) errors.push_back(line);
    return errors;
}

int count_lines_with(const std::string& text, const std::string& what) {
    int n = 0;
    for (const std::string& line : lines_of(text)) n += line.find(what) != std::string::npos;
    return n;
}

const char* MODEL = "d3c33h3t32v301";

// starts ./train_gpt with args in the background, its output going to `log`; the pid is train_gpt's own
pid_t start(const std::string& args, const std::string& log) {
    return start_command("env " + std::string(RUN_ENV) + " ./train_gpt " + args, log);
}

std::string hostname() {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    return host;
}

TEST_CASE("a model file with a NaN or an Inf is refused, naming the file and the tensor", "[failures]") {
    Data data;
    GPTConfig c = parse_model_descriptor(MODEL);
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 5);
    size_t sizes[NUM_PARAM_TENSORS];
    param_tensor_sizes(c, sizes);
    // element 5 of layer 1's ln1w, and the first element of wte
    size_t ln1w_layer1 = sizes[WTE] + sizes[WPE] + c.channels + 5;
    struct Case {
        size_t index;
        float value;
        const char* says;
    } cases[] = {{ln1w_layer1, NAN, "nan in ln1w of layer 1, element 5"}, {0, -INFINITY, "-inf in wte, element 0"}};
    for (const Case& k : cases) {
        INFO(k.says);
        std::vector<float> bad = params;
        bad[k.index] = k.value;
        const std::string path = data.dir / "bad_model.bin";
        gpt_save_params(c, bad.data(), path);
        CommandResult r = single(data.flags(2, 32, 2, "'" + path + "'"));
        INFO(r.output);
        CHECK(r.status == 1);
        REQUIRE(lines_of(r.output).size() == 1);
        CHECK(r.output.find("train_gpt: " + path + ": " + k.says) != std::string::npos);
    }
    // the same file, finite, trains
    gpt_save_params(c, params.data(), data.dir / "good_model.bin");
    CommandResult ok = single(data.flags(2, 32, 2, "'" + (data.dir / "good_model.bin") + "'"));
    INFO(ok.output);
    CHECK(ok.status == 0);
}

TEST_CASE("a checkpoint with a NaN in its model or optimizer state is refused, naming the file and the tensor",
          "[failures]") {
    Data data;
    TempDir out;
    const std::string flags = data.flags(2, 32, 4) + " -n 2";
    const std::string good = out / "good";
    train(1, flags, good);
    REQUIRE(list_checkpoints(good) == std::vector<int>{2, 4});
    size_t n = num_parameters(parse_model_descriptor(MODEL));

    struct Case {
        const char* file;
        size_t index;
        const char* says;
    } cases[] = {{"model.bin", n - 1, "model.bin: nan in lnfb, element 32"},
                 {"optimizer_rank0.bin", 7, "optimizer_rank0.bin: nan in the first moment (m) of wte, element 7"},
                 {"optimizer_rank0.bin", n + n - 33 - 1,
                  "optimizer_rank0.bin: nan in the second moment (v) of lnfw, element 32"}};
    for (const Case& k : cases) {
        INFO(k.says);
        const std::string dir = out / "bad";
        REQUIRE(run_command("rm -rf '" + dir + "' && cp -r '" + good + "' '" + dir + "'").status == 0);
        plant_float(dir + "/ckpt_00000004/" + k.file, k.index, NAN);
        CommandResult r = single(data.flags(2, 32, 6) + " -n 2 -y 1 -o '" + dir + "'");
        INFO(r.output);
        CHECK(r.status == 1);
        std::vector<std::string> errors = error_lines(r.output);
        REQUIRE(errors.size() == 1);
        CHECK(errors[0].find(dir + "/ckpt_00000004/" + k.says) != std::string::npos);
        CHECK(r.output.find("step ") == std::string::npos);
        CHECK(list_checkpoints(dir) == std::vector<int>{2, 4});
    }

    // a sharded optimizer state (ZeRO-1 on two ranks) is named by its tensor too: rank 1's shard begins in the
    // middle of the first bucket (the final layernorm, then layers 2 and 1: 27060 elements), at fcprojb of layer 2
    const std::string sharded = out / "sharded";
    train(2, data.flags(2, 64, 2) + " -z 1 -n 2", sharded);
    plant_float(sharded + "/ckpt_00000002/optimizer_rank1.bin", 3, INFINITY);
    CommandResult r = mpirun(2, "./train_gpt", data.flags(2, 64, 4) + " -z 1 -n 2 -y 1 -o '" + sharded + "'");
    INFO(r.output);
    CHECK(r.status != 0);
    std::vector<std::string> errors = error_lines(r.output);
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].find(sharded + "/ckpt_00000002/optimizer_rank1.bin: inf in the first moment (m) of fcprojb of "
                         "layer 2, element 3") != std::string::npos);
    CHECK(list_checkpoints(sharded) == std::vector<int>{2});
}

TEST_CASE("a checkpoint that fails verification is named, kept and skipped: -y 1 resumes from the newest good one",
          "[failures]") {
    Data data;
    TempDir out;
    const std::string good = out / "good", direct = out / "direct";
    train(1, data.flags(2, 32, 4) + " -n 2", good);
    REQUIRE(list_checkpoints(good) == std::vector<int>{2, 4});
    const std::string flags = data.flags(2, 32, 6) + " -n 2";
    // what resuming from ckpt_2 gives: a directory that holds only it
    make_dirs(direct);
    REQUIRE(run_command("cp -r '" + good + "/ckpt_00000002' '" + direct + "/'").status == 0);
    train(1, flags + " -y 1", direct);
    const std::map<std::string, double> expected = losses_from(direct, 3);
    REQUIRE(expected.size() >= 4);

    auto copy_of = [&](const std::string& name) {
        const std::string dir = out / name;
        REQUIRE(run_command("cp -r '" + good + "' '" + dir + "'").status == 0);
        return dir;
    };

    // 40 bytes flipped in the newest checkpoint's model: named on the first line, moved aside, ckpt_2 resumed
    const std::string flipped = copy_of("flipped");
    const std::string model = flipped + "/ckpt_00000004/model.bin";
    damage(model, 4000, std::string(40, '\x5a'));
    CommandResult r = single(flags + " -y 1 -o '" + flipped + "'");
    INFO(r.output);
    CHECK(r.status == 0);
    std::vector<std::string> lines = lines_of(r.output);
    REQUIRE(!lines.empty());
    CHECK(lines[0].rfind("checkpoint " + flipped + "/ckpt_00000004 fails verification, skipped and kept as " + flipped +
                             "/ckpt_00000004.unverified: " + model + ": checksum fnv1a64=",
                         0) == 0);
    CHECK(lines[0].find("the manifest records") != std::string::npos);
    CHECK(r.output.find("resumed from " + flipped + "/ckpt_00000002 at step 2") != std::string::npos);
    CHECK(losses_from(flipped, 3) == expected);
    CHECK(list_checkpoints(flipped) == std::vector<int>{2, 4, 6});
    CHECK(file_exists(flipped + "/ckpt_00000004.unverified/model.bin"));

    // the state's step edited (its checksum re-recorded, so that only the steps disagree)
    const std::string edited = copy_of("edited");
    const std::string state = edited + "/ckpt_00000004/state_rank0.bin";
    int one = 1;
    std::string bytes = read_file(state);
    memcpy(&bytes[8], &one, 4);
    {
        File f(state, "wb");
        f.write(bytes.data(), bytes.size());
        f.close();
    }
    rerecord_checksum(state);
    r = single(flags + " -y 1 -o '" + edited + "'");
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(lines_of(r.output).at(0).find(state + ": records step 1, the manifest step 4") != std::string::npos);
    CHECK(losses_from(edited, 3) == expected);

    // the newest manifest cut short, or edited (the seed it records changed): its own checksum no longer holds; or
    // one that lacks the run's inputs
    struct ManifestDamage {
        const char* name;
        std::function<void(std::string&)> plant;
        const char* says;
    } manifest_cases[] = {
        {"cut", [](std::string& text) { text.resize(text.size() / 2); },
         "manifest.txt: malformed manifest (its last line is not its own checksum: cut short, or written by an older "
         "train_gpt?)"},
        {"seed", [](std::string& text) { text.replace(text.find("\nseed 7\n"), 8, "\nseed 8\n"); },
         "manifest.txt: its checksum fnv1a64="},
        // as an older train_gpt wrote it: without the run's inputs (its own checksum recorded, to reach that check)
        {"old", [](std::string& text) {
             text.erase(text.find("\nmodel_source "), text.find("\nchecksum ") - text.find("\nmodel_source "));
             rerecord_own_checksum(text);
         },
         "manifest.txt: malformed manifest (no model_source line)"},
        // re-signed without the checksum of a file its layout implies, which a resume would read unverified
        {"unlisted", [](std::string& text) {
             size_t line = text.find("\nchecksum optimizer_rank0.bin ");
             text.erase(line, text.find('\n', line + 1) - line);
             rerecord_own_checksum(text);
         },
         "manifest.txt: no checksum of optimizer_rank0.bin, which its layout implies"},
        // re-signed claiming 4 ranks under ZeRO-1, whose optimizer files 1 to 3 do not exist
        {"world", [](std::string& text) {
             text.replace(text.find("layout world=1 "), 15, "layout world=4 ");
             text.replace(text.find(" zero=0 "), 8, " zero=1 ");
             rerecord_own_checksum(text);
         },
         "manifest.txt: no checksum of optimizer_rank1.bin, which its layout implies"},
        // re-signed with a checksum of a file its layout does not imply
        {"extra", [](std::string& text) {
             size_t own = text.rfind("manifest fnv1a64=");
             text.insert(own, "checksum optimizer_rank1.bin fnv1a64=0123456789abcdef\n");
             rerecord_own_checksum(text);
         },
         "manifest.txt: a checksum of optimizer_rank1.bin where its layout implies no more files"}};
    for (const ManifestDamage& k : manifest_cases) {
        INFO("manifest damaged: " << k.name);
        const std::string dir = copy_of(std::string("manifest_") + k.name), manifest = dir + "/ckpt_00000004/manifest.txt";
        std::string text = read_file(manifest);
        k.plant(text);
        {
            File f(manifest, "wb");
            f.write(text.data(), text.size());
            f.close();
        }
        r = single(flags + " -y 1 -o '" + dir + "'");
        INFO(r.output);
        CHECK(r.status == 0);
        CHECK(lines_of(r.output).at(0).find("fails verification, skipped and kept as " + dir +
                                            "/ckpt_00000004.unverified: " + dir + "/ckpt_00000004/" + k.says) !=
              std::string::npos);
        CHECK(r.output.find("resumed from " + dir + "/ckpt_00000002 at step 2") != std::string::npos);
        CHECK(losses_from(dir, 3) == expected);
    }

    // every checkpoint damaged: each named, one error line, nothing run, nothing moved or deleted
    const std::string all = copy_of("all");
    damage(all + "/ckpt_00000004/optimizer_rank0.bin", 2000, "\x01");
    damage(all + "/ckpt_00000002/state_rank0.bin", 20, "\x01");
    r = single(flags + " -y 1 -o '" + all + "'");
    INFO(r.output);
    CHECK(r.status == 1);
    std::vector<std::string> errors = error_lines(r.output);
    REQUIRE(errors.size() == 1);
    CHECK(errors[0] == "train_gpt: -y 1: none of the 2 checkpoints in " + all + " verifies (each is named above and kept)");
    CHECK(count_lines_with(r.output, "fails verification, skipped and kept: ") == 2);
    CHECK(r.output.find(all + "/ckpt_00000004/optimizer_rank0.bin: checksum") != std::string::npos);
    CHECK(r.output.find(all + "/ckpt_00000002/state_rank0.bin: checksum") != std::string::npos);
    CHECK(r.output.find("step ") == std::string::npos);
    CHECK(list_checkpoints(all) == std::vector<int>{2, 4});
}

TEST_CASE("on two ranks, a damaged newest checkpoint is skipped by both: -y 1 resumes from the one before",
          "[failures]") {
    Data data;
    TempDir out;
    const std::string good = out / "good", direct = out / "direct", damaged = out / "damaged";
    const std::string flags = data.flags(2, 64, 6) + " -z 1 -n 2";
    train(2, data.flags(2, 64, 4) + " -z 1 -n 2", good);
    REQUIRE(list_checkpoints(good) == std::vector<int>{2, 4});
    // the reference: resumed from a directory that holds only ckpt_2
    make_dirs(direct);
    REQUIRE(run_command("cp -r '" + good + "/ckpt_00000002' '" + direct + "/'").status == 0);
    train(2, flags + " -y 1", direct);
    // the newest manifest cut short
    REQUIRE(run_command("cp -r '" + good + "' '" + damaged + "'").status == 0);
    const std::string manifest = damaged + "/ckpt_00000004/manifest.txt";
    REQUIRE(truncate(manifest.c_str(), 100) == 0);
    std::string output = train(2, flags + " -y 1", damaged);
    CHECK(count_lines_with(output, "fails verification") == 1);
    CHECK(output.find("resumed from " + damaged + "/ckpt_00000002 at step 2") != std::string::npos);
    // had either rank loaded ckpt_4, the state at step 6 would differ: every rank's optimizer shard is compared
    for (const char* file : {"model.bin", "state_rank0.bin", "optimizer_rank0.bin", "optimizer_rank1.bin"}) {
        INFO(file);
        CHECK(read_file(damaged + "/ckpt_00000006/" + file) == read_file(direct + "/ckpt_00000006/" + file));
    }
    CHECK(read_file(damaged + "/main.log").find("s:3 trl:") != std::string::npos);
}

TEST_CASE("-y 1 refuses a model, seed, train data or shuffle other than the checkpoint's, and an -x it has reached",
          "[failures]") {
    Data data;
    TempDir out;
    // the run: two shards under a pattern, a descriptor for the model, --seed 7, shuffled
    const std::string shards = out / "data", pattern = shards + "/train_*.bin";
    make_dirs(shards);
    Rng rng(5);
    write_shard(shards + "/train_0.bin", Data::learnable_tokens(3000, rng));
    write_shard(shards + "/train_1.bin", Data::learnable_tokens(3000, rng));
    const std::string dir = out / "run", ckpt = dir + "/ckpt_00000002";
    auto flags = [&](int steps) { return data.flags(2, 32, steps) + " -i '" + pattern + "' -n 2"; };
    train(1, flags(2), dir);
    const std::string log = read_file(dir + "/main.log");
    // a model file of the same shape
    GPTConfig c = parse_model_descriptor(MODEL);
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 5);
    const std::string model = out / "model.bin";
    gpt_save_params(c, params.data(), model);

    // the one line a resume with `change` gets, which starts with `says`: nothing else printed, nothing written
    auto refused = [&](const std::string& change, const std::string& says, const std::string& in = "") {
        INFO(change);
        const std::string d = in.empty() ? dir : in;
        CommandResult r = single(flags(4) + " " + change + " -y 1 -o '" + d + "'");
        INFO(r.output);
        CHECK(r.status == 1);
        CHECK(lines_of(r.output).size() == 1);
        CHECK(r.output.rfind("train_gpt: " + says, 0) == 0);
        CHECK(list_checkpoints(d) == std::vector<int>{2});
    };
    refused("--seed 8", "-y 1: --seed 8 differs from the checkpoint's 7 (" + ckpt + ")");
    refused("--shuffle 0", "-y 1: --shuffle 0 differs from the checkpoint's 1 (" + ckpt + ")");
    refused("-e '" + model + "'", "-y 1: -e " + model + " differs from the checkpoint's " + MODEL + " (" + ckpt + ")");
    refused("-e d3c33h3t32v302", "-y 1: -e d3c33h3t32v302 differs from the checkpoint's " + std::string(MODEL) + " (" + ckpt + ")");
    const std::string one = shards + "/train_0.bin";
    refused("-i '" + one + "'", "-y 1: -i " + one + " differs from the checkpoint's " + pattern + " (" + ckpt + ")");
    refused("-x 2", "-x 2: " + ckpt + " has done 2 steps already; -x counts the steps from the start of the run, so "
                    "resume with a larger -x");
    refused("-x 1", "-x 1: " + ckpt + " has done 2 steps already; -x counts the steps from the start of the run, so "
                    "resume with a larger -x");

    // the shards -i matches: one more, one renamed, one longer, one whose header changed (at the same size)
    const std::string second = shards + "/train_1.bin", kept = out / "train_1.bin";
    REQUIRE(run_command("cp '" + second + "' '" + kept + "'").status == 0);
    auto restore = [&] { REQUIRE(run_command("rm -f " + pattern + " && cp '" + kept + "' '" + second + "' && cp '" +
                                             (out / "train_0.bin") + "' '" + one + "'").status == 0); };
    REQUIRE(run_command("cp '" + one + "' '" + (out / "train_0.bin") + "'").status == 0);
    write_shard(shards + "/train_2.bin", Data::learnable_tokens(3000, rng));
    refused("", "-y 1: -i " + pattern + " matches 3 files, the checkpoint's 2 (" + ckpt + ")");
    restore();
    REQUIRE(rename(second.c_str(), (shards + "/train_1b.bin").c_str()) == 0);
    refused("", "-y 1: -i " + pattern + ": shard 1 is " + shards + "/train_1b.bin, the checkpoint's " + second + " (" +
                    ckpt + ")");
    restore();
    const long bytes = (long)read_file(second).size();
    write_shard(second, Data::learnable_tokens(3001, rng));
    refused("", strfmt("-y 1: -i shard %s: %ld bytes differs from the checkpoint's %ld (%s)", second.c_str(), bytes + 2,
                       bytes, ckpt.c_str()));
    restore();
    damage(second, 12, "\x01");  // header word 3, which the loader does not read
    refused("", "-y 1: -i shard " + second + ": its header's checksum fnv1a64=");
    restore();

    // a model file that changed since the run began from it
    const std::string from_file = out / "from_file";
    train(1, data.flags(2, 32, 2, "'" + model + "'") + " -i '" + pattern + "' -n 2", from_file);
    gpt_init_random(c, params.data(), 6);
    gpt_save_params(c, params.data(), model);
    refused("-e '" + model + "'", "-y 1: -e " + model + ": its checksum fnv1a64=", from_file);

    // with what the checkpoint recorded, it resumes; the log was never touched before
    CHECK(read_file(dir + "/main.log") == log);
    std::string again = train(1, flags(4) + " -y 1", dir);
    CHECK(again.find("resumed from " + ckpt + " at step 2") != std::string::npos);
}

TEST_CASE("a fresh run refuses an -o that holds another run's main.log, or that is not a directory", "[failures]") {
    Data data;
    TempDir out;
    const std::string dir = out / "run";
    train(1, data.flags(2, 32, 2), dir);
    const std::string log = read_file(dir + "/main.log");
    CommandResult r = single(data.flags(2, 32, 3) + " -o '" + dir + "'");
    INFO(r.output);
    CHECK(r.status == 1);
    CHECK(r.output == "train_gpt: -o " + dir + ": already holds the main.log of another run; resume that run with -y 1, "
                      "choose another directory, or remove them (--overwrite 1)\n");
    CHECK(read_file(dir + "/main.log") == log);

    // told to overwrite, it removes the other run's checkpoints and log first, saying so, and its log is its own
    train(1, data.flags(2, 32, 2) + " -n 2 -y 1 -x 4", dir);
    REQUIRE(list_checkpoints(dir) == std::vector<int>{2, 4});
    std::string output = train(1, data.flags(2, 32, 3) + " --overwrite 1", dir);
    std::vector<std::string> lines = lines_of(output);
    REQUIRE(lines.size() >= 3);
    CHECK(lines[0] == "removed " + dir + "/ckpt_00000002: --overwrite 1");
    CHECK(lines[1] == "removed " + dir + "/ckpt_00000004: --overwrite 1");
    CHECK(lines[2] == "removed " + dir + "/main.log: --overwrite 1");
    CHECK(list_checkpoints(dir).empty());
    std::map<std::string, double> fresh = losses(dir);
    CHECK(fresh.count("trl 2") == 1);
    CHECK(fresh.count("trl 3") == 0);
    CHECK(single("--overwrite 1 -y 1 -o '" + dir + "'").output ==
          "train_gpt: --overwrite 1: -y 1 continues the run in -o, which overwriting would remove\n");

    const std::string file = out / "a_file";
    File(file, "wb").close();
    r = single(data.flags(2, 32, 3) + " -o '" + file + "'");
    INFO(r.output);
    CHECK(r.status == 1);
    CHECK(r.output == "train_gpt: -o " + file + ": not a directory\n");
}

TEST_CASE("a run removes the incomplete checkpoint directories an interrupted run left, one line each", "[failures]") {
    Data data;
    TempDir out;
    const std::string dir = out / "run";
    train(1, data.flags(2, 32, 4) + " -n 2", dir);
    // a checkpoint being written (ckpt_6.tmp), one being deleted (ckpt_8, its manifest gone first), and one kept
    // aside by an earlier resume: only the first two go
    for (const char* name : {"ckpt_00000006.tmp", "ckpt_00000008", "ckpt_00000004.unverified"})
        REQUIRE(run_command("cp -r '" + dir + "/ckpt_00000004' '" + dir + "/" + name + "'").status == 0);
    REQUIRE(unlink((dir + "/ckpt_00000008/manifest.txt").c_str()) == 0);
    REQUIRE(unlink((dir + "/ckpt_00000006.tmp/manifest.txt").c_str()) == 0);
    std::string output = train(1, data.flags(2, 32, 6) + " -n 2 -y 1", dir);
    std::vector<std::string> lines = lines_of(output);
    REQUIRE(lines.size() >= 3);
    const std::string why = ": an incomplete checkpoint, left by a run interrupted while writing or deleting it";
    CHECK(lines[0] == "removed " + dir + "/ckpt_00000006.tmp" + why);
    CHECK(lines[1] == "removed " + dir + "/ckpt_00000008" + why);
    CHECK(output.find("resumed from " + dir + "/ckpt_00000004 at step 4") != std::string::npos);
    CHECK(!file_exists(dir + "/ckpt_00000008/model.bin"));
    CHECK(file_exists(dir + "/ckpt_00000004.unverified/manifest.txt"));
    CHECK(list_checkpoints(dir) == std::vector<int>{2, 4, 6});
}

TEST_CASE("a step with a NaN gradient skips its update, says so, and the run goes on", "[failures]") {
    Data data;
    TempDir out;
    // one rank, and two ranks under ZeRO-1 and ZeRO-3 (where each rank updates only its own shard): the NaN is in
    // rank 0's gradients only, and every rank must skip
    struct Layout {
        int ranks;
        const char* flags;
        std::vector<std::string> optimizer_files;
    } layouts[] = {{1, "", {"optimizer_rank0.bin"}},
                   {2, " -z 1", {"optimizer_rank0.bin", "optimizer_rank1.bin"}},
                   {2, " -z 3", {"optimizer_rank0.bin", "optimizer_rank1.bin"}}};
    for (const Layout& l : layouts) {
        INFO(l.ranks << " ranks" << l.flags);
        const std::string dir = out / strfmt("r%d%s", l.ranks, l.flags + (l.flags[0] ? 1 : 0));
        std::string output = train(l.ranks, data.flags(2, 2 * 2 * 16, 5) + l.flags + " -n 1 --debug-nan-step 2", dir);
        // the step line and main.log say so
        CHECK(count_lines_with(output, "update skipped") == 1);
        CHECK(count_lines_with(output, "step     3/5") == 1);
        CHECK(output.find("step     3/5 | loss") != std::string::npos);
        std::string log = read_file(dir + "/main.log");
        CHECK(count_lines_with(log, "skipped:1") == 1);
        CHECK(count_lines_with(log, "s:2 trl:") == 1);
        CHECK(log.find("norm:nan skipped:1") != std::string::npos);
        // the step after the skipped one is finite again
        std::map<std::string, double> l2 = losses(dir);
        REQUIRE(l2.count("trl 3") == 1);
        CHECK(std::isfinite(l2["trl 3"]));
        CHECK(std::isfinite(l2["trl 4"]));
        // the parameters and the optimizer state after the skipped step (ckpt 3) are those before it (ckpt 2)
        for (const std::string& file : l.optimizer_files) {
            INFO(file);
            CHECK(read_file(dir + "/ckpt_00000002/" + file) == read_file(dir + "/ckpt_00000003/" + file));
        }
        CHECK(read_file(dir + "/ckpt_00000002/model.bin") == read_file(dir + "/ckpt_00000003/model.bin"));
        // ... while a step that is not skipped changes them
        CHECK(read_file(dir + "/ckpt_00000003/model.bin") != read_file(dir + "/ckpt_00000004/model.bin"));
    }
}

TEST_CASE("a state that overflows is never saved; --max-bad-steps bad steps in a row stop the run with exit 4",
          "[failures]") {
    Data data;
    TempDir out;
    const std::string start = out / "start";
    train(1, data.flags(2, 32, 2) + " -n 2", start);
    // a first moment of 3e38 for lnfw's first element, finite and so accepted on loading, overflows in the first
    // update after resuming (its bias correction alone exceeds the float range): lnfw becomes infinite and
    // every later forward gives NaN
    GPTConfig c = parse_model_descriptor(MODEL);
    plant_float(start + "/ckpt_00000002/optimizer_rank0.bin", num_parameters(c) - 2 * c.channels, 3e38f);
    auto resume_in = [&](const std::string& name) {
        std::string dir = out / name;
        REQUIRE(run_command("cp -r '" + start + "' '" + dir + "'").status == 0);
        return dir;
    };

    SECTION("the checkpoint after the overflow is not written, -nk prunes nothing, and the run stops") {
        std::string dir = resume_in("ckpt");
        CommandResult r = single(data.flags(2, 32, 8) + " -n 1 -nk 1 -y 1 -o '" + dir + "'");
        INFO(r.output);
        CHECK(r.status == 4);
        std::vector<std::string> errors = error_lines(r.output);
        REQUIRE(errors.size() == 1);
        CHECK(errors[0] == "train_gpt: step 3: the parameters or the optimizer state hold a NaN or Inf; no checkpoint "
                           "written (the newest checkpoint is " + dir + "/ckpt_00000002), stopping");
        CHECK(list_checkpoints(dir) == std::vector<int>{2});
        CHECK(!file_exists(dir + "/ckpt_00000003.tmp"));
    }
    for (int max_bad : {3, 1}) {
        SECTION(strfmt("without checkpoints, --max-bad-steps %d ends the run after %d bad steps", max_bad, max_bad)) {
            std::string dir = resume_in(strfmt("max%d", max_bad));
            CommandResult r = single(data.flags(2, 32, 20) + strfmt(" -y 1 --max-bad-steps %d -o '%s'", max_bad, dir.c_str()));
            INFO(r.output);
            CHECK(r.status == 4);
            // step 3 overflowed (its own loss and norm were finite), steps 4.. are skipped
            CHECK(count_lines_with(r.output, "update skipped") == max_bad);
            CHECK(count_lines_with(r.output, strfmt("update skipped: not finite (%d in a row)", max_bad)) == 1);
            std::vector<std::string> errors = error_lines(r.output);
            REQUIRE(errors.size() == 1);
            CHECK(errors[0] == strfmt("train_gpt: stopped after step %d: %d steps in a row skipped their update, the "
                                      "last for a non-finite loss or gradient norm (--max-bad-steps %d)", 3 + max_bad,
                                      max_bad, max_bad));
            CHECK(count_lines_with(read_file(dir + "/main.log"), "skipped:1") == max_bad);
            CHECK(list_checkpoints(dir) == std::vector<int>{2});
        }
    }
}

TEST_CASE("save_checkpoint writes nothing and prunes nothing when the state is not finite", "[failures]") {
    TempDir out;
    Comm solo;
    GPT m;
    gpt_allocate(m, parse_model_descriptor(MODEL), 2, 16);
    gpt_init_random(m.config, m.params, 3);
    const RunLayout layout{2, 16, 1, 32};
    REQUIRE(save_checkpoint(out.path, model_state(m), TrainState{1}, layout, RunInputs{}, 1, solo));
    const std::string before = read_file(out / "ckpt_00000001/model.bin");
    for (float* where : {&m.params[100], &m.adam_m[7], &m.adam_v[9]}) {
        float kept = *where;
        *where = NAN;
        CHECK(!save_checkpoint(out.path, model_state(m), TrainState{2}, layout, RunInputs{}, 1, solo));
        CHECK(list_checkpoints(out.path) == std::vector<int>{1});
        CHECK(!file_exists(out / "ckpt_00000002.tmp"));
        *where = kept;
    }
    CHECK(read_file(out / "ckpt_00000001/model.bin") == before);
    CHECK(save_checkpoint(out.path, model_state(m), TrainState{2}, layout, RunInputs{}, 1, solo));
    CHECK(list_checkpoints(out.path) == std::vector<int>{2});
}

TEST_CASE("a second run on the same -o stops at once, naming the run that holds it", "[failures]") {
    Data data;
    TempDir out;
    const std::string dir = out / "run", first_log = out / "first.log";
    // a run that goes on until it is killed
    pid_t first = start(data.flags(2, 32, 1000000) + " -o '" + dir + "'", first_log);
    REQUIRE(wait_for(first_log, "step     2/"));

    CommandResult second = single(data.flags(2, 32, 3) + " -n 1 -o '" + dir + "'");
    INFO(second.output);
    CHECK(second.status == 1);
    CHECK(second.output == strfmt("train_gpt: -o %s: another run is using it (host %s pid %d); wait for it to end or "
                                  "choose another directory\n", dir.c_str(), hostname().c_str(), (int)first));
    // it wrote nothing: no checkpoint, and the first run's log was not started anew
    CHECK(list_checkpoints(dir).empty());
    CHECK(read_file(dir + "/main.log").rfind("s:0 tel:", 0) == 0);

    // the lock goes with the process that held it, however it ends
    kill(first, SIGKILL);
    CHECK(finish(first) == 128 + SIGKILL);
    CommandResult third = single(data.flags(2, 32, 2) + " -y 1 -o '" + dir + "'");
    INFO(third.output);
    CHECK(third.status == 0);
    CHECK(read_file(dir + "/train_gpt.lock").rfind(strfmt("host %s pid ", hostname().c_str()), 0) == 0);
}

TEST_CASE("of two runs started together on one -o, exactly one runs", "[failures]") {
    Data data;
    TempDir out;
    const std::string dir = out / "run";
    const std::string args = data.flags(2, 32, 1000000) + " -n 5 -o '" + dir + "'";
    pid_t a = start(args, out / "a.log"), b = start(args, out / "b.log");
    // the one that lost exits within seconds; the other trains on
    int status = -1;
    pid_t lost = -1;
    for (int waited = 0; waited < 12000 && lost < 0; waited++) {
        int st;
        for (pid_t p : {a, b})
            if (waitpid(p, &st, WNOHANG) == p) lost = p, status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(10000);
    }
    REQUIRE(lost > 0);
    pid_t won = lost == a ? b : a;
    const std::string lost_log = read_file(out / (lost == a ? "a.log" : "b.log"));
    INFO(lost_log);
    CHECK(status == 1);
    CHECK(lost_log == strfmt("train_gpt: -o %s: another run is using it (host %s pid %d); wait for it to end or "
                             "choose another directory\n", dir.c_str(), hostname().c_str(), (int)won));
    CHECK(wait_for(out / (won == a ? "a.log" : "b.log"), "step    10/"));
    CHECK(waitpid(won, &status, WNOHANG) == 0);  // still running
    kill(won, SIGKILL);
    finish(won);
}

TEST_CASE("SIGTERM during a step: the step finishes, a checkpoint is written, exit 5; -y 1 continues bit-exactly",
          "[failures]") {
    Data data;
    TempDir out;
    // one rank, and two under ZeRO-1 where only the last rank (1) is signalled: rank 0, which writes the
    // checkpoint, learns of it through the per-step reduction
    for (int ranks : {1, 2}) {
        INFO(ranks << " ranks");
        const std::string flags = data.flags(2, 64, 8) + " -n 8" + (ranks == 2 ? " -z 1" : "");
        const std::string whole = out / strfmt("whole%d", ranks), stopped = out / strfmt("stopped%d", ranks);
        train(ranks, flags, whole);

        CommandResult r = mpirun(ranks, "./train_gpt", flags + " --debug-sigterm-step 3 -o '" + stopped + "'");
        INFO(r.output);
        CHECK(r.status == 5);
        CHECK(r.output.find(strfmt("train_gpt: stopped after step 4 on %s; checkpoint %s/ckpt_00000004 written; resume "
                                   "with -y 1", ranks == 1 ? "SIGTERM" : "a signal to another rank", stopped.c_str())) !=
              std::string::npos);
        CHECK(r.output.find("step     4/8") != std::string::npos);
        CHECK(r.output.find("step     5/8") == std::string::npos);
        CHECK(list_checkpoints(stopped) == std::vector<int>{4});

        std::string again = train(ranks, flags + " -y 1", stopped);
        CHECK(again.find("resumed from " + stopped + "/ckpt_00000004 at step 4") != std::string::npos);
        CHECK(read_file(stopped + "/main.log") == read_file(whole + "/main.log"));
        std::vector<std::string> files{"model.bin", "state_rank0.bin", "optimizer_rank0.bin"};
        if (ranks == 2) files.push_back("optimizer_rank1.bin");
        for (const std::string& f : files) {
            INFO(f);
            CHECK(read_file(stopped + "/ckpt_00000008/" + f) == read_file(whole + "/ckpt_00000008/" + f));
        }
    }
}

TEST_CASE("a SIGTERM from outside stops the run after its step with a checkpoint; repeats are ignored, a SIGINT "
          "after it ends the run at once",
          "[failures]") {
    Data data;
    TempDir out;
    const std::string args = data.flags(2, 32, 1000000);

    SECTION("one SIGTERM") {
        const std::string dir = out / "one", log = out / "one.log";
        pid_t pid = start(args + " -o '" + dir + "'", log);
        REQUIRE(wait_for(log, "step     2/"));
        kill(pid, SIGTERM);
        CHECK(finish(pid) == 5);
        std::string output = read_file(log);
        INFO(output);
        // the step it stopped after is the last one printed, and its checkpoint is there
        int stopped_after = last_step(output);
        REQUIRE(stopped_after >= 2);
        CHECK(output.find(strfmt("train_gpt: stopped after step %d on SIGTERM; checkpoint %s/%s written; resume with -y 1",
                                 stopped_after, dir.c_str(), checkpoint_name(stopped_after).c_str())) != std::string::npos);
        CHECK(list_checkpoints(dir) == std::vector<int>{stopped_after});
    }
    // steps of about a second, so that every signal below lands within one
    const std::string slow = data.flags(2, 1024, 1000000, "d4c256h4t64v301");
    SECTION("the request repeated: SIGTERM, SIGUSR1, SIGTERM again, SIGUSR2") {
        const std::string dir = out / "repeated", log = out / "repeated.log";
        pid_t pid = start(slow + " -o '" + dir + "'", log);
        REQUIRE(wait_for(log, "step     1/"));
        usleep(100000);  // step 2 has begun
        for (int sig : {SIGTERM, SIGUSR1, SIGTERM, SIGUSR2}) kill(pid, sig), usleep(50000);
        CHECK(finish(pid) == 5);
        std::string output = read_file(log);
        INFO(output);
        int stopped_after = last_step(output);
        CHECK(output.find(strfmt("train_gpt: stopped after step %d on SIGTERM; checkpoint", stopped_after)) !=
              std::string::npos);
        CHECK(list_checkpoints(dir) == std::vector<int>{stopped_after});
    }
    SECTION("SIGTERM, then SIGINT") {
        const std::string dir = out / "two", log = out / "two.log";
        pid_t pid = start(slow + " -o '" + dir + "'", log);
        REQUIRE(wait_for(log, "step     1/"));
        usleep(100000);
        for (int sig : {SIGTERM, SIGINT}) kill(pid, sig), usleep(50000);
        int status = finish(pid);
        INFO(read_file(log));
        CHECK(status == 128 + SIGINT);
        CHECK(list_checkpoints(dir).empty());
    }
}

TEST_CASE("a write error to main.log stops the run with one line", "[failures]") {
    Data data;
    TempDir out;
    // a full disk: every write to /dev/full fails with ENOSPC
    REQUIRE(symlink("/dev/full", (out / "main.log").c_str()) == 0);
    // (-y 1 finds no checkpoint and starts the log anew: a fresh run would refuse the directory for its main.log)
    CommandResult r = single(data.flags(2, 32, 3) + " -y 1 -o '" + out.path + "'");
    INFO(r.output);
    CHECK(r.status == 1);
    std::vector<std::string> errors = error_lines(r.output);
    REQUIRE(errors.size() == 1);
    CHECK(errors[0] == "train_gpt: " + out.path + "/main.log: cannot write (No space left on device)");
    CHECK(r.output.find("step     1/3") == std::string::npos);
}

TEST_CASE("a resumed run cuts main.log back to its checkpoint's step: no step is logged twice", "[failures]") {
    Data data;
    TempDir out;
    const std::string flags = data.flags(2, 32, 12) + " -n 4", whole = out / "whole", resumed = out / "resumed";
    train(1, flags, whole);
    // the directory a run leaves when it dies after step 11, past its checkpoint at 8, and one that lost its
    // last two checkpoints: both hold log lines of steps the resumed run takes again
    for (int from : {8, 4}) {
        INFO("resumed from step " << from);
        REQUIRE(run_command("rm -rf '" + resumed + "' && cp -r '" + whole + "' '" + resumed + "'").status == 0);
        for (int s = from + 4; s <= 12; s += 4) remove_checkpoint(resumed, s);
        REQUIRE(list_checkpoints(resumed).back() == from);
        std::string again = train(1, flags + " -y 1", resumed);
        CHECK(again.find(strfmt("at step %d", from)) != std::string::npos);
        CHECK(read_file(resumed + "/main.log") == read_file(whole + "/main.log"));
    }
}

}  // namespace test_failures

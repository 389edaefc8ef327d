// Tests of stopping a run of 2 ranks from outside, as a scheduler's time limit does, in the middle of a step of
// under a second: SIGUSR1 to mpirun (what `sbatch --signal` and the launch scripts send), SIGTERM to mpirun and its
// ranks at the same moment (what Slurm sends a job at its time limit), SIGTERM to mpirun alone with the launch
// scripts' kill delay, and SIGTERM to the launch script run_gpt2_124M.sh with the real mpirun. Each run finishes
// its step, writes the checkpoint of it and says so; where the uninterrupted run has that step, the checkpoint is
// byte for byte its, and -y 1 continues with its losses to the last digit. Exit 5, except where mpirun itself got
// SIGTERM: OpenMPI then aborts the job and exits 1 whatever the ranks do. And the launch scripts' forwarding, each
// run with a stand-in for its launcher (mpirun, srun) that records its arguments and the signals it gets.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>

#include "mpi_helpers.h"

namespace test_stop {

// the pids of the processes whose parent is `parent` (mpirun's ranks, on one node)
std::vector<pid_t> children_of(pid_t parent) {
    std::vector<pid_t> children;
    DIR* d = opendir("/proc");
    REQUIRE(d);
    while (struct dirent* e = readdir(d)) {
        pid_t pid = atoi(e->d_name), ppid = 0;
        if (pid <= 0) continue;
        FILE* f = fopen(strfmt("/proc/%d/stat", pid).c_str(), "r");
        if (!f) continue;
        // pid (comm) state ppid: comm may hold spaces and parentheses, so read from the last ')'
        char line[1024] = {};
        size_t n = fread(line, 1, sizeof(line) - 1, f);
        fclose(f);
        const char* close = strrchr(line, ')');
        if (n > 0 && close && sscanf(close + 1, " %*c %d", &ppid) == 1 && ppid == parent) children.push_back(pid);
    }
    closedir(d);
    return children;
}

// every checkpoint directory under a run's -o, by name, complete or not (a ckpt_STEP.tmp left behind shows)
std::vector<std::string> checkpoints_in(const std::string& dir) {
    std::vector<std::string> names;
    DIR* d = opendir(dir.c_str());
    if (!d) return names;
    while (struct dirent* e = readdir(d))
        if (strncmp(e->d_name, "ckpt_", 5) == 0) names.push_back(e->d_name);
    closedir(d);
    std::sort(names.begin(), names.end());
    return names;
}

// Token data and the flags of the GPT-2 124M launch script's recipe (its TRAIN_GPT_ARGS) for a run of 2 ranks
// whose steps take about 0.8 s on a 2-core machine: a model of 0.85M parameters, 4 micro-steps of 8 x 64 tokens
// per rank and step, ZeRO-1 (so that each rank writes an optimizer file). The signals go out within 10 ms of a
// step's line (wait_for polls the log), so a step of a few hundred ms is long enough to be hit mid-way. The kill
// delays (3 and 4 s; the launch scripts' default is 30) leave a rank several times what it needs to finish its step
// and write its checkpoint, and OpenMPI waits them out whatever the ranks do, so they are the test's idle time.
struct SlowRun {
    TempDir dir;
    static constexpr const char* MODEL = "d4c128h4t64v301";
    static constexpr int STEPS = 5;
    SlowRun() {
        Rng rng(5);
        write_shard(dir / "train.bin", Data::learnable_tokens(60000, rng));
        write_shard(dir / "val.bin", Data::learnable_tokens(2000, rng));
    }
    // the script's variables, as the environment of a run of it
    std::string script_env(const std::string& out_dir, int checkpoint_every) const {
        return strfmt(
            "DEVICE=cpu COMM=mpi TRAIN_DATA='%s' VAL_DATA='%s' OUT_DIR='%s' MODEL=%s MICRO_BATCH=8 SEQ_LEN=64 "
            "TOTAL_BATCH=4096 LR=1e-3 FINAL_LR_FRAC=0.1 WARMUP=2 WEIGHT_DECAY=0.1 MAX_STEPS=%d VAL_EVERY=0 "
            "SAMPLE_EVERY=0 GEN_TOKENS=16 CKPT_EVERY=%d RESUME=1 ZERO=1 EXTRA_ARGS=",
            (dir / "train.bin").c_str(), (dir / "val.bin").c_str(), out_dir.c_str(), MODEL, STEPS, checkpoint_every);
    }
    // the same as train_gpt flags
    std::string flags(const std::string& out_dir, int checkpoint_every, int steps = STEPS) const {
        return strfmt(
            "--device cpu --comm mpi -i '%s' -j '%s' -o '%s' -e %s -b 8 -t 64 -d 4096 -l 1e-3 -q 0.1 -u 2 "
            "-c 0.1 -x %d -v 0 -s 0 -g 16 -n %d -y 1 -z 1",
            (dir / "train.bin").c_str(), (dir / "val.bin").c_str(), out_dir.c_str(), MODEL, steps, checkpoint_every);
    }
    std::string mpirun_command(const std::string& mpirun_flags, const std::string& out_dir, int steps = STEPS) const {
        return strfmt("env %s mpirun --oversubscribe --bind-to none %s -np 2 ./train_gpt %s", RUN_ENV,
                      mpirun_flags.c_str(), flags(out_dir, 0, steps).c_str());
    }
};

// What a run stopped from outside left in `stopped` (its output `output`), against the uninterrupted run in
// `whole` (a checkpoint at every step): it stopped after a step it finished on `signal`, said so, wrote that
// step's checkpoint and no other, byte for byte the uninterrupted run's; -y 1 then finishes the run with the
// uninterrupted run's main.log.
void check_stopped_run(const SlowRun& run, const std::string& output, const std::string& stopped,
                       const std::string& whole, const char* signal) {
    INFO(output);
    int step = last_step(output);
    REQUIRE(step >= 2);
    REQUIRE(step < SlowRun::STEPS);
    const std::string name = strfmt("ckpt_%08d", step);
    CHECK(output.find(strfmt("train_gpt: stopped after step %d on %s; checkpoint %s/%s written; resume with -y 1", step,
                             signal, stopped.c_str(), name.c_str())) != std::string::npos);
    REQUIRE(checkpoints_in(stopped) == std::vector<std::string>{name});
    for (const char* file :
         {"manifest.txt", "model.bin", "state_rank0.bin", "optimizer_rank0.bin", "optimizer_rank1.bin"}) {
        INFO(file);
        CHECK(read_file(stopped + "/" + name + "/" + file) == read_file(whole + "/" + name + "/" + file));
    }
    CommandResult again = mpirun(2, "./train_gpt", run.flags(stopped, 0));
    INFO(again.output);
    REQUIRE(again.status == 0);
    CHECK(again.output.find(strfmt("resumed from %s/%s at step %d", stopped.c_str(), name.c_str(), step)) !=
          std::string::npos);
    CHECK(read_file(stopped + "/main.log") == read_file(whole + "/main.log"));
}

TEST_CASE("a run of 2 ranks stopped from outside mid-step leaves its finished step's checkpoint, from which -y 1 "
          "continues exactly",
          "[failures][stop]") {
    SlowRun run;
    TempDir out;
    const std::string whole = out / "whole";
    CommandResult r = mpirun(2, "./train_gpt", run.flags(whole, 1));
    INFO(r.output);
    REQUIRE(r.status == 0);
    // the steps are long enough that a signal sent on a step's line lands in the middle of the next
    double ms = 0;
    for (const std::string& line : lines_of(r.output))
        if (line.rfind("step     2/", 0) == 0) ms = atof(line.c_str() + line.rfind("| ", line.find(" ms |")) + 2);
    CHECK(ms > 200);

    {
        INFO("SIGUSR1 to mpirun: it passes it on, and exits 5 as the ranks do");
        const std::string dir = out / "usr1", log = out / "usr1.log";
        pid_t pid = start_command(run.mpirun_command("", dir), log);
        REQUIRE(wait_for(log, "step     2/"));
        kill(pid, SIGUSR1);
        CHECK(finish(pid) == 5);
        check_stopped_run(run, read_file(log), dir, whole, "SIGUSR1");
    }
    {
        INFO("SIGTERM to mpirun and its ranks at once, mpirun given the launch scripts' kill delay: exit 1, OpenMPI's");
        const std::string dir = out / "term", log = out / "term.log";
        pid_t pid = start_command(run.mpirun_command("--mca odls_base_sigkill_timeout 3", dir), log);
        REQUIRE(wait_for(log, "step     2/"));
        std::vector<pid_t> ranks = children_of(pid);
        REQUIRE(ranks.size() == 2);
        // each rank twice: from the scheduler, and again from a launcher that passes its own on (srun does)
        kill(pid, SIGTERM);
        for (pid_t rank : ranks) kill(rank, SIGTERM);
        usleep(100000);
        for (pid_t rank : ranks) kill(rank, SIGTERM);
        CHECK(finish(pid) == 1);
        check_stopped_run(run, read_file(log), dir, whole, "SIGTERM");
    }
    {
        // OpenMPI passes the SIGTERM on after the kill delay, and kills the ranks as long again after that; a
        // run long enough that the delay ends within it (40 steps: 30 s here)
        INFO("SIGTERM to mpirun alone, kill delay 4 s: the ranks stop with their checkpoint; exit 1, OpenMPI's");
        const std::string dir = out / "mpirun", log = out / "mpirun.log";
        pid_t pid = start_command(run.mpirun_command("--mca odls_base_sigkill_timeout 4", dir, 40), log);
        REQUIRE(wait_for(log, "step     1/"));
        kill(pid, SIGTERM);
        CHECK(finish(pid) == 1);
        std::string output = read_file(log);
        INFO(output);
        int step = last_step(output);
        CHECK(output.find(strfmt("train_gpt: stopped after step %d on SIGTERM; checkpoint %s/ckpt_%08d written", step,
                                 dir.c_str(), step)) != std::string::npos);
        CHECK(checkpoints_in(dir) == std::vector<std::string>{strfmt("ckpt_%08d", step)});
    }
    {
        INFO("SIGTERM to scripts/run_gpt2_124M.sh: the ranks get SIGUSR1 from mpirun, and the script exits 5");
        const std::string dir = out / "script", log = out / "script.log";
        pid_t pid =
            start_command(strfmt("env %s %s NUM_GPUS=2 BUILD=0 KILL_DELAY=3 MPI_ARGS='--oversubscribe --bind-to "
                                 "none' bash scripts/run_gpt2_124M.sh",
                                 RUN_ENV, run.script_env(dir, 0).c_str()),
                          log);
        REQUIRE(wait_for(log, "step     2/"));
        kill(pid, SIGTERM);
        CHECK(finish(pid) == 5);
        std::string output = read_file(log);
        CHECK(output.find("run_gpt2_124M.sh: SIGTERM: asking the ranks to stop after their step with a checkpoint "
                          "(SIGUSR1 to pid ") != std::string::npos);
        check_stopped_run(run, output, dir, whole, "SIGUSR1");
    }
}

// A directory with stand-ins for mpirun, srun and scontrol: each appends its name and arguments to `record`,
// then the signals it gets; SIGUSR1 ends a launcher with 5, as the ranks end after their checkpoint, and SIGTERM
// with 1, as mpirun's abort does.
struct StandIns {
    TempDir dir;
    std::string record = dir / "record";
    StandIns() {
        const std::string launcher =
            "#!/bin/bash\n"
            "record=\"$(dirname \"$0\")/record\"\n"
            "trap 'echo \"got SIGUSR1\" >> \"$record\"; exit 5' USR1\n"
            "trap 'echo \"got SIGTERM\" >> \"$record\"; exit 1' TERM\n"
            "echo \"$(basename \"$0\") $*\" >> \"$record\"\n"
            "while :; do sleep 0.05; done\n";
        const std::string scontrol = "#!/bin/bash\necho \"scontrol $*\" >> \"$(dirname \"$0\")/record\"\n";
        for (const auto& [name, text] :
             {std::pair<std::string, std::string>{"mpirun", launcher}, {"srun", launcher}, {"scontrol", scontrol}}) {
            File f(dir / name, "wb");
            f.write(text.data(), text.size());
            f.close();
            REQUIRE(chmod((dir / name).c_str(), 0755) == 0);
        }
    }
};

// Runs `script` under `env` with the stand-ins first on PATH, sends it `sig` once its launcher runs, and returns
// the script's exit status; `record` then holds what the launcher got.
int signal_script(const StandIns& s, const std::string& env, const std::string& script, int sig,
                  std::string* log_text) {
    const std::string log = s.dir / "script.log";
    unlink(s.record.c_str());
    pid_t pid = start_command(strfmt("env PATH='%s':\"$PATH\" MPIRUN='%s' %s bash %s", s.dir.path.c_str(),
                                     (s.dir / "mpirun").c_str(), env.c_str(), script.c_str()),
                              log);
    bool launched = wait_for(s.record, "run ", 30);  // "mpirun ARGS" or "srun ARGS"
    *log_text = read_file(log);
    INFO(*log_text);
    REQUIRE(launched);
    usleep(200000);  // its trap is set
    kill(pid, sig);
    int status = finish(pid);
    *log_text = read_file(log);
    return status;
}

TEST_CASE("the launch scripts pass SIGTERM and SIGUSR1 on to their launcher as SIGUSR1; the sbatch scripts requeue on "
          "the advance SIGUSR1",
          "[stop]") {
    StandIns s;
    TempDir out;
    const std::string common = strfmt("DEVICE=cpu OUT_DIR='%s' KILL_DELAY=7", (out / "run").c_str());
    {
        File f(out / "hostfile", "wb");
        f.write("localhost slots=2\n", 18);
        f.close();
    }
    char repo[4096] = {};
    REQUIRE(getcwd(repo, sizeof(repo) - 1));
    const std::string slurm = strfmt(
        "SLURM_JOB_ID=42 SLURM_NTASKS=2 SLURM_JOB_NUM_NODES=1 REPO_DIR='%s' "
        "SHARED_DIR='%s' MASTER_ADDR=localhost",
        repo, (out / "shared").c_str());
    struct Case {
        const char* script;
        std::string env;
        const char* launcher;
    } cases[] = {{"scripts/run_gpt2_124M.sh", "BUILD=0 NUM_GPUS=2", "mpirun"},
                 {"scripts/multi_node/mpirun_hostfile.sh",
                  "HOSTFILE='" + (out / "hostfile") + "' NUM_NODES=1 GPUS_PER_NODE=2", "mpirun"},
                 {"scripts/multi_node/sbatch_tcp.sbatch", slurm, "srun"},
                 {"scripts/multi_node/sbatch_file.sbatch", slurm, "srun"}};
    for (const Case& c : cases) {
        for (int sig : {SIGTERM, SIGUSR1}) {
            INFO(c.script << ", " << (sig == SIGTERM ? "SIGTERM" : "SIGUSR1"));
            std::string log;
            int status = signal_script(s, common + " " + c.env, c.script, sig, &log);
            INFO(log);
            CHECK(status == 5);
            std::string record = read_file(s.record);
            INFO(record);
            CHECK(record.find("got SIGUSR1") != std::string::npos);
            CHECK(record.find("got SIGTERM") == std::string::npos);
            const std::string script_name = strrchr(c.script, '/') + 1;
            CHECK(log.find(strfmt("%s: %s: asking the ranks to stop after their step with a checkpoint",
                                  script_name.c_str(), sig == SIGTERM ? "SIGTERM" : "SIGUSR1")) != std::string::npos);
            if (std::string(c.launcher) == "mpirun") {
                CHECK(record.find("--mca odls_base_sigkill_timeout 7 ") != std::string::npos);
            } else {
                // the advance notice requeues the job; a SIGTERM (scancel, or the time limit itself) does not
                CHECK((record.find("scontrol requeue 42") != std::string::npos) == (sig == SIGUSR1));
            }
        }
    }
}

}  // namespace test_stop

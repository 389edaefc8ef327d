// What guards a run against the world around it: a lock that keeps a second run out of its output directory,
// and the handling of the signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) that turns the first of them into a
// checkpoint and a clean stop. Both are state of the whole process (a file descriptor held open, a signal
// handler), so they live here rather than in the training story of train_gpt.cu.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <string>

#include "llmc/comm.cuh"
#include "llmc/utils.h"

// An flock on DIR/train_gpt.lock, held from acquire() to the end of the process: the kernel releases it however
// the process ends, so a crashed run never leaves a stale lock behind. The file, which stays, names the run that
// holds it ("host H pid P"), for the line that refuses a second run.
struct RunLock {
    int fd = -1;
    RunLock() = default;
    RunLock(const RunLock&) = delete;
    RunLock& operator=(const RunLock&) = delete;
    ~RunLock() {
        if (fd >= 0) close(fd);
    }
    void acquire(const std::string& dir) {
        std::string path = dir + "/train_gpt.lock";
        fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) fail("%s: cannot open (%s)", path.c_str(), strerror(errno));
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            if (errno != EWOULDBLOCK) fail("%s: cannot lock (%s)", path.c_str(), strerror(errno));
            // the holder writes its name right after locking; a run that lost a race by microseconds waits for it
            char text[512] = {};
            ssize_t n = 0;
            for (int tries = 0; tries < 100 && (n = pread(fd, text, sizeof(text) - 1, 0)) <= 0; tries++) usleep(10000);
            std::string holder(text, n > 0 ? (size_t)n : 0);
            while (!holder.empty() && holder.back() == '\n') holder.pop_back();
            fail("-o %s: another run is using it (%s); wait for it to end or choose another directory", dir.c_str(),
                 holder.empty() ? "it has not yet written its host and pid" : holder.c_str());
        }
        char host[256] = {};
        gethostname(host, sizeof(host) - 1);
        std::string text = strfmt("host %s pid %d\n", host, (int)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) != (ssize_t)text.size())
            fail("%s: cannot write (%s)", path.c_str(), strerror(errno));
    }
};

// The first SIGTERM, SIGINT, SIGUSR1 or SIGUSR2 asks the run to stop after the current step with a checkpoint.
// SIGUSR1 is the advance notice a scheduler can be asked for (`sbatch --signal=B:USR1@SECONDS`), and the signal
// OpenMPI's mpirun passes on to the ranks as it is (on SIGTERM mpirun aborts the job: docs/failures.md's table
// says what that costs, and how the launch scripts avoid it). The same request often comes more than once, so a
// repeated SIGTERM, SIGUSR1 or SIGUSR2 is ignored: Slurm signals mpirun and the ranks alike, mpirun passes its
// own on, and a scheduler that runs out of patience sends SIGKILL anyway. Only a SIGINT after the first request
// (Ctrl-C pressed again) ends the process at once.
inline volatile sig_atomic_t stop_signal = 0;  // the number of the first signal received, 0 before any

inline void on_stop_signal(int sig) {
    if (stop_signal == 0) {
        stop_signal = sig;
    } else if (sig == SIGINT) {
        signal(sig, SIG_DFL);
        raise(sig);  // delivered, by default, when this handler returns
    }
}

inline void install_stop_handlers() {
    struct sigaction sa = {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaction(sig, &sa, nullptr);
}

// Whether any rank has been asked to stop: a sum over all ranks, so that every rank stops after the same step
// (a signal may reach only some of them). Collective over `world`.
inline bool stop_requested(Comm& world) {
    int mine = stop_signal != 0, any = 0;
    world.wait(world.all_reduce(&mine, &any, 1, DType::I32));
    return any > 0;
}

// what asked this run to stop, for the line that says so
inline const char* stop_reason() {
    switch (stop_signal) {
        case SIGTERM: return "SIGTERM";
        case SIGINT: return "SIGINT";
        case SIGUSR1: return "SIGUSR1";
        case SIGUSR2: return "SIGUSR2";
        default: return "a signal to another rank";
    }
}

// Which checkpoint -y 1 resumes from. Every checkpoint in -o is a candidate, newest first; a candidate whose
// manifest or files fail verification is named, skipped and kept as evidence (moved aside once the run goes on),
// and the newest that verifies is chosen. The choice is made twice: run() reads the manifests alone, before the
// first line is printed, to refuse settings the checkpoint cannot continue with; train() checksums the chosen
// checkpoint's files over every rank, and falls back to an older one when they fail. It lives apart from
// llmc/checkpoint.h, which writes and reads one checkpoint, because choosing among them is the run's policy.
#pragma once

#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/comm.cuh"
#include "llmc/utils.h"

// A checkpoint -y 1 may resume from: its step, and the files its manifest lists, or why the manifest fails
struct ResumeCandidate {
    int step;
    std::vector<ListedFile> files;
    std::string why;
};

// every checkpoint in out_dir, newest first, with its manifest checked (cheap: the manifests and the files'
// headers); the files' contents are checksummed when one is chosen
inline std::vector<ResumeCandidate> resume_candidates(const std::string& out_dir) {
    std::vector<ResumeCandidate> candidates;
    for (int step : list_checkpoints(out_dir)) {
        ResumeCandidate c{step, {}, ""};
        try {
            c.files = verify_manifest(out_dir, step);
            checkpoint_config(out_dir + "/" + checkpoint_name(step));
        } catch (const Error& e) {
            c.why = e.what();
        }
        candidates.insert(candidates.begin(), c);
    }
    return candidates;
}

// what the newest checkpoint in out_dir is, for the line that says why a run stopped
inline std::string newest_checkpoint(const std::string& out_dir) {
    std::vector<int> steps = list_checkpoints(out_dir);
    if (steps.empty()) return "there is no checkpoint in " + out_dir;
    return "the newest checkpoint is " + out_dir + "/" + checkpoint_name(steps.back());
}

// the first rank's error line, or "" when no rank has one (a collective)
inline std::string first_failure(Comm& world, const std::string& mine) {
    constexpr int BYTES = 1024;
    std::vector<char> line(BYTES, 0), all((size_t)BYTES * world.size);
    memcpy(line.data(), mine.data(), std::min(mine.size(), (size_t)BYTES - 1));
    world.wait(world.all_gather(line.data(), all.data(), BYTES / 4, DType::I32));
    for (int r = 0; r < world.size; r++)
        if (all[(size_t)r * BYTES] != 0) return std::string(&all[(size_t)r * BYTES]);
    return "";
}

// The checkpoint of out_dir to resume from: of the candidates (newest first), the newest whose manifest verified
// and whose files verify, each rank checksumming its share of them over `world` (without one, where no manifest
// verified, none is chosen). Those before it are named, never loaded, and kept as evidence: moved aside when the
// run goes on, so that its own checkpoints of those steps cannot replace them and pruning cannot count them as
// good ones.
inline std::string choose_checkpoint(const std::string& out_dir, const std::vector<ResumeCandidate>& candidates,
                                     Comm* world) {
    std::vector<std::pair<int, std::string>> failed;
    std::string chosen;
    for (const ResumeCandidate& c : candidates) {
        std::string dir = out_dir + "/" + checkpoint_name(c.step), why = c.why;
        if (why.empty() && world) {
            std::string mine;
            try {
                verify_files(dir, c.files, world->rank, world->size);
            } catch (const Error& e) {
                mine = e.what();
            }
            why = first_failure(*world, mine);
            if (why.empty()) {
                chosen = dir;
                break;
            }
        }
        failed.push_back({c.step, why});
    }
    bool lead = world ? world->rank == 0 : detect_launch().rank == 0;
    for (const auto& [step, why] : failed) {
        std::string dir = out_dir + "/" + checkpoint_name(step), kept = "kept";
        if (lead && !chosen.empty()) {
            std::string aside = dir + ".unverified";
            for (int n = 2; access(aside.c_str(), F_OK) == 0; n++) aside = dir + strfmt(".unverified%d", n);
            if (rename(dir.c_str(), aside.c_str()) != 0) fail("%s: cannot move aside (%s)", dir.c_str(), strerror(errno));
            kept = "kept as " + aside;
        }
        if (lead) printf("checkpoint %s fails verification, skipped and %s: %s\n", dir.c_str(), kept.c_str(), why.c_str());
    }
    fflush(stdout);
    if (!candidates.empty() && chosen.empty())
        fail("-y 1: none of the %zu checkpoints in %s verifies (each is named above and kept)", candidates.size(),
             out_dir.c_str());
    return chosen;
}

// what a run must share with the checkpoint it resumes from: the inputs it started from and on, -t and -d
inline void check_resume_from(const RunInputs& inputs, const RunLayout& layout, const std::string& dir) {
    check_run_inputs(inputs, read_manifest_inputs(dir + "/manifest.txt"), dir);
    check_resumable(layout, read_manifest_layout(dir + "/manifest.txt"), dir);
}

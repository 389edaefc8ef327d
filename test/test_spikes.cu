// Tests of spike skipping (-sl, -sg, --spike-window; llmc/spikes.h): a learnable shard with two planted outlier
// batches (one token repeated, whose loss and gradient norm jump far above the steps before) skips exactly the
// two steps that read them, by the loss or by the gradient norm, on one rank and under dp 2; and a run resumed
// from a checkpoint between the two continues the statistics bit for bit.
#include "mpi_helpers.h"

namespace test_spikes {

constexpr int WINDOW = 24, STEPS = 70;
const std::vector<int> PLANTED{40, 55};  // the steps (main.log's s:STEP) that read the outlier batches

// Shards of vocab 301 with global batches of 64 tokens; the train shard's batches 40 and 55 (and the one token
// after each, the last target) are token 5 repeated, where the rest follows Data's learnable rule. Most runs read
// the shard in order (--shuffle 0), so step s reads batch s and the planted batches land on known steps; two
// read it shuffled, as runs do by default, on one rank and under dp 2, and must skip the same steps.
struct PlantedData {
    TempDir dir;
    PlantedData() {
        Rng rng(11);
        std::vector<uint16_t> train = Data::learnable_tokens(6000, rng);
        for (int batch : PLANTED) std::fill(train.begin() + batch * 64, train.begin() + (batch + 1) * 64 + 1, 5);
        write_shard(dir / "train.bin", train);
        write_shard(dir / "val.bin", Data::learnable_tokens(1200, rng));
    }
    // b sequences per rank per micro-step: 2 micro-steps of a global batch of 64 tokens on one rank with -b 2,
    // and under dp 2 with -b 1
    std::string flags(int b, const std::string& spikes, int shuffle = 0, int steps = STEPS) const {
        return strfmt("-e d3c33h3t32v301 -i '%s' -j '%s' -t 16 -b %d -d 64 -x %d -v 0 -s 0 -l 3e-3 -u 3 -q 0.1 -c 0.1 "
                      "--seed 7 --shuffle %d --bucket-mb 0.06 --spike-window %d %s",
                      (dir / "train.bin").c_str(), (dir / "val.bin").c_str(), b, steps, shuffle, WINDOW, spikes.c_str());
    }
};

// the steps main.log marks skipped:1, each of them carrying `z` ("zloss:" or "znorm:")
std::vector<int> skipped_steps(const std::string& out_dir, const std::string& z) {
    std::vector<int> steps;
    for (const std::string& line : lines_of(read_file(out_dir + "/main.log"))) {
        if (line.find(" skipped:1") == std::string::npos) continue;
        INFO(line);
        CHECK(line.find(" " + z) != std::string::npos);
        steps.push_back(atoi(line.c_str() + 2));
    }
    return steps;
}

TEST_CASE("-sl and -sg skip exactly the steps that read planted outlier batches, on one rank and under dp 2, and a "
          "resumed run continues the statistics bit for bit",
          "[spikes]") {
    PlantedData data;
    TempDir out;
    std::string output;
    SECTION("without -sl and -sg nothing is skipped") {
        REQUIRE(single_ok(data.flags(2, ""), out / "off"));
        CHECK(skipped_steps(out / "off", "z").empty());
    }
    SECTION("by the loss, and by the gradient norm, on one rank") {
        REQUIRE(single_ok(data.flags(2, "-sl 6 -sg 8"), out / "both", &output));
        CHECK(skipped_steps(out / "both", "zloss:") == PLANTED);
        CHECK(output.find("spikes: a step whose loss or gradient norm lies more than 6 (-sl) or 8 (-sg) standard "
                          "deviations above its mean over the newest 24 steps that updated") != std::string::npos);
        CHECK(output.find("update skipped: loss ") != std::string::npos);
        REQUIRE(single_ok(data.flags(2, "-sg 8"), out / "norm", &output));
        CHECK(skipped_steps(out / "norm", "znorm:") == PLANTED);
        CHECK(output.find("above its mean over the last 24 steps (-sg 8) (1 in a row)") != std::string::npos);
        // a step is measured only against a full window: none of the first 24 is skipped, however low the limit
        REQUIRE(single_ok(data.flags(2, "-sg 0.01 --max-bad-steps 100"), out / "low", &output));
        std::vector<int> low = skipped_steps(out / "low", "znorm:");
        CHECK(low.size() > 10);
        CHECK(*std::min_element(low.begin(), low.end()) >= WINDOW);
    }
    SECTION("with the default --shuffle 1, over one epoch, one rank and dp 2 skip the same steps") {
        REQUIRE(single_ok(data.flags(2, "-sl 6 -sg 8", 1, 93), out / "shuffled1"));
        REQUIRE(train_ok(2, data.flags(1, "-sl 6 -sg 8", 1, 93), out / "shuffled2"));
        std::vector<int> one = skipped_steps(out / "shuffled1", "z");
        CHECK(!one.empty());
        CHECK(skipped_steps(out / "shuffled2", "z") == one);
    }
    SECTION("under dp 2, and resumed from a checkpoint between the planted steps") {
        std::string whole = out / "whole", resumed = out / "resumed";
        REQUIRE(train_ok(2, data.flags(1, "-sl 6 -sg 8 -n 10"), whole));
        CHECK(skipped_steps(whole, "zloss:") == PLANTED);
        // the run as if it had stopped after its checkpoint of step 50: the later checkpoints gone
        REQUIRE(run_command(strfmt("cp -r '%s' '%s' && rm -r '%s/ckpt_00000060' '%s/ckpt_00000070'", whole.c_str(),
                                   resumed.c_str(), resumed.c_str(), resumed.c_str())).status == 0);
        REQUIRE(train_ok(2, data.flags(1, "-sl 6 -sg 8 -n 10 -y 1"), resumed));
        CHECK(read_file(resumed + "/main.log") == read_file(whole + "/main.log"));
        for (const char* file : {"model.bin", "state_rank0.bin", "optimizer_rank0.bin", "manifest.txt"}) {
            INFO(file);
            CHECK(read_file(resumed + "/ckpt_00000070/" + file) == read_file(whole + "/ckpt_00000070/" + file));
        }
        // the state holds the windows: 24 losses and 24 norms after the 1 KiB header
        CHECK(read_file(whole + "/ckpt_00000070/state_rank0.bin").size() == 1024 + 2 * WINDOW * 8);
    }
}

}  // namespace test_spikes

// Tests of the mixture of experts (llmc/moe.cuh; the model against PyTorch is in test_model_reference.cu): the
// routing against a direct reading of its definition; e1k1 is the dense model, file and losses; the model
// file's header; expert parallelism (--ep) with dp, ZeRO-1 and ZeRO-3, tp and pp, each with gradient
// accumulation, against the single-rank run with the same global batch over 20 steps (the equivalence
// principle); the counted all-to-all bytes against the formula; the ledger against --plan; a run resumed
// bit-exactly under ep; and the bad descriptors and layouts, each refused in one line.
//
// The model has odd sizes (C=48 in 4 heads of 12, a vocab of 301) and 4 experts with top-2 routing.
#include <catch.hpp>

#include "llmc/gpt.cuh"
#include "llmc/plan.h"
#include "mpi_helpers.h"

namespace {

const char* MOE_MODEL = "d2c48h4t32v301e4k2";

// "comm: rank 0 sent X bytes on ep in this step; ... says Y": X equals Y, and is not 0
void require_ep_counted_equals_formula(const std::string& output) {
    for (const std::string& line : lines_of(output))
        if (line.rfind("comm: rank 0 sent ", 0) == 0 && line.find(" on ep ") != std::string::npos) {
            double sent = -1, formula = -2;
            REQUIRE(sscanf(line.c_str(), "comm: rank 0 sent %lf", &sent) == 1);
            REQUIRE(sscanf(line.c_str() + line.find(" says ") + 6, "%lf", &formula) == 1);
            INFO(line);
            CHECK(sent > 0);
            CHECK(sent == formula);
            return;
        }
    FAIL("no ep comm line in:\n" << output);
}

}  // namespace

TEST_CASE("routing: the top-K by logit (ties to the lower expert), gates over the chosen, and the dispatch order",
          "[moe]") {
    const int E = 5, K = 3;
    const long BT = 7;
    Rng rng(3);
    std::vector<float> logits(BT * E);
    for (float& x : logits) x = rng.normal(0.0f, 1.0f);
    logits[2 * E + 1] = logits[2 * E + 3] = 4.0f;  // a tie at the top of token 2: expert 1 comes first
    MoERoute r;
    route_tokens(r, logits.data(), BT, E, K);
    std::vector<int> rows_seen(BT * K, 0);
    for (long t = 0; t < BT; t++) {
        const float* l = &logits[t * E];
        // the chosen are the K largest, in decreasing order
        std::vector<int> order(E);
        for (int e = 0; e < E; e++) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
        double gate_sum = 0.0, denominator = 0.0;
        for (int k = 0; k < K; k++) denominator += exp(l[order[k]] - l[order[0]]);
        for (int k = 0; k < K; k++) {
            CHECK(r.expert[t * K + k] == order[k]);
            CHECK(r.gate[t * K + k] == Approx(exp(l[order[k]] - l[order[0]]) / denominator).epsilon(1e-6));
            gate_sum += r.gate[t * K + k];
            // its row in dispatch order carries this token, among the rows of its expert
            int row = r.row_of[t * K + k];
            CHECK(r.token_of_row[row] == t);
            rows_seen[row]++;
            int first = 0;
            for (int e = 0; e < order[k]; e++) first += r.send_counts[e];
            CHECK(row >= first);
            CHECK(row < first + r.send_counts[order[k]]);
        }
        CHECK(gate_sum == Approx(1.0).epsilon(1e-6));
        double p_sum = 0.0;
        for (int e = 0; e < E; e++) p_sum += r.probs[t * E + e];
        CHECK(p_sum == Approx(1.0).epsilon(1e-6));
    }
    CHECK(r.expert[2 * K] == 1);
    CHECK(r.expert[2 * K + 1] == 3);
    for (int seen : rows_seen) CHECK(seen == 1);  // every row once: a permutation
    // within an expert, the rows follow the tokens
    std::vector<int> expert_of_row(BT * K);
    for (long tk = 0; tk < BT * K; tk++) expert_of_row[r.row_of[tk]] = r.expert[tk];
    for (long i = 1; i < BT * K; i++) {
        CHECK(expert_of_row[i - 1] <= expert_of_row[i]);
        if (expert_of_row[i - 1] == expert_of_row[i]) CHECK(r.token_of_row[i - 1] < r.token_of_row[i]);
    }
}

TEST_CASE("descriptors with experts; e1k1 is the dense model: the same file, byte for byte, and the same losses",
          "[moe]") {
    GPTConfig c = parse_model_descriptor("d2c48h4t32v301e4k2");
    CHECK((c.num_experts == 4 && c.top_k == 2 && c.moe()));
    GPTConfig g = parse_model_descriptor("d12e8k2");
    CHECK((g.channels == 768 && g.num_heads == 12 && g.num_experts == 8 && g.top_k == 2));
    CHECK(!parse_model_descriptor("d2c48h4e1k1").moe());
    // parameters: the dense model's, with E experts' MLPs and the router in place of one MLP
    GPTConfig dense = parse_model_descriptor("d2c48h4t32v301");
    size_t C = 48, mlp = 8 * C * C + 5 * C;
    CHECK(num_parameters(c) == num_parameters(dense) + 2 * (3 * mlp + 4 * C));
    // under ep 2 a rank holds 2 of the 4 experts, and the whole router
    CHECK(num_parameters(c, 1, whole_part(c), 2) == num_parameters(dense) + 2 * (mlp + 4 * C));

    Data data;
    TempDir out;
    std::string dense_dir = out / "dense", e1k1_dir = out / "e1k1", moe_dir = out / "moe";
    REQUIRE(single_ok(data.flags(2, 64, 4, "d2c48h4t32v301") + " -n 4", dense_dir));
    REQUIRE(single_ok(data.flags(2, 64, 4, "d2c48h4t32v301e1k1") + " -n 4", e1k1_dir));
    CHECK(losses(dense_dir) == losses(e1k1_dir));
    std::string dense_model = read_file(dense_dir + "/ckpt_00000004/model.bin");
    CHECK(dense_model == read_file(e1k1_dir + "/ckpt_00000004/model.bin"));
    int h[256];
    memcpy(h, dense_model.data(), sizeof(h));
    CHECK((h[8] == 0 && h[9] == 0));

    // with experts: header[8] = E, header[9] = K, and the file loads back as the same model
    std::string run;
    REQUIRE(single_ok(data.flags(2, 64, 4, MOE_MODEL) + " -n 4", moe_dir, &run));
    std::string moe_model = read_file(moe_dir + "/ckpt_00000004/model.bin");
    memcpy(h, moe_model.data(), sizeof(h));
    CHECK((h[8] == 4 && h[9] == 2));
    CHECK(moe_model.size() == 1024 + 4 * num_parameters(c));
    int version;
    GPTConfig read = read_model_header(moe_dir + "/ckpt_00000004/model.bin", &version);
    CHECK((read.num_experts == 4 && read.top_k == 2));
    // the log: the aux loss on every step line (near α·L = 0.02 for a router that starts balanced), and each
    // layer's expert load on the first step
    CHECK(run.find("| aux 0.02") != std::string::npos);
    std::string log = read_file(moe_dir + "/main.log");
    CHECK(log.find("s:0 load:") != std::string::npos);
    CHECK(log.find(" aux:0.02") != std::string::npos);
}

TEST_CASE("--ep with dp, ZeRO-1 and ZeRO-3, tp and pp, each with gradient accumulation, gives the single-rank run's "
          "losses over 20 steps; the all-to-all bytes equal the formula", "[moe]") {
    Data data;
    TempDir out;
    // the same global batch of 8 sequences: 4 micro-batches of 2 on one rank
    REQUIRE(single_ok(data.flags(2, 128, 20, MOE_MODEL), out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    struct Layout {
        const char* name;
        int ranks, b;
        const char* flags;
    };
    for (Layout l : {Layout{"ep2", 2, 2, " --ep 2"}, Layout{"ep4", 4, 1, " --ep 4"},
                     Layout{"ep2_dp4", 4, 1, " --ep 2"}, Layout{"ep2_z1", 2, 2, " --ep 2 -z 1"},
                     Layout{"ep2_z3", 2, 2, " --ep 2 -z 3"}, Layout{"ep2_tp2", 4, 2, " --ep 2 --tp 2"},
                     Layout{"ep2_pp2", 4, 1, " --ep 2 --pp 2"}, Layout{"dp2_replicated", 2, 2, ""}}) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(l.ranks, data.flags(l.b, 128, 20, MOE_MODEL) + l.flags, dir, &run)) continue;
        check_close(losses(dir), reference, 1e-5);
        if (std::string(l.flags).find("--ep") != std::string::npos) require_ep_counted_equals_formula(run);
    }
}

TEST_CASE("a run with experts under ep 2 resumes bit-exactly", "[moe]") {
    Data data;
    TempDir out;
    GPTConfig c = parse_model_descriptor(MOE_MODEL);
    check_resumes_bit_exactly(2, data.flags(2, 64, 6, MOE_MODEL) + " --ep 2 -z 1", out / "whole", out / "resumed",
                              num_parameters(c));
}

TEST_CASE("bad experts and ep layouts are refused in one line", "[moe]") {
    Data data;
    auto refused = [&](const std::string& model, const std::string& flags, const std::vector<std::string>& words) {
        check_one_line_error(single(data.flags(2, 32, 1, model) + flags), words);
    };
    refused("d2c48h4e4k5", "", {"top-5", "at least 5 experts"});
    refused("d2c48h4e4", "", {"e<E>", "k<K>"});
    refused("d2c48h4e0k1", "", {"-e d2c48h4e0k1", "bad number"});
    refused("d2c48h4t32v301", " --plan --world 2 --ep 2", {"--ep 2", "no experts"});
    refused(MOE_MODEL, " --plan --world 6 --ep 3", {"--ep 3", "must divide the number of experts (4)"});
    refused(MOE_MODEL, " --plan --world 4 --ep 8", {"--ep 8", "must divide the data-parallel size 4"});
    refused("d2c48h4t32v301", " --moe-aux 0.1", {"--moe-aux", "no experts"});
    refused(MOE_MODEL, " --plan --world 2 --pp 2 --pp-schedule zb", {"--pp-schedule zb", "experts"});
}

// Tests of the mixture of experts (llmc/moe.cuh; the model against PyTorch is in test_model_reference.cu): the
// routing against a direct reading of its definition; e1k1 is the dense model, file and losses; the model
// file's header; expert parallelism (--ep) with dp, ZeRO-1 and ZeRO-3, tp, pp (1F1B and the zero-bubble
// schedule's split backward), cp and recomputation, each with gradient accumulation, against the single-rank
// run with the same global batch over 10 steps (the equivalence principle); the counted all-to-all and dp bytes
// against their formulas; the ledger of every rank against --plan; a run resumed bit-exactly under ep; and the
// bad descriptors and layouts, each refused in one line.
//
// The model has odd sizes (C=48 in 4 heads of 12, a vocab of 301) and 4 experts with top-2 routing.
#include <catch.hpp>

#include "dev/cuda/routing_case.h"
#include "llmc/gpt.cuh"
#include "llmc/plan.h"
#include "llmc/pp.cuh"
#include "mpi_helpers.h"
#include "parameter_counts.h"

namespace test_moe {

const char* MOE_MODEL = "d2c48h4t32v301e4k2";
// ... and for the layouts, experts of 40 hidden units (not 4C) whose gates are not renormalized, layer 0 dense
// (n1), 1 sparse, 2 dense (off the step of 2), 3 sparse: DualPipeV's four chunks of one layer each put a dense
// chunk and a sparse one on each of its two stages. GPT-2's sparse layers add DeepSeek's shared expert (y24, always
// on, with GPT-2's biases) and its router's sigmoid scores, the gates scaled by 2.5 and the selection bias (i, r2.5,
// a: moved fast enough to change the routing within the run); the Llama's are Qwen2-MoE's: q, k and v biases and
// a gated shared expert (z56).
const char* LAYOUT_MODEL = "d4c48h4t32v301e4k2x40un1s2y24ir2.5a";
const char* LLAMA_LAYOUT_MODEL = "l4c48h4g2f88t32v301be4k2x40un1s2z56";

// One micro-batch's routing on the host, through the functions the CPU model calls (llmc/moe.cuh)
struct HostRouting {
    std::vector<int> expert, row_of, token_of_row, send_counts;
    std::vector<float> gate, probs, scores;
    long dispatched = 0;
    HostRouting() = default;
    HostRouting(const float* logits, long BT, int E, int K, const Routing& how, const float* bias = nullptr)
        : expert(BT * K), gate(BT * K), probs(BT * E), scores(how.sigmoid ? BT * E : 0) {
        route_tokens<float>(expert.data(), gate.data(), probs.data(), how.sigmoid ? scores.data() : nullptr, logits, bias,
                            BT, E, K, how);
        dispatch(BT, E, K);
    }
    void dispatch(long BT, int E, int K, const int* keep = nullptr) {
        row_of.resize(BT * K), token_of_row.resize(BT * K), send_counts.resize(E);
        dispatch_order<float>(row_of.data(), token_of_row.data(), send_counts.data(), expert.data(), keep, BT, E, K,
                              nullptr);
        dispatched = std::accumulate(send_counts.begin(), send_counts.end(), 0L);
        token_of_row.resize(dispatched);
    }
};

TEST_CASE("routing: the top-K by logit (ties to the lower expert), gates the softmax over all experts (or each "
          "expert's sigmoid) at the chosen, renormalized or not, scaled, and the dispatch order",
          "[moe]") {
    const int E = 5, K = 3;
    const long BT = 7;
    Rng rng(3);
    std::vector<float> logits(BT * E);
    for (float& x : logits) x = rng.normal(0.0f, 1.0f);
    logits[2 * E + 1] = logits[2 * E + 3] = 4.0f;  // a tie at the top of token 2: expert 1 comes first
    for (bool sigmoid : {false, true})
    for (bool normalize : {true, false}) {
        INFO("sigmoid " << sigmoid << ", normalized " << normalize);
        const double scale = sigmoid ? 2.5 : 1.0;
        HostRouting r(logits.data(), BT, E, K, Routing{sigmoid, normalize, (float)scale});
        std::vector<int> rows_seen(BT * K, 0);
        for (long t = 0; t < BT; t++) {
            const float* l = &logits[t * E];
            // the chosen are the K largest, in decreasing order
            std::vector<int> order(E);
            for (int e = 0; e < E; e++) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
            // the score: the softmax over all E, or each one's sigmoid; P the scores over their sum
            double all = 0.0, chosen = 0.0, scores = 0.0;
            for (int e = 0; e < E; e++) all += exp(l[e]);
            auto score = [&](int e) { return sigmoid ? 1.0 / (1.0 + exp(-l[e])) : exp(l[e]) / all; };
            for (int e = 0; e < E; e++) scores += score(e);
            for (int k = 0; k < K; k++) chosen += score(order[k]);
            double gate_sum = 0.0;
            for (int k = 0; k < K; k++) {
                CHECK(r.expert[t * K + k] == order[k]);
                double p = score(order[k]);
                CHECK(r.gate[t * K + k] == Approx((normalize ? p / chosen : p) * scale).epsilon(1e-6));
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
            CHECK(gate_sum == Approx((normalize ? 1.0 : chosen) * scale).epsilon(1e-6));
            CHECK(fabs(chosen - 1.0) > 1e-3);  // so that the two cases differ
            for (int e = 0; e < E; e++) CHECK(r.probs[t * E + e] == Approx(score(e) / scores).epsilon(1e-6));
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
}

TEST_CASE("capacity: an expert takes the first ceil(F·K·T/E) of a sequence's assignments in token, then slot, order; "
          "the dropped get no row, and the combine, its spread and the gates' gradients leave them out",
          "[moe]") {
    // 2 sequences of 4 tokens, 2 slots each, 3 experts; F = 0.75: ceil(0.75·2·4/3) = 2 per expert and sequence
    const int B = 2, T = 4, K = 2, E = 3;
    CHECK(expert_capacity(0.75f, K, E, T) == 2);
    CHECK(expert_capacity(1.0f, 8, 128, 4096) == 256);  // Qwen3-30B-A3B's even share at T=4096
    // each expert's third assignment in a sequence is dropped: sequence 0's expert 0 at token 2 and expert 1 at
    // token 3, sequence 1's expert 2 at token 2 and expert 1 at token 3
    std::vector<int> choices = {0, 1, 0, 2, 0, 1, 1, 2,
                                2, 1, 2, 0, 1, 2, 1, 0};
    std::vector<int> keep(B * T * K);
    within_capacity<float>(keep.data(), choices.data(), B, T, K, E, 2, nullptr);
    CHECK(keep == std::vector<int>{1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1});
    // the dispatch order of the kept: by expert, then token; the dropped have no row
    HostRouting r;
    r.expert = choices;
    r.dispatch(B * T, E, K, keep.data());
    CHECK(r.dispatched == 12);
    CHECK(r.send_counts == std::vector<int>{4, 4, 4});
    for (long tk = 0; tk < B * T * K; tk++) CHECK((r.row_of[tk] == -1) == !keep[tk]);
    CHECK(r.token_of_row == std::vector<int>{0, 1, 5, 7, 0, 2, 4, 6, 1, 3, 4, 5});
    // a token's output sums its kept slots alone; the spread and the gates' gradients skip the dropped
    const int C = 3;
    Rng rng(5);
    std::vector<float> rows(r.dispatched * C), gate(B * T * K), dout(B * T * C);
    for (float& x : rows) x = rng.normal(0.0f, 1.0f);
    for (float& x : gate) x = rng.uniform();
    for (float& x : dout) x = rng.normal(0.0f, 1.0f);
    std::vector<float> out(B * T * C), spread(r.dispatched * C, 7.0f), dgate(B * T * K, 7.0f);
    moe_combine(out.data(), rows.data(), r.row_of.data(), gate.data(), B * T, K, C);
    moe_spread(spread.data(), dout.data(), r.row_of.data(), gate.data(), B * T, K, C);
    moe_gate_grads(dgate.data(), dout.data(), rows.data(), r.row_of.data(), B * T, K, C);
    for (long t = 0; t < B * T; t++)
        for (int c = 0; c < C; c++) {
            double want = 0.0;
            for (int k = 0; k < K; k++)
                if (keep[t * K + k]) want += gate[t * K + k] * rows[r.row_of[t * K + k] * C + c];
            CHECK(out[t * C + c] == Approx(want).margin(1e-6));
        }
    for (long tk = 0; tk < B * T * K; tk++) {
        double want = 0.0;
        for (int c = 0; c < C && keep[tk]; c++) {
            CHECK(spread[r.row_of[tk] * C + c] == gate[tk] * dout[tk / K * C + c]);
            want += dout[tk / K * C + c] * rows[r.row_of[tk] * C + c];
        }
        CHECK(dgate[tk] == Approx(want).margin(1e-6));
    }
    for (float x : spread) CHECK(x != 7.0f);  // every row written, none twice over a dropped slot's
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
    CHECK((h[10] == 0 && h[11] == 0 && read.expert_size == 0 && read.norm_topk));
    // the log: the aux loss on every step line (near α·L = 0.02 for a router that starts balanced), and each
    // layer's expert load on the first step
    CHECK(run.find("| aux 0.02") != std::string::npos);
    std::string log = read_file(moe_dir + "/main.log");
    CHECK(log.find("s:0 load:") != std::string::npos);
    CHECK(log.find(" aux:0.02") != std::string::npos);
}

TEST_CASE("experts of their own width (x<H>), gates not renormalized (u), dense layers first (n<N>) and off the "
          "sparse step (s<S>), shared experts (y<H>, z<H> gated), sigmoid scores (i) and scaled gates (r<F>), q, k, v "
          "biases (b): descriptors, parameter counts, "
          "coordinates, the header slots of both file formats, and the published Qwen3-30B-A3B and Mixtral 8x7B",
          "[moe]") {
    GPTConfig c = parse_model_descriptor("d2c48h4t32v301e4k2x40u");
    CHECK((c.expert_size == 40 && !c.norm_topk && c.mlp_hidden() == 40 && c.hidden() == 192));
    GPTConfig wide = parse_model_descriptor("d2c48h4t32v301e4k2");
    size_t C = 48;
    // each expert: fcw H×C, fcb H, fcprojw C×H, fcprojb C
    auto expert = [&](size_t H) { return 2 * C * H + H + C; };
    CHECK(num_parameters(wide) - num_parameters(c) == 2 * 4 * (expert(192) - expert(40)));
    GPTConfig q = parse_model_descriptor("q2c48h4g2d16f88t32v301e4k2x40");
    CHECK((q.mlp_hidden() == 40 && q.hidden() == 88 && q.norm_topk));
    // dense layers: the first n, and those off the step s; each of its own MLP of the model's width
    GPTConfig mixed = parse_model_descriptor("d4c48h4t32v301e4k2x40n1s2");
    CHECK((mixed.dense_layers == 1 && mixed.sparse_step == 2 && mixed.count_dense_layers() == 2));
    CHECK((!mixed.sparse_layer(0) && mixed.sparse_layer(1) && !mixed.sparse_layer(2) && mixed.sparse_layer(3)));
    CHECK(num_parameters(mixed) == gpt2_parameter_count(mixed));
    CHECK(num_parameters(c) == gpt2_parameter_count(c));
    // a Qwen3 dense layer holds no router (E·C) and no experts (E of 3·C·40), but gate, up and down of 88
    GPTConfig qmixed = parse_model_descriptor("q4c48h4g2d16f88t32v301e4k2x40n1s2");
    GPTConfig qsparse = parse_model_descriptor("q4c48h4g2d16f88t32v301e4k2x40");
    CHECK(num_parameters(qmixed) == num_parameters(qsparse) - 2 * (4 * C + 4 * 3 * C * 40) + 2 * 3 * C * 88);
    // a shared expert in each sparse layer: DeepSeek's (GPT-2's MLP of 24, with its biases), Qwen2-MoE's gated one
    // (3·C·56 and the gate's C) with q, k and v biases (C + 2·KV·hd a layer)
    // (and DeepSeek-V3's router: sigmoid scores, the gates scaled by 2.5)
    GPTConfig ds = parse_model_descriptor("d4c48h4t32v301e4k2x40n1s2y24ir2.5");
    CHECK((ds.shared_size == 24 && !ds.shared_gate && num_parameters(ds) == gpt2_parameter_count(ds)));
    CHECK((ds.sigmoid_scores && ds.routed_scale == 2.5f && !mixed.sigmoid_scores && mixed.routed_scale == 1.0f));
    CHECK(num_parameters(ds) == num_parameters(mixed) + 2 * (2 * C * 24 + 24 + C));
    GPTConfig q2 = parse_model_descriptor("l4c48h4g2f88t32v301be4k2x40un1z56");
    GPTConfig q2plain = parse_model_descriptor("l4c48h4g2f88t32v301e4k2x40un1");
    CHECK((q2.shared_size == 56 && q2.shared_gate && q2.attention_bias && !q2plain.attention_bias));
    CHECK(num_parameters(q2) == num_parameters(q2plain) + 4 * (C + 2 * 2 * 12) + 3 * (3 * C * 56 + C));
    // every element's coordinates name a block that exists, and lead back to it
    for (const GPTConfig& m : {mixed, qmixed, ds, q2})
        for (size_t i = 0; i < num_parameters(m); i += 61) {
            ParamCoord p = param_coord(m, i);
            CHECK(param_block_exists(m, p.tensor, p.layer, p.expert));
            CHECK(param_offset(m, p) == i);
        }
    TempDir out;
    for (const GPTConfig& m : {c, q, mixed, qmixed, ds, q2}) {
        std::vector<float> params(num_parameters(m));
        gpt_init_random(m, params.data(), 7);
        std::string path = out / "model.bin";
        gpt_save_params(m, params.data(), path);
        int version;
        GPTConfig read = read_model_header(path, &version);
        CHECK(same_model_shape(read, m));
        CHECK((read.expert_size == 40 && read.norm_topk == m.norm_topk && read.dense_layers == m.dense_layers &&
               read.sparse_step == m.sparse_step && read.shared_size == m.shared_size &&
               read.shared_gate == m.shared_gate && read.attention_bias == m.attention_bias &&
               read.sigmoid_scores == m.sigmoid_scores && read.routed_scale == m.routed_scale));
        std::vector<float> back(params.size());
        gpt_load_params(read, back.data(), path);
        CHECK(back == params);
    }
    for (const char* bad : {"d2c48h4x40", "d2c48h4u", "q2c48h4e1k1x40", "l2c48h4e4k2x0", "d2c48h4n1", "d2c48h4e4k2n2",
                            "d2c48h4e4k2s3", "q2c48h4e4k2s0", "d2c48h4y24", "l2c48h4z24", "d2c48h4e4k2b",
                            "l2c48h4e4k2z0", "d2c48h4i", "d2c48h4r2", "d2c48h4e4k2r0", "d2c48h4e4k2r-1"}) {
        CommandResult r = single(strfmt("-e %s --plan", bad));
        INFO(bad << ": " << r.output);
        CHECK(r.status != 0);
        CHECK(lines_of(r.output).size() == 1);
    }
    // the published totals: Qwen3-30B-A3B 30,532,122,624 (its model card's 30.5B), Mixtral 8x7B 46,702,792,704
    // (46.7B); per layer attention, the router and E experts of three C×H matrices, and the embeddings
    GPTConfig qwen = parse_model_descriptor("qwen3-30b-a3b"), mixtral = parse_model_descriptor("mixtral-8x7b");
    CHECK((qwen.num_experts == 128 && qwen.top_k == 8 && qwen.mlp_hidden() == 768 && qwen.kv_heads() == 4));
    CHECK(num_parameters(qwen) == 30532122624ull);  // both vocabs are multiples of 128: no padding rows
    CHECK((mixtral.num_experts == 8 && mixtral.top_k == 2 && mixtral.mlp_hidden() == 14336 && mixtral.kv_heads() == 8));
    CHECK(num_parameters(mixtral) == 46702792704ull);
}

// One layout of a run against the single-rank one: `ranks` ranks with `flags`, b sequences a micro-batch
struct MoeLayout {
    const char* name;
    int ranks, b;
    const char* flags;
};

// Each layout's EQUIVALENCE_STEPS steps of `model`, `tokens` a step, with `common` flags, against `reference` (the single-rank
// run's losses), every loss within 1e-5; then check(name, dir, output)
template <typename Check>
void check_moe_layouts(const Data& data, const TempDir& out, const char* model, int tokens, const std::string& common,
                       const std::map<std::string, double>& reference, std::initializer_list<MoeLayout> layouts,
                       Check check) {
    for (const MoeLayout& l : layouts) {
        INFO(l.name);
        std::string dir = out / l.name, run;
        if (!train_ok(l.ranks, data.flags(l.b, tokens, EQUIVALENCE_STEPS, model) + common + l.flags, dir, &run)) continue;
        check_close(losses(dir), reference, 1e-5);
        check(std::string(l.flags), dir, run);
    }
}

TEST_CASE("--ep with dp, ZeRO-1 and ZeRO-3, tp, cp, pp (1F1B, zero-bubble, DualPipeV) and recomputation, each with "
          "gradient accumulation, on dense layers among the sparse ones and shared experts (DeepSeek's on GPT-2 with its "
          "router's sigmoid scores, scaled gates and selection bias; Qwen2-MoE's gated one on a Llama), gives the "
          "single-rank run's losses over 10 steps; the all-to-all bytes (and under pp the p2p bytes) equal the formula",
          "[moe]") {
    Data data;
    for (const char* model : {LAYOUT_MODEL, LLAMA_LAYOUT_MODEL}) {
    INFO(model);
    TempDir out;
    std::string bias = parse_model_descriptor(model).router_bias ? " --moe-bias-rate 0.02" : "";
    // the same global batch of 8 sequences: 4 micro-batches of 2 on one rank
    REQUIRE(single_ok(data.flags(2, 128, EQUIVALENCE_STEPS, model) + bias, out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    auto counted = [](const std::string& flags, const std::string&, const std::string& run) {
        if (flags.find("--ep") != std::string::npos) require_ep_counted_equals_formula(run);
        // the ring, and the aux statistics summed over the cp group
        if (flags.find("--cp") != std::string::npos) require_cp_counted_equals_formula(run, 2);
        // the step's p2p bytes alone: the experts' statistics, reduced over the stages after the step for its line,
        // are not the step's traffic
        if (flags.find("--pp") != std::string::npos) require_pp_counted_equals_formula(run);
        // both reduction groups (dp·cp, and the experts' replicas) against the formula off the pipeline, whose
        // tied embeddings travel on a group of their own
        if (flags.find("--pp") == std::string::npos) require_counted_equals_formula(run);
    };
    check_moe_layouts(data, out, model, 128, bias, reference,
                      {{"ep2", 2, 2, " --ep 2"}, {"ep4", 4, 1, " --ep 4"}, {"ep2_dp4", 4, 1, " --ep 2"},
                       {"ep2_z1", 2, 2, " --ep 2 -z 1"}, {"ep2_z3", 2, 2, " --ep 2 -z 3"}, {"ep2_tp2", 4, 2, " --ep 2 --tp 2"},
                       {"ep2_tp2_r1", 4, 2, " --ep 2 --tp 2 -r 1"}, {"ep2_pp2", 4, 1, " --ep 2 --pp 2"},
                       {"ep2_pp2_zb", 4, 1, " --ep 2 --pp 2 --pp-schedule zb -z 1"},
                       {"ep2_dualpipev", 4, 1, " --ep 2 --pp 2 --pp-schedule dualpipev"}, {"ep2_cp2", 4, 2, " --ep 2 --cp 2"},
                       {"ep2_r2", 2, 2, " --ep 2 -r 2"}, {"ep2_dp4_z2_r1", 4, 1, " --ep 2 -z 2 -r 1"},
                       {"dp2_replicated", 2, 2, ""}},
                      counted);
    }
}

// a field of main.log's line for a training step (" aux:", the aux loss to 6 decimals; " drop:"), NAN when it
// has none
double logged(const std::string& dir, int step, const std::string& field) {
    for (const std::string& line : lines_of(read_file(dir + "/main.log"))) {
        int s;
        size_t at = line.find(field);
        if (sscanf(line.c_str(), "s:%d trl:", &s) == 1 && s == step && at != std::string::npos)
            return atof(line.c_str() + at + field.size());
    }
    return NAN;
}
double aux_at(const std::string& dir, int step) { return logged(dir, step, " aux:"); }

// The batch scope's f is the share over the step's micro-batches so far on every dp·cp rank, so a layout equals
// the single-rank run that puts the same sequences in each micro-batch: dp·b of them (the loader deals
// micro-step m's rows (m·dp + r)·b onwards to rank r). Its dp bytes add the counts' all-reduce (E doubles per
// sparse layer and micro-batch), which the formula counts.
TEST_CASE("--moe-aux-scope batch (Megatron-LM's global aux loss) under ep with dp, ZeRO-3, tp, cp, pp (1F1B, "
          "DualPipeV) and recomputation gives the single-rank run's losses over 10 steps with as many sequences per "
          "micro-batch; its aux differs from the per-sequence one; the dp bytes equal the formula",
          "[moe]") {
    Data data;
    TempDir out;
    const std::string flags = " --moe-aux-scope batch --moe-aux 0.05";
    // 16 sequences a step: 4 micro-batches of 4 on one rank (DualPipeV on 2 stages wants 4)
    REQUIRE(single_ok(data.flags(4, 256, EQUIVALENCE_STEPS, LLAMA_LAYOUT_MODEL) + flags, out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    REQUIRE(single_ok(data.flags(4, 256, EQUIVALENCE_STEPS, LLAMA_LAYOUT_MODEL) + " --moe-aux 0.05", out / "sequence"));
    // the same sequences, the same first cross-entropy, another objective: the aux loss and the norms differ
    std::map<std::string, double> per_sequence = losses(out / "sequence");
    CHECK(per_sequence.at("trl 0") == reference.at("trl 0"));
    CHECK(per_sequence.at("norm 0") != reference.at("norm 0"));
    CHECK(aux_at(out / "sequence", 0) != aux_at(out / "one", 0));
    check_moe_layouts(data, out, LLAMA_LAYOUT_MODEL, 256, flags, reference,
                      {{"ep2", 2, 2, " --ep 2"}, {"ep4", 4, 1, " --ep 4"}, {"ep2_z3", 2, 2, " --ep 2 -z 3"},
                       {"ep2_tp2", 4, 2, " --ep 2 --tp 2"}, {"ep2_cp2", 4, 2, " --ep 2 --cp 2"}, {"ep2_pp2", 4, 2, " --ep 2 --pp 2"},
                       {"ep2_dualpipev", 4, 2, " --ep 2 --pp 2 --pp-schedule dualpipev"}, {"dp2_r2", 2, 2, " -r 2"}},
                      [&](const std::string& layout, const std::string& dir, const std::string& run) {
                          CHECK(std::fabs(aux_at(dir, 0) - aux_at(out / "one", 0)) <= 2e-6);
                          if (layout.find("--pp") == std::string::npos) require_counted_equals_formula(run);
                          if (layout.find("--cp") != std::string::npos) require_cp_counted_equals_formula(run, 2);
                      });
}

// Capacity is decided per sequence in token order, so every layout drops what one rank drops: cp gathers a
// sequence's choices from its ranks, ep and dp decide for their own sequences, tp ranks route alike.
TEST_CASE("--moe-capacity 1 under ep with dp, ZeRO-3, tp, cp (zig-zag and contiguous), pp (zero-bubble, DualPipeV) "
          "and recomputation drops the single-rank run's assignments and gives its losses over 10 steps",
          "[moe]") {
    Data data;
    TempDir out;
    const std::string flags = " --moe-capacity 1 --moe-bias-rate 0.02";
    REQUIRE(single_ok(data.flags(2, 128, EQUIVALENCE_STEPS, LAYOUT_MODEL) + flags, out / "one"));
    std::map<std::string, double> reference = losses(out / "one");
    double dropped = 0.0;
    for (int step = 0; step < EQUIVALENCE_STEPS; step++) dropped += logged(out / "one", step, " drop:");
    CHECK(dropped > 0.0);  // ceil(1·2·16/4) = 8 of a sequence's 32 assignments per expert: the routing overflows
    REQUIRE(single_ok(data.flags(2, 128, EQUIVALENCE_STEPS, LAYOUT_MODEL) + " --moe-bias-rate 0.02", out / "dropless"));
    CHECK(losses(out / "dropless").at("trl 0") != reference.at("trl 0"));
    check_moe_layouts(data, out, LAYOUT_MODEL, 128, flags, reference,
                      {{"ep2", 2, 2, " --ep 2"}, {"ep4", 4, 1, " --ep 4"}, {"ep2_z3", 2, 2, " --ep 2 -z 3"},
                       {"ep2_tp2", 4, 2, " --ep 2 --tp 2"}, {"ep2_cp2", 4, 2, " --ep 2 --cp 2"},
                       {"cp2_contiguous", 2, 2, " --cp 2 --cp-split contiguous"},
                       {"ep2_pp2_zb", 4, 1, " --ep 2 --pp 2 --pp-schedule zb -z 1"},
                       {"ep2_dualpipev", 4, 1, " --ep 2 --pp 2 --pp-schedule dualpipev"}, {"ep2_r2", 2, 2, " --ep 2 -r 2"}},
                      [&](const std::string& layout, const std::string& dir, const std::string& run) {
                          for (int step = 0; step < EQUIVALENCE_STEPS; step++)
                              CHECK(logged(dir, step, " drop:") == logged(out / "one", step, " drop:"));
                          // the ring, the aux statistics and the choices gathered over the cp group
                          if (layout.find("--cp") != std::string::npos) require_cp_counted_equals_formula(run, 2);
                      });
}

TEST_CASE("--plan predicts the ledger of every rank with experts, every layer sparse or dense layers among them: "
          "ep with dp, ZeRO, tp, cp, pp (1F1B and zb) and recomputation, dropless and under a capacity", "[moe]") {
    for (const char* model : {"d2c48h4t32v301e4k2", LAYOUT_MODEL, LLAMA_LAYOUT_MODEL}) {
    INFO(model);
    GPTConfig c = parse_model_descriptor(model);
    if (!c.llama()) CHECK(gpt2_parameter_count(c) == num_parameters(c));
    struct Layout {
        int ep, dp, tp, cp, pp;
        PPKind kind;
    };
    for (Layout l : {Layout{1, 1, 1, 1, 1, PPKind::OneFOneB}, Layout{2, 2, 1, 1, 1, PPKind::OneFOneB},
                     Layout{4, 4, 1, 1, 1, PPKind::OneFOneB}, Layout{2, 4, 1, 1, 1, PPKind::OneFOneB},
                     Layout{2, 2, 2, 1, 1, PPKind::OneFOneB}, Layout{2, 2, 1, 2, 1, PPKind::OneFOneB},
                     Layout{2, 2, 1, 1, 2, PPKind::OneFOneB}, Layout{2, 2, 1, 1, 2, PPKind::ZeroBubble},
                     Layout{1, 2, 1, 1, 2, PPKind::ZeroBubble}})
        for (int zero : {0, 1, 3})
            for (int recompute : {0, 1, 2})
                for (float capacity : {0.0f, 1.25f})
                for (int stage = 0; stage < l.pp; stage++) {
                    if (zero >= 2 && l.kind == PPKind::ZeroBubble && l.pp > 1) continue;  // refused: zb takes ZeRO-0/1
                    INFO("ep " << l.ep << ", dp " << l.dp << ", tp " << l.tp << ", cp " << l.cp << ", pp " << l.pp << " ("
                               << pp_schedule_name(l.kind) << ") stage " << stage << ", ZeRO-" << zero << ", -r " << recompute
                               << ", capacity " << capacity);
                    const int m_micro = 4, B = 2, T = 16;
                    PPSpec pp{l.pp, stage, 1, l.kind};
                    bool split = l.pp > 1 && l.kind == PPKind::ZeroBubble;
                    int slots = l.pp > 1 ? Pipeline<float>::slots_needed(pp_schedule(l.kind, l.pp, m_micro, 1)[stage], pp) : 1;
                    // only the sizes and ranks of the groups matter until a collective runs
                    Comm group, replicas, ep, stages;
                    group.size = l.dp * l.cp, replicas.size = l.dp / l.ep * l.cp, ep.size = l.ep, stages.size = l.pp;
                    GPT m;
                    ModelLayout layout;
                    layout.own = DataParallel<float>::model_buffers(zero);
                    layout.tp = TPSpec{l.tp, 0, l.tp > 1}, layout.cp = CPSpec{l.cp, 0, CPSplit::ZigZag};
                    layout.ep = l.ep, layout.capacity = capacity;
                    if (l.pp > 1) layout.part = stage_part(c, pp);
                    layout.slots = slots, layout.split_backward = split, layout.recompute = recompute;
                    gpt_allocate(m, c, B, T, layout);
                    DataParallel dpr(m, group, zero, 1000, StageLinks{l.pp > 1 ? &stages : nullptr, nullptr},
                                     ExpertLinks{l.ep > 1 ? &replicas : nullptr, &ep});
                    ParallelPlan par{l.dp, zero, 1000, l.pp > 1 ? m_micro : 1, l.tp, l.tp > 1, recompute, l.cp};
                    if (l.pp > 1) par.pp = pp;
                    par.ep = l.ep, par.capacity = capacity;
                    if (!c.llama()) CHECK(gpt2_parameter_count_per_rank(c, l.tp, planned_part(c, par), l.ep) == m.num_parameters);
                    MemoryPlan plan = plan_memory(c, B, T, omp_get_max_threads(), par);
                    for (int i = 0; i < MEM_CATEGORIES; i++) {
                        INFO(mem_category_name(i));
                        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                    }
                }
    }
    GPTConfig c = parse_model_descriptor("d2c48h4t32v301e4k2");

    // the command line prints that plan, the model with its experts and the layout's ep
    Data data;
    CommandResult r = single(data.flags(2, 128, 1, MOE_MODEL) + " -z 1 --plan --world 4 --ep 2");
    INFO(r.output);
    REQUIRE(r.status == 0);
    ParallelPlan par{4, 1, (size_t)(0.06f * 1048576.0 / 4.0), 1, 1, false};
    par.ep = 2;
    MemoryPlan plan = plan_memory(c, 2, 16, 1, par);
    for (int i = 0; i < MEM_CATEGORIES; i++) {
        INFO(mem_category_name(i));
        CHECK(plan_category_bytes(r.output, mem_category_name(i)) == (long long)plan.bytes[i]);
    }
    CHECK(r.output.find(strfmt("E=4 K=2: %zu parameters", gpt2_parameter_count(c))) != std::string::npos);
    CHECK(r.output.find("ep=2 (each expert on 2 ranks)") != std::string::npos);
    CHECK(line_value(r.output, "expert-parallel communication per step per rank, with balanced routing: ") ==
          planned_ep_comm_bytes(c, par, 2, 16, Device::CPU));
}

TEST_CASE("routing on the GPU: the CPU's choices, capacity, dispatch order and permutation to the bit",
          "[moe][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    // softmax and sigmoid scores, renormalized or not and scaled, with a selection bias, under a capacity; a
    // micro-batch of several sort chunks and sequences that cross them; Qwen3-30B-A3B's router (128 experts, top 8)
    for (const RoutingCase& c : {RoutingCase{2, 777, 8, 2, Routing{}, false, 0.0f, 1},
                                 RoutingCase{3, 1000, 8, 2, Routing{}, false, 1.25f, 2},
                                 RoutingCase{2, 513, 16, 4, Routing{true, true, 2.5f}, true, 1.0f, 3},
                                 RoutingCase{1, 300, 5, 3, Routing{true, false, 1.0f}, false, 0.0f, 4},
                                 RoutingCase{1, 4096, 128, 8, Routing{}, false, 1.25f, 5}}) {
        INFO("B " << c.B << ", T " << c.Tl << ", E " << c.E << ", K " << c.K << ", capacity " << c.capacity);
        std::vector<std::string> differences = routing_differences(c);
        std::string said;
        for (const std::string& d : differences) said += d + "; ";
        INFO(said);
        CHECK(differences.empty());
    }
}

TEST_CASE("on the GPU, --plan --device cuda predicts the ledger of every rank with experts, with ep, tp and ZeRO",
          "[moe][cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    GPTConfig c = parse_model_descriptor("d2c128h2t32v301e4k2");  // head size 64, which the GPU kernels take
    for (int ep : {1, 2})
        for (int tp : {1, 2})
            for (int zero : {0, 1, 3})
                for (int recompute : {0, 2}) {
                    INFO("ep " << ep << " (dp 2), tp " << tp << " (sp), ZeRO-" << zero << ", -r " << recompute);
                    Comm group, replicas, ep_group;  // only the sizes matter until a collective runs
                    group.size = 2, replicas.size = 2 / ep, ep_group.size = ep;
                    GPTCuda m;
                    ModelLayout layout;
                    layout.own = DataParallel<bf16>::model_buffers(zero);
                    layout.tp = TPSpec{tp, 0, tp > 1}, layout.ep = ep, layout.recompute = recompute;
                    gpt_allocate(m, c, 2, 32, layout);
                    DataParallel<bf16> dpr(m, group, zero, 1000, StageLinks{}, ExpertLinks{ep > 1 ? &replicas : nullptr, &ep_group});
                    ParallelPlan par{2, zero, 1000, 1, tp, tp > 1, recompute};
                    par.ep = ep;
                    MemoryPlan plan = plan_memory(c, 2, 32, 1, par, Device::CUDA);
                    for (int i = 0; i < MEM_CATEGORIES; i++) {
                        INFO(mem_category_name(i));
                        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
                    }
                }
}

TEST_CASE("the pipeline's split weighs dense and sparse layers by the weights a token passes through; a model of "
          "one kind of layer keeps the even split", "[moe][pp]") {
    // dense layers 0 and 1 (an MLP of 4C = 192: 2·48·192) before six sparse ones (router 4·48, 2 experts of 40:
    // 2·2·48·40), each with attention's 4·48²: 27648 and 17088 a layer, 157824 in all
    GPTConfig c = parse_model_descriptor("d8c48h4t32v301e4k2x40n2");
    std::vector<double> weights = layer_token_weights(c);
    CHECK((weights[0] == 27648 && weights[1] == 27648 && weights[2] == 17088 && weights[7] == 17088));
    auto layers = [](const GPTConfig& m, int pp, int rank) {
        ModelPart part = stage_part(m, PPSpec{pp, rank, 1, PPKind::OneFOneB});
        return std::make_pair(part.chunk_first[0], part.chunk_layers[0]);
    };
    // 4 + 4 would put 89472 on the first stage; 3 + 5 puts 72384 and 85440, the least largest there is
    CHECK(layers(c, 2, 0) == std::make_pair(0, 3));
    CHECK(layers(c, 2, 1) == std::make_pair(3, 5));
    // four stages: two each would put 55296 on the first; three sparse layers (51264) are the least largest there
    // is, and filling each stage up to it from the front gives d | d s | s s s | s s (27648, 44736, 51264, 34176)
    CHECK(layers(c, 4, 0) == std::make_pair(0, 1));
    CHECK(layers(c, 4, 1) == std::make_pair(1, 2));
    CHECK(layers(c, 4, 2) == std::make_pair(3, 3));
    CHECK(layers(c, 4, 3) == std::make_pair(6, 2));
    // every layer sparse: the even split, the extra layers first
    GPTConfig sparse = parse_model_descriptor("d8c48h4t32v301e4k2x40");
    CHECK(layers(sparse, 3, 0) == std::make_pair(0, 3));
    CHECK(layers(sparse, 3, 1) == std::make_pair(3, 3));
    CHECK(layers(sparse, 3, 2) == std::make_pair(6, 2));
}

TEST_CASE("the selection bias moves by γ·sign(mean load − load) per layer, by hand; a layer no token reached stays",
          "[moe]") {
    MixtureOfExperts<float> moe;
    moe.E = 4, moe.settings.bias_rate = 0.25f;
    moe.bias = {0.5f, -1.0f, 0.0f, 2.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // 3 layers of 4
    // layer 0: mean 5, loads 1 9 5 5; layer 1: all at the mean; layer 2: none (a dense layer)
    std::vector<double> load = {1, 9, 5, 5, 3, 3, 3, 3, 0, 0, 0, 0};
    moe.balance(load);
    std::vector<float> expected = {0.75f, -1.25f, 0.0f, 2.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    CHECK(moe.bias == expected);
    // the routing chooses by score + bias and gates by the score: a large bias on the weakest expert picks it
    const int E = 4, K = 1;
    std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f}, bias = {0.0f, 0.0f, 0.0f, 5.0f};
    HostRouting r(logits.data(), 1, E, K, Routing{true, false, 1.0f}, bias.data());
    CHECK(r.expert[0] == 3);
    CHECK(r.gate[0] == Approx(1.0 / (1.0 + exp(1.0))).epsilon(1e-6));
}

TEST_CASE("the ep byte formula for balanced routing, by hand", "[moe]") {
    // d2c48h4e4k2 at B=2 T=16, ep 2, 3 micro-steps: per layer and micro-step half of the 2·32 = 64 rows go to
    // the other rank and as many come back, each crossing twice in forward and twice in backward as 48 fp32
    // values: 2·64·48·4 = 24,576 bytes, plus 2 counts of 4 bytes; over 2 layers and 3 micro-steps, with the
    // experts' norm (8 bytes): 6·24,584 + 8 = 147,512
    GPTConfig c = parse_model_descriptor(MOE_MODEL);
    ParallelPlan par;
    par.dp = 2, par.ep = 2, par.accumulation = 3;
    CHECK(planned_ep_comm_bytes(c, par, 2, 16, Device::CPU) == 147512.0);
    CHECK(planned_ep_comm_bytes(c, par, 2, 16, Device::CUDA) == 6 * (12288.0 + 8) + 8);  // bf16 rows
    par.ep = 1;
    CHECK(planned_ep_comm_bytes(c, par, 2, 16, Device::CPU) == 0.0);
}

TEST_CASE("a run with experts under ep 2 resumes bit-exactly, and so does one whose router's selection bias moves "
          "(the bias in the checkpoint's model, not in AdamW's state)", "[moe]") {
    Data data;
    for (std::string model : {std::string(MOE_MODEL), std::string(MOE_MODEL) + "ia"}) {
        INFO(model);
        TempDir out;
        GPTConfig c = parse_model_descriptor(model);
        std::string bias = c.router_bias ? " --moe-bias-rate 0.02" : "";
        check_resumes_bit_exactly(2, data.flags(2, 64, 6, model) + bias + " --ep 2 -z 1", out / "whole",
                                  out / "resumed", num_parameters(c));
    }
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
    refused("d2c48h4t32v301", " --moe-aux-scope batch", {"--moe-aux-scope batch", "no experts"});
    refused(MOE_MODEL, " --moe-aux-scope global", {"--moe-aux-scope global", "sequence, batch"});
    refused("d2c48h4t32v301", " --moe-capacity 1.25", {"--moe-capacity 1.25", "no experts"});
}

}  // namespace test_moe

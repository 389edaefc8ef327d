// Tests of --plan: plan_memory reads the list of buffers gpt_allocate walks, so the two agree by construction;
// what is tested is the construction: that the Ledger recorded the planned list, buffer by buffer, that nothing
// is allocated beside it (the Ledger's categories equal the plan's to the byte), and that the list's sizes are
// right, against hand counts written out independently of both (GPT-2 124M's parameters and d12's activations and
// scratch; the ring's, the experts' and ZeRO's buffers). GPT-2's closed-form parameter count must equal the allocated
// parameter count, and `train_gpt --plan` must print the plan.
#include <omp.h>

#include <map>
#include <regex>
#include <sstream>

#include "llmc/gpt.cuh"
#include "llmc/plan.h"
#include "parameter_counts.h"
#include "test_helpers.h"

namespace test_plan {

// allocates the model for (B, T) with the given thread count and compares the plan with its ledger
void check_plan_against_ledger(const std::string& descriptor, int B, int T, int threads) {
    INFO("-e " << descriptor << " -b " << B << " -t " << T << ", " << threads << " threads");
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    GPTConfig config = parse_model_descriptor(descriptor);
    GPT m;
    gpt_allocate(m, config, B, T);
    omp_set_num_threads(saved);
    MemoryPlan plan = plan_memory(config, B, T, threads);
    for (int i = 0; i < MEM_CATEGORIES; i++) {
        INFO("category " << mem_category_name(i));
        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
    }
    CHECK(plan.total() == m.ledger.total());
    // the buffers the plan read are those the ledger allocated, in order
    std::vector<LedgerEntry> planned;
    for (const PlannedBuffer& b : planned_buffers(config, B, T, threads, ParallelPlan{}, Device::CPU))
        if (!b.shares) planned.push_back({b.name, b.category, b.bytes});
    REQUIRE(planned.size() == m.ledger.entries.size());
    for (size_t i = 0; i < planned.size(); i++) {
        INFO("buffer " << i << ": " << planned[i].name);
        CHECK(std::string(planned[i].name) == m.ledger.entries[i].name);
        CHECK(planned[i].category == m.ledger.entries[i].category);
        CHECK(planned[i].bytes == m.ledger.entries[i].bytes);
    }
    CHECK(gpt2_parameter_count(config) == m.num_parameters);
    // everything is fp32 on the CPU: parameters, gradients and two AdamW moments are 16 bytes per parameter
    CHECK(m.ledger.bytes[MEM_PARAMS] + m.ledger.bytes[MEM_GRADS] + m.ledger.bytes[MEM_OPTIMIZER] == 16 * m.num_parameters);
}

// the lines of `train_gpt --plan`: "  <category>   <bytes> bytes   <MiB> MiB", the last one named "total"
std::map<std::string, size_t> parse_plan_output(const std::string& output) {
    std::map<std::string, size_t> bytes;
    std::istringstream in(output);
    std::string line;
    const std::regex row(R"(^\s+(\S.*?)\s+(\d+) bytes\s+[\d.]+ MiB\s*$)");
    while (std::getline(in, line)) {
        std::smatch m;
        if (std::regex_match(line, m, row)) bytes[m[1]] = std::stoull(m[2]);
    }
    return bytes;
}

// runs `train_gpt --plan` with OMP_NUM_THREADS set, so that its scratch matches plan_memory's for `threads`
CommandResult run_plan(const std::string& flags, int threads) {
    INFO("./train_gpt not found: build it with `make train_gpt` (`make test` does) and run the tests from the "
         "repo root");
    REQUIRE(file_exists("./train_gpt"));
    return run_command(strfmt("OMP_NUM_THREADS=%d timeout 60 ./train_gpt --plan %s", threads, flags.c_str()));
}

void check_plan_command(const std::string& descriptor, int B, int T, int threads) {
    std::string flags = strfmt("-e %s -b %d -t %d", descriptor.c_str(), B, T);
    CommandResult r = run_plan(flags, threads);
    INFO("./train_gpt --plan " << flags << " with " << threads << " threads: exit status " << r.status << ", output:\n"
                               << r.output);
    REQUIRE(r.status == 0);
    GPTConfig config = parse_model_descriptor(descriptor);
    MemoryPlan plan = plan_memory(config, B, T, threads);
    std::map<std::string, size_t> printed = parse_plan_output(r.output);
    REQUIRE(printed.count("total") == 1);
    CHECK(printed["total"] == plan.total());
    for (int i = 0; i < MEM_CATEGORIES; i++) {
        INFO("category " << mem_category_name(i));
        REQUIRE(printed.count(mem_category_name(i)) == 1);
        CHECK(printed[mem_category_name(i)] == plan.bytes[i]);
    }
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex(R"((\d+) parameters)")));
    CHECK(std::stoull(m[1]) == gpt2_parameter_count(config));
    // a plan, not a run
    CHECK(!std::regex_search(r.output, std::regex(R"(step +[0-9]+/)")));
    CHECK(r.output.find("train:") == std::string::npos);
}

TEST_CASE("plan_memory equals gpt_allocate's ledger, category by category", "[plan]") {
    struct Case {
        const char* model;
        int B, T;
    };
    const Case cases[] = {
        {"d1c16h2t32v300", 2, 8},
        {"d3c48h4t29v397", 3, 17},  // odd sizes: T < maxT, T prime, V padded from 397 to 512
        {"d3c48h4t29v397", 1, 29},  // T = maxT
        {"d2c64h2", 4, 64},         // the GPT-2 vocab and maxT 1024
    };
    for (const Case& c : cases)
        for (int threads : {omp_get_max_threads(), 1, 3}) check_plan_against_ledger(c.model, c.B, c.T, threads);
}

TEST_CASE("the model table counts llm.c's GPT-2 124M (d12): 124,475,904 with the padded vocab", "[plan]") {
    GPTConfig d12 = parse_model_descriptor("d12");
    REQUIRE(d12.num_layers == 12);
    REQUIRE(d12.channels == 768);
    REQUIRE(d12.num_heads == 12);
    REQUIRE(d12.max_seq_len == 1024);
    REQUIRE(d12.vocab_size == 50257);
    REQUIRE(d12.padded_vocab_size == 50304);
    // by hand: wte 50304·768 = 38,633,472; wpe 1024·768 = 786,432; per layer: ln1 1,536, qkv 768·2304 + 2304 =
    // 1,771,776, attention projection 768·768 + 768 = 590,592, ln2 1,536, fc 768·3072 + 3072 = 2,362,368, fc
    // projection 3072·768 + 768 = 2,360,064, in all 7,087,872, times 12 = 85,054,464; lnf 1,536
    const size_t hand = 38633472ull + 786432ull + 12ull * (1536 + 1771776 + 590592 + 1536 + 2362368 + 2360064) + 1536;
    CHECK(hand == 124475904ull);
    CHECK(num_parameters(d12) == 124475904ull);
    CHECK(gpt2_parameter_count(d12) == 124475904ull);
    // without the padding rows it is the familiar 124,439,808 of Hugging Face's gpt2
    GPTConfig unpadded = d12;
    unpadded.padded_vocab_size = 50257;
    CHECK(num_parameters(unpadded) == 124439808ull);
}

TEST_CASE("the GPU's dp and tp byte formulas equal the bytes counted on an H100", "[plan]") {
    // counted by the ranks of dev/gpu/verify.sh's mpi phase (2 ranks on one H100, 2026-11-23): d12 B=4 T=1024,
    // 4 micro-batches per step, the default 25 MiB buckets; gradients and activations move as bf16 there
    GPTConfig d12 = parse_model_descriptor("d12");
    const double counted_dp[4] = {248951824, 248951824, 373427728, 746855440};  // ZeRO-0..3, 2 micro-steps
    for (int zero = 0; zero <= 3; zero++) {
        ParallelPlan dp2;
        dp2.dp = 2, dp2.zero = zero, dp2.accumulation = 2;
        CHECK(planned_comm_bytes(d12, dp2, Device::CUDA) == counted_dp[zero]);
        CHECK(planned_comm_bytes(d12, dp2, Device::CPU) == 2 * counted_dp[zero] - 16);  // fp32 values, same scalars
    }
    ParallelPlan tp2;
    tp2.tp = 2, tp2.sp = true, tp2.accumulation = 4, tp2.recompute = 1;
    // counted there 1,260,137,480; sp now also gathers each layer's two layernorm outputs again in backward (each
    // rank keeps its rows of them): 4 micro-steps × 2 × 12 layers × (t-1)/t × 4096 rows × 768 bf16 more
    CHECK(planned_tp_comm_bytes(d12, tp2, 4, 1024, Device::CUDA) == 1260137480.0 + 4 * 2 * 12 * 0.5 * 4096 * 768 * 2);
}

TEST_CASE("plan_memory for d12 at B=4 T=64 matches a hand count", "[plan]") {
    GPTConfig d12 = parse_model_descriptor("d12");
    const int threads = omp_get_max_threads();
    MemoryPlan plan = plan_memory(d12, 4, 64, threads);
    const size_t psi = 124475904ull;
    CHECK(plan.bytes[MEM_PARAMS] == 4 * psi);       // 497,903,616
    CHECK(plan.bytes[MEM_GRADS] == 4 * psi);        // 497,903,616
    CHECK(plan.bytes[MEM_OPTIMIZER] == 8 * psi);    // 995,807,232: AdamW's m and v
    CHECK(plan.bytes[MEM_MASTER_WEIGHTS] == 0);     // fp32 parameters are their own master copy
    CHECK(plan.bytes[MEM_COMM] == 0);               // one rank
    // llm.c's activation tensors for B·T = 256, C = 768, L = 12, NH = 12, Vp = 50304, in floats; this CPU
    // version keeps one B·NH·T·T attention matrix per layer (no separate preatt) and turns the logits into
    // their gradient in place (no separate probs)
    const size_t activations[] = {
        196608,    // encoded       BTC
        2359296,   // ln1           L·BTC
        3072,      // ln1_mean      L·BT
        3072,      // ln1_rstd      L·BT
        7077888,   // qkv           L·BT·3C
        2359296,   // att           L·B·NH·T·T = 12·4·12·64·64
        2359296,   // atty          L·BTC
        2359296,   // attproj       L·BTC
        2359296,   // residual2     L·BTC
        2359296,   // ln2           L·BTC
        3072,      // ln2_mean      L·BT
        3072,      // ln2_rstd      L·BT
        9437184,   // fch           L·BT·4C
        9437184,   // fch_gelu      L·BT·4C
        2359296,   // fcproj        L·BTC
        2359296,   // residual3     L·BTC
        196608,    // lnf           BTC
        256,       // lnf_mean      BT
        256,       // lnf_rstd      BT
        12877824,  // logits        BT·Vp
        256,       // losses        BT
    };
    size_t activation_floats = 0;
    for (size_t n : activations) activation_floats += n;
    CHECK(activation_floats == 58110720ull);
    CHECK(plan.bytes[MEM_ACTIVATIONS] == 4 * activation_floats);  // 232,442,880
    // backward's gradients of the residual stream, a layernorm input, qkv, the attention output and the MLP
    // hidden layer: (1 + 1 + 3 + 1 + 4)·BTC = 1,966,080 floats; then T floats per thread and the GEMM's panels
    CHECK(plan.bytes[MEM_SCRATCH] == 4 * (1966080ull + (size_t)threads * 64 + gemm_workspace_floats(threads)));
}

// the bytes of the named buffer of a list (0 when it is not there)
size_t listed_bytes(const BufferList& list, const std::string& name) {
    size_t bytes = 0;
    for (const PlannedBuffer& b : list)
        if (name == b.name) bytes += b.bytes;
    return bytes;
}

TEST_CASE("the ring's and the experts' buffers in the list match a hand count", "[plan]") {
    // ring attention over cp 2 on the CPU (fp32): d2c64h4t64 at B=2, T=16 holds Tl = 8 positions, 4 heads of 16,
    // chunks of n = 4; a K/V block is B·Tl·2C = 2048 values
    ParallelPlan cp2;
    cp2.cp = 2;
    BufferList ring = planned_buffers(parse_model_descriptor("d2c64h4t64"), 2, 16, 1, cp2, Device::CPU);
    for (const char* travels : {"ring kv_held", "ring kv_incoming", "ring acc[0]", "ring acc[1]", "ring acc_arrived"})
        CHECK(listed_bytes(ring, travels) == 4 * 2048);
    CHECK(listed_bytes(ring, "ring rows") == 4 * 2 * 8 * 64);    // B·Tl·C
    CHECK(listed_bytes(ring, "ring out_blk") == 4 * 2 * 4 * 64);  // B·n·C
    CHECK(listed_bytes(ring, "ring lse_blk") == 4 * 2 * 4 * 4);   // B·NH·n
    CHECK(listed_bytes(ring, "ring delta") == 4 * 2 * 8 * 4);     // B·Tl·NH
    CHECK(listed_bytes(ring, "cp position_table") == 4 * 8 * 64);  // wpe's rows at the rank's positions
    // four experts, two a token, C = 48, at B=2, T=16 (BT = 32, 64 rows in dispatch order), over ep 2: a rank's
    // two experts may see every row of the group's 2·32 tokens twice, 128 rows
    ParallelPlan ep2;
    ep2.dp = 2, ep2.ep = 2;
    BufferList moe = planned_buffers(parse_model_descriptor("d2c48h4t32v301e4k2"), 2, 16, 1, ep2, Device::CPU);
    CHECK(listed_bytes(moe, "moe dispatch") == 4 * 64 * 48);
    CHECK(listed_bytes(moe, "moe received") == 4 * 128 * 48);
    CHECK(listed_bytes(moe, "moe expert_rows") == 4 * 128 * 48);
    CHECK(listed_bytes(moe, "moe probs") == 4 * 32 * 4);  // BT·E
    CHECK(listed_bytes(moe, "moe dlogits") == 4 * 32 * 4);
    CHECK(listed_bytes(moe, "moe dgates") == 4 * 64);
    CHECK(listed_bytes(moe, "moe token_of_row") == 4 * 64);
    CHECK(listed_bytes(moe, "moe permutation_index") == 4 * 128);
    CHECK(listed_bytes(moe, "moe blocks") == 4 * 3 * 4);
    CHECK(listed_bytes(moe, "moe report") == 4 * (4 + 2 * 2 * 4));  // E counts, 2·B·E statistics
    CHECK(listed_bytes(moe, "moe scores") == 0);  // softmax scoring keeps no s; no capacity, no gathers
    CHECK(listed_bytes(moe, "moe keep") == 0);
}

TEST_CASE("ZeRO's shards and staging in the list match a hand count", "[plan]") {
    // GPT-2 d2c48h4t32v301 over dp 2 on the CPU (fp32), with buckets large enough that the embeddings (wte's Vp
    // rows and wpe's maxT rows) are one bucket and every other tensor a second: each splits into two halves
    GPTConfig c = parse_model_descriptor("d2c48h4t32v301");
    const size_t P = gpt2_parameter_count(c), E = (size_t)(c.padded_vocab_size + c.max_seq_len) * c.channels, R = P - E;
    REQUIRE(E % 2 == 0);
    REQUIRE(R % 2 == 0);
    for (int zero : {0, 1, 2, 3}) {
        INFO("ZeRO-" << zero);
        ParallelPlan dp2;
        dp2.dp = 2, dp2.zero = zero;
        BufferList list = planned_buffers(c, 2, 16, 1, dp2, Device::CPU);
        CHECK(listed_bytes(list, "zero master") == 0);  // the CPU's parameters are their own fp32 master copy
        CHECK(listed_bytes(list, "zero adam_m") == (zero >= 1 ? 4 * P / 2 : 0));
        CHECK(listed_bytes(list, "zero adam_v") == (zero >= 1 ? 4 * P / 2 : 0));
        CHECK(listed_bytes(list, "zero grads") == (zero >= 2 ? 4 * P / 2 : 0));
        CHECK(listed_bytes(list, "zero params") == (zero >= 3 ? 4 * P / 2 : 0));
        // reductions in flight: the embeddings' bucket and two others, each with its half
        CHECK(listed_bytes(list, "reduce staging") == 4 * (E + 2 * R));
        CHECK(listed_bytes(list, "reduce staging piece") == 4 * (E / 2 + 2 * (R / 2)));
        // ZeRO-3's gathers: the embeddings' bucket, the bucket in use and the next one
        CHECK(listed_bytes(list, "gather staging") == (zero == 3 ? 4 * (E + 2 * R) : 0));
    }
    // one rank without ZeRO stages nothing
    CHECK(listed_bytes(planned_buffers(c, 2, 16, 1, ParallelPlan{}, Device::CPU), "reduce staging") == 0);
}

TEST_CASE("train_gpt --plan prints plan_memory's numbers without allocating", "[plan]") {
    check_plan_command("d12", 4, 64, omp_get_max_threads());
    check_plan_command("d12", 4, 64, 3);
    // d48 at B=16, T=1024 needs over 100 GB: printing its plan must not try to allocate it
    check_plan_command("d48", 16, 1024, 2);
    GPTConfig d48 = parse_model_descriptor("d48");
    CHECK(plan_memory(d48, 16, 1024, 2).total() > 100ull * 1000 * 1000 * 1000);
}

}  // namespace test_plan

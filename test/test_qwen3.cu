// Tests of Qwen3, the architecture that entered through the table (llmc/model_table.h) and the one layer body
// (llmc/gpt.cuh): its presets against the parameter counts of Qwen's configs, its descriptors; QK-norm
// (llmc/norm.cuh) on the CPU against a double computation and central finite differences, in place and not,
// and on the GPU ([cuda], skipped without one) against the CPU; llm5d's Qwen3 file written and read back byte for
// byte; and the model under every parallelism on the CPU, under `mpirun --oversubscribe`, against the single-rank
// run over 10 steps of 4 micro-batches (the equivalence principle): dp 2 under ZeRO-1 and ZeRO-3, tp 2 with and
// without sp, tp 4 (each key/value head on two ranks, the QK-norm weights' gradients summed over the group), cp 2,
// pp 2 under 1F1B and ZB-H1, ep 2 on a Qwen3 with experts (with the counted bytes against the formulas), and a
// checkpoint resumed under another layout.
// (The plan's ledger against the allocated one: test/test_llama.cu, whose shapes include a Qwen3's.)
//
// The model: 4 layers, 32 channels, 4 query heads and 2 key/value heads of 12 channels (attention is 48 wide, not
// C), 80 hidden units, a vocab of 301 (padded to 384 in memory).

#include <array>
#include <cmath>
#include <vector>

#include "dev/cuda/common.h"
#include "llmc/gpt.cuh"
#include "llmc/norm.cuh"
#include "mpi_helpers.h"
#include "test/test_helpers.h"

namespace test_qwen3 {

const char* QWEN3 = "q4c32h4g2d12f80t32v301";
const char* TIED = "q4c32h4g2d12f80t32v301w";
const char* MOE = "q4c32h4g2d12f80t32v301e4k2";

TEST_CASE("Qwen3 names give Qwen's shapes and parameter counts; descriptors give the asked ones; bad ones are refused",
          "[qwen3]") {
    // the counts of Qwen's config.json files: per layer q (NH·128·C), k and v (8·128·C each), o, the MLP's three
    // C×H matrices, two norms of C and QK-norm's 2·128; the embedding (151936·C), untied for 8B; the final norm
    struct Published {
        const char* name;
        int L, C, NH, H;
        bool tied;
        size_t parameters;
    };
    for (Published p : {Published{"qwen3-0.6b", 28, 1024, 16, 3072, true, 596049920ull},
                        Published{"qwen3-1.7b", 28, 2048, 16, 6144, true, 1720574976ull},
                        Published{"qwen3-4b", 36, 2560, 32, 9728, true, 4022468096ull},
                        Published{"qwen3-8b", 36, 4096, 32, 12288, false, 8190735360ull}}) {
        INFO(p.name);
        GPTConfig c = parse_model_descriptor(p.name);
        CHECK(c.arch == Arch::Qwen3);
        CHECK(c.qk_norm());
        CHECK(c.num_layers == p.L);
        CHECK(c.channels == p.C);
        CHECK(c.num_heads == p.NH);
        CHECK(c.kv_heads() == 8);
        CHECK(c.head_size() == 128);
        CHECK(c.hidden() == p.H);
        CHECK(c.tied_embeddings == p.tied);
        CHECK(c.vocab_size == 151936);
        CHECK(c.norm_eps == 1e-6f);
        CHECK(c.rope_theta == 1e6f);
        CHECK(c.rope_scaling == 0.0f);
        size_t hd = 128, C = p.C, q = p.NH * hd, kv = 8 * hd, V = 151936;
        size_t layer = q * C + 2 * kv * C + C * q + 3 * C * p.H + 2 * C + 2 * hd;
        size_t by_hand = (p.tied ? 1 : 2) * V * C + p.L * layer + C;
        CHECK(by_hand == p.parameters);
        CHECK(num_parameters(c) == p.parameters);
    }
    GPTConfig small = parse_model_descriptor(QWEN3);
    CHECK(small.arch == Arch::Qwen3);
    CHECK(small.head_size() == 12);  // not C/NH = 8
    CHECK(small.hidden() == 80);
    CHECK(small.kv_heads() == 2);
    CHECK(!small.tied_embeddings);
    CHECK(parse_model_descriptor(TIED).tied_embeddings);
    LocalDims d = local_dims(small, TPSpec{}, 2, 16);
    CHECK(d.Cl == 48);
    CHECK(d.QKVl == (4 + 2 * 2) * 12);
    CHECK(parse_model_descriptor("q1c64h4").head_size() == 16);  // C/NH by default
    CHECK(parse_model_descriptor("q1c64h4").hidden() == 256);    // and Meta's rule for the MLP
    for (const char* bad : {"q2c32h4g3", "q2c32h4d7", "qwen3-2b", "q2c32", "q2c32h4wd8", "l2c32h4d8", "d2c32h4d8"}) {
        CommandResult r = single(strfmt("-e %s --plan", bad));
        INFO(bad << ": " << r.output);
        CHECK(r.status != 0);
        CHECK(lines_of(r.output).size() == 1);
    }
}

// QK-norm in double: every q and k head of every row normed over its hd values, v copied
void qk_norm_double(std::vector<double>& out, const std::vector<double>& x, const std::vector<double>& qw,
                    const std::vector<double>& kw, long N, int NH, int KV, int hd, double eps) {
    int width = (NH + 2 * KV) * hd;
    for (long n = 0; n < N; n++)
        for (int h = 0; h < NH + 2 * KV; h++) {
            const double* v = &x[n * width + h * hd];
            double* o = &out[n * width + h * hd];
            if (h >= NH + KV) {
                for (int c = 0; c < hd; c++) o[c] = v[c];
                continue;
            }
            double sum_sq = 0.0;
            for (int c = 0; c < hd; c++) sum_sq += v[c] * v[c];
            double s = 1.0 / sqrt(sum_sq / hd + eps);
            for (int c = 0; c < hd; c++) o[c] = v[c] * s * (h < NH ? qw[c] : kw[c]);
        }
}

TEST_CASE("QK-norm on the CPU: forward against double, backward against central differences, in place and not",
          "[qwen3][layers]") {
    const long N = 5;
    const int NH = 3, KV = 2, hd = 6, width = (NH + 2 * KV) * hd;
    const float eps = 1e-2f;  // large, so that ignoring it would show
    Rng rng(11);
    std::vector<float> x = random_vector(N * width, rng), qw = random_vector(hd, rng, 0.5f), kw = random_vector(hd, rng, 0.5f);
    std::vector<float> dout = random_vector(N * width, rng);
    for (long i = 0; i < N * width; i++) x[i] *= 0.3f + 0.2f * (float)(i / hd % 5);  // heads of different scales
    for (auto* w : {&qw, &kw})
        for (float& v : *w) v += 1.0f;
    std::vector<float> out(N * width), rstd(N * (NH + KV));
    qk_norm_forward(out.data(), rstd.data(), x.data(), qw.data(), kw.data(), N, NH, KV, hd, eps);
    std::vector<double> xd(x.begin(), x.end()), qd(qw.begin(), qw.end()), kd(kw.begin(), kw.end()), ref(N * width);
    qk_norm_double(ref, xd, qd, kd, N, NH, KV, hd, eps);
    for (long i = 0; i < N * width; i++) REQUIRE(std::fabs(out[i] - ref[i]) < 1e-5 * (1 + std::fabs(ref[i])));

    // the objective Σ dout ⊙ qk_norm(x) and its central differences in double
    auto objective = [&] {
        std::vector<double> o(N * width);
        qk_norm_double(o, xd, qd, kd, N, NH, KV, hd, eps);
        double s = 0.0;
        for (long i = 0; i < N * width; i++) s += dout[i] * o[i];
        return s;
    };
    auto numeric = [&](double& v) {
        double keep = v, h = 1e-6;
        v = keep + h;
        double up = objective();
        v = keep - h;
        double down = objective();
        v = keep;
        return (up - down) / (2 * h);
    };
    std::vector<float> dinp(N * width, 7.0f), dqw(hd, 0.5f), dkw(hd, -0.25f);  // dinp written, the weights' added to
    qk_norm_backward(dinp.data(), dqw.data(), dkw.data(), dout.data(), x.data(), qw.data(), kw.data(), rstd.data(), N, NH,
                     KV, hd, Workspace{});
    for (long i = 0; i < N * width; i++) {
        INFO("dinp " << i);
        REQUIRE(std::fabs(dinp[i] - numeric(xd[i])) < 1e-4);
    }
    for (int c = 0; c < hd; c++) {
        INFO("channel " << c);
        REQUIRE(std::fabs(dqw[c] - 0.5f - numeric(qd[c])) < 1e-4);
        REQUIRE(std::fabs(dkw[c] + 0.25f - numeric(kd[c])) < 1e-4);
    }
    // in place (dinp is dout): the same bits
    std::vector<float> inplace = dout, dqw2(hd, 0.5f), dkw2(hd, -0.25f);
    qk_norm_backward(inplace.data(), dqw2.data(), dkw2.data(), inplace.data(), x.data(), qw.data(), kw.data(), rstd.data(),
                     N, NH, KV, hd, Workspace{});
    CHECK(inplace == dinp);
    CHECK(dqw2 == dqw);
    CHECK(dkw2 == dkw);
}

TEST_CASE("QK-norm on the GPU against the CPU, bf16; the backward's bits reproducible", "[cuda][qwen3][qknorm]") {
    SKIP_WITHOUT_GPU_CASE();
    for (auto [N, NH, KV, hd] : {std::array<int, 4>{4096, 16, 8, 128}, {1001, 3, 1, 64}, {77, 4, 2, 12}}) {
        INFO("N=" << N << " NH=" << NH << " KV=" << KV << " hd=" << hd);
        int width = (NH + 2 * KV) * hd;
        Rng rng(5);
        std::vector<float> x = round_to_bf16(random_vector((size_t)N * width, rng));
        std::vector<float> qw = round_to_bf16(random_vector(hd, rng, 0.5f)), kw = round_to_bf16(random_vector(hd, rng, 0.5f));
        std::vector<float> dout = round_to_bf16(random_vector((size_t)N * width, rng));
        std::vector<float> out((size_t)N * width), rstd((size_t)N * (NH + KV)), dinp((size_t)N * width), dqw(hd, 0.0f),
            dkw(hd, 0.0f);
        qk_norm_forward(out.data(), rstd.data(), x.data(), qw.data(), kw.data(), N, NH, KV, hd, 1e-6f);
        qk_norm_backward(dinp.data(), dqw.data(), dkw.data(), dout.data(), x.data(), qw.data(), kw.data(), rstd.data(), N,
                         NH, KV, hd, Workspace{});
        DeviceArray<bf16> d_x(x.size()), d_out(x.size()), d_dout(x.size()), d_qw(hd), d_kw(hd), d_dqw(hd), d_dkw(hd);
        DeviceArray<float> d_rstd(rstd.size()), scratch(qk_norm_backward_scratch_floats(N, hd));
        upload(d_x, x), upload(d_qw, qw), upload(d_kw, kw), upload(d_dout, dout);
        qk_norm_forward_cuda(d_out.ptr, d_rstd.ptr, d_x.ptr, d_qw.ptr, d_kw.ptr, N, NH, KV, hd, 1e-6f, 0);
        CHECK(max_rel_error(download(d_out).data(), out.data(), out.size(), 1e-1) < 2e-2);
        CHECK(max_rel_error(download(d_rstd).data(), rstd.data(), rstd.size()) < 1e-3);
        std::vector<float> first;
        for (int run = 0; run < 2; run++) {
            upload(d_dqw, std::vector<float>(hd, 0.0f)), upload(d_dkw, std::vector<float>(hd, 0.0f));
            upload(d_rstd, rstd);
            DeviceArray<bf16> d_dinp(x.size());
            upload(d_dinp, dout);  // in place: dinp is dout
            qk_norm_backward_cuda(d_dinp.ptr, d_dqw.ptr, d_dkw.ptr, d_dinp.ptr, d_x.ptr, d_qw.ptr, d_kw.ptr, d_rstd.ptr, N, NH,
                                  KV, hd, scratch.ptr, 0);
            std::vector<float> got = download(d_dinp), gq = download(d_dqw), gk = download(d_dkw);
            CHECK(max_rel_error(got.data(), dinp.data(), dinp.size(), 1e-1) < 3e-2);
            CHECK(max_rel_error(gq.data(), dqw.data(), hd, 1e-1) < 2e-2);
            CHECK(max_rel_error(gk.data(), dkw.data(), hd, 1e-1) < 2e-2);
            got.insert(got.end(), gq.begin(), gq.end());
            got.insert(got.end(), gk.begin(), gk.end());
            if (run == 0) first = got;
            else CHECK(got == first);
        }
    }
}

TEST_CASE("llm5d's Qwen3 file: header slots 15 to 17, the QK-norm weights last, read and written back byte for byte",
          "[qwen3]") {
    for (const char* model : {QWEN3, TIED}) {
        INFO(model);
        GPTConfig c = parse_model_descriptor(model);
        std::vector<float> params(num_parameters(c));
        gpt_init_random(c, params.data(), 3);
        // the QK-norm weights start at one: nudge them, so that a reader that dropped them would show
        size_t sizes[NUM_PARAM_TENSORS], offset = 0;
        param_tensor_sizes(c, sizes);
        for (int t = 0; t < QNORMW; t++) offset += sizes[t];
        CHECK(sizes[QNORMW] == 4 * 12);
        CHECK(sizes[KNORMW] == 4 * 12);
        for (size_t i = 0; i < sizes[QNORMW] + sizes[KNORMW]; i++) params[offset + i] += 0.01f * (float)i;
        TempDir dir;
        gpt_save_params(c, params.data(), dir / "qwen3.bin");
        std::string bytes = read_file(dir / "qwen3.bin");
        const int* h = reinterpret_cast<const int*>(bytes.data());
        CHECK(h[0] == LLAMA_MODEL_MAGIC);
        CHECK(h[15] == 1);
        CHECK(h[16] == 12);
        CHECK(h[17] == 80);
        // the file's last values: knormw's
        const float* values = reinterpret_cast<const float*>(bytes.data() + bytes.size()) - sizes[KNORMW];
        CHECK(std::vector<float>(values, values + sizes[KNORMW]) ==
              std::vector<float>(params.begin() + offset + sizes[QNORMW], params.begin() + offset + sizes[QNORMW] + sizes[KNORMW]));
        int version;
        GPTConfig back = read_model_header(dir / "qwen3.bin", &version);
        CHECK(same_model_shape(back, c));
        CHECK(back.arch == Arch::Qwen3);
        std::vector<float> again(params.size());
        gpt_load_params(back, again.data(), dir / "qwen3.bin");
        CHECK(again == params);
        gpt_save_params(back, again.data(), dir / "again.bin");
        CHECK(read_file(dir / "again.bin") == bytes);
        // a header that names an unknown architecture is refused in one line
        std::string bad = bytes;
        reinterpret_cast<int*>(&bad[0])[15] = 7;
        File(dir / "bad.bin", "wb").write(bad.data(), bad.size());
        CommandResult r = single("-e '" + (dir / "bad.bin") + "' --plan");
        CHECK(r.status != 0);
        CHECK(r.output.find("slot 15") != std::string::npos);
    }
}

TEST_CASE("a Qwen3 file -> Hugging Face (Qwen3ForCausalLM) -> file, byte for byte; config.json as transformers 5 "
          "writes it (rope_parameters) reads as the Hub's; Qwen3's fields the trainer cannot build are refused",
          "[qwen3][hf]") {
    TempDir out;
    for (const char* model : {QWEN3, TIED}) {
        INFO(model);
        GPTConfig c = parse_model_descriptor(model);
        std::vector<float> params(num_parameters(c));
        gpt_init_random(c, params.data(), 5);
        for (float& v : params) v += 1e-3f * (&v - params.data()) / (float)params.size();  // QK-norm's weights off 1
        std::string file = out / "qwen3.bin", hf = out / "qwen3_hf", back = out / "back.bin";
        gpt_save_params(c, params.data(), file);
        CommandResult r = single(strfmt("--convert '%s' --to '%s' --format hf", file.c_str(), hf.c_str()));
        INFO(r.output);
        REQUIRE(r.status == 0);
        CHECK(r.output.find("Qwen3ForCausalLM") != std::string::npos);
        std::string config = read_file(hf + "/config.json");
        CHECK(config.find("\"model_type\": \"qwen3\"") != std::string::npos);
        CHECK(config.find("\"head_dim\": 12") != std::string::npos);
        REQUIRE(single(strfmt("--convert '%s' --to '%s'", hf.c_str(), back.c_str())).status == 0);
        CHECK(read_file(back) == read_file(file));
        // transformers 5: RoPE's theta inside rope_parameters; the same model
        std::string theta = "\"rope_theta\": 1000000,\n  \"rope_scaling\": null,";
        REQUIRE(config.find(theta) != std::string::npos);
        std::string v5 = config;
        v5.replace(v5.find(theta), theta.size(), "\"rope_parameters\": {\"rope_theta\": 1000000, \"rope_type\": \"default\"},");
        File(hf + "/config.json", "wb").write(v5.data(), v5.size());
        remove(back.c_str());
        REQUIRE(single(strfmt("--convert '%s' --to '%s'", hf.c_str(), back.c_str())).status == 0);
        CHECK(read_file(back) == read_file(file));
        // what is not built: sliding windows, scaled RoPE, biases
        for (auto [from, to] : {std::pair{"\"use_sliding_window\": false", "\"use_sliding_window\": true"},
                                {"\"rope_type\": \"default\"", "\"rope_type\": \"yarn\""},
                                {"\"attention_bias\": false", "\"attention_bias\": true"}}) {
            std::string bad = v5;
            REQUIRE(bad.find(from) != std::string::npos);
            bad.replace(bad.find(from), strlen(from), to);
            File(hf + "/config.json", "wb").write(bad.data(), bad.size());
            CommandResult refused = single(strfmt("-e '%s' --plan", hf.c_str()));
            INFO(refused.output);
            CHECK(refused.status != 0);
            CHECK(lines_of(refused.output).size() == 1);
        }
        remove_tree(hf);
        remove(back.c_str());
    }
}

TEST_CASE("a Qwen3 Hugging Face directory with Qwen's own tokenizer.json (151669 tokens for 151936 rows) trains and "
          "samples text among the tokenizer's ids, saying once that the rows past them are padding",
          "[qwen3][hf]") {
    const std::string tokenizer_dir = tokenizer_package("qwen3");
    if (tokenizer_dir.empty()) return;
    Data data;
    TempDir out;
    GPTConfig c = parse_model_descriptor("q1c64h4g2d16f128t64v151936w");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 9);
    std::string file = out / "qwen3.bin", hf = out / "qwen3_hf";
    gpt_save_params(c, params.data(), file);
    REQUIRE(single(strfmt("--convert '%s' --to '%s' --format hf", file.c_str(), hf.c_str())).status == 0);
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        File(hf + "/" + name, "wb").write(read_file(tokenizer_dir + "/" + name).data(),
                                          read_file(tokenizer_dir + "/" + name).size());
    std::string flags = strfmt("-i '%s' -j '%s' -t 32 -b 2 -x 2 -v 0 -s 1 -g 16 -l 1e-3 --seed 3",
                               (data.dir / "train.bin").c_str(), (data.dir / "val.bin").c_str());
    CommandResult r = single("-e '" + hf + "' " + flags + " -o '" + out / "run" + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("samples: decoded with " + hf + "/tokenizer.json") != std::string::npos);
    CHECK(r.output.find("\n---\n") != std::string::npos);
    CHECK(r.output.find("sampling off") == std::string::npos);
    // the same line as for a tokenizer named by --tokenizer (test_hf.cu)
    CHECK(r.output.find("tokenizer: 151669 ids for the model's 151936 rows; ids 151669..151935 are padding no text "
                        "holds\n") != std::string::npos);
}

TEST_CASE("Qwen3 under dp 2 (ZeRO-1, ZeRO-3), tp 2 with and without sp, tp 4 over 2 key/value heads, cp 2, pp 2 (1F1B, "
          "ZB-H1), and with experts under ep 2 gives the single-rank run's losses over 10 steps with accumulation; a "
          "tied Qwen3 under pp 2; a checkpoint of tp 2 resumes on one rank",
          "[qwen3][parallel]") {
    Data data;
    TempDir out;
    check_layouts(data, out,
                  {{"dp2_z1", QWEN3, 2, 2, " -z 1"}, {"dp2_z3", QWEN3, 2, 2, " -z 3"},
                   {"tp2_sp", QWEN3, 2, 2, " --tp 2 --sp 1"}, {"tp2", QWEN3, 2, 2, " --tp 2 --sp 0 -r 2"},
                   {"tp4_sp", QWEN3, 4, 2, " --tp 4 --sp 1 --debug-check-replicas 1"}, {"cp2", QWEN3, 2, 2, " --cp 2"},
                   {"pp2_1f1b", QWEN3, 2, 2, " --pp 2"}, {"pp2_zb", QWEN3, 2, 2, " --pp 2 --pp-schedule zb"},
                   {"tied_pp2", TIED, 2, 2, " --pp 2 --debug-check-replicas 1"}, {"moe_ep2", MOE, 2, 2, " --ep 2 -z 1"}});
    // a checkpoint of tp 2 × dp 2 resumed on one rank follows the uninterrupted single-rank run
    std::map<std::string, double> whole = resume_reference_losses(data, QWEN3, out / "resume_reference");
    check_resume(data, QWEN3, {4, "-b 2 --tp 2 --sp 1 -z 1"}, {1, "-b 4"}, whole, out / "resumed");
}

TEST_CASE("--plan -e qwen3-8b runs without allocating it, with Qwen's parameter count and shape", "[qwen3][plan]") {
    CommandResult r = single("-e qwen3-8b -t 4096 -b 1 --plan --device cuda");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("8190735360 parameters") != std::string::npos);
    CHECK(r.output.find("Qwen3 hd=128 KV=8 H=12288") != std::string::npos);
}

}  // namespace test_qwen3

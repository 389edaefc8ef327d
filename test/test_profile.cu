// Tests of the profiler (llmc/profile.h, llmc/profile_report.h): its accounting, on scopes timed by the host
// clock (each op family charged its scopes' own time, spans charged to no op, a pipeline's waiting split into
// transfers and bubble, the live activations), and --profile and --trace on one rank and under dp, tp, cp, pp and
// ep: the ops add up to the step, the bytes each kind of group sent equal the plan's formulas, the pipeline's
// bubble is measured, the live memory stays within the plan, and the plot scripts draw the files; --calibrate
// --from-profile fits a profile's rates to what a --profile run measured.
#include <map>
#include <set>

#include "llmc/nvtx.h"
#include "llmc/profile_report.h"
#include "test/mpi_helpers.h"

namespace test_profile {

void spin(double seconds) {
    double end = now_seconds() + seconds;
    while (now_seconds() < end) {
    }
}

const ProfileOp* find_op(const MeasuredStep& m, const std::string& name) {
    for (const ProfileOp& o : m.ops)
        if (o.name == name) return &o;
    return nullptr;
}

double component(const MeasuredStep& m, const std::string& name) {
    const std::vector<std::string>& names = profile_components();
    return m.components[std::find(names.begin(), names.end(), name) - names.begin()];
}

TEST_CASE("the profiler charges each op family its scopes' own time; spans go to no op; a pipeline's waiting splits "
          "into transfers and bubble; live activations rise and fall", "[profile]") {
    Profiler& p = profiler();
    p.begin_step(false);
    {
        ProfileScope outer("matmul forward");
        spin(0.004);
        {
            ProfileScope inner("gelu forward");
            spin(0.006);
        }
        ProfileScope again("matmul forward");  // a family inside itself (a fused entry point's part): one call
        spin(0.002);
    }
    {
        NvtxRange pass("forward");  // a span: its own time is no op's
        profile_store(1000);
        spin(0.003);
        profile_store(500);
    }
    // three exchanges of a pipeline: the fastest (1 ms) is the transfer, the rest of the waiting the bubble
    for (double wait : {0.001, 0.005, 0.009}) {
        ProfileScope exchange = profile_span("p2p", [] { return std::make_pair(std::string("p2p"), std::string()); });
        ProfileScope recv("pp recv", OpKind::PP);
        spin(wait);
    }
    {
        NvtxRange pass("backward");
        profile_release(1500);
        ProfileScope adam("adamw", OpKind::Optimizer);
        spin(0.002);
    }
    p.end_step();
    CHECK(!p.on);
    // outside the profiled step nothing is recorded
    size_t events = p.events.size();
    {
        ProfileScope ignored("matmul forward");
        profile_store(7);
    }
    CHECK(p.events.size() == events);

    MeasuredStep m = measure_step(p);
    const ProfileOp *matmul = find_op(m, "matmul forward"), *gelu = find_op(m, "gelu forward"),
                    *recv = find_op(m, "pp recv"), *adam = find_op(m, "adamw");
    REQUIRE(matmul);
    REQUIRE(gelu);
    REQUIRE(recv);
    REQUIRE(adam);
    CHECK(matmul->calls == 1);
    CHECK(matmul->seconds >= 0.006);
    CHECK(gelu->seconds >= 0.006);
    // its own time: the outer scope's less gelu's inside it (the trace's events are the scopes, in order)
    REQUIRE(m.trace.size() >= 3);
    CHECK(m.trace[0].name == "matmul forward");
    CHECK(m.trace[1].name == "gelu forward");
    CHECK(matmul->seconds == Approx(m.trace[0].seconds - m.trace[1].seconds).epsilon(1e-12));
    CHECK(gelu->seconds == Approx(m.trace[1].seconds).epsilon(1e-12));
    CHECK(recv->kind == OpKind::PP);
    CHECK(recv->calls == 0);  // communication counts its calls where they start (Comm::begin), not at waits
    CHECK(adam->kind == OpKind::Optimizer);
    // the families and the unattributed time are the step; the forward span's 3 ms are unattributed
    double ops = 0.0;
    for (const ProfileOp& o : m.ops) ops += o.seconds;
    CHECK(ops + m.unattributed == Approx(m.seconds).epsilon(1e-12));
    CHECK(m.unattributed >= 0.003);
    double parts = 0.0;
    for (double c : m.components) parts += c;
    CHECK(parts == Approx(m.seconds).epsilon(1e-12));
    CHECK(component(m, "compute") == Approx(matmul->seconds + gelu->seconds).epsilon(1e-12));
    CHECK(component(m, "optimizer") == Approx(adam->seconds).epsilon(1e-12));
    // the pp waits: 3 exchanges at the fastest one's time, the rest bubble
    double fastest = 1e30;
    for (const ProfileTraceEvent& e : m.trace)
        if (e.category == "p2p") fastest = std::min(fastest, e.seconds);
    CHECK(fastest >= 0.001);
    CHECK(component(m, "pp") == Approx(3 * fastest).epsilon(1e-12));
    CHECK(component(m, "pp") + component(m, "bubble") == Approx(recv->seconds).epsilon(1e-12));
    CHECK(component(m, "bubble") > 0.0);
    // live activations: 0 at the step's start, 1000 then 1500 in forward, 0 in backward, and a sample where each
    // pass begins and ends and at the step's end
    REQUIRE(m.timeline.size() == 9);
    CHECK(m.timeline[0].phase == "step");
    CHECK(m.timeline[2].bytes == 1000);
    CHECK(m.timeline[2].phase == "forward");
    CHECK(m.timeline[3].bytes == 1500);
    CHECK(m.timeline[6].bytes == 0);
    CHECK(m.timeline[6].phase == "backward");
    CHECK(m.peak_activations == 1500);
    CHECK(m.timeline.back().seconds == Approx(m.seconds));
}

// Steps of tens of milliseconds (micro-batches of PROFILE_B rows of 16): a host-clock profile of a step of two
// (as d4c36 at -b 2 was) is mostly the step's fixed host work and the profiler's own bookkeeping, and on cores
// the other tests share, one time slice lost between two ops is 20% of it.
const char* PROFILE_MODEL = "d4c128h4t32v301";       // 4 layers, 4 heads: splits over tp 2 and pp 2
const char* PROFILE_MOE_MODEL = "d2c128h4t32v301e4k2";  // 4 experts, top-2
constexpr int PROFILE_B = 16;

struct ProfileLayout {
    std::string name;
    int ranks;
    std::string flags;  // after the data's
    int tokens_per_step;
    std::string model, kind;  // kind: the communication the layout adds ("" on one rank)
};

double number(const JsonValue& v, const std::string& key) { return v.at(key).as_double(); }

// the checks every rank's figures pass: the ops add up to the step within 15%, the components exactly, the live
// memory within the plan, and the activations back to none at the step's end
void check_rank(const JsonValue& r, bool whole) {
    double step = number(r, "step_ms"), unattributed = number(r, "unattributed_ms"), ops = 0.0, parts = 0.0;
    for (const JsonValue& o : r.at("ops").as_array()) ops += number(o, "ms");
    for (const std::string& c : profile_components()) parts += number(r.at("components").at("measured"), c);
    INFO("step " << step << " ms, ops " << ops << " ms, unattributed " << unattributed << " ms");
    CHECK(step > 0.0);
    CHECK(std::fabs(unattributed) <= 0.15 * step);
    CHECK(ops + unattributed == Approx(step).epsilon(1e-6));
    CHECK(parts == Approx(step).epsilon(1e-6));
    const JsonValue& memory = r.at("memory");
    double planned = whole ? number(memory.at("planned"), "total") : number(memory, "planned_total");
    CHECK(number(memory, "peak_activations") > 0.0);
    CHECK(number(memory, "peak_live") <= planned);
    if (whole) {
        const std::vector<JsonValue>& timeline = memory.at("timeline").as_array();
        REQUIRE(timeline.size() > 2);
        CHECK(number(timeline.front(), "activations") == 0.0);
        CHECK(number(timeline.back(), "activations") == 0.0);
        CHECK(number(timeline.back(), "ms") == Approx(step));
    }
}

TEST_CASE("--profile on one rank and under dp 2 (ZeRO-1), tp 2, cp 2, pp 2 and ep 2: the ops add up to the step, each "
          "kind's bytes equal the plan's formula, the bubble is measured, the live memory stays within the plan; "
          "--trace has every rank's tracks; the scripts draw both", "[profile]") {
    Data data;
    TempDir out;
    const std::vector<ProfileLayout> layouts = {
        {"single", 1, "", 16 * PROFILE_B, PROFILE_MODEL, ""},
        {"dp2", 2, " -z 1", 32 * PROFILE_B, PROFILE_MODEL, "dp"},
        {"tp2", 2, " --tp 2", 16 * PROFILE_B, PROFILE_MODEL, "tp"},
        {"cp2", 2, " --cp 2", 16 * PROFILE_B, PROFILE_MODEL, "cp"},
        {"pp2", 2, " --pp 2", 64 * PROFILE_B, PROFILE_MODEL, "pp"},  // 4 micro-batches
        {"ep2", 2, " --ep 2", 32 * PROFILE_B, PROFILE_MOE_MODEL, "ep"},
    };
    for (const ProfileLayout& l : layouts) {
        INFO(l.name);
        std::string profile = out / (l.name + ".json"), trace = out / (l.name + "_trace.json"), run;
        REQUIRE(train_ok(l.ranks, data.flags(PROFILE_B, l.tokens_per_step, 3, l.model) + l.flags + " --profile '" + profile +
                                      "' --trace '" + trace + "'", out / l.name, &run));
        CHECK(run.find("profile of step 3") != std::string::npos);
        CHECK(!file_exists(profile + ".tmp"));  // written under it, then renamed into place
        CHECK(!file_exists(trace + ".tmp"));
        JsonDoc doc = JsonDoc::from_file(profile);
        const JsonValue& p = doc.root;
        CHECK(p.at("step").as_int64() == 3);
        check_rank(p, true);
        // the families every step has, each where its kind says (on one rank too: no op of the step left out)
        std::map<std::string, std::string> kind_of;
        for (const JsonValue& o : p.at("ops").as_array()) kind_of[o.at("name").as_string()] = o.at("kind").as_string();
        for (auto [name, kind] : {std::pair{"matmul forward", "compute"}, {"matmul backward", "compute"},
                                  {"attention backward", "compute"}, {"gradient norm", "optimizer"},
                                  {"adamw", "optimizer"}}) {
            INFO(name);
            CHECK(kind_of[name] == kind);
        }
        const JsonValue& measured = p.at("components").at("measured");
        // the step model's figures beside them (dev/hardware/cpu.txt)
        CHECK(number(p.at("components").at("predicted"), "step") > 0.0);
        // every kind's bytes: the plan's formulas (ep's at the step's routing)
        for (std::string kind : {"dp", "tp", "cp", "pp", "ep"}) {
            INFO(kind);
            const JsonValue& c = p.at("communication").at(kind);
            CHECK(number(c, "sent") == Approx(number(c, "planned")).epsilon(1e-9));
            CHECK((number(c, "sent") > 0.0) == (kind == l.kind || (kind == "dp" && (l.kind == "cp" || l.kind == "ep"))));
        }
        if (!l.kind.empty()) CHECK(number(measured, l.kind) > 0.0);
        if (l.ranks > 1) {
            const std::vector<JsonValue>& ranks = p.at("ranks").as_array();
            REQUIRE(ranks.size() == (size_t)l.ranks);
            for (const JsonValue& r : ranks) check_rank(r, false);
        }
        if (l.kind == "pp") {  // the stages wait for each other: measured on some rank
            double bubble = 0.0;
            for (const JsonValue& r : p.at("ranks").as_array())
                bubble = std::max(bubble, number(r.at("components").at("measured"), "bubble"));
            CHECK(bubble > 0.0);
            CHECK(number(measured, "pp") > 0.0);
        }
        // the trace: a process per rank, the compute track on each, and the communication track where ranks talk
        JsonDoc t = JsonDoc::from_file(trace);
        std::set<int64_t> ranks, comm_ranks;
        for (const JsonValue& e : t.root.at("traceEvents").as_array()) {
            if (e.at("ph").as_string() != "X") continue;
            ranks.insert(e.at("pid").as_int64());
            if (e.at("tid").as_int64() == 1) comm_ranks.insert(e.at("pid").as_int64());
        }
        CHECK(ranks.size() == (size_t)l.ranks);
        if (l.ranks > 1) CHECK(comm_ranks.size() == (size_t)l.ranks);
        if (l.name == "single") {  // --calibrate --from-profile: the profile's rates scaled by predicted over measured
            std::string fitted = out / "fitted.txt";
            CommandResult fit = single(strfmt("--calibrate '%s' --from-profile '%s'", fitted.c_str(), profile.c_str()));
            INFO(fit.output);
            REQUIRE(fit.status == 0);
            const JsonValue& predicted = p.at("components").at("predicted");
            HardwareProfile base = load_hardware(p.at("components").at("hardware").as_string()), h = load_hardware(fitted);
            double compute = number(predicted, "compute") / number(measured, "compute");
            double memory = number(predicted, "optimizer") / number(measured, "optimizer");
            CHECK(h.matmul_tflops.back().second == Approx(base.matmul_tflops.back().second * compute).epsilon(2e-3));
            CHECK(h.attention_tflops == Approx(base.attention_tflops * compute).epsilon(2e-3));
            CHECK(h.memory_gbps == Approx(base.memory_gbps * memory).epsilon(2e-3));
            CHECK(h.intra_gbps == Approx(base.intra_gbps).epsilon(2e-3));  // one rank: no communication to fit
            CommandResult plan = single(data.flags(PROFILE_B, l.tokens_per_step, 3, l.model) + " --plan --hardware '" + fitted + "'");
            INFO(plan.output);
            CHECK(plan.output.find("predicted step:") != std::string::npos);
        }
        if (l.name == "single" || l.name == "pp2") {
            for (const char* script : {"plot_memory", "plot_profile"}) {
                std::string png = out / (l.name + "_" + script + ".png");
                CommandResult plot = run_command(strfmt("scripts/%s.py '%s' -o '%s'", script, profile.c_str(), png.c_str()));
                INFO(plot.output);
                CHECK(plot.status == 0);
                CHECK(read_file(png).compare(1, 3, "PNG") == 0);
            }
        }
    }
}

TEST_CASE("--profile, --trace and --from-profile refuse what they cannot do in one line", "[profile]") {
    Data data;
    std::string flags = data.flags(2, 32, 1, PROFILE_MODEL);
    check_one_line_error(single(flags + " --profile-step 2"), {"--profile-step 2", "--profile"});
    check_one_line_error(single(flags + " --profile /nonexistent/dir/p.json"), {"--profile", "/nonexistent/dir/p.json"});
    check_one_line_error(single(flags + " --trace /nonexistent/dir/t.json"), {"--trace", "/nonexistent/dir/t.json"});
    check_one_line_error(single(flags + " --profile-step 0 --profile p.json"), {"--profile-step"});
    check_one_line_error(single(flags + " --from-profile p.json"), {"--from-profile", "--calibrate"});
    check_one_line_error(single("--calibrate x.txt --from-profile /nonexistent/p.json"), {"/nonexistent/p.json"});
}

}  // namespace test_profile

// What the profiler (llmc/profile.h) recorded of one step, as a user reads it: the op families with their times
// and bytes, the step's components as the step-time model splits it (llmc/step_time.h) beside that model's
// prediction, the live memory through the step beside the plan, and on the GPU CUPTI's kernel table. Rank 0
// writes it as JSON (--profile FILE) and prints it as a table; every rank's figures go in the same file. The
// trace (--trace FILE) is every rank's scopes on a timeline in the Chrome trace format.
//
// The components, measured on the rank:
//   compute, optimizer, and each communication kind: the own time of its op families; a communication op's time
//   is what the caller spent starting it and waiting for it (exposed). Hidden communication: the time requests of the kind were in
//   flight less what was waited on them (the MPI backend; NCCL's waits are the GPU's and go unseen by the host;
//   none for pp, whose requests are in flight while their peer is busy).
//   pp and bubble: a stage waits in its exchanges with its neighbours both for the transfer and for a
//   neighbour that has not reached it yet (the bubble). Every exchange moves the same bytes (a micro-batch's
//   activations or their gradient), so the fastest exchange of the step, whose peer was ready, is the
//   transfer's time: pp is that times the exchanges, the bubble the rest of the waiting.
//   other: the ops of no kind above (collectives of the whole world, as the loss's mean) and the unattributed
//   time, so that the components add up to the step.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/json.h"
#include "llmc/kernel_table.h"
#include "llmc/ledger.h"
#include "llmc/profile.h"
#include "llmc/step_time.h"

// the step model's components, in the order the tables print them
inline const std::vector<std::string>& profile_components() {
    static const std::vector<std::string> names = {"compute", "dp", "tp", "cp", "pp", "ep", "bubble", "optimizer", "other"};
    return names;
}

struct ProfileTraceEvent {
    std::string name, category, args;
    bool communication;  // drawn on the rank's communication track
    double start, seconds;
};

// one rank's step, measured
struct MeasuredStep {
    double seconds = 0.0, unattributed = 0.0;
    double own = 0.0;  // the profiler's bookkeeping in the step (on the host)
    std::vector<ProfileOp> ops;  // the longest first
    std::vector<double> components = std::vector<double>(9, 0.0), hidden = std::vector<double>(OP_KINDS, 0.0);
    struct Live {
        double seconds, bytes;
        std::string phase;
    };
    std::vector<Live> timeline;  // the live activation bytes
    double peak_activations = 0.0;
    std::vector<ProfileTraceEvent> trace;
};

inline MeasuredStep measure_step(const Profiler& p) {
    MeasuredStep m;
    m.ops = p.ops;
    std::vector<double> t = p.mark_seconds();
    m.seconds = t.empty() ? 0.0 : t.back();
    m.own = p.own;
    std::vector<double> inner(p.events.size(), 0.0);  // the time of the scopes directly inside each scope
    double transfer = 1e30;
    long exchanges = 0;
    for (size_t i = 0; i < p.events.size(); i++) {
        const ProfileEvent& e = p.events[i];
        double seconds = t[e.end] - t[e.begin];
        if (e.parent >= 0) inner[e.parent] += seconds;
        if (e.op < 0 && std::string(e.category) == "p2p") transfer = std::min(transfer, seconds), exchanges++;
        bool communication = e.op >= 0 && is_communication(m.ops[e.op].kind);
        m.trace.push_back({e.name, e.category, e.args, communication, t[e.begin], seconds});
    }
    for (size_t i = 0; i < p.events.size(); i++) {
        const ProfileEvent& e = p.events[i];
        if (e.op >= 0) m.ops[e.op].seconds += t[e.end] - t[e.begin] - inner[i];
    }
    double covered = 0.0;
    auto add = [&](const std::string& component, double s) {
        size_t k = std::find(profile_components().begin(), profile_components().end(), component) - profile_components().begin();
        m.components[k] += s;
    };
    for (const ProfileOp& o : m.ops) {
        covered += o.seconds;
        add(o.kind == OpKind::Compute ? "compute" : o.kind == OpKind::Optimizer ? "optimizer" : op_kind_name(o.kind), o.seconds);
    }
    m.unattributed = m.seconds - covered;
    add("other", m.unattributed);
    if (exchanges > 0) {  // the pipeline's waiting: the transfers, and the bubble
        double waited = m.components[4], moved = std::min(waited, exchanges * transfer);
        m.components[4] = moved, m.components[6] = waited - moved;
    }
    for (int k = 0; k < OP_KINDS; k++) {
        double exposed = 0.0;
        for (const ProfileOp& o : m.ops)
            if ((int)o.kind == k) exposed += o.seconds;
        // (a pipeline's exchanges wait for their peers: the bubble, not hidden transfers)
        if (is_communication((OpKind)k) && (OpKind)k != OpKind::PP) m.hidden[k] = std::max(0.0, p.in_flight[k] - exposed);
    }
    std::sort(m.ops.begin(), m.ops.end(), [](const ProfileOp& a, const ProfileOp& b) { return a.seconds > b.seconds; });
    for (const Profiler::LiveSample& s : p.live_at) {
        m.timeline.push_back({t[s.mark], s.bytes, s.phase});
        m.peak_activations = std::max(m.peak_activations, s.bytes);
    }
    return m;
}

// starts recording the profiled step (the ranks start it together: the caller's barrier), on the GPU with CUPTI's
// kernel records
inline void profile_begin(bool gpu) {
    if (gpu) kernel_table_start();
    profiler().begin_step(gpu);
}
// ... and the kernels CUPTI recorded since, the longest first (none on the CPU)
inline std::vector<KernelTime> profile_kernels() {
    return profiler().gpu ? kernel_table_stop() : std::vector<KernelTime>{};
}

// what the report says besides the measurement
struct ProfileSetting {
    int step;                  // the profiled step, counted from 1 as the step lines count
    std::string device, layout;
    MemoryPlan planned;              // this rank's memory plan (llmc/plan.h)
    const StepTime* predicted;       // the step model's, or null without a hardware profile
    std::string hardware;            // the profile it was priced with
    std::vector<KernelTime> kernels;  // the GPU's, from CUPTI
    std::vector<double> planned_sent;  // the plan's formulas: the bytes this rank sends on dp, tp, cp, pp and ep
};

inline JsonOut component_json(const std::vector<double>& seconds) {
    JsonOut o = JsonOut::object();
    for (size_t k = 0; k < seconds.size(); k++) o.set(profile_components()[k], seconds[k] * 1e3);
    return o;
}
inline JsonOut hidden_json(const MeasuredStep& m) {
    JsonOut o = JsonOut::object();
    for (int k = 0; k < OP_KINDS; k++)
        if (is_communication((OpKind)k)) o.set(op_kind_name((OpKind)k), m.hidden[k] * 1e3);
    return o;
}
// the step model's parts, the optimizer apart from the compute that holds it
inline std::vector<double> predicted_components(const StepTime& s) {
    return {s.compute - s.optimizer, s.dp, s.tp, s.cp, s.pp, s.ep, s.bubble, s.optimizer, 0.0};
}
// what a rank holds the whole step: its plan but the activations
inline double fixed_bytes(const MemoryPlan& planned) {
    return (double)(planned.total() - planned.bytes[MEM_ACTIVATIONS]);
}

// a rank's figures: the whole of them for rank 0's file, the summary for the others' entries beside it
inline JsonOut rank_json(const MeasuredStep& m, const ProfileSetting& s, bool whole) {
    JsonOut ops = JsonOut::array();
    for (const ProfileOp& o : m.ops)
        ops.push(JsonOut::object().set("name", o.name).set("kind", op_kind_name(o.kind)).set("calls", o.calls)
                     .set("ms", o.seconds * 1e3).set("bytes", o.bytes));
    JsonOut components = JsonOut::object().set("measured", component_json(m.components)).set("hidden", hidden_json(m));
    JsonOut communication = JsonOut::object();  // the bytes sent on each kind of group, beside the plan's formula
    for (int k = (int)OpKind::DP; k <= (int)OpKind::EP; k++) {
        double sent = 0.0;
        for (const ProfileOp& o : m.ops)
            if ((int)o.kind == k) sent += o.bytes;
        communication.set(op_kind_name((OpKind)k), JsonOut::object().set("sent", sent)
                                                        .set("planned", s.planned_sent[k - (int)OpKind::DP]));
    }
    double peak_live = fixed_bytes(s.planned) + m.peak_activations;
    if (!whole)
        return JsonOut::object().set("step_ms", m.seconds * 1e3).set("unattributed_ms", m.unattributed * 1e3)
            .set("profiler_ms", m.own * 1e3)
            .set("components", components).set("communication", communication).set("ops", ops)
            .set("memory", JsonOut::object().set("peak_live", peak_live).set("peak_activations", m.peak_activations)
                                .set("planned_total", s.planned.total()));
    if (s.predicted) {
        JsonOut predicted = component_json(predicted_components(*s.predicted));
        predicted.set("step", s.predicted->seconds * 1e3);
        components.set("predicted", predicted).set("hardware", s.hardware);
    } else {
        components.set("predicted", nullptr);
    }
    JsonOut planned = JsonOut::object(), timeline = JsonOut::array();
    for (int c = 0; c < MEM_CATEGORIES; c++) planned.set(mem_category_name(c), s.planned.bytes[c]);
    planned.set("total", s.planned.total());
    for (const MeasuredStep::Live& l : m.timeline)
        timeline.push(JsonOut::object().set("ms", l.seconds * 1e3).set("activations", l.bytes).set("phase", l.phase));
    JsonOut memory = JsonOut::object().set("planned", planned).set("timeline", timeline).set("peak_live", peak_live)
                         .set("peak_activations", m.peak_activations);
    JsonOut out = JsonOut::object().set("step", s.step).set("device", s.device).set("layout", s.layout)
                      .set("step_ms", m.seconds * 1e3).set("ops", ops).set("unattributed_ms", m.unattributed * 1e3)
                      .set("profiler_ms", m.own * 1e3)
                      .set("components", components).set("communication", communication).set("memory", memory);
    if (!s.kernels.empty()) {
        JsonOut kernels = JsonOut::array();
        for (const KernelTime& k : s.kernels)
            kernels.push(JsonOut::object().set("name", k.name).set("launches", k.launches).set("ms", k.ms));
        out.set("kernels", kernels);
    }
    return out;
}

// rank 0's table: its ops, the components of every rank (up to 8: `ranks`, each rank's measured ones) beside the
// prediction, the memory, the top kernels
inline void print_profile(const MeasuredStep& m, const ProfileSetting& s, const std::vector<std::vector<double>>& ranks) {
    double step = m.seconds * 1e3;
    printf("profile of step %d (%s, %s): %.3f ms; the ops cover %.1f%% of it; the profiler's own bookkeeping took "
           "%.3f ms of it (%.2f%%)\n", s.step, s.device.c_str(), s.layout.c_str(), step,
           100.0 * (m.seconds - m.unattributed) / m.seconds, m.own * 1e3, 100.0 * m.own / m.seconds);
    printf("  %-28s %-9s %7s %11s %7s %14s\n", "op", "kind", "calls", "ms", "%", "bytes sent");
    for (const ProfileOp& o : m.ops)
        printf("  %-28s %-9s %7ld %11.3f %6.1f%% %14.0f\n", o.name.c_str(), op_kind_name(o.kind), o.calls,
               o.seconds * 1e3, 100.0 * o.seconds / m.seconds, o.bytes);
    std::vector<double> predicted = s.predicted ? predicted_components(*s.predicted) : std::vector<double>();
    size_t columns = ranks.size() > 1 && ranks.size() <= 8 ? ranks.size() : 0;
    std::string head = "  component  ";
    for (size_t r = 0; r < columns; r++) head += strfmt("%12s", strfmt("rank %zu ms", r).c_str());
    if (!columns) head += strfmt("%12s", "measured ms");
    printf("%s %12s %13s\n", head.c_str(), columns ? "0's hidden" : "hidden ms", "predicted ms");
    for (size_t k = 0; k < m.components.size(); k++) {
        const std::string& name = profile_components()[k];
        int kind = -1;
        for (int j = 0; j < OP_KINDS; j++)
            if (is_communication((OpKind)j) && name == op_kind_name((OpKind)j)) kind = j;
        std::string measured = strfmt("  %-10s ", name.c_str());
        for (size_t r = 0; r < columns; r++) measured += strfmt("%12.3f", ranks[r][k] * 1e3);
        if (!columns) measured += strfmt("%12.3f", m.components[k] * 1e3);
        printf("%s %12s %13s\n", measured.c_str(),
               kind >= 0 ? strfmt("%.3f", m.hidden[kind] * 1e3).c_str() : "",
               s.predicted && name != "other" ? strfmt("%.3f", predicted[k] * 1e3).c_str() : "");
    }
    if (s.predicted)
        printf("  %-10s %*.3f %12s %13.3f (%s; the critical stage's)\n", "step", 12 * (int)std::max<size_t>(columns, 1),
               step, "", s.predicted->seconds * 1e3, s.hardware.c_str());
    printf("  memory: live peak %.2f MiB (activations %.2f MiB of the %.2f planned) of %.2f MiB planned\n",
           (fixed_bytes(s.planned) + m.peak_activations) / 1048576.0, m.peak_activations / 1048576.0,
           s.planned.bytes[MEM_ACTIVATIONS] / 1048576.0, s.planned.total() / 1048576.0);
    for (size_t i = 0; i < std::min<size_t>(s.kernels.size(), 15); i++)
        printf("  kernel %-100s %6ld launches %10.3f ms\n", s.kernels[i].name.c_str(), s.kernels[i].launches, s.kernels[i].ms);
}

// every rank's text on rank 0, in rank order (a collective of `world`; the others get nothing)
inline std::vector<std::string> gather_text(Comm& world, const std::string& mine) {
    double length = (double)mine.size();
    std::vector<double> lengths(world.size);
    world.wait(world.all_gather(&length, lengths.data(), 1, DType::F64));
    size_t longest = (size_t)*std::max_element(lengths.begin(), lengths.end());
    std::vector<char> padded(longest + 1, ' '), all((longest + 1) * world.size);
    std::copy(mine.begin(), mine.end(), padded.begin());
    world.wait(world.all_gather(padded.data(), all.data(), padded.size(), DType::U8));
    std::vector<std::string> texts;
    for (int r = 0; world.rank == 0 && r < world.size; r++)
        texts.emplace_back(all.data() + r * padded.size(), (size_t)lengths[r]);
    return texts;
}

// --profile: rank 0's figures, with every rank's beside them when there are several (a collective of `world`)
inline void write_profile(const std::string& path, Comm& world, const MeasuredStep& m, const ProfileSetting& s) {
    std::vector<std::string> ranks = gather_text(world, rank_json(m, s, false).dump(0));
    std::vector<double> every(m.components.size() * world.size);
    world.wait(world.all_gather(m.components.data(), every.data(), m.components.size(), DType::F64));
    if (world.rank != 0) return;
    std::vector<std::vector<double>> components;
    for (int r = 0; r < world.size; r++)
        components.emplace_back(every.begin() + r * m.components.size(), every.begin() + (r + 1) * m.components.size());
    JsonOut out = rank_json(m, s, true);
    if (world.size > 1) {
        JsonOut all = JsonOut::array();
        for (int r = 0; r < world.size; r++) {
            JsonOut entry;
            entry.text = "{\"rank\": " + std::to_string(r) + ", " + ranks[r].substr(1);  // the rank, then its figures
            all.push(entry);
        }
        out.set("ranks", all);
    }
    print_profile(m, s, components);
    write_file_whole(path, out.dump(2) + "\n");
    printf("profile: written to %s (scripts/plot_profile.py and scripts/plot_memory.py draw it)\n", path.c_str());
}

// --trace: every rank's scopes of the step as a Chrome trace (chrome://tracing and ui.perfetto.dev open it): a
// process per rank, named `label` ("rank 1 (stage 1)"), with the compute track (the passes, a pipeline's actions
// and exchanges, the ops inside them) and the communication track; times in microseconds from the step's start.
// scripts/plot_pipeline.py draws a pipeline's actions from it. A collective of `world`.
inline void write_trace(const std::string& path, Comm& world, const MeasuredStep& m, const std::string& label,
                        const std::string& schedule) {
    int r = world.rank;
    std::string mine = strfmt("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": %s}},\n", r,
                              JsonOut::quote(label).c_str());
    for (int track = 0; track < 2; track++)
        mine += strfmt("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": \"%s\"}},\n",
                       r, track, track ? "communication" : "compute");
    for (const ProfileTraceEvent& e : m.trace)
        mine += strfmt("{\"name\": %s, \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
                       "\"dur\": %.3f, \"args\": {%s}},\n", JsonOut::quote(e.name).c_str(), e.category.c_str(), r,
                       e.communication ? 1 : 0, e.start * 1e6, e.seconds * 1e6, e.args.c_str());
    std::vector<std::string> ranks = gather_text(world, mine);
    if (r != 0) return;
    std::string json = "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"schedule\": " + JsonOut::quote(schedule) +
                       "},\n\"traceEvents\": [\n";
    for (const std::string& text : ranks) json += text;
    json.resize(json.size() - 2);  // the last event's ",\n"
    json += "\n]}\n";
    write_file_whole(path, json);
    printf("trace: written to %s (ui.perfetto.dev opens it; scripts/plot_pipeline.py draws a pipeline's)\n", path.c_str());
}

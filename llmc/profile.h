// The profiler: where one training step's time and memory go (--profile FILE, --trace FILE). During the
// profiled step (and only then: every hook below is one test of a flag otherwise) it records
//   - scopes: a named span of the step opened and closed around an op (ProfileScope). An op scope belongs to an
//     op family ("matmul forward", "tp all_reduce") of a kind: compute, dp, tp, cp, pp, ep, optimizer or other;
//     the kernels' entry points open compute ones, llmc/comm.cuh a communication one where each op starts and
//     where it is waited on (the caller's time on it: exposed), the optimizer its own. A span scope (a pipeline action, a pass) is
//     not an op: it groups ops on the trace. Scopes nest; each op family is charged its scopes' own time (their
//     length less the scopes inside them), so the families add up to the time the scopes cover, and what no op
//     covers is the step's "unattributed" time;
//   - the bytes each communication op sends and its calls (llmc/comm.cuh's ring-algorithm count), and how long
//     each request was in flight, so that the communication that ran behind compute (hidden) is known beside
//     what was waited on (on the MPI backend, where the host sees each request complete);
//   - the live activation bytes: what forward has stored and backward not yet released (llmc/gpt.cuh stores and
//     releases a layer's slice at a time), sampled at each change, for the Playbook's memory figure.
// Times come from the host clock on the CPU, whose kernels run on the calling thread, and on the GPU from CUDA
// events recorded on the compute stream, read once after the step (so the step itself never waits on them).
// llmc/profile_report.h turns the record into the components the step-time model predicts, the JSON file and
// the table.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "llmc/device.cuh"
#include "llmc/utils.h"

enum class OpKind { Compute, DP, TP, CP, PP, EP, Optimizer, Other, Span };
constexpr int OP_KINDS = 8;  // the kinds an op family has (not Span)
inline const char* op_kind_name(OpKind k) {
    static const char* names[] = {"compute", "dp", "tp", "cp", "pp", "ep", "optimizer", "other", "span"};
    return names[(int)k];
}
inline bool is_communication(OpKind k) { return k >= OpKind::DP && k <= OpKind::EP; }

// the kind of a process group's communication, by the names llmc/grid.cuh gives the groups: the gradients'
// groups are dp's; tp_cp carries tp's reductions across cp too
inline OpKind group_kind(const std::string& group) {
    if (group == "tp" || group == "tp_cp") return OpKind::TP;
    if (group == "cp") return OpKind::CP;
    if (group == "pp") return OpKind::PP;
    if (group == "ep") return OpKind::EP;
    if (group == "dp" || group == "dp_cp" || group == "expert_dp") return OpKind::DP;
    return OpKind::Other;  // the world's, and the tied embeddings' copies on the first and last stages
}

struct ProfileOp {
    std::string name;
    OpKind kind;
    long calls = 0;
    double bytes = 0.0;    // sent, for communication
    double seconds = 0.0;  // its scopes' own time
};

// one scope of the step: an op's (op >= 0) or a span's, between two marks, inside `parent` (-1: the step)
struct ProfileEvent {
    int op;
    std::string name;
    const char* category;  // the trace's: the op's kind, or the span's own (forward, backward, weight, p2p, ...)
    std::string args;      // the trace's args, as JSON members ("\"micro\": 3, ...")
    int begin, end, parent;
};

struct Profiler {
    bool on = false;   // inside the profiled step
    bool gpu = false;  // marks are CUDA events on the compute stream, not host times
    std::vector<ProfileOp> ops;
    std::map<std::string, int> op_of;
    std::vector<ProfileEvent> events;
    int open = -1;  // the innermost open scope
    std::vector<double> host_marks;
    std::vector<cudaEvent_t> device_marks;
    size_t marks = 0;
    double live = 0.0;  // activation bytes stored and not yet released
    struct LiveSample {
        int mark;
        double bytes;
        std::string phase;  // the pass it was taken in (forward, backward, ...), "step" outside one
    };
    std::vector<LiveSample> live_at;  // at the step's ends and every change
    double in_flight[OP_KINDS] = {};          // seconds communication requests of each kind were in flight
    double own = 0.0;  // seconds of the step spent in the profiler's own bookkeeping (ProfilerTime)
    int inside = 0;    // ... its entry points open on the stack

    ~Profiler() {
        for (cudaEvent_t e : device_marks) cudaEventDestroy(e);
    }

    // starts recording a step; with `gpu` its marks are events on the compute stream
    void begin_step(bool on_gpu) {
        gpu = on_gpu;
        ops.clear(), op_of.clear(), events.clear(), host_marks.clear(), live_at.clear();
        marks = 0, open = -1, live = 0.0, own = 0.0;
        std::fill(in_flight, in_flight + OP_KINDS, 0.0);
        on = true;
        set_live(0.0);
    }
    // stops recording at the step's last mark
    void end_step() {
        set_live(live);
        on = false;
    }

    int mark() {
        if (!gpu) {
            host_marks.push_back(now_seconds());
            return (int)host_marks.size() - 1;
        }
        if (marks == device_marks.size()) {
            cudaEvent_t e;
            cuda_check(cudaEventCreate(&e));
            device_marks.push_back(e);
        }
        cuda_check(cudaEventRecord(device_marks[marks], main_stream()));
        return (int)marks++;
    }
    // every mark's time in seconds from the step's start (on the GPU, once its last event has happened)
    std::vector<double> mark_seconds() const {
        if (!gpu) {
            std::vector<double> t(host_marks.size());
            for (size_t i = 0; i < t.size(); i++) t[i] = host_marks[i] - host_marks[0];
            return t;
        }
        std::vector<double> t(marks, 0.0);
        if (marks == 0) return t;
        cuda_check(cudaEventSynchronize(device_marks[marks - 1]));
        for (size_t i = 1; i < marks; i++) {
            float ms = 0.0f;
            cuda_check(cudaEventElapsedTime(&ms, device_marks[0], device_marks[i]));
            t[i] = ms * 1e-3;
        }
        return t;
    }

    int op(const std::string& name, OpKind kind) {
        auto it = op_of.find(name);
        if (it != op_of.end()) return it->second;
        ops.push_back({name, kind});
        return op_of[name] = (int)ops.size() - 1;
    }
    // opens a scope; a compute, optimizer or other op's scope is one call of it (communication counts its calls
    // where they start: count_comm)
    int begin(const std::string& name, OpKind kind, const char* category, std::string args = "");
    void end(int event);
    bool is_pass(int event) const { return events[event].op < 0 && std::string(events[event].category) == "pass"; }
    // a communication op started: its bytes and its call; and how long a request was in flight
    void count_comm(const std::string& name, OpKind kind, double bytes);
    void comm_finished(OpKind kind, double seconds);
    // a layer's activations stored by forward, or released after backward
    void store(double bytes);
    void release(double bytes);
    void set_live(double bytes) {
        live = bytes;
        live_at.push_back({mark(), live, phase()});
    }
    std::string phase() const {
        for (int e = open; e >= 0; e = events[e].parent)
            if (is_pass(e)) return events[e].name;
        return "step";
    }
};

inline Profiler& profiler() {
    static Profiler p;
    return p;
}

// The profiler's own time: its entry points (and the callers' names and arguments built for it) time themselves,
// the outermost on the stack adding to Profiler::own, which the report gives beside the step as what profiling
// cost it on the host.
struct ProfilerTime {
    Profiler& p;
    double start;
    explicit ProfilerTime(Profiler& p_) : p(p_), start(p_.inside++ ? 0.0 : now_seconds()) {}
    ~ProfilerTime() {
        if (--p.inside == 0) p.own += now_seconds() - start;
    }
    ProfilerTime(const ProfilerTime&) = delete;
    ProfilerTime& operator=(const ProfilerTime&) = delete;
};

inline int Profiler::begin(const std::string& name, OpKind kind, const char* category, std::string args) {
    ProfilerTime own_time(*this);
    int o = kind == OpKind::Span ? -1 : op(name, kind);
    // (an entry point that calls another of its own family, as a fused one its parts, is one call)
    if (o >= 0 && !is_communication(kind) && !(open >= 0 && events[open].op == o)) ops[o].calls++;
    events.push_back({o, name, category, std::move(args), mark(), -1, open});
    open = (int)events.size() - 1;
    if (is_pass(open)) set_live(live);  // the memory timeline marks where each pass begins and ends
    return open;
}
inline void Profiler::end(int event) {
    ProfilerTime own_time(*this);
    if (is_pass(event)) set_live(live);
    events[event].end = mark();
    open = events[event].parent;
}
inline void Profiler::count_comm(const std::string& name, OpKind kind, double bytes) {
    ProfilerTime own_time(*this);
    ProfileOp& o = ops[op(name, kind)];
    o.calls++;
    o.bytes += bytes;
}
inline void Profiler::comm_finished(OpKind kind, double seconds) { in_flight[(int)kind] += seconds; }
inline void Profiler::store(double bytes) {
    ProfilerTime own_time(*this);
    set_live(live + bytes);
}
inline void Profiler::release(double bytes) {
    ProfilerTime own_time(*this);
    set_live(live - bytes);
}

// A scope of the profiled step, closed when it goes out of scope; outside the profiled step it does nothing.
// ProfileScope("matmul forward") times a compute op; a kind names another op's, a category a span's.
struct ProfileScope {
    int event = -1;
    explicit ProfileScope(const char* name, OpKind kind = OpKind::Compute) {
        if (!profiler().on) return;
        ProfilerTime own_time(profiler());
        event = profiler().begin(name, kind, op_kind_name(kind));
    }
    ProfileScope() = default;
    ProfileScope(ProfileScope&& other) noexcept : event(other.event) { other.event = -1; }
    ProfileScope(const ProfileScope&) = delete;
    ProfileScope& operator=(const ProfileScope&) = delete;
    ProfileScope& operator=(ProfileScope&& other) noexcept {
        std::swap(event, other.event);
        return *this;
    }
    ~ProfileScope() {
        if (event >= 0 && profiler().on) profiler().end(event);
    }
};

// a span of the trace (not an op), e.g. a pipeline action: built only while profiling
template <typename Args>
inline ProfileScope profile_span(const char* category, Args&& name_and_args) {
    ProfileScope s;
    if (profiler().on) {
        ProfilerTime own_time(profiler());
        auto [name, args] = name_and_args();
        s.event = profiler().begin(name, OpKind::Span, category, args);
    }
    return s;
}

// the live activations: no-ops outside the profiled step
inline void profile_store(double bytes) {
    if (profiler().on) profiler().store(bytes);
}
inline void profile_release(double bytes) {
    if (profiler().on) profiler().release(bytes);
}

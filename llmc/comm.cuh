// Communicators: a group of ranks and the collectives the parallelisms need (all_reduce, reduce_scatter,
// all_gather, broadcast, send/recv alone or grouped in an exchange, all_to_all(v), barrier), each started
// asynchronously and finished by wait(), so that communication can run while the caller computes.
//
// Three backends behind one interface:
//   SELF  a group of one rank: every collective is a local copy (a run without mpirun needs nothing else);
//   MPI   host buffers (the CPU device; device buffers are staged through host memory, which lets several
//         ranks share one GPU: the compute stream is drained before a device buffer is read, and the result
//         is copied back on it when the op completes);
//   NCCL  device buffers, on the communicator's own stream, ordered after the compute stream by an event (host
//         buffers, a few scalars per step, are staged through device memory).
// Sums of bf16 add in fp32 and round to nearest on both backends (MPI through an op of its own), so a packed
// bf16 gradient bucket reduces the same way whichever backend carries it.
//
// Every wait has a deadline. A collective that a peer never joins would otherwise hang the whole job; past
// the deadline the waiting rank prints its rank, the group, the op and its sequence number, and aborts the job.
//
// Bytes sent are counted per rank by what a ring algorithm sends, the figure the Playbook's formulas use: for
// a buffer of S bytes over N ranks, all_reduce 2(N-1)/N·S, reduce_scatter and all_gather (N-1)/N·S (S the
// whole, unscattered buffer), all_to_all (N-1)/N·S, broadcast S from the root, send S.
#pragma once

#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <netdb.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef LLM5D_MPI
#include <mpi.h>
#endif

#include "llmc/profile.h"
#include "llmc/utils.h"

// U8: raw bytes (FP8 codes), gathered and sent, never summed
enum class DType { F32, F64, I32, BF16, U8 };
inline size_t dtype_size(DType t) { return t == DType::F64 ? 8 : t == DType::BF16 ? 2 : t == DType::U8 ? 1 : 4; }
inline const char* dtype_name(DType t) {
    return t == DType::F32 ? "f32" : t == DType::F64 ? "f64" : t == DType::I32 ? "i32" : t == DType::U8 ? "u8" : "bf16";
}

enum class Backend { SELF, MPI, NCCL };

// whether p is device memory; on a machine without a GPU nothing is
inline bool is_device_pointer(const void* p) {
    static const bool have_gpu = [] {
        int n = 0;
        return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    }();
    if (!have_gpu || !p) return false;
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice;
}

#ifdef LLM5D_MPI
inline MPI_Datatype mpi_type(DType t) {
    switch (t) {
        case DType::F32: return MPI_FLOAT;
        case DType::F64: return MPI_DOUBLE;
        case DType::I32: return MPI_INT;
        case DType::U8: return MPI_UINT8_T;
        default: return MPI_UINT16_T;  // bf16 moves as raw 16-bit words; its sums go through mpi_bf16_sum
    }
}

// MPI has no bf16: its sum is a user op over the 16-bit words, each pair added in fp32 and rounded to nearest
// (as NCCL does). MPI applies it in an order fixed by the algorithm it picks for a size and a rank count, so a
// given layout gives the same bits on every run.
inline void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
    const uint16_t* a = static_cast<const uint16_t*>(in);
    uint16_t* b = static_cast<uint16_t*>(inout);
    for (int i = 0; i < *len; i++) b[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
}
inline MPI_Op mpi_sum(DType t) {
    if (t != DType::BF16) return MPI_SUM;
    static MPI_Op bf16_sum = [] {
        MPI_Op op;
        MPI_Op_create(bf16_sum_op, 1, &op);
        return op;
    }();
    return bf16_sum;
}
#endif

// An operation in flight. For the MPI backend with device buffers, the host copies it works on live here
// and the result is copied back to the device when the operation completes.
struct CommRequest {
    const char* op = "";
    uint64_t seq = 0;
    int peer = -1;  // send and recv: the rank of the group at the other end
    bool pending = false;
    double started = 0.0;  // when it started, in a step the profiler records (llmc/profile.h); else 0
#ifdef LLM5D_MPI
    MPI_Request mpi = MPI_REQUEST_NULL;
#endif
    cudaEvent_t done_event = nullptr;  // NCCL
    std::vector<char> host_send, host_recv;
    void* device_recv = nullptr;
    // NCCL with a host recv buffer: the device copy the op writes, to be copied into host_target on completion;
    // and every staging buffer to free then
    void *staged_recv = nullptr, *host_target = nullptr;
    size_t staged_bytes = 0;
    std::vector<void*> staging;
};

struct Comm {
    Backend backend = Backend::SELF;
    std::string name = "world";
    int rank = 0, size = 1;
    int world_rank = 0;            // this process's rank in the whole job, for diagnostics
    double timeout_s = 600.0;      // every wait's deadline
    uint64_t seq = 0;              // operations started on this group
    double bytes_sent = 0;         // by the ring-algorithm count in the header comment
#ifdef LLM5D_MPI
    MPI_Comm mpi = MPI_COMM_NULL;
#endif
    ncclComm_t nccl = nullptr;
    cudaStream_t stream = nullptr;          // NCCL: the communication stream
    cudaStream_t compute_stream = nullptr;  // NCCL: work on it is finished before an op starts

    CommRequest begin(const char* op, double ring_factor, size_t bytes) {
        CommRequest r;
        r.op = op;
        r.seq = ++seq;
        r.pending = true;
        bytes_sent += ring_factor * (double)bytes;
        if (profiler().on) {
            ProfilerTime own_time(profiler());
            profiler().count_comm(name + " " + op, group_kind(name), ring_factor * (double)bytes);
            r.started = now_seconds();
        }
        return r;
    }
    double ring(double k) const { return size > 1 ? k * (size - 1) / size : 0.0; }
    // In a profiled step, the caller's time on one of this group's ops is the op's exposed time: starting it
    // (staging, posting the request, in which MPI may move a small message) and waiting for it
    ProfileScope op_scope(const char* op) const {
        ProfileScope s;
        if (profiler().on) {
            ProfilerTime own_time(profiler());
            s.event = profiler().begin(name + " " + op, group_kind(name), op_kind_name(group_kind(name)));
        }
        return s;
    }

    // ---- collectives: each returns a request that wait() finishes --------------------------------------------

    // recv = Σ over ranks of send (count elements); send == recv works in place
    CommRequest all_reduce(const void* send, void* recv, size_t count, DType t) {
        CommRequest r = begin("all_reduce", ring(2.0), count * dtype_size(t));
        ProfileScope starting = op_scope(r.op);
        size_t bytes = count * dtype_size(t);
        if (size == 1) return copy(recv, send, bytes), done(r);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, send, bytes, recv, bytes);
            const void* in = h.send == h.recv ? MPI_IN_PLACE : h.send;
            mpi_check(MPI_Iallreduce(in, h.recv, mpi_count(count), mpi_type(t), mpi_sum(t), mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, send, bytes, recv, bytes);
        nccl_check(ncclAllReduce(d.send, d.recv, count, nccl_type(t), ncclSum, nccl, stream), "all_reduce");
        return nccl_end(r);
    }

    // send holds size·count elements; rank i receives Σ over ranks of piece i (count elements)
    CommRequest reduce_scatter(const void* send, void* recv, size_t count, DType t) {
        CommRequest r = begin("reduce_scatter", ring(1.0), count * size * dtype_size(t));
        ProfileScope starting = op_scope(r.op);
        size_t bytes = count * dtype_size(t);
        if (size == 1) return copy(recv, send, bytes), done(r);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, send, bytes * size, recv, bytes);
            mpi_check(MPI_Ireduce_scatter_block(h.send, h.recv, mpi_count(count), mpi_type(t), mpi_sum(t), mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, send, bytes * size, recv, bytes);
        nccl_check(ncclReduceScatter(d.send, d.recv, count, nccl_type(t), ncclSum, nccl, stream), "reduce_scatter");
        return nccl_end(r);
    }

    // every rank contributes count elements; recv holds them all in rank order (send may be this rank's slot)
    CommRequest all_gather(const void* send, void* recv, size_t count, DType t) {
        CommRequest r = begin("all_gather", ring(1.0), count * size * dtype_size(t));
        ProfileScope starting = op_scope(r.op);
        size_t bytes = count * dtype_size(t);
        if (size == 1) return copy(recv, send, bytes), done(r);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, send, bytes, recv, bytes * size);
            // a piece already in place (send is this rank's slot of recv) must be named so to MPI
            const void* in = r.host_send.empty() && send == (const char*)recv + rank * bytes ? MPI_IN_PLACE : h.send;
            mpi_check(MPI_Iallgather(in, mpi_count(count), mpi_type(t), h.recv, mpi_count(count), mpi_type(t), mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, send, bytes, recv, bytes * size);
        nccl_check(ncclAllGather(d.send, d.recv, count, nccl_type(t), nccl, stream), "all_gather");
        return nccl_end(r);
    }

    CommRequest broadcast(void* buf, size_t count, DType t, int root) {
        CommRequest r = begin("broadcast", rank == root && size > 1 ? 1.0 : 0.0, count * dtype_size(t));
        ProfileScope starting = op_scope(r.op);
        if (size == 1) return done(r);
        size_t bytes = count * dtype_size(t);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, buf, bytes, buf, bytes);
            mpi_check(MPI_Ibcast(h.recv, mpi_count(count), mpi_type(t), root, mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, buf, bytes, buf, bytes);
        nccl_check(ncclBroadcast(d.send, d.recv, count, nccl_type(t), root, nccl, stream), "broadcast");
        return nccl_end(r);
    }

    CommRequest send(const void* buf, size_t count, DType t, int peer) {
        CommRequest r = begin("send", 1.0, count * dtype_size(t));
        ProfileScope starting = op_scope(r.op);
        check_peer(peer, "send");
        r.peer = peer;
        size_t bytes = count * dtype_size(t);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, buf, bytes, nullptr, 0);
            mpi_check(MPI_Isend(h.send, mpi_count(count), mpi_type(t), peer, 0, mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, buf, bytes, nullptr, 0);
        nccl_check(ncclSend(d.send, count, nccl_type(t), peer, nccl, stream), "send");
        return nccl_end(r);
    }

    CommRequest recv(void* buf, size_t count, DType t, int peer) {
        CommRequest r = begin("recv", 0.0, 0);
        ProfileScope starting = op_scope(r.op);
        check_peer(peer, "recv");
        r.peer = peer;
        size_t bytes = count * dtype_size(t);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, nullptr, 0, buf, bytes);
            mpi_check(MPI_Irecv(h.recv, mpi_count(count), mpi_type(t), peer, 0, mpi, &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, nullptr, 0, buf, bytes);
        nccl_check(ncclRecv(d.recv, count, nccl_type(t), peer, nccl, stream), "recv");
        return nccl_end(r);
    }

    // Point-to-point ops that must be in flight together: one rank's part of an exchange with its neighbours
    // (a pipeline stage receiving one buffer while it sends another). NCCL runs a rank's ops in issue order
    // and a send completes only when its receive is posted, so two ranks that each sent to the other before
    // receiving would wait on each other; inside one NCCL group the ops are paired whatever their order. MPI's
    // are nonblocking: the receives are posted first. One request per op, in the order given.
    struct P2P {
        bool send;
        void* buf;
        size_t count;
        DType t;
        int peer;
    };
    std::vector<CommRequest> exchange(const std::vector<P2P>& ops) {
        std::vector<CommRequest> requests(ops.size());
        if (backend != Backend::NCCL) {
            for (bool sends : {false, true})
                for (size_t i = 0; i < ops.size(); i++)
                    if (ops[i].send == sends)
                        requests[i] = sends ? send(ops[i].buf, ops[i].count, ops[i].t, ops[i].peer)
                                            : recv(ops[i].buf, ops[i].count, ops[i].t, ops[i].peer);
            return requests;
        }
        nccl_begin();
        nccl_check(ncclGroupStart(), "exchange");
        for (size_t i = 0; i < ops.size(); i++) {
            const P2P& op = ops[i];
            size_t bytes = op.count * dtype_size(op.t);
            CommRequest& r = requests[i];
            r = begin(op.send ? "send" : "recv", op.send ? 1.0 : 0.0, op.send ? bytes : 0);
            check_peer(op.peer, r.op);
            r.peer = op.peer;
            if (op.send) {
                DeviceView d = nccl_stage(r, op.buf, bytes, nullptr, 0);
                nccl_check(ncclSend(d.send, op.count, nccl_type(op.t), op.peer, nccl, stream), "send");
            } else {
                DeviceView d = nccl_stage(r, nullptr, 0, op.buf, bytes);
                nccl_check(ncclRecv(d.recv, op.count, nccl_type(op.t), op.peer, nccl, stream), "recv");
            }
        }
        nccl_check(ncclGroupEnd(), "exchange");
        for (CommRequest& r : requests) nccl_end(r);
        return requests;
    }

    // rank i sends its piece j (count elements) to rank j, and receives rank j's piece i into its piece j
    CommRequest all_to_all(const void* send, void* recv, size_t count, DType t) {
        std::vector<size_t> counts(size, count), offsets(size);
        for (int i = 0; i < size; i++) offsets[i] = i * count;
        return all_to_allv(send, counts.data(), offsets.data(), recv, counts.data(), offsets.data(), t);
    }

    // counts and offsets in elements, one per rank
    CommRequest all_to_allv(const void* send, const size_t* send_counts, const size_t* send_offsets, void* recv,
                            const size_t* recv_counts, const size_t* recv_offsets, DType t) {
        size_t es = dtype_size(t), span_send = 0, span_recv = 0, away = 0;
        for (int i = 0; i < size; i++) {
            span_send = std::max(span_send, send_offsets[i] + send_counts[i]);
            span_recv = std::max(span_recv, recv_offsets[i] + recv_counts[i]);
            if (i != rank) away += send_counts[i];
        }
        CommRequest r = begin("all_to_all", 1.0, away * es);
        ProfileScope starting = op_scope(r.op);
        if (size == 1) {
            copy((char*)recv + recv_offsets[0] * es, (const char*)send + send_offsets[0] * es, send_counts[0] * es);
            return done(r);
        }
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            HostView h = stage(r, send, span_send * es, recv, span_recv * es);
            std::vector<int> sc(size), so(size), rc(size), ro(size);
            for (int i = 0; i < size; i++) {
                sc[i] = mpi_count(send_counts[i]), so[i] = mpi_count(send_offsets[i]);
                rc[i] = mpi_count(recv_counts[i]), ro[i] = mpi_count(recv_offsets[i]);
            }
            mpi_check(MPI_Ialltoallv(h.send, sc.data(), so.data(), mpi_type(t), h.recv, rc.data(), ro.data(), mpi_type(t), mpi,
                                     &r.mpi));
            return r;
        }
#endif
        nccl_begin();
        DeviceView d = nccl_stage(r, send, span_send * es, recv, span_recv * es);
        nccl_check(ncclGroupStart(), "all_to_all");
        for (int i = 0; i < size; i++) {
            nccl_check(ncclSend((const char*)d.send + send_offsets[i] * es, send_counts[i], nccl_type(t), i, nccl, stream), "all_to_all");
            nccl_check(ncclRecv((char*)d.recv + recv_offsets[i] * es, recv_counts[i], nccl_type(t), i, nccl, stream), "all_to_all");
        }
        nccl_check(ncclGroupEnd(), "all_to_all");
        return nccl_end(r);
    }

    CommRequest barrier() {
        CommRequest r = begin("barrier", 0.0, 0);
        ProfileScope starting = op_scope(r.op);
        if (size == 1) return done(r);
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            mpi_check(MPI_Ibarrier(mpi, &r.mpi));
            return r;
        }
#endif
        // NCCL has no barrier: a one-element all-reduce on the stream stands in for it
        static float* token = nullptr;
        if (!token && cudaMalloc(&token, sizeof(float)) != cudaSuccess) fail("comm: cudaMalloc failed");
        nccl_begin();
        nccl_check(ncclAllReduce(token, token, 1, ncclFloat, ncclSum, nccl, stream), "barrier");
        return nccl_end(r);
    }

    // ---- completion -----------------------------------------------------------------------------------------

    // whether r has finished (finishing it if so); never blocks
    bool test(CommRequest& r) {
        if (!r.pending) return true;
        bool finished = false;
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            int flag = 0;
            mpi_check(MPI_Test(&r.mpi, &flag, MPI_STATUS_IGNORE));
            finished = flag != 0;
        }
#endif
        if (backend == Backend::NCCL) {
            cudaError_t e = cudaEventQuery(r.done_event);
            if (e != cudaSuccess && e != cudaErrorNotReady) fail("comm: %s on group %s: %s", r.op, name.c_str(), cudaGetErrorString(e));
            ncclResult_t async;
            ncclCommGetAsyncError(nccl, &async);
            if (async != ncclSuccess && async != ncclInProgress)
                fail("comm: %s on group %s: NCCL error %s", r.op, name.c_str(), ncclGetErrorString(async));
            finished = e == cudaSuccess;
            if (finished) cudaEventDestroy(r.done_event);
            if (finished) nccl_unstage(r);
        }
        if (finished) {
            if (r.device_recv) copy(r.device_recv, r.host_recv.data(), r.host_recv.size());
            r.pending = false;
            // how long it was in flight, where the host sees it finish (not for a GPU's wait on NCCL)
            if (r.started > 0.0 && profiler().on) profiler().comm_finished(group_kind(name), now_seconds() - r.started);
        }
        return finished;
    }

    // blocks until r has finished, or aborts the job once the deadline passes; in a profiled step the time
    // blocked is the op's exposed time
    void wait(CommRequest& r) {
        ProfileScope waiting = op_scope(r.op);
        wait_until(r, now_seconds() + timeout_s);
    }
    void wait(CommRequest&& r) { wait(r); }

    void wait_until(CommRequest& r, double deadline) {
        // NCCL on device buffers: the compute stream waits for the op on the GPU and the host goes on; the
        // deadline is enforced the next time the host itself waits (settle_device_waits)
        if (backend == Backend::NCCL && r.pending && !r.host_target && r.staging.empty() && !r.device_recv) {
            if (cudaStreamWaitEvent(compute_stream, r.done_event, 0) != cudaSuccess)
                fail("comm: %s on group %s: cannot order the compute stream after it", r.op, name.c_str());
            device_waits.push_back({r.op, r.seq, r.done_event, deadline});
            r.pending = false;
            return;
        }
        settle_device_waits();
        poll_until(r, deadline);
    }
    void poll_until(CommRequest& r, double deadline) {
        for (int spins = 0; !test(r); spins++) {
            if (now_seconds() > deadline) timeout(r);
            if (spins > 100) usleep(spins > 10000 ? 1000 : 20);
        }
    }

    // The ops the GPU was told to wait for (above) must finish within their own deadlines: checked, in the order
    // they were waited for, whenever the host blocks on this group, and at the end of the run.
    struct DeviceWait {
        const char* op;
        uint64_t seq;
        cudaEvent_t done;
        double deadline;
    };
    std::vector<DeviceWait> device_waits;
    void settle_device_waits() {
        for (DeviceWait& w : device_waits) {
            CommRequest r;
            r.op = w.op;
            r.seq = w.seq;
            r.pending = true;
            r.done_event = w.done;
            poll_until(r, w.deadline);  // r holds no host buffers: test() polls the event and destroys it
        }
        device_waits.clear();
    }

    // The world rank of this group's rank r, or -1 where the comm layer cannot tell (a NCCL group split from the
    // world keeps no map back to it).
    int world_rank_of(int r) const {
        if (name == "world") return r;
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            MPI_Group group, world;
            int found = -1;
            MPI_Comm_group(mpi, &group);
            MPI_Comm_group(MPI_COMM_WORLD, &world);
            MPI_Group_translate_ranks(group, 1, &r, world, &found);
            MPI_Group_free(&group);
            MPI_Group_free(&world);
            return found == MPI_UNDEFINED ? -1 : found;
        }
#endif
        return -1;
    }

    // Only the ranks whose own wait runs out print, each what it can know of the rank that did not arrive: the
    // peer of a send or receive, or the other rank of a two-rank group; of a larger group's collective no rank
    // can tell which one is missing, only that it is among the ranks that print no such line.
    [[noreturn]] void timeout(const CommRequest& r) {
        int missing = r.peer >= 0 ? r.peer : size == 2 ? 1 - rank : -1;
        int missing_world = missing >= 0 ? world_rank_of(missing) : -1;
        std::string who =
            missing < 0 ? strfmt("one of the other %d ranks of the group did not arrive (a collective cannot tell "
                                 "which; it is among the ranks that print no such line)", size - 1)
            : missing_world < 0 ? strfmt("waiting for rank %d of the group", missing)
                                : strfmt("waiting for rank %d of the group, rank %d of the job", missing, missing_world);
        fprintf(stderr, "train_gpt: rank %d: comm timeout: %s #%llu on group %s (rank %d of %d) unfinished after %.0f s, "
                "%s; aborting the job\n", world_rank, r.op, (unsigned long long)r.seq, name.c_str(), rank, size,
                timeout_s, who.c_str());
        fflush(stderr);
        if (backend == Backend::NCCL) ncclCommAbort(nccl);
#ifdef LLM5D_MPI
        int up = 0;
        MPI_Initialized(&up);
        if (up) MPI_Abort(MPI_COMM_WORLD, 3);
#endif
        _exit(3);
    }

    // a group of the ranks that pass the same color, ordered by key (collective over this group)
    Comm split(int color, int key, const std::string& group_name) {
        Comm c;
        c.backend = backend;
        c.name = group_name;
        c.world_rank = world_rank;
        c.timeout_s = timeout_s;
        c.compute_stream = compute_stream;
        if (size == 1) return c;
#ifdef LLM5D_MPI
        if (backend == Backend::MPI) {
            // MPI_Comm_split blocks; a barrier first puts it under the deadline
            wait(barrier());
            mpi_check(MPI_Comm_split(mpi, color, key, &c.mpi));
            MPI_Comm_rank(c.mpi, &c.rank);
            MPI_Comm_size(c.mpi, &c.size);
            return c;
        }
#endif
        nccl_check(ncclCommSplit(nccl, color, key, &c.nccl, nullptr), "split");
        ncclCommUserRank(c.nccl, &c.rank);
        ncclCommCount(c.nccl, &c.size);
        if (cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking) != cudaSuccess) fail("comm: cannot create a stream");
        if (c.size == 1) c.backend = Backend::SELF;
        return c;
    }

   private:
    // A copy that may involve device memory runs on the compute stream, after the kernels queued before it, and
    // is finished when this returns (so a host source may be reused, and a device result read by later kernels).
    void copy(void* dst, const void* src, size_t bytes) {
        if (bytes == 0 || dst == src) return;
        if (is_device_pointer(dst) || is_device_pointer(src)) {
            if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, compute_stream) != cudaSuccess ||
                cudaStreamSynchronize(compute_stream) != cudaSuccess)
                fail("comm: a copy of %zu bytes on group %s failed", bytes, name.c_str());
        } else {
            memmove(dst, src, bytes);
        }
    }
    CommRequest done(CommRequest& r) {
        r.pending = false;
        return r;
    }
    void check_peer(int peer, const char* op) {
        if (peer < 0 || peer >= size || peer == rank)
            fail("comm: %s to rank %d in group %s of %d ranks (this is rank %d)", op, peer, name.c_str(), size, rank);
    }
#ifdef LLM5D_MPI
    static void mpi_check(int err) {
        if (err != MPI_SUCCESS) {
            char text[MPI_MAX_ERROR_STRING];
            int len = 0;
            MPI_Error_string(err, text, &len);
            fail("comm: MPI error: %s", text);
        }
    }
    static int mpi_count(size_t n) {
        if (n > (size_t)INT32_MAX) fail("comm: %zu elements is more than one MPI call can carry", n);
        return (int)n;
    }
    // device buffers go through host copies: send's content now, recv's back when the op completes; returns the
    // buffers the MPI call works on
    struct HostView {
        const void* send;
        void* recv;
    };
    HostView stage(CommRequest& r, const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
        HostView h{send, recv};
        if (send && is_device_pointer(send)) {
            r.host_send.resize(send_bytes);
            copy(r.host_send.data(), send, send_bytes);  // waits for the kernels that wrote send
            h.send = r.host_send.data();
        }
        if (recv && is_device_pointer(recv)) {
            r.device_recv = recv;
            if (send == recv) {  // in place: one host copy serves as both, as long as the longer of the two
                r.host_recv.swap(r.host_send);
                r.host_recv.resize(std::max(send_bytes, recv_bytes));
                h.send = r.host_recv.data();
            } else {
                r.host_recv.resize(recv_bytes);
            }
            h.recv = r.host_recv.data();
        }
        return h;
    }
#endif
    // NCCL moves device memory only: host buffers are copied into device buffers of the request's own, on the
    // communication stream (a host send buffer is free again when this returns); a host recv buffer gets its
    // result in nccl_unstage, when the op has completed. Returns the buffers the NCCL call works on.
    struct DeviceView {
        const void* send;
        void* recv;
    };
    DeviceView nccl_stage(CommRequest& r, const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
        auto device_buffer = [&](size_t bytes) {
            void* p = nullptr;
            if (cudaMallocAsync(&p, bytes ? bytes : 1, stream) != cudaSuccess) fail("comm: cannot stage %zu bytes on the GPU", bytes);
            r.staging.push_back(p);
            return p;
        };
        DeviceView d{send, recv};
        if (send && !is_device_pointer(send)) {
            void* p = device_buffer(send_bytes);
            if (cudaMemcpyAsync(p, send, send_bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) fail("comm: staging failed");
            d.send = p;
        }
        if (recv && !is_device_pointer(recv)) {
            d.recv = r.staged_recv = device_buffer(recv_bytes);
            r.host_target = recv;
            r.staged_bytes = recv_bytes;
        }
        return d;
    }
    void nccl_unstage(CommRequest& r) {
        if (r.host_target &&
            (cudaMemcpyAsync(r.host_target, r.staged_recv, r.staged_bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
             cudaStreamSynchronize(stream) != cudaSuccess))
            fail("comm: %s on group %s: copying the result to the host failed", r.op, name.c_str());
        for (void* p : r.staging) cudaFreeAsync(p, stream);
        r.staging.clear();
        r.host_target = nullptr;
    }
    static ncclDataType_t nccl_type(DType t) {
        switch (t) {
            case DType::F32: return ncclFloat32;
            case DType::F64: return ncclFloat64;
            case DType::I32: return ncclInt32;
            case DType::U8: return ncclUint8;
            default: return ncclBfloat16;
        }
    }
    void nccl_check(ncclResult_t e, const char* op) {
        if (e != ncclSuccess && e != ncclInProgress) fail("comm: NCCL %s on group %s: %s", op, name.c_str(), ncclGetErrorString(e));
    }
    // the op waits for what the compute stream has queued so far
    void nccl_begin() {
        cudaEvent_t ready;
        cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
        cudaEventRecord(ready, compute_stream);
        cudaStreamWaitEvent(stream, ready, 0);
        cudaEventDestroy(ready);
    }
    CommRequest nccl_end(CommRequest& r) {
        cudaEventCreateWithFlags(&r.done_event, cudaEventDisableTiming);
        cudaEventRecord(r.done_event, stream);
        return r;
    }
};

// ---------------------------------------------------------------------------------------------------------
// starting the job's world communicator

// how this process was launched: by mpirun (or an MPI-aware srun), by a plain srun, or alone
struct Launch {
    int rank = 0, world = 1;
    bool under_mpi = false;
};

inline Launch detect_launch() {
    Launch l;
    auto env_int = [](const char* name, int* out) {
        const char* v = getenv(name);
        if (!v || !*v) return false;
        *out = atoi(v);
        return true;
    };
    if (env_int("OMPI_COMM_WORLD_SIZE", &l.world) || env_int("PMI_SIZE", &l.world) || env_int("PMIX_SIZE", &l.world)) {
        l.under_mpi = true;
        if (!env_int("OMPI_COMM_WORLD_RANK", &l.rank) && !env_int("PMI_RANK", &l.rank)) env_int("PMIX_RANK", &l.rank);
    } else if (env_int("SLURM_NTASKS", &l.world)) {
        env_int("SLURM_PROCID", &l.rank);
    }
    if (l.world < 1 || l.rank < 0 || l.rank >= l.world) fail("launch: rank %d of %d from the environment is invalid", l.rank, l.world);
    return l;
}

struct CommSettings {
    std::string backend = "mpi";   // mpi | nccl
    std::string init = "mpi";      // nccl bootstrap: mpi | tcp | file
    std::string address;           // tcp: HOST:PORT where rank 0 listens
    std::string dir;               // file: a directory every rank sees, fresh for each job
    double timeout_s = 600.0;
};

// NCCL's unique id travels from rank 0 to every rank through MPI, a TCP socket, or a file
inline ncclUniqueId nccl_id_over_tcp(const Launch& l, const std::string& address, double deadline) {
    size_t colon = address.rfind(':');
    if (colon == std::string::npos) fail("--comm-address %s: expected HOST:PORT", address.c_str());
    std::string host = address.substr(0, colon), port = address.substr(colon + 1);
    addrinfo hints = {}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = l.rank == 0 ? AI_PASSIVE : 0;
    if (getaddrinfo(l.rank == 0 ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 || !res)
        fail("--comm-address %s: cannot resolve", address.c_str());
    ncclUniqueId id;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (l.rank == 0) {
        if (ncclGetUniqueId(&id) != ncclSuccess) fail("comm: ncclGetUniqueId failed");
        int yes = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, l.world) != 0)
            fail("--comm-address %s: cannot listen (%s)", address.c_str(), strerror(errno));
        for (int served = 1; served < l.world; served++) {
            timeval tv{(long)std::max(1.0, deadline - now_seconds()), 0};
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
            int peer = accept(fd, nullptr, nullptr);
            if (peer < 0) fail("--comm-address %s: only %d of %d ranks connected before the deadline", address.c_str(), served, l.world);
            if (write(peer, &id, sizeof(id)) != (ssize_t)sizeof(id)) fail("--comm-address %s: send failed", address.c_str());
            close(peer);
        }
    } else {
        while (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
            if (now_seconds() > deadline) fail("--comm-address %s: rank 0 never answered", address.c_str());
            close(fd);
            usleep(200000);
            fd = socket(AF_INET, SOCK_STREAM, 0);
        }
        if (read(fd, &id, sizeof(id)) != (ssize_t)sizeof(id)) fail("--comm-address %s: short read", address.c_str());
    }
    close(fd);
    freeaddrinfo(res);
    return id;
}

inline ncclUniqueId nccl_id_over_file(const Launch& l, const std::string& dir, double deadline) {
    std::string path = dir + "/llm5d_nccl_id";
    ncclUniqueId id;
    if (l.rank == 0) {
        if (ncclGetUniqueId(&id) != ncclSuccess) fail("comm: ncclGetUniqueId failed");
        write_file_whole(path, &id, sizeof(id));
    } else {
        while (!file_exists(path)) {
            if (now_seconds() > deadline) fail("%s: rank 0 never wrote it (is --comm-dir shared by every node?)", path.c_str());
            usleep(100000);
        }
        File f(path, "rb");
        f.read(&id, sizeof(id));
    }
    return id;
}

// the world communicator; MPI is started here when the job was launched through it
inline Comm comm_world(const CommSettings& s) {
    Launch l = detect_launch();
    Comm c;
    c.timeout_s = s.timeout_s;
    c.rank = c.world_rank = l.rank;
    c.size = l.world;
    bool use_mpi = l.under_mpi && (s.backend == "mpi" || s.init == "mpi");
    if (l.world > 1 && !use_mpi && s.backend == "mpi")
        fail("--comm mpi: launched by %s without MPI; start the job with mpirun (or srun --mpi=pmix)", getenv("SLURM_NTASKS") ? "srun" : "a launcher");
#ifdef LLM5D_MPI
    if (use_mpi) {
        int provided;
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
        c.mpi = MPI_COMM_WORLD;
        MPI_Comm_rank(c.mpi, &c.rank);
        MPI_Comm_size(c.mpi, &c.size);
        c.world_rank = c.rank;
    }
#else
    if (use_mpi && l.world > 1) fail("this train_gpt was built without MPI (NO_MPI=1); launch one process, or rebuild with MPI");
#endif
    if (c.size == 1) return c;
    if (s.backend == "mpi") {
        c.backend = Backend::MPI;
        return c;
    }
    double deadline = now_seconds() + s.timeout_s;
    ncclUniqueId id;
    if (s.init == "tcp") {
        id = nccl_id_over_tcp(l, s.address, deadline);
    } else if (s.init == "file") {
        id = nccl_id_over_file(l, s.dir, deadline);
    } else {
        if (!use_mpi)
            fail("--comm-init mpi: NCCL's ranks find each other through MPI, but this job was not launched by mpirun; "
                 "use --comm-init tcp or file");
#ifdef LLM5D_MPI
        if (c.rank == 0 && ncclGetUniqueId(&id) != ncclSuccess) fail("comm: ncclGetUniqueId failed");
        MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
#endif
    }
    c.backend = Backend::NCCL;
    if (ncclCommInitRank(&c.nccl, c.size, id, c.rank) != ncclSuccess) fail("comm: ncclCommInitRank failed on rank %d", c.rank);
    if (cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking) != cudaSuccess) fail("comm: cannot create a stream");
    return c;
}

// the end of a clean run: NCCL communicators destroyed, MPI finalized
inline void comm_finalize(Comm& c) {
    c.settle_device_waits();
    if (c.nccl) ncclCommDestroy(c.nccl);
#ifdef LLM5D_MPI
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down) MPI_Finalize();
#endif
}

// a failed rank takes the others down with it instead of leaving them waiting for the deadline
inline void comm_abort_job(int code) {
#ifdef LLM5D_MPI
    int up = 0, down = 0, size = 1;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down) {
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
    }
#endif
    (void)code;
}

// comm_bench: a collective benchmark in the manner of nccl-tests, on llm5d's own communicator (llmc/comm.cuh).
//
// For each op (all_reduce, reduce_scatter, all_gather, all_to_all, sendrecv: a ring neighbour exchange) and each
// size from --min-bytes to --max-bytes, doubling, it prints one row: the size in bytes, the element count (fp32),
// the time of one op in microseconds (the mean over --iters, the slowest rank's), the algorithm bandwidth (size /
// time) and the bus bandwidth (algbw times nccl-tests' factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather and
// all_to_all (n-1)/n; sendrecv 1), and the error of the first iteration's result against the expected one.
//
// The size S is, as in nccl-tests, the whole buffer: all_reduce and sendrecv move S bytes per rank; reduce_scatter
// reduces an S-byte buffer into S/n bytes per rank; all_gather gathers S/n bytes per rank into S bytes; all_to_all
// exchanges S bytes per rank in n pieces.
//
// The inputs are small integers held in floats, so every sum is exact and the error column must read 0; any
// other value is a broken link, a broken library or a broken communicator, and the run exits with status 1.
//
//   mpirun -np 4 dev/comm/comm_bench --backend mpi                 host buffers, MPI collectives
//   mpirun -np 8 dev/comm/comm_bench --backend nccl                device buffers, NCCL (bootstrapped over MPI)
//   srun ... dev/comm/comm_bench --backend nccl --comm-init tcp --comm-address HOST:PORT   (or file --comm-dir DIR)
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/utils.h"

static const char* BENCH_USAGE =
    "usage: comm_bench [flags]   (launch the ranks with mpirun, or srun with --comm-init tcp|file)\n"
    "  --backend mpi|nccl      communicator backend: host buffers (mpi) or device buffers (nccl)  [mpi]\n"
    "  --min-bytes N           smallest size; K, M, G suffixes are powers of 1024                 [1K]\n"
    "  --max-bytes N           largest size                                  [1G for nccl, 64M for mpi]\n"
    "  --iters N               timed iterations per size                                          [20]\n"
    "  --warmup N              untimed iterations per size (the first one is checked)             [5]\n"
    "  --ops LIST              comma-separated: all_reduce,reduce_scatter,all_gather,all_to_all,sendrecv [all]\n"
    "  --check 0|1             check the first iteration's result                                  [1]\n"
    "  --comm-init mpi|tcp|file  how NCCL ranks find each other                                   [mpi]\n"
    "  --comm-address HOST:PORT  --comm-init tcp: where rank 0 listens\n"
    "  --comm-dir DIR          --comm-init file: a directory every rank sees, fresh for each job\n"
    "  --timeout S             abort when one collective waits longer than S seconds              [600]\n"
    "  -h, --help              this text\n";

static const char* ALL_OPS[] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv"};

struct BenchOptions {
    CommSettings comm;
    size_t min_bytes = 1024, max_bytes = 0;  // 0: by backend
    int iters = 20, warmup = 5;
    bool check = true;
    std::vector<std::string> ops;
};

static size_t parse_bytes(const std::string& flag, const std::string& s) {
    char* end;
    errno = 0;
    double v = strtod(s.c_str(), &end);
    std::string suffix = end;
    double mult = suffix.empty() ? 1 : suffix == "K" || suffix == "k" ? 1024.0 : suffix == "M" || suffix == "m" ? 1048576.0
                                       : suffix == "G" || suffix == "g" ? 1073741824.0 : -1;
    if (s.empty() || end == s.c_str() || mult < 0 || !(v > 0) || errno == ERANGE)
        fail("%s %s: expected a positive size in bytes (K, M, G suffixes allowed)", flag.c_str(), s.c_str());
    return (size_t)(v * mult);
}

static int parse_int(const std::string& flag, const std::string& s, int lo) {
    char* end;
    long v = strtol(s.c_str(), &end, 10);
    if (s.empty() || *end || v < lo || v > 1000000000L) fail("%s %s: expected an integer >= %d", flag.c_str(), s.c_str(), lo);
    return (int)v;
}

static BenchOptions parse_bench_options(int argc, char** argv) {
    BenchOptions o;
    for (int i = 1; i < argc; i++) {
        std::string f = argv[i];
        if (f == "-h" || f == "--help") {
            fputs(BENCH_USAGE, stdout);
            exit(0);
        }
        if (i + 1 >= argc) fail("%s: unknown flag or missing value (see --help)", f.c_str());
        std::string v = argv[++i];
        if (f == "--backend") {
            if (v != "mpi" && v != "nccl") fail("--backend %s: expected mpi or nccl", v.c_str());
            o.comm.backend = v;
        } else if (f == "--min-bytes") {
            o.min_bytes = parse_bytes(f, v);
        } else if (f == "--max-bytes") {
            o.max_bytes = parse_bytes(f, v);
        } else if (f == "--iters") {
            o.iters = parse_int(f, v, 1);
        } else if (f == "--warmup") {
            o.warmup = parse_int(f, v, 0);
        } else if (f == "--check") {
            o.check = parse_int(f, v, 0) != 0;
        } else if (f == "--ops") {
            std::stringstream ss(v);
            std::string op;
            while (std::getline(ss, op, ',')) {
                if (std::find(std::begin(ALL_OPS), std::end(ALL_OPS), op) == std::end(ALL_OPS))
                    fail("--ops %s: unknown op %s (all_reduce, reduce_scatter, all_gather, all_to_all, sendrecv)", v.c_str(), op.c_str());
                o.ops.push_back(op);
            }
        } else if (f == "--comm-init") {
            if (v != "mpi" && v != "tcp" && v != "file") fail("--comm-init %s: expected mpi, tcp or file", v.c_str());
            o.comm.init = v;
        } else if (f == "--comm-address") {
            o.comm.address = v;
        } else if (f == "--comm-dir") {
            o.comm.dir = v;
        } else if (f == "--timeout") {
            o.comm.timeout_s = atof(v.c_str());
            if (!(o.comm.timeout_s > 0)) fail("--timeout %s: expected a positive number of seconds", v.c_str());
        } else {
            fail("%s: unknown flag (see --help)", f.c_str());
        }
    }
    if (o.ops.empty()) o.ops.assign(std::begin(ALL_OPS), std::end(ALL_OPS));
    if (o.max_bytes == 0) o.max_bytes = o.comm.backend == "nccl" ? (1ull << 30) : (64ull << 20);
    if (o.min_bytes > o.max_bytes) fail("--min-bytes %zu is larger than --max-bytes %zu", o.min_bytes, o.max_bytes);
    if (o.comm.init == "tcp" && o.comm.address.empty()) fail("--comm-init tcp needs --comm-address HOST:PORT");
    if (o.comm.init == "file" && o.comm.dir.empty()) fail("--comm-init file needs --comm-dir DIR");
    if (o.comm.init != "mpi" && o.comm.backend != "nccl") fail("--comm-init %s: only NCCL bootstraps without MPI; add --backend nccl", o.comm.init.c_str());
    return o;
}

// ---------------------------------------------------------------------------------------------------------
// buffers: host memory for MPI, device memory for NCCL

struct Buffer {
    bool device = false;
    size_t bytes = 0;
    float* p = nullptr;
    Buffer(size_t n, bool on_device) : device(on_device), bytes(n) {
        if (bytes == 0) return;
        if (device) {
            if (cudaMalloc(&p, bytes) != cudaSuccess) fail("cudaMalloc of %zu bytes failed", bytes);
        } else {
            p = (float*)malloc(bytes);
            if (!p) fail("malloc of %zu bytes failed", bytes);
        }
    }
    ~Buffer() {
        if (device) cudaFree(p);
        else free(p);
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    void upload(const void* src, size_t n) {
        if (device) {
            if (cudaMemcpy(p, src, n, cudaMemcpyHostToDevice) != cudaSuccess) fail("cudaMemcpy to the device failed");
        } else {
            memcpy(p, src, n);
        }
    }
    void download(void* dst, size_t n) const {
        if (device) {
            if (cudaMemcpy(dst, p, n, cudaMemcpyDeviceToHost) != cudaSuccess) fail("cudaMemcpy from the device failed");
        } else {
            memcpy(dst, p, n);
        }
    }
    void poison(size_t n) {  // all bits set: NaN, which never passes the check
        if (device) {
            if (cudaMemset(p, 0xff, n) != cudaSuccess) fail("cudaMemset failed");
        } else {
            memset(p, 0xff, n);
        }
    }
};

// element i of rank r's send buffer: a small integer, so that sums over ranks are exact in fp32
static const int PERIOD = 17;
static inline float value(int r, size_t i) { return (float)((int)(((size_t)r * 7 + i) % PERIOD) - 8); }

// ---------------------------------------------------------------------------------------------------------

struct Sizes {
    size_t send_count, recv_count;  // elements in this rank's send and receive buffers
    size_t count;                   // the count argument of the collective
    double bus_factor;
};

static bool op_sizes(const std::string& op, size_t bytes, int n, Sizes* s) {
    size_t total = bytes / sizeof(float);
    if (op == "all_reduce" || op == "sendrecv") {
        *s = {total, total, total, op == "sendrecv" ? 1.0 : 2.0 * (n - 1) / n};
    } else {
        size_t piece = total / n;
        if (op == "reduce_scatter") *s = {piece * n, piece, piece, (double)(n - 1) / n};
        else if (op == "all_gather") *s = {piece, piece * n, piece, (double)(n - 1) / n};
        else *s = {piece * n, piece * n, piece, (double)(n - 1) / n};
    }
    return s->count > 0;
}

struct Bench {
    Comm& c;
    const BenchOptions& o;
    bool device;
    Buffer send, recv;
    std::vector<float> host;  // staging for fills and checks
    Buffer stats;             // per-rank (time, error) gathered from every rank

    Bench(Comm& comm, const BenchOptions& opts, bool on_device)
        : c(comm), o(opts), device(on_device), send(opts.max_bytes, on_device), recv(opts.max_bytes, on_device),
          host(opts.max_bytes / sizeof(float)), stats(2 * sizeof(double) * (comm.size + 1), on_device) {
        for (size_t i = 0; i < host.size(); i++) host[i] = value(c.rank, i);
        send.upload(host.data(), host.size() * sizeof(float));
    }

    // starts one op and waits for it (MPI), or only starts it (NCCL, whose ops queue on one stream)
    void run_once(const std::string& op, const Sizes& s, bool wait_now) {
        std::vector<CommRequest> reqs;
        if (op == "all_reduce") reqs.push_back(c.all_reduce(send.p, recv.p, s.count, DType::F32));
        else if (op == "reduce_scatter") reqs.push_back(c.reduce_scatter(send.p, recv.p, s.count, DType::F32));
        else if (op == "all_gather") reqs.push_back(c.all_gather(send.p, recv.p, s.count, DType::F32));
        else if (op == "all_to_all") reqs.push_back(c.all_to_all(send.p, recv.p, s.count, DType::F32));
        else {
            // send to the next rank and receive from the previous one, both in flight at once: under NCCL the two
            // calls form one group, which NCCL needs to run them concurrently
            int next = (c.rank + 1) % c.size, prev = (c.rank + c.size - 1) % c.size;
            if (c.backend == Backend::NCCL) ncclGroupStart();
            reqs.push_back(c.send(send.p, s.count, DType::F32, next));
            reqs.push_back(c.recv(recv.p, s.count, DType::F32, prev));
            if (c.backend == Backend::NCCL) {
                ncclGroupEnd();
                // the requests' events were recorded before the group launched: wait on the stream instead
                for (CommRequest& r : reqs) c.wait(r);
                reqs.clear();
                if (wait_now && cudaStreamSynchronize(c.stream) != cudaSuccess) fail("sendrecv: stream synchronization failed");
            }
        }
        if (c.backend == Backend::NCCL && !wait_now) {
            for (CommRequest& r : reqs)
                if (r.done_event) cudaEventDestroy(r.done_event);  // completion is awaited on the stream
            return;
        }
        for (CommRequest& r : reqs) c.wait(r);
    }

    void drain() {
        if (c.backend == Backend::NCCL && cudaStreamSynchronize(c.stream) != cudaSuccess) fail("stream synchronization failed");
    }

    // the largest absolute difference between what arrived and what should have; inf for a NaN
    double check(const std::string& op, const Sizes& s) {
        int n = c.size, me = c.rank;
        std::vector<float> got(s.recv_count);
        recv.download(got.data(), got.size() * sizeof(float));
        // Σ over ranks of value(r, i) depends only on i mod PERIOD
        float sums[PERIOD];
        for (int k = 0; k < PERIOD; k++) {
            sums[k] = 0;
            for (int r = 0; r < n; r++) sums[k] += value(r, k);
        }
        double err = 0;
        for (size_t i = 0; i < got.size(); i++) {
            float want;
            if (op == "all_reduce") want = sums[i % PERIOD];
            else if (op == "reduce_scatter") want = sums[(me * s.count + i) % PERIOD];
            else if (op == "all_gather") want = value((int)(i / s.count), i % s.count);
            else if (op == "all_to_all") want = value((int)(i / s.count), me * s.count + i % s.count);
            else want = value((me + n - 1) % n, i);
            double d = fabs((double)got[i] - want);
            if (!(d <= err)) err = std::isnan(d) ? INFINITY : d;
        }
        return err;
    }

    // (time, error) of every rank, so rank 0 can print the slowest time and the worst error
    void gather(double t, double err, double* max_t, double* max_err) {
        double mine[2] = {t, err};
        std::vector<double> all(2 * c.size);
        if (device) {
            double* d = (double*)stats.p;
            if (cudaMemcpy(d + 2 * c.size, mine, sizeof(mine), cudaMemcpyHostToDevice) != cudaSuccess) fail("cudaMemcpy failed");
            c.wait(c.all_gather(d + 2 * c.size, d, 2, DType::F64));
            drain();
            if (cudaMemcpy(all.data(), d, all.size() * sizeof(double), cudaMemcpyDeviceToHost) != cudaSuccess) fail("cudaMemcpy failed");
        } else {
            c.wait(c.all_gather(mine, all.data(), 2, DType::F64));
        }
        *max_t = *max_err = 0;
        for (int r = 0; r < c.size; r++) {
            *max_t = std::max(*max_t, all[2 * r]);
            *max_err = std::max(*max_err, all[2 * r + 1]);
        }
    }

    // one table for one op; returns the number of sizes whose check failed
    int run_op(const std::string& op) {
        if (c.rank == 0) {
            printf("#\n# %s   (%d ranks, fp32%s)\n", op.c_str(), c.size, op == "all_reduce" || op == "reduce_scatter" ? ", sum" : "");
            printf("# %12s %12s %12s %12s %12s %10s\n", "size(B)", "count(elts)", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "error");
        }
        if (op == "sendrecv" && c.size == 1) {
            if (c.rank == 0) printf("# skipped: sendrecv needs at least 2 ranks\n");
            return 0;
        }
        int failures = 0, rows = 0;
        double busbw_sum = 0;
        for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
            Sizes s;
            if (!op_sizes(op, bytes, c.size, &s)) continue;  // fewer elements than ranks
            size_t real_bytes = std::max(s.send_count, s.recv_count) * sizeof(float);
            // first iteration into a poisoned buffer, checked
            double err = 0;
            recv.poison(s.recv_count * sizeof(float));
            run_once(op, s, true);
            if (o.check) err = check(op, s);
            for (int i = 1; i < o.warmup; i++) run_once(op, s, c.backend != Backend::NCCL);
            drain();
            c.wait(c.barrier());
            drain();
            double t0 = now_seconds();
            for (int i = 0; i < o.iters; i++) run_once(op, s, c.backend != Backend::NCCL);
            drain();
            double t = (now_seconds() - t0) / o.iters;
            double max_t, max_err;
            gather(t, err, &max_t, &max_err);
            double algbw = real_bytes / max_t / 1e9, busbw = algbw * s.bus_factor;
            if (max_err != 0) failures++;
            busbw_sum += busbw;
            rows++;
            if (c.rank == 0) {
                printf("  %12zu %12zu %12.1f %12.3f %12.3f %10.3g\n", real_bytes, real_bytes / sizeof(float), max_t * 1e6, algbw, busbw,
                       max_err);
                fflush(stdout);
            }
            if (bytes > o.max_bytes / 2) break;  // no overflow past the largest size
        }
        if (c.rank == 0 && rows > 0) printf("# %s: average bus bandwidth %.3f GB/s over %d sizes\n", op.c_str(), busbw_sum / rows, rows);
        return failures;
    }
};

static int local_rank() {
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
        const char* v = getenv(name);
        if (v && *v) return atoi(v);
    }
    return 0;
}

int main(int argc, char** argv) {
    Comm c;
    try {
        BenchOptions o = parse_bench_options(argc, argv);
        bool nccl = o.comm.backend == "nccl";
        int gpus = 0;
        if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
        if (nccl) {
            if (gpus == 0) {
                if (detect_launch().rank == 0) fprintf(stderr, "comm_bench: --backend nccl needs a GPU, and none is visible\n");
                return 1;
            }
            if (cudaSetDevice(local_rank() % gpus) != cudaSuccess) fail("cudaSetDevice(%d) failed", local_rank() % gpus);
        }
        c = comm_world(o.comm);
        if (c.rank == 0) {
            char host[256] = "";
            gethostname(host, sizeof(host));
            printf("# comm_bench: backend %s%s, %d ranks, sizes %zu..%zu bytes, %d warmup + %d timed iterations, check %s\n",
                   o.comm.backend.c_str(), nccl ? (" (init " + o.comm.init + ")").c_str() : "", c.size, o.min_bytes, o.max_bytes,
                   o.warmup, o.iters, o.check ? "on" : "off");
            printf("# rank 0 on %s%s\n", host, nccl ? strfmt(", GPU %d of %d", local_rank() % gpus, gpus).c_str() : "");
            printf("# time: mean over iterations, slowest rank; algbw = size / time; busbw = algbw x (all_reduce 2(n-1)/n,\n"
                   "# reduce_scatter, all_gather, all_to_all (n-1)/n, sendrecv 1); error: max |result - expected| of the first\n"
                   "# iteration, over ranks (0 = exact)\n");
            fflush(stdout);
        }
        int failures = 0;
        {
            Bench bench(c, o, nccl);
            for (const std::string& op : o.ops) failures += bench.run_op(op);
        }
        if (c.rank == 0) {
            printf("#\n# %s\n", failures ? strfmt("FAILED: %d sizes returned wrong results", failures).c_str() : "all results correct");
            fflush(stdout);
        }
        comm_finalize(c);
        return failures ? 1 : 0;
    } catch (const std::exception& e) {
        fprintf(stderr, "comm_bench: rank %d: %s\n", c.world_rank, e.what());
        fflush(stderr);
        comm_abort_job(1);
        return 1;
    }
}

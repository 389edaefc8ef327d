// Tensor parallelism with sequence parallelism, in Megatron-LM's layout (the Playbook's "Tensor Parallelism"
// and "Sequence Parallelism" sections). The tp ranks of a group split every layer:
//   attention  QKV column-parallel: each rank holds the Q, K and V rows of NH/tp heads and runs attention on
//              them alone; the output projection row-parallel (its input columns split the same way). With
//              fewer key/value heads than ranks (grouped-query attention, tp a multiple of KV), each rank holds
//              the one its query heads read, tp/KV ranks the same one; their partial gradients of it are summed
//              over those ranks (llmc/zero.cuh) and counted once in the gradient norm.
//   MLP        fc column-parallel (4C/tp hidden units per rank), GELU local, fc projection row-parallel.
//   embedding  the token embedding (and so the tied classifier) split by rows of the padded vocab; a lookup
//              masks the rows a rank does not hold, and the cross-entropy combines each rank's max, sum of
//              exponentials and target logit, so the full logits never exist anywhere.
// Between the parallel regions the activations are either whole on every rank, or (sequence parallelism)
// split by token rows, so layernorm and the residual adds run on BT/tp rows. Entering a column-parallel layer
// needs the whole input: an all-gather (sp) or nothing (no sp); its backward reduces the input gradient:
// reduce-scatter (sp) or all-reduce. Leaving a row-parallel layer sums the partial outputs: reduce-scatter (sp)
// or all-reduce; its backward gathers the output gradient: all-gather (sp) or nothing. Each all-reduce is a
// reduce-scatter followed by an all-gather, so every rank ends with the same bits and the volume is the same
// with and without sp.
//
// Under sp, the layernorm parameters and wpe see only a rank's rows, so their gradients are partial sums,
// added over the group (in rank order, identically on every rank) before data parallelism reduces them.
//
// On both devices: the collectives take the model's buffers where they live, and the few element-wise steps
// tp adds around the layers (the row-parallel bias, the masked lookup, the cross-entropy's statistics, the
// rank-order sums) are each a CPU loop with its CUDA kernel beside it, picked by the buffer's type as the
// layer headers pick theirs.
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "llmc/classifier.cuh"
#include "llmc/comm.cuh"
#include "llmc/device.cuh"
#include "llmc/encoder.cuh"
#include "llmc/fp8.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

struct TPSpec {
    int size = 1, rank = 0;
    bool sp = false;
};

// the element type of a buffer, as the communicator names it
template <typename E>
constexpr DType dtype_of() {
    return std::is_same_v<E, float> ? DType::F32 : std::is_same_v<E, double> ? DType::F64 : DType::BF16;
}

// A transient buffer of n elements of E on the device of the storage type floatX, for what a collective
// gathers: a vector on the CPU; stream-ordered device memory on the GPU, freed in stream order after the
// kernels queued to use it.
template <typename floatX, typename E>
struct DeviceTemp {
    std::vector<E> host;
    E* data = nullptr;
    explicit DeviceTemp(size_t n) {
        if constexpr (device_of<floatX> == Device::CUDA) cuda_check(cudaMallocAsync(&data, std::max<size_t>(n, 1) * sizeof(E), main_stream()));
        else host.resize(n), data = host.data();
    }
    ~DeviceTemp() {
        if constexpr (device_of<floatX> == Device::CUDA) cudaFreeAsync(data, main_stream());
    }
    DeviceTemp(const DeviceTemp&) = delete;
    DeviceTemp& operator=(const DeviceTemp&) = delete;
};

// ----------------------------------------------------------------------------------------------------------
// The element-wise steps, each a CPU loop and its CUDA kernel (one thread per element, grid-stride, fp32
// arithmetic on bf16 storage, on the compute stream).

// out (R×OC) = sum + bias on every row; sum may be out
inline void add_bias_rows(float* out, const float* sum, const float* bias, long R, int OC) {
#pragma omp parallel for
    for (long r = 0; r < R; r++)
        for (int o = 0; o < OC; o++) out[r * OC + o] = sum[r * OC + o] + bias[o];
}
static __global__ void add_bias_rows_kernel(bf16* out, const bf16* sum, const bf16* bias, long R, int OC) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < R * OC; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(sum[i]) + __bfloat162float(bias[i % OC]));
}
inline void add_bias_rows(bf16* out, const bf16* sum, const bf16* bias, long R, int OC) {
    launch_elementwise(add_bias_rows_kernel, R * OC, out, sum, bias, R, OC);
}

// out[i] = wte row (tokens[i] - vlo) when this rank holds it (rows [0, Vl)), else zeros
inline void masked_lookup(float* out, const int* tokens, const float* wte, long BT, int C, long vlo, int Vl) {
#pragma omp parallel for
    for (long i = 0; i < BT; i++) {
        long row = tokens[i] - vlo;
        float* o = out + i * C;
        if (row >= 0 && row < Vl) memcpy(o, wte + row * C, C * sizeof(float));
        else memset(o, 0, C * sizeof(float));
    }
}
static __global__ void masked_lookup_kernel(bf16* out, const int* tokens, const bf16* wte, long BT, int C, long vlo, int Vl) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C; i += (long)gridDim.x * blockDim.x) {
        long row = tokens[i / C] - vlo;
        out[i] = row >= 0 && row < Vl ? wte[row * C + i % C] : __float2bfloat16(0.0f);
    }
}
inline void masked_lookup(bf16* out, const int* tokens, const bf16* wte, long BT, int C, long vlo, int Vl) {
    launch_elementwise(masked_lookup_kernel, BT * C, out, tokens, wte, BT, C, vlo, Vl);
}

// out (R rows from token row `first`) = sum + wpe at each row's position; sum may be out
inline void add_positions(float* out, const float* sum, const float* wpe, long R, long first, int T, int C) {
#pragma omp parallel for
    for (long r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r * C + c] = sum[r * C + c] + wpe[((first + r) % T) * C + c];
}
static __global__ void add_positions_kernel(bf16* out, const bf16* sum, const bf16* wpe, long R, long first, int T, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < R * C; i += (long)gridDim.x * blockDim.x) {
        long r = i / C;
        int c = (int)(i % C);
        out[i] = __float2bfloat16(__bfloat162float(sum[i]) + __bfloat162float(wpe[((first + r) % T) * C + c]));
    }
}
inline void add_positions(bf16* out, const bf16* sum, const bf16* wpe, long R, long first, int T, int C) {
    launch_elementwise(add_positions_kernel, R * C, out, sum, wpe, R, first, T, C);
}

// Per row of this rank's logits (BT×Vl, `real` columns of real tokens), stats[3i..3i+2] = the max, Σ exp(x -
// max) and the target logit (0 where another rank holds the target; max -inf and sum 0 with no real column)
inline void vocab_row_stats(float* stats, const float* logits, const int* targets, long BT, int Vl, int real, long vlo) {
#pragma omp parallel for
    for (long i = 0; i < BT; i++) {
        const float* x = logits + i * Vl;
        float mx = -INFINITY;
        for (int j = 0; j < real; j++) mx = fmaxf(mx, x[j]);
        double s = 0.0;
        for (int j = 0; j < real; j++) s += exp((double)x[j] - mx);
        long t = targets[i] - vlo;
        stats[i * 3] = mx;
        stats[i * 3 + 1] = (float)s;
        stats[i * 3 + 2] = t >= 0 && t < Vl ? (float)x[t] : 0.0f;
    }
}
// a block per row, in two sweeps (the max, then the sum), each reduced over the block in a fixed order
static __global__ void vocab_row_stats_kernel(float* stats, const bf16* logits, const int* targets, int Vl, int real,
                                              long vlo) {
    __shared__ float shared[32];
    long i = blockIdx.x;
    const bf16* x = logits + i * Vl;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < real; j += blockDim.x) mx = fmaxf(mx, __bfloat162float(x[j]));
    mx = warp_max(mx);
    __syncthreads();
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = mx;
    __syncthreads();
    mx = threadIdx.x % 32 < blockDim.x / 32 ? shared[threadIdx.x % 32] : -INFINITY;
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < real; j += blockDim.x) s += expf(__bfloat162float(x[j]) - mx);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        long t = targets[i] - vlo;
        stats[i * 3] = mx;
        stats[i * 3 + 1] = s;
        stats[i * 3 + 2] = t >= 0 && t < Vl ? __bfloat162float(x[t]) : 0.0f;
    }
}
inline void vocab_row_stats(float* stats, const bf16* logits, const int* targets, long BT, int Vl, int real, long vlo) {
    vocab_row_stats_kernel<<<(unsigned int)BT, 256, 0, main_stream()>>>(stats, logits, targets, Vl, real, vlo);
    cuda_check(cudaGetLastError());
}

// every rank's row statistics (all: ranks × BT × 3, rank-major) combined in rank order into each row's log-sum-exp
// and loss
static __host__ __device__ inline void combine_row(float* losses, float* lse, const float* all, long BT, int ranks, long i) {
    float mx = -INFINITY, target = 0.0f;
    for (int r = 0; r < ranks; r++) mx = fmaxf(mx, all[(r * BT + i) * 3]);
    double s = 0.0;
    for (int r = 0; r < ranks; r++) {
        const float* p = &all[(r * BT + i) * 3];
        if (p[1] > 0) s += (double)p[1] * exp((double)p[0] - mx);
        target += p[2];
    }
    lse[i] = (float)(log(s) + mx);
    losses[i] = lse[i] - target;
}
static __global__ void combine_rows_kernel(float* losses, float* lse, const float* all, long BT, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT; i += (long)gridDim.x * blockDim.x)
        combine_row(losses, lse, all, BT, ranks, i);
}
// the combined rows and the mean loss (on the GPU reading it waits for the forward: the pass's one read)
template <typename floatX>
inline float combine_rows(float* losses, float* lse, const float* all, long BT, int ranks) {
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(combine_rows_kernel, BT, losses, lse, all, BT, ranks);
        return mean_loss_from_device(losses, BT);
    } else {
        double total = 0.0;
        for (long i = 0; i < BT; i++) {
            combine_row(losses, lse, all, BT, ranks, i);
            total += losses[i];
        }
        return (float)(total / BT);
    }
}

// logits (BT×Vl, global column vlo + j) become (softmax - onehot)·dloss on real columns, 0 on padding
inline void vocab_crossentropy_grad(float* logits, const float* lse, const int* targets, long BT, int V, int Vl, long vlo,
                                    float dloss) {
#pragma omp parallel for
    for (long i = 0; i < BT; i++) {
        float* x = logits + i * Vl;
        for (int j = 0; j < Vl; j++) {
            long v = vlo + j;
            x[j] = v < V ? (expf(x[j] - lse[i]) - (v == targets[i] ? 1.0f : 0.0f)) * dloss : 0.0f;
        }
    }
}
static __global__ void vocab_crossentropy_grad_kernel(bf16* logits, const float* lse, const int* targets, long BT, int V,
                                                      int Vl, long vlo, float dloss) {
    for (long k = (long)blockIdx.x * blockDim.x + threadIdx.x; k < BT * Vl; k += (long)gridDim.x * blockDim.x) {
        long i = k / Vl, v = vlo + k % Vl;
        float g = v < V ? (expf(__bfloat162float(logits[k]) - lse[i]) - (v == targets[i] ? 1.0f : 0.0f)) * dloss : 0.0f;
        logits[k] = __float2bfloat16(g);
    }
}
inline void vocab_crossentropy_grad(bf16* logits, const float* lse, const int* targets, long BT, int V, int Vl, long vlo,
                                    float dloss) {
    launch_elementwise(vocab_crossentropy_grad_kernel, BT * Vl, logits, lse, targets, BT, V, Vl, vlo, dloss);
}

// x[i] = Σ over ranks of all[r·n + i], added in rank order in fp32
inline void sum_ranks(float* x, const float* all, long n, int ranks) {
#pragma omp parallel for
    for (long i = 0; i < n; i++) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += all[r * n + i];
        x[i] = s;
    }
}
static __global__ void sum_ranks_kernel(bf16* x, const bf16* all, long n, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += __bfloat162float(all[r * n + i]);
        x[i] = __float2bfloat16(s);
    }
}
inline void sum_ranks(bf16* x, const bf16* all, long n, int ranks) { launch_elementwise(sum_ranks_kernel, n, x, all, n, ranks); }
// ... fp32 values on the device of the storage type floatX
static __global__ void sum_float_ranks_kernel(float* x, const float* all, long n, int ranks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ranks; r++) s += all[r * n + i];
        x[i] = s;
    }
}
template <typename floatX>
inline void sum_float_ranks(float* x, const float* all, long n, int ranks) {
    if constexpr (device_of<floatX> == Device::CPU) sum_ranks(x, all, n, ranks);
    else launch_elementwise(sum_float_ranks_kernel, n, x, all, n, ranks);
}

// ----------------------------------------------------------------------------------------------------------

// The methods are templates over the model's storage type (llmc/device.cuh): the same code moves host
// buffers on the CPU and device buffers on the GPU.
struct TensorParallel {
    TPSpec spec;
    Comm* comm = nullptr;  // the tp group; null for a single rank
    void* gather = nullptr;  // scratch for collectives that gather every rank's piece (set by the model)

    int size() const { return spec.size; }
    bool on() const { return spec.size > 1; }
    // rows of activations a rank holds between the parallel regions
    long rows(long BT) const { return spec.sp ? BT / spec.size : BT; }
    // where this rank's rows start inside a whole (BT-row) buffer
    long first_row(long BT) const { return spec.sp ? spec.rank * (BT / spec.size) : 0; }

    // --- entering a column-parallel layer -------------------------------------------------------------------

    // whole holds this rank's rows at first_row; afterwards every row (sp); without sp it already does
    template <typename floatX>
    void gather_rows(floatX* whole, long BT, int C) {
        if (!on() || !spec.sp) return;
        long n = rows(BT) * C;
        comm->wait(comm->all_gather(whole + spec.rank * n, whole, n, dtype_of<floatX>()));
    }
    // backward: the partial input gradients (BT rows) summed; into `mine` (this rank's rows: sp) or in place
    template <typename floatX>
    void reduce_rows(floatX* partial, floatX* mine, long BT, int C) {
        if (!on()) return;
        long n = rows(BT) * C;
        if (spec.sp) {
            comm->wait(comm->reduce_scatter(partial, mine, n, dtype_of<floatX>()));
        } else {
            all_reduce(partial, BT * C);
        }
    }

    // --- row-parallel layers --------------------------------------------------------------------------------

    // out (this rank's rows) = inp · Wᵀ summed over the group, plus bias; partial is BT×OC scratch; fp8: the
    // layer's FP8 state (null: bf16)
    template <typename floatX>
    void row_parallel_forward(floatX* out, floatX* partial, const floatX* inp, const floatX* W, const floatX* bias,
                              long BT, int C, int OC, float* ws, const Fp8Scaling<floatX>* fp8) {
        if (!on()) return matmul_forward(out, inp, W, bias, BT, C, OC, ws, fp8);
        matmul_forward(partial, inp, W, (const floatX*)nullptr, BT, C, OC, ws, fp8);
        reduce_rows(partial, out, BT, OC);
        if (bias) add_bias_rows(out, spec.sp ? out : partial, bias, rows(BT), OC);
        else if (!spec.sp) device_copy<floatX>(out, partial, BT * OC);  // no bias (Llama): the sum itself
    }

    // every row of a tensor sequence parallelism keeps in row pieces (a norm's output entering a column-parallel
    // layer, a row-parallel layer's output gradient): this rank's rows gathered from the group into whole (sp),
    // or mine as it is (mine holds every row already)
    template <typename floatX>
    const floatX* all_rows(const floatX* mine, floatX* whole, long BT, int C) {
        if (!on() || !spec.sp) return mine;
        long n = rows(BT) * C;
        comm->wait(comm->all_gather(mine, whole, n, dtype_of<floatX>()));
        return whole;
    }

    // --- vocab-parallel embedding ---------------------------------------------------------------------------

    // out (this rank's rows) = wte[token] + wpe[t], wte split by vocab rows [vlo, vlo + Vl)
    template <typename floatX>
    void embedding_forward(floatX* out, floatX* partial, const int* tokens, const floatX* wte, const floatX* wpe, int B,
                           int T, int C, int Vl) {
        if (!on()) return encoder_forward(out, tokens, wte, wpe, B, T, C);
        long BT = (long)B * T;
        masked_lookup(partial, tokens, wte, BT, C, (long)spec.rank * Vl, Vl);
        reduce_rows(partial, out, BT, C);
        if (wpe) add_positions(out, spec.sp ? out : partial, wpe, rows(BT), first_row(BT), T, C);
        else if (!spec.sp) device_copy<floatX>(out, partial, BT * C);  // no position table (Llama): the sum itself
    }

    // dwte (this rank's vocab rows) and dwpe accumulate; dout is this rank's rows, whole scratch BT×C
    template <typename floatX>
    void embedding_backward(floatX* dwte, floatX* dwpe, const floatX* dout, floatX* whole, const int* tokens, int B,
                            int T, int C, int Vl) {
        if (!on()) return encoder_backward(dwte, dwpe, dout, tokens, B, T, C, Vl);
        long BT = (long)B * T;
        // wpe: from this rank's rows (under sp a partial sum, completed before the dp reduction)
        if (dwpe) position_grads(dwpe, dout, rows(BT), first_row(BT), T, C);
        const floatX* d = all_rows(dout, whole, BT, C);
        masked_embedding_grads(dwte, d, tokens, BT, C, (long)spec.rank * Vl, Vl);
    }

    // --- vocab-parallel cross-entropy -----------------------------------------------------------------------

    // losses[i] for every row from this rank's logit columns (BT×Vl, global column vlo + j, real below V); lse
    // keeps each row's log-sum-exp for the backward. Returns the mean loss.
    template <typename floatX>
    float crossentropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, long BT, int V, int Vl) {
        long vlo = (long)spec.rank * Vl;
        int real = (int)std::max(0L, std::min((long)Vl, V - vlo));  // columns of real tokens here
        DeviceTemp<floatX, float> mine(BT * 3), all(BT * 3 * size());
        vocab_row_stats(mine.data, logits, targets, BT, Vl, real, vlo);
        comm->wait(comm->all_gather(mine.data, all.data, BT * 3, DType::F32));
        return combine_rows<floatX>(losses, lse, all.data, BT, size());
    }

    // logits become their gradient in place: (softmax - onehot)·dloss on real columns, 0 on padding
    template <typename floatX>
    void crossentropy_backward_inplace(floatX* logits, const float* lse, const int* targets, long BT, int V, int Vl,
                                       float dloss) {
        vocab_crossentropy_grad(logits, lse, targets, BT, V, Vl, (long)spec.rank * Vl, dloss);
    }

    // --- group sums that leave every rank with the same bits -----------------------------------------------

    // x (n elements) summed over the group in rank order: every rank's x gathered, then added up locally; or,
    // with `ranks`, over the block of that many consecutive ranks that holds this one (the ranks holding the
    // same key/value heads)
    template <typename floatX>
    void sum_in_rank_order(floatX* x, long n, int ranks = 0) {
        if (!on()) return;
        if (ranks == 0) ranks = size();
        DeviceTemp<floatX, floatX> all(n * size());
        comm->wait(comm->all_gather(x, all.data, n, dtype_of<floatX>()));
        sum_ranks(x, all.data + (spec.rank - spec.rank % ranks) * n, n, ranks);
    }
    // ... fp32 values on the device of the storage type floatX (the experts' gates' gradients)
    template <typename floatX>
    void sum_floats_in_rank_order(float* x, long n) {
        if (!on()) return;
        DeviceTemp<floatX, float> all(n * size());
        comm->wait(comm->all_gather(x, all.data, n, DType::F32));
        sum_float_ranks<floatX>(x, all.data, n, size());
    }

   private:
    // reduce-scatter then all-gather, n divisible by the group size: the result is one rank's sum, everywhere
    template <typename floatX>
    void all_reduce(floatX* x, long n) {
        long piece = n / size();
        floatX* mine = static_cast<floatX*>(gather);
        comm->wait(comm->reduce_scatter(x, mine, piece, dtype_of<floatX>()));
        comm->wait(comm->all_gather(mine, x, piece, dtype_of<floatX>()));
    }
};

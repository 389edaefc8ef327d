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
// tp adds around the layers live with the layers they belong to, each a CPU loop with its CUDA kernel beside it:
// the row-parallel bias in llmc/matmul.cuh, the masked lookup and the positions in llmc/encoder.cuh, the
// cross-entropy's row statistics in llmc/classifier.cuh, the rank-order sums in llmc/device.cuh.
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
// The methods are templates over the model's storage type (llmc/device.cuh): the same code moves host
// buffers on the CPU and device buffers on the GPU.
struct TensorParallel {
    TPSpec spec;
    Comm* comm = nullptr;  // the tp group; null for a single rank
    void* gather = nullptr;  // scratch for collectives that gather every rank's piece (set by the model)

    int size() const { return spec.size; }
    bool on() const { return spec.size > 1; }

    // --- placement: what this rank holds -------------------------------------------------------------------
    //   token rows between the parallel regions    rows(BT) from first_row(BT): its BT/tp (sp), or all BT
    //   vocab rows of wte, columns of the logits   Vl from first_vocab(Vl) = rank·Vl
    //   heads and hidden units                     its share of each tensor, by the model's table (model_table.h)
    long rows(long BT) const { return spec.sp ? BT / spec.size : BT; }
    long first_row(long BT) const { return spec.sp ? spec.rank * (BT / spec.size) : 0; }
    long first_vocab(int Vl) const { return (long)spec.rank * Vl; }

    // --- entering a column-parallel layer -------------------------------------------------------------------

    // whole holds this rank's rows at first_row; afterwards every row (sp); without sp it already does
    template <typename floatX>
    void gather_rows(floatX* whole, long BT, int C) {
        if (!on() || !spec.sp) return;
        long n = rows(BT) * C;
        comm->wait(comm->all_gather(whole + first_row(BT) * C, whole, n, dtype_of<floatX>()));
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
                              long BT, int C, int OC, Workspace ws, const Fp8Scaling<floatX>* fp8) {
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
        masked_lookup(partial, tokens, wte, BT, C, first_vocab(Vl), Vl);
        reduce_rows(partial, out, BT, C);
        if (wpe) add_positions(out, spec.sp ? out : partial, wpe, rows(BT), first_row(BT), T, C);
        else if (!spec.sp) device_copy<floatX>(out, partial, BT * C);  // no position table (Llama): the sum itself
    }

    // dwte (this rank's vocab rows) and dwpe accumulate; dout is this rank's rows, whole scratch BT×C
    template <typename floatX>
    void embedding_backward(floatX* dwte, floatX* dwpe, const floatX* dout, floatX* whole, const int* tokens, int B,
                            int T, int C, int Vl, Workspace ws) {
        if (!on()) return encoder_backward(dwte, dwpe, dout, tokens, B, T, C, Vl, ws);
        long BT = (long)B * T;
        // wpe: from this rank's rows (under sp a partial sum, completed before the dp reduction)
        if (dwpe) position_grads(dwpe, dout, rows(BT), first_row(BT), T, C);
        const floatX* d = all_rows(dout, whole, BT, C);
        masked_embedding_grads(dwte, d, tokens, BT, C, first_vocab(Vl), Vl);
    }

    // --- vocab-parallel cross-entropy -----------------------------------------------------------------------

    // losses[i] for every row from this rank's logit columns (BT×Vl, global column vlo + j, real below V); lse
    // keeps each row's log-sum-exp for the backward. Returns the mean loss.
    template <typename floatX>
    float crossentropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, long BT, int V, int Vl,
                               Workspace ws) {
        long vlo = first_vocab(Vl);
        int real = (int)std::max(0L, std::min((long)Vl, V - vlo));  // columns of real tokens here
        DeviceTemp<floatX, float> mine(BT * 3), all(BT * 3 * size());
        vocab_row_stats(mine.data, logits, targets, BT, Vl, real, vlo);
        comm->wait(comm->all_gather(mine.data, all.data, BT * 3, DType::F32));
        return combine_rows<floatX>(losses, lse, all.data, BT, size(), ws);
    }

    // logits become their gradient in place: (softmax - onehot)·dloss on real columns, 0 on padding
    template <typename floatX>
    void crossentropy_backward_inplace(floatX* logits, const float* lse, const int* targets, long BT, int V, int Vl,
                                       float dloss) {
        vocab_crossentropy_grad(logits, lse, targets, BT, V, Vl, first_vocab(Vl), dloss);
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

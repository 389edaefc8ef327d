// Tensor parallelism with sequence parallelism, in Megatron-LM's layout (the Playbook's "Tensor Parallelism"
// and "Sequence Parallelism" sections). The tp ranks of a group split every layer:
//   attention  QKV column-parallel: each rank holds the Q, K and V rows of NH/tp heads and runs attention on
//              them alone; the output projection row-parallel (its input columns split the same way).
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
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "llmc/classifier.cuh"
#include "llmc/comm.cuh"
#include "llmc/encoder.cuh"
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

// The methods are templates over the model's storage type (llmc/device.cuh); the collectives and loops they
// wrap around the layers run on host buffers, so the model refuses tp > 1 on the GPU for now.
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
    // the padded vocab rows each rank holds (the last ranks may hold padding only past Vp)
    static int vocab_rows(int Vp, int tp) { return (Vp + tp - 1) / tp; }

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

    // out (this rank's rows) = inp · Wᵀ summed over the group, plus bias; partial is BT×OC scratch
    template <typename floatX>
    void row_parallel_forward(floatX* out, floatX* partial, const floatX* inp, const floatX* W, const floatX* bias,
                              long BT, int C, int OC, float* ws) {
        if (!on()) return matmul_forward(out, inp, W, bias, BT, C, OC, ws);
        matmul_forward(partial, inp, W, nullptr, BT, C, OC, ws);
        reduce_rows(partial, out, BT, OC);
        const floatX* sum = spec.sp ? out : partial;
        long R = rows(BT);
#pragma omp parallel for
        for (long r = 0; r < R; r++)
            for (int o = 0; o < OC; o++) out[r * OC + o] = sum[r * OC + o] + bias[o];
    }

    // the output gradient of a row-parallel layer for every row: gathered (sp) or as it is
    template <typename floatX>
    const floatX* row_parallel_dout(const floatX* mine, floatX* whole, long BT, int C) {
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
        long BT = (long)B * T, vlo = (long)spec.rank * Vl;
#pragma omp parallel for
        for (long i = 0; i < BT; i++) {
            long row = tokens[i] - vlo;
            floatX* o = partial + i * C;
            if (row >= 0 && row < Vl) memcpy(o, wte + row * C, C * sizeof(floatX));
            else memset(o, 0, C * sizeof(floatX));
        }
        reduce_rows(partial, out, BT, C);
        const floatX* sum = spec.sp ? out : partial;
        long R = rows(BT), first = first_row(BT);
#pragma omp parallel for
        for (long r = 0; r < R; r++)
            for (int c = 0; c < C; c++) out[r * C + c] = sum[r * C + c] + wpe[((first + r) % T) * C + c];
    }

    // dwte (this rank's vocab rows) and dwpe accumulate; dout is this rank's rows, whole scratch BT×C
    template <typename floatX>
    void embedding_backward(floatX* dwte, floatX* dwpe, const floatX* dout, floatX* whole, const int* tokens, int B,
                            int T, int C, int Vl) {
        if (!on()) return encoder_backward(dwte, dwpe, dout, tokens, B, T, C, Vl);
        long BT = (long)B * T, R = rows(BT), first = first_row(BT), vlo = (long)spec.rank * Vl;
        // wpe: from this rank's rows (under sp a partial sum, completed by sum_replicated)
#pragma omp parallel for
        for (int c = 0; c < C; c++)
            for (long r = 0; r < R; r++) dwpe[((first + r) % T) * C + c] += dout[r * C + c];
        const floatX* d = row_parallel_dout(dout, whole, BT, C);
        // each channel is summed in token order by one thread: bit-reproducible
#pragma omp parallel for
        for (int c = 0; c < C; c++)
            for (long i = 0; i < BT; i++) {
                long row = tokens[i] - vlo;
                if (row >= 0 && row < Vl) dwte[row * C + c] += d[i * C + c];
            }
    }

    // --- vocab-parallel cross-entropy -----------------------------------------------------------------------

    // losses[i] for every row from this rank's logit columns (BT×Vl, global column vlo + j, real below V); lse
    // keeps each row's log-sum-exp for the backward. Returns the mean loss.
    template <typename floatX>
    float crossentropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, long BT, int V, int Vl) {
        long vlo = (long)spec.rank * Vl;
        int real = (int)std::max(0L, std::min((long)Vl, V - vlo));  // columns of real tokens here
        // per row: max, Σ exp(x - max), target logit (0 where another rank holds the target)
        std::vector<float> mine(BT * 3), all(BT * 3 * size());
#pragma omp parallel for
        for (long i = 0; i < BT; i++) {
            const floatX* x = logits + i * Vl;
            float mx = -INFINITY;
            for (int j = 0; j < real; j++) mx = fmaxf(mx, x[j]);
            double s = 0.0;
            for (int j = 0; j < real; j++) s += exp((double)x[j] - mx);
            long t = targets[i] - vlo;
            mine[i * 3] = mx;
            mine[i * 3 + 1] = (float)s;
            mine[i * 3 + 2] = t >= 0 && t < Vl ? (float)x[t] : 0.0f;
        }
        comm->wait(comm->all_gather(mine.data(), all.data(), BT * 3, DType::F32));
        double total = 0.0;
        for (long i = 0; i < BT; i++) {
            float mx = -INFINITY, target = 0.0f;
            for (int r = 0; r < size(); r++) mx = fmaxf(mx, all[(r * BT + i) * 3]);
            double s = 0.0;
            for (int r = 0; r < size(); r++) {
                const float* p = &all[(r * BT + i) * 3];
                if (p[1] > 0) s += (double)p[1] * exp((double)p[0] - mx);
                target += p[2];
            }
            lse[i] = (float)(log(s) + mx);
            losses[i] = lse[i] - target;
            total += losses[i];
        }
        return (float)(total / BT);
    }

    // logits become their gradient in place: (softmax - onehot)·dloss on real columns, 0 on padding
    template <typename floatX>
    void crossentropy_backward_inplace(floatX* logits, const float* lse, const int* targets, long BT, int V, int Vl,
                                       float dloss) {
        long vlo = (long)spec.rank * Vl;
#pragma omp parallel for
        for (long i = 0; i < BT; i++) {
            floatX* x = logits + i * Vl;
            for (int j = 0; j < Vl; j++) {
                long v = vlo + j;
                x[j] = (floatX)(v < V ? (expf((float)x[j] - lse[i]) - (v == targets[i] ? 1.0f : 0.0f)) * dloss : 0.0f);
            }
        }
    }

    // --- group sums that leave every rank with the same bits -----------------------------------------------

    // x (n floats) summed over the group in rank order: every rank's x gathered, then added up locally
    template <typename floatX>
    void sum_in_rank_order(floatX* x, long n) {
        if (!on()) return;
        std::vector<floatX> all(n * size());
        comm->wait(comm->all_gather(x, all.data(), n, dtype_of<floatX>()));
#pragma omp parallel for
        for (long i = 0; i < n; i++) {
            float s = 0.0f;
            for (int r = 0; r < size(); r++) s += (float)all[r * n + i];
            x[i] = (floatX)s;
        }
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

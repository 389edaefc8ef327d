// The MLP, written once for every place one runs: a dense layer's (every row of the micro-batch), each expert's
// (the rows routed to it, llmc/moe.cuh) and a shared expert's (every row again, beside the routed ones). Over n
// rows of C channels and H hidden units:
//
//   fch = in · fcwᵀ (+ fcb)        n × FC: FC = H, or 2·H for SwiGLU, whose fcw stacks c_fc and c_fc2
//   act = GELU(fch) | SwiGLU(fch)  n × H: GELU in the matmul's epilogue on the GPU
//   out = act · fcprojwᵀ (+ fcprojb)
//
// and backward the same in reverse, the weight gradients either at once or left to mlp_weight_grads (a split
// backward: the zero-bubble pipeline's W step). Under tensor parallelism each rank calls it with its share of
// the hidden units (fc by rows, fc_proj by columns) and gets a partial sum of `out`, which the caller reduces
// over the group; the caller passes fc_proj's bias on one rank of the group only, so that the reduction adds it
// once. The dense model's MLP is the case of one expert that takes every row.
#pragma once

#include "llmc/fp8.cuh"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"
#include "llmc/model_table.h"
#include "llmc/swiglu.cuh"

// An MLP's four tensors (or their gradients); a null bias: none (Llama's, or fc_proj's on all tp ranks but one),
// and in a gradient a null entry: not taken here
template <typename floatX>
struct MlpTensorViews {
    floatX *fcw, *fcb, *fcprojw, *fcprojb;
};

// The MLP's width and activation, and the width of its first matmul's output
struct MlpShape {
    int C, H;
    Activation activation;
    int FC() const { return activation == Activation::SwiGLU ? 2 * H : H; }
};

// out (n×C) from in (n×C); fch (n×FC) and act (n×H) are kept for backward
template <typename floatX>
inline void mlp_forward(floatX* out, floatX* fch, floatX* act, const floatX* in, const MlpTensorViews<floatX>& w,
                        long n, const MlpShape& s, Workspace ws, const Fp8Scaling<floatX>* fp8) {
    if (s.activation == Activation::GELU) {
        matmul_gelu_forward(act, fch, in, w.fcw, w.fcb, n, s.C, s.H, ws, fp8);
    } else {
        matmul_forward(fch, in, w.fcw, w.fcb, n, s.C, s.FC(), ws, fp8);
        swiglu_forward(act, fch, n, s.H);
    }
    matmul_forward(out, act, w.fcprojw, w.fcprojb, n, s.H, s.C, ws, fp8);
}

// act computed again from fch, exactly as forward did (-r 1 keeps only fch)
template <typename floatX>
inline void mlp_activation_again(floatX* act, const floatX* fch, long n, const MlpShape& s) {
    if (s.activation == Activation::SwiGLU) swiglu_forward(act, fch, n, s.H);
    else gelu_forward(act, fch, n * s.H);
}

// din (n×C) from dout (n×C); din may be dout itself (dout is read before din is written) or null. dfch (n×FC)
// receives fch's gradient (a split backward keeps it for mlp_weight_grads) and dact (n×H) the activation's
// (SwiGLU's: GELU's backward runs in place in dfch, dact unused). dw accumulates the gradients it has entries
// for; in (the MLP's input) is read only for fcw's.
template <typename floatX>
inline void mlp_backward(floatX* din, const MlpTensorViews<floatX>& dw, const floatX* dout, floatX* dfch, floatX* dact,
                         const floatX* fch, const floatX* act, const floatX* in, const MlpTensorViews<floatX>& w, long n,
                         const MlpShape& s, Workspace ws, const Fp8Scaling<floatX>* fp8) {
    bool gelu = s.activation == Activation::GELU;
    if (gelu) {  // fc's bias gradient comes with GELU's backward (on the GPU in the GEMM's epilogue)
        gelu_matmul_backward(dfch, dw.fcprojw, dw.fcprojb, dw.fcb, dout, act, fch, w.fcprojw, n, s.H, s.C, ws, fp8);
    } else {
        matmul_backward(dact, dw.fcprojw, dw.fcprojb, dout, act, w.fcprojw, n, s.H, s.C, ws, fp8);
        swiglu_backward(dfch, fch, dact, n, s.H);
    }
    matmul_backward(din, dw.fcw, gelu ? nullptr : dw.fcb, dfch, in, w.fcw, n, s.C, s.FC(), ws, fp8);
}

// The weight gradients a split backward left: from the output gradients it kept (dout, dfch) and the inputs
// forward kept (act, in)
template <typename floatX>
inline void mlp_weight_grads(const MlpTensorViews<floatX>& dw, const floatX* dout, const floatX* dfch, const floatX* act,
                             const floatX* in, const MlpTensorViews<floatX>& w, long n, const MlpShape& s, Workspace ws,
                             const Fp8Scaling<floatX>* fp8) {
    floatX* none = nullptr;
    matmul_backward(none, dw.fcprojw, dw.fcprojb, dout, act, w.fcprojw, n, s.H, s.C, ws, fp8);
    matmul_backward(none, dw.fcw, dw.fcb, dfch, in, w.fcw, n, s.C, s.FC(), ws, fp8);
}

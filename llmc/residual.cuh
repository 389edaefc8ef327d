// The residual connection: out = a + b. Its backward is the identity to both inputs, so the model passes the
// residual stream's gradient straight to the branch and keeps accumulating into it; no backward op is needed.
// Inside the model the add is fused with the layernorm after it; alone, it ends a pipeline stage's chunk,
// whose output is the residual stream after its last layer.
#pragma once

#include "llmc/device.cuh"
#include "llmc/profile.h"

inline void residual_forward(float* out, const float* a, const float* b, long N) {
    ProfileScope op("residual");
#pragma omp parallel for
    for (long i = 0; i < N; i++) out[i] = a[i] + b[i];
}

// the sum in fp32, rounded to bf16 once, as the fused layernorm kernel rounds it
static __global__ void residual_forward_kernel(bf16* out, const bf16* a, const bf16* b, long N) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}
inline void residual_forward(bf16* out, const bf16* a, const bf16* b, long N) {
    ProfileScope op("residual");
    launch_elementwise(residual_forward_kernel, N, out, a, b, N);
}

// Flash attention variants against the CPU reference (llmc/attention.cuh, which materializes the T×T
// probabilities), outputs poisoned first, on T = 1024, 77 and 1000 with head sizes 64 and 128, multi-head and
// grouped-query (Llama 3 8B's 32 query heads over 8 key/value heads of 128; multi-query, 12 heads of 64 over
// one); the backward must be bit-reproducible. Then each variant is timed on GPT-2 124M's attention (B=64,
// NH=12, T=1024, hs 64), d48's (B=16, NH=25, hs 64), an hs-128 shape and Llama 3 8B's (B=4, NH=32, KV=8,
// T=2048, hs 128); attention_sdpa.py times PyTorch's SDPA on the multi-head shapes.
//   variant 1: scalar fp32 FMAs on bf16 tiles in shared memory (32-row tiles, a lane per key): the first
//              version, kept as the baseline
//   variant 2: FlashAttention-2 on the tensor cores (mma.sync m16n8k16, cp.async double buffering), the
//              kernels of llmc/attention.cuh that the model runs; `cuobjdump -sass attention | grep HMMA`
//              shows its tensor-core instructions
//   variant 3: variant 2 with the forward at one m16 slab per warp (64-query blocks, twice the blocks and
//              fewer registers, but each K/V fragment feeds one mma instead of two); the backward is variant 2's
//   variant 4: FlashAttention-3's shape on Hopper (sm_90a): wgmma m64nNk16, TMA loads completing on mbarriers,
//              a producer warpgroup and two consumer warpgroups (llmc/attention.cuh, --attention wgmma); the
//              backward deterministic as variant 2's. Skipped, not failed, on a GPU other than Hopper or a
//              binary without sm_90a; `cuobjdump -sass attention | grep -c HGMMA` counts its tensor-core
//              instructions
// Usage: ./attention [variant]   (no argument: every variant). Inputs and CPU reference: AttentionCase in
// attention_case.h.
#include <cstdlib>

#include "dev/cuda/attention_case.h"

// ------------------------------------------------------------------------------------------------------------
// variant 1: a block of 4 warps takes a 32-row tile; a warp owns 8 rows and its lanes the 32 columns of the
// current 32-wide tile of the other operand (scores), then the head dimension (lane + 32·i) when accumulating.
// Shared-memory rows are padded by one 4-byte word so that 32 lanes reading 32 different rows hit 32 different
// banks. Deterministic like variant 2: one kernel sums dQ over key tiles, another dK and dV of a key/value head
// over the query tiles of each query head of its group in turn. qkv rows are C + 2·KV·HS wide.

constexpr int SCALAR_TILE = 32, SCALAR_WARPS = 4, SCALAR_ROWS = SCALAR_TILE / SCALAR_WARPS;

// rows [t0, t0+32) of one head's slice of a (B·T, row_stride) tensor into a padded tile; rows past T become zeros
template <int HS>
static __device__ void scalar_load_tile(bf16* tile, const bf16* src, long row_stride, int t0, int T) {
    for (int i = threadIdx.x; i < SCALAR_TILE * HS / 2; i += blockDim.x) {
        int r = i / (HS / 2), c = 2 * (i % (HS / 2));
        __nv_bfloat162 v = __floats2bfloat162_rn(0.0f, 0.0f);
        if (t0 + r < T) v = *reinterpret_cast<const __nv_bfloat162*>(src + (long)(t0 + r) * row_stride + c);
        *reinterpret_cast<__nv_bfloat162*>(tile + r * (HS + 2) + c) = v;
    }
}

// dots[r] = a[row0 + r] · b[lane]: a's rows are broadcast to the warp, b's rows are one per lane
template <int HS>
static __device__ __forceinline__ void scalar_row_dots(float (&dots)[SCALAR_ROWS], const bf16* a, int row0,
                                                       const bf16* b) {
    const __nv_bfloat162* brow = reinterpret_cast<const __nv_bfloat162*>(b + (threadIdx.x % 32) * (HS + 2));
    for (int r = 0; r < SCALAR_ROWS; r++) dots[r] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HS / 2; d++) {
        float2 bv = __bfloat1622float2(brow[d]);
        for (int r = 0; r < SCALAR_ROWS; r++) {
            float2 av = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(a + (row0 + r) * (HS + 2))[d]);
            dots[r] += av.x * bv.x + av.y * bv.y;
        }
    }
}

// acc[r][i] += Σ_j w[r] of lane j · m[j][lane + 32i]: weights held one per lane, applied to m's rows
template <int HS>
static __device__ __forceinline__ void scalar_accumulate(float (&acc)[SCALAR_ROWS][HS / 32],
                                                         const float (&w)[SCALAR_ROWS], const bf16* m) {
    int lane = threadIdx.x % 32;
    for (int j = 0; j < SCALAR_TILE; j++) {
        float mv[HS / 32];
        for (int i = 0; i < HS / 32; i++) mv[i] = __bfloat162float(m[j * (HS + 2) + lane + 32 * i]);
        for (int r = 0; r < SCALAR_ROWS; r++) {
            float wj = __shfl_sync(0xffffffffu, w[r], j);
            for (int i = 0; i < HS / 32; i++) acc[r][i] += wj * mv[i];
        }
    }
}

// grid (query tiles, B·NH); the longest rows (last tiles) start first so the tail of the grid is short
template <int HS>
static __global__ void __launch_bounds__(SCALAR_TILE * SCALAR_WARPS)
    scalar_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int C, int NH, int KV, float scale) {
    __shared__ bf16 q_s[SCALAR_TILE * (HS + 2)], k_s[SCALAR_TILE * (HS + 2)], v_s[SCALAR_TILE * (HS + 2)];
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH, kh = h / (NH / KV);
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * SCALAR_ROWS, q0 = qt * SCALAR_TILE;
    long row_stride = C + 2L * KV * HS;
    const bf16* base = qkv + (long)b * T * row_stride + h * HS;
    const bf16* k_g = qkv + (long)b * T * row_stride + C + kh * HS;
    scalar_load_tile<HS>(q_s, base, row_stride, q0, T);
    float m[SCALAR_ROWS], l[SCALAR_ROWS], acc[SCALAR_ROWS][HS / 32];
    for (int r = 0; r < SCALAR_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int i = 0; i < HS / 32; i++) acc[r][i] = 0.0f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();  // everyone is done with the previous key/value tile
        scalar_load_tile<HS>(k_s, k_g, row_stride, kt * SCALAR_TILE, T);
        scalar_load_tile<HS>(v_s, k_g + KV * HS, row_stride, kt * SCALAR_TILE, T);
        __syncthreads();
        float p[SCALAR_ROWS];
        scalar_row_dots<HS>(p, q_s, row0, k_s);
        int key = kt * SCALAR_TILE + lane;
        for (int r = 0; r < SCALAR_ROWS; r++) {
            bool visible = key <= q0 + row0 + r && key < T;
            float x = visible ? p[r] * scale : -INFINITY;
            // key 0 is visible to every row and comes in the first tile, so m_new is finite
            float m_new = fmaxf(m[r], warp_max(x));
            float e = visible ? __expf(x - m_new) : 0.0f;
            float rescale = __expf(m[r] - m_new);
            l[r] = l[r] * rescale + warp_sum(e);
            for (int i = 0; i < HS / 32; i++) acc[r][i] *= rescale;
            m[r] = m_new;
            p[r] = e;
        }
        scalar_accumulate<HS>(acc, p, v_s);
    }
    for (int r = 0; r < SCALAR_ROWS; r++) {
        int t = q0 + row0 + r;
        if (t >= T) break;
        bf16* o = out + ((long)b * T + t) * C + h * HS;
        for (int i = 0; i < HS / 32; i++) o[lane + 32 * i] = __float2bfloat16(acc[r][i] / l[r]);
        if (lane == 0) lse[(long)bh * T + t] = m[r] + logf(l[r]);
    }
}

// dQ for a query tile: rows are queries, lanes are keys of the current key tile
template <int HS>
static __global__ void __launch_bounds__(SCALAR_TILE * SCALAR_WARPS)
    scalar_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                              int T, int C, int NH, int KV, float scale) {
    __shared__ bf16 q_s[SCALAR_TILE * (HS + 2)], do_s[SCALAR_TILE * (HS + 2)], k_s[SCALAR_TILE * (HS + 2)],
        v_s[SCALAR_TILE * (HS + 2)];
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH, kh = h / (NH / KV);
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * SCALAR_ROWS, q0 = qt * SCALAR_TILE;
    long row_stride = C + 2L * KV * HS;
    const bf16* base = qkv + (long)b * T * row_stride + h * HS;
    const bf16* k_g = qkv + (long)b * T * row_stride + C + kh * HS;
    scalar_load_tile<HS>(q_s, base, row_stride, q0, T);
    scalar_load_tile<HS>(do_s, dout + (long)b * T * C + h * HS, C, q0, T);
    float row_lse[SCALAR_ROWS], row_delta[SCALAR_ROWS], acc[SCALAR_ROWS][HS / 32];
    for (int r = 0; r < SCALAR_ROWS; r++) {
        int t = q0 + row0 + r;
        row_lse[r] = t < T ? lse[(long)bh * T + t] : 0.0f;
        row_delta[r] = t < T ? delta[(long)bh * T + t] : 0.0f;
        for (int i = 0; i < HS / 32; i++) acc[r][i] = 0.0f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        scalar_load_tile<HS>(k_s, k_g, row_stride, kt * SCALAR_TILE, T);
        scalar_load_tile<HS>(v_s, k_g + KV * HS, row_stride, kt * SCALAR_TILE, T);
        __syncthreads();
        float s[SCALAR_ROWS], dp[SCALAR_ROWS];
        scalar_row_dots<HS>(s, q_s, row0, k_s);
        scalar_row_dots<HS>(dp, do_s, row0, v_s);
        int key = kt * SCALAR_TILE + lane;
        for (int r = 0; r < SCALAR_ROWS; r++) {
            int t = q0 + row0 + r;
            float p = key <= t && t < T ? __expf(s[r] * scale - row_lse[r]) : 0.0f;
            s[r] = p * (dp[r] - row_delta[r]);
        }
        scalar_accumulate<HS>(acc, s, k_s);
    }
    for (int r = 0; r < SCALAR_ROWS; r++) {
        int t = q0 + row0 + r;
        if (t >= T) break;
        bf16* dq = dqkv + ((long)b * T + t) * row_stride + h * HS;
        for (int i = 0; i < HS / 32; i++) dq[lane + 32 * i] = __float2bfloat16(acc[r][i] * scale);
    }
}

// dK and dV for a key tile of a key/value head (grid (key tiles, B·KV)): rows are keys, lanes are queries of
// the current query tile, which walks the tiles of each query head of the group in turn
template <int HS>
static __global__ void __launch_bounds__(SCALAR_TILE * SCALAR_WARPS)
    scalar_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                                int T, int C, int NH, int KV, float scale) {
    __shared__ bf16 k_s[SCALAR_TILE * (HS + 2)], v_s[SCALAR_TILE * (HS + 2)], q_s[SCALAR_TILE * (HS + 2)],
        do_s[SCALAR_TILE * (HS + 2)];
    __shared__ float lse_s[SCALAR_TILE], delta_s[SCALAR_TILE];
    int kt = blockIdx.x, tiles = gridDim.x, group = NH / KV, b = blockIdx.y / KV, kh = blockIdx.y % KV;
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * SCALAR_ROWS, k0 = kt * SCALAR_TILE;
    long row_stride = C + 2L * KV * HS;
    const bf16* k_g = qkv + (long)b * T * row_stride + C + kh * HS;
    scalar_load_tile<HS>(k_s, k_g, row_stride, k0, T);
    scalar_load_tile<HS>(v_s, k_g + KV * HS, row_stride, k0, T);
    float dk[SCALAR_ROWS][HS / 32], dv[SCALAR_ROWS][HS / 32];
    for (int r = 0; r < SCALAR_ROWS; r++)
        for (int i = 0; i < HS / 32; i++) dk[r][i] = dv[r][i] = 0.0f;
    int per_head = tiles - kt;  // query tiles at or after this key tile
    for (int n = 0; n < group * per_head; n++) {
        int h = kh * group + n / per_head, q0 = (kt + n % per_head) * SCALAR_TILE;
        long bh = (long)b * NH + h;
        __syncthreads();
        scalar_load_tile<HS>(q_s, qkv + (long)b * T * row_stride + h * HS, row_stride, q0, T);
        scalar_load_tile<HS>(do_s, dout + (long)b * T * C + h * HS, C, q0, T);
        if (threadIdx.x < SCALAR_TILE) {
            int t = q0 + threadIdx.x;
            lse_s[threadIdx.x] = t < T ? lse[bh * T + t] : 0.0f;
            delta_s[threadIdx.x] = t < T ? delta[bh * T + t] : 0.0f;
        }
        __syncthreads();
        float p[SCALAR_ROWS], ds[SCALAR_ROWS];
        scalar_row_dots<HS>(p, k_s, row0, q_s);
        scalar_row_dots<HS>(ds, v_s, row0, do_s);
        int t = q0 + lane;
        for (int r = 0; r < SCALAR_ROWS; r++) {
            int key = k0 + row0 + r;
            p[r] = key <= t && t < T ? __expf(p[r] * scale - lse_s[lane]) : 0.0f;
            ds[r] = p[r] * (ds[r] - delta_s[lane]);
        }
        scalar_accumulate<HS>(dv, p, do_s);
        scalar_accumulate<HS>(dk, ds, q_s);
    }
    for (int r = 0; r < SCALAR_ROWS; r++) {
        int key = k0 + row0 + r;
        if (key >= T) break;
        bf16* dkey = dqkv + ((long)b * T + key) * row_stride + C + kh * HS;
        for (int i = 0; i < HS / 32; i++) {
            dkey[lane + 32 * i] = __float2bfloat16(dk[r][i] * scale);
            dkey[KV * HS + lane + 32 * i] = __float2bfloat16(dv[r][i]);
        }
    }
}

static void scalar_forward(AttentionCase& k) {
    attention_dispatch(k.C, k.NH, k.KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        dim3 grid(cuda_blocks(k.T, SCALAR_TILE), k.B * k.NH);
        scalar_forward_kernel<HS><<<grid, SCALAR_TILE * SCALAR_WARPS>>>(k.d_out.ptr, k.d_lse.ptr, k.d_qkv.ptr, k.T, k.C,
                                                                        k.NH, k.KV, 1.0f / sqrtf((float)HS));
        cuda_check(cudaGetLastError());
    });
}

// D = rowsum(dO∘O) from the production kernel, then the two scalar passes
static void scalar_backward(AttentionCase& k) {
    attention_dispatch(k.C, k.NH, k.KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        float* delta = k.d_scratch.ptr;
        attention_delta_cuda<HS>(delta, k.d_dout.ptr, k.d_out.ptr, k.B, k.T, k.C, k.NH, 0);
        int tiles = cuda_blocks(k.T, SCALAR_TILE);
        float scale = 1.0f / sqrtf((float)HS);
        scalar_backward_dq_kernel<HS><<<dim3(tiles, k.B * k.NH), SCALAR_TILE * SCALAR_WARPS>>>(
            k.d_dqkv.ptr, k.d_dout.ptr, k.d_qkv.ptr, k.d_lse.ptr, delta, k.T, k.C, k.NH, k.KV, scale);
        cuda_check(cudaGetLastError());
        scalar_backward_dkdv_kernel<HS><<<dim3(tiles, k.B * k.KV), SCALAR_TILE * SCALAR_WARPS>>>(
            k.d_dqkv.ptr, k.d_dout.ptr, k.d_qkv.ptr, k.d_lse.ptr, delta, k.T, k.C, k.NH, k.KV, scale);
        cuda_check(cudaGetLastError());
    });
}

// ------------------------------------------------------------------------------------------------------------
// the variants and the program

struct Variant {
    const char* name;
    void (*forward)(AttentionCase&);
    void (*backward)(AttentionCase&);
    bool (*available)(std::string* why);  // null: runs on every GPU
};

static const Variant variants[] = {
    {"scalar FMAs", scalar_forward, scalar_backward},
    {"mma.sync FA2", [](AttentionCase& k) { k.gpu_forward(); }, [](AttentionCase& k) { k.gpu_backward(); }},
    {"mma.sync FA2, forward at one slab per warp",
     [](AttentionCase& k) {
         attention_dispatch(k.C, k.NH, k.KV, [&](auto hs) {
             attention_forward_launch<decltype(hs)::value, 1>(k.d_out.ptr, k.d_lse.ptr, k.d_qkv.ptr, k.B, k.T, k.C,
                                                               k.NH, k.KV, 0);
         });
     },
     [](AttentionCase& k) { k.gpu_backward(); }},
    {"wgmma FA3 (Hopper, sm_90a)", [](AttentionCase& k) { k.gpu_forward_hopper(); },
     [](AttentionCase& k) { k.gpu_backward_hopper(); }, attention_hopper_available},
};
constexpr int VARIANTS = sizeof(variants) / sizeof(variants[0]);
static bool skipped[VARIANTS];  // by main: variants this device or binary cannot run

// the backward runs on this variant's own forward (its out and lse), poisoned outputs each time
static void check_shape(Checks& checks, int first, int last, int B, int T, int C, int NH, int KV) {
    AttentionCase k(B, T, C, NH, KV, 6 + T + C + KV);
    if (!have_gpu()) return;  // without a GPU: the inputs and CPU reference alone
    for (int v = first; v <= last; v++) {
        if (skipped[v - 1]) continue;
        const Variant& variant = variants[v - 1];
        std::string shape = strfmt("v%d B=%d T=%d hs=%d", v, B, T, C / NH);
        if (KV != NH) shape += strfmt(" NH=%d KV=%d", NH, KV);
        k.d_out.poison();
        k.d_lse.poison();
        variant.forward(k);
        checks.check(shape + " forward", download(k.d_out), k.out, AttentionCase::OUT_TOL);
        checks.check(shape + " forward lse", download(k.d_lse), k.lse, 1e-3);
        k.d_dqkv.poison();
        k.d_scratch.poison();
        variant.backward(k);
        std::vector<float> gpu_dqkv = download(k.d_dqkv);
        checks.check(shape + " backward dqkv", gpu_dqkv, k.dqkv_for_out(download(k.d_out)),
                     AttentionCase::DQKV_TOL);
        k.d_dqkv.poison();
        variant.backward(k);
        checks.require(shape + " backward bit-reproducible", download(k.d_dqkv) == gpu_dqkv);
    }
}

// useful FLOPs: QKᵀ and PV over the causal half (4·T²·hs/2 per head); the backward counts 2.5 times that
// (FlashAttention's convention, which leaves out recomputation: variants 2 and 4's backward do 3.5 times)
// (per query head: grouped-query attention does the same products, only its K and V are shared)
static void time_shape(int first, int last, int B, int T, int C, int NH, int KV) {
    AttentionCase k(B, T, C, NH, KV, 1, false);
    if (!have_gpu()) return;  // without a GPU: the inputs and CPU reference alone
    double flops = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
    for (int v = first; v <= last; v++) {
        if (skipped[v - 1]) continue;
        const Variant& variant = variants[v - 1];
        std::string shape = strfmt("v%d B=%d NH=%d T=%d hs=%d", v, B, NH, T, C / NH);
        if (KV != NH) shape += strfmt(" KV=%d", KV);
        report_compute_bound(shape + " forward", time_ms([&] { variant.forward(k); }), flops);
        report_compute_bound(shape + " backward", time_ms([&] { variant.backward(k); }), 2.5 * flops);
    }
}

int main(int argc, char** argv) {
    Program program(
        "attention: flash attention variants against the CPU reference (T = 1024, 77, 1000; hs 64 and 128; "
        "grouped-query), then timed");
    int first = 1, last = VARIANTS;
    if (argc > 1) {
        first = last = atoi(argv[1]);
        if (first < 1 || first > VARIANTS) {
            fprintf(stderr, "usage: %s [variant 1..%d]\n", argv[0], VARIANTS);
            return 2;
        }
    }
    for (int v = first; v <= last; v++) printf("variant %d: %s\n", v, variants[v - 1].name);
    // a variant this device or binary cannot run says so once and is left out of the checks and timings
    for (int v = first; v <= last && program.gpu; v++) {
        std::string why;
        if (variants[v - 1].available && !variants[v - 1].available(&why)) {
            printf("variant %d: skipped: not Hopper (%s)\n", v, why.c_str());
            skipped[v - 1] = true;
        }
    }
    Checks checks;
    for (int T : {1024, 77, 1000}) {
        check_shape(checks, first, last, T == 1024 ? 4 : 2, T, 768, 12, 12);  // hs 64
        check_shape(checks, first, last, 2, T, 1024, 8, 8);                   // hs 128
        check_shape(checks, first, last, 1, T, 4096, 32, 8);                  // Llama 3 8B: groups of 4, hs 128
        check_shape(checks, first, last, 2, T, 768, 12, 1);                   // multi-query, hs 64
    }
    time_shape(first, last, 64, 1024, 768, 12, 12);   // GPT-2 124M
    time_shape(first, last, 16, 1024, 1600, 25, 25);  // GPT-2 1.5B (d48)
    time_shape(first, last, 16, 1024, 2048, 16, 16);  // hs 128
    time_shape(first, last, 4, 2048, 4096, 32, 8);    // Llama 3 8B's attention at T = 2048
    return program.finish(checks);
}

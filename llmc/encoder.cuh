// Token + position embedding: out[b,t,:] = wte[token[b,t],:] + wpe[t,:] (GPT-2's learned positions), or the token
// embedding alone for a model without a position table (Llama: RoPE turns q and k instead), and its backward.
// The backward scatters into the embedding tables: each table row's gradient is summed over the positions that
// read it, in a fixed order (bit-reproducible), and then added to the table's gradient once, so a micro-step's
// gradient reaches the accumulated one whole and one rank accumulating micro-steps adds what dp's ranks reduce
// (llmc/zero.cuh). The same backward over a share of the positions and of the vocabulary
// (position_grads, masked_embedding_grads) serves tensor parallelism's split tables (llmc/tp.cuh), and the
// forward's pieces for them are here too (masked_lookup, add_positions).
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "llmc/device.cuh"
#include "llmc/profile.h"

inline void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
    ProfileScope op("embedding forward");
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float* o = out + ((size_t)b * T + t) * C;
            const float* tok = wte + (size_t)tokens[b * T + t] * C;
            if (!wpe) {  // a model without a position table (Llama: RoPE turns q and k instead)
                for (int c = 0; c < C; c++) o[c] = tok[c];
                continue;
            }
            const float* pos = wpe + (size_t)t * C;
            for (int c = 0; c < C; c++) o[c] = tok[c] + pos[c];
        }
}

// dwpe += dout's rows (R rows from token row `first`) at their positions: each position's rows summed in row
// order, then added once
inline void position_grads(float* dwpe, const float* dout, long R, long first, int T, int C) {
    ProfileScope op("embedding backward");
#pragma omp parallel
    {
        std::vector<float> sum(C);
#pragma omp for
        for (int t = 0; t < T; t++) {
            std::fill(sum.begin(), sum.end(), 0.0f);
            for (long r = ((t - first) % T + T) % T; r < R; r += T)
                for (int c = 0; c < C; c++) sum[c] += dout[r * C + c];
            for (int c = 0; c < C; c++) dwpe[(long)t * C + c] += sum[c];
        }
    }
}

// dwte (the Vl vocab rows from vlo) += d's rows whose token it holds: each token's rows summed in row order,
// then added once
inline void masked_embedding_grads(float* dwte, const float* d, const int* tokens, long n, int C, long vlo, int Vl) {
    ProfileScope op("embedding backward");
    // the rows of each token held here, in row order: a counting sort by token
    auto held = [&](long i) {
        long v = tokens[i] - vlo;
        return v >= 0 && v < Vl ? v : -1L;
    };
    std::vector<long> start(Vl + 1, 0), rows;
    for (long i = 0; i < n; i++)
        if (long v = held(i); v >= 0) start[v + 1]++;
    for (int v = 0; v < Vl; v++) start[v + 1] += start[v];
    rows.resize(start[Vl]);
    std::vector<long> next(start.begin(), start.end() - 1);
    for (long i = 0; i < n; i++)
        if (long v = held(i); v >= 0) rows[next[v]++] = i;
#pragma omp parallel
    {
        std::vector<float> sum(C);
#pragma omp for schedule(dynamic, 64)
        for (int v = 0; v < Vl; v++) {
            if (start[v] == start[v + 1]) continue;
            std::fill(sum.begin(), sum.end(), 0.0f);
            for (long k = start[v]; k < start[v + 1]; k++)
                for (int c = 0; c < C; c++) sum[c] += d[rows[k] * C + c];
            for (int c = 0; c < C; c++) dwte[(long)v * C + c] += sum[c];
        }
    }
}

// dwte (V rows) and dwpe accumulate (+=); the CUDA kernel sizes its sort keys by V and sorts in the workspace
// (the CPU needs none). Without a position table (wpe and dwpe null) the output is the token's row alone.
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C, int V,
                             Workspace) {
    ProfileScope op("embedding backward");
    masked_embedding_grads(dwte, dout, tokens, (long)B * T, C, 0, V);
    if (dwpe) position_grads(dwpe, dout, (long)B * T, 0, T, C);
}

// ==========================================================================================================
// CUDA. The forward is a gather, memory-bound at 6 bytes per output element; a thread moves 16 bytes.
// The backward adds each position's gradient row into its token's row of dwte and its position's row of dwpe.
// Atomic adds would make the order of each sum, and so its bits, vary from run to run; instead the positions
// are stably sorted by token (CUB's radix sort is deterministic), so each token's occurrences form a run in
// position order. The sort looks only at the bits a token id can have: below 65536 tokens the keys are 16-bit,
// which halves the key traffic and the radix passes. The runs are then summed by two kernels:
// - a short run (at most ENCODER_SHORT_RUN positions: nearly every token) by one warp, lanes over channels,
//   in position order;
// - a long run (the hot tokens, such as "the", ",", newline or end of text, thousands of positions in a
//   64K-token batch) by a block of 1024 threads: the run is cut into contiguous slices, one per group of
//   threads, each summed in position order, and the block adds the slices' sums in slice order. The cut
//   depends only on the run's length and C, so the order of every sum is fixed and the bits reproducible.
// The warp that finds a long run's start puts it on a list (an atomic counter hands out the slots, so the
// list's order varies, but which block sums a run does not change the sum), and the warp at its last position
// notes where it ends. dwpe is summed over the batch, one thread per 8 channels of a position, in batch order.
// C must be a multiple of 8, at most ENCODER_MAX_C, and the pointers 16-byte aligned; the entry points check.

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "llmc/cuda_common.cuh"

constexpr int ENCODER_MAX_C = 8192;  // a long-run block's 1024 threads cover the row, 8 channels each
constexpr int ENCODER_SHORT_RUN = 32;  // a warp's lanes look at a run's next 32 positions at once
constexpr int ENCODER_LONG_RUN_THREADS = 1024;

inline void encoder_check_shape(const char* what, int C, std::initializer_list<const void*> pointers) {
    if (C <= 0 || C % 8 != 0 || C > ENCODER_MAX_C)
        fail("%s: C = %d must be a positive multiple of 8, at most %d", what, C, ENCODER_MAX_C);
    for (const void* p : pointers) require_aligned_16(what, p);
}

static __global__ void encoder_forward_kernel(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B,
                                              int T, int C) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)B * T * C) return;
    long bt = i / C;
    int c = (int)(i % C), t = (int)(bt % T);
    float tok[8], pos[8];
    unpack_bf16x8(*reinterpret_cast<const bf16x8*>(wte + (long)tokens[bt] * C + c), tok);
    if (wpe) {  // null: no position table (Llama)
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(wpe + (long)t * C + c), pos);
        for (int j = 0; j < 8; j++) tok[j] += pos[j];
    }
    *reinterpret_cast<bf16x8*>(out + i) = pack_bf16x8(tok);
}

inline void encoder_forward_cuda(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                                 cudaStream_t stream) {
    encoder_check_shape("encoder_forward_cuda", C, {out, wte, wpe});
    if ((long)B * T == 0) return;
    encoder_forward_kernel<<<cuda_blocks((long)B * T * C / 8, 256), 256, 0, stream>>>(out, tokens, wte, wpe, B, T, C);
    cuda_check(cudaGetLastError());
}

// the sort's input: each position's token as a Key, and the position itself
template <typename Key>
static __global__ void encoder_sort_input_kernel(Key* keys, int* positions, const int* tokens, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    keys[i] = (Key)tokens[i];
    positions[i] = i;
}

// sum = Σ dout[sorted_positions[i], c:c+8] over sorted indices i in [begin, end), in order
static __device__ __forceinline__ void encoder_sum_rows(float sum[8], const bf16* dout, const int* sorted_positions,
                                                        int begin, int end, int c, int C) {
    for (int j = 0; j < 8; j++) sum[j] = 0.0f;
#pragma unroll 4
    for (int i = begin; i < end; i++) {
        float v[8];
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(dout + (long)sorted_positions[i] * C + c), v);
        for (int j = 0; j < 8; j++) sum[j] += v[j];
    }
}

// a warp per sorted index: the warp at a run's first index sums a short run into dwte, or lists a long one;
// the warp at a run's last index records where it ends, by token
template <typename Key>
static __global__ void encoder_wte_short_runs_kernel(bf16* dwte, int* long_runs, int* long_run_count, int* run_end,
                                                     const bf16* dout, const Key* sorted_tokens,
                                                     const int* sorted_positions, int n, int C) {
    int i = (int)(((long)blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (i >= n) return;
    Key token = sorted_tokens[i];
    if (lane == 0 && (i == n - 1 || sorted_tokens[i + 1] != token)) run_end[token] = i + 1;
    if (i > 0 && sorted_tokens[i - 1] == token) return;
    // the lanes look at the next 32 indices at once: the run's length is 1 + how many of them match in a row
    unsigned same = __ballot_sync(0xffffffffu, i + 1 + lane < n && sorted_tokens[i + 1 + lane] == token);
    if (same == 0xffffffffu) {
        if (lane == 0) long_runs[atomicAdd(long_run_count, 1)] = i;
        return;
    }
    int end = i + __ffs(~same);
    for (int c = 8 * lane; c < C; c += 8 * 32) {
        float sum[8], old[8];
        encoder_sum_rows(sum, dout, sorted_positions, i, end, c, C);
        bf16x8* w = reinterpret_cast<bf16x8*>(dwte + (long)token * C + c);
        unpack_bf16x8(*w, old);
        for (int j = 0; j < 8; j++) old[j] += sum[j];
        *w = pack_bf16x8(old);
    }
}

// a block per long run (blocks stride over the list): thread t takes channels 8·(t mod C/8) of slice t / (C/8)
template <typename Key>
static __global__ void __launch_bounds__(ENCODER_LONG_RUN_THREADS)
    encoder_wte_long_runs_kernel(bf16* dwte, const int* long_runs, const int* long_run_count, const int* run_end,
                                 const bf16* dout, const Key* sorted_tokens, const int* sorted_positions, int C) {
    extern __shared__ float slice_sums[];  // [slice][C]
    int vectors = C / 8, slices = blockDim.x / vectors;
    int slice = threadIdx.x / vectors, c = 8 * (threadIdx.x % vectors);
    for (int r = blockIdx.x; r < *long_run_count; r += gridDim.x) {
        int start = long_runs[r];
        Key token = sorted_tokens[start];
        int length = run_end[token] - start;
        if (slice < slices) {
            float sum[8];
            encoder_sum_rows(sum, dout, sorted_positions, start + (int)((long)length * slice / slices),
                             start + (int)((long)length * (slice + 1) / slices), c, C);
            for (int j = 0; j < 8; j++) slice_sums[slice * C + c + j] = sum[j];
        }
        __syncthreads();
        for (int ch = threadIdx.x; ch < C; ch += blockDim.x) {
            float total = 0.0f;
            for (int s = 0; s < slices; s++) total += slice_sums[s * C + ch];
            bf16* w = dwte + (long)token * C + ch;
            *w = __float2bfloat16(__bfloat162float(*w) + total);
        }
        __syncthreads();  // slice_sums is reused by the next run
    }
}

// a thread owns 8 channels of one position and sums over the batch in order
static __global__ void encoder_wpe_backward_kernel(bf16* dwpe, const bf16* dout, int B, int T, int C) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)T * C) return;
    float sum[8] = {}, v[8];
#pragma unroll 8
    for (int b = 0; b < B; b++) {
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(dout + (long)b * T * C + i), v);
        for (int j = 0; j < 8; j++) sum[j] += v[j];
    }
    bf16x8* w = reinterpret_cast<bf16x8*>(dwpe + i);
    unpack_bf16x8(*w, v);
    for (int j = 0; j < 8; j++) v[j] += sum[j];
    *w = pack_bf16x8(v);
}

// The backward's scratch, in order, each piece starting on 16 bytes: unsorted and sorted keys (Key each),
// positions and sorted positions (int each), the long-run count, the long-run list (at most n / (SHORT + 1)),
// the run ends by token (V ints), and CUB's temporary space.
template <typename Key>
struct EncoderScratch {
    Key *keys, *sorted_keys;
    int *positions, *sorted_positions, *long_run_count, *long_runs, *run_end;
    void* sort_space;
    size_t sort_bytes, total_bytes;

    EncoderScratch(void* base, int n, int V) {
        cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const Key*)nullptr, (Key*)nullptr,
                                                   (const int*)nullptr, (int*)nullptr, n));
        uintptr_t p = reinterpret_cast<uintptr_t>(base);  // base may be null: then only total_bytes is wanted
        auto take = [&](size_t bytes) {
            void* piece = reinterpret_cast<void*>(p);
            p += (bytes + 15) / 16 * 16;
            return piece;
        };
        keys = static_cast<Key*>(take((size_t)n * sizeof(Key)));
        sorted_keys = static_cast<Key*>(take((size_t)n * sizeof(Key)));
        positions = static_cast<int*>(take((size_t)n * sizeof(int)));
        sorted_positions = static_cast<int*>(take((size_t)n * sizeof(int)));
        long_run_count = static_cast<int*>(take(sizeof(int)));
        long_runs = static_cast<int*>(take((size_t)(n / (ENCODER_SHORT_RUN + 1) + 1) * sizeof(int)));
        run_end = static_cast<int*>(take((size_t)V * sizeof(int)));
        sort_space = take(sort_bytes);
        total_bytes = (size_t)(p - reinterpret_cast<uintptr_t>(base));
    }
};

inline bool encoder_short_keys(int V) { return V <= 65536; }

inline size_t encoder_backward_scratch_bytes(int B, int T, int V) {
    if (encoder_short_keys(V)) return EncoderScratch<uint16_t>(nullptr, B * T, V).total_bytes;
    return EncoderScratch<uint32_t>(nullptr, B * T, V).total_bytes;
}

template <typename Key>
inline void encoder_backward_wte(bf16* dwte, const bf16* dout, const int* tokens, int n, int C, int V, void* scratch,
                                 cudaStream_t stream) {
    EncoderScratch<Key> s(scratch, n, V);
    int key_bits = 1;  // the sort looks at the bits that can differ between token ids 0 .. V-1
    while (key_bits < (int)(8 * sizeof(Key)) && (1L << key_bits) < V) key_bits++;
    encoder_sort_input_kernel<Key><<<cuda_blocks(n, 256), 256, 0, stream>>>(s.keys, s.positions, tokens, n);
    cuda_check(cudaGetLastError());
    cuda_check(cub::DeviceRadixSort::SortPairs(s.sort_space, s.sort_bytes, s.keys, s.sorted_keys, s.positions,
                                               s.sorted_positions, n, 0, key_bits, stream));
    cuda_check(cudaMemsetAsync(s.long_run_count, 0, sizeof(int), stream));
    encoder_wte_short_runs_kernel<Key><<<cuda_blocks(32L * n, 256), 256, 0, stream>>>(
        dwte, s.long_runs, s.long_run_count, s.run_end, dout, s.sorted_keys, s.sorted_positions, n, C);
    cuda_check(cudaGetLastError());
    int most_long_runs = n / (ENCODER_SHORT_RUN + 1);
    if (most_long_runs == 0) return;
    int slices = ENCODER_LONG_RUN_THREADS / (C / 8);
    unsigned int blocks = (unsigned int)std::min(most_long_runs, 2 * cuda_sm_count());
    encoder_wte_long_runs_kernel<Key><<<blocks, ENCODER_LONG_RUN_THREADS, (size_t)slices * C * sizeof(float), stream>>>(
        dwte, s.long_runs, s.long_run_count, s.run_end, dout, s.sorted_keys, s.sorted_positions, C);
    cuda_check(cudaGetLastError());
}

// dwte (V rows) and dwpe accumulate (+=); every token must be below V; scratch holds
// encoder_backward_scratch_bytes(B, T, V) bytes, 16-byte aligned
inline void encoder_backward_cuda(bf16* dwte, bf16* dwpe, const bf16* dout, const int* tokens, int B, int T, int C,
                                  int V, void* scratch, cudaStream_t stream) {
    encoder_check_shape("encoder_backward_cuda", C, {dwte, dwpe, dout, scratch});
    int n = B * T;
    if (n == 0) return;
    if (encoder_short_keys(V)) encoder_backward_wte<uint16_t>(dwte, dout, tokens, n, C, V, scratch, stream);
    else encoder_backward_wte<uint32_t>(dwte, dout, tokens, n, C, V, scratch, stream);
    if (dwpe) encoder_wpe_backward_kernel<<<cuda_blocks((long)T * C / 8, 256), 256, 0, stream>>>(dwpe, dout, B, T, C);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 storage, tokens in device memory

inline void encoder_forward(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C) {
    ProfileScope op("embedding forward");
    encoder_forward_cuda(out, tokens, wte, wpe, B, T, C, main_stream());
}
inline void encoder_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const int* tokens, int B, int T, int C, int V,
                             Workspace workspace) {
    ProfileScope op("embedding backward");
    size_t floats = (encoder_backward_scratch_bytes(B, T, V) + sizeof(float) - 1) / sizeof(float);
    encoder_backward_cuda(dwte, dwpe, dout, tokens, B, T, C, V, workspace.take(floats, "encoder_backward"),
                          main_stream());
}

// position_grads and masked_embedding_grads on bf16, for tensor parallelism's shares (llmc/tp.cuh); the whole
// tables' backward is encoder_backward_cuda's.
// A thread owns one entry of dwpe and walks the rows at its position (every T-th from the first)
static __global__ void position_grads_kernel(bf16* dwpe, const bf16* dout, long R, long first, int T, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)T * C; i += (long)gridDim.x * blockDim.x) {
        long t = i / C;
        int c = (int)(i % C);
        float s = 0.0f;
        for (long r = ((t - first) % T + T) % T; r < R; r += T) s += __bfloat162float(dout[r * C + c]);
        dwpe[i] = __float2bfloat16(__bfloat162float(dwpe[i]) + s);
    }
}
inline void position_grads(bf16* dwpe, const bf16* dout, long R, long first, int T, int C) {
    ProfileScope op("embedding backward");
    launch_elementwise(position_grads_kernel, (long)T * C, dwpe, dout, R, first, T, C);
}

// A block owns a tile of 128 vocab rows × 64 channels and scans the tokens in order, adding the rows of its
// tokens into an fp32 tile in shared memory; a thread owns one channel of the tile, so every entry is summed
// in token order by one thread (reproducible, no atomics). The cost is the scan: every tile reads all BT token
// ids (from cache), where the single-rank encoder sorts them once.
constexpr int VOCAB_TILE_ROWS = 128, VOCAB_TILE_CHANNELS = 64;
static __global__ void masked_embedding_grads_kernel(bf16* dwte, const bf16* d, const int* tokens, long BT, int C,
                                                     long vlo, int Vl) {
    __shared__ float tile[VOCAB_TILE_ROWS][VOCAB_TILE_CHANNELS];
    long row0 = (long)blockIdx.x * VOCAB_TILE_ROWS;
    int c = blockIdx.y * VOCAB_TILE_CHANNELS + threadIdx.x;
    for (int j = 0; j < VOCAB_TILE_ROWS; j++) tile[j][threadIdx.x] = 0.0f;
    if (c >= C) return;  // the threads share no shared-memory entry, so none waits for another
    for (long i = 0; i < BT; i++) {
        long j = tokens[i] - vlo - row0;
        if (j >= 0 && j < VOCAB_TILE_ROWS) tile[j][threadIdx.x] += __bfloat162float(d[i * C + c]);
    }
    for (int j = 0; j < VOCAB_TILE_ROWS && row0 + j < Vl; j++) {
        bf16* w = dwte + (row0 + j) * C + c;
        *w = __float2bfloat16(__bfloat162float(*w) + tile[j][threadIdx.x]);
    }
}
inline void masked_embedding_grads(bf16* dwte, const bf16* d, const int* tokens, long BT, int C, long vlo, int Vl) {
    ProfileScope op("embedding backward");
    dim3 grid(cuda_blocks(Vl, VOCAB_TILE_ROWS), cuda_blocks(C, VOCAB_TILE_CHANNELS));
    masked_embedding_grads_kernel<<<grid, VOCAB_TILE_CHANNELS, 0, main_stream()>>>(dwte, d, tokens, BT, C, vlo, Vl);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// The forward's pieces for tensor parallelism's split tables (llmc/tp.cuh), each a CPU loop and its CUDA kernel:
// a rank looks up only the vocab rows it holds, and the position rows are added once the group has summed the
// lookups.

// out[i] = wte row (tokens[i] - vlo) when this rank holds it (rows [0, Vl)), else zeros
inline void masked_lookup(float* out, const int* tokens, const float* wte, long BT, int C, long vlo, int Vl) {
    ProfileScope op("embedding forward");
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
    ProfileScope op("embedding forward");
    launch_elementwise(masked_lookup_kernel, BT * C, out, tokens, wte, BT, C, vlo, Vl);
}

// out (R rows from token row `first`) = sum + wpe at each row's position; sum may be out
inline void add_positions(float* out, const float* sum, const float* wpe, long R, long first, int T, int C) {
    ProfileScope op("embedding forward");
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
    ProfileScope op("embedding forward");
    launch_elementwise(add_positions_kernel, R * C, out, sum, wpe, R, first, T, C);
}

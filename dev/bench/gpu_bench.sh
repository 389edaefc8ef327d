#!/usr/bin/env bash
# GPU benchmark: on a host with an NVIDIA GPU, builds and runs in one go everything that measures llm5d's CUDA
# side beside its references, and prints the figures:
#   kernels   make -C dev/cuda, then dev/cuda/run_all.sh: every kernel checked against its CPU reference, timed
#   tests     make build/tests, then build/tests "[cuda]": the CUDA tests
#   llm5d     ./train_gpt --device cuda on each shape: ms/step, tokens/s, MFU, memory
#   llmc      llm.c's train_gpt2cu on the same shapes and data, built from LLMC_DIR when it is there
#   pytorch   dev/bench/pytorch_gpt2.py on the same shapes: PyTorch with torch.compile, bf16 autocast, flash
#             attention and fused AdamW
#   profile   one d12 step under Nsight Compute (ncu): each kernel's time and each phase's (forward and backward
#             in and outside the layers, the optimizer), by dev/gpu/kernel_breakdown.py
# A phase that fails does not stop the others; the end is a table of the figures, one line per run
# ("STATUS  name | note") and, last, "N passed, M failed". Exit status 0 when nothing failed, 1 otherwise.
# Without a GPU (nvidia-smi missing or failing) it prints "skipped: no GPU" and exits 0.
#
#   bash dev/bench/gpu_bench.sh
#   PHASES="llm5d pytorch" SHAPES="d12:64" bash dev/bench/gpu_bench.sh
#
# Variables (defaults in brackets):
#   PHASES        which phases to run, in this order                 [kernels tests llm5d llmc pytorch profile]
#   SHAPES        model:batch pairs; a model is d12 d24 d36 d48 or d<L>c<C>h<NH>[t<maxT>]; a batch that
#                 --plan says does not fit the GPU is halved until it does (said in the output) [d12:64 d48:16]
#   SEQ_LEN       T                                                                          [1024]
#   STEPS         PyTorch: timed steps                                                       [50]
#   WARMUP        PyTorch: untimed steps before them (torch.compile compiles here)            [5]
#   LLM5D_STEPS   llm5d and llm.c: training steps (-x)                                       [60]
#   LLM5D_SKIP    llm5d and llm.c: first steps left out of the medians                       [10]
#   LLM5D_FLAGS   llm5d: flags added to every run                                            [-r 0]
#   LLMC_DIR      an llm.c checkout (never committed here)                  [.bench/llm.c when it exists]
#   LLMC_BUILD    the script that builds its train_gpt2cu in a patched scratch copy     [.bench/build-llmc.sh]
#   LLMC_OUT      where that build goes; a train_gpt2cu there newer than LLMC_DIR's is reused   [.bench/out]
#   CUDNN_FRONTEND_DIR  a cudnn-frontend checkout, for llm.c's cuDNN attention [.bench/cudnn-frontend if there]
#   LLMC_CUDA_ARCH  the build script's CUDA_ARCH (its own form: arch=compute_90,code=[...])    [its default]
#   PROFILE_SHAPE   model:batch of the profiled step                                         [d12:64]
#   NCU           Nsight Compute                      [ncu on PATH, else under /usr/local/cuda or /opt/nvidia]
#   PYTHON        an interpreter with torch (CUDA)                                           [python3]
#   DATA, VAL     llm.c token shards for every trainer; without DATA, PyTorch uses random tokens
#                 (said in its output) and the others fail            [data/sotu/train.bin, data/sotu/val.bin]
#   PEAK_TFLOPS   the GPU's dense bf16 peak, for MFU (988.8: H100 SXM, llm.c's figure)       [988.8]
#   CUDA_ARCH     passed to make through the environment (the Makefiles have a default)
#   NO_BUILD=1    use the binaries as they are (built elsewhere, or by dev/gpu/verify.sh)
#   JOBS          parallel make jobs                                                         [nproc]
#   TIMEOUT       seconds each run may take; 0 = no limit                                    [0]
#   ENV_SCRIPT    a file sourced before building, e.g. one that points CPATH / LIBRARY_PATH / PATH at MPI
#                 and Catch2 on a host without them in the system paths                     [none]
#   TRAIN_GPT     our binary                                                                 [./train_gpt]
#   BENCH_TMP     directory for the logs of every phase; kept if given, else a fresh one under /tmp,
#                 removed at exit unless KEEP_LOGS=1
#
# MFU, for every trainer alike, as llm.c computes it: tokens/s x (6N + 6·L·C·T) / peak, N counting every
# parameter (the embedding of the padded vocabulary, 50304 rows, once: it is tied to the classifier). Memory:
# each trainer's own figure (llm5d: the device memory in use after the first step; llm.c: after its
# allocations; PyTorch: torch.cuda.max_memory_allocated) and, the same for all, the peak of nvidia-smi's
# memory.used sampled every 0.2 s during the run, less what was in use before it.

set -euo pipefail

ALL_PHASES="kernels tests llm5d llmc pytorch profile"
PHASES=${PHASES:-$ALL_PHASES}
SHAPES=${SHAPES:-d12:64 d48:16}
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-50}
WARMUP=${WARMUP:-5}
LLM5D_STEPS=${LLM5D_STEPS:-60}
LLM5D_SKIP=${LLM5D_SKIP:-10}
LLM5D_FLAGS=${LLM5D_FLAGS--r 0}
LLMC_DIR=${LLMC_DIR:-.bench/llm.c}
LLMC_BUILD=${LLMC_BUILD:-.bench/build-llmc.sh}
LLMC_OUT=${LLMC_OUT:-.bench/out}
CUDNN_FRONTEND_DIR=${CUDNN_FRONTEND_DIR:-.bench/cudnn-frontend}
PROFILE_SHAPE=${PROFILE_SHAPE:-d12:64}
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/sotu/train.bin}
VAL=${VAL:-data/sotu/val.bin}
PEAK_TFLOPS=${PEAK_TFLOPS:-988.8}
NO_BUILD=${NO_BUILD:-0}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
TIMEOUT=${TIMEOUT:-0}
ENV_SCRIPT=${ENV_SCRIPT:-}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
KEEP_LOGS=${KEEP_LOGS:-0}
VOCAB=50257

die() { echo "gpu_bench: $*" >&2; exit 2; }
absolute() { [[ $1 == /* ]] && echo "$1" || echo "$ROOT/$1"; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no GPU"
    exit 0
fi

for p in $PHASES; do
    [[ " $ALL_PHASES " == *" $p "* ]] || die "PHASES: unknown phase '$p' (known: $ALL_PHASES)"
done
for n in SEQ_LEN STEPS LLM5D_STEPS; do
    [[ ${!n} =~ ^[0-9]+$ && ${!n} -ge 1 ]] || die "$n must be a positive integer (got '${!n}')"
done
for n in WARMUP LLM5D_SKIP TIMEOUT JOBS; do
    [[ ${!n} =~ ^[0-9]+$ ]] || die "$n must be a non-negative integer (got '${!n}')"
done
(( LLM5D_SKIP < LLM5D_STEPS )) || die "LLM5D_SKIP ($LLM5D_SKIP) must be below LLM5D_STEPS ($LLM5D_STEPS)"
if [[ -n $ENV_SCRIPT ]]; then
    [[ -f $ENV_SCRIPT ]] || die "ENV_SCRIPT=$ENV_SCRIPT: no such file"
    # shellcheck disable=SC1090
    source "$ENV_SCRIPT"
fi

REMOVE_SCRATCH=0
if [[ -n ${BENCH_TMP:-} ]]; then
    SCRATCH=$BENCH_TMP
    mkdir -p "$SCRATCH"
else
    SCRATCH=$(mktemp -d /tmp/llm5d_gpu_bench.XXXXXX)
    [[ $KEEP_LOGS == 1 ]] || REMOVE_SCRATCH=1
fi
SCRATCH=$(cd "$SCRATCH" && pwd)
SAMPLER_PID=""
cleanup() {
    [[ -n $SAMPLER_PID ]] && kill "$SAMPLER_PID" 2>/dev/null
    if [[ $REMOVE_SCRATCH == 1 ]]; then rm -rf "$SCRATCH"; else echo "logs in $SCRATCH"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------------------
# helpers

NAMES=()    # one entry per run: its name, status (PASS FAIL SKIP) and a note
STATUS=()
NOTES=()
record() { NAMES+=("$1"); STATUS+=("$2"); NOTES+=("${3:-}"); }
note() { NOTES[-1]="${NOTES[-1]:+${NOTES[-1]}; }$1"; }

# run_logged LOG CMD...: runs CMD (under TIMEOUT when set), its output shown and kept in LOG; returns its status
run_logged() {
    local log=$1; shift
    local rc=0
    echo "\$ $*"
    if (( TIMEOUT > 0 )); then
        timeout -k 10 "$TIMEOUT" "$@" 2>&1 | tee "$log" || rc=$?
    else
        "$@" 2>&1 | tee "$log" || rc=$?
    fi
    if (( rc == 124 && TIMEOUT > 0 )); then echo "gpu_bench: timed out after $TIMEOUT s"; fi
    return "$rc"
}

# GPU memory in use (MiB), as nvidia-smi reports it for the first GPU
memory_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -n 1 | xargs; }

# phase NAME CMD...: one run; PASS when CMD exits 0. Its log: $LAST_LOG ($SCRATCH/NAME, odd characters as _).
# While it runs, nvidia-smi's memory.used is sampled: $LAST_PEAK_MIB is its peak less the use before the run.
LAST_LOG="" LAST_PEAK_MIB=""
phase() {
    local name=$1; shift
    LAST_LOG=$SCRATCH/${name//[^A-Za-z0-9_.-]/_}.log
    echo
    echo "== $name"
    local rc=0 before samples=$SCRATCH/memory_samples
    before=$(memory_used)
    (while :; do memory_used; sleep 0.2; done) >"$samples" 2>/dev/null &
    SAMPLER_PID=$!
    run_logged "$LAST_LOG" "$@" || rc=$?
    kill "$SAMPLER_PID" 2>/dev/null || true
    wait "$SAMPLER_PID" 2>/dev/null || true
    SAMPLER_PID=""
    LAST_PEAK_MIB=$(awk -v b="${before:-0}" '$1 ~ /^[0-9]+$/ && $1 > m { m = $1 } END { if (m > 0) print m - b }' "$samples")
    if (( rc == 0 )); then record "$name" PASS
    elif (( rc == 124 && TIMEOUT > 0 )); then record "$name" FAIL "timed out after $TIMEOUT s"
    else record "$name" FAIL "exit status $rc"; fi
    if (( rc != 0 )); then
        grep -qiE "out of memory|cudaErrorMemoryAllocation" "$LAST_LOG" && note "out of memory"
        # the program's own last word
        note "$(grep -E '^([a-z_0-9-]+: |[A-Za-z]*Error)' "$LAST_LOG" | tail -n 1 || true)"
    fi
    return 0
}

# make_phase NAME MAKE_ARGS...: a build, unless NO_BUILD=1; true when the binaries are there to use
make_phase() {
    local name=$1; shift
    if [[ $NO_BUILD == 1 ]]; then return 0; fi
    phase "$name" make --no-print-directory -j"$JOBS" "$@"
    [[ ${STATUS[-1]} == PASS ]]
}

# the last "N passed, M failed" line of a log, if any
passed_line() { grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" 2>/dev/null | tail -n 1 || true; }

# shape_dims MODEL: prints "L C NH maxT" for a model descriptor, or fails
shape_dims() {
    case $1 in
        d12) echo "12 768 12 1024" ;;
        d24) echo "24 1024 16 1024" ;;
        d36) echo "36 1280 20 1024" ;;
        d48) echo "48 1600 25 1024" ;;
        *)
            if [[ $1 =~ ^d([0-9]+)c([0-9]+)h([0-9]+)(t([0-9]+))?$ ]]; then
                echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]} ${BASH_REMATCH[5]:-1024}"
            else
                return 1
            fi ;;
    esac
}

# flops_per_token L C maxT T: llm.c's 6N + 6·L·C·T, N with the vocabulary padded to a multiple of 128
flops_per_token() {
    local L=$1 C=$2 maxT=$3 T=$4
    local Vp=$(( (VOCAB + 127) / 128 * 128 ))
    local N=$(( Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C ))
    echo $(( 6 * N + 6 * L * C * T ))
}

# step_figures LOG SKIP TOKENS_PER_STEP FLOPS_PER_TOKEN: "MS TOK_S MFU STEPS" from the step lines that llm5d
# and llm.c both print ("step    12/60 | loss ... | 123.45 ms | ..."): the median step time over the steps
# after the first SKIP, the tokens/s and MFU it gives (a trainer's own tok/s may be smoothed: llm.c's is)
step_figures() {
    awk -v skip="$2" -v tps="$3" -v fpt="$4" -v peak="$PEAK_TFLOPS" '
        function median(a, n,    i, j, t) {
            for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
            return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        }
        /^step +[0-9]+\/[0-9]+ *\|/ {
            if (++seen <= skip) next
            for (i = 2; i <= NF; i++) if ($i == "ms" && $(i - 1) ~ /^[0-9.]+$/) { n++; ms[n] = $(i - 1) + 0; break }
        }
        END {
            if (n == 0) { print "- - - 0"; exit }
            m = median(ms, n); tok = tps / (m / 1000)
            printf "%.2f %.0f %.2f %d\n", m, tok, 100 * tok * fpt / (peak * 1e12), n
        }' "$1"
}

# ---------------------------------------------------------------------------------------------------------
# machine

GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -n 1 | xargs)
echo "== machine"
echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null |
    sed 's/^/gpu:     /' || true
echo "nvcc:    $( (${NVCC:-/usr/local/cuda/bin/nvcc} --version 2>/dev/null || nvcc --version 2>/dev/null) | grep -i release | sed 's/.*release //' || echo 'not found')"
echo "cpu:     $(nproc) cores; make -j$JOBS"
echo "llm5d:   $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
echo "phases:  $PHASES; shapes: $SHAPES at T=$SEQ_LEN; peak $PEAK_TFLOPS TFLOP/s"

has_phase() { [[ " $PHASES " == *" $1 "* ]]; }

# fitting_batch MODEL B: B, halved while --plan --device cuda predicts more than 95% of the GPU's memory (B
# unchanged when --plan cannot say); prints "B NOTE"
fitting_batch() {
    local model=$1 b=$2 total note=""
    # shellcheck disable=SC2086  # LLM5D_FLAGS is a flag list
    while (( b > 1 )) &&
        total=$("$TRAIN_GPT" --plan --device cuda -e "$model" -b "$b" -t "$SEQ_LEN" $LLM5D_FLAGS 2>/dev/null |
            sed -n 's/^ *total *\([0-9]*\) bytes.*/\1/p' | tail -n 1) &&
        [[ -n $total && -n $GPU_MIB ]] && (( total / 1048576 > GPU_MIB * 95 / 100 )); do
        note="${note:-B=$b does not fit: }--plan $((total / 1048576)) MiB of $GPU_MIB; "
        b=$((b / 2))
    done
    echo "$b ${note:+${note}B=$b}"
}

# the shapes, checked once: "MODEL B L C NH maxT FLOPS_PER_TOKEN" each; B as --plan says it fits
SHAPE_ROWS=()
declare -A SHAPE_NOTE
for s in $SHAPES; do
    [[ $s =~ ^([A-Za-z0-9.-]+):([0-9]+)$ ]] || die "SHAPES: '$s' is not MODEL:BATCH"
    model=${BASH_REMATCH[1]} batch=${BASH_REMATCH[2]}
    dims=$(shape_dims "$model") || die "SHAPES: unknown model '$model'"
    read -r L C NH maxT <<<"$dims"
    (( SEQ_LEN <= maxT )) || die "SEQ_LEN $SEQ_LEN exceeds $model's maximum sequence length $maxT"
    if [[ -x $TRAIN_GPT ]]; then
        read -r batch fit_note <<<"$(fitting_batch "$model" "$batch")"
        [[ -n $fit_note ]] && SHAPE_NOTE[$model:$batch]=$fit_note && echo "shape:   $model: $fit_note"
    fi
    SHAPE_ROWS+=("$model $batch $L $C $NH $maxT $(flops_per_token "$L" "$C" "$maxT" "$SEQ_LEN")")
done

# ---------------------------------------------------------------------------------------------------------
# kernels: the standalone checks and timings of dev/cuda

if has_phase kernels; then
    if make_phase "kernels: make -C dev/cuda" -C dev/cuda; then
        phase "kernels: dev/cuda/run_all.sh" dev/cuda/run_all.sh
        line=$(passed_line "$LAST_LOG")
        [[ -n $line ]] && note "programs: $line"
    else
        record "kernels: dev/cuda/run_all.sh" SKIP "the build failed"
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# tests: the CUDA tests (Catch2)

if has_phase tests; then
    if make_phase "tests: make build/tests" build/tests; then
        phase "tests: build/tests [cuda]" build/tests "[cuda]"
        line=$(grep -E '^(All tests passed|test cases:)' "$LAST_LOG" | tail -n 1 || true)
        [[ -n $line ]] && note "$line"
    else
        record "tests: build/tests [cuda]" SKIP "the build failed"
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# llm5d: ./train_gpt --device cuda on each shape

declare -A MS TOK MFU MEM OWN_MEM   # keyed by "trainer:model:batch"
# figures TRAINER MODEL BATCH TOKENS_PER_STEP FPT: the medians of $LAST_LOG's step lines into the tables
figures() {
    local k=$1:$2:$3 ms tok mfu counted
    read -r ms tok mfu counted <<<"$(step_figures "$LAST_LOG" "$LLM5D_SKIP" "$4" "$5")"
    if [[ ${STATUS[-1]} == PASS && $counted == 0 ]]; then
        STATUS[-1]=FAIL; note "no step lines after the first $LLM5D_SKIP"
    elif [[ $counted != 0 ]]; then
        MS[$k]=$ms TOK[$k]=$tok MFU[$k]=$mfu
        note "median of $counted steps: $ms ms, $tok tok/s, MFU $mfu%"
    fi
    [[ ${STATUS[-1]} == PASS && -n $LAST_PEAK_MIB ]] && MEM[$k]=$LAST_PEAK_MIB && note "peak $LAST_PEAK_MIB MiB (nvidia-smi)"
    return 0
}

if has_phase llm5d; then
    if make_phase "llm5d: make train_gpt" train_gpt; then
        for row in "${SHAPE_ROWS[@]}"; do
            read -r model batch L C NH maxT fpt <<<"$row"
            # shellcheck disable=SC2086  # LLM5D_FLAGS is a flag list
            phase "llm5d: $model B=$batch" "$TRAIN_GPT" --device cuda -e "$model" -b "$batch" -t "$SEQ_LEN" \
                -x "$LLM5D_STEPS" $LLM5D_FLAGS -v 0 -s 0 -i "$DATA" -j "$VAL"
            device=$(grep -m 1 '^device' "$LAST_LOG" || true)
            if [[ ${STATUS[-1]} == PASS && $device != "device: cuda"* ]]; then
                STATUS[-1]=FAIL; note "ran on: ${device:-no device line}"
            fi
            [[ -n ${SHAPE_NOTE[$model:$batch]:-} ]] && note "${SHAPE_NOTE[$model:$batch]}"
            figures llm5d "$model" "$batch" $((batch * SEQ_LEN)) "$fpt"
            mem=$(sed -n 's/^memory: planned \([0-9.]*\) MiB, measured \([0-9.]*\) MiB.*/\2 (planned \1)/p' "$LAST_LOG" | head -n 1)
            [[ -n $mem ]] && OWN_MEM[llm5d:$model:$batch]=$mem && note "memory $mem MiB"
        done
    else
        for row in "${SHAPE_ROWS[@]}"; do
            read -r model batch _ <<<"$row"
            record "llm5d: $model B=$batch" SKIP "the build failed"
        done
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# llmc: llm.c's train_gpt2cu, built from LLMC_DIR by LLMC_BUILD (a patched scratch copy; never committed)

if has_phase llmc; then
    LLMC_BIN=$LLMC_OUT/train_gpt2cu
    llmc_ready=0
    if [[ ! -f $LLMC_DIR/train_gpt2.cu ]]; then
        record "llmc: build" SKIP "no llm.c checkout at LLMC_DIR=$LLMC_DIR"
    elif [[ -x $LLMC_BIN && $LLMC_BIN -nt $LLMC_DIR/train_gpt2.cu ]]; then
        llmc_ready=1
    elif [[ ! -f $LLMC_BUILD ]]; then
        record "llmc: build" SKIP "no build script at LLMC_BUILD=$LLMC_BUILD"
    else
        fe=()
        [[ -d $CUDNN_FRONTEND_DIR/include ]] && fe=("$CUDNN_FRONTEND_DIR")
        # the build script reads CUDA_ARCH in its own form
        phase "llmc: build" env -u CUDA_ARCH ${LLMC_CUDA_ARCH:+CUDA_ARCH="$LLMC_CUDA_ARCH"} \
            bash "$LLMC_BUILD" "$LLMC_DIR" "$LLMC_OUT" "${fe[@]}"
        [[ ${STATUS[-1]} == PASS ]] && llmc_ready=1
        note "$(grep -m 1 '^build-llmc: built' "$LAST_LOG" || true)"
    fi
    for row in "${SHAPE_ROWS[@]}"; do
        read -r model batch L C NH maxT fpt <<<"$row"
        name="llmc: $model B=$batch"
        if (( !llmc_ready )); then record "$name" SKIP "no train_gpt2cu"; continue; fi
        if [[ ! $model =~ ^d(12|24|36|48)$ ]]; then record "$name" SKIP "llm.c builds only d12 d24 d36 d48"; continue; fi
        # from its own directory: it looks for its tokenizer there, and writes nothing without -o. llm.c takes
        # the step modulo -v and -s (0 divides by zero): both past the last step, so validation and a sample
        # run only around the timed steps. Its validation reads B·T+1 tokens of one shard at least, more than
        # the SOTU validation shard holds: it validates on the training shard, which changes no timed step.
        # shellcheck disable=SC2016  # the inner script's own arguments
        phase "$name" bash -c 'cd "$1" && shift && exec ./train_gpt2cu "$@"' llmc "$LLMC_OUT" \
            -i "$(absolute "$DATA")" -j "$(absolute "$DATA")" -e "$model" -b "$batch" -t "$SEQ_LEN" \
            -x "$LLM5D_STEPS" -v $((LLM5D_STEPS + 1)) -s $((LLM5D_STEPS + 1)) -m 1 -h 0 -r 0 -ge 1
        figures llmc "$model" "$batch" $((batch * SEQ_LEN)) "$fpt"
        mem=$(sed -n 's/^device memory usage: \([0-9]*\) MiB.*/\1/p' "$LAST_LOG" | head -n 1)
        [[ -n $mem ]] && OWN_MEM[llmc:$model:$batch]=$mem && note "device memory usage $mem MiB (llm.c's line)"
    done
fi

# ---------------------------------------------------------------------------------------------------------
# pytorch: the reference on the same shapes

if has_phase pytorch; then
    data_args=(--data "$DATA")
    if [[ ! -f $DATA ]]; then
        echo
        echo "gpu_bench: $DATA missing: PyTorch trains on random tokens (the step time does not depend on them)"
        data_args=(--synthetic)
    fi
    for row in "${SHAPE_ROWS[@]}"; do
        read -r model batch L C NH maxT fpt <<<"$row"
        phase "pytorch: $model B=$batch" "$PYTHON" dev/bench/pytorch_gpt2.py --layers "$L" --channels "$C" \
            --heads "$NH" --vocab "$VOCAB" --max-seq-len "$maxT" --seq-len "$SEQ_LEN" --batch "$batch" \
            --steps "$STEPS" --warmup "$WARMUP" --peak-tflops "$PEAK_TFLOPS" "${data_args[@]}"
        k=pytorch:$model:$batch
        summary=$(grep -E '^timed steps: ' "$LAST_LOG" | tail -n 1 || true)
        final=$(grep -E '^pytorch: tokens/s ' "$LAST_LOG" | tail -n 1 || true)
        if [[ $summary =~ median\ ([0-9.]+)\ ms && $final =~ tokens/s\ ([0-9.]+)\ MFU\ ([0-9.]+)% ]]; then
            MS[$k]=$(grep -oE 'median [0-9.]+' <<<"$summary" | cut -d' ' -f2)
            TOK[$k]=${BASH_REMATCH[1]} MFU[$k]=${BASH_REMATCH[2]}
            note "median ${MS[$k]} ms; ${TOK[$k]} tok/s, MFU ${MFU[$k]}% (all timed tokens / all timed seconds)"
        elif [[ ${STATUS[-1]} == PASS ]]; then
            STATUS[-1]=FAIL; note "no summary line"
        fi
        own=$(sed -n 's/^peak memory: \([0-9]*\) bytes.*/\1/p' "$LAST_LOG" | tail -n 1)
        [[ -n $own ]] && OWN_MEM[$k]=$((own / 1048576)) && note "max_memory_allocated ${OWN_MEM[$k]} MiB"
        [[ ${STATUS[-1]} == PASS && -n $LAST_PEAK_MIB ]] && MEM[$k]=$LAST_PEAK_MIB && note "peak $LAST_PEAK_MIB MiB (nvidia-smi)"
    done
fi

# ---------------------------------------------------------------------------------------------------------
# profile: one step's kernels under Nsight Compute

if has_phase profile; then
    ncu_bin=${NCU:-$(command -v ncu || true)}
    for candidate in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
        [[ -z $ncu_bin && -x $candidate ]] && ncu_bin=$candidate
    done
    if [[ ! $PROFILE_SHAPE =~ ^([A-Za-z0-9.-]+):([0-9]+)$ ]]; then
        die "PROFILE_SHAPE: '$PROFILE_SHAPE' is not MODEL:BATCH"
    fi
    model=${BASH_REMATCH[1]} batch=${BASH_REMATCH[2]}
    name="profile: $model B=$batch, one step"
    if [[ -z $ncu_bin || ! -x $ncu_bin ]]; then
        record "$name" SKIP "no Nsight Compute (ncu) found; set NCU"
    else
        csv=$SCRATCH/profile_${model}_B$batch.csv
        # two steps: the second has no first-step set-up in it; one metric, so each kernel runs once
        # shellcheck disable=SC2086  # LLM5D_FLAGS is a flag list
        phase "$name: ncu" "$ncu_bin" --csv --page raw --nvtx --print-units base --clock-control none \
            --metrics gpu__time_duration.sum --log-file "$csv" \
            "$TRAIN_GPT" --device cuda -e "$model" -b "$batch" -t "$SEQ_LEN" -x 2 $LLM5D_FLAGS -v 0 -s 0 -i "$DATA"
        if [[ ${STATUS[-1]} == PASS ]]; then
            step_ms=${MS[llm5d:$model:$batch]:-}
            phase "$name" "$PYTHON" dev/gpu/kernel_breakdown.py "$csv" ${step_ms:+--step-ms "$step_ms"}
            note "$(grep -m 1 '^kernel time of one step' "$LAST_LOG" || true)"
            note "$(grep -m 1 'the GPU busy' "$LAST_LOG" | sed 's/.*: the GPU/the GPU/' || true)"
        fi
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# report

if has_phase llm5d || has_phase llmc || has_phase pytorch; then
    echo
    echo "== figures: T=$SEQ_LEN, MFU = tok/s x (6N + 6LCT) / $PEAK_TFLOPS TFLOP/s; memory: peak of nvidia-smi's memory.used (MiB)"
    echo "   (llm5d, llm.c: median step over steps $((LLM5D_SKIP + 1))-$LLM5D_STEPS; pytorch: $STEPS timed steps)"
    printf '%-8s %-4s %-8s %10s %10s %7s %9s %18s\n' model B trainer ms/step tok/s MFU% "peak MiB" "own figure MiB"
    for row in "${SHAPE_ROWS[@]}"; do
        read -r model batch _ <<<"$row"
        for trainer in llm5d llmc pytorch; do
            has_phase "$trainer" || continue
            k=$trainer:$model:$batch
            printf '%-8s %-4s %-8s %10s %10s %7s %9s %18s\n' "$model" "$batch" "$trainer" "${MS[$k]:--}" \
                "${TOK[$k]:--}" "${MFU[$k]:--}" "${MEM[$k]:--}" "${OWN_MEM[$k]:--}"
        done
        for ref in llmc pytorch; do
            a=${TOK[llm5d:$model:$batch]:-} b=${TOK[$ref:$model:$batch]:-}
            [[ -n $a && -n $b ]] && awk -v a="$a" -v b="$b" -v m="$model" -v n="$batch" -v r="$ref" \
                'BEGIN { printf "%-8s %-4s llm5d / %s: %.2fx the tokens/s\n", m, n, r, a / b }'
        done
    done
    echo
fi

echo "== summary"
passed=0 failed=0 skipped=0
for i in "${!NAMES[@]}"; do
    echo "${STATUS[$i]}  ${NAMES[$i]}${NOTES[$i]:+ | ${NOTES[$i]}}"
    case ${STATUS[$i]} in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
done
(( skipped == 0 )) || echo "($skipped skipped, not counted below)"
echo "$passed passed, $failed failed"
(( failed == 0 ))

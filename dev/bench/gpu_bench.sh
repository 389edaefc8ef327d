#!/usr/bin/env bash
# GPU benchmark: on a host with an NVIDIA GPU, builds and runs in one go everything that measures llm5d's CUDA
# side, and prints the figures:
#   kernels   make -C dev/cuda, then dev/cuda/run_all.sh: every kernel checked against its CPU reference, timed
#   tests     make build/tests, then build/tests "[cuda]": the CUDA kernel tests
#   llm5d     ./train_gpt --device cuda on each shape (tokens/s and MFU from its step lines); while train_gpt
#             refuses --device cuda this says so and goes on
#   pytorch   dev/bench/pytorch_gpt2.py on the same shapes: PyTorch with torch.compile, bf16 autocast, flash
#             attention and fused AdamW, the side-by-side reference
# A phase that fails does not stop the others; the end is a table of the figures, one line per phase
# (PASS, FAIL or SKIP) and, last, "N passed, M failed". Exit status 0 when nothing failed, 1 otherwise.
# Without a GPU (nvidia-smi missing or failing) it prints "skipped: no GPU" and exits 0.
#
#   bash dev/bench/gpu_bench.sh
#   PHASES="llm5d pytorch" SHAPES="d12:64" bash dev/bench/gpu_bench.sh
#
# Variables (defaults in brackets):
#   PHASES        which phases to run, in this order                        [kernels tests llm5d pytorch]
#   SHAPES        model:batch pairs; a model is d12 d24 d36 d48 or d<L>c<C>h<NH>[t<maxT>] [d12:64 d48:16]
#   SEQ_LEN       T                                                                          [1024]
#   STEPS         PyTorch: timed steps                                                       [50]
#   WARMUP        PyTorch: untimed steps before them (torch.compile compiles here)            [5]
#   LLM5D_STEPS   llm5d: training steps (-x)                                                 [60]
#   LLM5D_SKIP    llm5d: first steps left out of the medians                                 [10]
#   LLM5D_FLAGS   llm5d: flags added to every run                                            [-r 0]
#   PYTHON        an interpreter with torch (CUDA)                                           [python3]
#   DATA          llm.c token shard for both trainers; if missing, PyTorch uses random tokens
#                 (said in its output) and llm5d fails                               [data/sotu/train.bin]
#   PEAK_TFLOPS   the GPU's dense bf16 peak, for MFU (988.8: H100 SXM, llm.c's figure)       [988.8]
#   CUDA_ARCH     passed to make through the environment (the Makefiles default to sm_90a)
#   JOBS          parallel make jobs                                                         [nproc]
#   TIMEOUT       seconds each phase may run; 0 = no limit                                   [0]
#   ENV_SCRIPT    a file sourced before building, e.g. one that points CPATH / LIBRARY_PATH / PATH at MPI
#                 and Catch2 on a host without them in the system paths                     [none]
#   TRAIN_GPT     our binary                                                                 [./train_gpt]
#   BENCH_TMP     directory for the logs of every phase; kept if given, else a fresh one under /tmp,
#                 removed at exit unless KEEP_LOGS=1
#
# MFU, as llm.c computes it: tokens/s x (6N + 6·L·C·T) / peak, N counting every parameter (the embedding of the
# padded vocabulary, 50304 rows, once: it is tied to the classifier).

set -euo pipefail

PHASES=${PHASES:-kernels tests llm5d pytorch}
SHAPES=${SHAPES:-d12:64 d48:16}
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-50}
WARMUP=${WARMUP:-5}
LLM5D_STEPS=${LLM5D_STEPS:-60}
LLM5D_SKIP=${LLM5D_SKIP:-10}
LLM5D_FLAGS=${LLM5D_FLAGS--r 0}
PYTHON=${PYTHON:-python3}
DATA=${DATA:-data/sotu/train.bin}
PEAK_TFLOPS=${PEAK_TFLOPS:-988.8}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
TIMEOUT=${TIMEOUT:-0}
ENV_SCRIPT=${ENV_SCRIPT:-}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
KEEP_LOGS=${KEEP_LOGS:-0}
VOCAB=50257

die() { echo "gpu_bench: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no GPU"
    exit 0
fi

for p in $PHASES; do
    [[ $p == kernels || $p == tests || $p == llm5d || $p == pytorch ]] || die "PHASES: unknown phase '$p'"
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
cleanup() { if [[ $REMOVE_SCRATCH == 1 ]]; then rm -rf "$SCRATCH"; else echo "logs in $SCRATCH"; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------------------
# helpers

NAMES=()    # one entry per phase run: its name, status (PASS FAIL SKIP) and a note
STATUS=()
NOTES=()
record() { NAMES+=("$1"); STATUS+=("$2"); NOTES+=("${3:-}"); }

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

# phase NAME CMD...: one phase; PASS when CMD exits 0. Its log: $LAST_LOG ($SCRATCH/NAME, odd characters as _)
LAST_LOG=""
phase() {
    local name=$1; shift
    LAST_LOG=$SCRATCH/${name//[^A-Za-z0-9_.-]/_}.log
    echo
    echo "== $name"
    local rc=0
    run_logged "$LAST_LOG" "$@" || rc=$?
    if (( rc == 0 )); then record "$name" PASS
    elif (( rc == 124 && TIMEOUT > 0 )); then record "$name" FAIL "timed out after $TIMEOUT s"
    else record "$name" FAIL "exit status $rc"; fi
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

# llm5d_figures LOG SKIP FLOPS_PER_TOKEN: "TOK_S MFU STEPS" from train_gpt's step lines
# ("step    12/60 | loss ... | 123.4 ms | 531234 tok/s" and, when it prints one, an MFU figure "MFU 45.1%" or
# "45.1% MFU"): medians over the steps after the first SKIP; MFU from the formula when the line has none
llm5d_figures() {
    awk -v skip="$2" -v fpt="$3" -v peak="$PEAK_TFLOPS" '
        function median(a, n,    i, j, t) {
            for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
            return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        }
        /^step +[0-9]+\/[0-9]+ *\|/ {
            if (++seen <= skip) next
            tok = ""; mfu = ""
            for (i = 2; i <= NF; i++) {
                if ($i == "tok/s") tok = $(i - 1)
                if ($i ~ /^MFU:?$/ && $(i + 1) ~ /^[0-9.]+%?$/) mfu = $(i + 1)
                if ($i ~ /^MFU[:=][0-9.]+%?$/) { mfu = $i; sub(/^MFU[:=]/, "", mfu) }
                if ($i == "MFU" && $(i - 1) ~ /^[0-9.]+%$/) mfu = $(i - 1)
            }
            if (tok == "") next
            n++; toks[n] = tok + 0
            if (mfu != "") { sub(/%$/, "", mfu); m++; mfus[m] = mfu + 0 }
        }
        END {
            if (n == 0) { print "nan nan 0"; exit }
            t = median(toks, n)
            u = m > 0 ? median(mfus, m) : 100 * t * fpt / (peak * 1e12)
            printf "%.0f %.2f %d\n", t, u, n
        }' "$1"
}

# ---------------------------------------------------------------------------------------------------------
# machine

echo "== machine"
echo "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null |
    sed 's/^/gpu:     /' || true
echo "nvcc:    $( (${NVCC:-/usr/local/cuda/bin/nvcc} --version 2>/dev/null || nvcc --version 2>/dev/null) | grep -i release | sed 's/.*release //' || echo 'not found')"
echo "cpu:     $(nproc) cores; make -j$JOBS"
echo "llm5d:   $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
echo "phases:  $PHASES; shapes: $SHAPES at T=$SEQ_LEN; peak $PEAK_TFLOPS TFLOP/s"

has_phase() { [[ " $PHASES " == *" $1 "* ]]; }

# the shapes, checked once: "MODEL B L C NH maxT FLOPS_PER_TOKEN" each
SHAPE_ROWS=()
for s in $SHAPES; do
    [[ $s =~ ^([A-Za-z0-9]+):([0-9]+)$ ]] || die "SHAPES: '$s' is not MODEL:BATCH"
    model=${BASH_REMATCH[1]} batch=${BASH_REMATCH[2]}
    dims=$(shape_dims "$model") || die "SHAPES: unknown model '$model'"
    read -r L C NH maxT <<<"$dims"
    (( SEQ_LEN <= maxT )) || die "SEQ_LEN $SEQ_LEN exceeds $model's maximum sequence length $maxT"
    SHAPE_ROWS+=("$model $batch $L $C $NH $maxT $(flops_per_token "$L" "$C" "$maxT" "$SEQ_LEN")")
done

# ---------------------------------------------------------------------------------------------------------
# kernels: the standalone checks and timings of dev/cuda

if has_phase kernels; then
    phase "kernels: make -C dev/cuda" make --no-print-directory -j"$JOBS" -C dev/cuda
    if [[ ${STATUS[-1]} == PASS ]]; then
        phase "kernels: dev/cuda/run_all.sh" dev/cuda/run_all.sh
        line=$(passed_line "$LAST_LOG")
        [[ -n $line ]] && NOTES[-1]="programs: $line"
    else
        record "kernels: dev/cuda/run_all.sh" SKIP "the build failed"
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# tests: the CUDA kernel tests (Catch2)

if has_phase tests; then
    phase "tests: make build/tests" make --no-print-directory -j"$JOBS" build/tests
    if [[ ${STATUS[-1]} == PASS ]]; then
        phase "tests: build/tests [cuda]" build/tests "[cuda]"
        line=$(grep -E '^(All tests passed|test cases:)' "$LAST_LOG" | tail -n 1 || true)
        [[ -n $line ]] && NOTES[-1]=$line
    else
        record "tests: build/tests [cuda]" SKIP "the build failed"
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# llm5d: ./train_gpt --device cuda on each shape

declare -A LLM5D_TOK LLM5D_MFU
if has_phase llm5d; then
    phase "llm5d: make train_gpt" make --no-print-directory -j"$JOBS" train_gpt
    if [[ ${STATUS[-1]} != PASS ]]; then
        for row in "${SHAPE_ROWS[@]}"; do
            read -r model batch _ <<<"$row"
            record "llm5d: $model B=$batch" SKIP "the build failed"
        done
    else
        # does train_gpt take --device cuda? (--plan stops before training, after the device is chosen)
        available=1
        probe=$("$TRAIN_GPT" --device cuda --plan -e d12 -b 1 -t 64 2>&1) || available=0
        if (( !available )) && ! grep -qiE "device cuda.*not implemented|not (implemented|available).*cuda" <<<"$probe"; then
            echo "$probe"
            echo "gpu_bench: train_gpt --device cuda --plan failed for another reason; trying the runs anyway"
            available=1
        fi
        if (( !available )); then
            echo
            echo "llm5d: --device cuda not available yet (train_gpt refuses it)"
            echo "  ($probe)"
            for row in "${SHAPE_ROWS[@]}"; do
                read -r model batch _ <<<"$row"
                record "llm5d: $model B=$batch" SKIP "--device cuda not available yet"
            done
        else
            for row in "${SHAPE_ROWS[@]}"; do
                read -r model batch L C NH maxT fpt <<<"$row"
                name="llm5d: $model B=$batch"
                # shellcheck disable=SC2086  # LLM5D_FLAGS is a flag list
                phase "$name" "$TRAIN_GPT" --device cuda -e "$model" -b "$batch" -t "$SEQ_LEN" -x "$LLM5D_STEPS" \
                    $LLM5D_FLAGS -v 0 -s 0 -i "$DATA"
                read -r tok mfu counted <<<"$(llm5d_figures "$LAST_LOG" "$LLM5D_SKIP" "$fpt")"
                if [[ ${STATUS[-1]} == PASS && $counted == 0 ]]; then
                    STATUS[-1]=FAIL; NOTES[-1]="no step lines after the first $LLM5D_SKIP"
                elif [[ $counted != 0 ]]; then
                    LLM5D_TOK[$model:$batch]=$tok; LLM5D_MFU[$model:$batch]=$mfu
                    NOTES[-1]="${NOTES[-1]:+${NOTES[-1]}; }median of $counted steps: $tok tok/s, MFU $mfu%"
                fi
            done
        fi
    fi
fi

# ---------------------------------------------------------------------------------------------------------
# pytorch: the reference on the same shapes

declare -A PT_TOK PT_MFU PT_MEM
if has_phase pytorch; then
    data_args=(--data "$DATA")
    if [[ ! -f $DATA ]]; then
        echo
        echo "gpu_bench: $DATA missing: PyTorch trains on random tokens (the step time does not depend on them)"
        data_args=(--synthetic)
    fi
    for row in "${SHAPE_ROWS[@]}"; do
        read -r model batch L C NH maxT fpt <<<"$row"
        name="pytorch: $model B=$batch"
        phase "$name" "$PYTHON" dev/bench/pytorch_gpt2.py --layers "$L" --channels "$C" --heads "$NH" \
            --vocab "$VOCAB" --max-seq-len "$maxT" --seq-len "$SEQ_LEN" --batch "$batch" --steps "$STEPS" \
            --warmup "$WARMUP" --peak-tflops "$PEAK_TFLOPS" "${data_args[@]}"
        log=$LAST_LOG
        summary=$(grep -E '^pytorch: tokens/s ' "$log" | tail -n 1 || true)
        if [[ $summary =~ ^pytorch:\ tokens/s\ ([0-9.]+)\ MFU\ ([0-9.]+)% ]]; then
            PT_TOK[$model:$batch]=${BASH_REMATCH[1]}; PT_MFU[$model:$batch]=${BASH_REMATCH[2]}
            NOTES[-1]="${BASH_REMATCH[1]} tok/s, MFU ${BASH_REMATCH[2]}%"
        elif [[ ${STATUS[-1]} == PASS ]]; then
            STATUS[-1]=FAIL; NOTES[-1]="no summary line"
        elif grep -qi "out of memory" "$log"; then
            NOTES[-1]="out of memory"
        fi
        mem=$(sed -n 's/^peak memory: \([0-9]*\) bytes.*/\1/p' "$log" | tail -n 1)
        [[ -n $mem ]] && PT_MEM[$model:$batch]=$(awk -v b="$mem" 'BEGIN { printf "%.2f", b / 2^30 }')
    done
fi

# ---------------------------------------------------------------------------------------------------------
# report

if has_phase llm5d || has_phase pytorch; then
    echo
    echo "== figures: T=$SEQ_LEN, MFU = tok/s x (6N + 6LCT) / $PEAK_TFLOPS TFLOP/s"
    echo "   (llm5d: medians over steps $((LLM5D_SKIP + 1))-$LLM5D_STEPS; pytorch: all tokens / all seconds of $STEPS timed steps)"
    printf '%-8s %5s %14s %8s %14s %8s %14s %10s\n' model B "llm5d tok/s" MFU% "pytorch tok/s" MFU% "pytorch GiB" "llm5d/pt"
    for row in "${SHAPE_ROWS[@]}"; do
        read -r model batch _ <<<"$row"
        k=$model:$batch
        lt=${LLM5D_TOK[$k]:--} lm=${LLM5D_MFU[$k]:--} pt=${PT_TOK[$k]:--} pm=${PT_MFU[$k]:--} mem=${PT_MEM[$k]:--}
        ratio=$(awk -v a="$lt" -v b="$pt" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "-" }')
        printf '%-8s %5s %14s %8s %14s %8s %14s %10s\n' "$model" "$batch" "$lt" "$lm" "$pt" "$pm" "$mem" "$ratio"
    done
fi

echo
echo "== summary"
passed=0 failed=0 skipped=0
for i in "${!NAMES[@]}"; do
    printf '%-4s  %-34s %s\n' "${STATUS[$i]}" "${NAMES[$i]}" "${NOTES[$i]}"
    case ${STATUS[$i]} in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
done
(( skipped == 0 )) || echo "($skipped skipped, not counted below)"
echo "$passed passed, $failed failed"
(( failed == 0 ))

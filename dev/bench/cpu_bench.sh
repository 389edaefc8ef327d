#!/usr/bin/env bash
# CPU training-step benchmark for llm5d, optionally side by side with llm.c's train_gpt2.c.
#
# Runs ./train_gpt on the CPU for a few steps on two configurations and reports, for each, the median
# ms/step and tok/s over the steps after the first (the first step allocates and warms caches):
#   d12   GPT-2 124M (L=12, C=768), B=4, T=64   (the shape llm.c's train_gpt2.c hard-codes)
#   demo  the Makefile's CPU demo model (make train): -e d4c128h4 -b 8 -t 128
# With LLMC_DIR set, it also builds llm.c's train_gpt2.c (copied to a scratch directory; nothing is written
# into LLMC_DIR) with llm.c's Makefile CPU flags, runs it on the same d12 weights and the same SOTU shards,
# and prints its median ms/step next to ours, with the ratio.
#
# Usage (from anywhere):  bash dev/bench/cpu_bench.sh        or   make bench
#                         LLMC_DIR=~/llm.c REPEATS=2 bash dev/bench/cpu_bench.sh
#
# Environment variables (all optional):
#   STEPS        training steps per run of ours, the first one not counted              [10]
#   LLMC_STEPS   training steps per run of llm.c (its step 0 not counted); llm.c's CPU step is slow, and the
#                run is stopped once this many steps have printed                         [STEPS]
#   REPEATS      runs of each measurement, interleaved (ours d12, llm.c d12, ours demo, ...); the medians
#                are taken over the steps of all runs pooled, and each run's own median is printed too   [1]
#   CONFIGS      which of ours to run: "d12 demo", "d12" or "demo"                       [d12 demo]
#   LLMC_DIR     a directory holding llm.c's train_gpt2.c (and its llmc/*.h); unset: llm.c is skipped
#   LLMC_CC      C compiler for llm.c (its Makefile uses make's default, cc)              [cc]
#   LLMC_CFLAGS  llm.c's CPU flags             [-Ofast -Wno-unused-result -Wno-ignored-pragmas
#                                               -Wno-unknown-attributes -march=native -fopenmp -DOMP]
#   LLMC_LDLIBS  llm.c's CPU libraries                                                    [-lm -lgomp]
#   OMP_NUM_THREADS   passed to both programs; unset: OpenMP uses every core
#   TRAIN_GPT    our binary                                                               [./train_gpt]
#   NO_BUILD=1   do not run make (use TRAIN_GPT as it is)
#   BENCH_TMP    scratch directory; kept if given, else a fresh one under /tmp removed at exit
#   KEEP_LOGS=1  keep the fresh scratch directory (the logs of every run) and print its path
#
# Needs: bash, awk, sort, make (unless NO_BUILD=1); for llm.c also a C compiler with OpenMP and stdbuf
# (coreutils), which makes llm.c's stdout line-buffered so its steps can be counted as they print.

set -euo pipefail

STEPS=${STEPS:-10}
LLMC_STEPS=${LLMC_STEPS:-$STEPS}
REPEATS=${REPEATS:-1}
CONFIGS=${CONFIGS:-d12 demo}
LLMC_DIR=${LLMC_DIR:-}
LLMC_CC=${LLMC_CC:-cc}
LLMC_CFLAGS=${LLMC_CFLAGS:--Ofast -Wno-unused-result -Wno-ignored-pragmas -Wno-unknown-attributes -march=native -fopenmp -DOMP}
LLMC_LDLIBS=${LLMC_LDLIBS:--lm -lgomp}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
NO_BUILD=${NO_BUILD:-0}
KEEP_LOGS=${KEEP_LOGS:-0}

# the benchmark's configurations (ours): name -> flags
D12_FLAGS=(-e d12 -b 4 -t 64)
DEMO_FLAGS=(-e d4c128h4 -b 8 -t 128)
D12_TOKENS=$((4 * 64))
DEMO_TOKENS=$((8 * 128))

die() { echo "cpu_bench: $*" >&2; exit 1; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

[[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 2 ]] || die "STEPS must be an integer >= 2 (got '$STEPS')"
[[ $LLMC_STEPS =~ ^[0-9]+$ && $LLMC_STEPS -ge 2 ]] || die "LLMC_STEPS must be an integer >= 2 (got '$LLMC_STEPS')"
[[ $REPEATS =~ ^[0-9]+$ && $REPEATS -ge 1 ]] || die "REPEATS must be an integer >= 1 (got '$REPEATS')"
for c in $CONFIGS; do [[ $c == d12 || $c == demo ]] || die "CONFIGS: unknown configuration '$c'"; done

LLMC_PID=""      # the llm.c run in flight, stopped on exit
REMOVE_SCRATCH=0
if [[ -n ${BENCH_TMP:-} ]]; then
    SCRATCH=$BENCH_TMP
    mkdir -p "$SCRATCH"
else
    SCRATCH=$(mktemp -d /tmp/llm5d_cpu_bench.XXXXXX)
    [[ $KEEP_LOGS == 1 ]] || REMOVE_SCRATCH=1
fi
cleanup() {
    if [[ -n $LLMC_PID ]]; then kill "$LLMC_PID" 2>/dev/null || true; wait "$LLMC_PID" 2>/dev/null || true; fi
    if [[ $REMOVE_SCRATCH == 1 ]]; then rm -rf "$SCRATCH"; else echo "logs in $SCRATCH"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------------------
# helpers

# median of the numbers on stdin (one a line); prints "nan" when there are none
median() {
    sort -g | awk '{ v[NR] = $1 } END {
        if (NR == 0) { print "nan"; exit }
        if (NR % 2) printf "%.1f\n", v[(NR + 1) / 2]; else printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# ms of every step after the first, from our trainer's log ("step     2/10 | ... | 812.3 ms | 315 tok/s")
our_step_ms() {
    awk '/^step +[0-9]+\/[0-9]+ \|/ { n++; for (i = 2; i <= NF; i++) if ($i == "ms") ms = $(i - 1);
         if (n > 1) print ms }' "$1"
}

# ms of every step after step 0, from llm.c's log ("step 3: train loss 9.61 (took 2412.6 ms)")
llmc_step_ms() {
    awk '/^step [0-9]+: train loss/ { n++; for (i = 1; i <= NF; i++) if ($i == "(took") ms = $(i + 1);
         if (n > 1) print ms }' "$1"
}

# how many steps llm.c has printed so far
llmc_steps() { awk '/^step [0-9]+: train loss/ { n++ } END { print n + 0 }' "$1" 2>/dev/null || echo 0; }

tok_per_s() { awk -v t="$1" -v ms="$2" 'BEGIN { if (ms == "nan" || ms <= 0) print "nan"; else printf "%.0f\n", t * 1000 / ms }'; }

# ---------------------------------------------------------------------------------------------------------
# build and data

if [[ $NO_BUILD != 1 ]]; then
    echo "== make train_gpt"
    make --no-print-directory train_gpt
fi
[[ -x $TRAIN_GPT ]] || die "$TRAIN_GPT not found or not executable"
if [[ ! -f data/sotu/train.bin || ! -f data/sotu/val.bin || ! -f data/gpt2_tokenizer.bin ]]; then
    [[ $NO_BUILD == 1 ]] && die "SOTU data missing (data/sotu/*.bin, data/gpt2_tokenizer.bin): run make data"
    echo "== make data"
    make --no-print-directory data
fi

# ---------------------------------------------------------------------------------------------------------
# machine

cpu_model=$(lscpu 2>/dev/null | awk -F: '/^Model name/ { sub(/^[ \t]+/, "", $2); print $2; exit }')
[[ -n $cpu_model ]] || cpu_model=$(awk -F: '/^model name/ { sub(/^[ \t]+/, "", $2); print $2; exit }' /proc/cpuinfo)
echo "== machine"
echo "date:      $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "cpu:       ${cpu_model:-unknown}"
echo "cores:     $(nproc) usable of $(nproc --all) online; OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"
echo "load:      $(cut -d' ' -f1-3 /proc/loadavg) (1, 5, 15 min; anything above 0 is other work competing)"
echo "llm5d:     $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"

# ---------------------------------------------------------------------------------------------------------
# llm.c setup (when asked)

LLMC_BIN=""
D12_MODEL=""
if [[ -n $LLMC_DIR && " $CONFIGS " != *" d12 "* ]]; then
    echo "cpu_bench: LLMC_DIR is set but CONFIGS has no d12; llm.c is skipped" >&2
    LLMC_DIR=""
fi
if [[ -n $LLMC_DIR ]]; then
    [[ -f $LLMC_DIR/train_gpt2.c ]] || die "LLMC_DIR=$LLMC_DIR has no train_gpt2.c"
    command -v stdbuf >/dev/null || die "stdbuf (coreutils) is needed to run llm.c"
    LLMC_RUN=$SCRATCH/llmc
    mkdir -p "$LLMC_RUN"
    cp "$LLMC_DIR/train_gpt2.c" "$LLMC_RUN/"
    if [[ -d $LLMC_DIR/llmc ]]; then
        mkdir -p "$LLMC_RUN/llmc"
        cp "$LLMC_DIR"/llmc/*.h "$LLMC_RUN/llmc/" 2>/dev/null || true
    fi
    llmc_rev=$(git -C "$LLMC_DIR" rev-parse HEAD 2>/dev/null || true)
    echo "llm.c:     ${llmc_rev:-not a git checkout} (train_gpt2.c sha256 $(sha256sum "$LLMC_DIR/train_gpt2.c" | cut -c1-16))"
    echo "== build llm.c: $LLMC_CC $LLMC_CFLAGS train_gpt2.c $LLMC_LDLIBS -o train_gpt2"
    # shellcheck disable=SC2086  # the flag lists are meant to split
    (cd "$LLMC_RUN" && $LLMC_CC $LLMC_CFLAGS train_gpt2.c $LLMC_LDLIBS -o train_gpt2) ||
        die "building llm.c failed"
    LLMC_BIN=$LLMC_RUN/train_gpt2

    # llm.c reads fixed paths relative to its working directory: the model, the tokenizer, and the
    # tiny-shakespeare shards (whichever paths this version names). They become links to our files.
    echo "== d12 model file for llm.c (one step of ours, checkpointed in llm.c's fp32 format)"
    rm -rf "$SCRATCH/init"  # the trainer will not mix two runs in one output directory
    "$TRAIN_GPT" "${D12_FLAGS[@]}" -x 1 -n 1 -v 0 -s 0 -o "$SCRATCH/init" >"$SCRATCH/init.log" 2>&1 ||
        { cat "$SCRATCH/init.log" >&2; die "writing the d12 model file failed"; }
    D12_MODEL=$(find "$SCRATCH/init" -name model.bin | sort | tail -n 1)
    [[ -n $D12_MODEL ]] || die "no model.bin under $SCRATCH/init"
    find "$SCRATCH/init" -name 'optimizer*.bin' -delete  # 1 GB we do not need
    ln -sf "$D12_MODEL" "$LLMC_RUN/gpt2_124M.bin"
    ln -sf "$ROOT/data/gpt2_tokenizer.bin" "$LLMC_RUN/gpt2_tokenizer.bin"
    train_names=$(grep -o '"[^"]*tiny_shakespeare_train\.bin"' "$LLMC_RUN/train_gpt2.c" | tr -d '"' || true)
    val_names=$(grep -o '"[^"]*tiny_shakespeare_val\.bin"' "$LLMC_RUN/train_gpt2.c" | tr -d '"' || true)
    for p in ${train_names:-dev/data/tinyshakespeare/tiny_shakespeare_train.bin}; do
        mkdir -p "$LLMC_RUN/$(dirname "$p")"; ln -sf "$ROOT/data/sotu/train.bin" "$LLMC_RUN/$p"
    done
    for p in ${val_names:-dev/data/tinyshakespeare/tiny_shakespeare_val.bin}; do
        mkdir -p "$LLMC_RUN/$(dirname "$p")"; ln -sf "$ROOT/data/sotu/val.bin" "$LLMC_RUN/$p"
    done
fi

# ---------------------------------------------------------------------------------------------------------
# runs

# run_ours NAME REPEAT FLAGS...: one run of our trainer, its log at $SCRATCH/ours_NAME_REPEAT.log
run_ours() {
    local name=$1 rep=$2; shift 2
    local log=$SCRATCH/ours_${name}_$rep.log
    echo "-- ours $name (run $rep): $TRAIN_GPT $* -x $STEPS -v 0 -s 0"
    "$TRAIN_GPT" "$@" -x "$STEPS" -v 0 -s 0 >"$log" 2>&1 || { cat "$log" >&2; die "our $name run failed"; }
    echo "   median $(our_step_ms "$log" | median) ms/step over $(our_step_ms "$log" | wc -l) steps"
}

# run_llmc REPEAT: one run of llm.c, stopped after LLMC_STEPS steps; its log at $SCRATCH/llmc_REPEAT.log
run_llmc() {
    local rep=$1
    local log=$SCRATCH/llmc_$rep.log
    echo "-- llm.c d12 (run $rep): train_gpt2 (B=4 T=64 hard-coded), stopped after $LLMC_STEPS steps"
    : >"$log"
    (cd "$LLMC_RUN" && exec stdbuf -oL -eL ./train_gpt2) >"$log" 2>&1 &
    LLMC_PID=$!
    while kill -0 "$LLMC_PID" 2>/dev/null; do
        if (( $(llmc_steps "$log") >= LLMC_STEPS )); then
            kill "$LLMC_PID" 2>/dev/null || true
            break
        fi
        sleep 0.5
    done
    wait "$LLMC_PID" 2>/dev/null || true
    LLMC_PID=""
    local n
    n=$(llmc_steps "$log")
    (( n >= 2 )) || { cat "$log" >&2; die "llm.c printed $n steps; see the log above"; }
    echo "   median $(llmc_step_ms "$log" | median) ms/step over $(llmc_step_ms "$log" | wc -l) steps"
}

echo "== runs: $STEPS steps each (llm.c: $LLMC_STEPS), $REPEATS repeat(s), the first step of every run not counted"
for ((r = 1; r <= REPEATS; r++)); do
    for c in $CONFIGS; do
        if [[ $c == d12 ]]; then
            if [[ -n $D12_MODEL ]]; then
                # the same weights llm.c gets (timing does not depend on them, but it keeps the runs alike)
                run_ours d12 "$r" -e "$D12_MODEL" -b 4 -t 64
                run_llmc "$r"
            else
                run_ours d12 "$r" "${D12_FLAGS[@]}"
            fi
        else
            run_ours demo "$r" "${DEMO_FLAGS[@]}"
        fi
    done
done

# ---------------------------------------------------------------------------------------------------------
# report

pooled_ours() { for ((r = 1; r <= REPEATS; r++)); do our_step_ms "$SCRATCH/ours_$1_$r.log"; done; }
pooled_llmc() { for ((r = 1; r <= REPEATS; r++)); do llmc_step_ms "$SCRATCH/llmc_$r.log"; done; }

echo
echo "== results (median over the steps after the first of every run; tok/s = tokens per step / median)"
printf '%-34s %12s %10s %8s\n' "run" "ms/step" "tok/s" "steps"
d12_ms=""
for c in $CONFIGS; do
    if [[ $c == d12 ]]; then
        d12_ms=$(pooled_ours d12 | median)
        printf '%-34s %12s %10s %8s\n' "llm5d  d12 B=4 T=64" "$d12_ms" "$(tok_per_s $D12_TOKENS "$d12_ms")" \
            "$(pooled_ours d12 | wc -l)"
        if [[ -n $LLMC_BIN ]]; then
            llmc_ms=$(pooled_llmc | median)
            printf '%-34s %12s %10s %8s\n' "llm.c  train_gpt2.c d12 B=4 T=64" "$llmc_ms" \
                "$(tok_per_s $D12_TOKENS "$llmc_ms")" "$(pooled_llmc | wc -l)"
        fi
    else
        demo_ms=$(pooled_ours demo | median)
        printf '%-34s %12s %10s %8s\n' "llm5d  d4c128h4 B=8 T=128" "$demo_ms" "$(tok_per_s $DEMO_TOKENS "$demo_ms")" \
            "$(pooled_ours demo | wc -l)"
    fi
done
if [[ -n $LLMC_BIN && -n $d12_ms ]]; then
    awk -v a="$llmc_ms" -v b="$d12_ms" 'BEGIN { if (a > 0 && b > 0)
        printf "ratio  llm.c / llm5d ms per d12 step: %.2fx (above 1: llm5d is faster)\n", a / b }'
fi

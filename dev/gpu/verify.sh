#!/usr/bin/env bash
# The GPU verification: one command on a host with an NVIDIA GPU that builds llm5d for the GPU it finds, checks
# every rung of the verification ladder on it (kernels, the model against the CPU path and against PyTorch, bit
# determinism, the parallel layouts, the memory plan) and runs the benchmark. Each phase fits in TIMEOUT
# seconds, so a host that grants 10-minute calls runs one or a few phases per call (PHASES=...), and a BUDGET
# stops the whole run cleanly before it is spent, the phases in priority order.
#
#   bash dev/gpu/verify.sh LOGDIR                          # every phase
#   PHASES="build model pytorch" bash dev/gpu/verify.sh LOGDIR
#   BUDGET=300 PHASES=quick PREBUILT=1 bash dev/gpu/verify.sh LOGDIR   # every GPU code path, ~3 min on an H100
#   PHASES="pytorch determinism mpi" DEVICE=cpu bash dev/gpu/verify.sh LOGDIR   # the plumbing, on the CPU
#   QUICK=1 PHASES=fp8 PREBUILT=1 FP8_BLOCK_SPEED=llama3-1b:16:1024 bash dev/gpu/verify.sh LOGDIR   # FP8's recipes
#
# Every check prints one line "PASS|FAIL|SKIP <phase>: <check> <figure>"; the end is a table of the figures
# and, last, "N passed, M failed, K skipped". Every command's output goes to LOGDIR/<phase>.log. Exit status 0
# when nothing failed. Without a GPU every GPU phase says SKIP (and the exit status is 0).
#
# Variables (defaults in brackets):
#   PHASES      any of build tests model llama fp8 cp pp moe profile mpi kernels pytorch determinism resume nccl
#               plan bench; they run in that order (priority: the correctness checks first, the figures last, so that
#               a BUDGET running out costs the least), or `quick`: the named set below              [all]
#   BUDGET      seconds for the whole run, 0 for none: a phase starts only when its estimate (the table of
#               estimates below) fits in the time left, less 15 s for the summary, and runs under that time
#               at most; a phase that does not fit is "SKIP <phase>: ... (budget: ...)", and so is a check
#               stopped by the budget's end                                                                  [0]
#   quick       PHASES=quick: build tests model fp8 mpi cp pp moe profile resume nccl with small runs, which reach every
#               GPU code path (each kernel family through the [cuda] tests, GPT-2 and Llama, FP8, the mma and
#               wgmma attention, dp and ZeRO, tp, cp, pp, ep, NCCL on one rank, resume across devices):
#               CHECK_MODEL d6c384h6 at B=4 T=256 for 6 steps, ZeRO-1 and 3, the zb, dualpipev and interleaved pp
#               schedules, ep 2 with ZeRO-1 and under pp, one FP8 run of 20 steps with tensorwise and one with
#               blockwise, and no FP8 timings; the [cuda] tests run once (the tests and model phases)
#   QUICK       1: quick's small runs for the phases PHASES names (PHASES=quick sets it)                  [0]
#   DEVICE      cuda, or cpu for the phases that have a CPU form (build: train_gpt only; pytorch,
#               determinism, mpi; llama: its PyTorch comparison; fp8: its runs on small models, against fp32):
#               a test of this script's plumbing on a machine without a GPU                            [cuda]
#   TIMEOUT     seconds each phase may run (the bench phase: each of its own phases), BUDGET permitting [600]
#   ENV_SCRIPT  sourced first (MPI, Catch2, NCCL paths)                    [.devdeps/env.sh when present]
#   PREBUILT    1: binaries built elsewhere and newer than their sources are used as they are          [0]
#   CUDA_ARCH   nvcc's -gencode flags           [the Makefile's (nvcc.mk): the GPU's compute capability, sm_XY,
#               'a' from 9.0]
#   JOBS        parallel make jobs                                                                   [nproc]
#   PYTHON      an interpreter with torch                        [python3, else /usr/bin/python3 if it has torch]
#   DATA, VAL   token shards for every run                          [data/sotu/train.bin, data/sotu/val.bin]
#   CHECK_MODEL, CHECK_B, CHECK_T, CHECK_STEPS   the runs of determinism, mpi, cp, pp, moe, resume and nccl
#                                              [cuda: d12, 4, 1024, 20; cpu: d4c128h2, 2, 64, 10]
#   MOE_MODEL   the moe phase's model, with experts                 [d6c384h6e8k2 on cuda, d4c128h2e4k2 on cpu]
#   MOE_MIXED_MODEL   ... and its Qwen3 with dense layers (layers 0 and 2) among the sparse ones, experts of
#               their own width, and DeepSeek-V3's routing: an always-on shared expert, sigmoid scores, gates scaled by
#               2.5, a selection bias   [q4c384h6g2d64f1024e8k2x256n1s2y256ir2.5a on cuda,
#               q4c128h2g1d64f344e4k2x96n1s2y96ir2.5a on cpu]
#   MOE_SHARED_MODEL  ... and a Qwen2-MoE-shaped Llama: q, k and v biases, layer 0 dense, gates not renormalized, a
#               gated shared expert   [l4c384h6g2f1024be8k2x256un1z512 on cuda, l4c128h2g1f344be4k2x96un1z128 on cpu]
#   LLAMA_MODEL the Llama the mpi, cp and pp phases also run (grouped-query: 4 heads over 2 key/value heads);
#               the mpi phase also runs it with one key/value head, which tp 2 holds on both ranks
#                                                      [l4c256h4g2f688 on cuda, l4c128h4g2f344 on cpu]
#   PT_SHAPE, PT_B, PT_T, PT_STEPS, PT_LR, PT_TOL   the pytorch phase: model L:C:NH (test/reference's
#               initialization), batch, steps, constant lr, largest |loss difference|
#                                              [cuda: 12:768:12, 4, 1024, 10, 3e-4, 0.05; cpu: 2:128:2, 4, 64, 1e-4]
#   LLAMA_SHAPE the llama phase's Llama 3 file against PyTorch: L:C:NH:KV:H (KV key/value heads, H the MLP's
#               hidden size; RoPE θ 500000 with Llama 3.1's scaling; the other PT_ values as the pytorch
#               phase's)                                       [cuda: 4:256:4:2:688; cpu: 2:128:4:2:344]
#   FP8_RUNS    model:B:T runs of 200 steps with and without --fp8 1, whose losses must agree within FP8_TOL
#               (empty: none)
#               [d12:16:1024 l16c2048h32g8f8192t1024:4:1024 q8c1024h16g4d64f3072e8k2x768n1s2y768ir2.5a:8:1024: the
#               last a Qwen3 of dense and sparse layers, a shared expert and DeepSeek-V3's routing, both kinds FP8]
#   FP8_BLOCK_RUNS  model:B:T runs of FP8_STEPS steps with --fp8 1 --fp8-recipe blockwise against the run without
#               FP8 (FP8_RUNS's where it has the same model:B:T), held as FP8_RUNS's are; SKIP off compute
#               capability 9.0                 [d12:16:1024, its layers' matmuls whole 128x128 blocks; quick d12:4:1024]
#   FP8_STEPS   steps of each FP8_RUNS and FP8_BLOCK_RUNS run                              [200; quick 20]
#   FP8_TOL     largest relative difference of a --fp8 1 run's loss from the bf16 run's, each step's loss
#               averaged over FP8_WINDOW steps, after the warm-up (the runs' -u 20)                     [0.02]
#   FP8_WINDOW  the steps each compared loss averages over (1: every step alone). From random weights a
#               1B-size Llama's bf16 run is itself chaotic through its warm-up (loss 10.0 → 13.7 at step 3,
#               gradient norm 90, on an H100): two runs whose arithmetic differs part and meet again, so single
#               steps of the two curves are up to 20% apart later too while their 20-step means agree within
#               1.3% (dev/bench/RESULTS.md)                                                     [20; quick 1]
#   FP8_SPEED   model:B:T runs timed with and without --fp8 1 (30 steps, the median of steps 11 to 30); each
#               --fp8 1 run must say FP8 is on and the bf16 run must not, and a model of 1e9 parameters or more at
#               16384 tokens a step or more must be FP8_MIN_SPEEDUP times faster with it
#               [d12:16:1024 d12:4:4096 d48:4:1024 d48:1:4096 llama3-1b:16:1024 llama3-1b:1:4096]
#   FP8_MIN_SPEEDUP  the bf16 step over the fp8 step such a run must reach (measured on an H100: llama3-1b B=16
#               T=1024 1.12x and 1.13x, llama3-3b B=8 1.17x and 1.18x; d12 and qwen3-0.6b are slower with FP8,
#               so no bound below 1e9 parameters or 16384 tokens, where nothing was measured)            [1.05]
#   FP8_BLOCK_SPEED  model:B:T runs timed as FP8_SPEED's with --fp8 1 --fp8-recipe blockwise, beside the bf16 and
#               tensorwise runs of the same model:B:T (FP8_SPEED's where it has them): figures, unbounded (no
#               blockwise step was measured before); the runs must exit 0 with a median step and blockwise be on
#                                                                          [llama3-1b:16:1024; quick none]
#   MPI_TOL     largest relative difference of a 2-rank layout's loss, and of its gradient norm, from the
#               single-rank run's at any step (the mpi, cp, pp and moe phases and the resume phase's dp 2 then
#               1 rank). cuda: bf16 sums in another order; the layouts followed one rank within 1.4e-5 (dp),
#               1.0e-4 (tp), 8.6e-5 (cp), 1.0e-4 (pp), 2.2e-4 (moe under pp) and 1.6e-4 (tp over one key/value
#               head) on an H100 (dev/bench/RESULTS.md), so 1e-3 leaves 4x over the worst and still catches a
#               layout that drifts (2e-2 was 100-1000x the error). cpu: fp32, the equivalence principle's 1e-5.
#               Either way a value may also differ by its last printed digit (1e-6, absolute). Those figures
#               are losses: no GPU run has compared the norms yet (in PyTorch on the cpu, bf16 autocast moved
#               a 4-layer, 128-channel GPT-2's first norm by 1.9e-3, its loss by 1.4e-5), so a GPU run that
#               fails on a norm alone gives the figure to set this by                  [cuda 1e-3; cpu 1e-5]
#   RESUME_TOL  the same for the resume phase's checkpoints across devices (d4c128h2 on the cpu, then on the
#               GPU, and the other way round, against the cpu alone: fp32 against bf16). Relative, near the
#               error measured, not PT_TOL's 0.05 (an absolute bound for the pytorch phase): on an H100 d12's
#               losses under PyTorch and under llm5d's bf16 differed by 2.4e-3, the crossings' by 4.7e-5 and
#               9.1e-6. Each crossing's untrained continuation (-l 0 from the same checkpoint) must fail it:
#               on the cpu it differs by 1.5e-2 (loss) and 4.8e-2 (norm)               [cuda 5e-3; cpu 1e-5]
#   NCCL_TOL    the same for one rank over NCCL (the same arithmetic as without it: 0 is exact, print
#               rounding included)                                                                       [0]
#   PLAN_RUNS   model:B:recompute triples whose --plan total is compared with the measured memory
#                                                                       [d12:16:0 d12:16:2 d48:4:1 d12e8k2:8:1]
#   PLAN_TOL    largest relative difference of the plan from the measured memory                      [0.05]
#   STEP_TOL    largest relative difference of --plan's predicted step (dev/hardware/h100.txt) from the
#               measured median step of the same run, and of d12's predicted step on the --calibrate profile
#               from the same prediction on dev/hardware/h100.txt (a100.txt on an A100)                  [0.25]
#   BENCH_PHASES  the phases of dev/bench/gpu_bench.sh the bench phase runs     [llm5d llmc pytorch profile]
#   TRAIN_GPT   the train_gpt every run uses                                  [./train_gpt, the build phase's]
#   WORK        scratch for model files, checkpoints and run directories       [LOGDIR/work, removed at the
#               end unless KEEP_WORK=1; it holds model files of GPT-2 size]

set -uo pipefail

usage() { sed -n 2,13p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -eq 1 && $1 != -* ]] || usage
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$1" || exit 2
LOGDIR=$(cd "$1" && pwd)
cd "$ROOT" || exit 2

ALL_PHASES="build tests model llama fp8 cp pp moe profile mpi kernels pytorch determinism resume nccl plan bench"
PHASES=${PHASES:-$ALL_PHASES}
QUICK=${QUICK:-0}
[[ $QUICK == [01] ]] || { echo "verify: QUICK must be 0 or 1 (got '$QUICK')" >&2; exit 2; }
if [[ $PHASES == quick ]]; then
    QUICK=1
    PHASES="build tests model fp8 mpi cp pp moe profile resume nccl"
fi
BUDGET=${BUDGET:-0}
DEVICE=${DEVICE:-cuda}
TIMEOUT=${TIMEOUT:-600}
PREBUILT=${PREBUILT:-0}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
DATA=${DATA:-data/sotu/train.bin}
VAL=${VAL:-data/sotu/val.bin}
PLAN_RUNS=${PLAN_RUNS:-d12:16:0 d12:16:2 d48:4:1 d12e8k2:8:1}
PLAN_TOL=${PLAN_TOL:-0.05}
FP8_TOL=${FP8_TOL:-0.02}
FP8_WARMUP=20  # the FP8 runs' learning-rate warm-up (-u)
if [[ $DEVICE == cpu ]]; then
    # the fp8 phase's CPU form, its plumbing: models the CPU steps through in a second, 20 steps, each compared
    # alone; the Llama's matmuls are whole 128-tiles (C 128, q k v 256, the MLP's 512 and 256), so blockwise runs
    FP8_RUNS=${FP8_RUNS-d4c128h2:2:64} FP8_BLOCK_RUNS=${FP8_BLOCK_RUNS-l4c128h4g2f256:2:64}
    FP8_SPEED=${FP8_SPEED-} FP8_BLOCK_SPEED=${FP8_BLOCK_SPEED-l4c128h4g2f256:2:64}
    FP8_STEPS=${FP8_STEPS:-20} FP8_WINDOW=${FP8_WINDOW:-1}
fi
if (( QUICK )); then
    FP8_RUNS=${FP8_RUNS-d12:4:1024} FP8_STEPS=${FP8_STEPS:-20} FP8_SPEED=${FP8_SPEED-} FP8_WINDOW=${FP8_WINDOW:-1}
    FP8_BLOCK_RUNS=${FP8_BLOCK_RUNS-d12:4:1024} FP8_BLOCK_SPEED=${FP8_BLOCK_SPEED-}
    FP8_SKIP=0  # quick's 20 steps are its warm-up: each compared alone
    ZERO_STAGES="1 3" PP_SCHEDULES="zb dualpipev"
else
    FP8_RUNS=${FP8_RUNS-d12:16:1024 l16c2048h32g8f8192t1024:4:1024 q8c1024h16g4d64f3072e8k2x768n1s2y768ir2.5a:8:1024}
    FP8_STEPS=${FP8_STEPS:-200} FP8_WINDOW=${FP8_WINDOW:-20}
    FP8_SKIP=$FP8_WARMUP  # the steps left out of the comparison
    [[ $DEVICE == cpu ]] && FP8_SKIP=0
    FP8_SPEED=${FP8_SPEED-d12:16:1024 d12:4:4096 d48:4:1024 d48:1:4096 llama3-1b:16:1024 llama3-1b:1:4096}
    FP8_BLOCK_RUNS=${FP8_BLOCK_RUNS-d12:16:1024} FP8_BLOCK_SPEED=${FP8_BLOCK_SPEED-llama3-1b:16:1024}
    ZERO_STAGES="0 1 2 3" PP_SCHEDULES="afab 1f1b zb dualpipev"
fi
STEP_TOL=${STEP_TOL:-0.25}
FP8_MIN_SPEEDUP=${FP8_MIN_SPEEDUP:-1.05}
NCCL_TOL=${NCCL_TOL:-0}
BENCH_PHASES=${BENCH_PHASES:-llm5d llmc pytorch profile}
WORK=${WORK:-$LOGDIR/work}
KEEP_WORK=${KEEP_WORK:-0}
if [[ $DEVICE == cuda ]] && (( QUICK )); then
    # d12's code paths at half its layers and width and a quarter of its length: each step a few ms on one rank,
    # the two-ranks layouts' host-staged traffic a fourth to a sixteenth of d12's; 6 steps against one rank
    CHECK_MODEL=${CHECK_MODEL:-d6c384h6} CHECK_B=${CHECK_B:-4} CHECK_T=${CHECK_T:-256} CHECK_STEPS=${CHECK_STEPS:-6}
fi
if [[ $DEVICE == cpu ]] && (( QUICK )); then
    CHECK_STEPS=${CHECK_STEPS:-4}
fi
if [[ $DEVICE == cuda ]]; then
    CHECK_MODEL=${CHECK_MODEL:-d12} CHECK_B=${CHECK_B:-4} CHECK_T=${CHECK_T:-1024} CHECK_STEPS=${CHECK_STEPS:-20}
    PT_SHAPE=${PT_SHAPE:-12:768:12} PT_B=${PT_B:-4} PT_T=${PT_T:-1024} PT_TOL=${PT_TOL:-0.05}
    MPI_TOL=${MPI_TOL:-1e-3}
    RESUME_TOL=${RESUME_TOL:-5e-3}
    MOE_MODEL=${MOE_MODEL:-d6c384h6e8k2}
    MOE_MIXED_MODEL=${MOE_MIXED_MODEL:-q4c384h6g2d64f1024e8k2x256n1s2y256ir2.5a}
    MOE_SHARED_MODEL=${MOE_SHARED_MODEL:-l4c384h6g2f1024be8k2x256un1z512}
    LLAMA_MODEL=${LLAMA_MODEL:-l4c256h4g2f688}
    LLAMA_SHAPE=${LLAMA_SHAPE:-4:256:4:2:688}
elif [[ $DEVICE == cpu ]]; then
    CHECK_MODEL=${CHECK_MODEL:-d4c128h2} CHECK_B=${CHECK_B:-2} CHECK_T=${CHECK_T:-64} CHECK_STEPS=${CHECK_STEPS:-10}
    PT_SHAPE=${PT_SHAPE:-2:128:2} PT_B=${PT_B:-4} PT_T=${PT_T:-64} PT_TOL=${PT_TOL:-1e-4}
    MPI_TOL=${MPI_TOL:-1e-5}
    RESUME_TOL=${RESUME_TOL:-1e-5}
    MOE_MODEL=${MOE_MODEL:-d4c128h2e4k2}
    MOE_MIXED_MODEL=${MOE_MIXED_MODEL:-q4c128h2g1d64f344e4k2x96n1s2y96ir2.5a}
    MOE_SHARED_MODEL=${MOE_SHARED_MODEL:-l4c128h2g1f344be4k2x96un1z128}
    LLAMA_MODEL=${LLAMA_MODEL:-l4c128h4g2f344}
    LLAMA_SHAPE=${LLAMA_SHAPE:-2:128:4:2:344}
else
    echo "verify: DEVICE must be cuda or cpu (got '$DEVICE')" >&2; exit 2
fi
PT_STEPS=${PT_STEPS:-10} PT_LR=${PT_LR:-3e-4}
LLAMA_MQA=${LLAMA_MODEL/g2/g1}

for p in $PHASES; do
    [[ " $ALL_PHASES " == *" $p "* ]] || { echo "verify: PHASES: unknown phase '$p' (known: $ALL_PHASES)" >&2; exit 2; }
done
for n in TIMEOUT JOBS FP8_STEPS CHECK_B CHECK_T CHECK_STEPS PT_B PT_T PT_STEPS; do
    [[ ${!n} =~ ^[0-9]+$ && ${!n} -ge 1 ]] || { echo "verify: $n must be a positive integer (got '${!n}')" >&2; exit 2; }
done
[[ $BUDGET =~ ^[0-9]+$ ]] ||
    { echo "verify: BUDGET must be a number of seconds, 0 for none (got '$BUDGET')" >&2; exit 2; }
[[ $PT_SHAPE =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]] || { echo "verify: PT_SHAPE must be L:C:NH (got '$PT_SHAPE')" >&2; exit 2; }
[[ $LLAMA_SHAPE =~ ^([0-9]+):([0-9]+):([0-9]+):([0-9]+):([0-9]+)$ ]] ||
    { echo "verify: LLAMA_SHAPE must be L:C:NH:KV:H (got '$LLAMA_SHAPE')" >&2; exit 2; }

if [[ -n ${ENV_SCRIPT:-} ]]; then
    [[ -f $ENV_SCRIPT ]] || { echo "verify: ENV_SCRIPT=$ENV_SCRIPT: no such file" >&2; exit 2; }
    # shellcheck disable=SC1090
    source "$ENV_SCRIPT"
elif [[ -f .devdeps/env.sh ]]; then
    ENV_SCRIPT=.devdeps/env.sh
    # shellcheck disable=SC1091
    source .devdeps/env.sh
fi
# mpirun as root, ranks on one host over shared memory (what a container or a bare GPU host allows)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader} OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}

if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    if ! python3 -c 'import torch' >/dev/null 2>&1 && /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then
        PYTHON=/usr/bin/python3
    fi
fi
# the Catch2 tests start their reference scripts with $PYTHON (test/test_helpers.h)
export PYTHON

# ---------------------------------------------------------------------------------------------------------
# the GPU

GPU_NAME="" GPU_MIB="" GPU_CC=""
if command -v nvidia-smi >/dev/null 2>&1 &&
    gpu_line=$(nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits 2>/dev/null) &&
    [[ -n $gpu_line ]]; then
    IFS=, read -r GPU_NAME GPU_MIB GPU_CC <<<"$(head -n 1 <<<"$gpu_line")"
    GPU_NAME=$(xargs <<<"$GPU_NAME") GPU_MIB=$(xargs <<<"$GPU_MIB") GPU_CC=$(xargs <<<"$GPU_CC")
fi
HAVE_GPU=0
[[ -n $GPU_NAME ]] && HAVE_GPU=1

mkdir -p "$WORK"
cleanup() { [[ $KEEP_WORK == 1 ]] || rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== verify: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "gpu:      ${GPU_NAME:-none}${GPU_NAME:+, $GPU_MIB MiB, compute capability $GPU_CC}"
echo "device:   $DEVICE; phases: $PHASES$( ((QUICK)) && echo ' (quick)'); $TIMEOUT s per phase"
echo "budget:   $( ((BUDGET)) && echo "$BUDGET s for the whole run" || echo none)"
echo "build:    CUDA_ARCH=${CUDA_ARCH:-for the GPU found (nvcc.mk)}; PREBUILT=$PREBUILT; env ${ENV_SCRIPT:-none}"
echo "llm5d:    $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
echo "python:   $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'no torch'))"
echo "logs:     $LOGDIR/<phase>.log"

# ---------------------------------------------------------------------------------------------------------
# bookkeeping: one line per check, and the figures for the table at the end

RESULTS=()        # "STATUS<TAB>phase<TAB>check<TAB>figure"
PASSED=0 FAILED=0 SKIPPED=0
result() {
    local status=$1 phase=$2 check=$3 figure=${4:-}
    # a check stopped by the BUDGET's end (its phase's limit the time left, not TIMEOUT) was skipped, not failed
    if [[ $status == FAIL && $figure == "(timed out:"* ]] && (( PHASE_BUDGETED )); then
        status=SKIP figure="(budget: stopped when the time left ran out)"
        [[ " ${BUDGET_SKIPPED[*]} " == *" $phase (cut short) "* ]] || BUDGET_SKIPPED+=("$phase (cut short)")
    fi
    echo "$status $phase: $check${figure:+ $figure}"
    RESULTS+=("$status"$'\t'"$phase"$'\t'"$check"$'\t'"$figure")
    case $status in PASS) PASSED=$((PASSED + 1)) ;; FAIL) FAILED=$((FAILED + 1)) ;; *) SKIPPED=$((SKIPPED + 1)) ;; esac
}

has_phase() { [[ " $PHASES " == *" $1 "* ]]; }

PHASE="" PHASE_LOG="" PHASE_END=0 PHASE_LIMIT=$TIMEOUT PHASE_BUDGETED=0 RUN_START=1
BUDGET_SKIPPED=()  # phases skipped, or cut short, for the BUDGET
# start_phase NAME LIMIT: the phase's log begins, and its runs share LIMIT seconds
start_phase() {
    PHASE=$1 PHASE_LOG=$LOGDIR/$1.log PHASE_LIMIT=$2 PHASE_END=$((SECONDS + $2))
    : >"$PHASE_LOG"
    echo
    echo "== $PHASE ($2 s at most)"
}

# run CMD...: runs CMD in the phase's remaining time, its output appended to the phase log; returns its status
# (124: out of time)
run() {
    local left=$((PHASE_END - SECONDS))
    echo "\$ $*" >>"$PHASE_LOG"
    RUN_START=$(($(wc -l <"$PHASE_LOG") + 1))
    if (( left <= 0 )); then echo "verify: no time left in the phase" >>"$PHASE_LOG"; return 124; fi
    timeout -k 10 "$left" "$@" >>"$PHASE_LOG" 2>&1
    local rc=$?
    (( rc == 124 )) && echo "verify: stopped after the phase's $PHASE_LIMIT s" >>"$PHASE_LOG"
    echo "(exit status $rc)" >>"$PHASE_LOG"
    return "$rc"
}

# the output of the last run
run_output() { tail -n +"$RUN_START" "$PHASE_LOG" | grep -v '^(exit status [0-9]*)$'; }

# why the last run failed, in one line: its time limit, the program's own error line, or the exit status
why() {
    local rc=$1
    if [[ $rc == 124 ]]; then echo "(timed out: the phase's $PHASE_LIMIT s)"; return; fi
    if [[ $rc == 127 ]]; then echo "(not found: $(run_output | grep -m 1 -i 'no such file\|not found'))"; return; fi
    local line
    line=$(run_output | grep -E '^(train_gpt|pytorch_check|Traceback|[A-Za-z]*Error)' | tail -n 1)
    [[ $rc =~ ^[0-9]+$ ]] && rc="exit status $rc"
    echo "($rc${line:+: \"$line\"})"
}

# the training losses "STEP LOSS" of a main.log
losses() { sed -n 's/^s:\([0-9]*\) trl:\([^ ]*\).*/\1 \2/p' "$1" 2>/dev/null; }
# its training lines "STEP LOSS NORM" (NORM "none" when the line has no norm:)
trl_lines() {
    awk '$1 ~ /^s:[0-9]+$/ && $2 ~ /^trl:/ {
             norm = "none"
             for (i = 3; i <= NF; i++) if ($i ~ /^norm:/) norm = substr($i, 6)
             print substr($1, 3), substr($2, 5), norm
         }' "$1" 2>/dev/null
}

# compare_losses REF OTHER [SLACK]: OTHER's training lines against REF's, step by step, the loss and the gradient
# norm alike: "WORST N LOSS NORM WHICH", LOSS and NORM the largest relative difference of each, WORST the larger
# of the two (WHICH: loss or norm) and N the steps compared. A figure is "inf" when a step of REF is missing from
# OTHER or a value is not a number (norm:nan, -nan, inf). main.log prints both with 6 decimals, so a difference
# of SLACK (1e-6, one unit of the last digit: print rounding, not arithmetic) is taken off before dividing
compare_losses() {
    awk -v slack="${3:-1e-6}" '
         function number(x) { return x ~ /^-?[0-9]+(\.[0-9]+)?$/ }
         function rel(got, ref,   d, r) {
             # in units of the last printed digit, whole (the subtraction of two printed numbers is not)
             d = (got - ref) * 1e6; if (d < 0) d = -d
             d = int(d + 0.5) - slack * 1e6; if (d < 0) d = 0
             d /= 1e6
             r = ref < 0 ? -ref : ref
             return r > 0 ? d / r : d
         }
         NR == FNR { rl[$1] = $2; rn[$1] = $3; next }
         { gl[$1] = $2; gn[$1] = $3 }
         END {
             n = 0; wl = 0; wn = 0
             for (s in rl) {
                 n++
                 if (!(s in gl)) { wl = "inf"; wn = "inf"; continue }
                 if (wl != "inf") { if (number(gl[s]) && number(rl[s])) { d = rel(gl[s], rl[s]); if (d > wl) wl = d } else wl = "inf" }
                 if (wn != "inf") { if (number(gn[s]) && number(rn[s])) { d = rel(gn[s], rn[s]); if (d > wn) wn = d } else wn = "inf" }
             }
             if (n == 0) { wl = "inf"; wn = "inf" }
             which = wn == "inf" || (wl != "inf" && wn > wl) ? "norm" : "loss"
             if (wl == "inf") which = "loss"
             worst = which == "norm" ? wn : wl
             printf "%s %d %s %s %s\n", fmt(worst), n, fmt(wl), fmt(wn), which
         }
         function fmt(x) { return x == "inf" ? "inf" : sprintf("%.3e", x) }' <(trl_lines "$1") <(trl_lines "$2")
}
# compare_windows REF OTHER W FIRST [END]: the largest relative difference of OTHER's losses from REF's (losses
# alone: the FP8 phase compares a --fp8 1 run with a bf16 one, whose gradient norms need not match step by step)
# over the means of W consecutive steps from step FIRST up to END (main.log counts steps from 0:
# FIRST..FIRST+W-1, ...; a last window shorter than W is left out), and the number of windows compared
compare_windows() {
    awk -v w="$3" -v first="$4" -v end="${5:-}" 'NR == FNR { ref[$1] = $2; next }
         { got[$1] = $2 }
         END {
             worst = 0; n = 0
             for (s in ref) {
                 if (s + 0 < first + 0 || (end != "" && s + 0 >= end + 0)) continue
                 if (!(s in got) || got[s] !~ /^-?[0-9]/ || ref[s] !~ /^-?[0-9]/) { worst = "inf"; break }
                 k = int((s - first) / w); rsum[k] += ref[s]; gsum[k] += got[s]; count[k]++
             }
             if (worst != "inf")
                 for (k in count) {
                     if (count[k] < w) continue
                     n++
                     d = (gsum[k] - rsum[k]) / rsum[k]; if (d < 0) d = -d
                     if (d > worst) worst = d
                 }
             if (n == 0) worst = "inf"
             printf "%s %d\n", worst == "inf" ? "inf" : sprintf("%.3e", worst), n
         }' <(losses "$1") <(losses "$2")
}
within() { awk -v d="$1" -v t="$2" 'BEGIN { exit !(d != "inf" && d + 0 <= t + 0) }'; }

# on cuda, the last run must say it ran there (a silent fall-back to the CPU is a failure)
device_of() { run_output | grep -m 1 -E '^device'; }
ran_on_device() { [[ $DEVICE == cpu || $(device_of) == "device: cuda"* ]]; }

TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
# train_gpt for the checks: --device, data, no validation or samples
train() { run "$TRAIN_GPT" --device "$DEVICE" -i "$DATA" -j "$VAL" -v 0 -s 0 "$@"; }
MPIRUN=(mpirun --oversubscribe --bind-to none -np 2)
# on the cpu the two ranks share the cores: one thread each, as the distributed tests run
[[ $DEVICE == cpu ]] && MPIRUN=(env OMP_NUM_THREADS=1 "${MPIRUN[@]}")

# needs_gpu [CHECK]: SKIPs the phase, or its CHECK, (true) when it needs a GPU that is not there, or a device
# other than cuda
needs_gpu() {
    local check=${1:-the GPU phase}
    if [[ $DEVICE != cuda ]]; then result SKIP "$PHASE" "$check" "(DEVICE=$DEVICE)"; return 0; fi
    if (( !HAVE_GPU )); then result SKIP "$PHASE" "$check" "(no GPU: nvidia-smi found none)"; return 0; fi
    return 1
}
# needs_device [CHECK]: the same for a phase, or its CHECK, that runs on DEVICE, and FAILs it when train_gpt or
# the data are missing
needs_device() {
    if [[ $DEVICE == cuda ]] && (( !HAVE_GPU )); then
        result SKIP "$PHASE" "${1:-the GPU phase}" "(no GPU: nvidia-smi found none)"; return 0
    fi
    if [[ ! -x $TRAIN_GPT ]]; then result FAIL "$PHASE" "train_gpt" "(not built: add the build phase)"; return 0; fi
    if [[ ! -f $DATA ]]; then result FAIL "$PHASE" "data" "($DATA missing: make data, and take data/ along)"; return 0; fi
    return 1
}

# Catch2's summary of LOG: PASS with the counts, or FAIL; a GPU test that skipped on a GPU host fails
catch2_result() {
    local rc=$1 log=$2 check=$3 summary
    summary=$(grep -E '^(All tests passed|test cases:)' "$log" | tail -n 1)
    if grep -q 'skipped: no GPU' "$log"; then
        result FAIL "$PHASE" "$check" "(a test printed 'skipped: no GPU' on a GPU host)"
    elif [[ $GPU_CC == 9.0 ]] && grep -q 'skipped: not Hopper' "$log"; then
        result FAIL "$PHASE" "$check" "(a wgmma test printed 'skipped: not Hopper' on a Hopper: is sm_90a in CUDA_ARCH?)"
    elif grep -qE 'No test cases matched|No tests ran' "$log"; then
        result FAIL "$PHASE" "$check" "(no test matched)"
    elif (( rc == 0 )) && [[ $summary == "All tests passed"* ]]; then
        result PASS "$PHASE" "$check" "$summary"
    else
        result FAIL "$PHASE" "$check" "${summary:-$(why "$rc")}"
    fi
}

# catch2_last RC CHECK: catch2_result on the last run's output alone (the phase's log may hold earlier runs)
catch2_last() {
    run_output >"$WORK/catch2_last.log"
    catch2_result "$1" "$WORK/catch2_last.log" "$2"
}

# catch2_wgmma RC CHECK: the same for a run of wgmma cases, which only a Hopper runs: SKIP on another GPU
catch2_wgmma() {
    run_output >"$WORK/catch2_last.log"
    if [[ $GPU_CC != 9.0 ]] && grep -q 'skipped: not Hopper' "$WORK/catch2_last.log"; then
        result SKIP "$PHASE" "$2" "(not a Hopper: compute capability $GPU_CC)"
    else
        catch2_result "$1" "$WORK/catch2_last.log" "$2"
    fi
}

# kernel_result RC CHECK SUMMARY: the last run, of dev/cuda programs: PASS with their SUMMARY line; a program
# that skipped on a GPU host (or the wgmma variant on a Hopper) fails
kernel_result() {
    local rc=$1 check=$2 summary=$3
    if [[ $(run_output) == *"skipped: no GPU"* ]]; then
        result FAIL "$PHASE" "$check" "(a program printed 'skipped: no GPU' on a GPU host)"
    elif [[ $GPU_CC == 9.0 && $(run_output) == *"skipped: not Hopper"* ]]; then
        result FAIL "$PHASE" "$check" "(the wgmma attention variant was skipped on a Hopper: is sm_90a in CUDA_ARCH?)"
    elif (( rc == 0 )); then result PASS "$PHASE" "$check" "$summary"
    else result FAIL "$PHASE" "$check" "${summary:-$(why "$rc")}"; fi
}

# kernel_programs PROGRAM...: each dev/cuda program run, one result each (its "N of M checks passed" line)
kernel_programs() {
    local program rc
    for program in "$@"; do
        if [[ ! -x dev/cuda/$program ]]; then
            result FAIL "$PHASE" "dev/cuda/$program" "(not built: add the build phase)"; continue
        fi
        run "dev/cuda/$program"
        rc=$?
        kernel_result "$rc" "dev/cuda/$program" "$(run_output | grep -E '^[0-9]+ of [0-9]+ checks passed' | tail -n 1)"
    done
}

# ---------------------------------------------------------------------------------------------------------
# build: train_gpt, build/tests and dev/cuda for the GPU found

# fresh BINARY SOURCES...: the binary exists and no source is newer
fresh() {
    local bin=$1; shift
    [[ -x $bin ]] || return 1
    [[ -z $(find "$@" -newer "$bin" -print -quit 2>/dev/null) ]]
}
LLMC_SOURCES=(llmc Makefile mpi.mk nvcc.mk)
build_target() {  # build_target NAME MAKE_ARGS... ; BINARY and SOURCES set by the caller
    local name=$1; shift
    if [[ $PREBUILT == 1 ]] && fresh "$BINARY" "${SOURCES[@]}"; then
        result PASS build "$name" "(prebuilt, newer than its sources)"
        return
    fi
    local t0=$SECONDS rc
    run nice -n 5 make --no-print-directory -j"$JOBS" "$@"
    rc=$?
    if (( rc == 0 )); then result PASS build "$name" "$((SECONDS - t0)) s"
    else result FAIL build "$name" "$(why "$rc")"; fi
}

phase_build() {
    if [[ $DEVICE == cuda ]] && (( !HAVE_GPU )); then
        result SKIP build "the GPU build" "(no GPU: nothing to build for)"
    else
        BINARY=train_gpt SOURCES=(train_gpt.cu "${LLMC_SOURCES[@]}")
        build_target train_gpt train_gpt
        if [[ $DEVICE == cuda ]]; then
            BINARY=build/tests SOURCES=(test dev/cuda/*.h "${LLMC_SOURCES[@]}")
            build_target build/tests build/tests
            # the oldest of dev/cuda's programs stands for all of them
            BINARY=""
            read -ra programs <<<"$(sed -n 's/^PROGRAMS = //p' dev/cuda/Makefile)"
            for program in "${programs[@]}"; do
                [[ -z $BINARY || ! -e dev/cuda/$program || dev/cuda/$program -ot $BINARY ]] && BINARY=dev/cuda/$program
            done
            SOURCES=(dev/cuda/*.cu dev/cuda/*.h "${LLMC_SOURCES[@]}")
            build_target dev/cuda -C dev/cuda
            if command -v cuobjdump >/dev/null 2>&1 && [[ -x train_gpt ]]; then
                echo "machine code in train_gpt: $(cuobjdump --list-elf train_gpt 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | xargs)" \
                    >>"$PHASE_LOG"
            fi
            # on a Hopper the wgmma attention must be in the machine code: HGMMA, the SASS of wgmma
            if [[ $GPU_CC == 9.0 && -x dev/cuda/attention ]] && command -v cuobjdump >/dev/null 2>&1; then
                hgmma=$(cuobjdump -sass dev/cuda/attention 2>/dev/null | grep -c HGMMA)
                if (( hgmma > 0 )); then result PASS build "HGMMA in dev/cuda/attention (the wgmma attention)" "$hgmma instructions"
                else result FAIL build "HGMMA in dev/cuda/attention (the wgmma attention)" "(none: is sm_90a in CUDA_ARCH?)"; fi
            fi
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# kernels: every dev/cuda check and timing, and PyTorch's SDPA beside the attention kernel

phase_kernels() {
    if ! needs_gpu; then
        run dev/cuda/run_all.sh
        rc=$?
        kernel_result "$rc" "dev/cuda/run_all.sh" "$(run_output | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)"
        if [[ -f dev/cuda/attention_sdpa.py ]]; then
            run "$PYTHON" dev/cuda/attention_sdpa.py
            rc=$?
            last=$(run_output | tail -n 1)
            if (( rc == 0 )); then result PASS kernels "attention_sdpa.py" "$last"
            else result FAIL kernels "attention_sdpa.py" "$(why "$rc")"; fi
        else
            result FAIL kernels "attention_sdpa.py" "(dev/cuda/attention_sdpa.py not found)"
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# tests and model: the Catch2 CUDA tests (the model's own when the model phase runs them)

phase_tests() {
    if ! needs_gpu; then
        filter="[cuda]"
        has_phase model && filter="[cuda]~[model]"
        run build/tests "$filter"
        catch2_result $? "$PHASE_LOG" "build/tests \"$filter\""
    fi
}

phase_model() {
    if ! needs_gpu; then
        run build/tests "[cuda][model]~[wgmma]"
        catch2_last $? 'build/tests "[cuda][model]~[wgmma]" (GPU model against the CPU model)'
        # the same on the wgmma attention (--attention wgmma), which only a Hopper runs
        run build/tests "[cuda][model][wgmma]"
        catch2_wgmma $? 'build/tests "[cuda][model][wgmma]" (GPU model on the wgmma attention against the CPU model)'
    fi
}

# ---------------------------------------------------------------------------------------------------------
# pytorch: the same model file and batches in PyTorch (bf16 autocast on the GPU), 10 AdamW steps

# against_pytorch NAME INIT_ARGS...: pytorch_check.py init writes a model file (INIT_ARGS: its architecture and
# shape), train_gpt trains it for PT_STEPS steps and pytorch_check.py train the same file on the same batches;
# the check NAME passes when every step's losses agree within PT_TOL
against_pytorch() {
    local name=$1; shift
    local dir=$WORK/$PHASE rc verdict
    rm -rf "$dir" && mkdir -p "$dir"
    run "$PYTHON" dev/gpu/pytorch_check.py init --out "$dir/model.bin" "$@"
    rc=$?
    if (( rc != 0 )); then result FAIL "$PHASE" "the model file" "$(why "$rc")"; return; fi
    train -e "$dir/model.bin" -b "$PT_B" -t "$PT_T" -x "$PT_STEPS" -l "$PT_LR" -c 0.1 -k constant -u 0 --shuffle 0 \
        -o "$dir/run"
    rc=$?
    if (( rc != 0 )); then result FAIL "$PHASE" "train_gpt --device $DEVICE" "$(why "$rc")"; return; fi
    if ! ran_on_device; then result FAIL "$PHASE" "train_gpt --device $DEVICE" "(ran on: $(device_of))"; return; fi
    run "$PYTHON" dev/gpu/pytorch_check.py train --model "$dir/model.bin" --data "$DATA" --batch "$PT_B" \
        --seq-len "$PT_T" --steps "$PT_STEPS" --lr "$PT_LR" --weight-decay 0.1 --device "$DEVICE" \
        --compare "$dir/run/main.log" --tol "$PT_TOL"
    rc=$?
    verdict=$(run_output | grep -E '^pytorch_check: max' | tail -n 1 | sed 's/^pytorch_check: //; s/: \(PASS\|FAIL\)$//')
    if (( rc == 0 )); then result PASS "$PHASE" "$name" "$verdict"
    else result FAIL "$PHASE" "$name" "${verdict:-$(why "$rc")}"; fi
}

phase_pytorch() {
    if ! needs_device; then
        IFS=: read -r L C NH <<<"$PT_SHAPE"
        against_pytorch "L=$L C=$C NH=$NH B=$PT_B T=$PT_T, $PT_STEPS steps, against PyTorch" \
            --layers "$L" --channels "$C" --heads "$NH"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# determinism: two identical runs give identical logs and identical checkpoints

# the default shuffle: the data order depends on -t and -d alone, so every layout the mpi phase compares (the
# same -d, other dp and -b) reads the same tokens
CHECK_FLAGS=(-e "$CHECK_MODEL" -b "$CHECK_B" -t "$CHECK_T" -x "$CHECK_STEPS")
CHECK_NAME="$CHECK_MODEL B=$CHECK_B T=$CHECK_T, $CHECK_STEPS steps"

phase_determinism() {
    if ! needs_device; then
        dir=$WORK/determinism
        rm -rf "$dir" && mkdir -p "$dir"
        ok=1
        for r in a b; do
            train "${CHECK_FLAGS[@]}" -n "$CHECK_STEPS" -o "$dir/$r"
            rc=$?
            if (( rc != 0 )); then result FAIL determinism "run $r" "$(why "$rc")"; ok=0; break; fi
            if ! ran_on_device; then result FAIL determinism "run $r" "(ran on: $(device_of))"; ok=0; break; fi
        done
        if (( ok )); then
            if cmp -s "$dir/a/main.log" "$dir/b/main.log" && [[ -s $dir/a/main.log ]]; then
                result PASS determinism "main.log, $CHECK_NAME" "identical ($(losses "$dir/a/main.log" | wc -l) losses)"
            else
                result FAIL determinism "main.log, $CHECK_NAME" "(differ: $(diff "$dir/a/main.log" "$dir/b/main.log" | grep -m 1 '^>' || echo 'empty'))"
            fi
            # the weights, and the optimizer's moments with them
            for file in model.bin optimizer_rank0.bin; do
                ckpt=$(printf 'ckpt_%08d/%s' "$CHECK_STEPS" "$file")
                if [[ ! -f $dir/a/$ckpt ]]; then
                    result FAIL determinism "checkpoint $file" "($ckpt not written)"
                elif cmp "$dir/a/$ckpt" "$dir/b/$ckpt" >>"$PHASE_LOG" 2>&1; then
                    result PASS determinism "checkpoint $file" "identical ($(stat -c %s "$dir/a/$ckpt") bytes)"
                else
                    result FAIL determinism "checkpoint $file" "(differ: $(tail -n 1 "$PHASE_LOG"))"
                fi
            done
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# mpi: 2 ranks sharing the device over MPI (dp with ZeRO-0..3 and 2 micro-steps; tp 2) against one rank, all
# with the same global batch of 4 micro-batches; then a Llama (LLAMA_MODEL) under dp 2 with ZeRO-1 and tp 2,
# and with one key/value head (LLAMA_MQA) under tp 2, both ranks holding it and summing its gradient; last, the
# FP8 parameter gathers (fp8_gathers, below)

GLOBAL_BATCH=$((4 * CHECK_B * CHECK_T))

# single_rank DIR [FLAGS...]: the one-rank run every layout is compared with; true when it ran on the device. A
# phase after the first with the same FLAGS takes the earlier phase's main.log (the same run, repeated for nothing)
declare -A SINGLE_RUNS=()
single_rank() {
    local dir=$1; shift
    local key="flags: $*"  # never empty: bash refuses an empty key
    if [[ -n ${SINGLE_RUNS[$key]:-} && -f ${SINGLE_RUNS[$key]}/main.log ]]; then
        mkdir -p "$dir" && cp "${SINGLE_RUNS[$key]}/main.log" "$dir/main.log"
        echo "verify: one rank with $key, as run before in ${SINGLE_RUNS[$key]}" >>"$PHASE_LOG"
        return 0
    fi
    train "${CHECK_FLAGS[@]}" -d "$GLOBAL_BATCH" -o "$dir" "$@"
    local rc=$? name=$CHECK_NAME args=("$@") i b=$CHECK_B
    # the model (-e) and the micro-batch (-b) the FLAGS name, when they replace CHECK_FLAGS'
    for (( i = 0; i + 1 < ${#args[@]}; i++ )); do
        [[ ${args[i]} == -e ]] && name=${name/#$CHECK_MODEL/${args[i + 1]}}
        [[ ${args[i]} == -b ]] && b=${args[i + 1]} && name=${name/ B=$CHECK_B / B=$b }
    done
    if (( rc != 0 )); then result FAIL "$PHASE" "one rank, $name" "$(why "$rc")"; return 1; fi
    if ! ran_on_device; then result FAIL "$PHASE" "one rank" "(ran on: $(device_of))"; return 1; fi
    result PASS "$PHASE" "one rank, $name, $((GLOBAL_BATCH / (b * CHECK_T))) micro-steps" \
        "final loss $(losses "$dir/main.log" | tail -n 1 | cut -d' ' -f2)"
    SINGLE_RUNS[$key]=$dir
}

# compare_runs REF DIR TOL: compare_losses of the two runs' main.log, with the print's slack unless TOL is 0 (an
# exact comparison), into WORST N LOSS NORM WHICH and FIGURE, the figure a check prints
compare_runs() {
    local slack=1e-6
    awk -v t="$3" 'BEGIN { exit !(t + 0 == 0) }' && slack=0
    read -r WORST N LOSS NORM WHICH < <(compare_losses "$1/main.log" "$2/main.log" "$slack")
    FIGURE="max rel. loss difference $LOSS, norm $NORM over $N steps (worst: the $WHICH; tolerance $3)"
}

# against REF DIR NAME TOL RC: a layout's run in DIR against the one-rank run in REF, every step's loss and
# gradient norm within TOL
against() {
    local ref=$1 dir=$2 name=$3 tol=$4 rc=$5
    if (( rc != 0 )); then result FAIL "$PHASE" "$name" "$(why "$rc")"; return; fi
    compare_runs "$ref" "$dir" "$tol"
    if within "$WORST" "$tol"; then result PASS "$PHASE" "$name" "$FIGURE"
    else result FAIL "$PHASE" "$name" "($FIGURE)"; fi
}

# told_apart REF DIR NAME TOL RC: the negative control of a check by `against`: DIR's run, which must NOT follow
# REF (an untrained continuation), PASSes when the comparison fails on a real difference, and FAILs when it
# passes (the check would not see a run that learns nothing), when a step is missing or not a number (what
# failed is not the comparison), or when the run failed
told_apart() {
    local ref=$1 dir=$2 name=$3 tol=$4 rc=$5
    if (( rc != 0 )); then result FAIL "$PHASE" "$name" "$(why "$rc")"; return; fi
    compare_runs "$ref" "$dir" "$tol"
    if [[ $WORST == inf ]]; then
        result FAIL "$PHASE" "$name" "(not comparable: a step missing or not a number; $FIGURE)"
    elif within "$WORST" "$tol"; then
        result FAIL "$PHASE" "$name" "(not told apart: loss $LOSS, norm $NORM over $N steps, within the tolerance $tol)"
    else
        result PASS "$PHASE" "$name" "max rel. difference $WORST (tolerance $tol; loss $LOSS, norm $NORM over $N steps)"
    fi
}

# two_ranks_can_run: true when 2 ranks can run here; otherwise the phase's SKIP or FAIL is recorded
two_ranks_can_run() {
    if needs_device; then return 1; fi
    if ! command -v mpirun >/dev/null 2>&1; then
        result SKIP "$PHASE" "2 ranks" "(no mpirun: source .devdeps/env.sh, or set ENV_SCRIPT)"; return 1
    fi
    if [[ $(ldd "$TRAIN_GPT" 2>/dev/null) != *libmpi* ]]; then
        result FAIL "$PHASE" "2 ranks" "(train_gpt was built without MPI: rebuild with mpicxx on PATH)"; return 1
    fi
}

# two_ranks_ready DIR [FLAGS...]: true when 2 ranks can run here and the one-rank reference (with FLAGS) ran
# in DIR/single; otherwise the phase's SKIP or FAIL is recorded
two_ranks_ready() {
    local dir=$1; shift
    two_ranks_can_run || return 1
    rm -rf "$dir" && mkdir -p "$dir"
    single_rank "$dir/single" "$@"
}

# two_ranks DIR NAME FLAGS...: a layout on 2 ranks sharing the device over MPI, against DIR/single
two_ranks() {
    local dir=$1 name=$2; shift 2
    local out="$dir/$(printf %s "$name" | tr -c 'a-zA-Z0-9' '_')"
    run "${MPIRUN[@]}" "$TRAIN_GPT" --device "$DEVICE" --comm mpi -i "$DATA" -j "$VAL" -v 0 -s 0 "${CHECK_FLAGS[@]}" \
        -d "$GLOBAL_BATCH" -o "$out" "$@"
    against "$dir/single" "$out" "$name" "$MPI_TOL" $?
}

phase_mpi() {
    if two_ranks_ready "$WORK/mpi"; then
        for z in $ZERO_STAGES; do two_ranks "$WORK/mpi" "dp 2, ZeRO-$z, 2 micro-steps" -z "$z"; done
        two_ranks "$WORK/mpi" "tp 2 (sp), 4 micro-steps" --tp 2
    fi
    if two_ranks_ready "$WORK/mpi_llama" -e "$LLAMA_MODEL"; then
        (( QUICK )) || two_ranks "$WORK/mpi_llama" "$LLAMA_MODEL, dp 2, ZeRO-1, 2 micro-steps" -e "$LLAMA_MODEL" -z 1
        two_ranks "$WORK/mpi_llama" "$LLAMA_MODEL, tp 2 (sp), 4 micro-steps" -e "$LLAMA_MODEL" --tp 2
    fi
    if two_ranks_ready "$WORK/mpi_mqa" -e "$LLAMA_MQA"; then
        two_ranks "$WORK/mpi_mqa" "$LLAMA_MQA, tp 2 (sp) over its one key/value head, 4 micro-steps" -e "$LLAMA_MQA" \
            --tp 2 --debug-check-replicas 1
    fi
    fp8_gathers
}

# fp8_gathers: --fp8-param-gather 1 (llmc/fp8_gather.cuh) on 2 ranks sharing the device over MPI, dp 2 under
# ZeRO-1 and ZeRO-3, tensorwise and (where the GPU runs it) blockwise: the FP8 layers' weights travel as E4M3 codes
# cast from each rank's part with the whole tensor's amax, so every step's loss and gradient norm must be the same
# bits as the same layout gathering bf16 (tolerance 0), over 10 steps at least. The run with the flag must say it.
fp8_gathers() {
    local dir=$WORK/mpi_fp8 recipe z gather rc name missing steps=$((CHECK_STEPS > 10 ? CHECK_STEPS : 10))
    two_ranks_can_run || return
    mkdir -p "$dir"
    for recipe in tensorwise blockwise; do
        missing=$(recipe_missing "$recipe")
        for z in 1 3; do
            name="$CHECK_MODEL dp 2, ZeRO-$z, $recipe: --fp8-param-gather 1 against gathering the stored values"
            if [[ -n $missing ]]; then result SKIP "$PHASE" "$name" "($missing)"; continue; fi
            for gather in 0 1; do
                run "${MPIRUN[@]}" "$TRAIN_GPT" --device "$DEVICE" --comm mpi -i "$DATA" -j "$VAL" -v 0 -s 0 \
                    "${CHECK_FLAGS[@]}" -x "$steps" -d "$GLOBAL_BATCH" -z "$z" --fp8 1 --fp8-recipe "$recipe" \
                    --fp8-param-gather "$gather" -o "$dir/${recipe}_z${z}_$gather"
                rc=$?
                run_output >"$dir/${recipe}_z${z}_$gather.out"
                (( rc == 0 )) || break
            done
            if (( rc == 0 )) && ! grep -q '^fp8: .*gathered over dp as E4M3 codes' "$dir/${recipe}_z${z}_1.out"; then
                result FAIL "$PHASE" "$name" "(the run with the flag printed no 'fp8: ... gather' line)"; continue
            fi
            against "$dir/${recipe}_z${z}_0" "$dir/${recipe}_z${z}_1" "$name" 0 "$rc"
        done
    done
}

# ---------------------------------------------------------------------------------------------------------
# cp: context parallelism on 2 ranks sharing the device over MPI (ring attention with the zig-zag and the
# contiguous split, 2 micro-steps), against one rank with the same global batch; then a Llama (RoPE at the
# rank's positions, the ring carrying the key/value heads only) under the zig-zag split

phase_cp() {
    if two_ranks_ready "$WORK/cp"; then
        for split in zigzag contiguous; do two_ranks "$WORK/cp" "cp 2 ($split), 4 micro-steps" --cp 2 --cp-split "$split"; done
    fi
    if two_ranks_ready "$WORK/cp_llama" -e "$LLAMA_MODEL"; then
        two_ranks "$WORK/cp_llama" "$LLAMA_MODEL, cp 2 (zigzag), 4 micro-steps" -e "$LLAMA_MODEL" --cp 2
    fi
}

# ---------------------------------------------------------------------------------------------------------
# pp: pipeline parallelism on 2 ranks sharing the device over MPI (each schedule over the 4 micro-batches of
# the global batch; the interleaved one with 2 virtual stages per rank; dualpipev's V handing its bottom over in
# device memory on rank 1 and taking the loss on rank 0), against one rank; then a Llama (its lm_head on the last
# stage alone) under 1F1B, and under DualPipeV (its lm_head on rank 0, beside the embeddings)

phase_pp() {
    if two_ranks_ready "$WORK/pp"; then
        for schedule in $PP_SCHEDULES; do two_ranks "$WORK/pp" "pp 2 ($schedule), 4 micro-batches" --pp 2 --pp-schedule "$schedule"; done
        two_ranks "$WORK/pp" "pp 2 (interleaved, vpp 2), 4 micro-batches" --pp 2 --pp-schedule interleaved --vpp 2 \
            --trace "$WORK/pp/interleaved.json"
    fi
    if two_ranks_ready "$WORK/pp_llama" -e "$LLAMA_MODEL"; then
        two_ranks "$WORK/pp_llama" "$LLAMA_MODEL, pp 2 (1f1b), 4 micro-batches" -e "$LLAMA_MODEL" --pp 2 --pp-schedule 1f1b
        two_ranks "$WORK/pp_llama" "$LLAMA_MODEL, pp 2 (dualpipev), 4 micro-batches" -e "$LLAMA_MODEL" --pp 2 \
            --pp-schedule dualpipev
    fi
}

# ---------------------------------------------------------------------------------------------------------
# moe: a mixture of experts (MOE_MODEL) on 2 ranks sharing the device over MPI, its experts split over them
# (--ep 2, all-to-all dispatch; ZeRO-0 and ZeRO-1), replicated (dp 2), or on 2 pipeline stages under the
# zero-bubble schedule (the split backward with experts), against one rank; then a Qwen3 with dense layers
# among the sparse ones and DeepSeek-V3's routing (MOE_MIXED_MODEL: the shared expert's MLP, sigmoid scores, the
# selection bias moved after each step and written into the sharded master weights) under ep 2 with ZeRO-1, and
# under pp 2 (zb: the output gradients of a dense layer's MLP and of each expert's rows kept for the W step); and a
# Qwen2-MoE-shaped Llama (MOE_SHARED_MODEL: attention biases, the gated shared expert's kernels) under ep 2 with
# ZeRO-1 and under pp 2 (zb), and with the load-balancing loss over the batch (--moe-aux-scope batch: each
# forward's counts all-reduced over dp) under ep 2 against one rank of twice the sequences per micro-batch; last
# MOE_MODEL under a capacity (--moe-capacity 1: the kernels' dropped slots, rows -1) under ep 2 with ZeRO-1, and
# with FP8 experts (--fp8 1: one GEMM per expert, which cuBLAS's grouped GEMM cannot take) under ep 2 against one
# rank within FP8_TOL (each expert's scale spans the rows of both ranks' micro-batches). First, on the GPU, the
# routing's kernels against their CPU loops, to the bit (dev/cuda/moe, the [cuda][moe] cases), and the experts'
# grouped GEMMs against one GEMM per expert at Qwen3-30B-A3B's and Mixtral's shapes (dev/cuda/experts, the
# [cuda][experts] cases); every run below routes on the device and runs its bf16 experts grouped.

phase_moe() {
    if ! needs_gpu "the routing's and the grouped experts' kernel checks"; then
        kernel_programs moe experts
        run build/tests "[cuda][moe],[cuda][experts]"
        catch2_last $? 'build/tests "[cuda][moe],[cuda][experts]" (device routing to the bit, grouped GEMMs against the loop)'
    fi
    if two_ranks_ready "$WORK/moe" -e "$MOE_MODEL"; then
        for z in $( ((QUICK)) && echo 1 || echo 0 1); do
            two_ranks "$WORK/moe" "$MOE_MODEL, ep 2 (dp 2), ZeRO-$z, 2 micro-steps" -e "$MOE_MODEL" --ep 2 -z "$z"
        done
        (( QUICK )) || two_ranks "$WORK/moe" "$MOE_MODEL, dp 2 (experts replicated), 2 micro-steps" -e "$MOE_MODEL"
        two_ranks "$WORK/moe" "$MOE_MODEL, pp 2 (zb), 4 micro-batches" -e "$MOE_MODEL" --pp 2 --pp-schedule zb
    fi
    if two_ranks_ready "$WORK/moe_mixed" -e "$MOE_MIXED_MODEL"; then
        two_ranks "$WORK/moe_mixed" "$MOE_MIXED_MODEL, ep 2 (dp 2), ZeRO-1" -e "$MOE_MIXED_MODEL" --ep 2 -z 1
        (( QUICK )) || two_ranks "$WORK/moe_mixed" "$MOE_MIXED_MODEL, pp 2 (zb), 4 micro-batches" -e "$MOE_MIXED_MODEL" \
            --pp 2 --pp-schedule zb
    fi
    if two_ranks_ready "$WORK/moe_shared" -e "$MOE_SHARED_MODEL"; then
        two_ranks "$WORK/moe_shared" "$MOE_SHARED_MODEL, ep 2 (dp 2), ZeRO-1" -e "$MOE_SHARED_MODEL" --ep 2 -z 1
        (( QUICK )) || two_ranks "$WORK/moe_shared" "$MOE_SHARED_MODEL, pp 2 (zb), 4 micro-batches" \
            -e "$MOE_SHARED_MODEL" --pp 2 --pp-schedule zb
    fi
    if two_ranks_ready "$WORK/moe_batch" -e "$MOE_SHARED_MODEL" --moe-aux-scope batch -b $((2 * CHECK_B)); then
        two_ranks "$WORK/moe_batch" "$MOE_SHARED_MODEL, aux loss over the batch, ep 2 (dp 2)" -e "$MOE_SHARED_MODEL" \
            --moe-aux-scope batch --ep 2
    fi
    if two_ranks_ready "$WORK/moe_capacity" -e "$MOE_MODEL" --moe-capacity 1; then
        two_ranks "$WORK/moe_capacity" "$MOE_MODEL, capacity 1, ep 2 (dp 2), ZeRO-1" -e "$MOE_MODEL" --moe-capacity 1 \
            --ep 2 -z 1
    fi
    if two_ranks_ready "$WORK/moe_fp8" -e "$MOE_MODEL" --fp8 1; then
        MPI_TOL=$FP8_TOL two_ranks "$WORK/moe_fp8" "$MOE_MODEL, FP8 experts, ep 2 (dp 2), ZeRO-1" -e "$MOE_MODEL" --fp8 1 \
            --ep 2 -z 1
    fi
}

# ---------------------------------------------------------------------------------------------------------
# profile: --profile and --trace (llmc/profile.h: CUDA events around each op family on the GPU, CUPTI's kernel
# table): CHECK_MODEL on one rank for 8 steps with the third profiled, whose ops must cover it within 15%, whose
# kernel table must be there, whose live memory must stay within the plan, and which must take at most 2% more than
# the median of the steps after it (the profile's own cost); then pp 2 (1f1b, 4 micro-batches) on 2 ranks sharing
# the device, whose bubble must be measured, and its trace drawn (dev/gpu/check_profile.py holds the checks)

profile_result() {  # NAME RC FILE CHECK_PROFILE_FLAGS...: the checks of the last run's profile
    local name=$1 rc=$2 file=$3 problem; shift 3
    if (( rc != 0 )); then result FAIL profile "$name" "$(why "$rc")"; return; fi
    problem=$(run_output | python3 dev/gpu/check_profile.py "$file" "$@")
    if [[ -z $problem ]]; then
        result PASS profile "$name" "($(python3 -c "import json, sys; p = json.load(open(sys.argv[1])); print('step %.2f ms, %.1f%% unattributed, %d kernels' % (p['step_ms'], 100 * p['unattributed_ms'] / p['step_ms'], len(p.get('kernels', []))))" "$file"))"
    else
        result FAIL profile "$name" "$problem"
    fi
}

phase_profile() {
    needs_device && return
    local dir=$WORK/profile
    rm -rf "$dir" && mkdir -p "$dir"
    local gpu_flags=() gpu_checks=""
    [[ $DEVICE == cuda ]] && gpu_flags=(--kernels --overhead 0.02) gpu_checks=", CUPTI's kernels, the profile's cost"
    train -e "$CHECK_MODEL" -b "$CHECK_B" -t "$CHECK_T" -x 8 --profile "$dir/one.json" --trace "$dir/one_trace.json"
    profile_result "$CHECK_MODEL one rank: ops cover the step, memory within the plan$gpu_checks" $? "$dir/one.json" \
        "${gpu_flags[@]}"
    run "${MPIRUN[@]}" "$TRAIN_GPT" --device "$DEVICE" --comm mpi -i "$DATA" -j "$VAL" -v 0 -s 0 -e "$CHECK_MODEL" \
        -b "$CHECK_B" -t "$CHECK_T" -d $((4 * CHECK_B * CHECK_T)) -x 4 --pp 2 --profile "$dir/pp.json" --trace "$dir/pp_trace.json"
    profile_result "$CHECK_MODEL pp 2 (1f1b): every rank's ops, memory, the bubble measured" $? "$dir/pp.json" --bubble
    run scripts/plot_pipeline.py "$dir/pp_trace.json" -o "$dir/pp_trace.png"
    local rc=$?
    if (( rc == 0 )); then result PASS profile "the pp trace drawn" "($dir/pp_trace.png)"
    elif run_output | grep -q "No module named 'matplotlib'"; then result SKIP profile "the pp trace drawn" "(no Matplotlib)"
    else result FAIL profile "the pp trace drawn" "$(why "$rc")"; fi
}

# ---------------------------------------------------------------------------------------------------------
# llama: the Llama 3 path, and Qwen3's. On the GPU: the dev/cuda checks of its kernels (RMSNorm, RoPE, SwiGLU,
# Qwen3's QK-norm, and the attention, whose shapes include grouped-query ones), their Catch2 [cuda] tests and the
# GPU Llama and Qwen3 against the CPU model; then, like the pytorch phase, a Llama 3 file (LLAMA_SHAPE) trained by train_gpt and by PyTorch

# the kernels' Catch2 tests: RMSNorm's and RoPE's by tag, SwiGLU's by file (-# makes each file's name a tag:
# its [cuda] cases have no tag of their own), the grouped-query attention cases by name (mma.sync and wgmma)
LLAMA_KERNEL_TESTS='[cuda][rmsnorm],[cuda][rope],[cuda][#test_swiglu],[cuda][qknorm],CUDA flash attention forward*,CUDA wgmma flash attention*'

phase_llama() {
    if ! needs_gpu "dev/cuda's kernel checks and the Catch2 [cuda] tests"; then
        kernel_programs rmsnorm rope swiglu qknorm attention
        run build/tests -# "$LLAMA_KERNEL_TESTS"
        catch2_last $? 'build/tests: the [cuda] tests of RMSNorm, RoPE, SwiGLU, QK-norm and grouped-query attention'
        run build/tests "[cuda][llama]~[wgmma]"
        catch2_last $? 'build/tests "[cuda][llama]~[wgmma]" (GPU Llama against the CPU model)'
        run build/tests "[cuda][model][qwen3]"
        catch2_last $? 'build/tests "[cuda][model][qwen3]" (GPU Qwen3, QK-norm and a head size of its own, against the CPU model)'
        run build/tests "[cuda][llama][wgmma]"
        catch2_wgmma $? 'build/tests "[cuda][llama][wgmma]" (GPU Llama on the wgmma attention against the CPU model)'
        # a named Llama 3 shape trains: Meta's 1B (1.5 billion parameters here, its lm_head untied; 24 GB of model
        # states, more than a CPU host of this project's size holds in fp32), 10 steps on the SOTU tokens
        dir=$WORK/llama3_1b
        run "$TRAIN_GPT" --device cuda -e llama3-1b -i "$DATA" -j "$VAL" -v 0 -s 0 -b 4 -t 1024 -x 10 -l 3e-4 -o "$dir"
        rc=$?
        losses=$(grep -o 'trl:[0-9.eE+-]*' "$dir/main.log" 2>/dev/null | cut -d: -f2 | tr '\n' ' ')
        read -r first _ <<<"$losses"
        last=${losses% }; last=${last##* }
        name="llama3-1b, B=4 T=1024, 10 steps"
        if (( rc != 0 )); then result FAIL llama "$name" "$(why "$rc")"
        elif [[ -n $first ]] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
            result PASS llama "$name" "loss $first -> $last, $(run_output | grep -m 1 '^memory' || true)"
        else result FAIL llama "$name" "(loss did not fall: ${first:-none} -> ${last:-none})"; fi
    fi
    if ! needs_device "the Llama 3 file against PyTorch"; then
        IFS=: read -r L C NH KV H <<<"$LLAMA_SHAPE"
        against_pytorch "Llama 3 L=$L C=$C NH=$NH KV=$KV H=$H B=$PT_B T=$PT_T, $PT_STEPS steps, against PyTorch" \
            --arch llama3 --layers "$L" --channels "$C" --heads "$NH" --kv-heads "$KV" --hidden "$H" --rope-scaling 8
    fi
}

# ---------------------------------------------------------------------------------------------------------
# fp8: --fp8 1 on the GPU (llmc/fp8.cuh, llmc/fp8_blocks.cuh). Its Catch2 tests: the cast kernels bit for bit
# against the software cast (tensorwise) and the CPU's tile casts (blockwise and mxfp8, each scale at its layout's
# index), each FP8 GEMM (cuBLASLt, E4M3 and E5M2; the block-scaled ones of the recipes the GPU runs) against the
# CPU emulation. Then FP8_RUNS: 200 steps with and without --fp8 1 on the SOTU tokens, the mean losses of each
# FP8_WINDOW steps after the warm-up within FP8_TOL (the warm-up's own mean printed beside); FP8_BLOCK_RUNS, the
# same with --fp8-recipe blockwise; FP8_SPEED: the median step with and without it, side by side (the figures
# dev/bench/RESULTS.md records), and FP8_BLOCK_SPEED blockwise's beside them; last, the recipe the GPU lacks
# (mxfp8 on a Hopper) refused in one line. DEVICE=cpu runs the same on small models against fp32 (the CPU
# emulates every recipe), its plumbing.

# the median of a run's step times, steps 11 on, in ms (its console lines "step N/M | ... | X ms | ...")
median_step_ms() {
    run_output | sed -n 's/^step *\([0-9]*\)\/.* | \([0-9.]*\) ms |.*/\1 \2/p' | awk '$1 > 10 { print $2 }' | sort -g |
        awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'
}

# what train_gpt prints when --fp8 1 is on (train_gpt.cu: "fp8: the matmuls of layers 1 to ... in E4M3 ...")
FP8_ON_LINE='^fp8: the matmuls'
# fp8_problem BF16_OUT FP8_OUT [BF16_LOG FP8_LOG]: nothing when the --fp8 1 run's output says FP8 is on, the bf16
# run's does not, and (given their main.log files) FP8 changed the losses; else what is wrong, in parentheses
fp8_problem() {
    if ! grep -q "$FP8_ON_LINE" "$2" 2>/dev/null; then
        echo "(FP8 never engaged: the --fp8 1 run printed no 'fp8: the matmuls ...' line)"
    elif grep -q "$FP8_ON_LINE" "$1" 2>/dev/null; then
        echo "(the bf16 run printed 'fp8: the matmuls ...': FP8 on without --fp8 1)"
    elif [[ -n ${3:-} ]] && [[ -s $3 && $(losses "$3") == "$(losses "$4")" ]]; then
        echo "(every step's loss identical with and without --fp8 1: FP8 changed nothing)"
    fi
}
# fp8_speed_problem BF16_MS FP8_MS PARAMETERS TOKENS: nothing when both median steps are positive numbers and, for a
# model of 1e9 parameters or more at 16384 tokens a step or more, the bf16 step is at least FP8_MIN_SPEEDUP times
# the fp8 step; else what is wrong, in parentheses. The bound's ground (H100, dev/bench/RESULTS.md): llama3-1b at
# B=16 T=1024 ran 1.12x and 1.13x faster with FP8, llama3-3b at B=8 1.17x and 1.18x, the bf16 step itself within
# 1% from run to run; 1.05 leaves 0.07 below the worst, and FP8 silently off runs at 1.00x. Smaller models are
# slower with FP8 (d12, qwen3-0.6b: the casts' passes cost more than the matmuls save), and smaller batches of
# the 1B were never measured: for them the figure is printed, unbounded
fp8_speed_problem() {
    local number='^[0-9]*\.?[0-9]+$'
    if ! [[ $1 =~ $number && $2 =~ $number ]] || ! awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > 0 && b > 0) }'; then
        echo "(no median step: bf16 '${1}' ms, fp8 '${2}' ms)"
    elif [[ $3 =~ ^[0-9]+$ ]] && (( $3 >= 1000000000 && $4 >= 16384 )) &&
        ! awk -v a="$1" -v b="$2" -v m="$FP8_MIN_SPEEDUP" 'BEGIN { exit !(a / b >= m) }'; then
        echo "(speedup below $FP8_MIN_SPEEDUP at $3 parameters and $4 tokens a step: bf16 $1 ms, fp8 $2 ms)"
    fi
}

# fp8_against_plain NAME PLAIN_DIR FP8_DIR: one --fp8 1 run against the run without it (each DIR a run's -o, beside
# DIR.out its output): FP8 on in the one alone and changing the losses, then the means of each FP8_WINDOW steps after
# the first FP8_SKIP within FP8_TOL (the warm-up's mean and the worst single step printed beside)
fp8_against_plain() {
    local name=$1 plain=$2 fp8=$3 problem diff n step_diff warm figure
    problem=$(fp8_problem "$plain.out" "$fp8.out" "$plain/main.log" "$fp8/main.log")
    if [[ -n $problem ]]; then result FAIL fp8 "$name" "$problem"; return; fi
    # losses alone: FP8's gradients are not bf16's, and their norms need not agree step by step
    read -r diff n < <(compare_windows "$plain/main.log" "$fp8/main.log" "$FP8_WINDOW" "$FP8_SKIP")
    read -r _ _ step_diff _ < <(compare_losses "$plain/main.log" "$fp8/main.log")
    figure="max rel. difference of $FP8_WINDOW-step mean losses after the first $FP8_SKIP steps $diff over $n"
    figure+=" windows (tolerance $FP8_TOL; single steps $step_diff"
    if (( FP8_SKIP > 0 )); then
        read -r warm _ < <(compare_windows "$plain/main.log" "$fp8/main.log" "$FP8_SKIP" 0 "$FP8_SKIP")
        figure+=", the mean of the first $FP8_SKIP $warm"
    fi
    figure+=")"
    if within "$diff" "$FP8_TOL"; then result PASS fp8 "$name" "$figure"; else result FAIL fp8 "$name" "($figure)"; fi
}

# what the GPU lacks of the block recipes ("" when it has them, or on the cpu, which emulates every recipe):
# blockwise runs on compute capability 9.0 alone, mxfp8 from 10.0 (llmc/fp8.cuh, fp8_gpu_problem)
recipe_missing() {
    [[ $DEVICE == cuda ]] || return 0
    case $1 in
        blockwise) [[ $GPU_CC == 9.0 ]] || echo "blockwise runs on compute capability 9.0 alone; this GPU is $GPU_CC" ;;
        mxfp8) [[ ${GPU_CC%%.*} -ge 10 ]] || echo "mxfp8 needs compute capability 10.0; this GPU is $GPU_CC" ;;
    esac
}

# speed_run SPEC VARIANT: the median step of 30 steps of SPEC (model:B:T) without FP8 (VARIANT 0), with --fp8 1 (1)
# or with --fp8 1 --fp8-recipe VARIANT, into SPEED_MS, its output beside in SPEED_OUT; once per SPEC and VARIANT
# (FP8_SPEED and FP8_BLOCK_SPEED share their runs). Returns the run's status
declare -A SPEED_MS=() SPEED_OUT=()
speed_run() {
    local spec=$1 variant=$2 model B T out rc
    [[ -n ${SPEED_OUT["$spec $variant"]:-} ]] && return 0
    IFS=: read -r model B T <<<"$spec"
    out=$WORK/fp8/speed_${model}_${B}_${T}_$variant.out
    case $variant in
        0 | 1) train -e "$model" -b "$B" -t "$T" -x 30 --fp8 "$variant" ;;
        *) train -e "$model" -b "$B" -t "$T" -x 30 --fp8 1 --fp8-recipe "$variant" ;;
    esac
    rc=$?
    run_output >"$out"
    (( rc == 0 )) || return "$rc"
    SPEED_OUT["$spec $variant"]=$out SPEED_MS["$spec $variant"]=$(median_step_ms)
}

phase_fp8() {
    needs_device "the FP8 runs" && return
    mkdir -p "$WORK/fp8"
    local plain=bf16
    [[ $DEVICE == cpu ]] && plain=fp32
    # quick: the tests phase's [cuda] run holds these
    if ! needs_gpu 'build/tests "[cuda][fp8]"' && { (( !QUICK )) || ! has_phase tests; }; then
        run build/tests "[cuda][fp8]"
        catch2_last $? 'build/tests "[cuda][fp8]" (the cast kernels against the software cast and the CPU'"'"'s tile casts, FP8 GEMMs of each recipe the GPU runs against the CPU emulation, the recipes it lacks refused)'
    fi
    declare -A plain_run=()  # the run without FP8 of each model:B:T, which FP8_BLOCK_RUNS shares with FP8_RUNS
    for spec in $FP8_RUNS; do
        IFS=: read -r model B T <<<"$spec"
        for fp8 in 0 1; do
            train -e "$model" -b "$B" -t "$T" -x "$FP8_STEPS" -l 6e-4 -u "$FP8_WARMUP" --fp8 "$fp8" -o "$WORK/fp8/${model}_$fp8"
            rc=$?
            run_output >"$WORK/fp8/${model}_$fp8.out"
            (( rc == 0 )) || break
        done
        name="$model B=$B T=$T, $FP8_STEPS steps, --fp8 1 against $plain"
        if (( rc != 0 )); then result FAIL fp8 "$name" "$(why "$rc")"; continue; fi
        plain_run[$spec]=$WORK/fp8/${model}_0
        fp8_against_plain "$name" "$WORK/fp8/${model}_0" "$WORK/fp8/${model}_1"
    done
    # blockwise (1x128 tiles, 128x128 weight blocks) against the same runs without FP8, its "fp8:" line naming it
    missing=$(recipe_missing blockwise)
    for spec in $FP8_BLOCK_RUNS; do
        IFS=: read -r model B T <<<"$spec"
        name="$model B=$B T=$T, $FP8_STEPS steps, --fp8 1 --fp8-recipe blockwise against $plain"
        if [[ -n $missing ]]; then result SKIP fp8 "$name" "($missing)"; continue; fi
        rc=0
        if [[ -z ${plain_run[$spec]:-} ]]; then
            train -e "$model" -b "$B" -t "$T" -x "$FP8_STEPS" -l 6e-4 -u "$FP8_WARMUP" --fp8 0 -o "$WORK/fp8/${model}_0"
            rc=$?
            run_output >"$WORK/fp8/${model}_0.out"
            (( rc == 0 )) && plain_run[$spec]=$WORK/fp8/${model}_0
        fi
        if (( rc == 0 )); then
            train -e "$model" -b "$B" -t "$T" -x "$FP8_STEPS" -l 6e-4 -u "$FP8_WARMUP" --fp8 1 --fp8-recipe blockwise \
                -o "$WORK/fp8/${model}_blockwise"
            rc=$?
            run_output >"$WORK/fp8/${model}_blockwise.out"
        fi
        if (( rc != 0 )); then result FAIL fp8 "$name" "$(why "$rc")"; continue; fi
        if ! grep -q "$FP8_ON_LINE.*(blockwise)" "$WORK/fp8/${model}_blockwise.out"; then
            result FAIL fp8 "$name" "(the run's 'fp8: the matmuls ...' line does not name blockwise)"; continue
        fi
        fp8_against_plain "$name" "${plain_run[$spec]}" "$WORK/fp8/${model}_blockwise"
    done
    for spec in $FP8_SPEED; do
        IFS=: read -r model B T <<<"$spec"
        name="step time $model B=$B T=$T"
        speed_run "$spec" 0 && speed_run "$spec" 1
        rc=$?
        if (( rc != 0 )); then result FAIL fp8 "$name" "$(why "$rc")"; continue; fi
        ms=("${SPEED_MS["$spec 0"]}" "${SPEED_MS["$spec 1"]}")
        parameters=$(sed -n 's/^model .*: \([0-9]*\) parameters.*/\1/p' "${SPEED_OUT["$spec 1"]}" | head -n 1)
        problem=$(fp8_problem "${SPEED_OUT["$spec 0"]}" "${SPEED_OUT["$spec 1"]}")
        [[ -n $problem ]] || problem=$(fp8_speed_problem "${ms[0]}" "${ms[1]}" "$parameters" $((B * T)))
        if [[ -n $problem ]]; then result FAIL fp8 "$name" "$problem"
        else
            figure="bf16 ${ms[0]} ms, fp8 ${ms[1]} ms, speedup $(awk -v a="${ms[0]}" -v b="${ms[1]}" 'BEGIN { printf "%.2f", a / b }')x"
            if [[ $parameters =~ ^[0-9]+$ ]] && (( parameters >= 1000000000 && B * T >= 16384 )); then
                figure+=" (at least $FP8_MIN_SPEEDUP)"
            fi
            result PASS fp8 "$name" "$figure"
        fi
    done
    # blockwise's step beside the step without FP8 and tensorwise's: figures, unbounded (no blockwise step has been
    # measured yet); the runs must exit 0 with a median step, and blockwise must be on
    for spec in $FP8_BLOCK_SPEED; do
        IFS=: read -r model B T <<<"$spec"
        name="step time $model B=$B T=$T, blockwise"
        if [[ -n $missing ]]; then result SKIP fp8 "$name" "($missing)"; continue; fi
        speed_run "$spec" 0 && speed_run "$spec" 1 && speed_run "$spec" blockwise
        rc=$?
        if (( rc != 0 )); then result FAIL fp8 "$name" "$(why "$rc")"; continue; fi
        ms=("${SPEED_MS["$spec 0"]}" "${SPEED_MS["$spec 1"]}" "${SPEED_MS["$spec blockwise"]}")
        problem=$(fp8_problem "${SPEED_OUT["$spec 0"]}" "${SPEED_OUT["$spec blockwise"]}")
        if [[ -z $problem ]] && ! grep -q "$FP8_ON_LINE.*(blockwise)" "${SPEED_OUT["$spec blockwise"]}"; then
            problem="(the run's 'fp8: the matmuls ...' line does not name blockwise)"
        fi
        [[ -n $problem ]] || problem=$(fp8_speed_problem "${ms[0]}" "${ms[2]}" 0 0)
        if [[ -n $problem ]]; then result FAIL fp8 "$name" "$problem"; continue; fi
        result PASS fp8 "$name" "$(awk -v a="${ms[0]}" -v t="${ms[1]}" -v b="${ms[2]}" -v p="$plain" \
            'BEGIN { printf "%s %s ms, tensorwise %s ms, blockwise %s ms: %.2fx %s, %.2fx tensorwise (a figure, unbounded)", p, a, t, b, a / b, p, t / b }')"
    done
    # a recipe the GPU has no kernels for is refused before anything runs, in one line (llmc/fp8.cuh, fp8_gpu_problem)
    for recipe in blockwise mxfp8; do
        name="--fp8-recipe $recipe refused in one line"
        if [[ $DEVICE == cpu ]]; then result SKIP fp8 "$name" "(DEVICE=cpu: the CPU emulates every recipe)"; continue; fi
        missing=$(recipe_missing "$recipe")
        if [[ -z $missing ]]; then result SKIP fp8 "$name" "(compute capability $GPU_CC runs it)"; continue; fi
        train -e d12 -b 4 -t 1024 -x 1 --fp8 1 --fp8-recipe "$recipe"
        rc=$?
        lines=$(run_output | grep -c .)
        line=$(run_output | head -n 1)
        want="*compute capability 8.9*"  # below it no FP8 at all, whatever the recipe
        if awk -v cc="$GPU_CC" 'BEGIN { exit !(cc + 0 >= 8.9) }'; then
            want="*$recipe*compute capability $([[ $recipe == blockwise ]] && echo 9.0 || echo 10.0)*"
        fi
        # shellcheck disable=SC2053  # want is a pattern
        if (( rc == 1 && lines == 1 )) && [[ $line == "train_gpt: "* && $line == $want ]]; then
            result PASS fp8 "$name" "\"$line\""
        else
            result FAIL fp8 "$name" "(exit status $rc, $lines lines; the first: \"$line\")"
        fi
    done
}

# ---------------------------------------------------------------------------------------------------------
# resume: a checkpoint written on one layout or device and continued on another, against the run that was never
# interrupted: 2 ranks sharing the device (dp 2, ZeRO-1) for half the steps, then one rank (MPI_TOL); and a small
# model trained on the cpu for 5 steps, then on the GPU, and the other way, against the cpu alone (RESUME_TOL).
# Each with its negative control: the same continuation from the same checkpoint with -l 0, whose weights never
# move after it, must fail the same comparison (else the check would pass a resume that loses the training)

# untrained_copy DIR STEP CONTROL: CONTROL holds DIR's checkpoint of STEP and its main.log (which the resumed run
# cuts back to STEP), and nothing else: a continuation there leaves DIR's own run alone
untrained_copy() {
    local ckpt
    ckpt=$(printf 'ckpt_%08d' "$2")
    rm -rf "$3" && mkdir -p "$3" && cp -r "$1/$ckpt" "$3/" && cp "$1/main.log" "$3/"
}

phase_resume() {
    if two_ranks_ready "$WORK/resume"; then
        half=$((CHECK_STEPS / 2))
        dir=$WORK/resume/dp2_z1_then_1
        name="dp 2 ZeRO-1 for $half steps, then 1 rank"
        run "${MPIRUN[@]}" "$TRAIN_GPT" --device "$DEVICE" --comm mpi -i "$DATA" -j "$VAL" -v 0 -s 0 "${CHECK_FLAGS[@]}" \
            -d "$GLOBAL_BATCH" -z 1 -x "$half" -n "$half" -o "$dir"
        rc=$?
        if (( rc == 0 )); then train "${CHECK_FLAGS[@]}" -d "$GLOBAL_BATCH" -n "$half" -y 1 -o "$dir"; rc=$?; fi
        against "$WORK/resume/single" "$dir" "$name" "$MPI_TOL" $rc
        if (( rc == 0 )); then
            control=$WORK/resume/dp2_z1_then_1_lr0
            untrained_copy "$dir" "$half" "$control"
            rc=$?
            if (( rc == 0 )); then train "${CHECK_FLAGS[@]}" -d "$GLOBAL_BATCH" -y 1 -l 0 -o "$control"; rc=$?; fi
            told_apart "$WORK/resume/single" "$control" "$name: an untrained continuation (-l 0) is told apart" \
                "$MPI_TOL" $rc
        fi
        if [[ $DEVICE == cuda ]]; then
            small=(-e d4c128h2 -b 2 -t 64 -d 512 -i "$DATA" -j "$VAL" -v 0 -s 0)
            run "$TRAIN_GPT" --device cpu "${small[@]}" -x 10 -o "$WORK/resume/cpu_only"
            reference_rc=$?
            for devices in "cpu cuda" "cuda cpu"; do
                read -r first then <<<"$devices"
                dir=$WORK/resume/${first}_then_$then
                name="d4c128h2 on $first for 5 steps, then on $then"
                rc=$reference_rc
                if (( rc == 0 )); then run "$TRAIN_GPT" --device "$first" "${small[@]}" -x 5 -n 5 -o "$dir"; rc=$?; fi
                if (( rc == 0 )); then run "$TRAIN_GPT" --device "$then" "${small[@]}" -x 10 -n 5 -y 1 -o "$dir"; rc=$?; fi
                against "$WORK/resume/cpu_only" "$dir" "$name" "$RESUME_TOL" $rc
                (( rc == 0 )) || continue
                untrained_copy "$dir" 5 "${dir}_lr0"
                rc=$?
                if (( rc == 0 )); then run "$TRAIN_GPT" --device "$then" "${small[@]}" -x 10 -y 1 -l 0 -o "${dir}_lr0"; rc=$?; fi
                told_apart "$WORK/resume/cpu_only" "${dir}_lr0" "$name: an untrained continuation (-l 0) is told apart" \
                    "$RESUME_TOL" $rc
            done
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# nccl: one rank over NCCL against the same rank without it

phase_nccl() {
    if ! needs_gpu && ! needs_device; then
        dir=$WORK/nccl
        rm -rf "$dir" && mkdir -p "$dir"
        if single_rank "$dir/single"; then
            train "${CHECK_FLAGS[@]}" -d "$GLOBAL_BATCH" --comm nccl -o "$dir/nccl"
            against "$dir/single" "$dir/nccl" "one rank, --comm nccl" "$NCCL_TOL" $?
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# plan: --plan --device cuda's total against the memory a run measures after its first step

# the --calibrate bounds: the matmul rate at 4096 as a share of the dense bf16 peak. On an H100 SXM llm5d's
# 4096^3 GEMM ran at 786-796 TFLOP/s (dev/hardware/h100.txt, dev/bench/RESULTS.md), 80% of its 989; 0.3 leaves
# 2.6x below that (and takes an H100 PCIe, whose ~600 is 61% of the SXM's peak that h100.txt gives), while a
# kernel 10x slower (8%) or a profile of zeros fails; above the peak, a timing lost the work
CAL_MATMUL_MIN=0.3 CAL_MATMUL_MAX=1.0
# profile_problem FILE: nothing when every figure of the --calibrate profile FILE is a positive finite number
# (reserved_mib and overlap may be 0) and its matmul_tflops at 4096 lies between CAL_MATMUL_MIN and CAL_MATMUL_MAX
# of its peak_tflops (dev/hardware/h100.txt's when FILE names none); else what is wrong, in parentheses
profile_problem() {
    local fallback
    fallback=$(awk '$1 == "peak_tflops" { print $2; exit }' dev/hardware/h100.txt)
    awk -v lo="$CAL_MATMUL_MIN" -v hi="$CAL_MATMUL_MAX" -v fallback="$fallback" '
        { sub(/#.*/, "") }
        NF == 0 || $1 == "name" || $1 == "device" { next }
        {
            ok = 1
            for (i = 2; i <= NF; i++)
                if (!($i ~ /^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$/ && ($i + 0 > 0 || $1 == "reserved_mib" || $1 == "overlap")))
                    ok = 0
            if (!ok && ++nbad <= 3) { $1 = $1; bad = bad (nbad > 1 ? ", " : "") "\"" $0 "\"" }
            if (NF == 2 && $1 == "peak_tflops") peak = $2
            if (NF == 3 && $1 == "matmul_tflops" && $2 == 4096) rate = $3
        }
        END {
            if (nbad) { printf "(not a positive number: %s%s)\n", bad, (nbad > 3 ? sprintf(" and %d more", nbad - 3) : ""); exit }
            if (peak == "") peak = fallback
            if (rate == "") { print "(no matmul_tflops 4096)"; exit }
            if (rate < lo * peak || rate > hi * peak)
                printf "(matmul_tflops 4096 %s: %.0f%% of the peak %s, outside %.0f%% to %.0f%%)\n", rate,
                    100 * rate / peak, peak, 100 * lo, 100 * hi
        }' "$1"
}

phase_plan() {
    if ! needs_gpu && ! needs_device; then
        for spec in $PLAN_RUNS; do
            if ! [[ $spec =~ ^([A-Za-z0-9]+):([0-9]+):([0-2])$ ]]; then
                result FAIL plan "$spec" "(PLAN_RUNS: not MODEL:B:RECOMPUTE)"; continue
            fi
            model=${BASH_REMATCH[1]} b=${BASH_REMATCH[2]} r=${BASH_REMATCH[3]}
            name="$model B=$b T=1024 -r $r"
            run "$TRAIN_GPT" --plan --device cuda -e "$model" -b "$b" -t 1024 -r "$r"
            rc=$?
            planned=$(run_output | sed -n 's/^ *total\( on device\)\{0,1\} *\([0-9]*\) bytes.*/\2/p' | tail -n 1)
            if (( rc != 0 )) || [[ -z $planned ]]; then
                (( rc != 0 )) || rc="no total line"
                result FAIL plan "$name: --plan" "$(why "$rc")"; continue
            fi
            predicted_ms=$(run_output | sed -n 's/^predicted step: \([0-9.]*\) ms.*/\1/p')
            train -e "$model" -b "$b" -t 1024 -r "$r" -x 6
            rc=$?
            # the step time: the median of steps 2-6 beside --plan's prediction on the H100 profile
            measured_ms=$(run_output | sed -n 's/^step *\([2-6]\)\/.*| \([0-9.]*\) ms |.*/\2/p' | sort -n | sed -n 3p)
            if [[ -n $predicted_ms && -n $measured_ms ]]; then
                step_off=$(awk -v p="$predicted_ms" -v m="$measured_ms" 'BEGIN { printf "%.4f", (p - m) / m }')
                figure="--plan $predicted_ms ms, measured $measured_ms ms: $step_off relative (tolerance $STEP_TOL)"
                if within "${step_off#-}" "$STEP_TOL"; then result PASS plan "$name: step time" "$figure"
                else result FAIL plan "$name: step time" "($figure)"; fi
            else
                result FAIL plan "$name: step time" "(no predicted step or no step lines)"
            fi
            line=$(run_output | grep -m 1 '^memory: planned')
            if (( rc != 0 )) || [[ -z $line ]]; then
                (( rc != 0 )) || rc="no memory: line"
                result FAIL plan "$name: run" "$(why "$rc")"; continue
            fi
            if ! [[ $line =~ planned\ ([0-9.]+)\ MiB,\ measured\ ([0-9.]+)\ MiB ]]; then
                result FAIL plan "$name" "(unreadable: $line)"; continue
            fi
            run_planned=${BASH_REMATCH[1]} measured=${BASH_REMATCH[2]}
            read -r plan_mib off self_off < <(awk -v p="$planned" -v m="$measured" -v q="$run_planned" 'BEGIN {
                mib = p / 1048576; printf "%.1f %.4f %.4f\n", mib, (mib - m) / m, (mib - q) / (q > 0 ? q : 1) }')
            figure="--plan $plan_mib MiB, measured $measured MiB: $off relative (tolerance $PLAN_TOL)"
            if within "${off#-}" "$PLAN_TOL"; then result PASS plan "$name" "$figure"
            else result FAIL plan "$name" "($figure)"; fi
            # the run's own prediction is --plan's, to the MiB its line prints
            if within "${self_off#-}" 0.001; then result PASS plan "$name: the run's planned figure is --plan's" "$run_planned MiB"
            else result FAIL plan "$name: the run's planned figure is --plan's" "(run $run_planned MiB, --plan $plan_mib MiB)"; fi
        done
        # --calibrate on this GPU: a profile of positive figures, its 4096 matmul rate a plausible share of the
        # peak (profile_problem), and the d12 step --plan predicts with it within STEP_TOL of the prediction on
        # the stored profile of this GPU's kind (measured on an H100: the same GEMMs, attention and copies, so a
        # healthy GPU lands near it; a kernel 10x slower moves it by far more)
        base=dev/hardware/h100.txt
        [[ $GPU_NAME == *A100* ]] && base=dev/hardware/a100.txt
        profile="$LOGDIR/calibrated.txt"
        run "$TRAIN_GPT" --device cuda --calibrate "$profile" --hardware "$base"
        rc=$?
        if (( rc != 0 )) || [[ ! -s $profile ]]; then
            result FAIL plan "--calibrate" "$(why "$rc")"
        elif problem=$(profile_problem "$profile") && [[ -n $problem ]]; then
            result FAIL plan "--calibrate: the measured profile" "$problem"
        else
            result PASS plan "--calibrate: the measured profile" \
                "$(grep -E '^peak_tflops|^matmul_tflops 4096|^attention_tflops|^memory_gbps' "$profile" | sed 's/ *#.*//' | paste -sd, - | sed 's/,/, /g')"
            run "$TRAIN_GPT" --plan --device cuda -e d12 -b 64 -t 1024 --hardware "$base"
            stored=$(run_output | sed -n 's/^predicted step: \([0-9.]*\) ms.*/\1/p')
            run "$TRAIN_GPT" --plan --device cuda -e d12 -b 64 -t 1024 --hardware "$profile"
            rc=$?
            step=$(run_output | sed -n 's/^predicted step: \([0-9.]*\) ms.*/\1/p')
            name="--calibrate: d12 B=64 predicted on the measured profile against $base"
            if (( rc != 0 )) || [[ -z $step || -z $stored ]]; then
                (( rc != 0 )) || rc="no predicted step"
                result FAIL plan "$name" "$(why "$rc")"
            else
                off=$(awk -v p="$step" -v q="$stored" 'BEGIN { printf "%.4f", (p - q) / q }')
                figure="$step ms against $stored ms: $off relative (tolerance $STEP_TOL)"
                if within "${off#-}" "$STEP_TOL"; then result PASS plan "$name" "$figure"
                else result FAIL plan "$name" "($figure)"; fi
            fi
        fi
    fi
}

# ---------------------------------------------------------------------------------------------------------
# bench: dev/bench/gpu_bench.sh (llm5d, llm.c and PyTorch side by side; a per-kernel breakdown of one step)

phase_bench() {
    if ! needs_gpu; then
        # gpu_bench.sh limits each of its own runs (one per phase and shape, and a build); this limit only
        # stops a benchmark that hangs past all of them
        # (under a BUDGET, the phase's limit, the time left, bounds both)
        local runs=$(($(wc -w <<<"$BENCH_PHASES") * ($(wc -w <<<"${SHAPES:-d12:64 d48:16}") + 1) + 1))
        (( BUDGET )) || PHASE_END=$((SECONDS + TIMEOUT * runs))
        run env PHASES="$BENCH_PHASES" TIMEOUT="$(( PHASE_LIMIT < TIMEOUT ? PHASE_LIMIT : TIMEOUT ))" BENCH_TMP="$LOGDIR/bench" NO_BUILD=1 PYTHON="$PYTHON" \
            DATA="$DATA" VAL="$VAL" bash dev/bench/gpu_bench.sh
        rc=$?
        # its summary lines become checks here; its table of figures joins the table at the end
        while IFS= read -r line; do
            [[ $line =~ ^(PASS|FAIL|SKIP)\ \ (.*)$ ]] || continue
            status=${BASH_REMATCH[1]} rest=${BASH_REMATCH[2]}
            result "$status" bench "${rest%% | *}" "$([[ $rest == *" | "* ]] && echo "${rest#* | }")"
        done < <(sed -n '/^== summary/,$p' "$PHASE_LOG")
        grep -q '^== summary' "$PHASE_LOG" || result FAIL bench "dev/bench/gpu_bench.sh" "$(why "$rc")"
    fi
}

# ---------------------------------------------------------------------------------------------------------
# the phases, in priority order, each when it fits in what is left of the BUDGET

# Estimated seconds of each phase on one H100 (full, and PHASES=quick's form), and of its DEVICE=cpu form on a
# 2-core machine (quick's settings). From the first H100 runs (dev/bench/RESULTS.md, dev/gpu/README.md): one rank
# of d12 B=4 T=1024 43 ms a step, two ranks sharing the GPU over --comm mpi dp 2 920 ms, tp 2 4.0 s, cp 2 4.7 s,
# pp 2 390 ms; a train_gpt start (CUDA context, cuBLASLt, the model's init) taken as 4 s, mpirun's 2 ranks 7 s.
# Quick's runs (d6c384h6, T=256, 6 steps: half of d12's layers and width, a quarter of its length) are taken as
# their start plus at most 2 s of steps, whatever the layout. dev/gpu/README.md has the table with the reasoning.
declare -A EST_FULL=(
    [build]=240         # 2 to 4 minutes on 16 cores (PREBUILT=1 with fresh binaries: 5)
    [tests]=20          # build/tests "[cuda]~[model]": 28 cases in 9 s on an H100 (2026-11-27)
    [model]=20          # 2 models x 2 attentions against the CPU model: 11 cases in 11 s on an H100
    [llama]=170         # 4 dev/cuda programs (< 20 s each), Catch2 30, llama3-1b 10 steps 30, PyTorch 40
    [fp8]=580           # 3 x 2 runs of 200 steps (d12 B=16 ~0.15 s, the 1B Llama ~0.3 s, the MoE ~0.15 s a step), 12 timed runs; blockwise d12 200 steps 34 and llama3-1b timed 20 (its bf16 and tensorwise runs shared), mxfp8 refused 4
    [cp]=230            # 2 x (20 steps x 4.7 s + 7), the Llama 25
    [pp]=115            # 5 schedules x (20 x 0.39 s + 7), the Llama's 1f1b and dualpipev 20 each
    [moe]=260           # dev/cuda/moe and experts ~30, their Catch2 cases 5; 4 runs of 20 steps of d6c384 experts at T=1024, ~0.5 s a step, + 7 each; the mixed Qwen3-MoE and the Qwen2-MoE: 3 more each; the batch-scope, capacity and FP8 pairs 2 each
    [profile]=40        # CHECK_MODEL 8 steps on one rank (~1 s each at d12 B=4) + 7; pp 2 4 steps + 10; the plot 3
    [mpi]=450           # 4 x (20 x 0.92 s + 7), tp 20 x 4.0 s + 7, the Llama's 3 layouts 15 each; the FP8 gathers 8 x (20 x 0.92 s + 7)
    [kernels]=150       # 12 dev/cuda programs (93 s on an H100, 2026-11-27: attention 27) and attention_sdpa.py
    [pytorch]=60        # d12 10 steps, then PyTorch's d12 (bf16 autocast) 10 steps
    [determinism]=25    # 2 x (20 x 43 ms + 4 s + a 1.5 GB checkpoint)
    [resume]=75         # dp 2 10 steps, 1 rank 10 steps, 4 small runs across devices; 3 untrained (-l 0) continuations
    [nccl]=15           # 2 one-rank runs of 20 steps
    [plan]=120          # 4 x (--plan + 6 steps at B=16), --calibrate
    [bench]=1500        # llm5d, llm.c and PyTorch compiled at d12 and d48, and ncu's profile: 2 to 5 min each
)
declare -A EST_QUICK=(
    [build]=5           # PREBUILT=1 with fresh binaries (the recipe): the checks of freshness alone
    [tests]=20          # build/tests "[cuda]~[model]": every [cuda] case but the models': 9 s on an H100 (2026-11-27)
    [model]=20          # [cuda][model]: 11 cases, 274 assertions in 11 s on an H100
    [fp8]=25            # d12 B=4 T=1024, 20 steps without --fp8 1, with it and with blockwise: 3 x (4 s + 20 x ~45 ms); mxfp8 refused 4
    [mpi]=90            # 1 rank, ZeRO-1 and 3, tp 2; the Llama's 1 rank and tp 2, its one-head tp 2: 25 s on an H100; the FP8 gathers 8 x ~7
    [cp]=20             # 1 rank, zigzag and contiguous; the Llama's 1 rank and zigzag: 13 s on an H100
    [pp]=25             # zb, interleaved (7 s on an H100 with the Llama's 1f1b), dualpipev and the Llama's: ~5 each
    [moe]=110           # dev/cuda/moe and experts ~30, their Catch2 cases 5; 1 rank 5; ep 2 with ZeRO-1 and pp 2 (zb): 2 x 9; the mixed Qwen3-MoE and the Qwen2-MoE: 1 rank and ep 2 each; the batch-scope, capacity and FP8 pairs
    [profile]=25        # d6c384h6 8 steps on one rank + 7, pp 2 4 steps + 10, the plot 3
    [resume]=45         # dp 2 3 steps then 1 rank: 9 + 5; d4c128h2: 10 cpu steps, 2 x (5 on each device); 3 -l 0 runs
    [nccl]=5            # one run of 6 steps (its 1 rank: the mpi phase's)
)
declare -A EST_CPU=(
    [build]=240 [tests]=1 [model]=1 [llama]=60 [fp8]=100 [cp]=40 [pp]=60 [moe]=300 [profile]=30 [mpi]=100 [kernels]=1
    [pytorch]=30 [determinism]=20 [resume]=40 [nccl]=1 [plan]=1 [bench]=1
)
estimate() {
    local p=$1
    if [[ $DEVICE == cpu ]]; then echo "${EST_CPU[$p]}"
    elif [[ $p == build && $PREBUILT == 1 ]]; then echo 5
    elif [[ $p == fp8 ]] && { (( QUICK )) || [[ -z $FP8_SPEED ]]; }; then
        # the [cuda][fp8] tests, FP8_RUNS and FP8_BLOCK_RUNS (quick's or full's), and FP8_BLOCK_SPEED without
        # FP8_SPEED's runs to share: a bf16, a tensorwise and a blockwise run of 30 steps, ~20 s each
        echo $(( ( QUICK ? EST_QUICK[fp8] : 160 ) + 60 * $(wc -w <<<"$FP8_BLOCK_SPEED") ))
    elif (( QUICK )) && [[ -n ${EST_QUICK[$p]:-} ]]; then echo "${EST_QUICK[$p]}"
    else echo "${EST_FULL[$p]}"; fi
}

BUDGET_RESERVE=15  # the figures, the count, and a stopped command's grace (timeout -k 10)
for p in $ALL_PHASES; do
    has_phase "$p" || continue
    limit=$TIMEOUT PHASE_BUDGETED=0
    if (( BUDGET )); then
        left=$((BUDGET - SECONDS - BUDGET_RESERVE))
        est=$(estimate "$p")
        if (( est > left )); then
            (( left < 0 )) && left=0
            echo
            result SKIP "$p" "the phase" "(budget: estimated $est s, $left s left of BUDGET=$BUDGET)"
            BUDGET_SKIPPED+=("$p")
            continue
        fi
        (( left < limit )) && limit=$left PHASE_BUDGETED=1
    fi
    start_phase "$p" "$limit"
    "phase_$p"
done

# ---------------------------------------------------------------------------------------------------------
# the table of figures, and the count

echo
echo "== figures"
printf '%-4s  %-12s  %-60s  %s\n' "" phase check figure
for row in "${RESULTS[@]}"; do
    IFS=$'\t' read -r status phase check figure <<<"$row"
    [[ $status == SKIP ]] && continue
    printf '%-4s  %-12s  %-60s  %s\n' "$status" "$phase" "$check" "$figure"
done
if has_phase bench && [[ -f $LOGDIR/bench.log ]]; then
    sed -n '/^== figures/,/^$/p' "$LOGDIR/bench.log"
fi
echo
if (( BUDGET )); then
    echo "budget: $SECONDS s of $BUDGET s used; skipped for the budget: ${BUDGET_SKIPPED[*]:-nothing}"
fi
echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
(( FAILED == 0 ))

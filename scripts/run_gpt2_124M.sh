#!/usr/bin/env bash
# Trains GPT-2 124M (d12) on one node with data parallelism over NUM_GPUS ranks, with llm.c's recipe for it:
# micro-batch 64 x 1024 tokens per rank, 524288 tokens (0.5M) per optimizer step (gradient accumulation makes up
# the rest), lr 6e-4 with 700 warmup steps and cosine decay to 0, weight decay 0.1, ZeRO-1, validation every 250
# steps, a checkpoint every 5000 steps (resumed from automatically), main.log in OUT_DIR.
#
# Data: FineWeb-style uint16 token shards (llm.c's format); e.g. for FineWeb10B
#   TRAIN_DATA="dev/data/fineweb10B/fineweb_train_*.bin" VAL_DATA="dev/data/fineweb10B/fineweb_val_*.bin"
# (one epoch of FineWeb10B is about 19073 steps at 0.5M tokens). The defaults point at the small SOTU set that
# `make data` prepares, which is enough to check that the launch works.
#
# Variables (set in the environment; default in brackets):
#   NUM_GPUS      ranks to launch, one per GPU                                              [8]
#   DEVICE, COMM, TRAIN_DATA, VAL_DATA, MODEL, OUT_DIR, MICRO_BATCH, SEQ_LEN, TOTAL_BATCH, LR, FINAL_LR_FRAC,
#   WARMUP, WEIGHT_DECAY, MAX_STEPS, VAL_EVERY, SAMPLE_EVERY, GEN_TOKENS, CKPT_EVERY, RESUME, ZERO, EXTRA_ARGS
#                 the training settings and their train_gpt flags: listed, with their defaults, in
#                 scripts/gpt2_124M_flags.sh (shared with multi_node/mpirun_hostfile.sh)
#   MPIRUN        the MPI launcher                                                          [mpirun]
#   MPI_ARGS      more launcher flags, split on spaces (e.g. --oversubscribe)               []
#   KILL_DELAY    seconds mpirun gives the ranks between the SIGTERM and the SIGKILL of a job it aborts (its
#                 odls_base_sigkill_timeout; it waits as long again before that SIGTERM): at least one step
#                 plus one checkpoint, so that a SIGTERM to mpirun itself still leaves a checkpoint      [30]
#   BUILD         1 = `make train_gpt` first; 0 = use the ./train_gpt that is there          [1]
#                 (one node: the build's default -march=native suits it; for a binary built elsewhere, build it
#                 with `make HOST_ARCH=x86-64-v3` or the -march of this node's CPU)
#
# Stopping: SIGTERM, SIGINT, SIGUSR1 or SIGUSR2 to this script reaches the ranks as SIGUSR1 (forward_stop.sh):
# they finish their step, write a checkpoint and exit 5, and so does this script; RESUME=1 goes on from there.
#
# Usage: scripts/run_gpt2_124M.sh                 (from anywhere; it runs from the repository root)
#        DEVICE=cpu NUM_GPUS=2 MPI_ARGS=--oversubscribe MICRO_BATCH=4 SEQ_LEN=256 TOTAL_BATCH=2048 MAX_STEPS=10 \
#          scripts/run_gpt2_124M.sh
set -euo pipefail

: "${NUM_GPUS:=8}"
: "${MPIRUN:=mpirun}"
: "${MPI_ARGS:=}"
: "${BUILD:=1}"
: "${KILL_DELAY:=30}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpt2_124M_flags.sh
source scripts/forward_stop.sh
read -r -a mpi_args <<< "$MPI_ARGS"

if [ "$BUILD" = 1 ]; then make train_gpt; fi
mkdir -p "$OUT_DIR"

set -x
launch_forwarding_stop "$MPIRUN" -np "$NUM_GPUS" --mca odls_base_sigkill_timeout "$KILL_DELAY" "${mpi_args[@]}" \
    ./train_gpt "${TRAIN_GPT_ARGS[@]}"

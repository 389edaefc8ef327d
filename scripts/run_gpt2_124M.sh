#!/usr/bin/env bash
# Trains GPT-2 124M (d12) on one node with data parallelism over NUM_GPUS ranks, with llm.c's recipe for it:
# micro-batch 64 x 1024 tokens per rank, 524288 tokens (0.5M) per optimizer step (gradient accumulation makes up
# the rest), lr 6e-4 with 700 warmup steps and cosine decay to 0, weight decay 0.1, ZeRO-1, validation every 250
# steps, a checkpoint every 5000 steps (resumed from automatically), main.log in OUT_DIR.
#
# Status: train_gpt's CUDA backend is not built yet, so with DEVICE=cuda (the default) train_gpt refuses
# `--device cuda` and this script stops at once. It needs `--device cuda` to land; until then it runs the CPU path
# only if DEVICE=cpu is set (fp32 on the host, MPI communication; d12 at this batch size is very slow on a CPU:
# shrink MICRO_BATCH, SEQ_LEN and TOTAL_BATCH, or use the Makefile's `make train` demo, for a quick look).
#
# Data: FineWeb-style uint16 token shards (llm.c's format); e.g. for FineWeb10B
#   TRAIN_DATA="dev/data/fineweb10B/fineweb_train_*.bin" VAL_DATA="dev/data/fineweb10B/fineweb_val_*.bin"
# (one epoch of FineWeb10B is about 19073 steps at 0.5M tokens). The defaults point at the small SOTU set that
# `make data` prepares, which is enough to check that the launch works.
#
# Variables (set in the environment; default in brackets):
#   NUM_GPUS      ranks to launch, one per GPU                                              [8]
#   DEVICE        cuda | cpu, passed as --device                                            [cuda]
#   COMM          communication backend, passed as --comm                [nccl for cuda, mpi for cpu]
#   TRAIN_DATA    train shards (glob), -i                                                   [data/sotu/train.bin]
#   VAL_DATA      val shards (glob), -j                                                     [data/sotu/val.bin]
#   MODEL         -e: a descriptor (d12 = GPT-2 124M) or an llm.c model file                [d12]
#   OUT_DIR       -o: main.log and checkpoints                                              [log124M]
#   MICRO_BATCH   -b: sequences per rank per micro-step                                     [64]
#   SEQ_LEN       -t: sequence length                                                       [1024]
#   TOTAL_BATCH   -d: tokens per optimizer step                                             [524288]
#   LR            -l: peak learning rate                                                    [6e-4]
#   FINAL_LR_FRAC -q: final learning rate as a fraction of LR                               [0.0]
#   WARMUP        -u: warmup steps                                                          [700]
#   WEIGHT_DECAY  -c                                                                        [0.1]
#   MAX_STEPS     -x: training steps, -1 = one epoch of TRAIN_DATA                          [-1]
#   VAL_EVERY     -v: validate every N steps                                                [250]
#   SAMPLE_EVERY  -s: sample every N steps                                                  [20000]
#   GEN_TOKENS    -g: tokens per sample                                                     [144]
#   CKPT_EVERY    -n: checkpoint every N steps                                              [5000]
#   RESUME        -y: 1 = resume from the newest checkpoint in OUT_DIR (or start fresh)     [1]
#   ZERO          -z: ZeRO stage                                                            [1]
#   EXTRA_ARGS    more train_gpt flags, split on spaces                                     []
#   MPIRUN        the MPI launcher                                                          [mpirun]
#   MPI_ARGS      more launcher flags, split on spaces (e.g. --oversubscribe)               []
#   BUILD         1 = `make train_gpt` first; 0 = use the ./train_gpt that is there          [1]
#
# Usage: scripts/run_gpt2_124M.sh                 (from anywhere; it runs from the repository root)
#        DEVICE=cpu NUM_GPUS=2 MPI_ARGS=--oversubscribe MICRO_BATCH=4 SEQ_LEN=256 TOTAL_BATCH=2048 MAX_STEPS=10 \
#          scripts/run_gpt2_124M.sh
set -euo pipefail

: "${NUM_GPUS:=8}"
: "${DEVICE:=cuda}"
if [ "$DEVICE" = cuda ]; then : "${COMM:=nccl}"; else : "${COMM:=mpi}"; fi
: "${TRAIN_DATA:=data/sotu/train.bin}"
: "${VAL_DATA:=data/sotu/val.bin}"
: "${MODEL:=d12}"
: "${OUT_DIR:=log124M}"
: "${MICRO_BATCH:=64}"
: "${SEQ_LEN:=1024}"
: "${TOTAL_BATCH:=524288}"
: "${LR:=6e-4}"
: "${FINAL_LR_FRAC:=0.0}"
: "${WARMUP:=700}"
: "${WEIGHT_DECAY:=0.1}"
: "${MAX_STEPS:=-1}"
: "${VAL_EVERY:=250}"
: "${SAMPLE_EVERY:=20000}"
: "${GEN_TOKENS:=144}"
: "${CKPT_EVERY:=5000}"
: "${RESUME:=1}"
: "${ZERO:=1}"
: "${EXTRA_ARGS:=}"
: "${MPIRUN:=mpirun}"
: "${MPI_ARGS:=}"
: "${BUILD:=1}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
read -r -a extra <<< "$EXTRA_ARGS"
read -r -a mpi_args <<< "$MPI_ARGS"

if [ "$BUILD" = 1 ]; then make train_gpt; fi
mkdir -p "$OUT_DIR"

set -x
"$MPIRUN" -np "$NUM_GPUS" "${mpi_args[@]}" ./train_gpt \
    --device "$DEVICE" \
    --comm "$COMM" \
    -i "$TRAIN_DATA" \
    -j "$VAL_DATA" \
    -o "$OUT_DIR" \
    -e "$MODEL" \
    -b "$MICRO_BATCH" -t "$SEQ_LEN" \
    -d "$TOTAL_BATCH" \
    -l "$LR" -q "$FINAL_LR_FRAC" -u "$WARMUP" \
    -c "$WEIGHT_DECAY" \
    -x "$MAX_STEPS" \
    -v "$VAL_EVERY" -s "$SAMPLE_EVERY" -g "$GEN_TOKENS" \
    -n "$CKPT_EVERY" -y "$RESUME" \
    -z "$ZERO" \
    "${extra[@]}"

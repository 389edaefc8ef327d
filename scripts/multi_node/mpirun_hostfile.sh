#!/usr/bin/env bash
# Trains GPT-2 124M (d12) across several nodes with OpenMPI's mpirun and a hostfile: NUM_NODES x GPUS_PER_NODE
# ranks, GPUS_PER_NODE per node (--map-by ppr:GPUS_PER_NODE:node), NCCL bootstrapped through MPI. Every NCCL_*
# variable set here is exported to every rank, with PATH and LD_LIBRARY_PATH. The repository (built train_gpt
# and data included) must sit at the same path on every node, e.g. on a shared filesystem.
# Same recipe as scripts/run_gpt2_124M.sh (llm.c's GPT-2 124M run).
#
# Status: train_gpt's CUDA backend is not built yet, so with DEVICE=cuda (the default) train_gpt refuses
# `--device cuda`; it needs `--device cuda` to land. Until then only DEVICE=cpu runs (the CPU path, MPI comm).
#
# Hostfile, one line per node:   node001 slots=8
#                                node002 slots=8
# Before a long job, check the network with the collective benchmark (dev/comm/README.md), e.g.
#   mpirun --hostfile hostfile --map-by ppr:8:node -np 16 dev/comm/comm_bench --backend nccl
#
# Variables (set in the environment; default in brackets):
#   HOSTFILE      OpenMPI hostfile                                                          [hostfile]
#   NUM_NODES     nodes to use (the first NUM_NODES of the hostfile)                         [2]
#   GPUS_PER_NODE ranks per node, one per GPU; -np is NUM_NODES x GPUS_PER_NODE             [8]
#   DEVICE        cuda | cpu, passed as --device                                            [cuda]
#   COMM          communication backend, passed as --comm                [nccl for cuda, mpi for cpu]
#   TRAIN_DATA    train shards (glob), -i                                                   [data/sotu/train.bin]
#   VAL_DATA      val shards (glob), -j                                                     [data/sotu/val.bin]
#   MODEL         -e                                                                        [d12]
#   OUT_DIR       -o (on a shared filesystem: rank 0 writes main.log, every rank its shards) [log124M]
#   MICRO_BATCH   -b                                                                        [64]
#   SEQ_LEN       -t                                                                        [1024]
#   TOTAL_BATCH   -d: tokens per optimizer step                                             [524288]
#   LR            -l                                                                        [6e-4]
#   FINAL_LR_FRAC -q                                                                        [0.0]
#   WARMUP        -u                                                                        [700]
#   WEIGHT_DECAY  -c                                                                        [0.1]
#   MAX_STEPS     -x: -1 = one epoch of TRAIN_DATA                                          [-1]
#   VAL_EVERY     -v                                                                        [250]
#   SAMPLE_EVERY  -s                                                                        [20000]
#   GEN_TOKENS    -g                                                                        [144]
#   CKPT_EVERY    -n                                                                        [5000]
#   RESUME        -y                                                                        [1]
#   ZERO          -z                                                                        [1]
#   EXTRA_ARGS    more train_gpt flags, split on spaces                                     []
#   MPIRUN        the MPI launcher                                                          [mpirun]
#   MPI_ARGS      more mpirun flags, split on spaces (e.g. "--mca btl_tcp_if_include eth0") []
#   NCCL_*        any that are set (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...) are exported to all ranks
set -euo pipefail

: "${HOSTFILE:=hostfile}"
: "${NUM_NODES:=2}"
: "${GPUS_PER_NODE:=8}"
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

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -f "$HOSTFILE" ] || { echo "mpirun_hostfile.sh: HOSTFILE=$HOSTFILE does not exist (one line per node: NAME slots=$GPUS_PER_NODE)" >&2; exit 1; }
[ -x ./train_gpt ] || { echo "mpirun_hostfile.sh: ./train_gpt is missing; run make first" >&2; exit 1; }
NP=$((NUM_NODES * GPUS_PER_NODE))
read -r -a extra <<< "$EXTRA_ARGS"
read -r -a mpi_args <<< "$MPI_ARGS"

# export PATH, LD_LIBRARY_PATH and every NCCL_* that is set to the remote ranks
exports=(-x PATH)
[ -n "${LD_LIBRARY_PATH:-}" ] && exports+=(-x LD_LIBRARY_PATH)
for var in $(compgen -e); do
    case "$var" in NCCL_*) exports+=(-x "$var") ;; esac
done

mkdir -p "$OUT_DIR"
set -x
"$MPIRUN" -np "$NP" \
    --hostfile "$HOSTFILE" \
    --map-by "ppr:$GPUS_PER_NODE:node" \
    --bind-to none \
    "${exports[@]}" \
    "${mpi_args[@]}" \
    ./train_gpt \
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

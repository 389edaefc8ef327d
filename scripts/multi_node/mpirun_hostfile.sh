#!/usr/bin/env bash
# Trains GPT-2 124M (d12) across several nodes with OpenMPI's mpirun and a hostfile: NUM_NODES x GPUS_PER_NODE
# ranks, GPUS_PER_NODE per node (--map-by ppr:GPUS_PER_NODE:node), NCCL bootstrapped through MPI. Every NCCL_*
# variable set here is exported to every rank, with PATH and LD_LIBRARY_PATH. The repository (built train_gpt
# and data included) must sit at the same path on every node, e.g. on a shared filesystem, and train_gpt must
# run on every node's CPU: build it with `make HOST_ARCH=x86-64-v3` (or the -march of the oldest node), not a
# plain `make`, whose -march=native binary can die with an illegal instruction on another CPU.
# Same recipe as scripts/run_gpt2_124M.sh (llm.c's GPT-2 124M run).
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
#   MICRO_BATCH   -b, set here so that -np x MICRO_BATCH x SEQ_LEN divides TOTAL_BATCH: 16 x 32 x 1024 = 524288
#                 (scale it with the ranks)                                                 [32]
#   DEVICE, COMM, TRAIN_DATA, VAL_DATA, MODEL, OUT_DIR, MICRO_BATCH, SEQ_LEN, TOTAL_BATCH, LR, FINAL_LR_FRAC,
#   WARMUP, WEIGHT_DECAY, MAX_STEPS, VAL_EVERY, SAMPLE_EVERY, GEN_TOKENS, CKPT_EVERY, RESUME, ZERO, EXTRA_ARGS
#                 the training settings and their train_gpt flags: listed, with their defaults, in
#                 scripts/gpt2_124M_flags.sh (shared with run_gpt2_124M.sh). OUT_DIR should be on a shared
#                 filesystem: rank 0 writes main.log, every rank its checkpoint shards.
#   MPIRUN        the MPI launcher                                                          [mpirun]
#   MPI_ARGS      more mpirun flags, split on spaces (e.g. "--mca btl_tcp_if_include eth0") []
#   KILL_DELAY    seconds mpirun gives the ranks between the SIGTERM and the SIGKILL of a job it aborts (its
#                 odls_base_sigkill_timeout; it waits as long again before that SIGTERM): at least one step
#                 plus one checkpoint, so that a SIGTERM to mpirun itself still leaves a checkpoint      [30]
#   NCCL_*        any that are set (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...) are exported to all ranks
#
# Stopping: SIGTERM, SIGINT, SIGUSR1 or SIGUSR2 to this script reaches the ranks as SIGUSR1 (forward_stop.sh):
# they finish their step, write a checkpoint and exit 5, and so does this script; RESUME=1 goes on from there.
# Under Slurm (salloc, or an sbatch script that runs this one), ask for the advance notice, e.g.
# `sbatch --signal=B:USR1@300`, and have the batch script pass it on (as multi_node/sbatch_*.sbatch do).
set -euo pipefail

: "${HOSTFILE:=hostfile}"
: "${NUM_NODES:=2}"
: "${GPUS_PER_NODE:=8}"
: "${MPIRUN:=mpirun}"
: "${MPI_ARGS:=}"
: "${MICRO_BATCH:=32}"
: "${KILL_DELAY:=30}"

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -f "$HOSTFILE" ] || { echo "mpirun_hostfile.sh: HOSTFILE=$HOSTFILE does not exist (one line per node: NAME slots=$GPUS_PER_NODE)" >&2; exit 1; }
[ -x ./train_gpt ] || { echo "mpirun_hostfile.sh: ./train_gpt is missing; build it with make HOST_ARCH=x86-64-v3 (or the -march of the nodes' oldest CPU)" >&2; exit 1; }
NP=$((NUM_NODES * GPUS_PER_NODE))
source scripts/gpt2_124M_flags.sh
source scripts/forward_stop.sh
read -r -a mpi_args <<< "$MPI_ARGS"

# export PATH, LD_LIBRARY_PATH and every NCCL_* that is set to the remote ranks
exports=(-x PATH)
[ -n "${LD_LIBRARY_PATH:-}" ] && exports+=(-x LD_LIBRARY_PATH)
for var in $(compgen -e); do
    case "$var" in NCCL_*) exports+=(-x "$var") ;; esac
done

mkdir -p "$OUT_DIR"
set -x
launch_forwarding_stop "$MPIRUN" -np "$NP" \
    --mca odls_base_sigkill_timeout "$KILL_DELAY" \
    --hostfile "$HOSTFILE" \
    --map-by "ppr:$GPUS_PER_NODE:node" \
    --bind-to none \
    "${exports[@]}" \
    "${mpi_args[@]}" \
    ./train_gpt "${TRAIN_GPT_ARGS[@]}"

#!/usr/bin/env bash
# Checkpoint save and load times per rank, on the CPU under mpirun: GPT-2 124M (d12) on 1, 2 and 4 ranks.
#
# For each world size N it trains one step of d12 (-b 1 -t 64, ZeRO-1, so every rank keeps 1/N of the moments)
# with a checkpoint, then resumes from it on the same N ranks for one more step, and prints what train_gpt says:
# the save time (the fastest and the slowest rank), the verification and read times of the resume, and the
# bytes each rank wrote. The checkpoint is written to BENCH_TMP (a fresh directory under /tmp by default); the
# page cache holds it when it is read back, so the read times are those of memory-speed storage.
#
# Usage: bash dev/bench/checkpoint_bench.sh        (RANKS="1 2 4" by default; TRAIN_GPT=./train_gpt)
# Needs mpirun (OpenMPI) and about 3 GiB of memory per rank.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=${RANKS:-"1 2 4"}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
DATA=${DATA:-data/sotu}
TMP=${BENCH_TMP:-$(mktemp -d /tmp/llm5d_ckpt_bench.XXXXXX)}
[ -f "$DATA/train.bin" ] || make data
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
echo "machine: $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed "s/^ //"), $(nproc --all) cores; $(date -u +%F)"
echo "llm5d $(git rev-parse --short HEAD 2>/dev/null || echo '?'); d12, -b 1 -t 64, ZeRO-1"
for n in $RANKS; do
    out="$TMP/ranks$n"
    rm -rf "$out"
    flags="-e d12 -i $DATA/train.bin -j $DATA/val.bin -b 1 -t 64 -d $((64 * n)) -z 1 -v 0 -s 0 -n 1 -o $out"
    mpirun --oversubscribe --bind-to none -np "$n" "$TRAIN_GPT" $flags -x 1 > "$out.save.log" 2>&1 ||
        { cat "$out.save.log"; exit 1; }
    mpirun --oversubscribe --bind-to none -np "$n" "$TRAIN_GPT" $flags -x 2 -y 1 > "$out.load.log" 2>&1 ||
        { cat "$out.load.log"; exit 1; }
    saved=$(grep -m1 "ckpt_00000001 written in" "$out.save.log" | sed 's/.*written in //')
    loaded=$(grep -m1 "^checkpoint verified in" "$out.load.log" | sed 's/^checkpoint //')
    largest=$(ls -l "$out/ckpt_00000001"/optimizer_rank*.bin | awk '{ if ($5 > m) m = $5 } END { printf "%.0f", m / 1048576 }')
    model=$(ls -l "$out/ckpt_00000001/model.bin" | awk '{ printf "%.0f", $5 / 1048576 }')
    echo "$n rank(s): save $saved (rank 0 writes model.bin, $model MiB; the largest optimizer file $largest MiB); resume: $loaded"
done
[ -n "${BENCH_TMP:-}" ] || rm -rf "$TMP"

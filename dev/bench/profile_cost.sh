#!/usr/bin/env bash
# What --profile costs the step it records: RUNS runs of one model with --profile-step 6 of 12 steps, each run's
# profiled step against the median of its other steps after the first two (the same run, so the same machine
# state), and the median ratio over the runs. The other steps' cost (each hook's one test of a flag) is measured
# apart, against a build without the profiler, as whole runs side by side.
#
# Usage (from anywhere):  bash dev/bench/profile_cost.sh [TRAIN_GPT flags...]
#   default flags: --device cpu -e d4c128h4 -b 8 -t 128 (the CPU demo's model and batch)
# Environment: RUNS [6], TRAIN_GPT [./train_gpt], and the SOTU data (make data).
set -euo pipefail
cd "$(dirname "$0")/../.."

RUNS=${RUNS:-6}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
[[ -x $TRAIN_GPT ]] || { echo "profile_cost: $TRAIN_GPT not built (make train_gpt)" >&2; exit 1; }
[[ -f data/sotu/train.bin ]] || { echo "profile_cost: the SOTU data is missing (make data)" >&2; exit 1; }
FLAGS=("$@")
((${#FLAGS[@]})) || FLAGS=(--device cpu -e d4c128h4 -b 8 -t 128)
TMP=$(mktemp -d /tmp/llm5d_profile_cost.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

echo "$TRAIN_GPT ${FLAGS[*]} -x 12 -v 0 -s 0 --profile FILE --profile-step 6; $RUNS runs; $(date -u '+%F %H:%M UTC')"
for ((i = 1; i <= RUNS; i++)); do
    "$TRAIN_GPT" "${FLAGS[@]}" -x 12 -v 0 -s 0 --profile "$TMP/p.json" --profile-step 6 >"$TMP/run$i.log" 2>&1 ||
        { tail -n 20 "$TMP/run$i.log" >&2; exit 1; }
    awk '/^step +[0-9]+\/[0-9]+ \|/ { split($2, s, "/"); for (i = 2; i <= NF; i++) if ($i == "ms") ms = $(i - 1)
         if (s[1] == 6) profiled = ms; else if (s[1] > 2) other[++n] = ms }
         END { asort(other); m = n % 2 ? other[(n + 1) / 2] : (other[n / 2] + other[n / 2 + 1]) / 2
               printf "run %d: profiled step %.1f ms, the others median %.1f ms: %.4f\n", run, profiled, m, profiled / m }' \
        run="$i" "$TMP/run$i.log"
done | tee "$TMP/ratios"
awk '{ r[NR] = $NF } END { asort(r); printf "median ratio over %d runs: %.4f\n", NR, NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2 }' "$TMP/ratios"

#!/usr/bin/env bash
# What --profile costs the step it records: RUNS runs of one model with --profile-step 6 of 12 steps, each run's
# profiled step against the median of its other steps after the first two (the same run, so the same machine
# state), and the median ratio over the runs; and the profiler's own bookkeeping, which it times itself
# ("profiler_ms" in the file), as a share of the step: the ratio moves by a few percent from run to run on a
# shared machine, the bookkeeping's share is the cost itself. The other steps' cost (each hook's one test of a
# flag) is measured apart, against a build without the profiler, as whole runs side by side.
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
    "$TRAIN_GPT" "${FLAGS[@]}" -x 12 -v 0 -s 0 --profile "$TMP/p$i.json" --profile-step 6 >"$TMP/run$i.log" 2>&1 ||
        { tail -n 20 "$TMP/run$i.log" >&2; exit 1; }
done
python3 - "$TMP" "$RUNS" <<'EOF'
import json, re, statistics, sys

tmp, runs = sys.argv[1], int(sys.argv[2])
ratios, shares = [], []
for i in range(1, runs + 1):
    ms = {int(m.group(1)): float(m.group(2)) for m in
          (re.match(r"^step +(\d+)/\d+ .*\| ([0-9.]+) ms \|", line) for line in open(f"{tmp}/run{i}.log")) if m}
    others = statistics.median(v for s, v in ms.items() if s > 2 and s != 6)
    profile = json.load(open(f"{tmp}/p{i}.json"))
    ratios.append(ms[6] / others)
    shares.append(profile["profiler_ms"] / profile["step_ms"])
    print(f"run {i}: profiled step {ms[6]:.1f} ms, the others' median {others:.1f} ms: {ratios[-1]:.4f}; "
          f"the profiler's own bookkeeping {profile['profiler_ms']:.3f} ms ({100 * shares[-1]:.3f}%)")
print(f"median ratio over {runs} runs: {statistics.median(ratios):.4f}; "
      f"the profiler's own bookkeeping: median {100 * statistics.median(shares):.3f}% of the profiled step")
EOF

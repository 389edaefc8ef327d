#!/usr/bin/env bash
# The FP8 recipes against fp32 on the CPU (emulated), 200 steps on the State of the Union: for a GPT-2 and a Llama
# whose matmuls are whole 128-tiles (so blockwise and mxfp8 both engage), each recipe's validation losses and the
# largest relative difference of its 20-step windowed mean training loss from fp32's. Two runs at a time, one
# OpenMP thread each. Usage: bash dev/bench/fp8_recipes.sh [OUT_DIR]   (needs ./train_gpt and `make data`)
set -euo pipefail
out=${1:-/tmp/fp8_recipes}
mkdir -p "$out"
models=(d4c128h4t64 l4c128h4g2f384t64)
recipes=(fp32 tensorwise blockwise mxfp8)
flags="-b 4 -t 64 -x 200 -v 50 -m 4 -s 0 -l 1e-3 -u 10 --device cpu -i data/sotu/train.bin -j data/sotu/val.bin"
run() {  # model recipe
    local extra=""
    [[ $2 == fp32 ]] || extra="--fp8 1 --fp8-recipe $2"
    rm -rf "$out/$1_$2"
    OMP_NUM_THREADS=1 ./train_gpt -e "$1" $flags $extra -o "$out/$1_$2" >"$out/$1_$2.out" 2>&1
}
jobs_list=()
for m in "${models[@]}"; do for r in "${recipes[@]}"; do jobs_list+=("$m $r"); done; done
for ((i = 0; i < ${#jobs_list[@]}; i += 2)); do
    run ${jobs_list[i]} &
    [[ -n ${jobs_list[i + 1]:-} ]] && run ${jobs_list[i + 1]}
    wait
done
python3 - "$out" "${models[@]}" <<'PY'
import re, sys
out, models = sys.argv[1], sys.argv[2:]
recipes = ["fp32", "tensorwise", "blockwise", "mxfp8"]
def read(path):
    train, val, ms = {}, {}, []
    for line in open(path + "/main.log"):
        s = int(re.search(r"s:(\d+)", line).group(1))
        m = re.search(r"trl:([-\d.e+]+)", line)
        if m: train[s] = float(m.group(1))
        m = re.search(r"tel:([-\d.e+]+)", line)
        if m: val[s] = float(m.group(1))
    for line in open(path + ".out"):
        m = re.search(r"\| ([\d.]+) ms \|", line)
        if m: ms.append(float(m.group(1)))
    return train, val, sorted(ms)[len(ms) // 2] if ms else float("nan")
W = 20
print("| model | recipe | val loss at 0 / 50 / 100 / 150 / 200 | largest difference of %d-step mean train losses from fp32 | ms/step (median) |" % W)
print("|---|---|---|---|---|")
for m in models:
    base, _, _ = read("%s/%s_fp32" % (out, m))
    for r in recipes:
        train, val, ms = read("%s/%s_%s" % (out, m, r))
        worst = 0.0
        for w0 in range(0, 200, W):
            a = [base[s] for s in range(w0, w0 + W) if s in base]; b = [train[s] for s in range(w0, w0 + W) if s in train]
            if a and b: worst = max(worst, abs(sum(b) / len(b) - sum(a) / len(a)) / (sum(a) / len(a)))
        vals = " / ".join("%.4f" % val[s] for s in sorted(val))
        print("| %s | %s | %s | %s | %.1f |" % (m, r, vals, "-" if r == "fp32" else "%.2f%%" % (100 * worst), ms))
PY

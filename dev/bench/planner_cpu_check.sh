#!/usr/bin/env bash
# The step-time model against the clock: for a dozen layouts of one small model (d4c64h4, 64-token sequences)
# on 1 or 2 CPU ranks under mpirun, it compares the step time `--plan --world N --hardware FILE` predicts with
# the median step time a real run measures, and prints each layout's relative error, the Spearman rank
# correlation over the layouts and the median |error|. The rank correlation says whether the model orders
# layouts as the machine does (what choosing a layout needs); the median error, how far its absolute figures
# are off on this machine with this hardware profile. Each run also profiles its third step (--profile), and a
# second table puts that step's measured components (compute, exposed communication, bubble, optimizer) beside
# the prediction's.
#
# Usage (from anywhere):  bash dev/bench/planner_cpu_check.sh [HARDWARE_FILE] [--markdown FILE]
#   HARDWARE_FILE     the hardware profile the prediction uses               [dev/hardware/cpu.txt]
#   --markdown FILE   also write the table (and the two summary lines) to FILE as Markdown
#
# Environment variables (all optional):
#   STEPS       training steps per run; the median is taken over the steps after the first two      [8]
#   LAYOUTS     names of the layouts to run (see the list below), space-separated               [all of them]
#   PREDICT=0   measure only: no --plan runs, no hardware file needed, no correlation or error
#   TRAIN_GPT   the binary                                                                   [./train_gpt]
#   BENCH_TMP   scratch directory for the logs; kept if given, else a fresh one under /tmp removed at exit
#
# Every rank runs with OMP_NUM_THREADS=1, launched as the tests launch (test/mpi_helpers.h), so a 2-rank layout
# uses the machine's 2 cores one each. Needs mpirun (OpenMPI), python3, and the SOTU data (make data).
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "planner_cpu_check: $*" >&2; exit 1; }

HARDWARE=dev/hardware/cpu.txt
MARKDOWN=""
have_hw=0
while (($#)); do
    case $1 in
        --markdown) (($# >= 2)) || die "--markdown needs a file name"; MARKDOWN=$2; shift 2 ;;
        --markdown=*) MARKDOWN=${1#--markdown=}; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option '$1' (usage: $0 [HARDWARE_FILE] [--markdown FILE])" ;;
        *) ((have_hw == 0)) || die "one hardware file only (got '$HARDWARE' and '$1')"; HARDWARE=$1; have_hw=1; shift ;;
    esac
done

STEPS=${STEPS:-8}
PREDICT=${PREDICT:-1}
TRAIN_GPT=${TRAIN_GPT:-./train_gpt}
[[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 3 ]] || die "STEPS must be an integer >= 3 (got '$STEPS')"
[[ -x $TRAIN_GPT ]] || die "$TRAIN_GPT not found or not executable (build it with make train_gpt)"
[[ -f data/sotu/train.bin && -f data/sotu/val.bin ]] || die "SOTU data missing (data/sotu/*.bin): run make data"
command -v mpirun >/dev/null || die "mpirun not found"
command -v python3 >/dev/null || die "python3 not found"
[[ $PREDICT == 0 || -f $HARDWARE ]] || die "hardware profile '$HARDWARE' not found (or PREDICT=0 to measure only)"

# the model and micro-batch every layout shares: one rank takes ~150 ms a step on one core of a small machine
MODEL=(-e d4c64h4 -b 1 -t 64)
MOE_MODEL=(-e d4c64h4e4k2 -b 1 -t 64)
ACC=$((4 * 64))  # -d of the layouts with 4 micro-batches (pipelines, gradient accumulation)

# name | ranks | flags (after the model's)
ALL_LAYOUTS=(
    "single|1|"
    "dp2-z0|2|-z 0"
    "dp2-z1|2|-z 1"
    "dp2-z2|2|-z 2"
    "dp2-z3|2|-z 3"
    "tp2-sp|2|--tp 2 --sp 1"
    "tp2-nosp|2|--tp 2 --sp 0"
    "cp2|2|--cp 2"
    "pp2-afab|2|--pp 2 --pp-schedule afab -d $ACC"
    "pp2-1f1b|2|--pp 2 --pp-schedule 1f1b -d $ACC"
    "pp2-zb|2|--pp 2 --pp-schedule zb -d $ACC"
    "pp2-vpp2|2|--pp 2 --pp-schedule interleaved --vpp 2 -d $ACC"
    "accum4|1|-d $ACC"
    "dp2-z2-accum4|2|-z 2 -d $((2 * ACC))"
    "recompute2|1|-r 2"
    "moe-ep2|2|moe --ep 2"
)

SELECTED=()
for entry in "${ALL_LAYOUTS[@]}"; do
    name=${entry%%|*}
    if [[ -z ${LAYOUTS:-} || " $LAYOUTS " == *" $name "* ]]; then SELECTED+=("$entry"); fi
done
for want in ${LAYOUTS:-}; do
    known=0
    for entry in "${ALL_LAYOUTS[@]}"; do [[ ${entry%%|*} == "$want" ]] && known=1; done
    ((known)) || die "LAYOUTS: unknown layout '$want'"
done
((${#SELECTED[@]} > 0)) || die "no layout selected"

if [[ -n ${BENCH_TMP:-} ]]; then
    TMP=$BENCH_TMP
    mkdir -p "$TMP"
else
    TMP=$(mktemp -d /tmp/llm5d_planner_check.XXXXXX)
    trap 'rm -rf "$TMP"' EXIT
fi

echo "machine: $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed "s/^ //"), $(nproc) cores usable;" \
    "load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC')"
echo "llm5d $(git rev-parse --short HEAD 2>/dev/null || echo '?'); ${MODEL[*]}; $STEPS steps a run, the median of" \
    "steps 3..$STEPS; hardware profile: $([[ $PREDICT == 0 ]] && echo 'none (PREDICT=0)' || echo "$HARDWARE")"

# as test/mpi_helpers.h: every rank single-threaded and polite, the ranks sharing the cores
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
    OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

# layout_flags ENTRY: the trainer's flags of a layout (its model's, then its own)
layout_flags() {
    local rest=${1#*|}
    rest=${rest#*|}
    if [[ $rest == moe* ]]; then rest="${MOE_MODEL[*]}${rest#moe}"; else rest="${MODEL[*]} $rest"; fi
    echo "${rest% }"
}

# the median of the step times after the first two, from a run's output ("step     3/8 | ... | 12.3 ms | ...")
measured_ms() {
    awk '/^step +[0-9]+\/[0-9]+ \|/ { n++; for (i = 2; i <= NF; i++) if ($i == "ms") ms = $(i - 1);
         if (n > 2) print ms }' "$1" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) exit 1
             if (NR % 2) printf "%.1f\n", v[(NR + 1) / 2]; else printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# the first number of "predicted step: 123.456 ms, ..."
predicted_ms() {
    sed -n 's/^.*predicted step: *\([0-9.eE+-]*\) *ms.*$/\1/p' "$1" | head -n 1
}

# predictions first: they take a second each, and a trainer without the step-time model fails here, not after
# minutes of measuring
declare -A PRED
if [[ $PREDICT != 0 ]]; then
    for entry in "${SELECTED[@]}"; do
        IFS='|' read -r name np _ <<<"$entry"
        flags=$(layout_flags "$entry")
        log=$TMP/$name.plan.log
        # shellcheck disable=SC2086  # the flag lists are meant to split
        if ! timeout 120 "$TRAIN_GPT" $flags --device cpu -v 0 -s 0 --plan --world "$np" --hardware "$HARDWARE" \
            >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            die "$name: '$TRAIN_GPT $flags --device cpu -v 0 -s 0 --plan --world $np --hardware $HARDWARE' failed" \
                "(output above; a trainer without the step-time model refuses --hardware)"
        fi
        PRED[$name]=$(predicted_ms "$log")
        if [[ -z ${PRED[$name]} ]]; then
            tail -n 20 "$log" >&2
            die "$name: --plan printed no 'predicted step: X ms, ...' line (output above); does this train_gpt" \
                "have the step-time model?"
        fi
    done
fi

declare -A MEAS
for entry in "${SELECTED[@]}"; do
    IFS='|' read -r name np _ <<<"$entry"
    flags=$(layout_flags "$entry")
    log=$TMP/$name.run.log
    profile=()
    [[ $PREDICT != 0 ]] && profile=(--profile "$TMP/$name.profile.json" --hardware "$HARDWARE")
    echo "-- $name: mpirun -np $np $TRAIN_GPT $flags --device cpu -v 0 -s 0 -x $STEPS ${profile[*]}"
    # shellcheck disable=SC2086
    if ! timeout 600 mpirun --oversubscribe --bind-to none -np "$np" "$TRAIN_GPT" $flags --device cpu -v 0 -s 0 \
        -x "$STEPS" "${profile[@]}" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "$name: the run failed (output above)"
    fi
    MEAS[$name]=$(measured_ms "$log") || { tail -n 20 "$log" >&2; die "$name: the run printed fewer than 3 steps"; }
    echo "   ${MEAS[$name]} ms${PRED[$name]:+ (predicted ${PRED[$name]} ms)}"
done

# the table and the statistics: one row per layout, "name<TAB>ranks<TAB>flags<TAB>measured<TAB>predicted<TAB>profile"
rows=$TMP/rows.tsv
: >"$rows"
for entry in "${SELECTED[@]}"; do
    IFS='|' read -r name np _ <<<"$entry"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$np" "-np $np $(layout_flags "$entry")" "${MEAS[$name]}" \
        "${PRED[$name]:--}" "$TMP/$name.profile.json" >>"$rows"
done

echo
python3 - "$rows" "$MARKDOWN" <<'EOF'
import json, os, statistics, sys

sys.path.insert(0, os.path.join(os.getcwd(), "dev/bench"))
from rank_correlation import spearman

rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
markdown = sys.argv[2]

table, meas, pred, errs = [], [], [], []
for name, np_, flags, m, p, _ in rows:
    m = float(m)
    if p == "-":
        table.append((name, flags, f"{m:.1f}", "-", "-"))
        continue
    p = float(p)
    e = (p - m) / m * 100
    meas.append(m), pred.append(p), errs.append(abs(e))
    table.append((name, flags, f"{m:.1f}", f"{p:.1f}", f"{e:+.1f}"))

head = ("layout", "command flags", "measured ms", "predicted ms", "error %")
w = [max(len(r[i]) for r in table + [head]) for i in range(5)]
fmt = lambda r: " | ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r))
lines = [fmt(head), "-+-".join("-" * x for x in w)] + [fmt(r) for r in table]
if len(meas) >= 2:
    summary = [f"Spearman rank correlation: {spearman(meas, pred):.3f}",
               f"median |error|: {statistics.median(errs):.1f}%"]
elif meas:
    summary = ["Spearman rank correlation: n/a (one layout)", f"median |error|: {statistics.median(errs):.1f}%"]
else:
    summary = ["Spearman rank correlation: n/a (no predictions)", "median |error|: n/a (no predictions)"]
print("\n".join(lines + [""] + summary))

# the profiled step's components against predicted, in ms: the measured ones of the rank with the most compute,
# as the prediction's are its critical stage's (a pipeline's ranks differ; the others' lines are alike)
PARTS = ["compute", "dp", "tp", "cp", "pp", "ep", "bubble", "optimizer"]
parts_head = ("layout", "step ms") + tuple(PARTS) + ("other",)
parts_rows = []
for name, np_, flags, m, p, path in rows:
    if not os.path.exists(path):
        continue
    prof = json.load(open(path))
    critical = max(prof.get("ranks", [prof]), key=lambda r: r["components"]["measured"]["compute"])
    meas_c, pred_c = critical["components"]["measured"], prof["components"]["predicted"] or {}
    cell = lambda k: f"{meas_c[k]:.1f} / {pred_c.get(k, 0.0):.1f}"
    parts_rows.append((name, f"{prof['step_ms']:.1f} / {pred_c.get('step', 0.0):.1f}") + tuple(cell(k) for k in PARTS)
                      + (f"{meas_c['other']:.1f}",))
if parts_rows:
    pw = [max(len(r[i]) for r in parts_rows + [parts_head]) for i in range(len(parts_head))]
    pfmt = lambda r: " | ".join(c.ljust(pw[i]) if i == 0 else c.rjust(pw[i]) for i, c in enumerate(r))
    print("\nthe profiled step (--profile, step 3): measured / predicted ms, the busiest rank's")
    print("\n".join([pfmt(parts_head), "-+-".join("-" * x for x in pw)] + [pfmt(r) for r in parts_rows]))

if markdown:
    with open(markdown, "w") as f:
        f.write("| " + " | ".join(head) + " |\n|---|---|--:|--:|--:|\n")
        for r in table:
            f.write(f"| {r[0]} | `{r[1]}` | {r[2]} | {r[3]} | {r[4]} |\n")
        f.write("\n" + "\n\n".join(summary) + "\n")
        if parts_rows:
            f.write("\nThe profiled step (`--profile`, step 3), measured / predicted ms, on the rank with the most compute:\n\n")
            f.write("| " + " | ".join(parts_head) + " |\n|---|" + "--:|" * (len(parts_head) - 1) + "\n")
            for r in parts_rows:
                f.write("| " + " | ".join(r) + " |\n")
    print(f"\nMarkdown written to {markdown}")
EOF

#!/usr/bin/env bash
# Runs every test suite and prints, as the last line, "N passed, M failed, K skipped" over all of them: Catch2
# test cases (build/tests) and the data-preparation checks (dev/data/test.js). A skipped case is one that could not
# run here (no GPU, not a Hopper, an npm package missing): it writes its name to the file TEST_SKIP_LOG names
# (test/test_helpers.h's skip_case), and counts as skipped, not passed. Before it, the ten slowest test cases, so
# that a test that grows past what it proves is seen where it is added. `make test` builds what this needs first.
#
# The suite runs in shards side by side, a shard a process: one case after another leaves cores idle (the cases wait
# on the processes they start, train_gpt, mpirun and Python, most of which run on one core; one after another the
# suite kept 1.0 of 2 cores busy on average). A case that takes long is a shard of its own; the short ones are packed
# into shards of about BATCH_SECONDS. Shards start longest first (one that must run alone before all), each when
# the cores it needs are free out of TEST_JOBS: a core for each process one of its cases runs at once, up to the machine's cores (an mpirun of 4 ranks
# needs 4 where there are 4 cores, and both of a 2-core machine's); test/slow_cases.txt lists the slow cases' seconds
# and processes, and names the case that must run with no shard beside it. TEST_JOBS is four times the cores: an
# mpirun's ranks wait for its launch and for each other more than they compute (the dp, tp, cp and pp cases on 2
# cores: 53 and 62 s at 8, 70 s at 6, 72 and 78 s at 4, with 12% more CPU-seconds at 8). Each shard has its own
# scratch directory (TMPDIR, under which the tests' TempDir, OpenMPI's session directory and Python's temporary
# files go), its own log, build/test_logs/NN.log, and its own list of skipped cases, build/test_logs/NN.skips; a
# shard that failed is printed whole, with the command that runs it again alone. The [cuda] cases are one shard, so
# that they take turns on the GPU.
#
#   bash test/run_tests.sh [TEST_SPEC...]   only the cases a Catch2 test spec selects ("[tp]", a case's name)
#   TEST_JOBS=N                             cores' worth of shards at once [four times the cores]
set -u
cd "$(dirname "$0")/.."

CORES=$(nproc)
TEST_JOBS=${TEST_JOBS:-$((4 * CORES))}
BATCH_SECONDS=8  # a shard of short cases: long enough that its process's start is lost in it
DEFAULT_SECONDS=0.5  # a case in neither table below
LOGS=build/test_logs
LAST_DURATIONS=build/test_durations.txt  # every case's seconds in the last run, which orders the next one
# OpenMP's threads sleep when they wait rather than spin: the shards share the cores, and a thread spinning at a
# barrier while its partner waits for a core burns what another shard needs ([layers] alone beside the rest of the
# suite: 9 to 44 s spinning, 0.8 s sleeping). The train_gpt runs the tests start inherit it.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
start_time=$SECONDS

# The cases: Catch2's names, one a line. The CPU cases run with the GPUs hidden, so that the train_gpt runs they
# start take the CPU as their default device on a GPU host too; the [cuda] cases (which say "skipped: no GPU"
# where there is none) with them visible.
all_cases=$(build/tests --list-test-names-only "$@")
if [ -z "$all_cases" ]; then
    echo "build/tests: no test case matches $*"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi
cuda_cases=$(build/tests --list-test-names-only "[cuda]")
cpu_cases=$(grep -vxF -f <(printf '%s\n' "$cuda_cases") <<<"$all_cases")
cuda_cases=$(grep -xF -f <(printf '%s\n' "$cuda_cases") <<<"$all_cases")

# Each case's seconds (the last run's where there is one, else test/slow_cases.txt's, else DEFAULT_SECONDS) and
# processes at once (slow_cases.txt's, else 1), as "SECONDS<TAB>PROCESSES<TAB>NAME", longest first.
costed() {
    awk -F'\t' -v default="$DEFAULT_SECONDS" '
        FILENAME == ARGV[1] { if ($0 !~ /^#/ && NF == 3) { seconds[$3] = $1; processes[$3] = $2 } next }
        FILENAME == ARGV[2] { if (NF == 2) seconds[$2] = $1; next }
        $0 != "" { printf "%s\t%s\t%s\n", ($0 in seconds) ? seconds[$0] : default, ($0 in processes) ? processes[$0] : 1, $0 }
    ' test/slow_cases.txt <(cat "$LAST_DURATIONS" 2>/dev/null) - | sort -t$'\t' -k1,1gr
}

# The shards: NN.cases (Catch2's -f file: one name a line, its commas and backslashes escaped), and in the
# arrays its kind (cpu, cuda, node), seconds, cores and number of cases. A case's processes take as many cores
# as there are (the 4 ranks of an mpirun share 2 cores on a 2-core machine), and at most TEST_JOBS.
rm -rf "$LOGS"
mkdir -p "$LOGS"
shards=0
declare -a shard_seconds shard_cores shard_count shard_kind
cores_of() {  # PROCESSES
    local n=$1
    [ "$n" = all ] && n=$TEST_JOBS || n=$((n < CORES ? n : CORES))
    echo $((n < TEST_JOBS ? n : TEST_JOBS))
}
new_shard() {  # KIND SECONDS CORES
    shards=$((shards + 1))
    shard_kind[$shards]=$1
    shard_seconds[$shards]=$2
    shard_cores[$shards]=$3
    shard_count[$shards]=0
    : >"$(printf '%s/%02d.cases' "$LOGS" "$shards")"
}
add_case() {  # SHARD NAME
    local escaped=${2//\\/\\\\}
    printf '%s\n' "${escaped//,/\\,}" >>"$(printf '%s/%02d.cases' "$LOGS" "$1")"
    shard_count[$1]=$((shard_count[$1] + 1))
}
open=0  # the CPU shard of short cases being filled
while IFS=$'\t' read -r seconds processes name; do
    cores=$(cores_of "$processes")
    if awk -v s="$seconds" -v b="$BATCH_SECONDS" 'BEGIN { exit !(s >= b) }'; then
        new_shard cpu "$seconds" "$cores"
        add_case $shards "$name"
        continue
    fi
    if [ $open -eq 0 ]; then
        new_shard cpu 0 1
        open=$shards
    fi
    add_case $open "$name"
    shard_seconds[$open]=$(awk -v a="${shard_seconds[$open]}" -v s="$seconds" 'BEGIN { print a + s }')
    [ "$cores" -gt "${shard_cores[$open]}" ] && shard_cores[$open]=$cores
    awk -v a="${shard_seconds[$open]}" -v b="$BATCH_SECONDS" 'BEGIN { exit !(a >= b) }' && open=0
done < <(costed <<<"$cpu_cases")
cuda_count=$(grep -c . <<<"$cuda_cases")
if [ "$cuda_count" -gt 0 ]; then
    new_shard cuda "$(costed <<<"$cuda_cases" | awk -F'\t' '{ s += $1 } END { print s }')" 1
    while IFS= read -r name; do add_case $shards "$name"; done <<<"$cuda_cases"
fi
node_shard=0
if [ $# -eq 0 ]; then  # the whole suite: the data-preparation checks too, as a shard of their own
    new_shard node "$(costed <<<"dev/data/test.js" | cut -f1)" 1
    node_shard=$shards
fi

# The order the shards start in: a shard that must run alone first, on the empty machine (queued behind another,
# it would hold back every shard after it for as long as that one runs), then longest first.
order=$(for ((i = 1; i <= shards; i++)); do
    printf '%d %s %d\n' "$((shard_cores[i] >= TEST_JOBS))" "${shard_seconds[$i]}" "$i"
done | sort -k1,1nr -k2,2gr | cut -d' ' -f3)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/llm5d_tests.XXXXXX")
declare -A running  # pid -> shard
declare -a shard_started shard_took
trap 'for pid in "${!running[@]}"; do kill "$pid" 2>/dev/null; done; rm -rf "$scratch"' EXIT

# the command line that runs shard $1 alone, as it ran here
shard_command() {
    local cases
    cases=$(printf '%s/%02d.cases' "$LOGS" "$1")
    case ${shard_kind[$1]} in
        cpu) echo "CUDA_VISIBLE_DEVICES= build/tests -f $cases --durations yes" ;;
        cuda) echo "build/tests -f $cases --durations yes" ;;
        node) echo "node dev/data/test.js" ;;
    esac
}
start_shard() {
    local dir log
    dir=$(printf '%s/%02d' "$scratch" "$1")
    log=$(printf '%s/%02d.log' "$LOGS" "$1")
    mkdir -p "$dir"
    shard_started[$1]=$EPOCHREALTIME
    TMPDIR=$dir TEST_SKIP_LOG=$(printf '%s/%02d.skips' "$LOGS" "$1") bash -c "$(shard_command "$1")" >"$log" 2>&1 &
    running[$!]=$1
}

passed=0
failed=0
skipped=0
# Counts shard $1's results from its log: Catch2's summary line (which must count every case the shard was
# given), or node's last line, "N passed, M failed"; of Catch2's passed cases, those that said they skipped (once
# for each of their sections) are counted as skipped. Prints the log whole when something failed, else only what
# the tests said besides their durations and the summary.
count_shard() {
    local log summary ok=1 ran=-1 p=0 f=0 k=0 what
    log=$(printf '%s/%02d.log' "$LOGS" "$1")
    shard_took[$1]=$(awk -v a="${shard_started[$1]}" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    rm -rf "$(printf '%s/%02d' "$scratch" "$1")"
    if [ "${shard_kind[$1]}" = node ]; then
        summary=$(tail -1 "$log")
        what="dev/data/test.js"
        if [[ $summary =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
            p=${BASH_REMATCH[1]} f=${BASH_REMATCH[2]}
        else
            summary="no summary line"
            f=1
        fi
    else
        what="${shard_count[$1]} case$([ "${shard_count[$1]}" -eq 1 ] || echo s)"
        summary=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
        if [[ $summary =~ ^All\ tests\ passed.*\ in\ ([0-9]+)\ test\ case ]]; then
            ran=${BASH_REMATCH[1]} p=$ran
        elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ passed\ \|\ +([0-9]+)\ failed ]]; then
            ran=${BASH_REMATCH[1]} p=${BASH_REMATCH[2]} f=${BASH_REMATCH[3]}
        elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ passed$ ]]; then  # none asserted anything
            ran=${BASH_REMATCH[1]} p=${BASH_REMATCH[2]}
        elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ failed ]]; then
            ran=${BASH_REMATCH[1]} f=${BASH_REMATCH[2]}
        else
            summary="no summary line (crashed?)"
            f=1
        fi
        if [ "$ran" -ge 0 ] && [ "$ran" -ne "${shard_count[$1]}" ]; then
            summary="$summary; ${shard_count[$1]} cases given, $ran ran"
            f=$((f + 1))
        fi
        local skips
        skips=$(printf '%s/%02d.skips' "$LOGS" "$1")
        if [ -s "$skips" ]; then
            k=$(sort -u "$skips" | grep -c .)
            k=$((k < p ? k : p))  # a case that skipped and failed counts as failed
            p=$((p - k))
            summary="$summary; $k skipped"
        fi
    fi
    passed=$((passed + p))
    failed=$((failed + f))
    skipped=$((skipped + k))
    [ "$f" -eq 0 ] || ok=0
    if [ $ok -eq 1 ]; then
        printf 'shard %02d passed in %s s: %s, %s\n' "$1" "${shard_took[$1]}" "$what" "$summary"
        grep -vE '^([0-9]+\.[0-9]+ s: |={20,}$|All tests passed|[0-9]+ passed, [0-9]+ failed$|Filters: )' "$log" | grep -v '^$'
    else
        printf '\nshard %02d FAILED in %s s: %s, %s\n' "$1" "${shard_took[$1]}" "$what" "$summary"
        printf 'run it alone: %s\n' "$(shard_command "$1")"
        grep -vE '^[0-9]+\.[0-9]+ s: ' "$log"
        echo
    fi
}

echo "$(grep -c . <<<"$cpu_cases") CPU cases, $cuda_count CUDA cases$([ $node_shard -gt 0 ] && echo " and dev/data/test.js") in" \
    "$shards shards, $TEST_JOBS cores' worth at once on $CORES cores; logs in $LOGS"
free=$TEST_JOBS
pending=($order)
while [ ${#pending[@]} -gt 0 ] || [ ${#running[@]} -gt 0 ]; do
    # the next shard in order starts when its cores are free; one that needs them all waits for an empty machine
    while [ ${#pending[@]} -gt 0 ] && [ "${shard_cores[${pending[0]}]}" -le $free ]; do
        start_shard "${pending[0]}"
        free=$((free - shard_cores[${pending[0]}]))
        pending=("${pending[@]:1}")
    done
    wait -n -p done_pid "${!running[@]}"
    shard=${running[$done_pid]}
    unset "running[$done_pid]"
    free=$((free + shard_cores[shard]))
    count_shard "$shard"
done

# every case's duration, for the list below and the next run's order: Catch2 prints a line at the end of every
# section, the case's own among them once for each time the case runs (once per leaf section), so the lines
# that name a case are summed and the sections' own left out; the cases this run did not run keep theirs
durations=$(cat "$LOGS"/*.log | grep -E '^[0-9]+\.[0-9]+ s: ' | sed -E 's/^([0-9.]+) s: /\1\t/' |
    awk -F'\t' 'NR == FNR { is_case[$0] = 1; next }
        ($2 in is_case) { s[$2] += $1 }
        END { for (name in s) printf "%.3f\t%s\n", s[name], name }' <(printf '%s\n' "$all_cases") -)
ran=$durations
[ $node_shard -gt 0 ] && ran+=$'\n'"${shard_took[$node_shard]}"$'\t'"dev/data/test.js"
{
    printf '%s\n' "$ran"
    awk -F'\t' 'NR == FNR { ran[$2] = 1; next } !($2 in ran)' <(printf '%s\n' "$ran") "$LAST_DURATIONS" 2>/dev/null
} | grep . >"$LAST_DURATIONS.new" && mv "$LAST_DURATIONS.new" "$LAST_DURATIONS"

echo "slowest test cases:"
printf '%s\n' "$durations" | sort -t$'\t' -k1,1gr | head -n 10 | awk -F'\t' '{ printf "  %s s: %s\n", $1, $2 }'
echo "$shards shards in $((SECONDS - start_time)) s"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]

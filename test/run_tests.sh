#!/usr/bin/env bash
# Runs every test suite and prints, as the last line, "N passed, M failed" over all of them: Catch2 test cases
# (build/tests) and the data-preparation checks (dev/data/test.js). Before it, the ten slowest test cases, so
# that a test that grows past what it proves is seen where it is added. `make test` builds what this needs first.
set -u
cd "$(dirname "$0")/.."

passed=0
failed=0
durations=$(mktemp)

# Catch2: one line per test case from the console reporter's summary. The CPU suites run with the GPUs hidden,
# so that the train_gpt runs they start take the CPU as their default device on a GPU host too; the [cuda]
# cases (which say "skipped: no GPU" where there is none) run with them visible.
run_catch() {
    local catch_log summary
    catch_log=$(mktemp)
    "$@" --durations yes 2>&1 | tee "$catch_log" | grep -vE '^[0-9]+\.[0-9]+ s: '
    grep -E '^[0-9]+\.[0-9]+ s: ' "$catch_log" >>"$durations"
    summary=$(grep -E "^(All tests passed|test cases:)" "$catch_log" | tail -1)
    if [[ $summary =~ ^All\ tests\ passed.*\ in\ ([0-9]+)\ test\ case ]]; then
        passed=$((passed + BASH_REMATCH[1]))
    elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ passed\ \|\ +([0-9]+)\ failed ]]; then
        passed=$((passed + BASH_REMATCH[2]))
        failed=$((failed + BASH_REMATCH[3]))
    elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ failed ]]; then
        failed=$((failed + BASH_REMATCH[2]))
    else
        echo "build/tests: no summary line (crashed?)"
        failed=$((failed + 1))
    fi
    rm -f "$catch_log"
}
CUDA_VISIBLE_DEVICES="" run_catch build/tests "~[cuda]"
run_catch build/tests "[cuda]"

# data preparation (Node.js): its last line is "N passed, M failed"
node_log=$(mktemp)
node dev/data/test.js >"$node_log" 2>&1
cat "$node_log"
node_summary=$(tail -1 "$node_log")
rm -f "$node_log"
if [[ $node_summary =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
    passed=$((passed + BASH_REMATCH[1]))
    failed=$((failed + BASH_REMATCH[2]))
else
    echo "dev/data/test.js: no summary line"
    failed=$((failed + 1))
fi

echo "slowest test cases:"
sort -rn "$durations" | head -n 10 | sed 's/^/  /'
rm -f "$durations"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

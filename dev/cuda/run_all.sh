#!/usr/bin/env bash
# Builds and runs every kernel check in dev/cuda (the Makefile's PROGRAMS); the last line is "N passed, M failed"
# (a program that prints "skipped: no GPU" counts as passed). Each program runs under a time limit,
# PROGRAM_TIMEOUT seconds: 60 where nvidia-smi lists a GPU (each program finishes within half of it on an H100:
# dev/cuda/README.md has the estimates), 600 without one, where the programs build their inputs and CPU
# references alone on however few cores the machine has. A program past its limit is stopped and counted as
# failed, "FAIL <program>: timed out after N s", so that a hang cannot hold a GPU session.
set -u
cd "$(dirname "$0")"
if [[ -z ${PROGRAM_TIMEOUT:-} ]]; then
    PROGRAM_TIMEOUT=600
    if command -v nvidia-smi >/dev/null 2>&1 && [[ -n $(nvidia-smi --list-gpus 2>/dev/null) ]]; then PROGRAM_TIMEOUT=60; fi
fi
make || { echo "0 passed, 1 failed"; exit 1; }
read -ra programs <<<"$(sed -n 's/^PROGRAMS = //p' Makefile)"
passed=0
failed=0
for program in "${programs[@]}"; do
    echo "== $program (limit $PROGRAM_TIMEOUT s)"
    start=$SECONDS
    timeout -k 5 "$PROGRAM_TIMEOUT" ./"$program"
    rc=$?
    if (( rc == 0 )); then
        passed=$((passed + 1))
        echo "$program: $((SECONDS - start)) s"
    elif (( rc == 124 || rc == 137 )); then
        failed=$((failed + 1))
        echo "FAIL $program: timed out after $PROGRAM_TIMEOUT s"
    else
        failed=$((failed + 1))
        echo "FAIL $program: exit status $rc"
    fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# Builds and runs every kernel check in dev/cuda; the last line is "N passed, M failed" (a program that
# prints "skipped: no GPU" counts as passed).
set -u
cd "$(dirname "$0")"
make || { echo "0 passed, 1 failed"; exit 1; }
passed=0
failed=0
for program in encoder layernorm matmul attention gelu classifier adamw global_norm moe rmsnorm swiglu rope; do
    echo "== $program"
    if ./"$program"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "$program: FAILED"; fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]

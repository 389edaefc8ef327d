#!/usr/bin/env bash
# Installs what llm5d needs on Debian 12 / Ubuntu, skipping what is already there: a C++ compiler and make
# (nvcc's host compiler), Node.js and npm (data preparation), Catch2 (tests), Debian's PyTorch and NumPy (the
# reference the tests compare against), and OpenMPI (distributed runs). The CUDA toolkit is expected at
# /usr/local/cuda (or set NVCC). Runs apt-get through sudo when not root.
set -euo pipefail

missing=()
need() { dpkg -s "$1" >/dev/null 2>&1 || missing+=("$1"); }
# commands first: a Node.js from another source (NodeSource, nvm) already brings npm
command -v g++ >/dev/null || need g++
command -v make >/dev/null || need make
command -v node >/dev/null || need nodejs
command -v npm >/dev/null || need npm
need catch2
need python3-torch
need python3-numpy
need openmpi-bin
need libopenmpi-dev

if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ ! -x "$nvcc" ]; then
    echo "error: nvcc not found at $nvcc; install the CUDA toolkit (or set NVCC)" >&2
    exit 1
fi

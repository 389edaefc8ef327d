# llm5d build. nvcc compiles everything, host code included (with OpenMP), so one toolchain serves the CPU and
# the CUDA backends. Every target builds on all cores (make -jN to say otherwise), one line per program built
# (V=1 prints nvcc's command lines).
#   make            ./train_gpt
#   make train      install what is missing, prepare the SOTU data, build, train the demo model, sample, and
#                   plot its losses (build/demo/loss.png)
#   make test       install what is missing, build, run the unit, reference and CLI tests in shards side by side
#                   (test/run_tests.sh); last line "N passed, M failed, K skipped". It builds everything,
#                   ./train_gpt included, for the tests' GPU targets (TEST_CUDA_ARCH below), and with
#                   TEST_BUILD_ALSO=dev-programs the dev/cuda and dev/comm programs too, in the same make (CI)
#   make deps       only install what is missing (scripts/install_deps.sh)
#   make bench      CPU benchmark (dev/bench)
# Variables:
#   CUDA_ARCH   GPU code to embed, as nvcc -gencode flags [the visible GPUs' own, from nvidia-smi; on a machine
#               without one, train_gpt gets Ampere (sm_80) and Hopper (sm_90a: Hopper's own instructions, wgmma
#               and setmaxnreg, which --attention wgmma needs) machine code plus Hopper PTX (compute_90) that
#               newer GPUs compile when they load it, and the tests, which cannot run GPU code there, sm_90a
#               alone (nvcc.mk): so does the ./train_gpt that `make test` builds, which the next `make` builds
#               again for the portable list]; e.g. CUDA_ARCH="-gencode arch=compute_90a,code=sm_90a" for a
#               Hopper cluster built on a login node without a GPU
#   HOST_ARCH   the CPU the host code may assume, passed to -march [native: this machine]; a binary for the nodes
#               of a cluster needs one they all run, e.g. HOST_ARCH=x86-64-v3 (AVX2) or x86-64-v4 (AVX-512)
#   NO_MPI=1    build without MPI: one process only; MPICXX: the MPI compiler wrapper that says where MPI is
#   NVCC, PYTHON (an interpreter that has torch; Debian's python3-torch lives under /usr/bin/python3),
#   CATCH2_INCLUDE (where catch.hpp is)
# ./train_gpt depends on build/flags.stamp and the tests' objects on build/test_flags.stamp, which hold the flags
# they were compiled with (MPI or not, and where it is, among them): when MPI is installed later, or a variable
# above changes, the next make rebuilds them; two stamps, so that `make` after `make test` (another CUDA_ARCH
# on a machine without a GPU) rebuilds ./train_gpt alone.

NVCC ?= /usr/local/cuda/bin/nvcc
include nvcc.mk
HOST_ARCH ?= native
PYTHON ?= /usr/bin/python3
HOST_FLAGS = -O3 -march=$(HOST_ARCH) -fopenmp -Wall -Wno-unknown-pragmas
NVCC_FLAGS = -std=c++17 -O3 $(NVCC_THREADS) -Xcompiler "$(HOST_FLAGS)" -I. -diag-suppress 177
# The tests (build/tests) optimise their host code at -O1: they check what the code computes, and most of their
# time is the train_gpt runs they start, which keeps -O3. The host compiler took 129 of suite_model.o's 175
# CPU-seconds at -O3, 69 of 117 at -O1 (nvcc's -O is the host's: the kernels are as fast).
TEST_NVCC_FLAGS = $(subst -O3,-O1,$(NVCC_FLAGS))
# Catch2's main is not optimised at all: it reads the command line, runs the cases and reports, and the tests ran
# as fast against it (40 cases, 6,383 assertions); it compiled in 16 CPU-seconds instead of 23 at -O1.
CATCH_NVCC_FLAGS = $(subst -O3,-O0,$(NVCC_FLAGS))
LDLIBS = -lgomp -lnccl  # cuBLASLt is opened when first used (llmc/cuda_common.cuh)
FLAGS_STAMP = build/flags.stamp
TEST_FLAGS_STAMP = build/test_flags.stamp
# test and train install MPI before they build, in a make of their own: this one says nothing about MPI
ifneq ($(MAKECMDGOALS),)
ifeq ($(filter-out test train deps clean,$(MAKECMDGOALS)),)
MPI_QUIET = 1
endif
endif
include mpi.mk
# Debian's catch2 package puts the single header at /usr/include/catch2/catch.hpp; CATCH2_INCLUDE overrides.
CATCH2_INCLUDE ?= /usr/include/catch2
# what the installer is told, so it looks where the build will
DEPS_ENV = NVCC="$(NVCC)" PYTHON="$(PYTHON)" CATCH2_INCLUDE="$(CATCH2_INCLUDE)" MPICXX="$(MPICXX)" NO_MPI="$(NO_MPI)"

DEP_DIR = build
# The tests are two translation units, each a list of test files (test/suite_*.cu says why).
SUITES = model tools
SUITE_OBJECTS = $(patsubst %,build/suite_%.o,$(SUITES))
SUITE_MEMBERS := $(shell sed -n 's|^\#include "\(test/test_[a-z0-9_]*\.cu\)"$$|\1|p' \
    $(patsubst %,test/suite_%.cu,$(SUITES)))
UNLISTED_TESTS := $(filter-out $(SUITE_MEMBERS),$(wildcard test/test_*.cu))
ifneq ($(UNLISTED_TESTS),)
$(error $(UNLISTED_TESTS): in no test suite; include it in test/suite_model.cu (if it compiles kernels) or \
    test/suite_tools.cu)
endif

# the CPU demo: a small GPT on SOTU whose loss falls visibly within minutes on two cores; its log and plot go
# to TRAIN_OUT
TRAIN_FLAGS ?= --device cpu -e d4c128h4 -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 50 -m 8 -s 100 -g 64 -n 300
TRAIN_OUT ?= build/demo

.PHONY: all train test dev-programs bench data deps clean

all: train_gpt

train_gpt: train_gpt.cu $(call dep_file,train_gpt) $(FLAGS_STAMP)
	@mkdir -p build
	$(call say,nvcc $< -> $@ ($(ARCH_NAMES)))
	$(Q)$(NVCC) $(NVCC_FLAGS) $(CUDA_ARCH) $(DEPFLAGS) train_gpt.cu -o $@ $(LDLIBS)

build/catch_main.o: test/catch_main.cpp $(TEST_FLAGS_STAMP)
	@mkdir -p build
	$(call say,nvcc $< -> $@)
	$(Q)$(NVCC) $(CATCH_NVCC_FLAGS) $(TEST_CUDA_ARCH) -I$(CATCH2_INCLUDE) -c $< -o $@

build/suite_%.o: test/suite_%.cu $(DEP_DIR)/suite_%.o.d $(TEST_FLAGS_STAMP)
	@mkdir -p build
	$(call say,nvcc $< -> $@ ($(TEST_ARCH_NAMES)))
	$(Q)$(NVCC) $(TEST_NVCC_FLAGS) $(TEST_CUDA_ARCH) -I$(CATCH2_INCLUDE) -DLLM5D_PYTHON='"$(PYTHON)"' $(DEPFLAGS) -c $< -o $@

build/tests: $(SUITE_OBJECTS) build/catch_main.o $(TEST_FLAGS_STAMP)
	$(call say,nvcc -> $@)
	$(Q)$(NVCC) $(TEST_NVCC_FLAGS) $(TEST_CUDA_ARCH) $(filter %.o,$^) -o $@ $(LDLIBS)

$(DEP_DIR)/%.d: ;
.PRECIOUS: $(DEP_DIR)/%.d
-include $(wildcard $(DEP_DIR)/*.d)

deps:
	$(DEPS_ENV) bash scripts/install_deps.sh

dev/data/node_modules: dev/data/package.json dev/data/package-lock.json
	cd dev/data && npm ci --no-audit --no-fund
	@touch $@

data/sotu/train.bin: dev/data/node_modules dev/data/prepare.js
	node dev/data/prepare.js

data: data/sotu/train.bin

# The reference models the tests compare against, made with PyTorch: each a directory under build/ and the command
# line of the test/reference script that writes it. All of them are made in one Python process
# (test/reference/make_references.py), which imports torch, most of each script's time, once.
# A small GPT-2, and with experts (plain, with a shared expert, and DeepSeek's sigmoid scores, gate scale and
# selection bias):
REFERENCE_reference = make_reference.py
REFERENCE_reference_moe = make_reference.py --moe
REFERENCE_reference_moe_shared = make_reference.py --moe --shared 24
REFERENCE_reference_moe_deepseek = make_reference.py --moe --shared 24 --sigmoid --scale 2.5 --bias-rate 0.01
# small Llama 3 models in float64: grouped-query attention with Llama 3.1's RoPE scaling, multi-query,
# multi-head, Llama 3.2's tied classifier with its RoPE scaling, and Mixtral's experts (4 SwiGLU experts, top 2)
REFERENCE_reference_llama_gqa = make_llama_reference.py --kv 2 --rope-scaling 8
REFERENCE_reference_llama_mqa = make_llama_reference.py --kv 1
REFERENCE_reference_llama_mha = make_llama_reference.py --kv 6 --rope-scaling 8
REFERENCE_reference_llama_tied = make_llama_reference.py --kv 3 --rope-scaling 32 --tied
REFERENCE_reference_llama_moe = make_llama_reference.py --kv 2 --rope-scaling 8 --experts 4 --top-k 2
# small Qwen3 models in float64 (QK-norm, a head size of its own), each with its HF directories hf/ and hf5/:
# grouped-query attention with a classifier of its own, and multi-query with the tied classifier
REFERENCE_reference_qwen3 = make_qwen3_reference.py --kv 2
REFERENCE_reference_qwen3_tied = make_qwen3_reference.py --kv 1 --tied
# small Hugging Face mixtures of experts in float64, each its HF directory hf/ and a state (no llm.c file: the
# tests read the directory): Qwen3-MoE with the top-K gates renormalized and not, Mixtral, Qwen3-MoE with dense
# layers among the sparse ones, Qwen2-MoE, and Qwen3-MoE's aux loss over the batch
REFERENCE_reference_qwen3_moe = make_moe_reference.py --arch qwen3_moe
REFERENCE_reference_qwen3_moe_raw = make_moe_reference.py --arch qwen3_moe --unnormalized
REFERENCE_reference_mixtral = make_moe_reference.py --arch mixtral
REFERENCE_reference_qwen3_moe_mixed = make_moe_reference.py --arch qwen3_moe --layers 4 --dense-layers 1 --sparse-step 2
REFERENCE_reference_qwen2_moe = make_moe_reference.py --arch qwen2_moe --unnormalized --layers 3 --dense-layers 1
REFERENCE_reference_qwen3_moe_batch = make_moe_reference.py --arch qwen3_moe --aux-batch
REFERENCE_DIRS = reference reference_moe reference_moe_shared reference_moe_deepseek reference_llama_gqa \
    reference_llama_mqa reference_llama_mha reference_llama_tied reference_llama_moe reference_qwen3 \
    reference_qwen3_tied reference_qwen3_moe reference_qwen3_moe_raw reference_mixtral reference_qwen3_moe_mixed \
    reference_qwen2_moe reference_qwen3_moe_batch
# the file of each that the tests read first: the MoE models' state.bin (they have no llm.c file), else model.bin
REFERENCES = $(foreach d,$(REFERENCE_DIRS),build/$(d)/$(if $(filter make_moe_reference.py,$(REFERENCE_$(d))),state,model).bin)
$(REFERENCES) &: $(wildcard test/reference/*.py)
	$(PYTHON) test/reference/make_references.py $(foreach d,$(REFERENCE_DIRS),'$(REFERENCE_$(d)) --out build/$(d)')

# test and train install what is missing first, then build in a new make, which finds MPI and Catch2 as the
# installer left them. The tests' build names the longest jobs first, ./train_gpt and the model's suite (most of
# its CPU time), so that both cores start on them and the short ones fill in around them; every program is built
# for the tests' GPU targets (without a GPU: sm_90a alone, which compiles every kernel; the next plain `make`
# builds ./train_gpt again for the portable list). TEST_BUILD_ALSO names more targets for that make: CI's
# dev-programs. The tests then run in shards, as many at once as the cores take (TEST_JOBS; docs/tests.md says
# how to run one shard or one case).
TEST_BUILD = train_gpt build/suite_model.o build/tests $(REFERENCES) data/sotu/train.bin
test: deps
	$(MAKE) CUDA_ARCH='$(TEST_CUDA_ARCH)' $(TEST_BUILD) $(TEST_BUILD_ALSO)
	bash test/run_tests.sh

# dev/cuda's kernel checks and dev/comm's benchmark, for this make's GPU targets: in CI, which only compiles them
# (`make test TEST_BUILD_ALSO=dev-programs`), sm_90a alone, as the tests
dev-programs:
	$(MAKE) -C dev/cuda
	$(MAKE) -C dev/comm

train: deps
	$(MAKE) data train_gpt
	./train_gpt $(TRAIN_FLAGS) -o $(TRAIN_OUT)
	$(PYTHON) scripts/plot_log.py $(TRAIN_OUT)/main.log -o $(TRAIN_OUT)/loss.png
	@ckpt=$$(ls -d $(TRAIN_OUT)/ckpt_* 2>/dev/null | tail -n 1); [ -z "$$ckpt" ] || echo "for Hugging Face \
	(transformers, lm-evaluation-harness): ./train_gpt --convert $$ckpt --to $(TRAIN_OUT)/hf --format hf"

bench: train_gpt data
	bash dev/bench/cpu_bench.sh

clean:
	rm -rf build train_gpt

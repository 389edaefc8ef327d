# What the Makefiles that run nvcc share (the top level, dev/cuda, dev/comm): the GPU code to embed, parallel
# jobs, and short output lines.
#
# GPU code: sets CUDA_ARCH (train_gpt and the programs meant to run on a GPU) and TEST_CUDA_ARCH (the tests), as
# nvcc -gencode flags, and ARCH_NAMES / TEST_ARCH_NAMES (the targets, for the build's lines).
#
# CUDA_ARCH given (command line or environment): used for everything.
# Otherwise the GPUs nvidia-smi lists decide: machine code for each compute capability, sm_XY, with the
# arch-specific 'a' from Hopper on (sm_90a: wgmma and setmaxnreg, which --attention wgmma needs).
# Without a GPU: a binary built here is meant for GPUs elsewhere (a cluster's login node), so it gets the
# portable list, Ampere and Hopper machine code plus Hopper PTX that newer GPUs compile when they load it; the
# tests, which run no GPU code here, get one target that still compiles every kernel, wgmma included: sm_90a.
PORTABLE_CUDA_ARCH = -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a \
    -gencode arch=compute_90,code=compute_90
ONE_TARGET_CUDA_ARCH = -gencode arch=compute_90a,code=sm_90a

ifeq ($(origin CUDA_ARCH),undefined)
GPU_CUDA_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | \
    sed -nE 's/^ *([0-9]+)\.([0-9]) *$$/\1\2/p' | sort -u | \
    awk '{ sm = $$1 >= 90 ? $$1 "a" : $$1; printf "-gencode arch=compute_%s,code=sm_%s ", sm, sm }')
ifneq ($(GPU_CUDA_ARCH),)
CUDA_ARCH := $(GPU_CUDA_ARCH)
TEST_CUDA_ARCH := $(GPU_CUDA_ARCH)
else
CUDA_ARCH := $(PORTABLE_CUDA_ARCH)
TEST_CUDA_ARCH := $(ONE_TARGET_CUDA_ARCH)
endif
else
TEST_CUDA_ARCH := $(CUDA_ARCH)
endif

# nvcc compiles the GPU targets of one program side by side, a thread each: train_gpt's three take 54 s instead
# of 72 s on two cores
NVCC_THREADS = --threads 0

# nvcc writes what each program or object includes into DEP_DIR (set by the includer), and the includer reads
# those files back, so a change to a header rebuilds what includes it, and only that. A target lists its own
# dependency file as a prerequisite (dep_file), so one built without it is built again.
DEPFLAGS = -MMD -MP -MF $(DEP_DIR)/$(notdir $@).d
dep_file = $(DEP_DIR)/$(notdir $(1)).d

comma := ,
arch_names = $(patsubst code=%,%,$(filter code=%,$(subst $(comma), ,$(1))))
ARCH_NAMES = $(call arch_names,$(CUDA_ARCH))
TEST_ARCH_NAMES = $(call arch_names,$(TEST_CUDA_ARCH))

# Every core unless the command line says -jN (make -j1 builds one thing at a time); a sub-make shares its
# parent's jobs.
ifeq ($(MAKELEVEL),0)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 1)
endif

# One short line per program built; V=1 prints nvcc's whole command line instead.
ifeq ($(V),1)
Q =
say =
else
Q = @
say = @echo "  $(1)"
endif

# MPI for the Makefiles that build with it (the top level and dev/comm): found through its compiler wrapper, which
# honours the environment (e.g. a packed OpenMPI), unless NO_MPI=1; MPI_QUIET=1 leaves out the warning when there is
# none. Adds to NVCC_FLAGS and LDLIBS, then writes the compile line (NVCC_FLAGS with the GPU targets of nvcc.mk,
# which the includer includes first) to FLAGS_STAMP (a path the includer sets), and the tests' (TEST_NVCC_FLAGS,
# TEST_CUDA_ARCH) to TEST_FLAGS_STAMP where the includer sets one, each when it differs from what the stamp holds:
# targets that depend on a stamp are rebuilt when MPI appears, goes or moves, or any other of their flags changes,
# and only then.
MPICXX ?= mpicxx
ifneq ($(NO_MPI),1)
MPI_INCDIRS := $(shell $(MPICXX) --showme:incdirs 2>/dev/null)
MPI_LIBDIRS := $(shell $(MPICXX) --showme:libdirs 2>/dev/null)
ifneq ($(MPI_INCDIRS),)
NVCC_FLAGS += -DLLM5D_MPI $(addprefix -I,$(MPI_INCDIRS))
LDLIBS += $(addprefix -L,$(MPI_LIBDIRS)) $(addprefix -Xlinker -rpath -Xlinker ,$(MPI_LIBDIRS)) -lmpi
else ifneq ($(MPI_QUIET),1)
$(warning no MPI found ($(MPICXX) --showme failed): building for one process; set NO_MPI=1 to silence this)
endif
endif

# write_stamp,STAMP,TEXT: the file STAMP holds the value of the variable TEXT (a name: the flags hold commas)
define write_stamp
ifneq ($$(file < $(1)),$$($(2)))
$$(shell mkdir -p $(dir $(1)))
$$(file > $(1),$$($(2)))
endif
endef
FLAGS_STAMP_TEXT := $(NVCC) $(NVCC_FLAGS) $(CUDA_ARCH) $(LDLIBS)
$(eval $(call write_stamp,$(FLAGS_STAMP),FLAGS_STAMP_TEXT))
ifdef TEST_FLAGS_STAMP
TEST_FLAGS_STAMP_TEXT := $(NVCC) $(TEST_NVCC_FLAGS) $(TEST_CUDA_ARCH) $(LDLIBS)
$(eval $(call write_stamp,$(TEST_FLAGS_STAMP),TEST_FLAGS_STAMP_TEXT))
endif

# MPI for the Makefiles that build with it (the top level and dev/comm): found through its compiler wrapper,
# which honours the environment (e.g. a packed OpenMPI), unless NO_MPI=1. Adds to NVCC_FLAGS and LDLIBS.
MPICXX ?= mpicxx
ifneq ($(NO_MPI),1)
MPI_INCDIRS := $(shell $(MPICXX) --showme:incdirs 2>/dev/null)
MPI_LIBDIRS := $(shell $(MPICXX) --showme:libdirs 2>/dev/null)
ifneq ($(MPI_INCDIRS),)
NVCC_FLAGS += -DLLM5D_MPI $(addprefix -I,$(MPI_INCDIRS))
LDLIBS += $(addprefix -L,$(MPI_LIBDIRS)) $(addprefix -Xlinker -rpath -Xlinker ,$(MPI_LIBDIRS)) -lmpi
else
$(warning no MPI found ($(MPICXX) --showme failed): building for one process; set NO_MPI=1 to silence this)
endif
endif

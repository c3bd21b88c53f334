# tandem's build. A plain Makefile: one file to read, no generator step, and the rules are
# globs, so a new src/<subsystem>/x.c, tests/test_x.c, examples/<name>/ or bench/<name>.c
# joins the build without editing this file.
#
#   make                 library (static + shared), tools, examples, benchmarks
#   make test            the suite, then the suite again under ASan + UBSan
#   make check           the suite once (BUILD=build)
#   make check-long      the slower training tests
#   make install PREFIX=/usr/local
#   make NATIVE=1        everything compiled for this machine's CPU (-march=native)
#   make CUDA=0          without libtandem_cuda.so even where nvcc is installed
#   make check-torch     all of the torch.distributed backend's tests, worlds 2-4 (make check runs
#                        world 2 where the module is built: sh scripts/deps.sh torch)
#   make plots           the benchmarks run afresh and drawn as the docs' figures (scripts/plots.sh)
#
# SAN=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer into build-san/.

SAN ?=
BUILD ?= $(if $(SAN),build-san,build)
PREFIX ?= /usr/local
CC ?= cc

# Warnings are errors here and in CI; WERROR= keeps them warnings, for a machine whose compilers
# are newer than the ones the code was written against (scripts/gpu.sh builds that way).
WERROR ?= -Werror
comma := ,
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -fno-math-errno -Wall -Wextra $(WERROR) -fPIC -g -Iinclude -Isrc -MMD -MP
# The default build runs on any x86-64: the vector paths (AVX-512 reductions and conversions)
# are compiled for their ISA alone and chosen at run time (src/core/cpu.c); NATIVE=1 builds all
# of the library for the CPU that builds it.
ifeq ($(SAN),)
OPT ?= -O2 $(if $(NATIVE),-march=native)
else
OPT ?= -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
LDFLAGS += -fsanitize=address,undefined
endif
CFLAGS += $(CFLAGS_BASE) $(OPT)
# libgomp is oneDNN's OpenMP runtime, whose per-thread count a graph sets (td_graph_params.threads).
LIBS := -ldnnl -lgomp -lz -lpthread -lm

# The mpi backend is built when Open MPI's compiler wrapper is present (make MPICC= builds
# without it); otherwise its stub (src/comm/mpi/stub.c), which refuses the backend by name.
MPICC := $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
MPI_CFLAGS := $(shell mpicc --showme:compile) -DTD_HAVE_MPI
MPI_LIBS := $(shell mpicc --showme:link)
LIB_SRC_MPI := $(filter-out src/comm/mpi/stub.c,$(wildcard src/comm/mpi/*.c))
else
LIB_SRC_MPI := src/comm/mpi/stub.c
endif

# The ucx backend is built when UCX's headers are present (libucx-dev; make UCX= builds
# without it); otherwise its stub (src/comm/ucx/stub.c).
UCX := $(shell pkg-config --exists ucx 2>/dev/null && echo yes)
ifeq ($(UCX),yes)
UCX_CFLAGS := $(shell pkg-config --cflags ucx) -DTD_HAVE_UCX
UCX_LIBS := -lucp -lucs
LIB_SRC_UCX := $(filter-out src/comm/ucx/stub.c,$(wildcard src/comm/ucx/*.c))
else
LIB_SRC_UCX := src/comm/ucx/stub.c
endif

# The CUDA library (libtandem_cuda.so, loaded at run time by src/device/cuda_loader.c) is built
# when nvcc is present; CUDA=0 skips it. It links the CUDA runtime statically and exports one
# symbol. Hopper (sm_90) machine code, and PTX for newer GPUs. cuDNN by its versioned name:
# PyTorch's pip wheel (nvidia/cudnn/lib, found through LIBRARY_PATH) ships no libcudnn.so.
NVCC := $(if $(filter 0,$(CUDA)),,$(shell command -v nvcc 2>/dev/null))
ifneq ($(NVCC),)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
# -Xptxas -v writes each object's resource report (OBJ.ptxas) and --no-compress keeps the PTX
# readable in it, for the gate below.
NVCCFLAGS := -std=c++20 -O2 -g $(CUDA_ARCH) -Iinclude -Isrc $(if $(WERROR),-Werror all-warnings) \
	-Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra$(if $(WERROR),$(comma)-Werror),-Wno-missing-field-initializers \
	-Xptxas -v --no-compress
CUDA_SRC := $(wildcard src/*/cuda/*.cu)
CUDA_OBJ := $(CUDA_SRC:%.cu=$(BUILD)/obj/%.o)
CUDA_SO := $(BUILD)/lib/libtandem_cuda.so
# The compiler's resource report as a gate: no register spills, static shared memory within
# 48 KiB, every kernel bounded to the block size every launch has; the table of registers and
# shared memory per kernel (docs/gpu.md's) lands here.
CUDA_REPORT := $(BUILD)/cuda-resources.md
CUDA_LINK := -L$(CUDA_HOME)/lib64 -lcublasLt -l:libcudnn.so.9 -l:libnccl.so.2 -lcudart_static -ldl \
	-lrt -lpthread
endif

# The torch.distributed backend (bindings/torch/, the Python module tandem_torch) is built when
# PyTorch's C++ headers (libtorch-dev), pybind11 and Debian's python3-torch are present; not
# under the sanitizers, as an unsanitized python3 loads it.
PYTHON ?= /usr/bin/python3
ifeq ($(SAN),)
TORCH := $(and $(wildcard /usr/include/torch/csrc/distributed/c10d/ProcessGroup.hpp), \
	$(wildcard /usr/include/pybind11/pybind11.h), \
	$(shell $(PYTHON) -c 'import torch.distributed' 2>/dev/null && echo yes))
endif
ifneq ($(TORCH),)
TORCH_EXT := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
TORCH_CXXFLAGS := -std=c++17 -O2 -g -fPIC -fvisibility=hidden -Wall -Wextra $(WERROR) -Iinclude \
	-isystem /usr/include/torch/csrc/api/include \
	-isystem $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
	-MMD -MP
TORCH_OBJ := $(patsubst %.cpp,$(BUILD)/obj/%.o,$(wildcard bindings/torch/*.cpp))
TORCH_MODULE := $(BUILD)/python/tandem_torch$(TORCH_EXT)
endif

# Backends may have folders of their own (src/comm/shm/); mpi's and ucx's need their flags.
LIB_SRC := $(wildcard src/*/*.c) $(LIB_SRC_MPI) $(LIB_SRC_UCX) \
	$(filter-out src/comm/mpi/% src/comm/ucx/%,$(wildcard src/*/*/*.c))
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
ALL_LIBS := $(LIBS) $(MPI_LIBS) $(UCX_LIBS)

STATIC := $(BUILD)/lib/libtandem.a
SHARED := $(BUILD)/lib/libtandem.so

# Tests in C++ (tests/test_*.cc): the CUDA kernels under the CPU's emulation of CUDA
# (src/device/cuda/emulate.cuh), built on every machine, with or without nvcc. Contraction stays
# off, so __fmul_rn and __fadd_rn round each operation as on a GPU.
EMU_TESTS := $(patsubst tests/%.cc,$(BUILD)/tests/%,$(wildcard tests/test_*.cc))
EMU_CXXFLAGS := -std=c++17 -DTD_CUDA_EMULATE -D_GNU_SOURCE -fno-math-errno -ffp-contract=off -Wall \
	-Wextra $(WERROR) -g -Iinclude -Isrc -MMD -MP $(OPT)
TESTS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c)) $(EMU_TESTS)
BENCHES := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))
EXAMPLES := $(patsubst examples/%/,$(BUILD)/examples/%,$(dir $(wildcard examples/*/main.c)))
TOOLS := $(patsubst tools/%/,$(BUILD)/bin/%,$(dir $(wildcard tools/*/main.c)))

all: $(STATIC) $(SHARED) $(CUDA_SO) $(TOOLS) $(EXAMPLES) $(BENCHES) $(TORCH_MODULE) \
	$(BUILD)/tandem.pc

$(BUILD)/obj/src/comm/mpi/%.o: src/comm/mpi/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(MPI_CFLAGS) -c $< -o $@

$(BUILD)/obj/src/comm/ucx/%.o: src/comm/ucx/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(UCX_CFLAGS) -c $< -o $@

# Benchmarks may call Open MPI directly to measure it side by side.
$(BUILD)/obj/bench/%.o: bench/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(MPI_CFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(if $(MPICC),-DTD_HAVE_MPI) $(if $(UCX),-DTD_HAVE_UCX) -c $< -o $@

$(BUILD)/obj/tests/%.o: tests/%.cc
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@ 2> $(@:.o=.ptxas) || { cat $(@:.o=.ptxas) >&2; exit 1; }
	@grep -v '^ptxas info\|bytes stack frame' $(@:.o=.ptxas) >&2 || true

$(BUILD)/obj/bindings/torch/%.o: bindings/torch/%.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(TORCH_CXXFLAGS) -c $< -o $@

# The archive's symbols stay inside the module.
$(TORCH_MODULE): $(TORCH_OBJ) $(STATIC)
	@mkdir -p $(dir $@)
	$(CXX) -shared -Wl,--exclude-libs,ALL -Wl,-z,defs -o $@ $(TORCH_OBJ) $(STATIC) $(ALL_LIBS) \
		-ltorch_python -ltorch -ltorch_cpu -lc10 \
		$(shell $(PYTHON) -c 'import sysconfig; print("-lpython" + sysconfig.get_config_var("LDVERSION"))')

$(CUDA_REPORT): $(CUDA_OBJ) scripts/cuda_resources.sh src/device/cuda/kernel.cuh
	sh scripts/cuda_resources.sh $(CUDA_OBJ) > $@.tmp && mv $@.tmp $@

$(CUDA_SO): $(CUDA_OBJ) $(CUDA_REPORT)
	@mkdir -p $(dir $@)
	$(NVCC) -shared $(CUDA_ARCH) -Xlinker -z,defs -o $@ $(CUDA_OBJ) $(CUDA_LINK)

$(STATIC): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The shared library exports the public API alone (src/libtandem.map).
$(SHARED): $(LIB_OBJ) src/libtandem.map
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libtandem.so.0 -Wl,--version-script=src/libtandem.map \
		-o $@ $(LIB_OBJ) $(ALL_LIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(STATIC) $(ALL_LIBS)

$(EMU_TESTS): $(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(STATIC)
	@mkdir -p $(dir $@)
	$(CXX) $(LDFLAGS) -o $@ $< $(STATIC) $(ALL_LIBS)

$(BUILD)/bench/%: $(BUILD)/obj/bench/%.o $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(STATIC) $(ALL_LIBS)

# The objects of every .c file in folder $(1).
objects_in = $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard $(1)/*.c))

.SECONDEXPANSION:
$(BUILD)/examples/%: $$(call objects_in,examples/$$*) $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(STATIC) $(ALL_LIBS)

$(BUILD)/bin/%: $$(call objects_in,tools/$$*) $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(STATIC) $(ALL_LIBS)

# pkg-config file for prefix $(1). The rpath lets a program built with it run as built, from
# any prefix, without ldconfig or LD_LIBRARY_PATH (also with --static, which still links the
# shared library when both are installed).
pc_text = printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: tandem\nDescription: distributed training for C programs\nVersion: 0.1.0\nLibs: -L$${libdir} -Wl,-rpath,$${libdir} -ltandem\nLibs.private: %s\nCflags: -I$${includedir}\n' '$(1)' '$(ALL_LIBS)'

$(BUILD)/tandem.pc: Makefile
	@mkdir -p $(dir $@)
	$(call pc_text,$(abspath $(BUILD))) > $@

tests: $(TESTS) $(TOOLS)

# One pass of the suite in $(BUILD).
check: all tests
	TD_LDFLAGS='$(LDFLAGS)' sh tests/run.sh $(BUILD)

# The README's test command: the suite, then the suite under the sanitizers.
test:
	$(MAKE) check
	$(MAKE) check SAN=1

check-long: all tests
	TD_LONG=1 TD_LDFLAGS='$(LDFLAGS)' sh tests/run.sh $(BUILD)

# The torch.distributed backend's tests alone (they skip where the module is not built).
check-torch: all tests
	TD_TORCH=1 OMP_NUM_THREADS=1 $(BUILD)/tests/test_torch

# The docs' figures (docs/img) from fresh runs of the benchmarks (docs/data); about 40 minutes.
plots:
	sh scripts/plots.sh

install: $(STATIC) $(SHARED) $(CUDA_SO) $(TOOLS)
	install -d $(DESTDIR)$(PREFIX)/include/tandem $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/tandem/*.h $(DESTDIR)$(PREFIX)/include/tandem/
	install -m 644 $(STATIC) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(SHARED) $(DESTDIR)$(PREFIX)/lib/libtandem.so.0
	$(if $(CUDA_SO),install -m 755 $(CUDA_SO) $(DESTDIR)$(PREFIX)/lib/)
	ln -sf libtandem.so.0 $(DESTDIR)$(PREFIX)/lib/libtandem.so
	$(call pc_text,$(PREFIX)) > $(DESTDIR)$(PREFIX)/lib/pkgconfig/tandem.pc
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin/

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-san

.PHONY: all tests check test check-long check-torch plots install format clean
.PRECIOUS: $(BUILD)/obj/%.o

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

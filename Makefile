# k3 - one non-recursive Makefile.
#
#   make          build libk3.a and the tools into bin/
#   make test     the whole suite; ends "N passed, N failed"
#   make demo     build, then run the main job end to end on the small trained model (models/kjv-tiny)
#   make asan     the suite under AddressSanitizer + UBSan (build-asan/)
#   make test-arm64  cross-build for aarch64 (build-arm64/) and run the suite
#                 under qemu-aarch64, but for tests/qemu-skip.txt (scripts/install-deps --arm64)
#   make bench    benchmarks (never part of make test)
#   make install  PREFIX=/usr/local (the tools and their manual pages)
#
# Layout: the library libk3.a is common/ manifests/ kernels/ engine/ (LIB_DIRS);
# each tool folder (TOOL_DIRS) holds its main.c plus code only that tool uses,
# and a tool links its own folder and libk3.a, nothing else (check-layout
# runs nm to keep it so). The test binary, benchmarks and fuzz targets link
# every tool folder's code too (they test it). Modules may add rules in
# <dir>/module.mk (included below), e.g. generated tables.

CC      ?= cc
O       ?= build
BIN     ?= bin
PREFIX  ?= /usr/local
OPT     ?= -O2
SAN     ?=

WARN    = -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
# -ffp-contract=off: no silent FMA contraction, so numbers are the same
# whatever the compiler decides; kernels that want FMA ask for it explicitly.
CFLAGS  ?= $(OPT) -g
ALL_CFLAGS = -std=c11 -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 $(WARN) -ffp-contract=off \
             -fno-fast-math -fopenmp -pthread -Iinclude -I$(O)/gen $(SAN) $(CFLAGS)
LDLIBS  = -lcjson -lcrypto -lz -lm -ledit
LDFLAGS_ALL = -fopenmp -pthread $(SAN) $(LDFLAGS)

LIB_DIRS  = common manifests kernels engine
TOOL_DIRS = convert pack verify synth runtime serve
TOOL_NAME_convert = k3-convert
TOOL_NAME_pack    = k3-pack
TOOL_NAME_verify  = k3-verify
TOOL_NAME_synth   = k3-synth
TOOL_NAME_runtime = k3-run
TOOL_NAME_serve   = k3-serve
# libraries only one tool links (the test binary and benchmarks hold every
# tool folder's code, so they link them all)
TOOL_LDLIBS_serve = -lmicrohttpd
TOOL_LDLIBS = $(foreach d,$(TOOL_DIRS),$(TOOL_LDLIBS_$(d)))

# The target architecture, from the compiler itself, so that
# CC=aarch64-linux-gnu-gcc cross-builds (x86_64 or aarch64; any other
# builds the scalar paths only).
ARCH := $(firstword $(subst -, ,$(shell $(CC) -dumpmachine)))

# Per-ISA files by file-name suffix (kernels/gemm_avx2.c, common/crc32_arm.c,
# ...): a build holds only the files of its architecture, and only they are
# built with the wider instruction sets; dispatch picks at run time.
ISA_X86 = avx2 avx512 avx512bf16 x86
ISA_ARM = neon arm
ISA_avx2       = -mavx2 -mfma -mf16c
ISA_avx512     = -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
ISA_avx512bf16 = $(ISA_avx512) -mavx512bf16
ISA_arm        = -march=armv8-a+crc
ifeq ($(ARCH),x86_64)
ISA_OTHER = $(ISA_ARM)
else ifeq ($(ARCH),aarch64)
ISA_OTHER = $(ISA_X86)
else
ISA_OTHER = $(ISA_X86) $(ISA_ARM)
endif
isa_of   = $(lastword $(subst _, ,$(basename $(notdir $(1)))))
for_arch = $(foreach f,$(1),$(if $(filter $(call isa_of,$(f)),$(ISA_OTHER)),,$(f)))

LIB_SRC  = $(call for_arch,$(sort $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c))))
LIB_OBJ  = $(LIB_SRC:%.c=$(O)/%.o)
LIB      = $(O)/libk3.a

# tool-only objects (everything in a tool folder but main.c); TOOL_OBJ_<dir>
# are one tool's own
TOOL_LIB_SRC = $(sort $(foreach d,$(TOOL_DIRS),$(filter-out $(d)/main.c,$(wildcard $(d)/*.c))))
TOOL_LIB_OBJ = $(TOOL_LIB_SRC:%.c=$(O)/%.o)
tool_obj = $(filter $(O)/$(1)/%,$(TOOL_LIB_OBJ))
TOOLS = $(foreach d,$(TOOL_DIRS),$(if $(wildcard $(d)/main.c),$(BIN)/$(TOOL_NAME_$(d))))

TEST_SRC = $(sort $(wildcard tests/*.c))
TEST_OBJ = $(TEST_SRC:%.c=$(O)/%.o)
TEST_BIN = $(BIN)/k3-test

BENCH_SRC = $(sort $(wildcard bench/*.c))
BENCH_BIN = $(BENCH_SRC:bench/%.c=$(BIN)/bench-%)

GEN_HDR =   # generated headers, appended to by module.mk files

.SECONDEXPANSION:
.PHONY: all test check-layout check-lines test-arm64 demo asan bench install install-man clean deps
all: $(LIB) $(TOOLS) $(TEST_BIN)

-include $(sort $(wildcard */module.mk))

$(O)/%.o: %.c $(GEN_HDR) | $(O)/gen
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ISA_$(call isa_of,$<)) -MMD -MP -c $< -o $@

$(O)/gen:
	@mkdir -p $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

define tool_rule
$(BIN)/$(TOOL_NAME_$(1)): $(O)/$(1)/main.o $(call tool_obj,$(1)) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(LDFLAGS_ALL) -o $$@ $(O)/$(1)/main.o $(call tool_obj,$(1)) $(LIB) $(LDLIBS) $(TOOL_LDLIBS_$(1))
endef
$(foreach d,$(TOOL_DIRS),$(eval $(call tool_rule,$(d))))

$(TEST_BIN): $(TEST_OBJ) $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(LDFLAGS_ALL) -o $@ $(TEST_OBJ) $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS) $(TOOL_LDLIBS)

$(BIN)/bench-%: bench/%.c $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN) $(O)/bench
	$(CC) $(ALL_CFLAGS) -MMD -MP -MF $(O)/bench/$*.d -MT $@ $(LDFLAGS_ALL) -o $@ $< $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS) $(TOOL_LDLIBS)

# The MPI build (docs/DIST.md): k3-run-mpi and k3-serve-mpi, the tools' own
# main (renamed k3_tool_main) under mpi/launch.c, linked with Open MPI. Built
# with the rest when mpicc is there and the build is native; scripts/install-deps
# installs Open MPI.
MPICC ?= mpicc
ifeq ($(shell $(MPICC) -dumpmachine 2>/dev/null),$(shell $(CC) -dumpmachine))
MPI_TOOLS = $(BIN)/k3-run-mpi $(BIN)/k3-serve-mpi
endif
MPI_DIR_run = runtime
MPI_DIR_serve = serve
all: $(MPI_TOOLS)
.PRECIOUS: $(O)/mpi/%-main.o
$(O)/mpi/launch.o: mpi/launch.c $(GEN_HDR) | $(O)/gen
	@mkdir -p $(dir $@)
	$(MPICC) $(ALL_CFLAGS) -MMD -MP -c $< -o $@
$(O)/mpi/%-main.o: $$(MPI_DIR_$$*)/main.c $(GEN_HDR) | $(O)/gen
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Dmain=k3_tool_main -include mpi/tool_main.h -MMD -MP -c $< -o $@
$(BIN)/k3-%-mpi: $(O)/mpi/launch.o $(O)/mpi/%-main.o $$(call tool_obj,$$(MPI_DIR_$$*)) $(LIB)
	@mkdir -p $(BIN)
	$(MPICC) $(LDFLAGS_ALL) -o $@ $^ $(LDLIBS) $(TOOL_LDLIBS_$(MPI_DIR_$*))

# the benchmarks are built (not run) by every test run, so they cannot rot
test: all $(BENCH_BIN) check-layout check-lines
	K3_BIN=$(BIN) ./$(TEST_BIN) $(T)

# No source file over 1,000 lines (scripts/check-lines: the exceptions and why).
check-lines:
	./scripts/check-lines

# No tool holds another tool's code (nm of each binary against the others'
# objects).
check-layout: $(TOOLS)
	./scripts/check-layout $(O) $(BIN) $(foreach d,$(TOOL_DIRS),$(d)=$(TOOL_NAME_$(d)))

asan:
	$(MAKE) O=build-asan BIN=build-asan/bin OPT=-O1 \
	    SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

# the aarch64 cross-build and its suite under qemu (scripts/test-arm64)
ARM64_CC ?= aarch64-linux-gnu-gcc
test-arm64: all
	$(MAKE) CC=$(ARM64_CC) O=build-arm64 BIN=build-arm64/bin all
	./scripts/test-arm64 $(T)

bench: $(BENCH_BIN)
	@echo "benchmarks built in $(BIN)/: run them one by one (see bench/README.md)"

demo: deps all
	./scripts/demo

MAN_PAGES = $(sort $(wildcard man/*.1))

install: all install-man
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(TOOLS) $(MPI_TOOLS) $(DESTDIR)$(PREFIX)/bin

# the manual pages alone (no build needed; tests/t_docs.c runs it)
install-man:
	install -d $(DESTDIR)$(PREFIX)/share/man/man1
	install -m 644 $(MAN_PAGES) $(DESTDIR)$(PREFIX)/share/man/man1

deps:
	./scripts/install-deps

clean:
	rm -rf build build-asan build-arm64 bin

-include $(LIB_OBJ:.o=.d) $(TOOL_LIB_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(foreach d,$(TOOL_DIRS),$(O)/$(d)/main.d) \
         $(wildcard $(O)/mpi/*.d $(O)/bench/*.d)

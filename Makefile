# k3 - one non-recursive Makefile.
#
#   make          build libk3.a and the tools into bin/
#   make test     the whole suite; ends "N passed, N failed"
#   make demo     build, then run the main job end to end on a tiny model
#   make asan     the suite under AddressSanitizer + UBSan (build-asan/)
#   make bench    benchmarks (never part of make test)
#   make install  PREFIX=/usr/local
#
# Library sources: common/ manifests/ kernels/ (and runtime/ lib code, see
# LIB_DIRS). Each tool folder holds main.c plus tool-only code. Modules may add
# rules in <dir>/module.mk (included below), e.g. generated tables.

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
TOOL_DIRS = convert pack verify synth runtime
TOOL_NAME_convert = k3-convert
TOOL_NAME_pack    = k3-pack
TOOL_NAME_verify  = k3-verify
TOOL_NAME_synth   = k3-synth
TOOL_NAME_runtime = k3-run

# Per-ISA flags by file-name suffix (kernels/*_avx2.c, ...): only those files
# are built with the wider instruction sets; dispatch picks at run time.
ISA_avx2       = -mavx2 -mfma -mf16c
ISA_avx512     = -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
ISA_avx512bf16 = $(ISA_avx512) -mavx512bf16

LIB_SRC  = $(sort $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c)))
LIB_OBJ  = $(LIB_SRC:%.c=$(O)/%.o)
LIB      = $(O)/libk3.a

# tool-only objects (everything in a tool folder but main.c)
TOOL_LIB_SRC = $(sort $(foreach d,$(TOOL_DIRS),$(filter-out $(d)/main.c,$(wildcard $(d)/*.c))))
TOOL_LIB_OBJ = $(TOOL_LIB_SRC:%.c=$(O)/%.o)
TOOLS = $(foreach d,$(TOOL_DIRS),$(if $(wildcard $(d)/main.c),$(BIN)/$(TOOL_NAME_$(d))))

TEST_SRC = $(sort $(wildcard tests/*.c))
TEST_OBJ = $(TEST_SRC:%.c=$(O)/%.o)
TEST_BIN = $(BIN)/k3-test

BENCH_SRC = $(sort $(wildcard bench/*.c))
BENCH_BIN = $(BENCH_SRC:bench/%.c=$(BIN)/bench-%)

GEN_HDR =   # generated headers, appended to by module.mk files

.PHONY: all test demo asan bench install clean deps
all: $(LIB) $(TOOLS) $(TEST_BIN)

-include $(sort $(wildcard */module.mk))

$(O)/%.o: %.c $(GEN_HDR) | $(O)/gen
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ISA_$(lastword $(subst _, ,$(basename $(notdir $<))))) -MMD -MP -c $< -o $@

$(O)/gen:
	@mkdir -p $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

define tool_rule
$(BIN)/$(TOOL_NAME_$(1)): $(O)/$(1)/main.o $(filter $(O)/$(1)/%,$(TOOL_LIB_OBJ)) $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(LDFLAGS_ALL) -o $$@ $(O)/$(1)/main.o $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS)
endef
$(foreach d,$(TOOL_DIRS),$(eval $(call tool_rule,$(d))))

$(TEST_BIN): $(TEST_OBJ) $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(LDFLAGS_ALL) -o $@ $(TEST_OBJ) $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS)

$(BIN)/bench-%: bench/%.c $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(ALL_CFLAGS) $(LDFLAGS_ALL) -o $@ $< $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS)

test: all
	K3_BIN=$(BIN) ./$(TEST_BIN) $(T)

asan:
	$(MAKE) O=build-asan BIN=build-asan/bin OPT=-O1 \
	    SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

bench: $(BENCH_BIN)
	@echo "benchmarks built in $(BIN)/: run them one by one (see bench/README.md)"

demo: deps all
	./scripts/demo

install: all
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin

deps:
	./scripts/install-deps

clean:
	rm -rf build build-asan bin

-include $(LIB_OBJ:.o=.d) $(TOOL_LIB_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(foreach d,$(TOOL_DIRS),$(O)/$(d)/main.d)

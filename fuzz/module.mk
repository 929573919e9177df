# fuzz/module.mk - fuzz targets (fuzz/fz_<name>.c) and their regression corpora.
#
#   make fuzz [FUZZ_SECONDS=60] [FUZZ_TARGETS="cfg st_header"]
#        build every target with clang -fsanitize=fuzzer,address,undefined in
#        fuzz-out/ and run each for FUZZ_SECONDS; fails if any finds a crash,
#        leak, timeout or over-limit allocation (inputs land in
#        fuzz-out/artifacts/<name>/; copy them to fuzz/corpus/<name>/ as
#        regression cases once fixed).
#   make fuzz-build   only build the fuzz binaries (fuzz-out/bin/fz_<name>)
#   make fuzz-regress replay fuzz/corpus/*/ through every target in the normal
#        build (the same tests run as part of `make test` and `make asan`).
#   make fuzz-pending replay fuzz/pending/*/: inputs of known bugs not fixed yet
#        (fuzz/pending/README.md); expected to fail until they are, then the
#        input moves to fuzz/corpus/<name>/.
#
# Every fuzz/fz_<name>.c is built, always: a target that no longer compiles
# breaks the build, and the replay test fails when a corpus folder has no
# target (tests/t_fuzz_regress.c), so no target can drop out silently.

# helper sources some targets share (fuzz/<name>.c)
FUZZ_EXTRA_tok       = tok_check
FUZZ_EXTRA_tok_text  = tok_check

FUZZ_ALL := $(patsubst fuzz/fz_%.c,%,$(sort $(wildcard fuzz/fz_*.c)))
FUZZ_READY := $(FUZZ_ALL)
FUZZ_TARGETS ?= $(FUZZ_READY)
FUZZ_SECONDS ?= 60

FUZZ_HELPER_OBJ := $(patsubst %,$(O)/fuzz/%.o,util $(sort $(foreach t,$(FUZZ_READY),$(FUZZ_EXTRA_$(t)))))

# The regression replay lives in the test binary.
TEST_OBJ += $(FUZZ_HELPER_OBJ) $(FUZZ_READY:%=$(O)/fuzz/fz_%.o)

FUZZ_O   = fuzz-out/build
FUZZ_BIN = fuzz-out/bin
FUZZ_CC ?= clang
FUZZ_SAN = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer

.PHONY: fuzz fuzz-build fuzz-bins fuzz-regress fuzz-pending fuzz-clean

# -O1 runs no loop vectorizer, so clang would warn on every `omp simd` hint.
fuzz-build:
	$(MAKE) O=$(FUZZ_O) BIN=$(FUZZ_BIN) CC=$(FUZZ_CC) OPT="-O1 -Wno-pass-failed" \
	    SAN="$(FUZZ_SAN) -fsanitize=fuzzer-no-link" fuzz-bins

fuzz-bins: $(FUZZ_READY:%=$(BIN)/fz_%)

$(BIN)/fz_%: $(O)/fuzz/fz_%.o $(FUZZ_HELPER_OBJ) $(O)/fuzz/entry.o $(TOOL_LIB_OBJ) $(LIB)
	@mkdir -p $(BIN)
	$(CC) $(LDFLAGS_ALL) -fsanitize=fuzzer -o $@ $(O)/fuzz/fz_$*.o $(FUZZ_HELPER_OBJ) \
	    $(O)/fuzz/entry.o $(TOOL_LIB_OBJ) $(LIB) $(LDLIBS) $(TOOL_LDLIBS)

fuzz: fuzz-build
	FUZZ_SECONDS=$(FUZZ_SECONDS) ./fuzz/run $(FUZZ_TARGETS)

fuzz-regress: all
	K3_BIN=$(BIN) ./$(TEST_BIN) fuzz_

fuzz-pending: all
	K3_BIN=$(BIN) K3_FUZZ_CORPUS=fuzz/pending ./$(TEST_BIN) fuzz_

fuzz-clean:
	rm -rf fuzz-out

clean: fuzz-clean

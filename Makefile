# refit - plain Makefile. `make` builds everything under $(BUILD); `make test`, `make bench`,
# `make demo` install the Debian packages they need first (scripts/deps.sh).
BUILD     ?= build
CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(CUDA_HOME)
PREFIX    ?= /usr/local
DESTDIR   ?=

CC      ?= cc
# CFLAGS, LDFLAGS and LDLIBS are the user's (`make CFLAGS=-O0`); the project's own flags are
# kept apart in RF_CFLAGS and RF_LDLIBS, so giving them on the command line drops nothing.
CFLAGS  ?= -O2 -g
# Messages for people are cut to their buffers on purpose, so truncation is not an error.
# Hidden visibility: librefit.so exports only what client/refit.h marks REFIT_API.
# common/ has one folder per layer (docs/ARCHITECTURE.md); headers are included by name.
COMMON_DIRS := common/model common/data common/control common/service
COMMON_INC  := -I common $(addprefix -I ,$(COMMON_DIRS))
RF_CFLAGS := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-format-truncation -fPIC -MMD -MP \
             -fvisibility=hidden $(COMMON_INC) -I client -I $(BUILD)/gen

# Libraries are found through their pkg-config files (scripts/deps.sh installs pkg-config with
# them). Asked only when something is compiled or linked, and once per make: `make deps`,
# `make test` (which installs them first) and `make clean` work before they are installed.
# $(call rf_pkg,VAR,--cflags|--libs,PACKAGES) sets VAR to pkg-config's answer, or stops make
# with pkg-config's own words on what is missing.
PKG_CONFIG ?= pkg-config
RF_PKGS   := libuv libprotobuf-c inih jansson libsodium libmicrohttpd
rf_pkg     = $(eval $(1) := $(shell $(PKG_CONFIG) $(2) $(3) 2>/dev/null || echo RF_PKG_FAILED))$(if \
             $(filter RF_PKG_FAILED,$($(1))),$(error $(PKG_CONFIG) $(2) $(3) failed: $(shell \
             $(PKG_CONFIG) --print-errors --exists $(3) 2>&1 | head -n 3) -- run scripts/deps.sh \
             (make deps), or set PKG_CONFIG_PATH to where their .pc files are))$($(1))
PKG_CFLAGS = $(call rf_pkg,PKG_CFLAGS,--cflags,$(RF_PKGS))
PKG_LIBS   = $(call rf_pkg,PKG_LIBS,--libs,$(RF_PKGS))
CRIT_CFLAGS = $(call rf_pkg,CRIT_CFLAGS,--cflags,criterion)
CRIT_LIBS  = $(call rf_pkg,CRIT_LIBS,--libs,criterion)
RF_LDLIBS  = $(PKG_LIBS) -lpthread -lm

ifeq ($(V),1)
Q :=
else
Q := @
endif

# A build directory remembers how it was made: `make asan` and `make fuzz` write its
# flavour.mk, so that a later plain `make BUILD=build-asan ...` (tests/e2e/40-install.sh runs
# `make install` on the build under test) builds the same way instead of mixing objects.
-include $(BUILD)/flavour.mk

# Sanitizers, each in a build directory of its own. SAN=1: AddressSanitizer and
# UndefinedBehaviorSanitizer on every object and program (`make asan` builds that in
# $(ASAN_BUILD) and runs the tests with it). FUZZ=1: the same with clang and libFuzzer's
# coverage instrumentation, for the targets in fuzz/ (`make fuzz`, in $(FUZZ_BUILD)); the CUDA
# parts stay out of that build, nvcc does not take clang's sanitizer flags.
ifeq ($(FUZZ),1)
override HAVE_CUDA :=
SAN_CFLAGS  := -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined \
               -fno-omit-frame-pointer
SAN_LDFLAGS := -fsanitize=address,undefined
# clang before 17 does not know -Wno-format-truncation (nor the warning it silences).
RF_CFLAGS   += -Wno-unknown-warning-option
else ifeq ($(SAN),1)
SAN_CFLAGS  := -fsanitize=address,undefined -fno-omit-frame-pointer
SAN_LDFLAGS := -fsanitize=address,undefined
endif
ALL_CFLAGS = $(RF_CFLAGS) $(PKG_CFLAGS) $(TEST_CFLAGS) $(SAN_CFLAGS) $(CFLAGS)

# The GPU data path (CUDA memory import, copy kernels, NCCL transport) builds when a CUDA
# toolkit with NCCL is found; everything else builds and works without one. Files named
# *_cuda.c, *_nccl.c and *.cu are the GPU parts. libcuda (the driver) is never linked: it is
# opened at run time, so the binaries also start on machines without a GPU driver (CI).
HAVE_CUDA ?= $(shell test -x $(CUDA_HOME)/bin/nvcc && test -f $(NCCL_HOME)/include/nccl.h && echo 1)
NVCC      := $(CUDA_HOME)/bin/nvcc
# Kernels are built for the GPUs refit runs on: machine code for each of CUDA_ARCHS (90:
# H100/H200, 100: B200) that this nvcc can build, and PTX of the newest of them, which the
# driver compiles for a later GPU. nvcc is asked for its list once, when a .cu is compiled.
CUDA_ARCHS ?= 90 100
NV_ARCHS   = $(eval NV_ARCHS := $(filter $(patsubst compute_%,%,$(shell $(NVCC) --list-gpu-arch \
             2>/dev/null)),$(CUDA_ARCHS)))$(if $(NV_ARCHS),,$(error $(NVCC) builds none of \
             CUDA_ARCHS ($(CUDA_ARCHS)); its architectures: $(shell $(NVCC) --list-gpu-arch \
             2>&1 | tr '\n' ' ') -- set CUDA_ARCHS, or CUDA_HOME to a newer toolkit))$(NV_ARCHS)
NV_GENCODE = $(foreach a,$(NV_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
             -gencode arch=compute_$(lastword $(NV_ARCHS)),code=compute_$(lastword $(NV_ARCHS))
NVFLAGS    = -O2 -std=c++17 $(NV_GENCODE) -Xcompiler -fPIC,-Wall $(COMMON_INC) -I client
GPU_SRC   := $(wildcard common/*/*_cuda.c common/*/*_nccl.c sim/*_cuda.c client/lib/*_cuda.c)
CU_SRC    := $(wildcard common/*/*.cu sim/*.cu)
ifeq ($(HAVE_CUDA),1)
RF_CFLAGS += -DRF_HAVE_CUDA -I $(CUDA_HOME)/include -I $(NCCL_HOME)/include
RF_LDLIBS += -L$(CUDA_HOME)/lib64 -L$(NCCL_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 \
             -lnccl -lcudart -ldl -lstdc++
endif

PROTOS    := $(wildcard proto/*.proto)
PROTO_C   := $(patsubst proto/%.proto,$(BUILD)/gen/%.pb-c.c,$(PROTOS))
PROTO_H   := $(PROTO_C:.c=.h)
ifeq ($(HAVE_CUDA),1)
CU_O      := $(patsubst %.cu,$(BUILD)/%.cu.o,$(CU_SRC))
else
CU_O      :=
endif
ALL_C_IF  = $(if $(filter 1,$(HAVE_CUDA)),$(1),$(filter-out $(GPU_SRC),$(1)))
COMMON_C  := $(call ALL_C_IF,$(wildcard common/*.c common/*/*.c))
COMMON_O  := $(patsubst %.c,$(BUILD)/%.o,$(COMMON_C)) $(PROTO_C:.c=.o) $(filter $(BUILD)/common/%,$(CU_O))
LIBCOMMON := $(BUILD)/librfcommon.a

# Each directory of programs: every .c there with a main() is named in its own rule below.
PUB_O     := $(patsubst %.c,$(BUILD)/%.o,$(wildcard publisherd/*.c))
RECV_O    := $(patsubst %.c,$(BUILD)/%.o,$(wildcard receiverd/*.c))
LIBREFIT_C:= $(call ALL_C_IF,$(wildcard client/lib/*.c))
LIBREFIT_O:= $(patsubst %.c,$(BUILD)/%.o,$(LIBREFIT_C))
CTL_O     := $(patsubst %.c,$(BUILD)/%.o,$(wildcard client/refitctl/*.c))
SIM_LIB_O := $(patsubst %.c,$(BUILD)/%.o,$(filter-out sim/refit-sim-%.c,$(call ALL_C_IF,$(wildcard sim/*.c)))) \
             $(filter $(BUILD)/sim/%,$(CU_O))
SIM_BINS  := $(patsubst sim/%.c,$(BUILD)/%,$(wildcard sim/refit-sim-*.c))
UNIT_BINS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c))
# What the unit tests share that is no test itself (the reference plan executor, copy_ref.c).
TEST_LIB_O:= $(patsubst %.c,$(BUILD)/%.o,$(filter-out tests/unit/test_%.c,$(wildcard tests/unit/*.c)))
BENCH_BINS:= $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/bench_*.c))
# Programs the GPU test scripts run (tests/gpu/*.c, e.g. fp8_dump), built with the CUDA parts.
GPU_TEST_BINS := $(if $(filter 1,$(HAVE_CUDA)),$(patsubst tests/gpu/%.c,$(BUILD)/tests/%,$(wildcard tests/gpu/*.c)))

BINS := $(if $(PUB_O),$(BUILD)/refit-publisherd) $(if $(RECV_O),$(BUILD)/refit-receiverd) \
        $(if $(LIBREFIT_O),$(BUILD)/librefit.so) $(if $(CTL_O),$(BUILD)/refitctl) $(SIM_BINS)

.PHONY: all deps test unit e2e bench soak demo install clean asan asan-tests fuzz fuzz-bins \
        fuzz-long fuzz-corpus
# Objects are never intermediates: keep them, so a second make (or make install) relinks nothing.
.SECONDARY:
all: $(LIBCOMMON) $(BINS) $(UNIT_BINS) $(BENCH_BINS) $(GPU_TEST_BINS)

deps:
	$(Q)scripts/deps.sh

$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)/gen
	@echo "  PROTOC  $<"
	$(Q)protoc-c --proto_path=proto --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.pb-c.o: $(BUILD)/gen/%.pb-c.c
	@echo "  CC      $<"
	$(Q)$(CC) $(ALL_CFLAGS) -Wno-unused-parameter -c -o $@ $<

$(BUILD)/%.o: %.c | $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(ALL_CFLAGS) -c -o $@ $<

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) $(NVFLAGS) -c -o $@ $<

$(LIBCOMMON): $(COMMON_O)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BUILD)/refit-publisherd: $(PUB_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

$(BUILD)/refit-receiverd: $(RECV_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

# The version script exports the API and nothing else, whatever built the objects.
$(BUILD)/librefit.so: $(LIBREFIT_O) $(LIBCOMMON) client/lib/librefit.map
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -shared -Wl,-soname,librefit.so.0 \
		-Wl,--version-script=client/lib/librefit.map -o $@ $(LIBREFIT_O) $(LIBCOMMON) \
		$(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

$(BUILD)/refitctl: $(CTL_O) $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

$(BUILD)/refit-sim-%: $(BUILD)/sim/refit-sim-%.o $(SIM_LIB_O) $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

# Test objects are compiled with Criterion's flags (TEST_CFLAGS is empty for everything else).
$(BUILD)/tests/unit/%.o: TEST_CFLAGS = $(CRIT_CFLAGS)

$(BUILD)/tests/%: $(BUILD)/tests/unit/%.o $(TEST_LIB_O) $(LIBREFIT_O) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS) $(CRIT_LIBS)

# The coordinator's unit test drives publisherd's state machine itself (linked before the
# archive it calls into).
$(BUILD)/tests/test_coord: $(BUILD)/tests/unit/test_coord.o $(BUILD)/publisherd/coordinator.o \
		$(TEST_LIB_O) $(LIBREFIT_O) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS) $(CRIT_LIBS)

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

ifneq ($(GPU_TEST_BINS),)
$(GPU_TEST_BINS): $(BUILD)/tests/%: $(BUILD)/tests/gpu/%.o $(LIBCOMMON)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)
endif

# A hung test fails instead of stalling the run: limits far above any test's normal time.
UNIT_TIMEOUT_S ?= 300
E2E_TIMEOUT_S  ?= 600

# Unit tests: one Criterion binary per module. End-to-end tests: scripts that start the real
# daemons and clients as processes (tests/e2e/*.sh), then the Python package's tests.
unit: all
	$(Q)set -e; for t in $(UNIT_BINS); do echo "== $$t"; REFIT_BUILD=$(BUILD) $$t --jobs=2 --short-filename --timeout $(UNIT_TIMEOUT_S); done

e2e: all
	$(Q)set -e; for t in $(sort $(wildcard tests/e2e/[0-9]*.sh)); do echo "== $$t"; BUILD=$(BUILD) timeout $(E2E_TIMEOUT_S) $$t; done
	$(Q)echo "== tests/python"; BUILD=$(BUILD) REFIT_LIB=$(BUILD)/librefit.so python3 -m unittest discover -s tests/python

test: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)$(MAKE) --no-print-directory unit
	$(Q)$(MAKE) --no-print-directory e2e
	@echo "make test: all passed"

bench: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)BUILD=$(BUILD) bench/run.sh

# >= 1,000 refits with verify = full on the host path; fails if either daemon's RSS or open
# descriptors grow (bench/soak.sh prints the table; REFITS=N for another count).
soak: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)BUILD=$(BUILD) bench/soak.sh

demo: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)BUILD=$(BUILD) scripts/demo.sh

# The sanitizer build: everything with ASan and UBSan in $(ASAN_BUILD), then the unit and
# end-to-end tests with it. Every report of every process (daemons the scripts kill, Criterion
# workers) goes to a file under $(ASAN_BUILD)/san, so none is lost in a log nobody reads; any
# such file fails the run and is printed. Python is not instrumented: it runs through a
# wrapper that preloads the ASan runtime (which must come first to load librefit) and does
# not check python's own leaks.
ASAN_BUILD ?= build-asan
LIBASAN     = $(shell $(CC) -print-file-name=libasan.so)
# Preloaded after the ASan runtime into python3, so that C++ exceptions inside torch unwind
# through the C++ runtime the interposed python was started with. Under make asan, python3 and
# system-python3 (Debian's /usr/bin/python3, which has python3-torch when PATH's python3 is
# another) are wrappers that preload both.
LIBSTDCXX   = $(shell $(CC) -print-file-name=libstdc++.so.6)
PYTHON3     = $(shell command -v python3)
SAN_DIR     = $(abspath $(BUILD))/san
SAN_ENV     = PATH="$(SAN_DIR)/bin:$$PATH" \
              ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:log_path=$(SAN_DIR)/asan$(if \
              $(filter 1,$(HAVE_CUDA)),:protect_shadow_gap=0)" \
              UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$(SAN_DIR)/ubsan"

asan: deps
	$(Q)mkdir -p $(ASAN_BUILD) && echo 'SAN = 1' >$(ASAN_BUILD)/flavour.mk
	$(Q)$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) SAN=1 all
	$(Q)$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) SAN=1 asan-tests

asan-tests:
	$(Q)test "$(SAN)" = 1 || { echo "asan-tests: run 'make asan' (it builds with SAN=1)"; exit 1; }
	$(Q)rm -rf $(SAN_DIR) && mkdir -p $(SAN_DIR)/bin
	$(Q)for w in "python3 $(PYTHON3)" "system-python3 /usr/bin/python3"; do \
		set -- $$w; [ -x "$$2" ] || continue; \
		printf '#!/bin/sh\nLD_PRELOAD="%s %s$${LD_PRELOAD:+ $$LD_PRELOAD}" ASAN_OPTIONS="$$ASAN_OPTIONS:detect_leaks=0" exec %s "$$@"\n' \
			"$(LIBASAN)" "$(LIBSTDCXX)" "$$2" >$(SAN_DIR)/bin/$$1 && chmod +x $(SAN_DIR)/bin/$$1; \
	done
	$(Q)rc=0; { $(SAN_ENV) $(MAKE) --no-print-directory unit && \
		$(SAN_ENV) $(MAKE) --no-print-directory e2e; } || rc=$$?; \
	for f in $(SAN_DIR)/*san.*; do \
		[ -e "$$f" ] || continue; rc=1; echo "--- sanitizer report $$f"; cat "$$f"; \
	done; \
	if [ $$rc = 0 ]; then echo "make asan: all passed, no sanitizer report"; \
	else echo "make asan: FAILED (tests above, reports in $(SAN_DIR))"; fi; exit $$rc

# Fuzzing with libFuzzer: every fuzz/fuzz_NAME.c is a target built with clang against the
# project's objects (instrumented, in $(FUZZ_BUILD)) and run for FUZZ_SECONDS from its seed
# corpus fuzz/corpus/NAME (read-only; what it finds goes to $(FUZZ_BUILD)/corpus/NAME). A
# crash leaves its input in fuzz/crashes/NAME/ and fails the run after all targets ran.
# `make fuzz-corpus` rewrites the seeds from real messages (fuzz/gen_corpus.c).
FUZZ_BUILD        ?= build-fuzz
FUZZ_CC           ?= clang
FUZZ_SECONDS      ?= 20
FUZZ_LONG_SECONDS ?= 600
FUZZ_NAMES := $(patsubst fuzz/fuzz_%.c,%,$(wildcard fuzz/fuzz_*.c))
FUZZ_BINS  := $(patsubst %,$(BUILD)/fuzz/fuzz_%,$(FUZZ_NAMES))

$(FUZZ_BINS): $(BUILD)/fuzz/%: $(BUILD)/fuzz/%.o $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -fsanitize=fuzzer,address,undefined -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

$(BUILD)/fuzz/gen_corpus: $(BUILD)/fuzz/gen_corpus.o $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) $(SAN_LDFLAGS) -o $@ $^ $(LDFLAGS) $(LDLIBS) $(RF_LDLIBS)

fuzz-bins: $(FUZZ_BINS) $(BUILD)/fuzz/gen_corpus
	$(Q)test "$(FUZZ)" = 1 || { echo "fuzz-bins: run 'make fuzz' (it builds with FUZZ=1)"; exit 1; }

fuzz:
	$(Q)scripts/deps.sh fuzz
	$(Q)mkdir -p $(FUZZ_BUILD) && printf 'FUZZ = 1\nCC = %s\n' $(FUZZ_CC) >$(FUZZ_BUILD)/flavour.mk
	$(Q)$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) FUZZ=1 CC=$(FUZZ_CC) fuzz-bins
	$(Q)failed=""; for t in $(FUZZ_NAMES); do \
		log=$(FUZZ_BUILD)/fuzz/$$t.log; \
		mkdir -p $(FUZZ_BUILD)/corpus/$$t fuzz/crashes/$$t; \
		echo "== fuzz $$t, $(FUZZ_SECONDS) s (log $$log)"; \
		if $(FUZZ_BUILD)/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
			-artifact_prefix=fuzz/crashes/$$t/ $(FUZZ_ARGS) \
			$(FUZZ_BUILD)/corpus/$$t fuzz/corpus/$$t >$$log 2>&1; then \
			grep -E '^(Done|stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb)' $$log; \
		else \
			failed="$$failed $$t"; tail -n 60 $$log; \
		fi; \
	done; \
	if [ -n "$$failed" ]; then echo "make fuzz: FAILED:$$failed (inputs in fuzz/crashes/)"; exit 1; fi; \
	echo "make fuzz: no crash in $(FUZZ_NAMES)"

fuzz-long:
	$(Q)$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=$(FUZZ_LONG_SECONDS)

fuzz-corpus:
	$(Q)scripts/deps.sh fuzz
	$(Q)mkdir -p $(FUZZ_BUILD) && printf 'FUZZ = 1\nCC = %s\n' $(FUZZ_CC) >$(FUZZ_BUILD)/flavour.mk
	$(Q)$(MAKE) --no-print-directory BUILD=$(FUZZ_BUILD) FUZZ=1 CC=$(FUZZ_CC) $(FUZZ_BUILD)/fuzz/gen_corpus
	$(Q)$(FUZZ_BUILD)/fuzz/gen_corpus fuzz/corpus

# Install: programs, librefit (+ header, pkg-config file, Python package), systemd units with
# @BINDIR@ expanded, example configs. PREFIX is where things run from; DESTDIR stages the tree
# (packaging, tests/e2e/40-install.sh). Units and configs go to /lib/systemd/system and
# /etc/refit under DESTDIR whatever PREFIX is: that is where systemd and the units look.
INSTALL       ?= install
BINDIR        ?= $(PREFIX)/bin
LIBDIR        ?= $(PREFIX)/lib
INCLUDEDIR    ?= $(PREFIX)/include
PKGCONFIGDIR  ?= $(LIBDIR)/pkgconfig
PYTHONDIR     ?= $(LIBDIR)/python3/dist-packages
UNITDIR       ?= /lib/systemd/system
CONFDIR       ?= /etc/refit
REFIT_VERSION := $(shell sed -n 's/^\#define RF_VERSION "\(.*\)"/\1/p' common/service/daemon_cfg.h)
# refit.pc names its directories relative to ${prefix} where they lie under it, so that
# `pkg-config --define-prefix` and PKG_CONFIG_SYSROOT_DIR work on a staged tree.
PC_LIBDIR     = $(patsubst $(PREFIX)/%,$${prefix}/%,$(LIBDIR))
PC_INCLUDEDIR = $(patsubst $(PREFIX)/%,$${prefix}/%,$(INCLUDEDIR))
INSTALL_BINS  := refit-publisherd refit-receiverd refitctl refit-sim-trainer refit-sim-engine

install: $(addprefix $(BUILD)/,$(INSTALL_BINS) librefit.so)
	$(Q)test -n "$(REFIT_VERSION)" || { echo "install: no RF_VERSION in common/service/daemon_cfg.h"; exit 1; }
	@echo "  INSTALL $(DESTDIR)$(PREFIX) (units in $(DESTDIR)$(UNITDIR), configs in $(DESTDIR)$(CONFDIR))"
	$(Q)$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) \
		$(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(PYTHONDIR)/refit $(DESTDIR)$(UNITDIR) \
		$(DESTDIR)$(CONFDIR)
	$(Q)$(INSTALL) -m 0755 $(addprefix $(BUILD)/,$(INSTALL_BINS)) $(DESTDIR)$(BINDIR)/
	$(Q)$(INSTALL) -m 0755 $(BUILD)/librefit.so $(DESTDIR)$(LIBDIR)/librefit.so.0
	$(Q)ln -sf librefit.so.0 $(DESTDIR)$(LIBDIR)/librefit.so
	$(Q)$(INSTALL) -m 0644 client/refit.h $(DESTDIR)$(INCLUDEDIR)/refit.h
	$(Q)printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(PC_LIBDIR)' 'includedir=$(PC_INCLUDEDIR)' '' \
		'Name: refit' \
		'Description: client library of the refit weight-transfer daemons' \
		'Version: $(REFIT_VERSION)' \
		'Cflags: -I$${includedir}' \
		'Libs: -L$${libdir} -lrefit' >$(DESTDIR)$(PKGCONFIGDIR)/refit.pc
	$(Q)chmod 0644 $(DESTDIR)$(PKGCONFIGDIR)/refit.pc
	$(Q)$(INSTALL) -m 0644 client/python/refit/*.py $(DESTDIR)$(PYTHONDIR)/refit/
	$(Q)for u in systemd/*.service.in; do \
		n=$$(basename $$u .in); \
		sed 's|@BINDIR@|$(BINDIR)|g' $$u >$(DESTDIR)$(UNITDIR)/$$n && \
		chmod 0644 $(DESTDIR)$(UNITDIR)/$$n || exit 1; \
	done
	$(Q)$(INSTALL) -m 0644 systemd/*.conf.example $(DESTDIR)$(CONFDIR)/

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

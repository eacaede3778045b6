# refit - plain Makefile. `make` builds everything under $(BUILD); `make test`, `make bench`,
# `make demo` install the Debian packages they need first (scripts/deps.sh).
BUILD     ?= build
CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(CUDA_HOME)
PREFIX    ?= /usr/local
DESTDIR   ?=

CC      ?= cc
CFLAGS  ?= -O2 -g
# Messages for people are cut to their buffers on purpose, so truncation is not an error.
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-format-truncation -fPIC -MMD -MP \
           -I common -I client -I $(BUILD)/gen
LDLIBS  += -luv -lprotobuf-c -linih -ljansson -lsodium -lmicrohttpd -lpthread -lm

ifeq ($(V),1)
Q :=
else
Q := @
endif

PROTOS    := $(wildcard proto/*.proto)
PROTO_C   := $(patsubst proto/%.proto,$(BUILD)/gen/%.pb-c.c,$(PROTOS))
PROTO_H   := $(PROTO_C:.c=.h)
COMMON_C  := $(wildcard common/*.c)
COMMON_O  := $(patsubst %.c,$(BUILD)/%.o,$(COMMON_C)) $(PROTO_C:.c=.o)
LIBCOMMON := $(BUILD)/librfcommon.a

# Each directory of programs: every .c there with a main() is named in its own rule below.
PUB_O     := $(patsubst %.c,$(BUILD)/%.o,$(wildcard publisherd/*.c))
RECV_O    := $(patsubst %.c,$(BUILD)/%.o,$(wildcard receiverd/*.c))
LIBREFIT_C:= $(wildcard client/lib/*.c)
LIBREFIT_O:= $(patsubst %.c,$(BUILD)/%.o,$(LIBREFIT_C))
CTL_O     := $(patsubst %.c,$(BUILD)/%.o,$(wildcard client/refitctl/*.c))
SIM_LIB_O := $(patsubst %.c,$(BUILD)/%.o,$(filter-out sim/refit-sim-%.c,$(wildcard sim/*.c)))
SIM_BINS  := $(patsubst sim/%.c,$(BUILD)/%,$(wildcard sim/refit-sim-*.c))
UNIT_BINS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c))
BENCH_BINS:= $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/bench_*.c))

BINS := $(if $(PUB_O),$(BUILD)/refit-publisherd) $(if $(RECV_O),$(BUILD)/refit-receiverd) \
        $(if $(LIBREFIT_O),$(BUILD)/librefit.so) $(if $(CTL_O),$(BUILD)/refitctl) $(SIM_BINS)

.PHONY: all deps test unit e2e bench demo install clean fuzz
all: $(LIBCOMMON) $(BINS) $(UNIT_BINS) $(BENCH_BINS)

deps:
	$(Q)scripts/deps.sh

$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)/gen
	@echo "  PROTOC  $<"
	$(Q)protoc-c --proto_path=proto --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.pb-c.o: $(BUILD)/gen/%.pb-c.c
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS) -Wno-unused-parameter -c -o $@ $<

$(BUILD)/%.o: %.c | $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS) -c -o $@ $<

$(LIBCOMMON): $(COMMON_O)
	@echo "  AR      $@"
	$(Q)rm -f $@ && ar rcs $@ $^

$(BUILD)/refit-publisherd: $(PUB_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS)

$(BUILD)/refit-receiverd: $(RECV_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS)

$(BUILD)/librefit.so: $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,librefit.so.0 -o $@ $^ $(LDFLAGS) $(LDLIBS)

$(BUILD)/refitctl: $(CTL_O) $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS)

$(BUILD)/refit-sim-%: $(BUILD)/sim/refit-sim-%.o $(SIM_LIB_O) $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/unit/%.o $(LIBREFIT_O) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS) -lcriterion

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(LIBREFIT_O) $(LIBCOMMON)
	@echo "  LD      $@"
	$(Q)$(CC) -o $@ $^ $(LDFLAGS) $(LDLIBS)

# Unit tests: one Criterion binary per module. End-to-end tests: scripts that start the real
# daemons and clients as processes (tests/e2e/*.sh), then the Python package's tests.
unit: all
	$(Q)set -e; for t in $(UNIT_BINS); do echo "== $$t"; REFIT_BUILD=$(BUILD) $$t --jobs=2 --short-filename; done

e2e: all
	$(Q)set -e; for t in $(sort $(wildcard tests/e2e/*.sh)); do echo "== $$t"; BUILD=$(BUILD) $$t; done

test: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)$(MAKE) --no-print-directory unit
	$(Q)$(MAKE) --no-print-directory e2e
	@echo "make test: all passed"

bench: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)BUILD=$(BUILD) bench/run.sh

demo: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)BUILD=$(BUILD) scripts/demo.sh

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

#!/bin/bash
# tests/e2e/40-install.sh - `make install` into a temporary DESTDIR with a PREFIX, then uses
# only what was installed: the programs' --help/--version/--check-config, the units and
# example configs, a C program built against the installed header and librefit through the
# installed refit.pc, the installed Python package, and a real refit (tp=2 -> tp=4, verified
# by the engine) run with the installed daemons and simulators.
. "$(dirname "$0")/lib.sh"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=$E2E_DIR/dest
PREFIX=/opt/refit-e2e
P=$DEST$PREFIX

make -C "$ROOT" --no-print-directory BUILD="$BIN" DESTDIR="$DEST" PREFIX="$PREFIX" install \
    > "$E2E_DIR/install.log" 2>&1 || { cat "$E2E_DIR/install.log"; fail "make install failed"; }

for f in bin/refit-publisherd bin/refit-receiverd bin/refitctl bin/refit-sim-trainer \
         bin/refit-sim-engine; do
    [ -x "$P/$f" ] || fail "make install did not install $PREFIX/$f executable"
done
for f in lib/librefit.so.0 lib/librefit.so include/refit.h lib/pkgconfig/refit.pc \
         lib/python3/dist-packages/refit/__init__.py; do
    [ -e "$P/$f" ] || fail "make install did not install $PREFIX/$f"
done
[ "$(readlink "$P/lib/librefit.so")" = librefit.so.0 ] ||
    fail "$PREFIX/lib/librefit.so is not a link to librefit.so.0"
soname=$(objdump -p "$P/lib/librefit.so.0" 2>/dev/null | awk '/SONAME/ {print $2}')
[ -z "$soname" ] || [ "$soname" = librefit.so.0 ] ||
    fail "installed librefit.so.0 has soname '$soname'"
# librefit exports its API and nothing else: each function refit.h declares (one it forgot to
# mark REFIT_API stays hidden), and no internal (rf_*, refit__*, protobuf) a program could come
# to depend on.
decl='s/^\(REFIT_API \)\{0,1\}[a-z].*[ *]\(refit_[a-z0-9_]*\)(.*/\2/p'
api=$(sed -n "$decl" "$P/include/refit.h" | sort)
[ -n "$api" ] || fail "found no function declaration in the installed refit.h"
exported=$(nm -D --defined-only "$P/lib/librefit.so.0" | awk '{print $NF}' | sort)
[ "$api" = "$exported" ] || fail "installed librefit.so.0 does not export exactly refit.h's API" \
    "(< declared but not exported, > exported but not declared):" \
    "$(diff <(echo "$api") <(echo "$exported") | grep '^[<>]' | head -n 20 | tr '\n' ' ')"
for d in publisherd receiverd; do
    u=$DEST/lib/systemd/system/refit-$d.service
    [ -f "$u" ] || fail "make install did not install /lib/systemd/system/refit-$d.service"
    grep -n '@[A-Z_]*@' "$u" && fail "refit-$d.service still has @...@ placeholders"
    grep -q "^ExecStart=$PREFIX/bin/refit-$d --config /etc/refit/$d.conf\$" "$u" ||
        fail "refit-$d.service: ExecStart does not run $PREFIX/bin/refit-$d: $(grep ExecStart "$u")"
    [ -f "$DEST/etc/refit/$d.conf.example" ] || fail "no /etc/refit/$d.conf.example installed"
done

# The installed programs run and say who they are.
"$P/bin/refitctl" --help > "$E2E_DIR/ctl-help.out" 2>&1 || fail "installed refitctl --help exited $?"
grep -q "usage: refitctl" "$E2E_DIR/ctl-help.out" || fail "installed refitctl --help printed no usage"
pcver=$(PKG_CONFIG_PATH=$P/lib/pkgconfig pkg-config --modversion refit) ||
    fail "pkg-config cannot read the installed refit.pc"
for d in publisherd receiverd; do
    out=$("$P/bin/refit-$d" --version 2>&1) || fail "installed refit-$d --version exited $?"
    [ "$out" = "refit-$d $pcver" ] ||
        fail "refit-$d --version says '$out', refit.pc says version $pcver"
    out=$("$P/bin/refit-$d" --config "$DEST/etc/refit/$d.conf.example" \
        --cluster-key-file "$E2E_DIR/cluster.key" --check-config 2>&1) ||
        fail "installed refit-$d rejects its installed example config: $out"
    echo "$out" | grep -q "configuration is valid" || fail "refit-$d --check-config said: $out"
    # The check must be able to fail: an unknown key is reported with file and line.
    { cat "$DEST/etc/refit/$d.conf.example"; echo "no_such_key = 1"; } > "$E2E_DIR/bad-$d.conf"
    out=$("$P/bin/refit-$d" --config "$E2E_DIR/bad-$d.conf" --check-config 2>&1) &&
        fail "refit-$d --check-config accepted an unknown key"
    echo "$out" | grep -q "bad-$d.conf" || fail "refit-$d --check-config did not name the file: $out"
done

# A C program against the installed header and library, through the installed refit.pc.
cat > "$E2E_DIR/prog.c" <<'EOF'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <refit.h>

int main(int argc, char **argv)
{
    refit_client *c = NULL;
    char *json = NULL;
    int rc;

    if (argc != 2)
        return 2;
    rc = refit_connect(argv[1], "e2e-install", 0, REFIT_CTL, &c);
    if (rc < 0) {
        fprintf(stderr, "connect: %s\n", refit_last_error(NULL));
        return 1;
    }
    rc = refit_status_json(c, &json);
    if (rc < 0) {
        fprintf(stderr, "status: %s\n", refit_last_error(c));
        refit_close(c);
        return 1;
    }
    printf("%s\n", json);
    free(json);
    refit_close(c);
    return 0;
}
EOF
flags=$(PKG_CONFIG_PATH=$P/lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$DEST pkg-config --cflags --libs refit) ||
    fail "pkg-config --cflags --libs refit failed on the installed refit.pc"
case $flags in *"-I$P/include"*"-L$P/lib"*"-lrefit"*) ;; *) fail "refit.pc gives '$flags'" ;; esac
# A sanitizer build (make asan) installs a librefit that needs the sanitizer runtime first:
# the program is built with the same sanitizers, as a user of that library would.
san=""
ldd "$P/lib/librefit.so.0" | grep -q libasan && san="-fsanitize=address,undefined"
cc -std=c11 -Wall -Werror $san -o "$E2E_DIR/prog" "$E2E_DIR/prog.c" $flags \
    > "$E2E_DIR/cc.log" 2>&1 || { cat "$E2E_DIR/cc.log"; fail "cannot build a program against the installed refit.h/librefit"; }
LD_LIBRARY_PATH=$P/lib ldd "$E2E_DIR/prog" | grep -q "librefit.so.0 => $P/lib/librefit.so.0" ||
    fail "the test program does not load the installed librefit.so.0: $(LD_LIBRARY_PATH=$P/lib ldd "$E2E_DIR/prog" | grep refit)"

# A real refit, every daemon and client from the install.
BIN=$P/bin
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
start_publisher 0 2
start_receiver 0 4
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions 2
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions 2
wait_ok tr eng
grep -q "version 2 committed.*0 wrong" "$E2E_DIR/eng.log" ||
    fail "engine (installed refit-sim-engine) did not verify version 2"

out=$(LD_LIBRARY_PATH=$P/lib "$E2E_DIR/prog" "$E2E_DIR/pub0.sock" 2>&1) ||
    fail "the test program could not read the coordinator's status: $out"
echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["committed"] == 2 else 1)' ||
    fail "status read by the test program does not say committed 2: $out"

# The installed Python package, over the installed library.
PYDIR=$P/lib/python3/dist-packages
out=$(cd / && env -u BUILD PYTHONPATH=$PYDIR REFIT_LIB=$P/lib/librefit.so.0 python3 -c '
import json, sys, refit
assert refit.__file__.startswith(sys.argv[1]), "imported " + refit.__file__
with refit.Client(refit.CTL, "e2e-install-py", socket=sys.argv[2]) as c:
    print(json.loads(c.status())["committed"])
' "$PYDIR" "$E2E_DIR/pub0.sock" 2>&1) || fail "installed Python package failed: $out"
[ "$out" = 2 ] || fail "installed Python package read committed '$out', expected 2"
# Without REFIT_LIB the package only looks in a source tree's build/ (see the report).
if ! (cd / && env -u BUILD -u REFIT_LIB PYTHONPATH=$PYDIR python3 -c 'import refit; refit._load()') \
        > /dev/null 2>&1; then
    echo "note: the installed Python package needs REFIT_LIB=$PREFIX/lib/librefit.so.0 to find librefit"
fi

echo "ok: make install (PREFIX=$PREFIX, DESTDIR) installed programs, library, header, refit.pc," \
     "Python package, units and configs; a refit ran on the installed programs"

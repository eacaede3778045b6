#!/bin/sh
# tests/e2e/10-systemd-verify.sh - expands the unit templates in systemd/ into a temporary
# directory and runs `systemd-analyze verify` on them; any message about our units fails.
# Skips (exit 0) where systemd-analyze is not installed.
set -u

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "SKIP: systemd-analyze not found; install systemd to check the units"
    exit 0
fi

root=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-build}
case $BUILD in /*) build=$BUILD ;; *) build=$root/$BUILD ;; esac

tmp=$(mktemp -d /tmp/refit-systemd-verify.XXXXXX) || exit 1
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM
mkdir "$tmp/bin"

# verify checks that ExecStart= names an executable: use the built daemons, or a stand-in
# where a daemon is not built in this tree yet.
for d in refit-publisherd refit-receiverd; do
    if [ -x "$build/$d" ]; then
        ln -s "$build/$d" "$tmp/bin/$d"
    else
        echo "note: $build/$d not built; verifying against a stand-in executable"
        printf '#!/bin/sh\nexit 0\n' >"$tmp/bin/$d"
        chmod +x "$tmp/bin/$d"
    fi
done

# Prints every line of verify's output that concerns the units in $1; returns verify's
# status when it is not 0.
verify() {
    out=$(cd "$1" && systemd-analyze verify --man=no "$1"/*.service 2>&1)
    rc=$?
    printf '%s\n' "$out" | grep -e 'refit-' -e "$1" || true
    [ $rc -eq 0 ] || { echo "systemd-analyze verify exited $rc"; return $rc; }
    if printf '%s\n' "$out" | grep -q -e 'refit-' -e "$1"; then
        return 1
    fi
    return 0
}

fail=0
mkdir "$tmp/units"
for d in refit-publisherd refit-receiverd; do
    sed "s|@BINDIR@|$tmp/bin|g" "$root/systemd/$d.service.in" >"$tmp/units/$d.service"
    if grep -n '@[A-Z_]*@' "$tmp/units/$d.service"; then
        echo "FAIL: $d.service has unexpanded placeholders"
        fail=1
    fi
    grep -q "^ExecStart=$tmp/bin/$d --config /etc/refit/" "$tmp/units/$d.service" || {
        echo "FAIL: $d.service: ExecStart does not run $d with its config"
        fail=1
    }
done
if ! verify "$tmp/units"; then
    echo "FAIL: systemd-analyze verify reported problems in the units above"
    fail=1
fi

# The check itself must be able to fail: a unit with an unknown key has to be caught.
mkdir "$tmp/broken"
sed 's|^Type=notify|Type=notify\nNoSuchSetting=1|' "$tmp/units/refit-publisherd.service" \
    >"$tmp/broken/refit-publisherd.service"
if verify "$tmp/broken" >/dev/null 2>&1; then
    echo "FAIL: systemd-analyze verify did not report an unknown key; the check is blind"
    fail=1
fi

[ $fail -eq 0 ] && echo "PASS: systemd units verify cleanly"
exit $fail

#!/usr/bin/env bash
# scripts/mutate.sh - mutation testing: applies each mutation of a table to a copy of the source
# tree, builds the copy and runs the tests that must catch it; reports killed/survived per
# mutant and the kill ratio. The working tree itself is never modified.
#
# usage: scripts/mutate.sh [-t TABLE] [-k] [-n] [-j JOBS] [-o OUTFILE] [ID...]
#   -t TABLE   the mutation table (default scripts/mutations.txt)
#   -k         keep the copy (its path is printed); MUTATE_DIR=path reuses such a copy
#   -n         skip the baseline run of the tests on the unmutated copy
#   -j JOBS    make -j (default 2)
#   -o OUTFILE also write the report lines to OUTFILE
#   ID...      only the mutants with these ids
#
# Table: one mutant per line, fields separated by TABs, '#' starts a comment line:
#   id <TAB> file <TAB> original text <TAB> replacement <TAB> tests
# The original text must occur exactly once in the file. In both texts \t stands for a tab
# and \n for a newline. tests is a space-separated list of
#   test_x            build/tests/test_x, every test in it
#   test_x:FILTER     build/tests/test_x --filter FILTER (Criterion's glob, e.g. xfer_check/*)
#   tests/e2e/NN.sh   the e2e script, BUILD=build
# A mutant is killed when any of its tests fails (or times out, MUTATE_TIMEOUT s, default
# 600), survives when all pass; one whose copy does not build is reported as "unbuildable"
# and left out of the ratio (the compiler caught it, not the tests).
set -u

here=$(cd "$(dirname "$0")/.." && pwd)
table=$here/scripts/mutations.txt
keep=0
baseline=1
jobs=2
outfile=
timeout_s=${MUTATE_TIMEOUT:-600}

while getopts "t:knj:o:h" opt; do
    case $opt in
    t) table=$OPTARG ;;
    k) keep=1 ;;
    n) baseline=0 ;;
    j) jobs=$OPTARG ;;
    o) outfile=$OPTARG ;;
    *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
want_ids=" $* "

if [ ! -r "$table" ]; then
    echo "mutate: cannot read the mutation table $table" >&2
    exit 2
fi

say() {
    echo "$*"
    if [ -n "$outfile" ]; then echo "$*" >>"$outfile"; fi
}

# The copy: tracked and untracked (not ignored) files of the working tree.
if [ -n "${MUTATE_DIR:-}" ]; then
    work=$MUTATE_DIR
    mkdir -p "$work" || exit 2
    keep=1
else
    work=$(mktemp -d /tmp/refit-mutate.XXXXXX) || exit 2
fi
cleanup() {
    if [ "$keep" = 1 ]; then echo "mutate: the copy stays in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
(cd "$here" && git ls-files -co --exclude-standard -z |
    tar --null -T - -cf - 2>/dev/null) | tar -xf - -C "$work" || {
    echo "mutate: copying the source tree to $work failed" >&2
    exit 2
}
echo "mutate: source tree copied to $work"

build() {
    make -C "$work" -s -j"$jobs" BUILD=build all >"$work/.mutate-build.log" 2>&1
}

# Runs one test spec in the copy; returns its exit status (124: timed out).
run_test() {
    local spec=$1 bin filter
    case $spec in
    tests/e2e/*)
        (cd "$work" && BUILD=build timeout "$timeout_s" "$spec") >"$work/.mutate-test.log" 2>&1
        ;;
    test_*)
        bin=${spec%%:*}
        filter=
        [ "$bin" != "$spec" ] && filter=${spec#*:}
        if [ ! -x "$work/build/tests/$bin" ]; then
            echo "mutate: no test binary build/tests/$bin in the copy" >"$work/.mutate-test.log"
            return 127
        fi
        (cd "$work" && timeout "$timeout_s" "build/tests/$bin" ${filter:+--filter "$filter"}) \
            >"$work/.mutate-test.log" 2>&1
        ;;
    *)
        echo "mutate: unknown test spec '$spec'" >"$work/.mutate-test.log"
        return 127
        ;;
    esac
}

# Replaces the one occurrence of $2 in file $1 by $3 (\t and \n unescaped); 1: not found,
# 2: more than one.
apply() {
    python3 - "$1" "$2" "$3" <<'EOF'
import sys
path, old, new = sys.argv[1], sys.argv[2], sys.argv[3]
un = lambda s: s.replace('\\t', '\t').replace('\\n', '\n')
old, new = un(old), un(new)
src = open(path).read()
n = src.count(old)
if n != 1:
    sys.exit(1 if n == 0 else 2)
open(path, 'w').write(src.replace(old, new))
EOF
}

echo "mutate: building the unmutated copy"
if ! build; then
    echo "mutate: the unmutated copy does not build; see $work/.mutate-build.log" >&2
    tail -20 "$work/.mutate-build.log" >&2
    keep=1
    exit 2
fi

# Reads the table into parallel arrays, the selected ids only.
ids=() files=() olds=() news=() tests=()
while IFS=$'\t' read -r id file old new tst rest; do
    case $id in '' | '#'*) continue ;; esac
    if [ -z "${tst:-}" ] || [ -n "${rest:-}" ]; then
        echo "mutate: table line of '$id' needs 5 tab-separated fields" >&2
        exit 2
    fi
    if [ "$want_ids" != "  " ] && [[ $want_ids != *" $id "* ]]; then continue; fi
    ids+=("$id") files+=("$file") olds+=("$old") news+=("$new") tests+=("$tst")
done <"$table"
if [ ${#ids[@]} = 0 ]; then
    echo "mutate: no mutant selected from $table" >&2
    exit 2
fi

# Every test must pass on the unmutated copy, or a kill would mean nothing.
if [ "$baseline" = 1 ]; then
    declare -A seen=()
    for t in "${tests[@]}"; do
        for spec in $t; do
            [ -n "${seen[$spec]:-}" ] && continue
            seen[$spec]=1
            if ! run_test "$spec"; then
                echo "mutate: $spec fails on the unmutated copy:" >&2
                tail -15 "$work/.mutate-test.log" >&2
                exit 2
            fi
        done
    done
    echo "mutate: baseline: every listed test passes unmutated"
fi

killed=0 survived=0 unbuildable=0 bad=0
for i in "${!ids[@]}"; do
    id=${ids[$i]} f=${files[$i]}
    t0=$(date +%s)
    if [ ! -f "$work/$f" ]; then
        say "ERROR       $id: no file $f"
        bad=$((bad + 1))
        continue
    fi
    cp "$work/$f" "$work/.mutate-orig"
    apply "$work/$f" "${olds[$i]}" "${news[$i]}"
    rc=$?
    if [ $rc != 0 ]; then
        say "ERROR       $id: the original text occurs $([ $rc = 1 ] && echo "nowhere" || echo "more than once") in $f"
        bad=$((bad + 1))
        continue
    fi
    if ! build; then
        verdict=unbuildable
        unbuildable=$((unbuildable + 1))
        by="(compiler)"
    else
        verdict=SURVIVED
        by=
        for spec in ${tests[$i]}; do
            run_test "$spec"
            rc=$?
            if [ $rc != 0 ]; then
                verdict=killed
                by="by $spec (exit $rc)"
                break
            fi
        done
        if [ $verdict = killed ]; then killed=$((killed + 1)); else survived=$((survived + 1)); fi
    fi
    # Restored with a new mtime, so the next build recompiles what the mutant changed.
    cp "$work/.mutate-orig" "$work/$f"
    touch "$work/$f"
    say "$(printf '%-11s %s: %s %s (%d s)' "$verdict" "$id" "$f" "$by" $(($(date +%s) - t0)))"
done
build || echo "mutate: warning: the restored copy no longer builds" >&2

total=$((killed + survived))
if [ $total -gt 0 ]; then
    say "$(printf 'mutate: %d of %d mutants killed (%d%%), %d survived, %d unbuildable, %d bad table lines' \
        $killed $total $((100 * killed / total)) $survived $unbuildable $bad)"
else
    say "mutate: no mutant built ($unbuildable unbuildable, $bad bad table lines)"
fi
[ $survived = 0 ] && [ $bad = 0 ]

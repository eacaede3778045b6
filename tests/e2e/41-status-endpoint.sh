#!/bin/bash
# tests/e2e/41-status-endpoint.sh - /metrics and /status of the coordinator and of a receiver,
# scraped (python3 urllib: curl is not guaranteed) before and many times during a run of 10
# refits (qwen3-0.6b shrunk, tp=2 -> tp=4). The Prometheus text must parse (HELP/TYPE lines,
# every sample `name{labels} value`, no duplicate series, consistent histograms) and the
# values must move: refits committed, committed version, stage histogram counts, bytes. Then
# `refitctl status` (human and --json) and refitctl's exit codes: 0 ok, 1 failed operation,
# 2 bad usage, 3 no daemon.
. "$(dirname "$0")/lib.sh"
E2E_PUBLISHERS=1 E2E_RECEIVERS=1
VERSIONS=10

start_publisher 0 2
start_receiver 0 4
st_port PUB_HTTP "$E2E_DIR/pub0.log" 10
st_port RECV_HTTP "$E2E_DIR/recv0.log" 10

cat > "$E2E_DIR/scrape.py" <<'EOF'
import json, math, re, sys, time, urllib.error, urllib.request

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(r"^(%s)(?:\{((?:%s)(?:,%s)*,?)?\})? (\S+)(?: -?[0-9]+)?$" % (NAME, LABEL, LABEL))
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
HELP = re.compile(r"^# HELP (%s) .*$" % NAME)
TYPE = re.compile(r"^# TYPE (%s) (counter|gauge|histogram|summary|untyped)$" % NAME)
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def parse(text):
    """Prometheus text format 0.0.4 -> {(name, ((label, value), ...)): float}; raises
    ValueError naming the line on anything malformed."""
    types, helps, series, seen_families = {}, set(), {}, []
    if text and not text.endswith("\n"):
        raise ValueError("the text does not end with a newline")
    for no, line in enumerate(text.split("\n")[:-1], 1):
        if line == "":
            continue
        if line.startswith("#"):
            m = HELP.match(line)
            if m:
                if m.group(1) in helps:
                    raise ValueError("line %d: second HELP for %s" % (no, m.group(1)))
                helps.add(m.group(1))
                continue
            m = TYPE.match(line)
            if m:
                fam = m.group(1)
                if fam in types:
                    raise ValueError("line %d: second TYPE for %s" % (no, fam))
                if any(f[0] == fam for f in seen_families):
                    raise ValueError("line %d: TYPE of %s after its samples" % (no, fam))
                types[fam] = m.group(2)
                continue
            if line.startswith("# HELP") or line.startswith("# TYPE"):
                raise ValueError("line %d: malformed HELP/TYPE line: %r" % (no, line))
            continue
        m = SAMPLE.match(line)
        if not m:
            raise ValueError("line %d: not `name{labels} value`: %r" % (no, line))
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            raise ValueError("line %d: value %r is not a number" % (no, value)) from None
        lab = tuple(sorted(LABEL_RE.findall(labels)))
        if len({k for k, _ in lab}) != len(lab):
            raise ValueError("line %d: a label given twice: %r" % (no, line))
        fam = None
        for f, t in types.items():
            if name == f or any(name == f + s for s in SUFFIXES.get(t, ())):
                fam = f
        if fam is None:
            raise ValueError("line %d: sample %s has no TYPE line before it" % (no, name))
        if types[fam] == "histogram" and name == fam:
            raise ValueError("line %d: histogram %s sample without _bucket/_sum/_count" % (no, name))
        if name.endswith("_bucket") and types[fam] == "histogram" and "le" not in dict(lab):
            raise ValueError("line %d: histogram bucket without le: %r" % (no, line))
        if (name, lab) in series:
            raise ValueError("line %d: duplicate series %r" % (no, line))
        series[(name, lab)] = v
        seen_families.append((fam, no))
    check_histograms(series, types)
    return series


def check_histograms(series, types):
    for fam, t in types.items():
        if t != "histogram":
            continue
        groups = {}
        for (name, lab), v in series.items():
            if name == fam + "_bucket":
                d = dict(lab)
                le = float(d.pop("le"))
                groups.setdefault(tuple(sorted(d.items())), []).append((le, v))
        for key, buckets in groups.items():
            buckets.sort()
            if buckets[-1][0] != math.inf:
                raise ValueError("histogram %s%s has no le=\"+Inf\" bucket" % (fam, dict(key)))
            counts = [c for _, c in buckets]
            if counts != sorted(counts):
                raise ValueError("histogram %s%s: buckets not cumulative: %s" % (fam, dict(key), buckets))
            if series.get((fam + "_count", key)) != counts[-1]:
                raise ValueError("histogram %s%s: _count %s != +Inf bucket %s" % (
                    fam, dict(key), series.get((fam + "_count", key)), counts[-1]))
            if (fam + "_sum", key) not in series:
                raise ValueError("histogram %s%s has no _sum" % (fam, dict(key)))


def selftest():
    """The parser must reject what it is meant to catch, or the checks below are blind."""
    good = '# HELP a_total x\n# TYPE a_total counter\na_total{r="x"} 1\n'
    parse(good)
    bad = [good + 'a_total{r="x"} 2\n', good + "b 1\n", good.replace("} 1", "} one"),
           good.replace('{r="x"}', "{r=x}"), good + "# TYPE a_total gauge\n",
           "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
           good.rstrip("\n")]
    for b in bad:
        try:
            parse(b)
        except ValueError:
            continue
        raise SystemExit("FAIL: the metrics parser accepted malformed text: %r" % b)


def get(port, path):
    url = "http://127.0.0.1:%d%s" % (port, path)
    with urllib.request.urlopen(url, timeout=5) as r:
        if r.status != 200:
            raise SystemExit("FAIL: GET %s answered %d" % (url, r.status))
        return r.headers.get("Content-Type", ""), r.read().decode()


def scrape(port, who):
    ctype, text = get(port, "/metrics")
    if not ctype.startswith("text/plain"):
        raise SystemExit("FAIL: %s /metrics Content-Type is %r" % (who, ctype))
    try:
        m = parse(text)
    except ValueError as e:
        raise SystemExit("FAIL: %s /metrics does not parse as Prometheus text: %s\n%s" % (who, e, text))
    ctype, body = get(port, "/status")
    try:
        st = json.loads(body)
    except ValueError as e:
        raise SystemExit("FAIL: %s /status is not JSON (%s): %r" % (who, e, body[:300]))
    return {"t": time.time(), "metrics": m, "status": st}


def val(snap, name, **labels):
    """A sample's value, 0 when absent (a labelled counter not yet incremented)."""
    want = tuple(sorted(labels.items()))
    return snap["metrics"].get((name, want), 0.0)


def total(snap, name, **labels):
    """Sum over every series of name whose labels include labels."""
    return sum(v for (n, lab), v in snap["metrics"].items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def stages(snap, fam):
    return sorted({dict(lab)["stage"] for (n, lab) in snap["metrics"] if n == fam + "_count"})


def main():
    selftest()
    mode, pub, recv, versions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
    state = sys.argv[4]
    daemons = {"coordinator": pub, "receiver": recv}
    if mode == "initial":
        snaps = {w: scrape(p, w) for w, p in daemons.items()}
        for w, s in snaps.items():
            if s["status"].get("committed") != 0 or val(s, "refit_committed_version") != 0:
                raise SystemExit("FAIL: %s reports a committed version before any refit" % w)
        with open(state, "w") as f:
            json.dump({w: {"status": s["status"], "metrics": [[n, list(map(list, lab)), v]
                           for (n, lab), v in s["metrics"].items()]} for w, s in snaps.items()}, f)
        return
    with open(state) as f:
        raw = json.load(f)
    hist = {w: [{"t": 0, "status": raw[w]["status"],
                 "metrics": {(n, tuple(map(tuple, lab))): v for n, lab, v in raw[w]["metrics"]}}]
            for w in daemons}
    deadline = time.time() + 45
    while True:
        for w, p in daemons.items():
            hist[w].append(scrape(p, w))
        if all(h[-1]["status"].get("committed", 0) >= versions for h in hist.values()):
            break
        if time.time() > deadline:
            raise SystemExit("FAIL: version %d not committed on both daemons within 45 s "
                             "(coordinator %s, receiver %s)" % (versions,
                             hist["coordinator"][-1]["status"].get("committed"),
                             hist["receiver"][-1]["status"].get("committed")))
        time.sleep(0.04)
    time.sleep(0.3)  # let the last refit's accounting settle, then a final scrape
    for w, p in daemons.items():
        hist[w].append(scrape(p, w))

    errors = []
    for w, h in hist.items():
        first, last = h[0], h[-1]
        # Counters and histogram series never go down; the committed version never goes down.
        for i in range(1, len(h)):
            for key, v in h[i - 1]["metrics"].items():
                n = key[0]
                mono = n.endswith("_total") or n.endswith("_count") or n.endswith("_sum") or \
                    n.endswith("_bucket") or n.endswith("committed_version")
                if mono and h[i]["metrics"].get(key, -1) < v:
                    errors.append("%s: %s%s went down from %s to %s between scrapes" % (
                        w, n, dict(key[1]), v, h[i]["metrics"].get(key)))
            if h[i]["status"].get("committed", 0) < h[i - 1]["status"].get("committed", 0):
                errors.append("%s: /status committed went down" % w)
        seen = sorted({s["metrics"].get(("refit_committed_version", ()), -1) for s in h})
        mid = [v for v in seen if 0 < v < versions]
        if not mid:
            errors.append("%s: no scrape during the run saw a committed version between 0 and "
                          "%d (saw %s): the values do not move while refits run" % (w, versions, seen))
        if val(last, "refit_committed_version") != versions:
            errors.append("%s: refit_committed_version is %s after %d refits" % (
                w, val(last, "refit_committed_version"), versions))
        d = val(last, "refit_refits_total", result="committed") - \
            val(first, "refit_refits_total", result="committed")
        if d != versions:
            errors.append("%s: refit_refits_total{result=\"committed\"} grew by %s, not %d" % (w, d, versions))
        if total(last, "refit_refits_total") - total(first, "refit_refits_total") != versions:
            errors.append("%s: refits with another result than committed: %s" % (w, {
                dict(l)["result"]: v for (n, l), v in last["metrics"].items() if n == "refit_refits_total"}))
        st = stages(last, "refit_stage_seconds")
        if "transfer" not in st:
            errors.append("%s: no refit_stage_seconds{stage=\"transfer\"} histogram (stages %s)" % (w, st))
        for stage in st:
            d = val(last, "refit_stage_seconds_count", stage=stage) - \
                val(first, "refit_stage_seconds_count", stage=stage)
            if d != versions:
                errors.append("%s: refit_stage_seconds_count{stage=\"%s\"} grew by %s, not %d" % (
                    w, stage, d, versions))
            if val(last, "refit_stage_seconds_sum", stage=stage) <= 0:
                errors.append("%s: refit_stage_seconds_sum{stage=\"%s\"} is not > 0" % (w, stage))
        if last["status"].get("committed") != versions:
            errors.append("%s: /status committed is %s" % (w, last["status"].get("committed")))
        lr = last["status"].get("last_refit") or {}
        if lr.get("version") != versions or lr.get("result") != "committed":
            errors.append("%s: /status last_refit is %s" % (w, lr))
        if not (last["status"].get("coordinator") or {}).get("connected"):
            errors.append("%s: /status says the coordinator is not connected" % w)

    c, r = hist["coordinator"], hist["receiver"]
    cs = c[-1]["status"].get("cluster")
    if not isinstance(cs, dict):
        errors.append("coordinator /status has no cluster object: %s" % c[-1]["status"])
    else:
        if cs.get("committed") != versions:
            errors.append("coordinator /status cluster.committed is %s" % cs.get("committed"))
        members = {(m.get("role"), m.get("index")): m for m in cs.get("members", [])}
        for key in (("publisher", 0), ("receiver", 0)):
            if key not in members or not members[key].get("connected"):
                errors.append("coordinator /status cluster.members lacks a connected %s %d: %s" % (
                    key + (cs.get("members"),)))
        plan_bytes = (cs.get("plan") or {}).get("dst_bytes", 0)
        if plan_bytes <= 0:
            errors.append("coordinator /status cluster.plan.dst_bytes is %s" % plan_bytes)
        # One publisher and one receiver: every planned byte goes from one to the other.
        sent = total(c[-1], "refit_bytes_total", direction="sent") - \
            total(c[0], "refit_bytes_total", direction="sent")
        got = total(r[-1], "refit_bytes_total", direction="received") - \
            total(r[0], "refit_bytes_total", direction="received")
        if sent != versions * plan_bytes or got != versions * plan_bytes:
            errors.append("refit_bytes_total grew by %s sent (coordinator) and %s received "
                          "(receiver), expected %d x %d" % (sent, got, versions, plan_bytes))
        mid_bytes = {total(s, "refit_bytes_total", direction="received") for s in r}
        if len(mid_bytes) < 3:
            errors.append("receiver refit_bytes_total took only the values %s" % sorted(mid_bytes))
    if val(c[-1], "refit_cluster_committed_version") != versions:
        errors.append("refit_cluster_committed_version is %s" % val(c[-1], "refit_cluster_committed_version"))
    d = val(c[-1], "refit_cluster_refits_total", result="committed") - \
        val(c[0], "refit_cluster_refits_total", result="committed")
    if d != versions:
        errors.append("refit_cluster_refits_total{result=\"committed\"} grew by %s" % d)
    for stage in stages(c[-1], "refit_cluster_stage_seconds"):
        d = val(c[-1], "refit_cluster_stage_seconds_count", stage=stage) - \
            val(c[0], "refit_cluster_stage_seconds_count", stage=stage)
        if d != versions:
            errors.append("refit_cluster_stage_seconds_count{stage=\"%s\"} grew by %s" % (stage, d))
    if not stages(c[-1], "refit_cluster_stage_seconds"):
        errors.append("coordinator has no refit_cluster_stage_seconds histogram")
    if val(c[-1], "refit_members_connected") != 2:
        errors.append("refit_members_connected is %s, expected 2" % val(c[-1], "refit_members_connected"))

    # Unknown pages and methods are refused, not served.
    for path in ("/nope", "/metrics/x"):
        try:
            get(pub, path)
            errors.append("GET %s answered 200" % path)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                errors.append("GET %s answered %d, expected 404" % (path, e.code))
    try:
        urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:%d/metrics" % pub,
                                                      data=b"x", method="POST"), timeout=5)
        errors.append("POST /metrics answered 200")
    except urllib.error.HTTPError as e:
        if e.code != 405:
            errors.append("POST /metrics answered %d, expected 405" % e.code)

    if errors:
        print("FAIL: status endpoints:\n  " + "\n  ".join(errors))
        sys.exit(1)
    print("status endpoints: %d scrapes per daemon, committed versions seen %s" % (
        len(c), sorted({s["metrics"].get(("refit_committed_version", ()), -1) for s in c})))


main()
EOF

python3 "$E2E_DIR/scrape.py" initial "$PUB_HTTP" "$RECV_HTTP" "$E2E_DIR/snap0.json" $VERSIONS ||
    fail "scrape before the run"
start_engine eng 0 --model qwen3-0.6b --shrink 8 --layout tp=4 --versions $VERSIONS
start_trainer tr 0 --model qwen3-0.6b --shrink 8 --layout tp=2 --versions $VERSIONS
python3 "$E2E_DIR/scrape.py" poll "$PUB_HTTP" "$RECV_HTTP" "$E2E_DIR/snap0.json" $VERSIONS ||
    fail "metrics and status during the run (above)"
wait_ok tr eng
grep -q "version $VERSIONS committed.*0 wrong" "$E2E_DIR/eng.log" ||
    fail "engine did not verify version $VERSIONS"

# refitctl status, for people and as JSON, on both daemons.
for d in pub0 recv0; do
    out=$(ctl --socket "$E2E_DIR/$d.sock" status 2>&1) || fail "refitctl status on $d exited $?: $out"
    echo "$out" | grep -Eq "^committed +version $VERSIONS\$" ||
        fail "refitctl status on $d does not show committed version $VERSIONS:"$'\n'"$out"
    echo "$out" | grep -Eq "^last refit +version $VERSIONS committed" ||
        fail "refitctl status on $d does not show the last refit:"$'\n'"$out"
    ctl --socket "$E2E_DIR/$d.sock" status --json > "$E2E_DIR/$d.status.json" ||
        fail "refitctl status --json on $d exited $?"
    python3 - "$E2E_DIR/$d.status.json" $VERSIONS <<'EOF' || fail "refitctl status --json on $d (above)"
import json, sys
d = json.load(open(sys.argv[1]))
v = int(sys.argv[2])
if d.get("committed") != v or (d.get("last_refit") or {}).get("version") != v:
    sys.exit("FAIL: refitctl status --json: committed %s, last_refit %s" % (d.get("committed"), d.get("last_refit")))
if d.get("role") == "coordinator":
    members = d.get("cluster", {}).get("members", [])
    if sorted(m.get("role") for m in members) != ["publisher", "receiver"]:
        sys.exit("FAIL: refitctl status --json cluster members: %s" % members)
EOF
done
out=$(ctl --socket "$E2E_DIR/pub0.sock" status)
echo "$out" | grep -Eq "^cluster +idle, committed version $VERSIONS" ||
    fail "refitctl status on the coordinator has no cluster line:"$'\n'"$out"
echo "$out" | grep -Eq "^ +publisher +0 .*connected" && echo "$out" | grep -Eq "^ +receiver +0 .*connected" ||
    fail "refitctl status on the coordinator does not list both members:"$'\n'"$out"

# Exit codes: 3 no daemon, 2 bad usage, 1 failed operation, 0 success.
expect_rc() {
    local want=$1 what=$2; shift 2
    local out rc
    out=$(ctl "$@" 2>&1)
    rc=$?
    [ $rc = "$want" ] || fail "refitctl $* ($what) exited $rc, expected $want: $out"
    if [ "$want" != 0 ]; then
        [ -n "$out" ] || fail "refitctl $* ($what) exited $rc without saying why"
    fi
}
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' "$E2E_DIR/stale.sock"
expect_rc 3 "no socket file" --socket "$E2E_DIR/none.sock" status
expect_rc 3 "socket file nobody listens on" --socket "$E2E_DIR/stale.sock" status
expect_rc 3 "no daemon, wait" --socket "$E2E_DIR/none.sock" wait 1 --timeout 0.5
expect_rc 2 "unknown command" --socket "$E2E_DIR/pub0.sock" frobnicate
expect_rc 2 "no command" --socket "$E2E_DIR/pub0.sock"
expect_rc 2 "unknown option" --socket "$E2E_DIR/pub0.sock" status --bogus
expect_rc 2 "wait without a version" --socket "$E2E_DIR/pub0.sock" wait
expect_rc 2 "version not a number" --socket "$E2E_DIR/pub0.sock" wait abc
t0=$(date +%s.%N)
expect_rc 1 "wait for a version that never comes" --socket "$E2E_DIR/pub0.sock" wait 999 --timeout 0.5
t1=$(date +%s.%N)
python3 -c 'import sys; d=float(sys.argv[2])-float(sys.argv[1]); sys.exit(0 if 0.4 <= d < 5 else 1)' "$t0" "$t1" ||
    fail "refitctl wait 999 --timeout 0.5 returned after $(python3 -c "print(round($t1-$t0,2))") s"
expect_rc 1 "refit of a version not newer than the committed one" --socket "$E2E_DIR/pub0.sock" refit --version 3
expect_rc 0 "wait for a committed version" --socket "$E2E_DIR/pub0.sock" wait $VERSIONS --timeout 2
expect_rc 0 "wait for a committed version, receiver" --socket "$E2E_DIR/recv0.sock" wait 5 --timeout 2
expect_rc 0 "help" --help

echo "ok: /metrics and /status moved over $VERSIONS refits and parse; refitctl status and exit codes"

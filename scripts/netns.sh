# scripts/netns.sh - a cluster of "nodes" on this one machine: each daemon in a network
# namespace of its own, joined by a veth pair to a bridge in one more namespace, with a token
# bucket (tc tbf) on both ends of every veth, so each node has a link of a given rate each way.
# Sourced by tests/e2e/80-netns-cluster.sh and bench/bench_cluster.sh after tests/e2e/lib.sh,
# whose variables (E2E_DIR, E2E_COMMON, E2E_PIDS, BIN) and functions (fail, e2e_cleanup) it uses.
#
# Names. Every namespace of one run is called rfcl-PID-START-NODE: PID and START (the start time
# of the process that made it, in clock ticks since boot, /proc/PID/stat field 22) tell a live
# owner from a dead one even after the PID was reused, and the prefix rfcl- finds what runs that
# died by SIGKILL left behind (nc_reap). NODE is br (the bridge), pI (publisher I) or rI
# (receiver I). Interfaces live inside those namespaces, so their names (br0, eth0, pI, rI)
# never meet another run's. Addresses: publisher I is 10.77.0.(I+1), receiver I 10.77.1.(I+1),
# all in 10.77.0.0/16 on the one bridge; the coordinator listens on port 7470 in its namespace.
#
# Clean-up. nc_setup installs an EXIT trap that stops every process lib.sh started
# (e2e_cleanup), kills whatever still runs in this run's namespaces and deletes them; lib.sh's
# INT and TERM traps exit through it. A SIGKILLed run cannot clean up: the next run's nc_setup
# (or nc_reap) kills the processes in the namespaces of runs whose owner is gone and deletes
# them. A namespace's veth end goes with it, and the other end with its pair.

NC_PREFIX=rfcl
NC_COORD_PORT=7470
NC_OWNER=""
NC_RUN=""
NC_PUBLISHERS=0
NC_RECEIVERS=0
NC_RATE=""
NC_WHY=""

# nc_start_time PID: the process's start time (clock ticks since boot), or nothing when it is
# gone. The command name, field 2, may hold spaces and parentheses: fields are counted after
# its last ')'.
nc_start_time() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    # After the name: state is field 3, so start time (field 22) is the 20th here.
    set -- $stat
    echo "${20}"
}

# nc_available: whether this shell may make network namespaces, veths, a bridge and tbf qdiscs;
# when not, returns 1 with the reason in NC_WHY. It tries each for real in a namespace of its
# own (rfcl-PID-START-probe, deleted at once): a root user in a container without
# CAP_NET_ADMIN, or a kernel without veth, bridge or sch_tbf, fails here and not in the middle
# of a test.
nc_available() {
    local ns
    NC_WHY=""
    if ! command -v ip > /dev/null || ! command -v tc > /dev/null; then
        NC_WHY="no 'ip' or 'tc' command (install iproute2)"
        return 1
    fi
    if [ "$(id -u)" != 0 ]; then
        NC_WHY="network namespaces need root (running as uid $(id -u)); run as root"
        return 1
    fi
    nc_owner
    ns=$NC_RUN-probe
    if ! NC_WHY=$(ip netns add "$ns" 2>&1); then
        NC_WHY="'ip netns add $ns' failed: ${NC_WHY:-no message} (no CAP_SYS_ADMIN or no /run/netns?)"
        return 1
    fi
    if ! NC_WHY=$( { ip -n "$ns" link add br0 type bridge &&
                     ip -n "$ns" link add va type veth peer name vb &&
                     tc -n "$ns" qdisc add dev va root tbf rate 1gbit burst 128kb latency 10ms; } 2>&1)
    then
        ip netns del "$ns" 2>/dev/null
        NC_WHY="a bridge, veth pair or tbf qdisc cannot be made in a network namespace: \
${NC_WHY:-no message} (kernel modules bridge, veth, sch_tbf?)"
        return 1
    fi
    ip netns del "$ns"
    NC_WHY=""
    return 0
}

# nc_owner: sets NC_OWNER (PID-START of this shell) and NC_RUN (this run's name prefix).
nc_owner() {
    [ -n "$NC_RUN" ] && return 0
    NC_OWNER=$$-$(nc_start_time $$)
    NC_RUN=$NC_PREFIX-$NC_OWNER
}

# nc_wait_gone PID...: returns once every PID has exited (up to 5 s), woken by each exit
# (pidfd_open), not by polling.
nc_wait_gone() {
    [ $# -gt 0 ] || return 0
    python3 - "$@" <<'PY'
import os, select, sys, time
fds = []
for p in sys.argv[1:]:
    try:
        fds.append(os.pidfd_open(int(p)))
    except ProcessLookupError:
        pass
end = time.monotonic() + 5
while fds:
    ready, _, _ = select.select(fds, [], [], max(0.0, end - time.monotonic()))
    if not ready:
        break
    for f in ready:
        fds.remove(f)
        os.close(f)
PY
}

# nc_kill_ns NS: SIGKILLs every process in namespace NS and deletes it. A process killed there
# keeps the namespace alive until it is gone, so the deletion waits (up to 5 s) for them first.
nc_kill_ns() {
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null)
    if [ -n "$pids" ]; then
        kill -9 $pids 2>/dev/null
        nc_wait_gone $pids
    fi
    ip netns del "$ns" 2>/dev/null || true
}

# nc_reap: removes what runs of this library that are no longer alive left behind (killed by
# SIGKILL, which no trap sees): their processes and namespaces. Prints one line per run reaped.
nc_reap() {
    local ns rest pid start owners="" o
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        case $ns in $NC_PREFIX-*-*-*) ;; *) continue ;; esac
        rest=${ns#"$NC_PREFIX"-}
        pid=${rest%%-*}
        rest=${rest#*-}
        start=${rest%%-*}
        case $pid$start in *[!0-9]*) continue ;; esac
        [ "$(nc_start_time "$pid")" = "$start" ] && continue
        nc_kill_ns "$ns"
        case " $owners " in *" $pid-$start "*) ;; *) owners="$owners $pid-$start" ;; esac
    done
    for o in $owners; do
        echo "netns: removed the namespaces of an earlier run (process ${o%-*}) that died without cleaning up"
    done
}

# nc_cleanup: kills whatever runs in this run's namespaces and deletes them (nc_exit first
# stops what lib.sh started, with SIGTERM, so that the daemons end cleanly and their logs say so).
nc_cleanup() {
    local ns
    [ -n "$NC_RUN" ] || return 0
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        case $ns in "$NC_RUN"-*) nc_kill_ns "$ns" ;; esac
    done
}

# nc_exit: the EXIT trap; the script's exit status stays the one it exited with.
nc_exit() {
    local rc=$?
    type e2e_cleanup > /dev/null 2>&1 && e2e_cleanup
    nc_cleanup
    return $rc
}

# nc_ns pub|recv|br [INDEX]: the namespace of that node in this run.
nc_ns() {
    case $1 in
        pub) echo "$NC_RUN-p$2" ;;
        recv) echo "$NC_RUN-r$2" ;;
        br) echo "$NC_RUN-br" ;;
    esac
}

# nc_addr pub|recv INDEX: the node's address.
nc_addr() {
    case $1 in
        pub) echo "10.77.0.$(($2 + 1))" ;;
        recv) echo "10.77.1.$(($2 + 1))" ;;
    esac
}

# nc_port pub|recv INDEX: the name of the node's veth end in the bridge's namespace.
nc_port() {
    case $1 in pub) echo "p$2" ;; recv) echo "r$2" ;; esac
}

# nc_tbf NS DEV RATE: a token bucket of RATE (tc's units, e.g. 2gbit) on DEV's egress. The
# bucket holds 1 ms at the rate, at least 128 KiB: the veth passes GSO packets of up to 64 KiB,
# and a bucket smaller than a packet would make tbf split each one in software. The queue holds
# 10 ms at the rate beyond the bucket, enough for TCP to keep the link full without adding
# much delay.
nc_tbf() {
    local bits burst
    bits=$(nc_rate_bits "$3") || return 1
    burst=$((bits / 8 / 1000))
    [ $burst -lt 131072 ] && burst=131072
    tc -n "$1" qdisc add dev "$2" root tbf rate "$bits" burst "$burst" latency 10ms
}

# nc_rate_bits RATE: RATE (a number with k, m or g and "bit", e.g. 2gbit, 400mbit) in bit/s.
nc_rate_bits() {
    local r=${1%bit} mult=1
    case $r in
        *[kK]) mult=1000; r=${r%?} ;;
        *[mM]) mult=1000000; r=${r%?} ;;
        *[gG]) mult=1000000000; r=${r%?} ;;
    esac
    case $r in ''|*[!0-9.]*) echo "netns: bad rate '$1' (write e.g. 2gbit or 400mbit)" >&2; return 1 ;; esac
    python3 -S -c "print(int(float('$r') * $mult))"
}

# nc_add_node pub|recv INDEX: the node's namespace, its veth to the bridge, address and rate.
nc_add_node() {
    local ns br port
    ns=$(nc_ns "$1" "$2")
    br=$(nc_ns br)
    port=$(nc_port "$1" "$2")
    ip netns add "$ns" &&
    ip -n "$br" link add "$port" type veth peer name eth0 netns "$ns" &&
    ip -n "$br" link set "$port" master br0 up &&
    ip -n "$ns" link set lo up &&
    ip -n "$ns" addr add "$(nc_addr "$1" "$2")/16" dev eth0 &&
    ip -n "$ns" link set eth0 up &&
    nc_tbf "$ns" eth0 "$NC_RATE" &&
    nc_tbf "$br" "$port" "$NC_RATE"
}

# nc_setup PUBLISHERS RECEIVERS RATE: reaps dead runs' leftovers, installs the clean-up trap
# and builds this run's cluster network. Fails the test (lib.sh's fail) when a step fails.
nc_setup() {
    local i out br
    nc_owner
    NC_PUBLISHERS=$1 NC_RECEIVERS=$2 NC_RATE=$3
    nc_rate_bits "$NC_RATE" > /dev/null || fail "bad rate '$NC_RATE'"
    nc_reap
    trap nc_exit EXIT
    br=$(nc_ns br)
    out=$( { ip netns add "$br" &&
             ip -n "$br" link add br0 type bridge &&
             ip -n "$br" link set br0 up &&
             ip -n "$br" link set lo up; } 2>&1) ||
        fail "could not make the bridge namespace $br: $out"
    for ((i = 0; i < NC_PUBLISHERS; i++)); do
        out=$(nc_add_node pub $i 2>&1) || fail "could not make publisher node $i ($(nc_ns pub $i)): $out"
    done
    for ((i = 0; i < NC_RECEIVERS; i++)); do
        out=$(nc_add_node recv $i 2>&1) || fail "could not make receiver node $i ($(nc_ns recv $i)): $out"
    done
    # The coordinator's address replaces lib.sh's loopback one in every daemon's flags.
    E2E_COMMON=${E2E_COMMON/--coordinator-addr 127.0.0.1:$E2E_COORD_PORT/--coordinator-addr $(nc_addr pub 0):$NC_COORD_PORT}
    E2E_COORD_PORT=$NC_COORD_PORT
}

# nc_conf ROLE INDEX: writes the daemon's config file (E2E_DIR/ROLEINDEX.conf) and prints its
# path. It holds this node's identity and addresses, then DAEMON_CONF: extra "key = value"
# lines (newline separated) for every daemon, e.g. DAEMON_CONF='relay = on' once daemons know
# relays, or 'verify = full'. The flags of lib.sh's E2E_COMMON come on the command line.
nc_conf() {
    local f=$E2E_DIR/$1$2.conf
    {
        echo "# written by scripts/netns.sh for node $1 $2 in namespace $(nc_ns "$1" "$2")"
        echo "[common]"
        echo "node = $1$2"
        echo "host_id = $NC_RUN-$1$2"
        echo "data_listen = $(nc_addr "$1" "$2"):0"
        printf '%s\n' "${DAEMON_CONF:-}"
    } > "$f"
    echo "$f"
}

# nc_start_daemon pub|recv INDEX CLIENTS [flags...]: the daemon in its node's namespace, as
# lib.sh's start_publisher/start_receiver do on loopback (same flags, log, socket and PID
# variable PUBi_PID / RECVi_PID); publisher 0 is the coordinator.
nc_start_daemon() {
    local role=$1 idx=$2 clients=$3 conf bin name coord=""
    shift 3
    conf=$(nc_conf "$role" "$idx")
    if [ "$role" = pub ]; then
        bin=refit-publisherd name=PUB
        [ "$idx" = 0 ] && coord="--coordinator"
    else
        bin=refit-receiverd name=RECV
    fi
    ip netns exec "$(nc_ns "$role" "$idx")" "$BIN/$bin" --config "$conf" $E2E_COMMON \
        --local-copy "$E2E_LOCAL_COPY" $coord --index "$idx" --clients "$clients" \
        --publishers "$NC_PUBLISHERS" --receivers "$NC_RECEIVERS" \
        --socket "$E2E_DIR/$role$idx.sock" "$@" >> "$E2E_DIR/$role$idx.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "${name}${idx}_PID=$!"
}

# nc_start_client trainer|engine NAME INDEX args...: refit-sim-trainer on publisher INDEX's node
# or refit-sim-engine on receiver INDEX's, in that node's namespace; log E2E_DIR/NAME.log, PID in
# NAME_PID (lib.sh's wait_ok waits for it).
nc_start_client() {
    local kind=$1 name=$2 idx=$3 role=pub
    shift 3
    [ "$kind" = engine ] && role=recv
    ip netns exec "$(nc_ns $role "$idx")" "$BIN/refit-sim-$kind" \
        --socket "$E2E_DIR/$role$idx.sock" "$@" > "$E2E_DIR/$name.log" 2>&1 &
    E2E_PIDS="$E2E_PIDS $!"
    eval "${name}_PID=$!"
}

# nc_tc_bytes pub|recv INDEX up|down: bytes the node's token bucket passed so far, headers
# included: up is what the node sent (its eth0), down what it was sent (its port on the
# bridge).
nc_tc_bytes() {
    local ns dev
    if [ "$3" = up ]; then
        ns=$(nc_ns "$1" "$2") dev=eth0
    else
        ns=$(nc_ns br) dev=$(nc_port "$1" "$2")
    fi
    tc -n "$ns" -s qdisc show dev "$dev" | sed -n 's/^ *Sent \([0-9]*\) bytes.*/\1/p' | head -n 1
}

# nc_metric pub|recv INDEX NAME-REGEX: the value of a /metrics line of the daemon, read in its
# namespace (its status endpoint listens on the namespace's loopback).
nc_metric() {
    local port
    port=$(status_port "$E2E_DIR/$1$2.log")
    [ -n "$port" ] || return 1
    ip netns exec "$(nc_ns "$1" "$2")" curl -sf "http://127.0.0.1:$port/metrics" |
        grep -E "^$3 " | awk '{print $2}'
}

"""tests/e2e/68-installer-boundary.py - a keyless engine process tries to reach trainer memory
through the receiverd's in-process install (68-installer-boundary.sh runs it): what it may get is
exactly the regions its own part of the plan in flight reads, read-only."""
import mmap
import os
import socket
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pbwire import field, frame, parse_all, read_varint, unzigzag, zigzag  # noqa: E402

RECV_SOCK, PUB_SOCK = sys.argv[1], sys.argv[2]
ENGINE, PEER, INSTALLER, MEM_INPROC, FP32 = 2, 4, 5, 4, 2


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


class Conn:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(60)
        self.s.connect(path)
        self.next_id = 0
        self.pushes = []

    def send(self, body_num, body, fds=()):
        self.next_id += 1
        data = frame(field(1, self.next_id) + field(body_num, body))
        if fds:
            socket.send_fds(self.s, [data[:1]], [f.fileno() for f in fds])
            self.s.sendall(data[1:])
        else:
            self.s.sendall(data)
        return self.next_id

    def read(self):
        hdr = self._exact(4)
        return parse_all(self._exact(struct.unpack(">I", hdr)[0]))

    def _exact(self, n):
        b = b""
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                fail("the daemon closed the connection")
            b += c
        return b

    def call(self, body_num, body, fds=()):
        rid = self.send(body_num, body, fds)
        while True:
            r = self.read()
            if r.get(1, [0])[0] == rid:
                return unzigzag(r.get(2, [0])[0]), r.get(3, [b""])[0].decode(), r
            self.pushes.append(r)


def hello(c, kind, name):
    code, msg, _ = c.call(2, field(1, 1) + field(2, name.encode()) + field(4, kind) +
                          field(5, os.getpid()))
    if code != 0:
        fail("Hello as kind %d refused: %s" % (kind, msg))


def expect(what, got, code, text):
    if got[0] != code or text not in got[1]:
        fail("%s: answered %d '%s', expected %d with '%s'" % (what, got[0], got[1], code, text))
    print("refused as it should be: %s: %s" % (what, got[1]), flush=True)


# ---- an engine of one in-process region holding model.w, sealed: the install token ----
eng = Conn(RECV_SOCK)
hello(eng, ENGINE, "attacker")
code, msg, _ = eng.call(3, field(1, 4096) + field(2, b"host") + field(3, MEM_INPROC))
if code != 0:
    fail("RegisterRegion refused: " + msg)
piece = (field(1, b"model.w") + field(2, FP32) + field(3, field(1, 1024)[1:]) + field(4, 0) +
         field(5, 0) + field(6, b"\x00") + field(7, field(1, 1024)[1:]) + field(8, b"\x01"))
code, msg, _ = eng.call(4, piece)
if code != 0:
    fail("RegisterPiece refused: " + msg)
code, msg, r = eng.call(5, b"")
if code != 0 or 13 not in r:
    fail("Seal gave no install token: %d %s" % (code, msg))
token = r[13][0]

ins = Conn(RECV_SOCK)
hello(ins, INSTALLER, "attacker")
code, msg, _ = ins.call(16, field(1, token))
if code != 0:
    fail("InstallerAttach refused: " + msg)

# ---- 1. the signing oracle is gone: InstallSign (field 17) is an unknown request ----
expect("InstallSign", ins.call(17, field(1, b"\0" * 32) + field(2, b"\0" * 32)), -95,
       "unknown request")

# ---- 2. the publisherd gives nothing to a peer without the key ----
peer = Conn(PUB_SOCK)
hello(peer, PEER, "attacker")
code, msg, r = peer.call(14, b"")
if code != 0 or len(r.get(9, [b""])[0]) != 32:
    fail("ExportHello: %d %s" % (code, msg))
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
got = peer.call(15, field(1, os.urandom(32)) + field(2, b"\0" * 32) + field(3, b"\x00\x01"),
                fds=[b])
b.close()
expect("Export with a guessed MAC", got, -13, "wrong MAC")
a.settimeout(0.5)
try:
    _, fds, _, _ = socket.recv_fds(a, 16, 16)
    if fds:
        fail("the publisherd passed %d fds to a keyless peer" % len(fds))
except (socket.timeout, ConnectionResetError):
    pass

# ---- 3. the plan in flight: the engine's part, pushed to its installer ----
plan = None
while plan is None:
    for r in ins.pushes:
        inst = parse_all(r[15][0]) if 15 in r else {}
        if 1 in inst:
            plan = parse_all(inst[1][0])
            break
    if plan is None:
        ins.pushes.append(ins.read())
ps = parse_all(plan[3][0])
# The publisher on this host is the peer with a local socket (PeerAddr.local_sock).
pubs = [parse_all(x) for x in ps[3] if parse_all(x).get(4, [b""])[0]]
if len(pubs) != 1:
    fail("the engine's plan names %d local publishers, expected 1" % len(pubs))
daemon_id, generation = pubs[0][1][0], pubs[0].get(5, [0])[0]
print("the plan in flight reads publisher %016x at generation %d" % (daemon_id, generation),
      flush=True)


def sources(did, gen):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got = ins.call(19, field(1, did) + field(2, gen), fds=[b])
    b.close()
    return got, a


got, chan = sources(daemon_id ^ 1, generation)
expect("InstallSources of a publisher the plan does not read", got, -13, "copies nothing from")
got, chan = sources(daemon_id, generation + 1)
expect("InstallSources of another generation", got, -116, "not %d" % (generation + 1))
(code, msg, r), chan = sources(daemon_id, generation)
if code != 0:
    fail("InstallSources of the plan's own publisher refused: %s" % msg)
regions = [parse_all(x) for x in r.get(12, [])]
granted = [g for g in regions if g.get(1, [0])[0] != 0]
if len(regions) != 2 or len(granted) != 1:
    fail("the installer was given %d of %d regions, expected 1 of 2" % (len(granted),
                                                                        len(regions)))
chan.settimeout(10)
_, fds, _, _ = socket.recv_fds(chan, 16, 16)
if len(fds) != 1:
    fail("%d fds came with one granted region" % len(fds))
size = granted[0][3][0] + granted[0].get(4, [0])[0]
try:
    mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    fail("the trainer memfd maps writable")
except PermissionError:
    pass
m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
off = granted[0].get(4, [0])[0]
if m[off:off + 4096] != b"\x11" * 4096:
    fail("the granted region is not model.w's memory")
print("given: model.w's region alone, read-only; model.secret's never", flush=True)
# Fail this refit: nothing is installed.
ins.call(18, field(1, 1) + field(2, zigzag(-1)) + field(3, b"the test ends it"))
print("ok", flush=True)

"""Tests of the refit Python package against the real daemons: a coordinator
refit-publisherd and a refit-receiverd on loopback, one Python trainer and one Python engine.
Run: BUILD=build python3 -m unittest discover -s tests/python (skips when the binaries are
missing). The library comes from $REFIT_LIB or $BUILD/librefit.so."""

import errno
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
os.environ.setdefault("REFIT_LIB", os.path.join(BUILD, "librefit.so"))

import refit  # noqa: E402

PUB = os.path.join(BUILD, "refit-publisherd")
RECV = os.path.join(BUILD, "refit-receiverd")
HAVE_LIB = os.path.exists(os.environ["REFIT_LIB"])
try:
    import torch
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
HAVE_DAEMONS = HAVE_LIB and os.path.exists(PUB) and os.path.exists(RECV)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@unittest.skipUnless(HAVE_LIB, f"librefit not built ({os.environ['REFIT_LIB']}): run make")
class TestWithoutDaemon(unittest.TestCase):
    def test_connect_error_names_the_socket(self):
        with self.assertRaises(refit.Error) as cm:
            refit.Client(refit.TRAINER, "t", 0, socket="/nonexistent/refit.sock")
        self.assertEqual(cm.exception.code, -errno.ENOENT)
        self.assertIn("/nonexistent/refit.sock", cm.exception.message)
        self.assertIn("is the daemon running", cm.exception.message)

    def test_bad_buffer_size(self):
        with self.assertRaises(refit.Error) as cm:
            refit.HostBuffer(0)
        self.assertEqual(cm.exception.code, -errno.EINVAL)


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7f
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _response(rid, code=0, message="", version=0):
    """A refit.rpc.Response frame: id (1), code (2, sint32), message (3), version (7)."""
    body = b"\x08" + _varint(rid)
    if code:
        body += b"\x10" + _varint(((code << 1) ^ (code >> 31)) & 0xffffffff)
    if message:
        m = message.encode()
        body += b"\x1a" + _varint(len(m)) + m
    if version:
        body += b"\x38" + _varint(version)
    return struct.pack(">I", len(body)) + body


def _read_request_id(conn):
    """Reads one Request frame; returns its id (field 1, the first one librefit writes)."""
    def exact(n):
        buf = b""
        while len(buf) < n:
            b = conn.recv(n - len(buf))
            if not b:
                raise EOFError
            buf += b
        return buf
    body = exact(struct.unpack(">I", exact(4))[0])
    assert body[0] == 0x08, body
    rid, shift, i = 0, 0, 1
    while True:
        rid |= (body[i] & 0x7f) << shift
        shift += 7
        i += 1
        if not body[i - 1] & 0x80:
            return rid


@unittest.skipUnless(HAVE_LIB, f"librefit not built ({os.environ['REFIT_LIB']}): run make")
class TestAgainstScriptedDaemon(unittest.TestCase):
    """librefit against a socket whose answers the test scripts: what a daemon does in the
    orders that are a matter of timing with a real one."""

    def serve(self, script):
        """Listens on a fresh socket; a thread runs script(conn) for the first client and
        sets self.done when it has finished (closed the connection)."""
        self.tmp = tempfile.TemporaryDirectory(prefix="refit-py-fake-")
        self.addCleanup(self.tmp.cleanup)
        path = os.path.join(self.tmp.name, "fake.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        self.done = threading.Event()

        def run():
            conn, _ = srv.accept()
            try:
                script(conn)
            finally:
                conn.close()
                srv.close()
                self.done.set()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.addCleanup(t.join, 5)
        return path

    def test_refusal_written_before_close_is_shown_when_the_write_fails(self):
        # The daemon answers Hello, then refuses and closes before the next request is
        # written: that write fails (EPIPE) and the call must report the daemon's reason.
        def script(conn):
            conn.sendall(_response(_read_request_id(conn)))
            conn.sendall(_response(0, -errno.EACCES, "uid 4242 is not allowed on fake.sock"))
        path = self.serve(script)
        c = refit.Client(refit.CTL, "py", 0, socket=path)
        self.assertTrue(self.done.wait(5))
        with self.assertRaises(refit.Error) as cm:
            c.status()
        self.assertEqual(cm.exception.code, -errno.EACCES)
        self.assertEqual(cm.exception.message, "uid 4242 is not allowed on fake.sock")
        c.close()

    def test_close_without_a_reason_reports_the_failed_write(self):
        def script(conn):
            conn.sendall(_response(_read_request_id(conn)))
        path = self.serve(script)
        c = refit.Client(refit.CTL, "py", 0, socket=path)
        self.assertTrue(self.done.wait(5))
        with self.assertRaises(refit.Error) as cm:
            c.status()
        self.assertEqual(cm.exception.code, -errno.EPIPE)
        self.assertIn("the daemon closed the connection", cm.exception.message)
        c.close()

    def test_wait_answered_with_an_older_version_is_a_protocol_error(self):
        def script(conn):
            conn.sendall(_response(_read_request_id(conn)))
            conn.sendall(_response(_read_request_id(conn), version=3))
        path = self.serve(script)
        with refit.Client(refit.ENGINE, "py", 0, socket=path) as c:
            with self.assertRaises(refit.Error) as cm:
                c.wait_version(5, 5000)
            self.assertEqual(cm.exception.code, -errno.EPROTO)
            self.assertIn("answered the wait for version 5 with version 3", cm.exception.message)


FP8_ROWS, FP8_COLS = 128, 64
FP8_SCALES = [1.0, 0.5, 1.0, 2.0 ** -4]


def fp8_case():
    """A 128x64 bf16 matrix (bytes) of values exactly representable in e4m3 after scaling, and
    the float8_e4m3fn bytes its block:64x32 quantization gives: blocks with amax 448 (scale 1),
    224 (scale 1/2), all zeros of both signs (scale 1, -0 is 0x80) and 28 (scale 1/16)."""
    table = [448.0, -448.0, 1.0, -1.0, 0.5, 1.5, 2.0, 3.0, 13.0, -2.0 ** -6, 2.0 ** -9,
             240.0, -96.0, 0.0, 7.0, 52.0]
    factor = [[1.0, 0.5], [0.0, 2.0 ** -4]]

    def e4m3(v):
        # Exactly representable values only (the table's).
        sign = 0x80 if math.copysign(1.0, v) < 0 else 0
        a = abs(v)
        if a == 0:
            return sign
        e = math.floor(math.log2(a))
        if e < -6:
            return sign | int(a / 2.0 ** -9)
        return sign | (e + 7) << 3 | int((a / 2.0 ** e - 1) * 8)

    bf16 = bytearray(FP8_ROWS * FP8_COLS * 2)
    want = bytearray(FP8_ROWS * FP8_COLS)
    for i in range(FP8_ROWS):
        for j in range(FP8_COLS):
            t = table[(i * FP8_COLS + j) % len(table)]
            x = t * factor[i // 64][j // 32]
            bits = struct.unpack("<I", struct.pack("<f", x))[0] >> 16
            struct.pack_into("<H", bf16, (i * FP8_COLS + j) * 2, bits)
            want[i * FP8_COLS + j] = e4m3(x / FP8_SCALES[(i // 64) * 2 + j // 32])
    return bytes(bf16), want


@unittest.skipUnless(HAVE_DAEMONS, f"daemons not built in {BUILD}: run make")
class TestWithDaemons(unittest.TestCase):
    SHAPE = [4, 8]

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="refit-py-")
        d = cls.dir.name
        key = os.path.join(d, "cluster.key")
        with open(key, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(key, 0o600)
        cls.pub_sock = os.path.join(d, "publisherd.sock")
        cls.recv_sock = os.path.join(d, "receiverd.sock")
        common = ["--cluster-key-file", key, "--coordinator-addr",
                  f"127.0.0.1:{free_port()}", "--publishers", "1", "--receivers", "1",
                  "--status-listen", "127.0.0.1:0", "--verify", "full", "--index", "0",
                  "--clients", "1"]
        cls.logs = [open(os.path.join(d, n), "w") for n in ("pub.log", "recv.log")]
        cls.procs = [
            subprocess.Popen([PUB] + common + ["--coordinator", "--socket", cls.pub_sock],
                             stdout=cls.logs[0], stderr=subprocess.STDOUT),
            subprocess.Popen([RECV] + common + ["--socket", cls.recv_sock],
                             stdout=cls.logs[1], stderr=subprocess.STDOUT),
        ]
        deadline = time.time() + 10
        while time.time() < deadline:
            if all(os.path.exists(s) for s in (cls.pub_sock, cls.recv_sock)):
                break
            if any(p.poll() is not None for p in cls.procs):
                break
            time.sleep(0.05)

    @classmethod
    def tearDownClass(cls):
        for p in cls.procs:
            p.terminate()
        for p in cls.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in cls.logs:
            f.close()
        cls.dir.cleanup()

    def logs_text(self):
        out = []
        for name in ("pub.log", "recv.log"):
            with open(os.path.join(self.dir.name, name)) as f:
                out.append(f"== {name}\n{f.read()}")
        return "\n".join(out)

    def test_1_refit_moves_bytes(self):
        n = 4 * 8
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr, \
                refit.Client(refit.ENGINE, "py-engine", 0, socket=self.recv_sock) as en:
            src = tr.alloc_host(n * 4)
            # The trainer holds the tensor transposed ([8][4] in memory): strides (1, 4).
            for i in range(4):
                for j in range(8):
                    struct.pack_into("<f", src.mmap, (j * 4 + i) * 4, float(i * 100 + j))
            tr.add_piece("model.w", "fp32", self.SHAPE, src.region, 0, [0, 0], [4, 8], [1, 4])
            tr.seal()
            dst = en.alloc_host(n * 4 + 64)
            en.add_piece("model.w", "float32", self.SHAPE, dst.region, 64, [0, 0], [4, 8])
            en.seal()
            tr.publish(1)
            try:
                self.assertEqual(en.wait_version(1, 20000), 1)
                tr.wait_released(1, 20000)
            except refit.Error as e:
                self.fail(f"{e}\n{self.logs_text()}")
            for i in range(4):
                for j in range(8):
                    v = struct.unpack_from("<f", dst.mmap, 64 + (i * 8 + j) * 4)[0]
                    self.assertEqual(v, float(i * 100 + j), (i, j))
            ev = [en.next_event(1000) for _ in range(2)]
            self.assertEqual(ev, [("installing", 1), ("committed", 1)])
            with refit.Client(refit.CTL, "py-ctl", 0, socket=self.pub_sock) as ctl:
                self.assertIn("{", ctl.status())
                ctl.wait(1, 1000)

    def test_2_errors_raise_with_messages(self):
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr:
            buf = tr.alloc_host(64)
            with self.assertRaises(refit.Error) as cm:
                tr.add_piece("model.w", "fp32", self.SHAPE, buf.region + 5, 0, [0, 0], [4, 8])
            self.assertEqual(cm.exception.code, -errno.ENOENT)
            self.assertIn("unknown region", cm.exception.message)
            with self.assertRaises(refit.Error) as cm:
                tr.add_piece("model.w", "fp32", self.SHAPE, buf.region, 0, [0, 0], [4, 8])
            self.assertIn("outside its registered region", cm.exception.message)
            with self.assertRaises(refit.Error) as cm:
                tr.publish(1)
            self.assertIn("before Seal", cm.exception.message)
        with self.assertRaises(refit.Error) as cm:
            refit.Client(refit.ENGINE, "wrong", 0, socket=self.pub_sock)
        self.assertIn("trainers connect to refit-publisherd", cm.exception.message)

    def test_3_bad_tensor_names_refused_escaped(self):
        # The daemon refuses the name and shows it escaped: never a raw newline or byte.
        cases = [("model.w\n", "a control character", '"model.w\\n"'),
                 (b"model.\xffw", "not valid UTF-8", '"model.\\xffw"'),
                 ('model."w"', "a quote", '"model.\\"w\\""'),
                 ("model w", "a space", '"model w"'),
                 ("m" * 256, "is 256 bytes long; the limit is 255", "mmm...")]
        with refit.Client(refit.TRAINER, "py-names", 0, socket=self.pub_sock) as tr:
            buf = tr.alloc_host(16)
            for name, problem, shown in cases:
                with self.assertRaises(refit.Error, msg=repr(name)) as cm:
                    tr.add_piece(name, "fp32", [4], buf.region, 0, [0], [4])
                self.assertEqual(cm.exception.code, -errno.EINVAL)
                self.assertIn(problem, cm.exception.message)
                self.assertIn(shown, cm.exception.message)
                self.assertNotIn("\n", cm.exception.message)
            tr.add_piece("model.\u6a21\u578b", "fp32", [4], buf.region, 0, [0], [4])
            st = json.loads(tr.status())
            mine = [c for c in st["clients"]["clients"] if c.get("name") == "py-names"]
            self.assertEqual(mine[0]["pieces"], 1, mine)

    def test_4_wait_version_returns_the_version_reached(self):
        n = 4 * 8
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr, \
                refit.Client(refit.ENGINE, "py-engine", 0, socket=self.recv_sock) as en:
            src = tr.alloc_host(n * 4)
            tr.add_piece("model.w", "fp32", self.SHAPE, src.region, 0, [0, 0], [4, 8])
            tr.seal()
            dst = en.alloc_host(n * 4)
            en.add_piece("model.w", "fp32", self.SHAPE, dst.region, 0, [0, 0], [4, 8])
            en.seal()
            for i in range(n):
                struct.pack_into("<f", src.mmap, i * 4, float(1000 + i))
            tr.publish(2)
            try:
                tr.wait_released(2, 20000)
                # Asked for 1, the daemon has committed 2: the memory holds 2, and says so.
                self.assertEqual(en.wait_version(1, 20000), 2)
            except refit.Error as e:
                self.fail(f"{e}\n{self.logs_text()}")
            self.assertEqual(struct.unpack_from("<f", dst.mmap, 0)[0], 1000.0)

    def test_5_fp8_engine_refit(self):
        """A bf16 trainer refits an FP8 engine (block:64x32, scales in the same buffer): every
        FP8 byte and scale is what the format says, for blocks whose amax gives scales 1, 1/2,
        1 (all zeros) and 1/16."""
        rows, cols = FP8_ROWS, FP8_COLS
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr, \
                refit.Client(refit.ENGINE, "py-engine", 0, socket=self.recv_sock) as en:
            src = tr.alloc_host(rows * cols * 2)
            bf16, want = fp8_case()
            src.mmap[0:rows * cols * 2] = bf16
            tr.add_piece("model.q", "bf16", [rows, cols], src.region, 0, [0, 0], [rows, cols])
            tr.seal()
            sshape, ses = refit.fp8_scale_shape("block:64x32", [rows, cols], [0, 0],
                                                [rows, cols])
            self.assertEqual((sshape, ses), ([2, 2], 4))
            with self.assertRaises(refit.Error):
                refit.fp8_scale_shape("block:0x3", [rows, cols], [0, 0], [rows, cols])
            dst = en.alloc_host(rows * cols + 16)
            en.add_piece_fp8("model.q", "bf16", [rows, cols], dst.region, 0, [0, 0],
                             [rows, cols], "block:64x32", dst.region, rows * cols)
            en.seal()
            tr.publish(3)
            try:
                tr.wait_released(3, 20000)
                self.assertEqual(en.wait_version(3, 20000), 3)
            except refit.Error as e:
                self.fail(f"{e}\n{self.logs_text()}")
            got = bytes(dst.mmap[0:rows * cols])
            bad = [k for k in range(rows * cols) if got[k] != want[k]]
            self.assertEqual(bad, [], f"{len(bad)} FP8 bytes differ, first at {bad[:4]}: "
                             f"{[got[k] for k in bad[:4]]} != {[want[k] for k in bad[:4]]}")
            scales = struct.unpack_from("<4f", dst.mmap, rows * cols)
            self.assertEqual(list(scales), FP8_SCALES)

    def refit_fp8(self, tr, en, version, w, sc, want):
        """Publishes version and checks that the engine's FP8 weight w holds want and its
        scales sc FP8_SCALES."""
        tr.publish(version)
        try:
            tr.wait_released(version, 20000)
            self.assertEqual(en.wait_version(version, 20000), version)
        except refit.Error as e:
            self.fail(f"{e}\n{self.logs_text()}")
        got = bytes(w.view(torch.uint8).contiguous().view(-1).tolist())
        self.assertEqual(got, bytes(want))
        self.assertEqual(sc.view(-1).tolist(), FP8_SCALES)

    @unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
    def test_6_fp8_engine_with_refit_torch(self):
        """The same through refit.torch: register() a bf16 tensor, register_fp8() a uint8 (or
        float8_e4m3fn) weight and its float32 weight_scale_inv in refit.torch.empty memory."""
        import refit.torch as rt

        rows, cols = FP8_ROWS, FP8_COLS
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr, \
                refit.Client(refit.ENGINE, "py-engine", 0, socket=self.recv_sock) as en:
            bf16, want = fp8_case()
            src = rt.empty([rows, cols], torch.bfloat16)
            src.view(torch.uint8).view(-1)[:] = torch.frombuffer(bytearray(bf16),
                                                                 dtype=torch.uint8)
            rt.register(tr, "model.q", src)
            tr.seal()
            w = rt.empty([rows, cols], getattr(torch, "float8_e4m3fn", torch.uint8))
            sc = rt.empty([2, 2], torch.float32)
            with self.assertRaises(refit.Error) as cm:
                rt.register_fp8(en, "model.q", w, rt.empty([2, 3], torch.float32), "block:64x32")
            self.assertIn("needs [2, 2] scales of 4 bytes", cm.exception.message)
            with self.assertRaises(refit.Error) as cm:
                rt.register_fp8(en, "model.q", rt.empty([rows, cols], torch.float16), sc,
                                "block:64x32")
            self.assertIn("FP8 weights are float8_e4m3fn", cm.exception.message)
            rt.register_fp8(en, "model.q", w, sc, "block:64x32")
            en.seal()
            self.refit_fp8(tr, en, 4, w, sc, want)

    @unittest.skipUnless(HAVE_TORCH, "needs torch (python3-torch)")
    def test_7_fp8_trainer_into_fp8_engine(self):
        """A trainer that holds model.q in FP8 (block:64x32) registers it with register_fp8 as
        engines do: the engine of the same format gets its bytes and scales as they are."""
        import refit.torch as rt

        rows, cols = FP8_ROWS, FP8_COLS
        fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)
        with refit.Client(refit.TRAINER, "py-trainer", 0, socket=self.pub_sock) as tr, \
                refit.Client(refit.ENGINE, "py-engine", 0, socket=self.recv_sock) as en:
            _, want = fp8_case()
            tw = rt.empty([rows, cols], fp8)
            tw.view(torch.uint8).view(-1)[:] = torch.frombuffer(bytearray(want), dtype=torch.uint8)
            tsc = rt.empty([2, 2], torch.float32)
            tsc.view(-1)[:] = torch.tensor(FP8_SCALES, dtype=torch.float32)
            rt.register_fp8(tr, "model.q", tw, tsc, "block:64x32")
            tr.seal()
            w = rt.empty([rows, cols], fp8)
            sc = rt.empty([2, 2], torch.float32)
            rt.register_fp8(en, "model.q", w, sc, "block:64x32")
            en.seal()
            self.refit_fp8(tr, en, 5, w, sc, want)


if __name__ == "__main__":
    unittest.main()

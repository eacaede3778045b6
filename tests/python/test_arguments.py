"""The refit package refuses arguments librefit could not take as given, before any call:
integers outside their C type (ctypes would keep only the low bits: rank 1 << 40 joins as
rank 0), strings with a NUL byte (a C string ends there: "block\\0garbage" would be "block"),
values of the wrong type, and, in refit.torch, negative shapes, empty tensors and scale dtypes
the FP8 format does not use. A scripted daemon answers Hello and records every request after
it: none may arrive. Run as tests/python/test_refit.py is."""

import errno
import os
import socket
import sys
import tempfile
import threading
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
os.environ.setdefault("REFIT_LIB", os.path.join(BUILD, "librefit.so"))

import refit  # noqa: E402
from test_refit import _read_request_id, _response  # noqa: E402

HAVE_LIB = os.path.exists(os.environ["REFIT_LIB"])
try:
    import torch
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


class Refused:
    """assertRaises for an argument refused before the call: the exception is the given
    builtin class (ValueError, TypeError) and a refit.Error of code -EINVAL whose message holds
    every one of texts."""

    def __init__(self, test, cls, *texts):
        self.test, self.cls, self.texts = test, cls, texts

    def __enter__(self):
        self.cm = self.test.assertRaises(self.cls)
        self.cm.__enter__()
        return self.cm

    def __exit__(self, *exc):
        if not self.cm.__exit__(*exc):
            return False
        e = self.cm.exception
        self.test.assertIsInstance(e, refit.Error)
        self.test.assertEqual(e.code, -errno.EINVAL)
        for t in self.texts:
            self.test.assertIn(t, e.message)
        return True


class ScriptedDaemon:
    """A socket that answers the Hello of its first client and records the ids of the
    requests after it until the client closes."""

    def __init__(self, test):
        self.tmp = tempfile.TemporaryDirectory(prefix="refit-py-args-")
        test.addCleanup(self.tmp.cleanup)
        self.path = os.path.join(self.tmp.name, "fake.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.requests = []
        self.done = threading.Event()
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        test.addCleanup(t.join, 5)

    def run(self):
        conn, _ = self.srv.accept()
        try:
            conn.sendall(_response(_read_request_id(conn)))
            while True:
                rid = _read_request_id(conn)
                self.requests.append(rid)
                conn.sendall(_response(rid))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            self.srv.close()
            self.done.set()


NOWHERE = "/nonexistent/refit-args.sock"


@unittest.skipUnless(HAVE_LIB, f"librefit not built ({os.environ['REFIT_LIB']}): run make")
class TestClientArguments(unittest.TestCase):
    def test_rank_outside_int32_is_refused_before_connecting(self):
        # The socket does not exist: a connection attempt would fail with ENOENT instead.
        for rank in (1 << 40, 1 << 31, -(1 << 31) - 1):
            with Refused(self, ValueError, f"rank is {rank}, outside -2147483648..2147483647"):
                refit.Client(refit.TRAINER, "py", rank, socket=NOWHERE)
        with Refused(self, TypeError, "rank must be an integer, not str"):
            refit.Client(refit.TRAINER, "py", "3", socket=NOWHERE)
        with Refused(self, TypeError, "rank must be an integer, not a bool"):
            refit.Client(refit.TRAINER, "py", True, socket=NOWHERE)
        with Refused(self, ValueError, "kind is 4294967297"):
            refit.Client((1 << 32) + 1, "py", 0, socket=NOWHERE)

    def test_names_with_a_nul_are_refused(self):
        with Refused(self, ValueError, "client name 'py\\x00x' holds a NUL byte at byte 2"):
            refit.Client(refit.TRAINER, "py\0x", 0, socket=NOWHERE)
        with Refused(self, ValueError, "socket", "NUL byte at byte 3"):
            refit.Client(refit.TRAINER, "py", 0, socket="/tm\0p/x.sock")
        with Refused(self, TypeError, "client name must be a str or bytes, not int"):
            refit.Client(refit.TRAINER, 7, 0, socket=NOWHERE)

    def test_fp8_format_with_a_nul_is_refused(self):
        # Cut at the NUL it would read "block", a format librefit knows.
        self.assertEqual(refit.fp8_scale_shape("block", [256, 256], [0, 0], [256, 256]),
                         ([2, 2], 4))
        with Refused(self, ValueError, "FP8 format 'block\\x00garbage' holds a NUL byte at "
                     "byte 5"):
            refit.fp8_scale_shape("block\0garbage", [256, 256], [0, 0], [256, 256])
        with Refused(self, ValueError, "extent[1] is 18446744073709551616"):
            refit.fp8_scale_shape("block", [256, 256], [0, 0], [256, 1 << 64])

    def test_piece_arguments_are_refused_before_the_call(self):
        d = ScriptedDaemon(self)
        c = refit.Client(refit.TRAINER, "py", 0, socket=d.path)
        shape, start, extent = [4, 8], [0, 0], [4, 8]
        cases = [
            (ValueError, ("tensor 'model.w': region is 4294967296, outside 0..4294967295",),
             lambda: c.add_piece("model.w", "fp32", shape, 1 << 32, 0, start, extent)),
            (ValueError, ("offset is -1, outside 0..18446744073709551615",),
             lambda: c.add_piece("model.w", "fp32", shape, 0, -1, start, extent)),
            (ValueError, ("shape[0] is 9223372036854775808",),
             lambda: c.add_piece("model.w", "fp32", [1 << 63, 8], 0, 0, start, extent)),
            (ValueError, ("strides[1] is -9223372036854775809",),
             lambda: c.add_piece("model.w", "fp32", shape, 0, 0, start, extent,
                                 [8, -(1 << 63) - 1])),
            (ValueError, ("tensor name 'model.w\\x00junk' holds a NUL byte at byte 7",),
             lambda: c.add_piece("model.w\0junk", "fp32", shape, 0, 0, start, extent)),
            (ValueError, ("NUL byte at byte 1",),
             lambda: c.add_piece(b"m\0", "fp32", shape, 0, 0, start, extent)),
            (TypeError, ("tensor name must be a str or bytes, not NoneType",),
             lambda: c.add_piece(None, "fp32", shape, 0, 0, start, extent)),
            (TypeError, ("start must be a sequence of integers, not NoneType",),
             lambda: c.add_piece("model.w", "fp32", shape, 0, 0, None, extent)),
            (TypeError, ("extent[0] must be an integer, not float",),
             lambda: c.add_piece("model.w", "fp32", shape, 0, 0, start, [4.0, 8])),
            (ValueError, ("unknown dtype 'fp33'",),
             lambda: c.add_piece("model.w", "fp33", shape, 0, 0, start, extent)),
            (ValueError, ("need one value per dim",),
             lambda: c.add_piece("model.w", "fp32", shape, 0, 0, [0], extent)),
            (ValueError, ("FP8 format 'block\\x00garbage' holds a NUL byte at byte 5",),
             lambda: c.add_piece_fp8("model.q", "bf16", [256, 256], 0, 0, [0, 0], [256, 256],
                                     "block\0garbage", 0, 65536)),
            (ValueError, ("scale_offset is 18446744073709551616",),
             lambda: c.add_piece_fp8("model.q", "bf16", [256, 256], 0, 0, [0, 0], [256, 256],
                                     "block", 0, 1 << 64)),
            (ValueError, ("scale_region is -1",),
             lambda: c.add_piece_fp8("model.q", "bf16", [256, 256], 0, 0, [0, 0], [256, 256],
                                     "block", -1, 0)),
            (ValueError, ("size is 18446744073709551616",),
             lambda: c.register_memfd(0, 1 << 64)),
            (ValueError, ("fd is 4294967296",), lambda: c.register_memfd(1 << 32, 64)),
            (ValueError, ("version is 18446744073709551616",), lambda: c.publish(1 << 64)),
            (ValueError, ("version is -1",), lambda: c.publish(-1)),
            # Timeouts whose low 32 bits are 50 ms: without the check they would not hang.
            (ValueError, ("timeout_ms is 4294967346",), lambda: c.wait_version(1, (1 << 32) + 50)),
            (ValueError, ("timeout_ms is 4294967346",),
             lambda: c.wait_released(1, (1 << 32) + 50)),
            (ValueError, ("timeout_ms is -4294967246",), lambda: c.next_event(-(1 << 32) + 50)),
            (ValueError, ("version is 18446744073709551616",), lambda: c.trigger(1 << 64)),
            (ValueError, ("version is 18446744073709551616",), lambda: c.wait(1 << 64)),
            (ValueError, ("version is 18446744073709551616",), lambda: c.consumed(1 << 64)),
        ]
        for cls, texts, call in cases:
            with self.subTest(texts[0]):
                with Refused(self, cls, *texts):
                    call()
        # A request that goes through is answered: the daemon sees exactly that one.
        c.publish(1)
        c.close()
        self.assertTrue(d.done.wait(5))
        self.assertEqual(len(d.requests), 1, "only the valid publish may reach the daemon")

    def test_buffer_size_outside_uint64(self):
        with Refused(self, ValueError, "buffer size is 18446744073709551616"):
            refit.HostBuffer(1 << 64)


@unittest.skipUnless(HAVE_LIB and HAVE_TORCH, "needs librefit and torch (python3-torch)")
class TestTorchArguments(unittest.TestCase):
    def setUp(self):
        import refit.torch as rt
        self.rt = rt
        self.d = ScriptedDaemon(self)
        self.c = refit.Client(refit.ENGINE, "py", 0, socket=self.d.path)

    def tearDown(self):
        self.c.close()
        self.assertTrue(self.d.done.wait(5))
        self.assertEqual(self.d.requests, [], "a refused call reached the daemon")

    def test_negative_sizes_are_refused(self):
        rt = self.rt
        with Refused(self, ValueError, "shape (-1, 4): size of dim 0 is -1"):
            rt.empty((-1, 4))
        with Refused(self, ValueError, "shape (2, -3): size of dim 1 is -3"):
            rt.Arena(1 << 16).empty((2, -3))
        with Refused(self, TypeError, "size of dim 1 must be an integer, not float"):
            rt.empty((2, 1.5))
        with Refused(self, ValueError, "arena size is 0"):
            rt.Arena(0)
        self.assertEqual(tuple(rt.empty((0, 4)).shape), (0, 4))

    def test_empty_tensors_are_refused_as_empty(self):
        rt = self.rt
        for t in (torch.empty((0, 4)), rt.empty((0, 4)), rt.empty((3, 0), torch.bfloat16)):
            with Refused(self, ValueError, "tensor model.w: the tensor is empty (shape "
                         f"{list(t.shape)}, no element)"):
                rt.register(self.c, "model.w", t)
        with Refused(self, ValueError, "its scale: the tensor is empty"):
            rt.register_fp8(self.c, "model.q", rt.empty((128, 64), torch.uint8),
                            rt.empty((0, 2), torch.float32), "block:64x32")

    def test_tensor_that_is_not_one(self):
        with Refused(self, TypeError, "tensor model.w: a NoneType is not a torch.Tensor"):
            self.rt.register(self.c, "model.w", None)
        with Refused(self, ValueError, "tensor name 'model.w\\x00x' holds a NUL byte"):
            self.rt.register(self.c, "model.w\0x", self.rt.empty((2, 2)))

    def test_fp8_scale_dtypes_the_format_does_not_use(self):
        rt = self.rt
        w = rt.empty((128, 64), torch.uint8)
        # int32 has fp32's size: its bits would be read as fp32 scales.
        with Refused(self, ValueError, "format block:64x32 keeps its scales as torch.float32; "
                     "scale is torch.int32"):
            rt.register_fp8(self.c, "model.q", w, rt.empty((2, 2), torch.int32), "block:64x32")
        with Refused(self, ValueError, "format channel keeps its scales as torch.float32"):
            rt.register_fp8(self.c, "model.q", w, rt.empty((128, 1), torch.int32), "channel")
        # mxfp8's scales are E8M0 bytes: int8 and bool have their size, not their meaning.
        for dt in (torch.int8, torch.bool):
            with Refused(self, ValueError, "format mxfp8 keeps its scales as torch.uint8",
                         f"scale is {dt}"):
                rt.register_fp8(self.c, "model.q", w, rt.empty((128, 2), dt), "mxfp8")
        with Refused(self, ValueError, "the weight is torch.int8; FP8 weights are"):
            rt.register_fp8(self.c, "model.q", rt.empty((128, 64), torch.int8),
                            rt.empty((2, 2), torch.float32), "block:64x32")
        with Refused(self, ValueError, "FP8 format 'block\\x00garbage' holds a NUL byte"):
            rt.register_fp8(self.c, "model.q", rt.empty((256, 256), torch.uint8),
                            rt.empty((2, 2), torch.float32), "block\0garbage")

    def test_layout_arguments(self):
        rt = self.rt
        with Refused(self, ValueError, "convention 'hf\\x00x' holds a NUL byte"):
            rt.layout("qwen3-4b", "hf\0x")
        with Refused(self, ValueError, "rank is 4294967296"):
            rt.layout("qwen3-4b", "hf", "", 1 << 32)
        with Refused(self, ValueError, "shrink is 4294967296"):
            rt.layout("qwen3-4b", "hf", "", 0, 1 << 32)


if __name__ == "__main__":
    unittest.main()

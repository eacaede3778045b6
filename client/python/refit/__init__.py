"""refit: Python bindings (ctypes, standard library only) over librefit, the client library of
the refit daemons. Trainers register host buffers and pieces and publish versions; engines
register buffers and wait for versions; refitctl-like tools read status and trigger refits.

Every failing call raises refit.Error(code, message), code being a negative errno. Arguments
librefit could not take as given (an integer outside its C type, a string with a NUL byte, a
value of the wrong type) are refused before any call, with refit.ArgumentError (also a
ValueError) or refit.ArgumentTypeError (also a TypeError), both refit.Error of code -EINVAL.
The library is loaded from $REFIT_LIB, else from build/librefit.so of this source tree."""

import ctypes
import errno
import fcntl
import mmap
import operator
import os

TRAINER, ENGINE, CTL = 1, 2, 3
EVENT_INSTALLING, EVENT_COMMITTED, EVENT_ABORTED = 1, 2, 3
EVENT_NAMES = {EVENT_INSTALLING: "installing", EVENT_COMMITTED: "committed",
               EVENT_ABORTED: "aborted"}

DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2, "fp64": 3, "fp8_e4m3": 4, "fp8_e5m2": 5,
          "int8": 6, "uint8": 7, "int16": 8, "int32": 9, "int64": 10, "bool": 11,
          "bfloat16": 0, "float16": 1, "float32": 2, "float64": 3, "float8_e4m3fn": 4,
          "float8_e5m2": 5}
DTYPE_SIZES = {0: 2, 1: 2, 2: 4, 3: 8, 4: 1, 5: 1, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 1}


class Error(Exception):
    """A refit call failed: code is a negative errno, message says what was wrong."""

    def __init__(self, code, message):
        super().__init__(f"{message} ({errno.errorcode.get(-code, code)})")
        self.code = code
        self.message = message


class ArgumentError(Error, ValueError):
    """An argument librefit cannot take as given: refused before the call (code -EINVAL)."""

    def __init__(self, message):
        super().__init__(-errno.EINVAL, message)


class ArgumentTypeError(Error, TypeError):
    """An argument of a type the call does not take: refused before the call (-EINVAL)."""

    def __init__(self, message):
        super().__init__(-errno.EINVAL, message)


# The ranges of librefit's C argument types: ctypes would cut a larger Python int to its low
# bits without a word (rank 1 << 40 arrives as rank 0), so each integer is checked first.
I32 = (-2 ** 31, 2 ** 31 - 1)
U32 = (0, 2 ** 32 - 1)
I64 = (-2 ** 63, 2 ** 63 - 1)
U64 = (0, 2 ** 64 - 1)


def _int(what, value, lo_hi):
    """value as a Python int when it is an integer in lo_hi; else ArgumentError or
    ArgumentTypeError naming what and the range."""
    lo, hi = lo_hi
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be an integer, not a bool ({value})")
    try:
        v = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an integer, not {type(value).__name__} "
                                f"({value!r})") from None
    if not lo <= v <= hi:
        raise ArgumentError(f"{what} is {v}, outside {lo}..{hi}: librefit takes it as a "
                            f"{'signed' if lo < 0 else 'unsigned'} "
                            f"{(hi - lo).bit_length()}-bit integer")
    return v


def _cstr(what, s, none_ok=False):
    """s (a str, sent as UTF-8, or bytes, sent as they are) as the bytes of a C string; None
    only when none_ok. A NUL byte would end the C string there and the rest would be lost
    silently: refused."""
    if s is None and none_ok:
        return None
    if isinstance(s, str):
        try:
            b = s.encode()
        except UnicodeEncodeError as e:
            raise ArgumentError(f"{what} {s!r} cannot be sent as UTF-8: {e.reason} at "
                                f"character {e.start}") from None
    elif isinstance(s, (bytes, bytearray)):
        b = bytes(s)
    else:
        raise ArgumentTypeError(f"{what} must be a str or bytes, not {type(s).__name__} "
                                f"({s!r})")
    i = b.find(b"\0")
    if i >= 0:
        raise ArgumentError(f"{what} {s!r} holds a NUL byte at byte {i}: librefit takes a C "
                            "string, which would end there; remove the NUL")
    return b


def _dtype(what, dtype):
    """A dtype name of DTYPES or a REFIT value, as the value."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ArgumentError(f"{what}: unknown dtype {dtype!r}; one of "
                                f"{', '.join(sorted(DTYPES))}")
        return DTYPES[dtype]
    return _int(f"{what}: dtype", dtype, I32)


def _find_lib():
    """REFIT_LIB if set; else the library of an installed tree (the package lives in
    PREFIX/lib/python3/dist-packages/refit, the library in PREFIX/lib); else the source tree's
    build directory; else whatever the dynamic loader finds."""
    path = os.environ.get("REFIT_LIB")
    if path:
        return path
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.normpath(os.path.join(here, "..", "..", "..", "librefit.so.0"))
    if os.path.exists(installed):
        return installed
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    build = os.environ.get("BUILD", "build")
    built = os.path.join(root if not os.path.isabs(build) else "", build, "librefit.so")
    if os.path.exists(built):
        return built
    return "librefit.so.0"


_lib = None


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = _find_lib()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise Error(-errno.ENOENT, f"cannot load librefit from {path}: {e}; build it with "
                    "`make` or set REFIT_LIB") from None
    c_p, u32, u64, i64p = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, \
        ctypes.POINTER(ctypes.c_int64)
    sigs = {
        "refit_connect": [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                          ctypes.POINTER(c_p)],
        "refit_region_memfd": [c_p, ctypes.c_int, u64, ctypes.POINTER(u32)],
        "refit_region_cuda": [c_p, c_p, u64, ctypes.POINTER(u32)],
        "refit_add_piece": [c_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, i64p, u32, u64,
                            i64p, i64p, i64p],
        "refit_add_piece_fp8": [c_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, i64p, u32,
                                u64, i64p, i64p, i64p, ctypes.c_char_p, u32, u64, i64p],
        "refit_fp8_scale_shape": [ctypes.c_char_p, ctypes.c_int, i64p, i64p, i64p, i64p,
                                  ctypes.POINTER(ctypes.c_size_t)],
        "refit_seal": [c_p],
        "refit_publish": [c_p, u64],
        "refit_wait_released": [c_p, u64, ctypes.c_int],
        "refit_wait_version": [c_p, u64, ctypes.c_int],
        "refit_wait_version_reached": [c_p, u64, ctypes.c_int, ctypes.POINTER(u64)],
        "refit_next_event": [c_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                             ctypes.POINTER(u64)],
        "refit_status_json": [c_p, ctypes.POINTER(c_p)],
        "refit_trigger": [c_p, u64],
        "refit_wait": [c_p, u64, ctypes.c_int],
        "refit_gate": [c_p],
        "refit_consumed": [c_p, u64],
        "refit_close": [c_p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.refit_last_error.argtypes = [c_p]
    lib.refit_last_error.restype = ctypes.c_char_p
    _libc = ctypes.CDLL(None)
    _libc.free.argtypes = [c_p]
    lib._free = _libc.free
    _lib = lib
    return lib


def _i64s(what, values):
    """A C array of int64 of the integers in values (each checked)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ArgumentTypeError(f"{what} must be a sequence of integers, not "
                                f"{type(values).__name__} ({values!r})")
    vals = [_int(f"{what}[{k}]", v, I64) for k, v in enumerate(values)]
    return (ctypes.c_int64 * len(vals))(*vals)


def fp8_scale_shape(fmt, shape, start, extent):
    """The shape of the scales of an FP8 piece (the box's block grid) in format fmt, and the
    bytes of one scale (4: fp32; 1: E8M0 for mxfp8)."""
    cfmt = _cstr("FP8 format", fmt)
    shape, start, extent = (_i64s(w, v) for w, v in (("shape", shape), ("start", start),
                                                       ("extent", extent)))
    n = len(shape)
    if len(start) != n or len(extent) != n:
        raise ArgumentError(f"FP8 scale shape: shape, start and extent need one value per dim "
                            f"({n}, {len(start)}, {len(extent)} given)")
    out = (ctypes.c_int64 * n)()
    es = ctypes.c_size_t()
    rc = _load().refit_fp8_scale_shape(cfmt, n, shape, start, extent, out, ctypes.byref(es))
    if rc < 0:
        raise Error(rc, f"FP8 format {fmt!r} on a {n}-dim tensor: expected block, "
                    "block:<rows>x<cols>, channel, tensor or mxfp8 and 2 dims or more")
    return list(out), es.value


class HostBuffer:
    """Shared host memory registered with the daemon: a memfd mapped here (an mmap object,
    usable like a bytearray: slicing, memoryview, readinto) and in the daemon. `region` is
    what add_piece takes. It stays valid after the client closes."""

    def __init__(self, size):
        size = _int("buffer size", size, (1, U64[1]))
        self.size = size
        self.fd = os.memfd_create("refit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.region = None

    def memoryview(self):
        return memoryview(self.mmap)

    def close(self):
        self.mmap.close()
        os.close(self.fd)


class Client:
    """One connection to a refit daemon (a context manager). socket None: $REFIT_SOCKET, else
    the default socket of the kind (publisherd for trainers and ctl, receiverd for engines)."""

    def __init__(self, kind, name="", rank=0, socket=None):
        self._c = None
        kind = _int("kind", kind, I32)
        cname = _cstr("client name", name, none_ok=True)
        rank = _int("rank", rank, I32)
        csock = _cstr("socket", socket) if socket else None
        lib = _load()
        self._lib = lib
        h = ctypes.c_void_p()
        rc = lib.refit_connect(csock, cname, rank, kind, ctypes.byref(h))
        if rc < 0:
            raise Error(rc, lib.refit_last_error(None).decode(errors="replace"))
        self._c = h
        self._buffers = []

    def _check(self, rc):
        if rc < 0:
            raise Error(rc, self._lib.refit_last_error(self._c).decode(errors="replace"))
        return rc

    def register_memfd(self, fd, size):
        """Registers size bytes of a memfd (made with MFD_ALLOW_SEALING); returns the region."""
        fd, size = _int("fd", fd, I32), _int("size", size, U64)
        region = ctypes.c_uint32()
        self._check(self._lib.refit_region_memfd(self._c, fd, size, ctypes.byref(region)))
        return region.value

    def register_cuda(self, ptr, size):
        """Registers size bytes of GPU memory at device address ptr (an int, such as
        tensor.data_ptr(); the allocation must stay alive while registered); returns the
        region. Memory of PyTorch's default caching allocator is shared by CUDA IPC, VMM
        allocations (expandable segments) as POSIX fds where they allow it; host or managed
        memory raises Error saying what to use instead."""
        ptr, size = _int("ptr", ptr, U64), _int("size", size, U64)
        region = ctypes.c_uint32()
        self._check(self._lib.refit_region_cuda(self._c, ctypes.c_void_p(ptr), size,
                                                ctypes.byref(region)))
        return region.value

    def alloc_host(self, size):
        """Allocates and registers a HostBuffer of size bytes."""
        buf = HostBuffer(size)
        try:
            buf.region = self.register_memfd(buf.fd, size)
        except Error:
            buf.close()
            raise
        self._buffers.append(buf)
        return buf

    def add_piece(self, tensor, dtype, shape, region, offset, start, extent, strides=None):
        """Registers the box (start, extent) of tensor (dtype name or REFIT value, global
        shape) at offset bytes in region; strides in elements, None for row-major. tensor is
        a str (sent as UTF-8) or bytes (sent as they are); the daemon takes printable UTF-8
        without spaces, quotes, backslashes or control characters."""
        name = _cstr("tensor name", tensor)
        what = f"tensor {tensor!r}"
        dt = _dtype(what, dtype)
        shape, start, extent = (_i64s(f"{what}: {w}", v) for w, v in
                                (("shape", shape), ("start", start), ("extent", extent)))
        strides = _i64s(f"{what}: strides", strides) if strides is not None else None
        region = _int(f"{what}: region", region, U32)
        offset = _int(f"{what}: offset", offset, U64)
        n = len(shape)
        if not (len(start) == len(extent) == n) or (strides is not None and len(strides) != n):
            raise ArgumentError(f"{what}: shape, start, extent and strides need one value "
                                "per dim")
        self._check(self._lib.refit_add_piece(self._c, name, dt, n, shape, region, offset,
                                              start, extent, strides))

    def add_piece_fp8(self, tensor, dtype, shape, region, offset, start, extent, fmt,
                      scale_region, scale_offset, strides=None, scale_strides=None):
        """Engines serving FP8: registers the box of tensor (dtype: the trainers', bf16, fp16
        or fp32) stored as float8_e4m3fn (1 byte an element) at offset in region, quantized
        during each refit in format fmt ("block" = 128x128 with fp32 scales, "block:RxC",
        "channel", "tensor", "mxfp8"), its scales at scale_offset in scale_region, laid out
        over the box's block grid (fp8_scale_shape); strides in elements, None for
        row-major. A trainer that holds the weight in FP8 registers it the same way: its bytes
        and scales are copied as they are into engine FP8 pieces of the same format."""
        name = _cstr("tensor name", tensor)
        what = f"FP8 tensor {tensor!r}"
        dt = _dtype(what, dtype)
        cfmt = _cstr(f"{what}: FP8 format", fmt)
        shape, start, extent = (_i64s(f"{what}: {w}", v) for w, v in
                                (("shape", shape), ("start", start), ("extent", extent)))
        strides = _i64s(f"{what}: strides", strides) if strides is not None else None
        sstrides = _i64s(f"{what}: scale_strides", scale_strides) \
            if scale_strides is not None else None
        region = _int(f"{what}: region", region, U32)
        offset = _int(f"{what}: offset", offset, U64)
        scale_region = _int(f"{what}: scale_region", scale_region, U32)
        scale_offset = _int(f"{what}: scale_offset", scale_offset, U64)
        n = len(shape)
        if not (len(start) == len(extent) == n) or (strides is not None and len(strides) != n) \
                or (sstrides is not None and len(sstrides) != n):
            raise ArgumentError(f"{what}: shape, start, extent and strides need one value "
                                "per dim")
        self._check(self._lib.refit_add_piece_fp8(
            self._c, name, dt, n, shape, region, offset, start, extent, strides, cfmt,
            scale_region, scale_offset, sstrides))

    def seal(self):
        self._check(self._lib.refit_seal(self._c))

    def publish(self, version):
        self._check(self._lib.refit_publish(self._c, _int("version", version, U64)))

    def wait_released(self, version, timeout_ms=-1):
        """Trainers: waits until version is committed everywhere (the weights may then be
        overwritten). Raises refit.Error: code -ETIMEDOUT after timeout_ms (-1: no limit),
        -ECANCELED when the refit aborted (publish again), -EAGAIN at once while the cluster
        cannot refit it, the message being the coordinator's reason (a plan that fails, a
        refused daemon): not final, the same wait after the cause is gone waits as usual."""
        self._check(self._lib.refit_wait_released(self._c, _int("version", version, U64),
                                                  _int("timeout_ms", timeout_ms, I32)))

    def wait_version(self, version, timeout_ms=-1):
        """Engines: waits until version or a later one is committed; returns the version the
        daemon committed, which the engine's memory holds (it may be later than version).
        Raises refit.Error as wait_released does (-EAGAIN: not now, with the cluster's
        reason)."""
        version = _int("version", version, U64)
        timeout_ms = _int("timeout_ms", timeout_ms, I32)
        reached = ctypes.c_uint64()
        self._check(self._lib.refit_wait_version_reached(self._c, version, timeout_ms,
                                                         ctypes.byref(reached)))
        return reached.value

    def next_event(self, timeout_ms=-1):
        """(event name, version) of the next pushed event."""
        timeout_ms = _int("timeout_ms", timeout_ms, I32)
        ev, ver = ctypes.c_int(), ctypes.c_uint64()
        self._check(self._lib.refit_next_event(self._c, timeout_ms, ctypes.byref(ev),
                                               ctypes.byref(ver)))
        return EVENT_NAMES.get(ev.value, str(ev.value)), ver.value

    def status(self):
        """The daemon's status document as a str of JSON."""
        p = ctypes.c_void_p()
        self._check(self._lib.refit_status_json(self._c, ctypes.byref(p)))
        try:
            return ctypes.string_at(p).decode()
        finally:
            self._lib._free(p)

    def trigger(self, version):
        self._check(self._lib.refit_trigger(self._c, _int("version", version, U64)))

    def wait(self, version, timeout_ms=-1):
        self._check(self._lib.refit_wait(self._c, _int("version", version, U64),
                                         _int("timeout_ms", timeout_ms, I32)))

    def gate(self):
        """Engines: hold installs until this client says consumed(); call before seal()."""
        self._check(self._lib.refit_gate(self._c))

    def consumed(self, version):
        """Engines (gated): done with committed version; the next may be installed."""
        self._check(self._lib.refit_consumed(self._c, _int("version", version, U64)))

    def close(self):
        if self._c is not None:
            self._lib.refit_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

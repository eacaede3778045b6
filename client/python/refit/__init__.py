"""refit: Python bindings (ctypes, standard library only) over librefit, the client library of
the refit daemons. Trainers register host buffers and pieces and publish versions; engines
register buffers and wait for versions; refitctl-like tools read status and trigger refits.

Every failing call raises refit.Error(code, message), code being a negative errno.
The library is loaded from $REFIT_LIB, else from build/librefit.so of this source tree."""

import ctypes
import errno
import fcntl
import mmap
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


def _i64s(values):
    return (ctypes.c_int64 * len(values))(*values)


def fp8_scale_shape(fmt, shape, start, extent):
    """The shape of the scales of an FP8 piece (the box's block grid) in format fmt, and the
    bytes of one scale (4: fp32; 1: E8M0 for mxfp8)."""
    n = len(shape)
    out = (ctypes.c_int64 * n)()
    es = ctypes.c_size_t()
    rc = _load().refit_fp8_scale_shape(fmt.encode(), n, _i64s(shape), _i64s(start),
                                       _i64s(extent), out, ctypes.byref(es))
    if rc < 0:
        raise Error(rc, f"FP8 format {fmt!r} on a {n}-dim tensor: expected block, "
                    "block:<rows>x<cols>, channel, tensor or mxfp8 and 2 dims or more")
    return list(out), es.value


class HostBuffer:
    """Shared host memory registered with the daemon: a memfd mapped here (an mmap object,
    usable like a bytearray: slicing, memoryview, readinto) and in the daemon. `region` is
    what add_piece takes. It stays valid after the client closes."""

    def __init__(self, size):
        if size <= 0:
            raise Error(-errno.EINVAL, f"buffer size {size}: must be > 0")
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
        lib = _load()
        self._lib = lib
        self._c = None
        h = ctypes.c_void_p()
        rc = lib.refit_connect(socket.encode() if socket else None, name.encode(), rank, kind,
                               ctypes.byref(h))
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
        region = ctypes.c_uint32()
        self._check(self._lib.refit_region_memfd(self._c, fd, size, ctypes.byref(region)))
        return region.value

    def register_cuda(self, ptr, size):
        """Registers size bytes of GPU memory at device address ptr (an int, such as
        tensor.data_ptr(); the allocation must stay alive while registered); returns the
        region. Memory of PyTorch's default caching allocator is shared by CUDA IPC, VMM
        allocations (expandable segments) as POSIX fds where they allow it; host or managed
        memory raises Error saying what to use instead."""
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
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        n = len(shape)
        if not (len(start) == len(extent) == n) or (strides is not None and len(strides) != n):
            raise Error(-errno.EINVAL, f"tensor {tensor}: shape, start, extent and strides "
                        "need one value per dim")
        name = tensor if isinstance(tensor, bytes) else tensor.encode()
        self._check(self._lib.refit_add_piece(
            self._c, name, dt, n, _i64s(shape), region, offset, _i64s(start),
            _i64s(extent), _i64s(strides) if strides is not None else None))

    def add_piece_fp8(self, tensor, dtype, shape, region, offset, start, extent, fmt,
                      scale_region, scale_offset, strides=None, scale_strides=None):
        """Engines serving FP8: registers the box of tensor (dtype: the trainers', bf16, fp16
        or fp32) stored as float8_e4m3fn (1 byte an element) at offset in region, quantized
        during each refit in format fmt ("block" = 128x128 with fp32 scales, "block:RxC",
        "channel", "tensor", "mxfp8"), its scales at scale_offset in scale_region, laid out
        over the box's block grid (fp8_scale_shape); strides in elements, None for
        row-major. A trainer that holds the weight in FP8 registers it the same way: its bytes
        and scales are copied as they are into engine FP8 pieces of the same format."""
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        n = len(shape)
        if not (len(start) == len(extent) == n) or (strides is not None and len(strides) != n) \
                or (scale_strides is not None and len(scale_strides) != n):
            raise Error(-errno.EINVAL, f"tensor {tensor}: shape, start, extent and strides "
                        "need one value per dim")
        name = tensor if isinstance(tensor, bytes) else tensor.encode()
        self._check(self._lib.refit_add_piece_fp8(
            self._c, name, dt, n, _i64s(shape), region, offset, _i64s(start), _i64s(extent),
            _i64s(strides) if strides is not None else None, fmt.encode(), scale_region,
            scale_offset, _i64s(scale_strides) if scale_strides is not None else None))

    def seal(self):
        self._check(self._lib.refit_seal(self._c))

    def publish(self, version):
        self._check(self._lib.refit_publish(self._c, version))

    def wait_released(self, version, timeout_ms=-1):
        self._check(self._lib.refit_wait_released(self._c, version, timeout_ms))

    def wait_version(self, version, timeout_ms=-1):
        """Engines: waits until version or a later one is committed; returns the version the
        daemon committed, which the engine's memory holds (it may be later than version)."""
        reached = ctypes.c_uint64()
        self._check(self._lib.refit_wait_version_reached(self._c, version, timeout_ms,
                                                         ctypes.byref(reached)))
        return reached.value

    def next_event(self, timeout_ms=-1):
        """(event name, version) of the next pushed event."""
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
        self._check(self._lib.refit_trigger(self._c, version))

    def wait(self, version, timeout_ms=-1):
        self._check(self._lib.refit_wait(self._c, version, timeout_ms))

    def gate(self):
        """Engines: hold installs until this client says consumed(); call before seal()."""
        self._check(self._lib.refit_gate(self._c))

    def consumed(self, version):
        """Engines (gated): done with committed version; the next may be installed."""
        self._check(self._lib.refit_consumed(self._c, version))

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

"""refit.torch: PyTorch trainers and engines join refit in a few lines.

    arena = refit.torch.share_module(model)          # host weights into one shared memfd
    with refit.Client(refit.TRAINER, rank=r) as c:
        refit.torch.register_module(c, model, "megatron", "tp=2", r, "qwen3-4b")
        c.seal()

register() registers one tensor (or a box of a larger one); register_module() binds a module's
named parameters to HF tensors and boxes by a convention (hf, megatron, vllm, sglang: with
"attn=dp" in the layout for --enable-dp-attention) whose layouts come from librefit
(refit_layout_*, the same model module the simulators and `refitctl plan` use).
A DTensor (FSDP2, tensor parallelism) needs no box: its device_mesh and placements give it, in
register() and in register_module(..., "hf", ...).
Memory is registered once per allocation: an Arena (one memfd) on the host, the CUDA allocation
(a caching allocator segment, a VMM allocation) on a GPU, so that a rank registers a handful of
regions whatever its parameter count. torch is imported here only: `import refit` stays
standard-library only."""

import ctypes
import errno
import fcntl
import mmap
import os
import re
import threading

import torch

from . import I32, I64, U64, ArgumentError, ArgumentTypeError, Error, _cstr, _int, _load

_ALIGN = 256  # every tensor of an arena starts here: any dtype's view is aligned

_TORCH_DTYPES = {
    torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3,
    torch.int8: 6, torch.uint8: 7, torch.int16: 8, torch.int32: 9, torch.int64: 10,
    torch.bool: 11,
}
for _name, _code in (("float8_e4m3fn", 4), ("float8_e5m2", 5)):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = _code
_REFIT_TO_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}
# What register_fp8 takes: the weight's bytes, and the dtypes of each kind of scales.
_FP8_WEIGHT = tuple(getattr(torch, n) for n in ("uint8", "float8_e4m3fn") if hasattr(torch, n))
_SCALE_FP32 = (torch.float32,)
_SCALE_E8M0 = tuple(getattr(torch, n) for n in ("uint8", "float8_e8m0fnu") if hasattr(torch, n))


# ---- host memory ---------------------------------------------------------------------------

_arenas = []  # every live Arena, to find the one a host tensor lives in
_arenas_lock = threading.Lock()


class Arena:
    """size bytes of shared host memory (a sealed memfd mapped here) that torch tensors are
    carved from: empty() hands out tensors, register() registers the whole arena once per
    client. The memory stays mapped while the arena or any of its tensors lives."""

    def __init__(self, size):
        size = _int("arena size", size, (1, U64[1]))
        self.size = size
        self.fd = os.memfd_create("refit-torch", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        self.used = 0
        with _arenas_lock:
            _arenas.append(self)

    def empty(self, shape, dtype=torch.float32):
        """A new tensor of shape and dtype inside the arena (contents undefined)."""
        shape = _shape(shape)
        numel = 1
        for s in shape:
            numel *= s
        esize = torch.empty((), dtype=dtype).element_size()
        start = (self.used + _ALIGN - 1) // _ALIGN * _ALIGN
        if start + numel * esize > self.size:
            raise Error(-errno.ENOMEM, f"arena of {self.size} bytes is full ({self.used} used): "
                        f"a tensor of {shape} {dtype} needs {numel * esize}; make a larger one")
        self.used = start + numel * esize
        return self.bytes[start:start + numel * esize].view(dtype).view(shape)

    def contains(self, ptr, nbytes):
        return self.base <= ptr and ptr + nbytes <= self.base + self.size


def _shape(shape):
    """shape as a tuple of sizes >= 0. A negative size is refused: torch's view() would take
    -1 as "infer this dim" and hand out a tensor of another shape than asked."""
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ArgumentTypeError(f"shape must be a sequence of sizes, not {type(shape).__name__} "
                                f"({shape!r})")
    return tuple(_int(f"shape {tuple(shape)}: size of dim {d}", n, (0, I64[1]))
                 for d, n in enumerate(shape))


def _arena_of(ptr, nbytes):
    with _arenas_lock:
        for a in _arenas:
            if a.contains(ptr, nbytes):
                return a
    return None


_default_arena = None


def empty(shape, dtype=torch.float32, arena=None):
    """A tensor in shared host memory that refit can move: from arena, else from this module's
    default arenas (256 MiB each, a larger one for a larger tensor)."""
    global _default_arena
    shape = _shape(shape)
    if arena is not None:
        return arena.empty(shape, dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        nbytes *= s
    if _default_arena is None or _default_arena.used + nbytes + _ALIGN > _default_arena.size:
        _default_arena = Arena(max(256 << 20, nbytes + _ALIGN))
    return _default_arena.empty(shape, dtype)


def share_module(module):
    """Moves every parameter of module (host tensors) into one new Arena sized for them all, so
    that a rank registers one region; returns the arena."""
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    total = sum((p.numel() * p.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for p in params)
    arena = Arena(max(total, _ALIGN))
    with torch.no_grad():
        for p in params:
            t = arena.empty(p.shape, p.dtype)
            t.copy_(p.data)
            p.data = t
    return arena


# ---- GPU memory ----------------------------------------------------------------------------

_libcuda = None


def _cuda_allocation(ptr):
    """(base, size) of the CUDA allocation holding device address ptr (cuMemGetAddressRange:
    a caching allocator's segment, a cudaMalloc, one VMM allocation)."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.POINTER(ctypes.c_size_t),
                                                     ctypes.c_uint64]
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc != 0:
        return None
    return base.value, size.value


def _cuda_run(ptr, nbytes):
    """(start, end) of the CUDA allocations, mapped back to back, that hold [ptr, ptr+nbytes);
    a sentence saying what is wrong when there are none or a gap."""
    first = _cuda_allocation(ptr)
    if first is None:
        return ("no CUDA allocation of this process holds it (cuMemGetAddressRange failed); "
                "register memory from torch's CUDA allocator")
    start, end = first[0], first[0] + first[1]
    while end < ptr + nbytes:
        nxt = _cuda_allocation(end)
        if nxt is None or nxt[0] != end:
            return (f"it runs past its allocations into unmapped memory at {end:#x}; register "
                    "only tensors inside torch's segments")
        end = nxt[0] + nxt[1]
    return start, end


# ---- registration --------------------------------------------------------------------------

def _regions(client):
    regs = getattr(client, "_torch_regions", None)
    if regs is None:
        regs = client._torch_regions = {}
    return regs


def region_count(client):
    """How many regions refit.torch registered on client."""
    return len(_regions(client))


def _region_of(client, tensor, what):
    """(region, base address) of the allocation holding tensor's bytes, registered on client
    the first time one of its tensors is."""
    ptr = tensor.data_ptr()
    span = _span_bytes(tensor)
    regs = _regions(client)
    if tensor.device.type == "cpu":
        arena = _arena_of(ptr, span)
        if arena is None:
            raise Error(-errno.EINVAL, f"{what}: host memory at {ptr:#x} ({span} bytes) is "
                        "private to this process, refit cannot move it; allocate it with "
                        "refit.torch.empty() or an Arena, or move the module there with "
                        "refit.torch.share_module(module)")
        key = ("host", id(arena))
        if key not in regs:
            regs[key] = (client.register_memfd(arena.fd, arena.size), arena.base,
                         arena.base + arena.size)
        return regs[key][0], regs[key][1]
    if tensor.device.type == "cuda":
        # A segment of the caching allocator is one allocation; an expandable segment maps
        # many back to back, a tensor may span several and librefit registers such a run as
        # one region. Regions already registered that hold the tensor are used again.
        dev = tensor.device.index
        for key, (region, start, end) in regs.items():
            if key[0] == "cuda" and key[1] == dev and start <= ptr and ptr + span <= end:
                return region, start
        with torch.cuda.device(tensor.device):
            run = _cuda_run(ptr, max(span, 1))
        if isinstance(run, str):
            raise Error(-errno.EINVAL, f"{what}: GPU memory at {ptr:#x} ({span} bytes): {run}")
        start, end = run
        regs[("cuda", dev, start)] = (client.register_cuda(start, end - start), start, end)
        return regs[("cuda", dev, start)][0], start
    raise Error(-errno.EINVAL, f"{what}: memory of device {tensor.device} cannot be moved by "
                "refit; use host (refit.torch.empty) or CUDA tensors")


def _span_bytes(tensor):
    """Bytes from the tensor's first element to one past its last."""
    if tensor.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what}: a {type(tensor).__name__} is not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise Error(-errno.EINVAL, f"{what}: a {tensor.layout} tensor has no strided storage "
                    "refit can address; register its dense form (to_dense())")
    if tensor.dtype not in _TORCH_DTYPES:
        raise Error(-errno.EINVAL, f"{what}: dtype {tensor.dtype} is not one refit moves "
                    f"(one of {', '.join(str(d) for d in _TORCH_DTYPES)})")
    # Negative strides need no check: torch refuses to make them (as_strided, from_numpy of a
    # reversed array and DLPack all raise), so every strided tensor addresses forward.
    if tensor.numel() == 0:
        # Checked before its memory is looked for: an empty tensor has no bytes to find.
        raise ArgumentError(f"{what}: the tensor is empty (shape {list(tensor.shape)}, no "
                            "element), refit has nothing to move; register tensors with at "
                            "least one element")
    return _TORCH_DTYPES[tensor.dtype]


# ---- DTensor ---------------------------------------------------------------------------------
# torch < 2.2 (Debian's 1.13) has no DTensor: nothing below imports it unless a tensor is one,
# and a DTensor can only exist once torch has imported its module.

def _is_dtensor(tensor):
    return any(c.__name__ == "DTensor" for c in type(tensor).__mro__)


_dt_api = None


def _dtensor_api():
    """(Shard, Replicate, compute_local_shape_and_global_offset) of the installed torch: the
    public torch.distributed.tensor (>= 2.5) or torch.distributed._tensor (2.2-2.4)."""
    global _dt_api
    if _dt_api is None:
        try:
            from torch.distributed.tensor import placement_types as pt, _utils as ut
        except ImportError:
            from torch.distributed._tensor import placement_types as pt, _utils as ut
        _dt_api = (pt.Shard, pt.Replicate, ut.compute_local_shape_and_global_offset)
    return _dt_api


def _dtensor_box(what, tensor):
    """(local tensor, global shape, box) of this rank's shard of a DTensor, from its device_mesh
    and placements through torch's own placement math (uneven last shards as torch.chunk cuts
    them, FSDP2's _StridedShard over TP). Partial and unknown placements are refused: their
    local tensor is not a box of the global one."""
    shard, replicate, local_box = _dtensor_api()
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    names = getattr(mesh, "mesh_dim_names", None)
    for i, pl in enumerate(placements):
        # FSDP2's _StridedShard (over a TP Shard) is a Shard subclass in some torch versions
        # and a placement of its own in others; torch's helper boxes it in both.
        if isinstance(pl, (shard, replicate)) or type(pl).__name__ == "_StridedShard":
            continue
        dim = f"mesh dim {i}" + (f" ('{names[i]}')" if names else "")
        if any(c.__name__ in ("Partial", "_Partial") for c in type(pl).__mro__):
            # Named by class and by torch's repr ("P(sum)" in recent torch, "_Partial(...)"
            # in older ones), so the message says "Partial" in every version.
            raise Error(-errno.EINVAL, f"{what}: placement Partial ({pl}) over {dim} holds "
                        "partial values (each rank one term of a reduction), not a box of the "
                        "tensor; "
                        "refit cannot move it: redistribute it to Shard or Replicate first "
                        "(tensor.redistribute(mesh, [Replicate()]))")
        raise Error(-errno.EINVAL, f"{what}: placement {pl} over {dim} is not one refit can "
                    f"express as a box (only Shard and Replicate are); placements {placements}")
    # A rank outside the mesh gets an empty shard from torch (and registers nothing).
    gshape = list(tensor.shape)
    shape, offset = local_box(tensor.shape, mesh, placements)
    with torch.no_grad():
        local = tensor.to_local()
    if list(shape) != list(local.shape):
        raise Error(-errno.EINVAL, f"{what}: torch's placement math gives this rank a shard of "
                    f"{list(shape)} for placements {placements} of {gshape}, its local tensor is "
                    f"{list(local.shape)}; refit cannot place it (register to_local() with a box)")
    return local, gshape, [(o, o + n) for o, n in zip(offset, shape)]


def register(client, hf_name, tensor, box=None, global_shape=None):
    """Registers tensor as the box of HF tensor hf_name: box is a list of (start, end) per dim
    (None: the whole tensor, global_shape its shape). dtype, strides and offset come from the
    tensor; its allocation is registered once per client. A DTensor brings its own global shape
    and box (from device_mesh and placements): its local tensor is registered, an empty shard
    registers nothing. Returns the number of pieces registered (0 or 1)."""
    _cstr("tensor name", hf_name)
    what = f"tensor {hf_name}"
    if _is_dtensor(tensor):
        if box is not None or global_shape is not None:
            raise Error(-errno.EINVAL, f"{what}: a DTensor's box and global shape come from its "
                        "placements; pass neither box nor global_shape")
        tensor, global_shape, box = _dtensor_box(what, tensor)
        if tensor.numel() == 0:
            return 0  # an uneven split's empty last shard: other ranks hold every element
    dt = _check_tensor(tensor, what)
    shape = list(tensor.shape) or [1]
    strides = list(tensor.stride()) or [1]
    if box is None:
        start, extent = [0] * len(shape), shape
        gshape = list(global_shape) if global_shape is not None else shape
    else:
        box = [tuple(b) for b in box]
        start = [b[0] for b in box]
        extent = [b[1] - b[0] for b in box]
        if extent != shape:
            raise Error(-errno.EINVAL, f"{what}: box {box} has extents {extent}, the tensor's "
                        f"shape is {shape}; they must be equal")
        if global_shape is None:
            raise Error(-errno.EINVAL, f"{what}: a box needs the global_shape of the tensor")
        gshape = list(global_shape)
    if len(gshape) != len(shape) or any(s < 0 or s + e > g for s, e, g in
                                        zip(start, extent, gshape)):
        raise Error(-errno.EINVAL, f"{what}: box starting at {start} with extents {extent} "
                    f"lies outside the global shape {gshape}")
    region, base = _region_of(client, tensor, what)
    client.add_piece(hf_name, dt, gshape, region, tensor.data_ptr() - base, start, extent,
                     strides)
    return 1


def register_fp8(client, hf_name, weight, scale, fmt="block", dtype=torch.bfloat16, box=None,
                 global_shape=None):
    """Engines serving FP8: registers weight (float8_e4m3fn, or uint8 where torch has no FP8
    dtype: the same bytes) as the box of HF tensor hf_name, which the trainers hold in dtype
    (bfloat16, float16 or float32); each refit quantizes it in fmt ("block" = 128x128 blocks,
    "block:RxC", "channel", "tensor", "mxfp8") and writes its scales into scale (float32, or
    uint8 E8M0 for mxfp8), shaped as the box's block grid (refit.fp8_scale_shape: for "block"
    it is DeepSeek-V3's and Qwen3-FP8's weight_scale_inv). box and global_shape as for
    register; both tensors in memory refit can move, on one device. A trainer that holds the
    weight in FP8 registers it the same way (its bytes and scales are copied as they are into
    engine FP8 pieces of the same format). Returns 1."""
    from . import fp8_scale_shape

    _cstr("tensor name", hf_name)
    what = f"FP8 tensor {hf_name}"
    for t, name in ((weight, "weight"), (scale, "scale")):
        _check_tensor(t, f"{what}: its {name}")
    if weight.dtype not in _FP8_WEIGHT:
        raise ArgumentError(f"{what}: the weight is {weight.dtype}; FP8 weights are "
                            "float8_e4m3fn (uint8 where torch has no FP8 dtype)")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Error(-errno.EINVAL, f"{what}: trainers' dtype {dtype} is not quantized; give "
                    "bfloat16, float16 or float32")
    if weight.device != scale.device:
        raise Error(-errno.EINVAL, f"{what}: weight on {weight.device}, scales on "
                    f"{scale.device}: both must be on one device")
    shape = list(weight.shape)
    if box is None:
        start, gshape = [0] * len(shape), list(global_shape) if global_shape else shape
    else:
        start = [b[0] for b in box]
        if [b[1] - b[0] for b in box] != shape or global_shape is None:
            raise Error(-errno.EINVAL, f"{what}: box {box} must have the weight's shape "
                        f"{shape} and come with global_shape")
        gshape = list(global_shape)
    sshape, ses = fp8_scale_shape(fmt, gshape, start, shape)
    # The scales are fp32, or E8M0 bytes for mxfp8 (fp8_scale_shape's element size says which):
    # another dtype of the same size (int32 for fp32) would be read as fp32 bits.
    want = _SCALE_FP32 if ses == 4 else _SCALE_E8M0
    if scale.dtype not in want:
        raise ArgumentError(f"{what}: format {fmt} keeps its scales as "
                            f"{' or '.join(str(d) for d in want)}; scale is {scale.dtype}")
    if list(scale.shape) != sshape or scale.element_size() != ses:
        raise Error(-errno.EINVAL, f"{what}: format {fmt} on box {shape} at {start} needs "
                    f"{sshape} scales of {ses} bytes; scale is {list(scale.shape)} of "
                    f"{scale.dtype}")
    region, base = _region_of(client, weight, what)
    sregion, sbase = _region_of(client, scale, what)
    client.add_piece_fp8(hf_name, _TORCH_DTYPES[dtype], gshape, region,
                         weight.data_ptr() - base, start, shape, fmt, sregion,
                         scale.data_ptr() - sbase, list(weight.stride()), list(scale.stride()))
    return 1


class Param:
    """One parameter of a layout: its name in the convention, torch dtype, local shape, and
    its pieces: (hf_name, global_shape, start, extent, strides, offset in elements)."""

    def __init__(self, name, dtype, shape, pieces):
        self.name, self.dtype, self.shape, self.pieces = name, dtype, shape, pieces


def layout(model, convention, parallel="", rank=0, shrink=1):
    """The parameters of one rank of model (a builtin name or JSON spec) as the convention
    names them, from librefit's model module: a list of Param."""
    lib = _load()
    if not hasattr(lib, "_layout_sigs"):
        c_p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.refit_layout_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(c_p)]
        lib.refit_layout_open.restype = ctypes.c_int
        lib.refit_layout_nparams.argtypes = [c_p]
        lib.refit_layout_nparams.restype = ctypes.c_uint32
        lib.refit_layout_param.argtypes = [c_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_char_p),
                                           ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int), ctypes.POINTER(i64),
                                           ctypes.POINTER(ctypes.c_uint32)]
        lib.refit_layout_param.restype = ctypes.c_int
        lib.refit_layout_piece.argtypes = [c_p, ctypes.c_uint32, ctypes.c_uint32,
                                           ctypes.POINTER(ctypes.c_char_p),
                                           ctypes.POINTER(ctypes.c_int)] + \
            [ctypes.POINTER(i64)] * 4 + [ctypes.POINTER(ctypes.c_uint64)]
        lib.refit_layout_piece.restype = ctypes.c_int
        lib.refit_layout_free.argtypes = [c_p]
        lib.refit_layout_free.restype = None
        lib._layout_sigs = True
    cmodel = _cstr("model", str(model))
    cconv = _cstr("convention", convention)
    cpar = _cstr("parallel", parallel or "")
    rank, shrink = _int("rank", rank, I32), _int("shrink", shrink, I32)
    h = ctypes.c_void_p()
    rc = lib.refit_layout_open(cmodel, shrink, cconv, cpar, rank, ctypes.byref(h))
    if rc < 0:
        raise Error(rc, lib.refit_last_error(None).decode(errors="replace"))
    try:
        out = []
        name, tname = ctypes.c_char_p(), ctypes.c_char_p()
        dt, nd, npc = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint32()
        arr = [(ctypes.c_int64 * 8)() for _ in range(5)]
        off = ctypes.c_uint64()
        for i in range(lib.refit_layout_nparams(h)):
            lib.refit_layout_param(h, i, ctypes.byref(name), ctypes.byref(dt), ctypes.byref(nd),
                                   arr[0], ctypes.byref(npc))
            shape = tuple(arr[0][:nd.value])
            pieces = []
            for j in range(npc.value):
                lib.refit_layout_piece(h, i, j, ctypes.byref(tname), ctypes.byref(nd), arr[1],
                                       arr[2], arr[3], arr[4], ctypes.byref(off))
                n = nd.value
                pieces.append((tname.value.decode(), tuple(arr[1][:n]), tuple(arr[2][:n]),
                               tuple(arr[3][:n]), tuple(arr[4][:n]), off.value))
            out.append(Param(name.value.decode(), _REFIT_TO_TORCH.get(dt.value), shape, pieces))
        return out
    finally:
        lib.refit_layout_free(h)


def piece_view(param, piece):
    """The view of a contiguous local parameter tensor that holds piece (an entry of
    Param.pieces): indexing it is indexing the HF tensor's box."""
    _, _, _, extent, strides, offset = piece
    return param.as_strided(extent, strides, param.storage_offset() + offset)


# Megatron-Core's Transformer Engine layers fuse the norm before a linear layer into it: the
# same weights as the local spec's input_layernorm and (dense layers) pre_mlp_layernorm. Its
# grouped-GEMM experts (TEGroupedMLP) name local expert i's weights linear_fc1.weight<i>.
_MEGATRON_TE = [
    (re.compile(r"^(decoder\.layers\.\d+\.)self_attention\.linear_qkv\.layer_norm_weight$"),
     r"\1input_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.)mlp\.linear_fc1\.layer_norm_weight$"),
     r"\1pre_mlp_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$"),
     r"\1local_experts.\3.\2.weight"),
]


def _canonical(name, convention, prefix):
    """The layout's name of a module's parameter: prefix (a wrapper's "module.") removed,
    Transformer Engine's fused norms named as the local spec names them."""
    if prefix:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix):]
    if convention == "megatron":
        for pat, to in _MEGATRON_TE:
            name = pat.sub(to, name)
    return name


def register_module(client, module_or_named_params, convention, parallel="", rank=0,
                    model=None, shrink=1, prefix=""):
    """Registers every named parameter of a module (or a dict or iterable of (name, tensor))
    as the HF pieces the convention puts there for this rank of model. Every parameter the layout
    lists must be present, with its dtype and shape, and no other; each must be contiguous.
    prefix is removed from every name (e.g. "module." of a DDP wrapper); Megatron's
    Transformer Engine names (linear_qkv.layer_norm_weight, grouped experts'
    linear_fc1.weight<i>) are taken too.
    Returns {"params": n, "pieces": n, "regions": n} (regions: of this client so far)."""
    if model is None:
        raise Error(-errno.EINVAL, "register_module: model (a builtin name or a JSON spec) is "
                    "required")
    if hasattr(module_or_named_params, "named_parameters"):
        given = list(module_or_named_params.named_parameters())
    elif hasattr(module_or_named_params, "items"):
        given = list(module_or_named_params.items())
    else:
        given = list(module_or_named_params)
    named = {}
    for name, t in given:
        canon = _canonical(name, convention, prefix)
        if canon is None:
            raise Error(-errno.ENOENT, f"parameter {name}: its name does not begin with "
                        f"prefix '{prefix}'")
        named[canon] = t
    params = layout(model, convention, parallel, rank, shrink)
    where = f"the {convention} layout '{parallel}' of {model} rank {rank}"
    known = {p.name for p in params}
    for name in named:
        if name not in known:
            raise Error(-errno.ENOENT, f"parameter {name}: {where} has no parameter of this "
                        f"name (it has {len(known)}, e.g. {sorted(known)[:3]})")
    npieces = 0
    for p in params:
        t = named.get(p.name)
        what = f"parameter {p.name}"
        if t is None:
            raise Error(-errno.ENOENT, f"{what} of {where} is missing from the module")
        dt = _check_tensor(t, what)
        if p.dtype is not None and t.dtype != p.dtype:
            raise Error(-errno.EINVAL, f"{what}: dtype {t.dtype}, the model config says "
                        f"{p.dtype}")
        if tuple(t.shape) != p.shape:
            raise Error(-errno.EINVAL, f"{what}: shape {tuple(t.shape)}, {where} says "
                        f"{p.shape}")
        if _is_dtensor(t):
            # FSDP2 / parallelize_module: the DTensor's placements say which box this rank
            # holds, so only the hf convention (every tensor whole) can take it.
            if convention != "hf":
                raise Error(-errno.EINVAL, f"{what}: a DTensor (placements "
                            f"{tuple(t.placements)}) is placed by its device mesh; register "
                            f"it with the hf convention, not {convention}")
            npieces += register(client, p.pieces[0][0], t)
            continue
        if not t.is_contiguous():
            raise Error(-errno.EINVAL, f"{what}: strides {tuple(t.stride())} are not row-major; "
                        "the convention places pieces in a contiguous parameter")
        region, base = _region_of(client, t, what)
        origin = t.data_ptr() - base
        esize = t.element_size()
        for hf, gshape, start, extent, strides, offset in p.pieces:
            client.add_piece(hf, dt, list(gshape), region, origin + offset * esize,
                             list(start), list(extent), list(strides))
            npieces += 1
    return {"params": len(params), "pieces": npieces, "regions": region_count(client)}

"""tests/gpu/fp8_torch.py - recomputes in PyTorch what refit's GPU quantizer wrote (fp8_dump's
directory: bf16 sources, float8_e4m3fn bytes, scales) with the formula of common/data/quant.h,
and compares every byte and every scale.

    python3 tests/gpu/fp8_torch.py DIR [--devices cuda,cpu]

The torch formula, per block of the format's grid:
    amax  = where(isfinite(x), |x|, 0).amax()                           (fp32)
    scale = amax / 448, 1 where that is 0                               (block, channel, tensor)
    scale = 2^clamp(floor(log2 amax) - 8, -127, 127), 1 where amax == 0 (mxfp8, E8M0 byte e+127)
    q     = (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)
NaN elements are compared by the contract's rule, byte 0x7F (torch keeps the NaN's sign, a GPU
division does not). Every division has tensors on both sides: torch's CUDA kernel turns a
division by a CPU scalar into a multiplication by its reciprocal, which rounds differently.
Exits 0 when nothing differs on any device, 1 otherwise.
"""

import argparse
import os
import sys

import torch


def grid(fmt, rows, cols):
    """The block (rows, cols) of a format name as rf_quant_fmt_parse reads it."""
    if fmt == "block":
        return 128, 128
    if fmt.startswith("block:"):
        r, c = fmt[len("block:"):].split("x")
        return int(r), int(c)
    if fmt == "channel":
        return 1, cols
    if fmt == "tensor":
        return rows, cols
    if fmt == "mxfp8":
        return 1, 32
    raise ValueError("unknown format %r" % fmt)


def read(path, dtype, count):
    with open(path, "rb") as f:
        data = f.read()
    esize = torch.empty((), dtype=dtype).element_size()
    if len(data) != count * esize:
        raise ValueError("%s holds %d bytes, expected %d (%d x %s)" %
                         (path, len(data), count * esize, count, dtype))
    return torch.frombuffer(bytearray(data), dtype=dtype)


def reference(x, fmt, dev):
    """torch's bytes and scales for the bf16 matrix x (on dev): uint8 [rows, cols], and fp32
    or uint8 (E8M0) [srows, scols]."""
    rows, cols = x.shape
    br, bc = grid(fmt, rows, cols)
    sr, sc = -(-rows // br), -(-cols // bc)
    xf = x.float()
    a = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    # Partial blocks at the edges: padding with 0 leaves every amax as it is.
    padded = torch.zeros(sr * br, sc * bc, dtype=torch.float32, device=dev)
    padded[:rows, :cols] = a
    amax = padded.view(sr, br, sc, bc).amax(dim=(1, 3))
    if fmt == "mxfp8":
        _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        ex = (e.to(torch.int32) - 1 - 8).clamp(-127, 127)
        ex = torch.where(amax == 0, torch.zeros_like(ex), ex)
        byte = ex + 127
        # 2^(byte - 127) from its bits; byte 0 is the fp32 subnormal 2^-127.
        bits = torch.where(byte == 0, torch.full_like(byte, 0x00400000),
                           torch.bitwise_left_shift(byte, 23))
        scale = bits.view(torch.float32)
        stored = byte.to(torch.uint8)
    else:
        scale = amax / torch.full_like(amax, 448.0)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        stored = scale
    full = scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)[:rows, :cols]
    v = (xf / full.contiguous()).clamp(-448.0, 448.0)
    q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.isnan(v)
    odd = nan & (q != 0x7F) & (q != 0xFF)
    if bool(odd.any()):
        raise AssertionError("torch encoded a NaN as neither 0x7F nor 0xFF")
    q = torch.where(nan, torch.full_like(q, 0x7F), q)
    return q, stored


def bf16_hex(x, r, c):
    return "0x%04x" % (int(x[r, c].view(torch.int16)) & 0xFFFF)


def compare(name, fmt, x, q_ours, s_ours, dev):
    """Prints one line for this matrix, format and device; returns (bytes, scales, differ)."""
    q_ref, s_ref = reference(x.to(dev), fmt, dev)
    q_ref, s_ref = q_ref.cpu(), s_ref.cpu()
    if fmt == "mxfp8":
        s_diff = s_ref != s_ours
    else:  # bit for bit, -0 and NaN included
        s_diff = s_ref.view(torch.int32) != s_ours.view(torch.int32)
    q_diff = q_ref != q_ours
    nq, ns = int(q_diff.sum()), int(s_diff.sum())
    print("%-5s %-22s %-12s %9d bytes, %7d scales, %d differ" %
          (dev, name, fmt, q_ours.numel(), s_ours.numel(), nq + ns))
    rows, cols = x.shape
    br, bc = grid(fmt, rows, cols)
    for i, j in s_diff.nonzero().tolist()[:5]:
        print("    scale [%d, %d]: torch %r, refit %r" %
              (i, j, s_ref[i, j].item(), s_ours[i, j].item()))
    for r, c in q_diff.nonzero().tolist()[:10]:
        print("    q [%d, %d] (source %s, block scale %r): torch 0x%02x, refit 0x%02x" %
              (r, c, bf16_hex(x, r, c), s_ref[r // br, c // bc].item(),
               int(q_ref[r, c]), int(q_ours[r, c])))
    return q_ours.numel(), s_ours.numel(), nq + ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="fp8_dump's output directory")
    ap.add_argument("--devices", default=None,
                    help="comma-separated torch devices to compute on (default: cuda,cpu where "
                         "CUDA is available, else cpu)")
    args = ap.parse_args()
    if not hasattr(torch, "float8_e4m3fn"):
        print("fp8_torch: torch %s has no float8_e4m3fn (it needs torch >= 2.1)" %
              torch.__version__)
        return 1
    devs = args.devices.split(",") if args.devices else \
        (["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"])
    lines = []
    with open(os.path.join(args.dir, "manifest.txt")) as f:
        for line in f:
            if line.strip():
                lines.append(line.split())
    if not lines:
        print("fp8_torch: %s/manifest.txt lists nothing" % args.dir)
        return 1
    totals = {}
    sources = {}
    for name, rows, cols, fmt, tag, srows, scols in lines:
        rows, cols, srows, scols = int(rows), int(cols), int(srows), int(scols)
        if name not in sources:
            sources[name] = read(os.path.join(args.dir, name + ".src"), torch.int16,
                                 rows * cols).view(torch.bfloat16).view(rows, cols)
        x = sources[name]
        q = read(os.path.join(args.dir, "%s.%s.q" % (name, tag)), torch.uint8,
                 rows * cols).view(rows, cols)
        sdt = torch.uint8 if fmt == "mxfp8" else torch.float32
        s = read(os.path.join(args.dir, "%s.%s.scale" % (name, tag)), sdt,
                 srows * scols).view(srows, scols)
        for dev in devs:
            nb, ns, nd = compare(name, fmt, x, q, s, dev)
            t = totals.setdefault((dev, fmt), [0, 0, 0])
            t[0] += nb
            t[1] += ns
            t[2] += nd
    print()
    bad = 0
    for (dev, fmt), (nb, ns, nd) in sorted(totals.items()):
        print("%-5s %-12s %10d bytes, %8d scales, %d differ" % (dev, fmt, nb, ns, nd))
        bad += nd
    want = {"block", "channel", "tensor", "mxfp8"}
    missing = want - {fmt for _, fmt in totals}
    if missing:
        print("fp8_torch: the dump lacks format(s) %s" % ", ".join(sorted(missing)))
        return 1
    if bad:
        print("fp8_torch: FAILED: %d bytes or scales differ from torch's" % bad)
        return 1
    print("fp8_torch: every byte and scale equal to torch's (torch %s, devices %s)" %
          (torch.__version__, ",".join(devs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

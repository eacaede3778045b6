"""tests/e2e/pbwire.py - the daemons' wire spoken by hand, for the tests that send what no
real client would (43-bad-input, 45-handshake): protobuf fields, the 4-byte big-endian frames of
both channels, and the control protocol version of this tree."""
import os
import re
import struct


def _peer_protocol():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "common",
                        "control", "peer.h")
    with open(path) as f:
        return int(re.search(r"#define RF_PEER_PROTOCOL_VERSION (\d+)", f.read()).group(1))


# The daemons' control protocol version (common/control/peer.h), so that a test's Hello is
# refused only for what the test means to be wrong.
PEER_PROTOCOL = _peer_protocol()


def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if n == 0:
            return out + bytes([b])
        out += bytes([b | 0x80])


def read_varint(b, i):
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return n, i


def field(num, payload):
    """A protobuf field: an int is a varint, bytes are length-delimited."""
    if isinstance(payload, int):
        return varint(num << 3) + varint(payload)
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def parse_fields(b):
    """The top-level fields of a message, the last of each number kept."""
    return {num: vals[-1] for num, vals in parse_all(b).items()}


def frame(body):
    return struct.pack(">I", len(body)) + body


def parse_all(b):
    """The top-level fields of a message, every value of each number in order (repeated
    fields, and packed varints left as their bytes)."""
    i, out = 0, {}
    while i < len(b):
        key, i = read_varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(b, i)
        elif wt == 2:
            n, i = read_varint(b, i)
            v, i = b[i:i + n], i + n
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % wt)
        out.setdefault(num, []).append(v)
    return out


def zigzag(n):
    """A sint32/sint64 field's varint for n."""
    return (n << 1) ^ (n >> 63)


def unzigzag(v):
    return (v >> 1) ^ -(v & 1)

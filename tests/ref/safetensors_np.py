"""safetensors_np - a minimal safetensors reader/writer on NumPy, for the
reference implementation and its self-tests only.

Owns: parsing a checkpoint directory (with or without
model.safetensors.index.json), turning stored bytes into NumPy arrays, and
writing small files for the self-tests.

Invariants: every tensor's byte range lies inside its file's data section and
its size equals prod(shape) * itemsize (checked at open, before any read);
decoding follows the format definitions written out here (BF16 by bit shift,
F16/F8 from sign/exponent/mantissa fields), never a library's converter.

Format (docs/MODEL.md §2.2): u64 little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the data; offsets are relative to the start of the data.
"""

import json
import os
import struct

import numpy as np

# storage dtype of each safetensors dtype: what the raw bytes are read as
_STORAGE = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
}

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")


class SafetensorsError(Exception):
    """A malformed or missing file or tensor; the message names it."""


# ---------------------------------------------------------------- decoding

def bf16_to_f32(bits):
    """u16 bit patterns -> float32: bf16 is the top half of an f32."""
    b = np.asarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x):
    """float32 -> u16 bf16 bit patterns, round to nearest, ties to even
    (used by the writer; NaN stays NaN)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    r = np.where(nan, (u >> np.uint64(16)) | np.uint64(0x40), r)
    return r.astype(np.uint16)


def minifloat_decode(bits, exp_bits, man_bits, bias, special):
    """Decode unsigned integer bit patterns of a small binary float format
    into float64, from the definition: sign | exponent | mantissa.

    exponent 0 is subnormal: (m / 2^man_bits) * 2^(1 - bias); otherwise
    (1 + m / 2^man_bits) * 2^(e - bias). `special` says what the all-ones
    exponent means:
      "ieee": mantissa 0 -> infinity, else NaN (F16, F8_E5M2);
      "fn":   only the all-ones exponent AND all-ones mantissa is NaN, other
              patterns are ordinary numbers, no infinities (F8_E4M3FN).
    """
    b = np.asarray(bits).astype(np.int64)
    sign = np.where((b >> (exp_bits + man_bits)) & 1, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = (b & ((1 << man_bits) - 1)).astype(np.float64)
    emax = (1 << exp_bits) - 1
    frac = m / float(1 << man_bits)
    normal = np.ldexp(1.0 + frac, (e - bias).astype(np.int32))
    sub = np.ldexp(frac, np.full(e.shape, 1 - bias, dtype=np.int32))
    val = np.where(e == 0, sub, normal)
    if special == "ieee":
        val = np.where(e == emax, np.where(m == 0, np.inf, np.nan), val)
    elif special == "fn":
        val = np.where((e == emax) & (m == (1 << man_bits) - 1), np.nan, val)
    else:
        raise ValueError(special)
    return sign * val


def f16_to_f64(bits):
    """IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits."""
    return minifloat_decode(bits, 5, 10, 15, "ieee")


def e4m3_to_f64(bits):
    """OCP FP8 E4M3 (the FN variant): 1|4|3, bias 7, max 448, S.1111.111 NaN."""
    return minifloat_decode(bits, 4, 3, 7, "fn")


def e5m2_to_f64(bits):
    """OCP FP8 E5M2: 1|5|2, bias 15, IEEE-style infinities and NaN."""
    return minifloat_decode(bits, 5, 2, 15, "ieee")


def decode(dtype, raw):
    """Stored array (as read with _STORAGE[dtype]) -> values. Float formats
    give float32 (BF16, F32) or float64 (F16, F8, F64: exact either way);
    integer formats are returned as they are."""
    if dtype == "BF16":
        return bf16_to_f32(raw)
    if dtype == "F16":
        return f16_to_f64(raw)
    if dtype == "F8_E4M3":
        return e4m3_to_f64(raw)
    if dtype == "F8_E5M2":
        return e5m2_to_f64(raw)
    return raw


# ---------------------------------------------------------------- reading

class _Entry:
    __slots__ = ("name", "dtype", "shape", "path", "offset", "nbytes")


def _read_header(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated: no 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} runs past end of file ({size} bytes)")
        text = f.read(n)
    try:
        hdr = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as ex:
        raise SafetensorsError(f"{path}: header is not valid JSON: {ex}")
    if not isinstance(hdr, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    entries = {}
    for name, d in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(d, dict):
            raise SafetensorsError(f"{path}: tensor {name}: entry is not an object")
        dt = d.get("dtype")
        if dt not in _STORAGE:
            raise SafetensorsError(f"{path}: tensor {name}: unsupported dtype {dt!r}")
        shape = d.get("shape")
        offs = d.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) for o in offs)):
            raise SafetensorsError(f"{path}: tensor {name}: bad shape or data_offsets")
        begin, end = offs
        count = 1
        for s in shape:
            count *= s
        nbytes = count * _STORAGE[dt].itemsize
        if not (0 <= begin <= end) or data_start + end > size:
            raise SafetensorsError(f"{path}: tensor {name}: data_offsets {offs} outside the data section")
        if end - begin != nbytes:
            raise SafetensorsError(f"{path}: tensor {name}: {end - begin} bytes for shape {shape} "
                                   f"{dt}, expected {nbytes}")
        e = _Entry()
        e.name, e.dtype, e.shape, e.path = name, dt, tuple(shape), path
        e.offset, e.nbytes = data_start + begin, nbytes
        entries[name] = e
    return entries


class SafetensorsDir:
    """All tensors of a checkpoint directory. With model.safetensors.index.json
    the weight_map decides which shard holds each tensor (and every mapped
    tensor must be there); without it every *.safetensors file is read and a
    name may appear only once."""

    def __init__(self, directory):
        self.directory = directory
        self._entries = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, "rb") as f:
                try:
                    wm = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError) as ex:
                    raise SafetensorsError(f"{index}: no usable weight_map: {ex}")
            headers = {}
            for name, shard in wm.items():
                if shard not in headers:
                    headers[shard] = _read_header(os.path.join(directory, shard))
                if name not in headers[shard]:
                    raise SafetensorsError(f"{index}: tensor {name} mapped to {shard}, which lacks it")
                self._entries[name] = headers[shard][name]
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise SafetensorsError(f"{directory}: no *.safetensors files")
            for fn in files:
                for name, e in _read_header(os.path.join(directory, fn)).items():
                    if name in self._entries:
                        raise SafetensorsError(f"{directory}: tensor {name} in two shards "
                                               f"({self._entries[name].path}, {fn})")
                    self._entries[name] = e

    def names(self):
        return sorted(self._entries)

    def has(self, name):
        return name in self._entries

    def dtype(self, name):
        return self._entry(name).dtype

    def shape(self, name):
        return self._entry(name).shape

    def _entry(self, name):
        try:
            return self._entries[name]
        except KeyError:
            raise SafetensorsError(f"{self.directory}: missing tensor {name}")

    def raw(self, name):
        """The stored elements (u16 for BF16/F16, u8 for F8), shaped."""
        e = self._entry(name)
        st = _STORAGE[e.dtype]
        count = e.nbytes // st.itemsize
        with open(e.path, "rb") as f:
            f.seek(e.offset)
            buf = f.read(e.nbytes)
        if len(buf) != e.nbytes:
            raise SafetensorsError(f"{e.path}: tensor {name}: short read")
        return np.frombuffer(buf, dtype=st, count=count).reshape(e.shape)

    def get(self, name):
        """Decoded values: floats as float32/float64, integers as stored."""
        e = self._entry(name)
        return decode(e.dtype, self.raw(name))

    def get_f64(self, name):
        """Decoded float tensor widened to float64 (exact for every float dtype)."""
        e = self._entry(name)
        if e.dtype not in FLOAT_DTYPES:
            raise SafetensorsError(f"{e.path}: tensor {name}: dtype {e.dtype} is not a float type")
        return np.asarray(self.get(name), dtype=np.float64)


# ---------------------------------------------------------------- writing

def save_file(path, tensors, metadata=None):
    """Write one safetensors file. `tensors` maps name -> (dtype, array) where
    the array already holds the STORAGE values (u16 bit patterns for BF16/F16,
    u8 for F8, the numbers themselves otherwise). Tensors are laid out in
    name order; the header is padded with spaces to a multiple of 8."""
    hdr = {}
    if metadata:
        hdr["__metadata__"] = metadata
    blobs = []
    off = 0
    for name in sorted(tensors):
        dt, arr = tensors[name]
        a = np.ascontiguousarray(np.asarray(arr).astype(_STORAGE[dt], copy=False))
        b = a.tobytes()
        hdr[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    text = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)

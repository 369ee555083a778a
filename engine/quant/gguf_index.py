"""A GGUF file's tensor table and scalar metadata, read in one pass over its header.

The `gguf` package's GGUFReader makes a numpy view for every part of every metadata
field, the tokenizer's ~100k strings included: 2-4 s on the default model, spent on
every engine start just to find where the tensors are. The engine needs only the
tensor table (name, type, shape, offset) and a few scalars (architecture, head
counts), so this walks the header with `struct`, skipping arrays by their lengths
(~50 ms), and hands out tensors as slices of one read-only memory map. The format's
constants (value types, block sizes) still come from the `gguf` package.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import UnsupportedModelError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# scalar value types -> struct format (little-endian)
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# numpy dtypes of the unquantized tensor types
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                 "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `shape` as GGUF lists it (fastest-moving dimension
    first), `offset` and `nbytes` within the file."""

    name: str
    type_name: str  # the GGML type's name (Q4_1, F32, ...)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFIndex:
    """The tensor table and scalar metadata of a (little-endian) GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        buf = memoryview(self.data)
        if bytes(buf[:4]) != _MAGIC:
            raise UnsupportedModelError(f"{self.path} is not a GGUF file (bad magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise UnsupportedModelError(f"{self.path} is a big-endian GGUF file; only "
                                        "little-endian files are read")
        self._buf, self._pos = buf, 24
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            value = self._value(GGUFValueType(self._unpack("<I")))
            if value is not _SKIPPED:
                self.metadata[key] = value
        table = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [GGUFTensor(name, type_name, shape, start + offset, nbytes)
                        for name, type_name, shape, offset, nbytes in table]
        del self._buf

    def array(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes in the map: uint8 [rows, bytes per row] for a block type,
        the values in GGUF's order reversed (rows last-listed first) for a float type."""
        raw = self.data[tensor.offset:tensor.offset + tensor.nbytes]
        rows = tuple(reversed(tensor.shape))
        dtype = _FLOAT_DTYPES.get(tensor.type_name)
        if tensor.type_name == "BF16":
            return raw.view(np.uint16).reshape(rows)
        if dtype is not None:
            return raw.view(dtype).reshape(rows)
        return raw.reshape(math.prod(rows[:-1]), -1)

    # ---- the header ----------------------------------------------------------------
    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._buf[self._pos:self._pos + length]).decode("utf-8", "replace")
        self._pos += length
        return text

    def _value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:  # skipped: the tokenizer's, read at conversion
            item = GGUFValueType(self._unpack("<I"))
            count = self._unpack("<Q")
            if item == GGUFValueType.STRING:
                for _ in range(count):
                    length = self._unpack("<Q")  # moves past the length first
                    self._pos += length
            elif item == GGUFValueType.ARRAY:
                for _ in range(count):
                    self._value(GGUFValueType.ARRAY)
            else:
                self._pos += count * struct.calcsize(_SCALARS[item])
            return _SKIPPED
        return self._unpack(_SCALARS[kind])

    def _tensor_info(self) -> tuple[str, str, tuple[int, ...], int, int]:
        name = self._string()
        dims = self._unpack("<I")
        shape = struct.unpack_from(f"<{dims}Q", self._buf, self._pos)
        self._pos += 8 * dims
        kind = self._unpack("<I")
        offset = self._unpack("<Q")
        try:
            ggml = GGMLQuantizationType(kind)
        except ValueError:
            raise UnsupportedModelError(
                f"GGUF tensor {name!r} has type {kind}, which the gguf package does not "
                "know") from None
        block, size = GGML_QUANT_SIZES[ggml]
        return name, ggml.name, tuple(int(d) for d in shape), offset, \
            math.prod(shape) // block * size


_SKIPPED = object()

"""Read and write the safetensors container with NumPy only (bf16 kept as uint16 bits).

Format: 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
then the data. Source: https://github.com/huggingface/safetensors (format spec).
The `safetensors` package's NumPy API cannot hold bf16, hence this module.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from executor.errors import CheckpointError

ST_DTYPES: dict[str, tuple[str, np.dtype]] = {
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F16": ("float16", np.dtype("<f2")),
    "F32": ("float32", np.dtype("<f4")),
    "F64": ("float64", np.dtype("<f8")),
    "I64": ("int64", np.dtype("<i8")),
    "I32": ("int32", np.dtype("<i4")),
    "U8": ("uint8", np.dtype("u1")),
    "BOOL": ("bool", np.dtype("?")),
}
_NAME_TO_ST = {name: code for code, (name, _) in ST_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@attrs.frozen(slots=True)
class TensorEntry:
    """Where one tensor lives: file, dtype name ("bfloat16", ...), shape, absolute byte range."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header and check every tensor's byte range lies in the file.

    Raises CheckpointError naming the file (and the tensor) when the file is too short,
    the header is not JSON, a dtype is unknown, a byte range disagrees with its shape, or
    the file is truncated before a tensor's end.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(str(path), "", "truncated: shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(str(path), "", f"truncated or corrupt: header length {length} exceeds the file")
        try:
            header = json.loads(fh.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(str(path), "", f"header is not valid JSON ({exc})") from None
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code = info.get("dtype")
        if code not in ST_DTYPES:
            raise CheckpointError(str(path), name, f"unsupported dtype {code!r}")
        dtype_name, np_dtype = ST_DTYPES[code]
        shape = tuple(int(x) for x in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
            raise CheckpointError(str(path), name, f"byte range {begin}..{end} disagrees with shape {list(shape)}")
        if data_start + end > size:
            raise CheckpointError(
                str(path), name, f"file truncated: tensor ends at byte {data_start + end}, file has {size}"
            )
        entries[name] = TensorEntry(str(path), name, dtype_name, shape, data_start + begin, data_start + end)
    return entries


def load_tensor(entry: TensorEntry) -> np.ndarray:
    """Memory-map one tensor read-only: bf16 as uint16 bits, others in their NumPy dtype."""
    np_dtype = ST_DTYPES[_NAME_TO_ST[entry.dtype]][1]
    if entry.end == entry.begin:
        return np.zeros(entry.shape, dtype=np_dtype)
    return np.memmap(entry.file, dtype=np_dtype, mode="r", offset=entry.begin, shape=entry.shape)


def write_file(
    path: str | Path, tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str] | None = None
) -> None:
    """Write tensors {name: (dtype name, array)}; bf16 arrays must be uint16 bits.

    Tensors are written in the mapping's order; the header is padded to 8 bytes.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    blobs = []
    for name, (dtype_name, array) in tensors.items():
        code = _NAME_TO_ST[dtype_name]
        data = np.ascontiguousarray(array, dtype=ST_DTYPES[code][1]).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for blob in blobs:
            fh.write(blob)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) to float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 bits (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)

"""Checkpoint inspection, plus a small pure-numpy safetensors writer.

Reading goes through the native core (``_core.Checkpoint``: mmap, every header validated,
zero-copy tensors). Writing is plain Python + numpy and exists for tools and tests (tiny
demo checkpoints, corrupted files), so that neither needs torch or the ``safetensors``
package.

bfloat16 and float8-e4m3 have no numpy dtype: pass them as ``(bits, "BF16")`` with a
uint16 array, or ``(bits, "F8_E4M3")`` with a uint8 array; ``f32_to_bf16_bits`` makes the
former from float32.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Mapping, Union

import numpy as np

from . import _core

__all__ = [
    "Checkpoint",
    "inspect_checkpoint",
    "load_config",
    "save_safetensors",
    "save_sharded",
    "plan_shards",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "DTYPE_SIZES",
    "INDEX_NAME",
]

Checkpoint = _core.Checkpoint
INDEX_NAME = "model.safetensors.index.json"

# Bytes per element of every dtype the runtime reads.
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1, "I32": 4, "I64": 8}

# numpy dtype -> safetensors name, for plain arrays.
_NUMPY_TO_ST = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8",
}
# safetensors name -> the numpy dtype that holds its bits.
_ST_STORAGE = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "F8_E4M3": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}

TensorLike = Union[np.ndarray, tuple]


def inspect_checkpoint(path: Union[str, os.PathLike]) -> dict:
    """Validates a checkpoint (a ``.safetensors`` file or a directory with an index or
    shards) and returns ``{name: {"dtype": "BF16", "shape": [...], "file": basename}}``
    in name order. Raises CheckpointError (or ConfigError for a bad config.json)."""
    return _core.inspect_checkpoint(os.fspath(path))


def load_config(path: Union[str, os.PathLike]) -> dict:
    """Reads ``config.json`` (or ``DIR/config.json``) with the strict native parser."""
    return _core.load_config(os.fspath(path))


# ---------------------------------------------------------------------------- bf16 bits


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaNs stay NaN
    (quiet), infinities stay infinite, overflow past the bf16 range becomes infinity."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7F800000) == 0x7F800000
    is_nan &= (u & 0x007FFFFF) != 0
    quiet = (u >> 16) | 0x40
    return np.where(is_nan, quiet, rounded).astype(np.uint16).reshape(np.shape(x))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16_bits_to_f32: expected a uint16 array, found {b.dtype}")
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------- writer


def _normalize(name: str, value: TensorLike) -> tuple[str, np.ndarray]:
    """(dtype name, C-contiguous little-endian array holding the bits)."""
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], str):
            raise ValueError(f"tensor '{name}': expected (array, dtype_name), e.g. (bits, 'BF16'), found {value!r}")
        arr, dt = np.asarray(value[0]), value[1].upper()
        if dt not in _ST_STORAGE:
            raise ValueError(f"tensor '{name}': unsupported dtype '{value[1]}' (supported: {' '.join(_ST_STORAGE)})")
        storage = _ST_STORAGE[dt]
        if arr.dtype.kind != storage.kind or arr.dtype.itemsize != storage.itemsize:
            raise ValueError(f"tensor '{name}': dtype {dt} must be given as a {storage} array, found {arr.dtype}")
    else:
        arr = np.asarray(value)
        dt = _NUMPY_TO_ST.get(arr.dtype.newbyteorder("="))
        if dt is None:
            raise ValueError(
                f"tensor '{name}': unsupported numpy dtype {arr.dtype} (use float32, float16, int32, int64, uint8, "
                "or (uint16 bits, 'BF16') / (uint8 bits, 'F8_E4M3'))")
        storage = _ST_STORAGE[dt]
    arr = arr.astype(storage.newbyteorder("<"), order="C", copy=False)  # keeps 0-d arrays 0-d
    return dt, arr


def _tensor_bytes(tensors: Mapping[str, TensorLike]) -> dict:
    return {name: _normalize(name, v) for name, v in tensors.items()}


def _write_file(path: str, prepared: dict, metadata: Mapping[str, str] | None) -> int:
    """Writes one safetensors file; returns its data size in bytes."""
    # Widest elements first, then by name, so that every tensor is aligned to its element size.
    order = sorted(prepared, key=lambda n: (-prepared[n][1].dtype.itemsize, n))
    header: dict = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metadata must map str to str, found {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        dt, arr = prepared[name]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # pad so the data region starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(prepared[name][1].reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
    return offset


def _check_names(tensors: Mapping[str, TensorLike]) -> None:
    for name in tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, found {name!r}")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot be a tensor name")


def save_safetensors(path: Union[str, os.PathLike], tensors: Mapping[str, TensorLike],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes ``tensors`` ({name: array or (bits, dtype_name)}) to one safetensors file."""
    _check_names(tensors)
    _write_file(os.fspath(path), _tensor_bytes(tensors), metadata)


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """How save_sharded groups tensors: in name order, a new shard whenever the next tensor
    would push the current one past ``max_shard_bytes`` (so at least one shard, and a
    tensor larger than the limit sits alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in sorted(sizes):
        n = int(sizes[name])
        if current and size + n > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not groups:
        groups.append(current)
    return groups


def save_sharded(directory: Union[str, os.PathLike], tensors: Mapping[str, TensorLike],
                 max_shard_bytes: int, metadata: Mapping[str, str] | None = None) -> list[str]:
    """Writes ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes``
    each (a larger tensor gets a shard of its own), filled in name order, plus
    ``model.safetensors.index.json``. Returns the shard paths."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, found {max_shard_bytes}")
    _check_names(tensors)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    prepared = _tensor_bytes(tensors)
    groups = plan_shards({n: a.nbytes for n, (_, a) in prepared.items()}, max_shard_bytes)
    total = len(groups)
    weight_map = {}
    paths = []
    total_size = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        path = os.path.join(directory, fname)
        total_size += _write_file(path, {n: prepared[n] for n in group}, metadata)
        paths.append(path)
        for n in group:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return paths

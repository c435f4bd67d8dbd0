"""Read one slice of a tensor from a safetensors file with positioned reads, nothing else.

The safetensors format (an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range, then the raw bytes) makes any slice along one dimension a set of
contiguous byte runs: one run per range for dim 0, one per outer index for an inner dim. Reading
those runs with ``os.pread`` straight into the destination tensor means a rank's memory holds its
slice only. (``safe_open`` memory-maps the file instead: pages touched by a strided column slice
stay resident while the file is open, so a rank's peak would include whole tensors.)

Only the documented format is parsed: JSON and raw numbers, no code, no pickle.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from mtk import jsonio
from mtk.errors import CheckpointError

__all__ = ["SafetensorsError", "SafetensorsFile", "open_safetensors", "TensorSlicer"]

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20


class SafetensorsError(CheckpointError):
    """A file that is not a valid safetensors file (truncated, bad header, offsets out of range)."""


def open_safetensors(path: Path) -> SafetensorsFile:
    """Open ``path`` for slice reads; a missing or unreadable file is one clear line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return SafetensorsFile(path)
    except SafetensorsError as err:
        raise SafetensorsError(f"{path.name} is not a readable safetensors file: {err}") from None


class TensorSlicer:
    """``full[index]`` for one tensor of an open file: contiguous runs read straight into the result (a slice of
    one dimension); where several dimensions are sliced (an expert-parallel rank's experts of a fused
    ``[E, 2I, H]`` tensor, and its TP slice of each), one row of the first dimension at a time."""

    def __init__(self, fd: int, path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.fd, self.path, self.name = fd, path, name
        self.dtype, self.shape, self.offset = dtype, shape, offset
        self.bytes_read = 0

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        if len(index) != len(self.shape):
            raise IndexError(f"{self.name}: index has {len(index)} dims, tensor has {len(self.shape)}")
        sliced = [d for d, s in enumerate(index) if s.indices(self.shape[d]) != (0, self.shape[d], 1)]
        if len(sliced) > 1:
            return self._rows(index)
        shape = self.shape or (1,)  # a scalar reads as one element
        dim = sliced[0] if sliced else 0
        start, stop, step = index[dim].indices(shape[dim]) if self.shape else (0, 1, 1)
        if step != 1:
            raise IndexError(f"{self.name}: strided slices are not supported")
        out_shape = list(shape)
        out_shape[dim] = max(stop - start, 0)
        out = torch.empty(out_shape, dtype=self.dtype)
        if out.numel() > 0:
            item = out.element_size()
            outer = math.prod(shape[:dim])
            inner = math.prod(shape[dim + 1 :]) * item  # bytes per index of ``dim``
            run = (stop - start) * inner  # contiguous bytes per outer index
            buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy().data)  # [outer * run] bytes
            for o in range(outer):  # dim 0: one read; an inner dim: one read per outer row
                position = self.offset + (o * shape[dim] + start) * inner
                self._read_exact(buffer[o * run : (o + 1) * run], position)
        return out if self.shape else out.reshape(())

    def _rows(self, index: tuple[slice, ...]) -> torch.Tensor:
        """``full[index]`` row by row of the first dimension: each row is a tensor of one dimension fewer, read with
        the rest of ``index`` (fewer dimensions sliced each time)."""
        start, stop, step = index[0].indices(self.shape[0])
        if step != 1:
            raise IndexError(f"{self.name}: strided slices are not supported")
        row_bytes = math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()
        rows = []
        for row in range(start, stop):
            offset = self.offset + row * row_bytes
            child = TensorSlicer(self.fd, self.path, self.name, self.dtype, self.shape[1:], offset)
            rows.append(child[index[1:]])
            self.bytes_read += child.bytes_read
        if not rows:
            inner = [len(range(*s.indices(n))) for s, n in zip(index[1:], self.shape[1:])]
            return torch.empty(0, *inner, dtype=self.dtype)
        return torch.stack(rows)

    def _read_exact(self, target: memoryview, position: int) -> None:
        done = 0
        while done < len(target):
            chunk = os.preadv(self.fd, [target[done:]], position + done)
            if chunk <= 0:
                raise SafetensorsError(f"{self.path}: unexpected end of file while reading {self.name}")
            done += chunk
        self.bytes_read += len(target)


class SafetensorsFile:
    """An open safetensors file: its tensor names and a :class:`TensorSlicer` per tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise SafetensorsError(f"{self.path}: cannot open ({err.strerror})") from None
        try:
            self._entries, self._data_start = self._parse_header()
        except Exception:
            os.close(self.fd)
            raise

    def _parse_header(self) -> tuple[dict, int]:
        size = os.fstat(self.fd).st_size
        raw = os.pread(self.fd, 8, 0)
        if len(raw) < 8:
            raise SafetensorsError(f"{self.path} is not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"{self.path} is not a safetensors file (header length {header_len} is invalid)")
        try:
            header = jsonio.loads(os.pread(self.fd, header_len, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            reason = f": {err.msg}" if isinstance(err, json.JSONDecodeError) else ""  # (a key given twice)
            raise SafetensorsError(f"{self.path} is not a safetensors file (its header is not JSON{reason})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path} is not a safetensors file (its header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + header_len, size - 8 - header_len
        entries = {}
        for name, info in header.items():
            try:
                dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
                begin, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has an invalid header entry") from None
            expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected or not 0 <= begin <= end <= data_size:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} needs bytes [{begin}, {end}) but the file holds {data_size} "
                    f"data bytes (truncated or corrupt)"
                )
            entries[name] = (dtype, shape, data_start + begin)
        self._check_disjoint(header)
        return entries, data_start

    def _check_disjoint(self, header: dict) -> None:
        """No two tensors share bytes (safetensors' own rule): a second entry over another tensor's bytes would read
        as a copy of it, past every shape check."""
        spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
        spans = [span for span in spans if span[0] < span[1]]  # empty tensors take no bytes
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise SafetensorsError(f"{self.path}: tensors {first!r} and {second!r} share bytes (damaged)")

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get_slice(self, name: str) -> TensorSlicer:
        dtype, shape, offset = self._entries[name]
        return TensorSlicer(self.fd, self.path, name, dtype, shape, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

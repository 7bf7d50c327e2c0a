"""Writing safetensors files for the checkpoint writer (`cupy_moe.testing`): shards with headers fixed up front,
and rewriting a checkpoint with tensors replaced, removed or renamed (for bad-input tests)."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .checkpoint.safetensors import SafetensorsFile

__all__ = ["ShardWriter", "edit_checkpoint"]

# NumPy dtype name -> safetensors dtype name. bfloat16 is written from uint16 bit patterns.
_ST_NAME = {"int32": "I32", "float16": "F16", "float32": "F32", "bfloat16": "BF16", "int64": "I64", "int8": "I8"}


def _write_header(fh, header: dict):
    """The 8-byte length and the JSON header of a safetensors file, padded so the data is 8-byte aligned."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    fh.write(struct.pack("<Q", len(raw)) + raw)


class ShardWriter:
    """Writes safetensors files whose headers are fixed up front, then appends tensors in header order."""

    def __init__(self, folder: Path, plan: list[tuple[str, str, tuple]], num_shards: int, file_name: str):
        self.folder = folder
        if num_shards == 1:
            names = [file_name]
        else:
            names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
        # Round-robin by tensor: one module's qweight/qzeros/scales/g_idx land in different files.
        self.where = {}
        headers = [dict() for _ in names]
        offsets = [0] * len(names)
        for i, (tname, dtype, shape) in enumerate(plan):
            s = i % len(names)
            nbytes = math.prod(shape) * np.dtype(dtype if dtype != "bfloat16" else np.uint16).itemsize
            headers[s][tname] = {"dtype": _ST_NAME[dtype], "shape": list(shape),
                                 "data_offsets": [offsets[s], offsets[s] + nbytes]}
            offsets[s] += nbytes
            self.where[tname] = (s, dtype, tuple(shape))
        self.files = []
        for name, header in zip(names, headers):
            fh = open(folder / name, "wb")
            _write_header(fh, {"__metadata__": {"format": "pt"}, **header})
            self.files.append(fh)
        self.names = names
        self.total = sum(offsets)
        self.pending = [iter([t for t, (s, _, _) in self.where.items() if s == i]) for i in range(len(names))]

    def write(self, tname: str, array: np.ndarray):
        s, dtype, shape = self.where[tname]
        expect = next(self.pending[s])
        if expect != tname:  # header order is the write order; anything else is a bug in the writer
            raise RuntimeError(f"internal: wrote '{tname}' to {self.names[s]}, expected '{expect}' next")
        want = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        if array.dtype != want or array.shape != shape:
            raise RuntimeError(f"internal: '{tname}' is {array.dtype} {array.shape}, planned {dtype} {shape}")
        self.files[s].write(np.ascontiguousarray(array).tobytes())

    def close(self, index: bool):
        for fh in self.files:
            fh.close()
        if index:
            weight_map = {t: self.names[s] for t, (s, _, _) in self.where.items()}
            with open(self.folder / "model.safetensors.index.json", "w") as fh:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, fh, indent=2)


def edit_checkpoint(path, *, replace: dict | None = None, remove: Iterable | None = None,
                    rename: Callable[[str], str] | None = None):
    """Rewrite the safetensors files of a checkpoint folder with some tensors replaced, removed or renamed.

    replace: {tensor name: NumPy array} (int8/int32/int64/float16/float32; new names go to the file of the
    first tensor). remove: tensor names to drop. rename: maps every remaining tensor name to its new name
    (applied last). The index (if any) is rewritten to match.
    Used by tests to build broken checkpoints (a wrong shape, a missing tensor, experts that differ).
    """
    folder = Path(path)
    replace, remove = dict(replace or {}), set(remove or ())
    index_path = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    weight_map = {}
    new_names = [n for n in replace]
    for fpath in files:
        f = SafetensorsFile(fpath)
        try:
            tensors = {}
            for name, info in f.tensors.items():
                if name in remove:
                    continue
                if name in replace:
                    arr = np.ascontiguousarray(replace[name])
                    dtype = _ST_NAME[arr.dtype.name]
                    data = arr.tobytes()
                    shape = arr.shape
                    new_names.remove(name)
                else:
                    dtype, shape = info.dtype, info.shape
                    data = f.raw_bytes(info)
                tensors[name] = (dtype, shape, data)
        finally:
            f.close()
        if fpath == files[0]:
            for name in list(new_names):
                arr = np.ascontiguousarray(replace[name])
                tensors[name] = (_ST_NAME[arr.dtype.name], arr.shape, arr.tobytes())
                new_names.remove(name)
        header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
        for name, (dtype, shape, data) in tensors.items():
            name = rename(name) if rename else name
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
            blobs.append(data)
            weight_map[name] = fpath.name
        with open(fpath, "wb") as fh:
            _write_header(fh, header)
            for data in blobs:
                fh.write(data)
    if index_path.exists():
        with open(index_path, "w") as fh:
            json.dump({"metadata": {"total_size": sum(p.stat().st_size for p in files)}, "weight_map": weight_map},
                      fh, indent=2)

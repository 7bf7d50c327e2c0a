"""Reading safetensors checkpoints: headers parsed and checked, tensors read on demand, the shard index.

We parse the safetensors header ourselves instead of `safetensors.safe_open`: its NumPy backend cannot return
bfloat16 (bf16 scales and routers are common) and it maps whole files, while the loader reads each tensor
directly into its slot of a stacked array with positioned reads (no mmap, so untouched tensors never count in
the process RSS).
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SafetensorsFile", "TensorInfo", "TensorIndex", "FLOATS", "as_float", "bf16_to_f32", "read_json"]


# safetensors dtype -> (NumPy dtype the raw bytes are read as, bytes per element). BF16 is read as uint16
# (NumPy has no bfloat16) and widened with a shift.
_ST_DTYPES = {
    "BOOL": (np.bool_, 1), "U8": (np.uint8, 1), "I8": (np.int8, 1), "F8_E4M3": (np.uint8, 1),
    "F8_E5M2": (np.uint8, 1), "I16": (np.int16, 2), "U16": (np.uint16, 2), "F16": (np.float16, 2),
    "BF16": (np.uint16, 2), "I32": (np.int32, 4), "U32": (np.uint32, 4), "F32": (np.float32, 4),
    "I64": (np.int64, 8), "U64": (np.uint64, 8), "F64": (np.float64, 8),
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
FLOATS = ("F16", "BF16", "F32")  # the float dtypes a scale, router or dense weight may have


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name: "I32", "F16", "BF16", ...
    shape: tuple
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One .safetensors file: the header parsed and checked against the file size; tensors read on demand.

    lenient: tensors whose bytes run past the end of the file are listed in `truncated` instead of raising
    (inspect_checkpoint reports them; reading one still raises).
    """

    def __init__(self, path: Path, lenient: bool = False):
        self.path = path
        self.label = path.name
        self.lenient = lenient
        self.truncated: list[str] = []
        try:
            _require_regular_file(path, "safetensors file")
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: safetensors file not found") from None
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.tensors, self.metadata = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self):
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise ValueError(f"{self.label}: not a safetensors file: {size} bytes, shorter than the 8-byte "
                             f"header length")
        (hlen,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise ValueError(f"{self.label}: corrupt or truncated safetensors file: the header claims {hlen} bytes "
                             f"but the file has {size} bytes in all")
        raw = os.pread(self._fd, hlen, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.label}: corrupt safetensors header (not valid JSON: {exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.label}: corrupt safetensors header: expected a JSON object, "
                             f"got {type(header).__name__}")
        data_start = 8 + hlen
        tensors = {}
        metadata = header.pop("__metadata__", None) or {}
        for name, entry in header.items():
            try:
                dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
                ok = (isinstance(dtype, str) and isinstance(shape, list)
                      and all(isinstance(d, int) and d >= 0 for d in shape)
                      and isinstance(b, int) and isinstance(e, int) and 0 <= b <= e)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{self.label}: corrupt safetensors header: tensor '{name}' has entry {entry!r}, "
                                 f"expected {{dtype, shape, data_offsets: [begin, end]}}")
            if dtype not in _ST_DTYPES:
                raise ValueError(f"{self.label}: tensor '{name}': unknown safetensors dtype {dtype!r}")
            want = math.prod(shape) * _ST_DTYPES[dtype][1]
            if e - b != want:
                raise ValueError(f"{self.label}: corrupt safetensors header: tensor '{name}' {dtype} {shape} needs "
                                 f"{want} bytes, its data_offsets [{b}, {e}] span {e - b}")
            if data_start + e > size and self.lenient:
                self.truncated.append(name)
            elif data_start + e > size:
                raise ValueError(f"{self.label}: truncated safetensors file: tensor '{name}' ends at byte "
                                 f"{data_start + e}, but the file has only {size} bytes")
            tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + b, e - b)
        return tensors, metadata

    def read_into(self, info: TensorInfo, out: np.ndarray) -> np.ndarray:
        """Read `info`'s raw bytes into the C-contiguous array `out` (dtype and size already checked)."""
        view = memoryview(out).cast("B")
        done = 0
        while done < info.nbytes:  # os.preadv may return short reads on some filesystems
            n = os.preadv(self._fd, [view[done:]], info.start + done)
            if n <= 0:
                raise ValueError(f"{self.label}: tensor '{info.name}': file ended after {done} of {info.nbytes} "
                                 f"bytes (truncated while reading?)")
            done += n
        return out

    def raw_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's bytes as stored."""
        return os.pread(self._fd, info.nbytes, info.start)

    def read(self, info: TensorInfo) -> np.ndarray:
        """A new array with the tensor's raw values (BF16 as uint16)."""
        out = np.empty(info.shape, _ST_DTYPES[info.dtype][0])
        return self.read_into(info, out)

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of bfloat16 -> float32 (exact: bf16 is the top half of a float32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def as_float(f: SafetensorsFile, info: TensorInfo) -> np.ndarray:
    """A float tensor as float16 (if stored F16) or float32 (BF16 widened exactly, F32)."""
    raw = f.read(info)
    return bf16_to_f32(raw) if info.dtype == "BF16" else raw


class TensorIndex:
    """tensor name -> file, from model.safetensors.index.json or from the headers of the folder's files.

    lenient: files are opened leniently (see SafetensorsFile), and without an index a file whose header cannot be
    read is recorded in `broken` {file name: error} instead of raising (inspect_checkpoint lists them).
    """

    def __init__(self, folder: Path, lenient: bool = False):
        self.folder = folder
        self.lenient = lenient
        self.broken: dict[str, str] = {}
        self._files: dict[str, SafetensorsFile] = {}
        index = folder / "model.safetensors.index.json"
        if not index.exists():
            others = sorted(folder.glob("*.safetensors.index.json"))
            index = others[0] if len(others) == 1 else None
        if index is not None:
            data = read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index.name}: expected {{'weight_map': {{tensor name: file name}}}}, "
                                 f"got {str(data)[:200]}")
            for name, fname in weight_map.items():
                if fname in ("", ".", "..") or Path(fname).name != fname or "\\" in fname:
                    raise ValueError(f"{index.name}: weight_map['{name}'] = {fname!r}: expected the name of a file "
                                     f"in the checkpoint folder (no directory part)")
            self.source = index.name
            self.weight_map = dict(weight_map)
            return
        single = folder / "model.safetensors"
        files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no safetensors weights (looked for model.safetensors.index.json, "
                                    f"model.safetensors and *.safetensors)")
        self.source = ", ".join(p.name for p in files)
        self.weight_map = {}
        try:
            for p in files:  # no index: the headers are the index (header-only reads)
                try:
                    names = self.file(p.name).tensors
                except ValueError as exc:
                    if not lenient:
                        raise
                    self.broken[p.name] = str(exc)
                    continue
                for name in names:
                    self.weight_map[name] = p.name
        except BaseException:
            self.close()
            raise

    def names(self):
        return self.weight_map.keys()

    def file(self, fname: str, tensor: str | None = None) -> SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            path = self.folder / fname
            if not path.exists():
                what = f" (it holds tensor '{tensor}' per {self.source})" if tensor else ""
                raise FileNotFoundError(f"{path}: safetensors shard not found{what}")
            f = self._files[fname] = SafetensorsFile(path, self.lenient)
        return f

    def get(self, name: str) -> tuple[SafetensorsFile, TensorInfo] | None:
        """(file, header entry) of tensor `name`, or None when the checkpoint has no such tensor."""
        fname = self.weight_map.get(name)
        if fname is None:
            return None
        f = self.file(fname, name)
        info = f.tensors.get(name)
        if info is None:
            raise ValueError(f"{fname}: {self.source} maps tensor '{name}' to this file, but its header has no "
                             f"such tensor")
        return f, info

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def _require_regular_file(path: Path, what: str) -> None:
    """ValueError naming `path` unless it is a regular file (or a link to one), checked before opening it: a
    directory fails only on the first read, and opening a FIFO blocks until a writer comes."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise ValueError(f"{path}: expected a {what}, got {kind}, not a regular file")


def read_json(path: Path):
    """The parsed JSON file; ValueError naming the file when it is not a readable JSON document."""
    _require_regular_file(path, "JSON file")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: expected UTF-8 JSON text, got undecodable bytes ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON for this reader: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


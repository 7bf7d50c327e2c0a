"""Tuned configurations as data: one JSON table per GPU, measured by `python -m cupy_moe tune`.

A table is one file named after the GPU (`table_file_name`: "NVIDIA H200" -> `NVIDIA_H200.json`):

    {"gpu": "NVIDIA H200",
     "entries": {"E8_K4096_N28672_b4_G128_P2": {"block_m": 16, "split_k": 2, "warps_k": 1, "time_us": 35.2}, ...}}

Keys are `tuning_key(E, K, N, bits, G, P)` with P = M * A pairs bucketed to powers of two; `block_m`, `split_k` and
the optional `warps_k` are what `choose_config` uses (warps_k 1: the block size's plain shape, split_k ways; the
warps-along-K shape's warps_k: that shape; absent: the heuristic's rule 4 decides, see heuristic.py); `time_us` is
the measured time, for people. Two places hold tables:

- shipped with the package: `cupy_moe/configs/tuned/<file>` (`shipped_dir()`);
- the user's cache: `$CUPY_MOE_CACHE_DIR`, else `$XDG_CACHE_HOME/cupy_moe`, else `~/.cache/cupy_moe`
  (`user_dir()`), where `tune` writes. Its entries win over the shipped ones, key by key.

A problem without an entry uses the heuristic, silently. A file that cannot be read is ignored with one warning.
"""
from __future__ import annotations

import functools
import json
import os
import re
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from .catalogue import MAX_SPLIT, SPLIT_WARPS_SHAPES, SUPPORTED_BLOCK_M, warps_k_choices

__all__ = ["tuning_key", "table_file_name", "shipped_dir", "user_dir", "read_table", "load_table", "tuned_table",
           "tuned_entry", "save_tuned"]


def tuning_key(e: int, k: int, n: int, bits: int, group_size: int, pairs: int) -> str:
    """One entry per (E, K, N, bits, G, bucket of P = M*A pairs); buckets are powers of two."""
    bucket = 1 << max(0, int(pairs) - 1).bit_length()
    return f"E{e}_K{k}_N{n}_b{bits}_G{group_size}_P{bucket}"


def table_file_name(gpu: str) -> str:
    """The file of a GPU's table: its name with every run of other characters than letters and digits as one '_'."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", str(gpu)).strip("_")
    if not slug:
        raise ValueError(f"gpu: expected a device name with letters or digits, got {gpu!r}")
    return f"{slug}.json"


def shipped_dir() -> Path:
    """The tables that ship with the package."""
    return Path(__file__).resolve().parent / "tuned"


def user_dir() -> Path:
    """$CUPY_MOE_CACHE_DIR, else $XDG_CACHE_HOME/cupy_moe, else ~/.cache/cupy_moe."""
    root = os.environ.get("CUPY_MOE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cupy_moe"


# what `_valid` asks of an entry, for the messages that refuse one
_ENTRY_RULE = (f"a block_m of {SUPPORTED_BLOCK_M}, a split_k in [1, {MAX_SPLIT}] and, if given, a warps_k of 1 or "
               "the warps-along-K shape's ("
               + ", ".join(f"{s.warps_k} for block_m {b}" for b, s in SPLIT_WARPS_SHAPES.items()) + ")")


def _valid(entry) -> bool:
    try:
        block_m, split_k, warps_k = entry["block_m"], entry["split_k"], entry.get("warps_k", 1)
    except (KeyError, TypeError, AttributeError):
        return False
    return (isinstance(block_m, int) and isinstance(split_k, int) and block_m in SUPPORTED_BLOCK_M
            and 1 <= split_k <= MAX_SPLIT and warps_k in warps_k_choices(block_m))


def read_table(path: Path, gpu: str) -> dict:
    """The entries of one table file ({} when it does not exist). A file that is not a table of `gpu` is ignored
    with a warning, and so is each entry without a supported block_m, split_k and warps_k."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"cupy_moe: ignoring the tuned table {path}: {exc}", stacklevel=2)
        return {}
    if not isinstance(data, dict) or data.get("gpu") != gpu or not isinstance(data.get("entries"), dict):
        warnings.warn(f"cupy_moe: ignoring the tuned table {path}: expected {{\"gpu\": {gpu!r}, \"entries\": {{...}}}}",
                      stacklevel=2)
        return {}
    entries = {key: value for key, value in data["entries"].items() if _valid(value)}
    if len(entries) < len(data["entries"]):
        bad = sorted(set(data["entries"]) - set(entries))
        warnings.warn(f"cupy_moe: ignoring {len(bad)} entries of {path} without {_ENTRY_RULE}: {bad[:3]}",
                      stacklevel=2)
    return entries


def load_table(gpu: str, directories=None) -> dict:
    """The merged entries of `gpu`'s table in `directories` (default: shipped_dir(), then user_dir()); a later
    directory's entries win."""
    merged = {}
    for folder in (shipped_dir(), user_dir()) if directories is None else directories:
        merged.update(read_table(Path(folder) / table_file_name(gpu), gpu))
    return merged


@functools.lru_cache(maxsize=None)
def _cached_table(gpu: str, *environment) -> Mapping:
    return MappingProxyType(load_table(gpu))


def tuned_table(gpu: str) -> Mapping:
    """The entries `choose_config` uses for `gpu` (shipped, then the user's), read once per process and cache
    folder; read-only. Keyed by the variables user_dir() reads, so that a lookup costs no path arithmetic."""
    env = os.environ
    return _cached_table(str(gpu), env.get("CUPY_MOE_CACHE_DIR"), env.get("XDG_CACHE_HOME"), env.get("HOME"))


def tuned_entry(gpu: str, e: int, k: int, n: int, bits: int, group_size: int, pairs: int):
    """(block_m, split_k, warps_k or None) of `gpu`'s entry for this problem, or None."""
    if pairs <= 0:
        return None
    entry = tuned_table(gpu).get(tuning_key(e, k, n, bits, group_size, pairs))
    return None if entry is None else (entry["block_m"], entry["split_k"], entry.get("warps_k"))


def save_tuned(gpu: str, entries: Mapping, directory=None) -> Path:
    """Merge {tuning_key: {"block_m", "split_k", ["warps_k",] "time_us"}} into `gpu`'s table in `directory` (default:
    user_dir()); returns the file's path. `choose_config` sees the new entries from then on."""
    bad = sorted(key for key, value in entries.items() if not _valid(value))
    if bad:
        raise ValueError(f"entries: expected {_ENTRY_RULE} in each, got {bad[:3]}: {[entries[key] for key in bad[:3]]}")
    path = Path(user_dir() if directory is None else directory) / table_file_name(gpu)
    merged = dict(read_table(path, gpu))
    merged.update({key: dict(value) for key, value in entries.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpu": gpu, "entries": merged}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    _cached_table.cache_clear()
    return path

"""Bit packing of GPTQ/AWQ codes into int32 words, the GPTQ v1 zero-point convention and the AWQ nibble order.

The one place the loader (`cupy_moe.checkpoint`), `cupy_moe.weights` and the checkpoint writer
(`cupy_moe.testing`) take these rules from. `cupy_moe.reference` keeps its own plain unpacking on purpose: it
is the definition of correct that this module is tested against.

Packing (docs/gptq_layout.md): `bits`-wide values are packed along one axis, the lowest value in the lowest
bits. 2/4/8 bits: 32/bits values per int32 word. 3 bits: 32 values in 3 words, one 96-bit little-endian stream
(values 10 and 21 straddle two words). Words are stored as int32; they are read as unsigned here.

Zero points: GPTQ v1 ("gptq") stores real zero - 1 in every field, gptq_v2 the real zero. AWQ GEMM packs 8
nibbles per word along N in the order AWQ_ORDER.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["unit", "pack", "unpack", "v1_to_real", "real_to_v1", "AWQ_ORDER", "awq_interleave",
           "awq_deinterleave"]


def unit(bits: int) -> tuple[int, int]:
    """(values per packing unit, int32 words per unit): (32/bits, 1) for 2/4/8 bits, (32, 3) for 3 bits."""
    values = 32 // math.gcd(32, bits)
    return values, values * bits // 32


def _unpack_last(words: np.ndarray, bits: int) -> np.ndarray:
    per, wpu = unit(bits)
    lead, nw = words.shape[:-1], words.shape[-1]
    u = np.ascontiguousarray(words).view(np.uint32).reshape(*lead, nw // wpu, wpu).astype(np.uint64)
    out = np.empty((*lead, nw // wpu, per), np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for j in range(per):  # one vectorized pass per field position
        word, shift = divmod(bits * j, 32)
        field = u[..., word] >> np.uint64(shift)
        if shift + bits > 32:  # 3-bit fields 10 and 21 straddle two words
            field |= u[..., word + 1] << np.uint64(32 - shift)
        out[..., j] = field & mask
    return out.reshape(*lead, nw // wpu * per)


def _pack_last(values: np.ndarray, bits: int) -> np.ndarray:
    per, wpu = unit(bits)
    lead, c = values.shape[:-1], values.shape[-1]
    v = values.reshape(*lead, c // per, per).astype(np.uint64)
    out = np.zeros((*lead, c // per, wpu), np.uint64)
    for j in range(per):
        word, shift = divmod(bits * j, 32)
        out[..., word] |= v[..., j] << np.uint64(shift)
        if shift + bits > 32:
            out[..., word + 1] |= v[..., j] >> np.uint64(32 - shift)
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32).reshape(*lead, c // per * wpu)


def unpack(words: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
    """int32 words [..., W, ...] -> uint8 values [..., W*32/bits, ...] unpacked along `axis`, lowest field first.

    Along the last axis this is qzeros [R, N*bits/32] -> [R, N]; along axis -2 qweight [K*bits/32, N] -> [K, N].
    """
    if axis in (-1, words.ndim - 1):
        return _unpack_last(words, bits)
    return np.moveaxis(_unpack_last(np.moveaxis(words, axis, -1), bits), -1, axis)


def pack(values: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
    """Integer values in [0, 2**bits) [..., C, ...] -> int32 words [..., C*bits/32, ...] packed along `axis`
    (C a multiple of unit(bits)[0]); the inverse of unpack."""
    if axis in (-1, values.ndim - 1):
        return _pack_last(values, bits)
    return np.moveaxis(_pack_last(np.moveaxis(values, axis, -1), bits), -1, axis)


# Adding 1 to every field of a v1 qzeros word at once (GPTQModel's v1 -> v2 load conversion): for 2/4/8 bits
# the exact inverse of GPTQModel's word-level v2 -> v1 export (a real zero of 0 borrows from the next field),
# and on every symmetric checkpoint the same as per-field (z + 1) & mask. 3 bits go field by field.
_V1_WORD_ADD = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _per_field(words: np.ndarray, bits: int, delta: int) -> np.ndarray:
    return pack((unpack(words, bits).astype(np.int64) + delta) & ((1 << bits) - 1), bits)


def v1_to_real(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ v1 qzeros int32 [..., N*bits/32] (stored zero = real zero - 1) -> real zeros, packed the same way."""
    if bits in _V1_WORD_ADD:
        words = qzeros.view(np.uint32).astype(np.uint64) + np.uint64(_V1_WORD_ADD[bits])
        return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return _per_field(qzeros, bits, 1)


def real_to_v1(qzeros: np.ndarray, bits: int) -> np.ndarray:
    """Real qzeros int32 [..., N*bits/32] -> GPTQ v1 (stored zero = real zero - 1), as GPTQModel exports it:
    for 2/4/8 bits one word-level subtract (a real zero of 0 borrows from the next field); the inverse of
    v1_to_real."""
    if bits in _V1_WORD_ADD:
        words = qzeros.view(np.uint32).astype(np.int64) - _V1_WORD_ADD[bits]
        return (words % (1 << 32)).astype(np.uint32).view(np.int32)
    return _per_field(qzeros, bits, -1)


# AWQ GEMM interleaves 8 nibbles per word: nibble i of word c holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_AWQ_REVERSE = np.argsort(AWQ_ORDER)  # column j of a word = nibble _AWQ_REVERSE[j]


def awq_interleave(columns: np.ndarray) -> np.ndarray:
    """4-bit values [..., N] in column order -> [..., N] in AWQ nibble order (N a multiple of 8)."""
    return columns.reshape(*columns.shape[:-1], -1, 8)[..., AWQ_ORDER].reshape(columns.shape)


def awq_deinterleave(nibbles: np.ndarray) -> np.ndarray:
    """Values [..., N] in AWQ nibble order -> column order; the inverse of awq_interleave."""
    return nibbles.reshape(*nibbles.shape[:-1], -1, 8)[..., _AWQ_REVERSE].reshape(nibbles.shape)

"""NumPy reference for GPTQ MoE layers: the definition of a correct answer.

Plain NumPy, written to be read. It imports nothing else from cupy_moe and shares no code with the GPU path,
so a bug in one cannot hide in the other. Tests, examples and benchmarks compare against it.

Legend (shape letters, as everywhere in cupy_moe):
    M tokens, K in-features, N out-features, E experts, A top-k (experts per token),
    G group size, P = M * A (token, expert) pairs, B align block size, C align capacity,
    H hidden size, I expert intermediate size, R rows of qzeros/scales = ceil(K / G).

GPTQ layout (see docs/gptq_layout.md): one Linear computes y = x @ W with W [K, N] and
    W[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
codes q packed along K into qweight [K*bits/32, N], zero points packed along N into qzeros [R, N*bits/32].
Inside a 32-bit word the least-significant field holds the lowest index (4-bit, one word of qweight):

    bit   31..28 27..24 23..20 19..16 15..12 11..8  7..4   3..0
          k=8r+7 k=8r+6 k=8r+5 k=8r+4 k=8r+3 k=8r+2 k=8r+1 k=8r+0      e.g. codes [3,0,15,7,8,1,12,5] -> 0x5C187F03

3-bit: 32 values fill 3 words as one 96-bit little-endian bit stream; value i sits at stream bits [3i, 3i+3),
so values 10 and 21 straddle two words.

Input dtypes: activations and scales may be float16, float32 or ml_dtypes.bfloat16 (this module never imports
ml_dtypes); math happens in float32/float64 and each result is rounded once with `.astype(dtype)`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "QuantizedLinear", "pack_rows", "unpack_rows", "pack_cols", "unpack_cols", "dequantize", "quantize",
    "act_order_g_idx", "moe_align_block_size", "fused_moe_gemm", "select_experts", "fused_moe", "to_pair_order",
    "from_pair_order",
]

_BITS = (2, 3, 4, 8)
_FORMATS = ("gptq", "gptq_v2")


# --------------------------------------------------------------------------- input checks
def _is_float(dtype) -> bool:
    # bfloat16 comes from ml_dtypes (dtype kind 'V'), recognised by name so we never import it.
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _is_int(dtype) -> bool:
    return np.dtype(dtype).kind in "iu"


def _host(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(x).__module__}.{type(x).__name__}")
    return x


def _check_ndim(name, x, ndim, letters):
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D {letters}, got shape {x.shape}")


def _check_int_array(name, x, ndim, letters):
    _host(name, x)
    if not _is_int(x.dtype):
        raise TypeError(f"{name}: expected an integer array, got {x.dtype}")
    _check_ndim(name, x, ndim, letters)


def _check_int32(name, x, ndim, letters):
    _host(name, x)
    if x.dtype != np.int32:
        raise TypeError(f"{name}: expected int32, got {x.dtype}")
    _check_ndim(name, x, ndim, letters)


def _check_float_array(name, x, ndim, letters):
    _host(name, x)
    if not _is_float(x.dtype):
        raise TypeError(f"{name}: expected float16, float32 or bfloat16, got {x.dtype}")
    _check_ndim(name, x, ndim, letters)


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in _BITS:
        raise ValueError(f"bits: expected one of {_BITS}, got {bits!r}")
    return int(bits)


def _check_positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v}")
    return int(v)


def _group_len(group_size, k):
    """G as a length: group_size, or K when group_size == -1 (one group of all rows)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size == -1:
        return max(k, 1)
    if group_size < 1:
        raise ValueError(f"group_size: expected -1 or a positive int, got {group_size}")
    return int(group_size)


def _unit(bits):
    """(values per packing unit, int32 words per unit): (32/bits, 1) for 2/4/8 bits, (32, 3) for 3 bits."""
    values = 32 // math.gcd(32, bits)
    return values, bits * values // 32


# --------------------------------------------------------------------------- packing
def _pack_axis0(values, bits):
    """int [L, X] codes in [0, 2**bits) -> int32 [L*bits/32, X], packed along axis 0 (L % unit == 0)."""
    per_unit, words_per_unit = _unit(bits)
    length, x = values.shape
    v = values.astype(np.uint64).reshape(length // per_unit, per_unit, x)  # [L/u, u, X]
    words = np.zeros((length // per_unit, words_per_unit, x), np.uint64)  # [L/u, bits*u/32, X]
    for i in range(per_unit):
        word, shift = divmod(bits * i, 32)  # value i occupies stream bits [bits*i, bits*i + bits)
        words[:, word] |= (v[:, i] << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:  # straddles into the next word (3-bit values 10 and 21)
            words[:, word + 1] |= v[:, i] >> np.uint64(32 - shift)
    # Built as uint32, stored as int32 (a top field >= 2**(bits-1) makes the int32 negative), like AutoGPTQ.
    return words.reshape(-1, x).astype(np.uint32).view(np.int32)


def _unpack_axis0(words, bits):
    """int32 [W, X] -> int32 [W*32/bits, X] codes, the inverse of _pack_axis0."""
    per_unit, words_per_unit = _unit(bits)
    nwords, x = words.shape
    # Logical shifts: look at the words as unsigned, so the int32 sign bit is just another data bit.
    w = words.view(np.uint32).astype(np.uint64).reshape(nwords // words_per_unit, words_per_unit, x)
    out = np.empty((nwords // words_per_unit, per_unit, x), np.int32)  # [W/wu, u, X]
    mask = np.uint64((1 << bits) - 1)
    for i in range(per_unit):
        word, shift = divmod(bits * i, 32)
        field = w[:, word] >> np.uint64(shift)
        if shift + bits > 32:
            field = field | (w[:, word + 1] << np.uint64(32 - shift))
        out[:, i] = field & mask
    return out.reshape(-1, x)


def _check_codes(name, q, bits, axis_name, axis):
    _check_int_array(name, q, 2, "array")
    per_unit, _ = _unit(bits)
    if q.shape[axis] % per_unit:
        raise ValueError(f"{name}: {axis_name} must be a multiple of {per_unit} to pack {bits}-bit values, "
                         f"got shape {q.shape}")
    if q.size and (q.min() < 0 or q.max() >= (1 << bits)):
        raise ValueError(f"{name}: expected values in [0, {(1 << bits) - 1}] for {bits} bits, "
                         f"got range [{q.min()}, {q.max()}]")


def _check_words(name, w, bits, axis_name, axis):
    _check_int32(name, w, 2, "array")
    _, words_per_unit = _unit(bits)
    if w.shape[axis] % words_per_unit:
        raise ValueError(f"{name}: {axis_name} must be a multiple of {words_per_unit} words for {bits} bits, "
                         f"got shape {w.shape}")


def pack_rows(q, bits):
    """Pack codes along K (rows), the qweight layout.

    q: int [K, N], values in [0, 2**bits); K a multiple of 32/bits (of 32 for 3 bits).
    Returns int32 [K*bits/32, N]: qweight[r, n] = OR_j q[r*f + j, n] << (bits*j), f = 32/bits.
    """
    bits = _check_bits(bits)
    _check_codes("q", q, bits, "K (axis 0)", 0)
    return _pack_axis0(q, bits)


def unpack_rows(qweight, bits):
    """Unpack qweight int32 [K*bits/32, N] -> int32 codes [K, N] (inverse of pack_rows)."""
    bits = _check_bits(bits)
    _check_words("qweight", qweight, bits, "axis 0", 0)
    return _unpack_axis0(qweight, bits)


def pack_cols(z, bits):
    """Pack values along N (columns), the qzeros layout (sequential fields, not AWQ-interleaved).

    z: int [R, N], values in [0, 2**bits); N a multiple of 32/bits (of 32 for 3 bits).
    Returns int32 [R, N*bits/32]: qzeros[g, c] = OR_j z[g, c*f + j] << (bits*j).
    """
    bits = _check_bits(bits)
    _check_codes("z", z, bits, "N (axis 1)", 1)
    return np.ascontiguousarray(_pack_axis0(z.T, bits).T)


def unpack_cols(qzeros, bits):
    """Unpack qzeros int32 [R, N*bits/32] -> int32 [R, N] stored values (inverse of pack_cols)."""
    bits = _check_bits(bits)
    _check_words("qzeros", qzeros, bits, "axis 1", 1)
    return np.ascontiguousarray(_unpack_axis0(qzeros.T, bits).T)


# --------------------------------------------------------------------------- dequantize / quantize
def _check_g_idx(g_idx, k, num_groups):
    _check_int_array("g_idx", g_idx, 1, "[K]")
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx: expected shape ({k},) = [K], got {g_idx.shape}")
    if k and (g_idx.min() < 0 or g_idx.max() >= num_groups):
        raise ValueError(f"g_idx: expected values in [0, {num_groups - 1}] (ceil(K/G) = {num_groups} groups), "
                         f"got range [{g_idx.min()}, {g_idx.max()}]")
    return g_idx.astype(np.int64)


# GPTQ v1 stores zero - 1, as GPTQModel exports it: for 2, 4 and 8 bits one subtraction per 32-bit word of this
# constant (a real zero of 0 borrows from the next field), so the real zeros are the word plus one in every field,
# carries included; 3-bit fields, which straddle words, are shifted one by one.
_V1_ONES = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def dequantize(qweight, scales, qzeros=None, g_idx=None, *, bits, group_size, checkpoint_format="gptq"):
    """Dequantize one GPTQ Linear to float32 W [K, N] (y = x @ W).

    qweight: int32 [K*bits/32, N] codes packed along K.
    scales: float16/float32/bfloat16 [R, N], R = ceil(K/G).
    qzeros: int32 [R, N*bits/32] stored zero points packed along N, or None for symmetric (zero = 2**(bits-1)).
    g_idx: int [K] group of each row k (act-order: non-monotone), or None for k // G.
    bits: 2, 3, 4 or 8. group_size: G, or -1 for one group of all K rows.
    checkpoint_format: "gptq" (v1: the real zeros are each stored word plus one in every field, carries included,
        for 2/4/8 bits, and (stored + 1) & (2**bits - 1) per field for 3 bits) or "gptq_v2" (real zero = stored).
    Returns float32 [K, N] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]); the product of an fp16 scale and
    a small integer is exact in float32.
    """
    bits = _check_bits(bits)
    if checkpoint_format not in _FORMATS:
        raise ValueError(f"checkpoint_format: expected one of {_FORMATS}, got {checkpoint_format!r}")
    _check_words("qweight", qweight, bits, "axis 0", 0)
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    glen = _group_len(group_size, k)
    num_groups = -(-k // glen)
    _check_float_array("scales", scales, 2, "[ceil(K/G), N]")
    if scales.shape != (num_groups, n):
        raise ValueError(f"scales: expected shape ({num_groups}, {n}) = [ceil(K/G), N] for K={k}, G={glen}, "
                         f"got {scales.shape}")
    mask = (1 << bits) - 1
    if qzeros is None:
        zeros = np.full((num_groups, n), 1 << (bits - 1), np.int64)  # symmetric: zero = 2**(bits-1)
    else:
        _check_int32("qzeros", qzeros, 2, "[ceil(K/G), N*bits/32]")
        if qzeros.shape != (num_groups, n * bits // 32) or (n * bits) % 32:
            raise ValueError(f"qzeros: expected shape ({num_groups}, {n * bits / 32:g}) = [ceil(K/G), N*bits/32] "
                             f"(N a multiple of {_unit(bits)[0]}), got {qzeros.shape}")
        if checkpoint_format == "gptq" and bits in _V1_ONES:  # v1 stores zero - 1, word by word
            words = (qzeros.astype(np.int64) % (1 << 32) + _V1_ONES[bits]) % (1 << 32)
            zeros = unpack_cols(words.astype(np.uint32).view(np.int32), bits).astype(np.int64)  # [R, N]
        else:
            zeros = unpack_cols(qzeros, bits).astype(np.int64)  # [R, N]
            if checkpoint_format == "gptq":  # 3 bits: field by field
                zeros = (zeros + 1) & mask
    if g_idx is None:
        groups = np.arange(k) // glen  # [K]
    else:
        groups = _check_g_idx(g_idx, k, num_groups)
    q = unpack_rows(qweight, bits).astype(np.int64)  # [K, N]
    s = scales.astype(np.float32)[groups]  # [K, N]
    return s * (q - zeros[groups]).astype(np.float32)


class QuantizedLinear(NamedTuple):
    """GPTQ tensors of one Linear as a checkpoint stores them."""
    qweight: np.ndarray  # int32 [K*bits/32, N]
    qzeros: np.ndarray  # int32 [ceil(K/G), N*bits/32]; v1: zero - 1, v2: real zero
    scales: np.ndarray  # float16 [ceil(K/G), N]
    g_idx: np.ndarray  # int32 [K]
    checkpoint_format: str  # "gptq" (sym) or "gptq_v2" (asym)


def act_order_g_idx(k, group_size, rng):
    """An act-order g_idx: int32 [K] = argsort(random permutation) // G.

    Non-monotone, and each group has G members (the last one K mod G when G does not divide K), as GPTQ's
    desc_act writes it: g_idx[k] = (rank of k in the processing order) // G.
    rng: numpy.random.Generator or an int seed.
    """
    k = int(k)
    if k < 0:
        raise ValueError(f"k: expected a non-negative int, got {k}")
    glen = _group_len(group_size, k)
    perm = np.random.default_rng(rng).permutation(k)  # processing order
    return (np.argsort(perm) // glen).astype(np.int32)


def quantize(w, *, bits, group_size, sym=True, g_idx=None):
    """Round-to-nearest GPTQ quantizer writing genuine checkpoint tensors.

    w: float [K, N] (W of y = x @ W, i.e. nn.Linear.weight transposed). K a multiple of 32/bits
       (of 32 for 3 bits), N likewise (qzeros pack along N).
    bits: 2, 3, 4, 8. group_size: G or -1 (one group). sym: symmetric (zero = 2**(bits-1)).
    g_idx: int [K] act-order groups (e.g. act_order_g_idx), or None for k // G.
    Per group g and column n, over the rows with g_idx == g:
        xmin = min(min w, 0), xmax = max(max w, 0); sym: xmax = max(-xmin, xmax), xmin = -xmax if xmin < 0;
        both 0 -> (-1, 1); scale = (xmax - xmin) / (2**bits - 1), stored fp16;
        zero = 2**(bits-1) if sym else round(-xmin / scale); q = clip(round(w / scale16) + zero, 0, 2**bits - 1).
    Codes divide by the stored fp16 scale, so dequantization error is at most scale16/2 inside the range.
    (AutoGPTQ quirk kept on purpose: with sym, a group whose values are all >= 0 keeps xmin = 0, so codes clamp.)
    Returns QuantizedLinear: sym -> checkpoint_format "gptq" (v1, stored zero - 1);
    asym -> "gptq_v2" (real zeros: v1 cannot hold a real zero of 0).
    """
    bits = _check_bits(bits)
    _check_float_array("w", w, 2, "[K, N]")
    k, n = w.shape
    per_unit, _ = _unit(bits)
    if k % per_unit or n % per_unit:
        raise ValueError(f"w: K and N must be multiples of {per_unit} for {bits} bits, got shape {w.shape}")
    glen = _group_len(group_size, k)
    num_groups = -(-k // glen)
    groups = np.arange(k) // glen if g_idx is None else _check_g_idx(g_idx, k, num_groups)  # [K]
    maxq = (1 << bits) - 1
    w64 = w.astype(np.float64)
    if not np.all(np.isfinite(w64)):
        raise ValueError("w: expected finite values, got inf or nan")

    xmin = np.zeros((num_groups, n))  # [R, N]; starting at 0 = min(min w, 0)
    xmax = np.zeros((num_groups, n))
    for g in range(num_groups):
        rows = w64[groups == g]  # [rows of group g, N]
        if rows.size:
            xmin[g] = np.minimum(rows.min(0), 0.0)
            xmax[g] = np.maximum(rows.max(0), 0.0)
    if sym:
        xmax = np.maximum(-xmin, xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = np.where(both_zero, -1.0, xmin)
    xmax = np.where(both_zero, 1.0, xmax)
    scale = (xmax - xmin) / maxq  # [R, N] float64
    with np.errstate(over="ignore"):  # overflow is reported below, naming w
        scale16 = scale.astype(np.float16)
    if not np.all(np.isfinite(scale16)):
        raise ValueError(f"w: values too large for float16 scales (max |w| = {np.abs(w64).max():g})")
    zero = np.full((num_groups, n), float(1 << (bits - 1))) if sym else np.round(-xmin / scale)
    # Divide by the scale the checkpoint stores; a scale that underflows fp16 to 0 falls back to the exact one
    # (its codes then dequantize to 0, an error below maxq * scale).
    div = np.where(scale16 > 0, scale16.astype(np.float64), scale)
    q = np.clip(np.round(w64 / div[groups]) + zero[groups], 0, maxq).astype(np.int64)  # [K, N]

    if sym:
        stored, fmt = (zero.astype(np.int64) - 1) & maxq, "gptq"
    else:
        stored, fmt = zero.astype(np.int64), "gptq_v2"
    return QuantizedLinear(pack_rows(q, bits), pack_cols(stored, bits), scale16, groups.astype(np.int32), fmt)


# --------------------------------------------------------------------------- MoE
def moe_align_block_size(topk_ids, block_size, num_experts):
    """Sort (token, expert) pairs by expert and pad each expert's run to a multiple of B.

    topk_ids: int [M, A] expert of each (token, slot), values in [0, E).
    block_size: B > 0. num_experts: E > 0.
    Pair p = token * A + slot, P = M * A. Pairs are grouped by expert ascending, ascending p within an expert;
    each expert's group is padded to a multiple of B with the sentinel P. Capacity
        C = (P + min(E, P) * (B - 1)) // B * B
    is the most any routing of P pairs over E experts can need (a multiple of B; the GPU uses the same).
    Returns
        sorted_token_ids: int32 [C], pair ids, P (the sentinel) wherever there is no pair;
        expert_ids: int32 [C/B], expert of each block, -1 for blocks past the padded total;
        num_tokens_post_padded: int32 [1], the padded total T (a multiple of B, T <= C).

    Worked example: M=3, A=2, E=4, B=4, topk_ids = [[1, 3], [1, 0], [3, 1]], so P = 6 (sentinel 6) and
    pairs p=0..5 go to experts [1, 3, 1, 0, 3, 1]. Expert 0: [3]; expert 1: [0, 2, 5]; expert 2: none;
    expert 3: [1, 4]. C = (6 + 4 * 3) // 4 * 4 = 16:

    >>> s, e, t = moe_align_block_size(np.array([[1, 3], [1, 0], [3, 1]]), 4, 4)
    >>> s.tolist()
    [3, 6, 6, 6, 0, 2, 5, 6, 1, 4, 6, 6, 6, 6, 6, 6]
    >>> e.tolist(), t.tolist()
    ([0, 1, 3, -1], [12])
    """
    _check_int_array("topk_ids", topk_ids, 2, "[M, A]")
    b = _check_positive_int("block_size", block_size)
    e = _check_positive_int("num_experts", num_experts)
    flat = topk_ids.reshape(-1).astype(np.int64)  # [P], flat[p] = expert of pair p
    p_total = flat.size
    if p_total and (flat.min() < 0 or flat.max() >= e):
        raise ValueError(f"topk_ids: expected expert ids in [0, {e - 1}] (num_experts={e}), "
                         f"got range [{flat.min()}, {flat.max()}]")
    capacity = (p_total + min(e, p_total) * (b - 1)) // b * b
    sorted_ids = np.full(capacity, p_total, np.int32)  # [C] sentinel everywhere first
    expert_ids = np.full(capacity // b, -1, np.int32)  # [C/B]
    pos = 0
    for expert in range(e):
        pairs = np.nonzero(flat == expert)[0]  # ascending p
        if pairs.size == 0:
            continue
        padded = -(-pairs.size // b) * b
        sorted_ids[pos:pos + pairs.size] = pairs
        expert_ids[pos // b:(pos + padded) // b] = expert
        pos += padded
    return sorted_ids, expert_ids, np.array([pos], np.int32)


def _check_weight(name, weight):
    """Duck-typed StackedGptqWeight on the host -> (E, K, N)."""
    for field in ("qweight", "scales", "qzeros", "g_idx", "bits", "group_size"):
        if not hasattr(weight, field):
            raise TypeError(f"{name}: expected a StackedGptqWeight-like object with .{field}, "
                            f"got {type(weight).__name__}")
    bits = _check_bits(weight.bits)
    for field in ("qweight", "scales", "qzeros", "g_idx"):
        x = getattr(weight, field)
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}.{field}: expected a NumPy (host) array, got "
                            f"{type(x).__module__}.{type(x).__name__} (use .to_host())")
    _check_int32(f"{name}.qweight", weight.qweight, 3, "[E, K*bits/32, N]")
    e, rows, n = weight.qweight.shape
    return e, rows * 32 // bits, n


def _dequantize_expert(weight, expert):
    """float32 [K, N] of one expert of a stacked weight (qzeros hold real zeros: v2 semantics)."""
    return dequantize(weight.qweight[expert], weight.scales[expert],
                      None if weight.qzeros is None else weight.qzeros[expert],
                      None if weight.g_idx is None else weight.g_idx[expert],
                      bits=weight.bits, group_size=weight.group_size, checkpoint_format="gptq_v2")


def _swap_runs(x, a, b):
    """x [..., K] (K a multiple of 8, NumPy or CuPy) with every run of 8 columns seen as [a][b] and stored as [b][a]
    (a * b = 8): a new array. A transpose, so CuPy needs no index array on the device (one copy kernel, which a CUDA
    graph can capture)."""
    if x.shape[-1] % 8:
        raise ValueError(f"x: expected a last dimension that is a multiple of 8, got shape {x.shape}")
    return x.reshape(*x.shape[:-1], -1, a, b).swapaxes(-1, -2).reshape(x.shape)


def to_pair_order(x):
    """[..., K] (K a multiple of 8) -> the same values with every run of 8 columns in pair order
    k0 k4 k1 k5 k2 k6 k3 k7, the 4-bit kernels' activation layout (fused_moe_gemm's a_pair_order).
    Works on NumPy and CuPy arrays alike (returns a new array of the same kind)."""
    return _swap_runs(x, 2, 4)  # [half][j] = k(4 half + j) -> position 2j + half


def from_pair_order(x):
    """The inverse of to_pair_order."""
    return _swap_runs(x, 4, 2)


def fused_moe_gemm(a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                   topk_weights=None, out=None, *, a_pair_order=False):
    """One GPTQ MoE GEMM phase over aligned blocks of pairs.

    a: float16/bfloat16/float32 [M, K] activations; a_pair_order: a's columns are in pair order (to_pair_order).
    weight: StackedGptqWeight on the host (qweight [E, K*bits/32, N], scales [E, ceil(K/G), N],
            qzeros [E, ceil(K/G), N*bits/32] real zeros or None, g_idx [E, K] or None, bits, group_size).
    sorted_token_ids: int [C], expert_ids: int [C/B], num_tokens_post_padded: int [1] from moe_align_block_size;
            B = C / (C/B). Or one pair per block: sorted_token_ids and num_tokens_post_padded None, expert_ids the
            pairs' expert ids [P] or [M, A] (topk_ids).
    top_k: A; pair p reads row a[p // A] (for the down phase a is already one row per pair: top_k = 1).
    topk_weights: float [M, A] (any shape of P elements) or None; multiplies row p by topk_weights.flat[p].
    out: optional [M*A, N] array of a's dtype to write into.
    Returns [M*A, N] of a's dtype: row p = a[p // A] @ W[expert of p's block] (* weight of p), float64 math,
    rounded once. Only blocks b with b*B < num_tokens_post_padded and expert_ids[b] != -1 are computed; ids >= P
    (sentinels) are skipped, and must follow the block's pairs (padding ends a block). Rows of pairs never produced
    stay untouched in `out` (zeros in a new output).
    """
    _check_float_array("a", a, 2, "[M, K]")
    top_k = _check_positive_int("top_k", top_k)
    e, k, n = _check_weight("weight", weight)
    m = a.shape[0]
    if a.shape[1] != k:
        raise ValueError(f"a: expected K = {k} columns to match weight, got shape {a.shape}")
    p_total = m * top_k
    if sorted_token_ids is None and num_tokens_post_padded is None:  # one pair per block: the layout that says so
        _check_int_array("expert_ids", expert_ids, np.ndim(expert_ids), "[P] or [M, A] (one pair per block)")
        if expert_ids.size != p_total:
            raise ValueError(f"expert_ids: expected M*A = {p_total} expert ids (one pair per block), "
                             f"got shape {expert_ids.shape}")
        sorted_token_ids, expert_ids = np.arange(p_total), expert_ids.reshape(-1)
        num_tokens_post_padded = np.array([p_total])
    _check_int_array("sorted_token_ids", sorted_token_ids, 1, "[C]")
    _check_int_array("expert_ids", expert_ids, 1, "[C/B]")
    _check_int_array("num_tokens_post_padded", num_tokens_post_padded, 1, "[1]")
    if num_tokens_post_padded.shape != (1,):
        raise ValueError(f"num_tokens_post_padded: expected shape (1,), got {num_tokens_post_padded.shape}")
    num_blocks = expert_ids.size
    if num_blocks == 0:
        if sorted_token_ids.size:
            raise ValueError(f"expert_ids: expected a block per B entries of sorted_token_ids "
                             f"({sorted_token_ids.size} entries), got 0 blocks")
        block = 1
    else:
        if sorted_token_ids.size % num_blocks:
            raise ValueError(f"sorted_token_ids: expected a size that is a multiple of expert_ids.size "
                             f"({num_blocks}), got {sorted_token_ids.size}")
        block = sorted_token_ids.size // num_blocks
    if num_blocks and (expert_ids.min() < -1 or expert_ids.max() >= e):
        raise ValueError(f"expert_ids: expected values in [-1, {e - 1}], got range "
                         f"[{expert_ids.min()}, {expert_ids.max()}]")
    if topk_weights is not None:
        _host("topk_weights", topk_weights)
        if not _is_float(topk_weights.dtype):
            raise TypeError(f"topk_weights: expected a float array, got {topk_weights.dtype}")
        if topk_weights.size != p_total:
            raise ValueError(f"topk_weights: expected M*top_k = {p_total} elements, got shape {topk_weights.shape}")
        route = topk_weights.reshape(-1).astype(np.float64)  # [P]
    if out is None:
        out = np.zeros((p_total, n), a.dtype)
    else:
        _host("out", out)
        if out.shape != (p_total, n) or out.dtype != a.dtype:
            raise ValueError(f"out: expected shape ({p_total}, {n}) = [M*top_k, N] and dtype {a.dtype}, "
                             f"got shape {out.shape} and dtype {out.dtype}")

    a64 = (from_pair_order(a) if a_pair_order else a).astype(np.float64)  # [M, K]
    dense = {}  # expert -> float64 [K, N], dequantized once
    total = int(num_tokens_post_padded[0])
    for b in range(num_blocks):
        expert = int(expert_ids[b])
        if b * block >= total or expert == -1:
            continue
        pairs = sorted_token_ids[b * block:(b + 1) * block].astype(np.int64)
        valid = (pairs >= 0) & (pairs < p_total)
        if not valid[:int(valid.sum())].all():  # the GPU kernels find a block's rows by its first padding slot
            raise ValueError(f"sorted_token_ids: expected each block's pairs before its padding (as "
                             f"moe_align_block_size writes them), got block {b}: {pairs.tolist()}")
        pairs = pairs[valid]  # drop sentinels
        if pairs.size == 0:
            continue
        if expert not in dense:
            dense[expert] = _dequantize_expert(weight, expert).astype(np.float64)
        rows = a64[pairs // top_k] @ dense[expert]  # [pairs in block, N]
        if topk_weights is not None:
            rows = rows * route[pairs][:, None]
        out[pairs] = rows.astype(a.dtype)
    return out


def select_experts(router_logits, top_k, renormalize):
    """Softmax routing: (topk_weights float32 [M, A], topk_ids int32 [M, A]).

    router_logits: float [M, E]. top_k: A in [1, E]. Softmax in float32 over E; the A experts of highest
    probability in descending order, ties to the lower expert index; renormalize divides by their sum.
    """
    _check_float_array("router_logits", router_logits, 2, "[M, E]")
    m, e = router_logits.shape
    top_k = _check_positive_int("top_k", top_k)
    if top_k > e:
        raise ValueError(f"top_k: expected at most E = {e}, got {top_k}")
    logits = router_logits.astype(np.float32)  # [M, E]
    shifted = logits - logits.max(axis=1, keepdims=True) if m else logits
    expd = np.exp(shifted)
    probs = expd / expd.sum(axis=1, keepdims=True)  # [M, E] float32
    # A stable sort of -probs keeps equal probabilities in index order: ties go to the lower expert.
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]  # [M, A]
    weights = np.take_along_axis(probs, ids, axis=1)  # [M, A]
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32), ids.astype(np.int32)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, block_size=16):
    """A whole MoE layer of routed experts: [M, H] of hidden_states' dtype.

    hidden_states: float16/bfloat16/float32 [M, H].
    w13: StackedGptqWeight (host), K = H, N = 2I, gate columns [:I] then up columns [I:].
    w2: StackedGptqWeight (host), K = I, N = H.
    topk_weights: float [M, A]; topk_ids: int [M, A] (from select_experts). block_size: B of the alignment.
    Roundings (the GPU path rounds at the same points; its weights are fp16/bf16 and its sums run in another
    order, within tests/tolerances.py), dtype = hidden_states.dtype:
        x1 = gemm(hidden, w13, top_k=A) -> dtype [P, 2I]
        act = silu(x1[:, :I]) * x1[:, I:] in float32 -> dtype [P, I]
        x2 = gemm(act, w2, top_k=1, topk_weights) -> dtype [P, H]
        out = sum over the A slots (slot 0 first) in float32 -> dtype [M, H]
    """
    _check_float_array("hidden_states", hidden_states, 2, "[M, H]")
    e13, k13, n13 = _check_weight("w13", w13)
    e2, k2, n2 = _check_weight("w2", w2)
    m, h = hidden_states.shape
    if e2 != e13:
        raise ValueError(f"w2: expected E = {e13} experts like w13, got {e2}")
    if n13 % 2:
        raise ValueError(f"w13: expected an even N = 2I (gate then up), got N = {n13}")
    inter = n13 // 2
    if k13 != h:
        raise ValueError(f"w13: expected K = H = {h}, got K = {k13}")
    if k2 != inter or n2 != h:
        raise ValueError(f"w2: expected K = I = {inter} and N = H = {h}, got K = {k2}, N = {n2}")
    _check_int_array("topk_ids", topk_ids, 2, "[M, A]")
    _check_float_array("topk_weights", topk_weights, 2, "[M, A]")
    if topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights, topk_ids: expected equal shapes [M={m}, A], got "
                         f"{topk_weights.shape} and {topk_ids.shape}")
    a_k = topk_ids.shape[1]
    dtype = hidden_states.dtype

    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block_size, e13)
    x1 = fused_moe_gemm(hidden_states, w13, sorted_ids, expert_ids, total, a_k)  # [P, 2I] dtype
    gate = x1[:, :inter].astype(np.float32)
    up = x1[:, inter:].astype(np.float32)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for very negative gate gives silu = -0, as it should
        act = (gate / (np.float32(1) + np.exp(-gate)) * up).astype(dtype)  # silu(gate) * up, [P, I]
    x2 = fused_moe_gemm(act, w2, sorted_ids, expert_ids, total, 1, topk_weights=topk_weights)  # [P, H]
    x2 = x2.reshape(m, a_k, h)
    acc = np.zeros((m, h), np.float32)
    for slot in range(a_k):
        acc += x2[:, slot].astype(np.float32)
    return acc.astype(dtype)

"""fused_moe_gemm: one launch computes every (token, expert) pair of one MoE phase from raw stacked GPTQ weights.

NumPy inputs run `cupy_moe.reference.fused_moe_gemm` (same signature); CuPy inputs run the kernels of
`kernels/moe_gemm_decode.cu`, `moe_gemm_prefill.cu` and `moe_gemm_swapped.cu` (the config's source_file).
The launcher checks, allocates (the output only; the split-K workspace is allocated once and cached), launches.
"""
from __future__ import annotations

import numpy as np

from . import _compile, configs
from ._xp import is_device_array, require_gpu

__all__ = ["fused_moe_gemm"]

_WORKSPACES: dict = {}  # (device, stream) -> [partials float32, tickets int32]: grow-only, tickets kept at zero
_SMEM_SET: dict = {}  # (kernel name, device) -> (RawKernel, dynamic shared-memory bytes already allowed for it)


def _fail(name, expected, got, exc=ValueError):
    raise exc(f"{name}: expected {expected}, got {got}")


def _check_dev_array(cp, name, x, dtype, ndim, letters):
    if not isinstance(x, cp.ndarray):
        _fail(name, "a CuPy array (all inputs on the device)", type(x).__name__, TypeError)
    if x.dtype != dtype:
        _fail(name, np.dtype(dtype).name, x.dtype, TypeError)
    if x.ndim != ndim:
        _fail(name, f"{ndim}-D {letters}", f"shape {x.shape}")
    if not x.flags.c_contiguous:
        _fail(name, "a C-contiguous array", "a strided view")
    if x.device.id != cp.cuda.Device().id:
        _fail(name, f"an array on the current device {cp.cuda.Device().id}", f"device {x.device.id}")
    return x


def _workspace(cp, floats, ints):
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].size < floats or ws[1].size < ints:
        old = (0, 0) if ws is None else (ws[0].size, ws[1].size)
        ws = [cp.empty(max(floats, old[0]), cp.float32), cp.zeros(max(ints, old[1]), cp.int32)]
        _WORKSPACES[key] = ws
    return ws


def fused_moe_gemm(a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                   topk_weights=None, out=None, *, a_pair_order=False):
    """out[p, :] = a[p // top_k, :] @ W[expert of p] (* topk_weights[p]), rounded once to a's dtype.

    a: float16 or bfloat16 [M, K] (NumPy input: any float dtype the reference takes).
    weight: StackedGptqWeight on the device: qweight int32 [E, K*bits/32, N], scales float16 [E, ceil(K/G), N],
        qzeros int32 [E, ceil(K/G), N*bits/32] real zeros or None (symmetric), g_idx int32 [E, K] or None;
        bits 4 or 8; group_size G in {-1 or a multiple of 32}.
    sorted_token_ids int32 [C], expert_ids int32 [C/B], num_tokens_post_padded int32 [1]: from
        `moe_align_block_size(topk_ids, B, E)`; B = C / (C/B) must be a supported block_m (16, 32, 64 or 128;
        `configs.choose_config(...).block_m` says which to use). Never read on the host.
        One pair per block instead: sorted_token_ids and num_tokens_post_padded None, expert_ids the pairs' expert
        ids themselves, int32 [P] or [M, top_k] (topk_ids). Every pair gets a 16-row block of its own, so no align
        launch is needed; the fast path for M = 1, wasteful when many pairs share an expert.
    top_k: pairs per row of a (A for gate/up, 1 for down); P = M * top_k.
    topk_weights: float32 [M, top_k] or [P], or None: multiplies each row in fp32 before the single rounding.
    out: [P, N] of a's dtype to write into, or None (new, zero-filled). Rows of pairs absent from the list stay
        untouched.
    a_pair_order: a's columns are in pair order (4-bit weights only): each run of 8 columns holds k0 k4 k1 k5 k2 k6
        k3 k7 of its run, the order in which the 4-bit dequantizer pairs codes, so the kernels need not re-pair
        them (`cupy_moe.reference.to_pair_order` makes it; fused_moe's down phase gets it from silu-and-mul).
    Returns out [P, N].
    A block whose expert id is outside [0, E) is skipped: its rows stay untouched (ids are not checked on the host,
    which would need a synchronization).
    """
    if not is_device_array(a):
        from . import reference
        return reference.fused_moe_gemm(a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                                        topk_weights=topk_weights, out=out, a_pair_order=a_pair_order)
    cp = require_gpu("fused_moe_gemm on CuPy arrays")
    # ---- check
    if a.dtype == np.float16:
        bf16 = False
    elif a.dtype.name == "bfloat16":
        bf16 = True
    else:
        _fail("a", "float16 or bfloat16", a.dtype, TypeError)
    if a.ndim != 2:
        _fail("a", "2-D [M, K]", f"shape {a.shape}")
    _check_dev_array(cp, "a", a, a.dtype, 2, "[M, K]")
    for field in ("qweight", "scales", "qzeros", "g_idx", "bits", "group_size"):
        if not hasattr(weight, field):
            _fail("weight", f"a StackedGptqWeight with .{field}", type(weight).__name__, TypeError)
    bits = weight.bits
    if bits not in (4, 8):
        _fail("weight.bits", "4 or 8 (the kernel's dequantizers)", bits)
    if a_pair_order and bits != 4:
        _fail("a_pair_order", "False with 8-bit weights (pair order is the 4-bit dequantizer's)", a_pair_order)
    qweight = _check_dev_array(cp, "weight.qweight", weight.qweight, np.int32, 3, "[E, K*bits/32, N]")
    e, rows, n = qweight.shape
    k = rows * 32 // bits
    m = a.shape[0]
    if a.shape[1] != k:
        _fail("a", f"K = {k} columns (from weight.qweight {qweight.shape}, {bits}-bit)", f"shape {a.shape}")
    if k % 32:
        _fail("K", "a multiple of 32 (the kernel walks K in chunks of 32)", k)
    if n % 32:
        _fail("N", "a multiple of 32 (the kernel's column groups)", n)
    if e < 1:
        _fail("E", "at least one expert", e)
    gs = weight.group_size
    if not isinstance(gs, (int, np.integer)) or isinstance(gs, bool):
        _fail("weight.group_size", "an int", type(gs).__name__, TypeError)
    if gs != -1 and (gs <= 0 or gs % 32):
        _fail("weight.group_size", "-1 or a positive multiple of 32 (a 32-wide K chunk stays inside one group)", gs)
    group_len = k if gs == -1 else int(gs)
    num_groups = -(-k // group_len)
    scales = _check_dev_array(cp, "weight.scales", weight.scales, np.float16, 3, "[E, ceil(K/G), N]")
    if scales.shape != (e, num_groups, n):
        _fail("weight.scales", f"shape {(e, num_groups, n)} = [E, ceil(K/G), N]", scales.shape)
    qzeros = weight.qzeros
    if qzeros is not None:
        _check_dev_array(cp, "weight.qzeros", qzeros, np.int32, 3, "[E, ceil(K/G), N*bits/32]")
        if qzeros.shape != (e, num_groups, n * bits // 32):
            _fail("weight.qzeros", f"shape {(e, num_groups, n * bits // 32)} = [E, ceil(K/G), N*bits/32]",
                  qzeros.shape)
    g_idx = weight.g_idx
    if g_idx is not None:
        _check_dev_array(cp, "weight.g_idx", g_idx, np.int32, 2, "[E, K]")
        if g_idx.shape != (e, k):
            _fail("weight.g_idx", f"shape {(e, k)} = [E, K]", g_idx.shape)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        _fail("top_k", "a positive int", repr(top_k), TypeError if not isinstance(top_k, (int, np.integer)) else
              ValueError)
    top_k = int(top_k)
    p = m * top_k
    one_pair = sorted_token_ids is None and num_tokens_post_padded is None
    if one_pair:  # expert_ids is topk_ids: one 16-row block per pair
        blocks = _check_dev_array(cp, "expert_ids", expert_ids, np.int32, getattr(expert_ids, "ndim", 1),
                                  "[P] or [M, top_k] (one pair per block)")
        if blocks.size != p:
            _fail("expert_ids", f"M*top_k = {p} expert ids (one pair per block)", f"shape {blocks.shape}")
        sorted_ids = post = None
        capacity = 16 * p
    else:
        if sorted_token_ids is None or num_tokens_post_padded is None:
            _fail("sorted_token_ids, num_tokens_post_padded", "both arrays, or both None (one pair per block)",
                  f"{type(sorted_token_ids).__name__}, {type(num_tokens_post_padded).__name__}", TypeError)
        sorted_ids = _check_dev_array(cp, "sorted_token_ids", sorted_token_ids, np.int32, 1, "[C]")
        blocks = _check_dev_array(cp, "expert_ids", expert_ids, np.int32, 1, "[C/B]")
        post = _check_dev_array(cp, "num_tokens_post_padded", num_tokens_post_padded, np.int32, 1, "[1]")
        if post.shape != (1,):
            _fail("num_tokens_post_padded", "shape (1,)", post.shape)
        capacity = sorted_ids.size
    if blocks.size == 0:
        if capacity:
            _fail("expert_ids", f"a block per B entries of sorted_token_ids ({capacity})", "no blocks")
        block_m = None
    else:
        if capacity % blocks.size:
            _fail("sorted_token_ids", f"a size that is a multiple of expert_ids.size = {blocks.size}", capacity)
        block_m = capacity // blocks.size
        if block_m not in configs.SUPPORTED_BLOCK_M:
            _fail("block size B = sorted_token_ids.size // expert_ids.size",
                  f"one of {configs.SUPPORTED_BLOCK_M} (align with configs.choose_config(...).block_m)", block_m)
    if capacity >= 2**31 or p >= 2**31:
        _fail("sorted_token_ids", "fewer than 2**31 rows", capacity)
    if topk_weights is not None:
        _check_dev_array(cp, "topk_weights", topk_weights, np.float32, topk_weights.ndim, "[M, top_k] or [P]")
        if topk_weights.size != p:
            _fail("topk_weights", f"M*top_k = {p} elements", f"shape {topk_weights.shape}")
    if out is not None:
        _check_dev_array(cp, "out", out, a.dtype, 2, "[P, N]")
        if out.shape != (p, n):
            _fail("out", f"shape {(p, n)} = [M*top_k, N]", out.shape)
    for name, x in (("a", a), ("out", out), ("weight.qweight", qweight), ("weight.scales", scales),
                    ("weight.qzeros", qzeros)):
        if x is not None and x.data.ptr % 16:
            _fail(name, "16-byte aligned data (the kernels move 16 bytes per access)", "a misaligned view")
    # ---- allocate
    if out is None:
        out = cp.zeros((p, n), a.dtype)
    if block_m is None or p == 0 or n == 0:
        return out
    hopper = configs.hopper_enabled(_compile.device_arch())
    cfg = configs.choose_config(m, e, top_k, k, n, bits, gs, block_m=block_m, hopper=hopper,
                                act_order=g_idx is not None)
    cfg, name, smem = configs.kernel_instance(cfg, bf16, bits, g_idx is not None, group_len, hopper, k,
                                              pair_a=bool(a_pair_order))
    n_tiles = -(-n // cfg.block_n)
    chunks = k // 32
    wk = cfg.warps_k  # K slices per CTA (moe_gemm's warps along K), so split * wk slices in all
    cps = -(-chunks // (cfg.split_k * wk))
    cps = -(-cps // cfg.ku) * cfg.ku  # slices start on a stage boundary (group mode 1 relies on it)
    split = -(-chunks // (cps * wk))  # no CTA without work (its last warps' slices may be empty)
    if split > 1:
        partials, tickets = _workspace(cp, split * capacity * n, blocks.size * n_tiles)
    else:
        partials = tickets = None
    # ---- launch
    kern = _compile.get_kernel(cfg.source_file, name)
    smem_key = (name, cp.cuda.Device().id)
    allowed = _SMEM_SET.get(smem_key)
    if smem and (allowed is None or allowed[0] is not kern or allowed[1] < smem):  # opt in above 48 KiB once
        kern.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[smem_key] = (kern, smem)
    i32 = np.int32
    null = np.uintp(0)  # a null pointer argument
    opt = lambda x: null if x is None else x
    _compile.launch(kern, (blocks.size, n_tiles, split), (cfg.threads,),
                    (a, qweight, scales, opt(qzeros), opt(g_idx), opt(topk_weights), opt(sorted_ids), blocks, opt(post),
                     out, opt(partials), opt(tickets), i32(k), i32(n), i32(group_len), i32(num_groups), i32(top_k),
                     i32(p), i32(capacity), i32(split), i32(cps), i32(e)), smem)
    return out

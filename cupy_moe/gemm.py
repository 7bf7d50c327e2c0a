"""fused_moe_gemm: one launch computes every (token, expert) pair of one MoE phase from raw stacked GPTQ weights.

NumPy inputs run `cupy_moe.reference.fused_moe_gemm` (same signature); CuPy inputs run the kernel family of the
configuration (`kernels/moe_gemm_decode.cu`, `moe_gemm_prefill.cu` or `moe_gemm_swapped.cu`: its source_file).
The launcher checks, allocates (the output only; the split-K workspace is allocated once per stream and cached),
launches the configuration it is given (`config=`, from `configs.choose_config`) or chooses one itself.
"""
from __future__ import annotations

import numpy as np

from . import _compile, configs
from ._xp import ACTIVATION_DTYPES, check_current_device, check_input, is_device_array, require_gpu
from .align import align_capacity
from .weights import StackedGptqWeight

__all__ = ["fused_moe_gemm", "SplitKWorkspace"]

_WORKSPACES: dict = {}  # (device, stream) -> [partials float32, tickets int32]: grow-only, tickets kept at zero
_SMEM_SET: dict = {}  # (kernel name, device) -> (RawKernel, dynamic shared-memory bytes already allowed for it)


def _fail(name, expected, got, exc=ValueError):
    raise exc(f"{name}: expected {expected}, got {got}")


def _check_dev_array(xp, name, x, dtype, ndim, letters):
    """x: an array of xp (cupy: on the current device), of this dtype and ndim, C-contiguous."""
    if not isinstance(x, xp.ndarray):
        where = "NumPy array (all inputs on the host)" if xp is np else "CuPy array (all inputs on the device)"
        _fail(name, f"a {where}", type(x).__name__, TypeError)
    if x.dtype != dtype:
        _fail(name, np.dtype(dtype).name, x.dtype, TypeError)
    if x.ndim != ndim:
        _fail(name, f"{ndim}-D {letters}", f"shape {x.shape}")
    if not x.flags.c_contiguous:
        _fail(name, "a C-contiguous array", "a strided view")
    check_current_device(name, x)
    return x


def _stream_key(cp, stream=None):
    return cp.cuda.Device().id, (stream or cp.cuda.get_current_stream()).ptr


def _workspace(cp, floats, ints):
    key = _stream_key(cp)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].size < floats or ws[1].size < ints:
        old = (0, 0) if ws is None else (ws[0].size, ws[1].size)
        ws = [cp.empty(max(floats, old[0]), cp.float32), cp.zeros(max(ints, old[1]), cp.int32)]
        _WORKSPACES[key] = ws
    return ws


def take_stream_workspace(stream):
    """Remove the cached workspace of `stream` on the current device from the cache and return it (None if the
    stream has none): a CUDA graph captured on the stream holds it, so that its memory lives as long as the graph
    and no later call can grow (free) it under the graph."""
    cp = require_gpu("take_stream_workspace")
    return _WORKSPACES.pop(_stream_key(cp, stream), None)


def _geometry(config, k, n):
    """(column tiles, split-K CTAs, 32-k chunks per slice) of one launch of `config` on K x N."""
    chunks = k // 32
    wk = config.warps_k  # K slices per CTA (moe_gemm's warps along K), so split * wk slices in all
    cps = -(-chunks // (config.split_k * wk))
    cps = -(-cps // config.ku) * config.ku  # slices start on a stage boundary (group mode 1 relies on it)
    split = -(-chunks // (cps * wk))  # no CTA without work (its last warps' slices may be empty)
    return -(-n // config.block_n), split, cps


def _scratch(config, k, n, capacity):
    """(partials, tickets) one launch of `config` on K x N needs for a pair list of `capacity` rows (aligned, or 16 per
    pair with one pair per block): fp32 partials of every slice and an int32 ticket per (block, column tile); (0, 0)
    without split-K, and where the slices reduce inside a cluster (`_cluster_size`), which never touches them."""
    n_tiles, split, _ = _geometry(config, k, n)
    if split == 1 or _cluster_size(config, split) > 1:
        return 0, 0
    return split * capacity * n, capacity // config.block_m * n_tiles


def _cluster_size(config, split: int) -> int:
    """The thread-block cluster size of a launch: 2 where its split-K slices form one cluster and add their partial
    tiles through distributed shared memory (`configs.splits_in_cluster`) on this device, skipping the workspace;
    else 1."""
    usable = (split == configs.CLUSTER_SPLIT and _compile.clusters_available()
              and configs.splits_in_cluster(config, split, configs.gpu_info().hopper))
    return split if usable else 1


class SplitKWorkspace:
    """The scratch of split-K launches on one device: fp32 partial tiles and int32 tickets (zero between launches:
    each tile's last CTA resets its ticket). Made once for the launches it serves and passed as
    `fused_moe_gemm(..., workspace=)`, a call allocates nothing but its output; without one, a call uses a
    workspace cached per device and stream, grown when a launch needs more. One workspace serves one stream at a
    time; it is zeroed before the constructor returns, so that stream may be any."""

    def __init__(self, partials: int, tickets: int):
        cp = require_gpu("SplitKWorkspace")
        self.partials = cp.empty(max(0, int(partials)), cp.float32)
        self.tickets = cp.zeros(max(0, int(tickets)), cp.int32)
        cp.cuda.get_current_stream().synchronize()  # the zeroing ran on this stream; another may use the tickets

    @staticmethod
    def size(config, k: int, n: int, pairs: int, num_experts: int, one_pair: bool = False) -> tuple[int, int]:
        """(partials, tickets) that one launch of `config` (a GemmConfig) on K x N needs for P = `pairs` pairs
        aligned by moe_align_block_size over `num_experts` experts, or one pair per block (`one_pair`); (0, 0)
        without split-K or where its 2 slices add their tiles inside a thread-block cluster (on this device)."""
        if pairs == 0:
            return 0, 0
        return _scratch(config, k, n, 16 * pairs if one_pair else align_capacity(pairs, config.block_m, num_experts))

    @classmethod
    def for_launches(cls, sizes) -> "SplitKWorkspace":
        """One workspace for launches of these `size(...)` results (run one after another on one stream)."""
        sizes = list(sizes)
        return cls(max((f for f, _ in sizes), default=0), max((t for _, t in sizes), default=0))


def _check_config(config, block_m, act_order, pair_a, hopper, one_pair):
    """`config` (a GemmConfig) must be what runs on these inputs: its block size that of the aligned list, the
    decode kernel for one pair per block (the only one that reads no aligned list), and a kernel variant for
    act-order, pair order and the device (hopper None: not judged, the NumPy path)."""
    if not isinstance(config, configs.GemmConfig):
        _fail("config", "a GemmConfig (configs.choose_config(...)) or None", type(config).__name__, TypeError)
    if config.block_m != block_m:
        _fail("config", f"block_m = {block_m}, the block size of sorted_token_ids and expert_ids (align with "
              "config.block_m)", f"block_m = {config.block_m}")
    if one_pair and config.kind != "reg":
        _fail("config", "kind 'reg' with one pair per block (sorted_token_ids None: only the decode kernel runs "
              "without an aligned list)", f"kind {config.kind!r}")
    runs = configs.fallback(config, act_order=act_order, hopper=True if hopper is None else hopper, pair_a=pair_a)
    if runs != config:
        _fail("config", f"a shape with a kernel variant for act_order={act_order}, a_pair_order={pair_a}"
              + ("" if hopper is None else f", hopper={hopper}")
              + " (choose_config with the same flags gives one)", f"kind {config.kind!r} {config}")


def _check_device_weight(weight, a, a_pair_order):
    """What the kernels need of the weight beyond its own validation: on this device, 4 or 8 bits, K matching a,
    K, N and the group size in whole 32-wide chunks (its type: _check_call)."""
    if not weight.is_device:
        _fail("weight", "a StackedGptqWeight on the device (weight.to_device())", "NumPy arrays", TypeError)
    check_current_device("weight", weight.qweight)
    bits, gs, k, n = weight.bits, weight.group_size, weight.k, weight.n
    if bits not in (4, 8):
        _fail("weight.bits", "4 or 8 (the kernel's dequantizers)", bits)
    if a_pair_order and bits != 4:
        _fail("a_pair_order", "False with 8-bit weights (pair order is the 4-bit dequantizer's)", a_pair_order)
    if a.shape[1] != k:
        _fail("a", f"K = {k} columns (from weight.qweight {weight.qweight.shape}, {bits}-bit)", f"shape {a.shape}")
    if k % 32:
        _fail("K", "a multiple of 32 (the kernel walks K in chunks of 32)", k)
    if n % 32:
        _fail("N", "a multiple of 32 (the kernel's column groups)", n)
    if gs != -1 and gs % 32:
        _fail("weight.group_size", "-1 or a positive multiple of 32 (a 32-wide K chunk stays inside one group)", gs)


def _pair_list(xp, sorted_token_ids, expert_ids, num_tokens_post_padded, p):
    """(sorted_ids, blocks, post, capacity C, block size B or None without blocks) of the pair list: an aligned
    list, or one pair per 16-row block (sorted_token_ids and num_tokens_post_padded None, expert_ids = topk_ids)."""
    one_pair = sorted_token_ids is None and num_tokens_post_padded is None
    if one_pair:  # expert_ids is topk_ids: one 16-row block per pair
        blocks = _check_dev_array(xp, "expert_ids", expert_ids, np.int32, getattr(expert_ids, "ndim", 1),
                                  "[P] or [M, top_k] (one pair per block)")
        if blocks.size != p:
            _fail("expert_ids", f"M*top_k = {p} expert ids (one pair per block)", f"shape {blocks.shape}")
        sorted_ids = post = None
        capacity = 16 * p
    else:
        if sorted_token_ids is None or num_tokens_post_padded is None:
            _fail("sorted_token_ids, num_tokens_post_padded", "both arrays, or both None (one pair per block)",
                  f"{type(sorted_token_ids).__name__}, {type(num_tokens_post_padded).__name__}", TypeError)
        sorted_ids = _check_dev_array(xp, "sorted_token_ids", sorted_token_ids, np.int32, 1, "[C]")
        blocks = _check_dev_array(xp, "expert_ids", expert_ids, np.int32, 1, "[C/B]")
        post = _check_dev_array(xp, "num_tokens_post_padded", num_tokens_post_padded, np.int32, 1, "[1]")
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
    return sorted_ids, blocks, post, capacity, block_m


def _check_call(xp, a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, topk_weights, out,
                config, workspace):
    """The checks of a fused_moe_gemm call that hold on both paths (xp: numpy or cupy, where `a` is): the arrays'
    kind, dtype, shape and layout, top_k, the pair list and its block size, the types of config and workspace.
    Returns (top_k, P, sorted_ids, blocks, post, capacity, block_m); see _pair_list."""
    _check_dev_array(xp, "a", a, a.dtype, 2, "[M, K]")
    if not isinstance(weight, StackedGptqWeight):
        _fail("weight", "a StackedGptqWeight", type(weight).__name__, TypeError)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        _fail("top_k", "a positive int", repr(top_k), TypeError if not isinstance(top_k, (int, np.integer)) else
              ValueError)
    top_k = int(top_k)
    p = a.shape[0] * top_k
    listed = _pair_list(xp, sorted_token_ids, expert_ids, num_tokens_post_padded, p)
    if topk_weights is not None:
        _check_dev_array(xp, "topk_weights", topk_weights, np.float32, topk_weights.ndim, "[M, top_k] or [P]")
        if topk_weights.size != p:
            _fail("topk_weights", f"M*top_k = {p} elements", f"shape {topk_weights.shape}")
    if out is not None:
        _check_dev_array(xp, "out", out, a.dtype, 2, "[P, N]")
        if out.shape != (p, weight.n):
            _fail("out", f"shape {(p, weight.n)} = [M*top_k, N]", out.shape)
    if config is not None and not isinstance(config, configs.GemmConfig):
        _fail("config", "a GemmConfig (configs.choose_config(...)) or None", type(config).__name__, TypeError)
    if workspace is not None and not isinstance(workspace, SplitKWorkspace):
        _fail("workspace", "a SplitKWorkspace or None", type(workspace).__name__, TypeError)
    return (top_k, p, *listed)


def fused_moe_gemm(a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                   topk_weights=None, out=None, *, a_pair_order=False, config=None, workspace=None):
    """out[p, :] = a[p // top_k, :] @ W[expert of p] (* topk_weights[p]), rounded once to a's dtype.

    a: float16 or bfloat16 [M, K], NumPy or CuPy (the same inputs are accepted on both paths).
    weight: StackedGptqWeight on the device (it validates its own arrays): bits 4 or 8, K and N multiples of 32,
        group_size G -1 or a multiple of 32.
    sorted_token_ids int32 [C], expert_ids int32 [C/B], num_tokens_post_padded int32 [1]: from
        `moe_align_block_size(topk_ids, B, E)`; B = C / (C/B) must be a supported block_m (16, 32, 48, 64 or 128;
        `config.block_m` of `configs.choose_config(...)` says which to use). Never read on the host. In each block
        the pairs come first and the padding (the sentinel P) after them, as the align writes them: the kernels
        take a block's first padding slot for its end (the reference raises on a pair after padding).
        One pair per block instead: sorted_token_ids and num_tokens_post_padded None, expert_ids the pairs' expert
        ids themselves, int32 [P] or [M, top_k] (topk_ids). Every pair gets a 16-row block of its own, so no align
        launch is needed; fused_moe's path at M = 1 and at a few tokens of small experts
        (`configs.one_pair_blocks`), wasteful when many pairs share an expert.
    top_k: pairs per row of a (A for gate/up, 1 for down); P = M * top_k.
    topk_weights: float32 [M, top_k] or [P], or None: multiplies each row in fp32 before the single rounding.
    out: [P, N] of a's dtype to write into, or None (new, zero-filled). Rows of pairs absent from the list stay
        untouched.
    a_pair_order: a's columns are in pair order (4-bit weights only): each run of 8 columns holds k0 k4 k1 k5 k2 k6
        k3 k7 of its run, the order in which the 4-bit dequantizer pairs codes, so the kernels need not re-pair
        them (`cupy_moe.reference.to_pair_order` makes it; fused_moe's down phase gets it from silu-and-mul).
    config: the GemmConfig to launch (`configs.choose_config(...)` for this problem, aligned with its block_m), or
        None: chosen here for the block size of the aligned list. A config that cannot run these inputs (another
        block size, a kernel without an act-order or pair-order variant, the swapped kernel off sm_90a) is a
        ValueError.
    workspace: a SplitKWorkspace at least `SplitKWorkspace.size(config, ...)` large, so that the call allocates
        nothing but `out`; None: one cached per device and stream. The results are the same either way.
    Returns out [P, N].
    A block whose expert id is outside [0, E) is skipped: its rows stay untouched (ids are not checked on the host,
    which would need a synchronization).
    """
    check_input("a", a, ACTIVATION_DTYPES, "[M, K]")
    if topk_weights is not None:
        check_input("topk_weights", topk_weights, ("float32",), "[M, top_k] or [P]", ndim=(1, 2))
    device = is_device_array(a)
    xp = require_gpu("fused_moe_gemm on CuPy arrays") if device else np
    top_k, p, sorted_ids, blocks, post, capacity, block_m = _check_call(
        xp, a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, topk_weights, out, config,
        workspace)
    act_order, pair_a = weight.g_idx is not None, bool(a_pair_order)
    if not device:
        from . import reference
        if config is not None and block_m is not None:
            _check_config(config, block_m, act_order, pair_a, None, sorted_ids is None)
        return reference.fused_moe_gemm(a, weight, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                                        topk_weights=topk_weights, out=out, a_pair_order=a_pair_order)
    cp = xp
    # ---- check (the weight validated its own arrays when it was made; what is checked here is this launch's)
    bf16 = a.dtype.name == "bfloat16"
    _check_device_weight(weight, a, a_pair_order)
    bits, gs, e, k, n = weight.bits, weight.group_size, weight.num_experts, weight.k, weight.n
    m = a.shape[0]
    group_len, num_groups = weight.group_len, weight.num_groups
    qweight, scales, qzeros, g_idx = weight.qweight, weight.scales, weight.qzeros, weight.g_idx
    for name, x in (("a", a), ("out", out), ("weight.qweight", qweight), ("weight.scales", scales),
                    ("weight.qzeros", qzeros), ("weight.g_idx", g_idx)):
        if x is not None and x.data.ptr % 16:
            _fail(name, "16-byte aligned data (the kernels move 16 bytes per access)", "a misaligned view")
    if block_m is not None:
        gpu = configs.gpu_info()
        if config is None:
            config = configs.choose_config(m, e, top_k, k, n, bits, gs, block_m, act_order=act_order, pair_a=pair_a,
                                           gpu=gpu, one_pair=sorted_ids is None)
        else:
            _check_config(config, block_m, act_order, pair_a, gpu.hopper, sorted_ids is None)
        n_tiles, split, cps = _geometry(config, k, n)
        need = _scratch(config, k, n, capacity)
        partials = tickets = None
        if need[0] and workspace is not None:
            partials, tickets = workspace.partials, workspace.tickets
            if partials.size < need[0] or tickets.size < need[1]:
                _fail("workspace", f"at least {need[0]} partials and {need[1]} tickets "
                      "(SplitKWorkspace.size(config, ...))", f"{partials.size} and {tickets.size}")
            check_current_device("workspace", partials)
    # ---- allocate
    if out is None:
        out = cp.zeros((p, n), a.dtype)
    if block_m is None or p == 0 or n == 0:
        return out
    if need[0] and workspace is None:
        partials, tickets = _workspace(cp, *need)
    name = config.name_expression(bf16, bits, act_order, group_len, gpu.hopper, k, pair_a)
    smem = config.smem_bytes(bits, gpu.hopper)
    # ---- launch
    kern = _compile.get_kernel(config.source_file, name, gpu.arch)
    smem_key = (name, cp.cuda.Device().id)
    allowed = _SMEM_SET.get(smem_key)
    if smem and (allowed is None or allowed[0] is not kern or allowed[1] < smem):  # opt in above 48 KiB once
        kern.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[smem_key] = (kern, smem)
    i32 = np.int32
    null = np.uintp(0)  # a null pointer argument
    opt = lambda x: null if x is None else x
    _compile.launch(kern, (blocks.size, n_tiles, split), (config.threads,),
                    (a, qweight, scales, opt(qzeros), opt(g_idx), opt(topk_weights), opt(sorted_ids), blocks, opt(post),
                     out, opt(partials), opt(tickets), i32(k), i32(n), i32(group_len), i32(num_groups), i32(top_k),
                     i32(p), i32(capacity), i32(split), i32(cps), i32(e))
                    + ((i32(configs.COLUMN_BAND),) if config.kind != "reg" else ()), smem,
                    cluster_z=_cluster_size(config, split))
    return out

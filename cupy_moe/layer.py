"""A whole MoE layer: routing, the two fused GEMM phases, SiLU(gate) * up, and the sum over the top-k.

Legend: M tokens, H hidden size, I expert intermediate size, E experts, A top-k, P = M * A pairs.

NumPy inputs run `cupy_moe.reference`; CuPy inputs run the kernels:

    router logits [M, E] --select_experts--> topk_weights [M, A] fp32, topk_ids [M, A] int32   one launch
                         (DeepSeek's scoring, bias and groups: route_experts, one launch)
    topk_ids --moe_align_block_size--> sorted_token_ids, expert_ids, num_tokens_post_padded (device only;
                                       skipped where the plan gives each pair a block of its own: M = 1, and
                                       a few tokens of small experts (configs.one_pair_blocks);
                                       done again for the down phase when it picks another block size)
    hidden [M, H] --fused_moe_gemm(w13, top_k=A)--> x1 [P, 2I]        one launch
    x1 --silu_and_mul--> act [P, I]                                   one launch (4-bit w2, 16-row blocks: pair order)
    act --fused_moe_gemm(w2, top_k=1, topk_weights)--> x2 [P, H]      one launch, routing weights fused
    x2 --moe_sum--> out [M, H]                                        one launch (A = 1: none, the GEMM writes out)

MoELayer runs its shared experts through the same launches (one expert, A = 1) on a side stream of the caller's
stream, concurrently with the routing and the routed experts, and adds them with add_shared (one launch).
Nothing on the GPU path reads device memory on the host, so a forward can be captured in a CUDA graph
(`MoELayer.capture`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _compile, configs, reference
from ._xp import ACTIVATION_DTYPES, check_current_device, check_input, cupy, is_device_array, require_gpu
from .align import moe_align_block_size
from .gemm import SplitKWorkspace, fused_moe_gemm, take_stream_workspace
from .weights import StackedGptqWeight

__all__ = ["select_experts", "route_experts", "fused_moe", "plan_moe", "MoEPlan", "MoELayer", "CapturedForward",
           "capture", "load_moe_layer", "load_moe_model"]

_FILE = "moe_layer.cu"
_THREADS = 256  # every kernel of moe_layer.cu; router_logits fixes its sums to these 8 warps
_MAX_GRID = 132 * 16  # grid-stride loops: enough CTAs to fill an H100/H200 several times over
_CTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "float"}  # element types of kernels/moe_layer.cu
# router_logits' CTA tiles (experts, tokens): one token; a few tokens, each router row read once per 4 tokens; and
# once the activations outgrow what L2 keeps (_ROUTER_L2_BYTES), 4 experts per CTA so that each token row is read
# half as often (H100, same run: DeepSeek-V3 M = 4096 1426 against 2485 us; Qwen3-30B-A3B M = 4096, 16 MiB of
# activations, 213 against 293 us the other way)
_ROUTER_TILES = ((2, 1), (2, 4), (4, 4))
_ROUTER_L2_BYTES = 32 << 20
# Every instance the launchers below can ask for (the NVRTC compile test builds each one).
KERNEL_NAMES = (["route_experts"] + [f"select_experts<{t}>" for t in ("float", "f16", "bf16")]
                + [f"silu_and_mul<{t}>" for t in ("f16", "bf16")]
                + [f"moe_sum<{t}, {i}>" for t in ("f16", "bf16") for i in ("int", "long long")]
                + [f"add_shared<{t}>" for t in ("f16", "bf16")]
                + [f"router_logits<{x}, {w}, {ec}, {tm}>" for x in ("f16", "bf16") for w in ("f16", "float")
                   for ec, tm in _ROUTER_TILES])


def _ctype(name, dtype, allowed=("float16", "bfloat16")):
    key = np.dtype(dtype).name
    if key not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {np.dtype(dtype).name}")
    return _CTYPES[key]


def _check_matrix(name, x, letters, rows=None, cols=None):
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array {letters}, got shape {tuple(x.shape)}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows ({letters[1]}), got shape {tuple(x.shape)}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name}: expected {cols} columns, got shape {tuple(x.shape)}")


def _grid(total):
    return (max(1, min(_MAX_GRID, -(-total // _THREADS))),)


def select_experts(router_logits, top_k, renormalize=False):
    """Softmax over experts, then the top-k (ties go to the lower expert index).

    router_logits: float16, bfloat16 or float32 [M, E], E <= 1024. top_k: A, 1 <= A <= min(E, 32).
    renormalize: divide the A weights of each token by their sum.
    Returns topk_weights float32 [M, A] and topk_ids int32 [M, A], on the device for CuPy input.
    """
    check_input("router_logits", router_logits, ("float16", "bfloat16", "float32"), "[M, E]")
    _check_matrix("router_logits", router_logits, "[M, E]")
    # the kernel's limits, on both paths (a NumPy script moves over unchanged)
    _check_routing_args(router_logits, top_k, renormalize)
    if not is_device_array(router_logits):
        return reference.select_experts(router_logits, top_k, renormalize)
    ctype = _ctype("router_logits", router_logits.dtype, ("float16", "bfloat16", "float32"))
    return _launch_per_token(f"select_experts<{ctype}>", router_logits, top_k, (np.int32(bool(renormalize)),))


def _check_routing_args(router_logits, top_k, renormalize):
    """The routing kernels' limits, checked on both paths: E <= 1024 (a warp's shared memory), A <= 32 (one slot
    per lane); and renormalize a bool (a string such as "no" would read as true)."""
    if not isinstance(renormalize, (bool, np.bool_)):
        raise TypeError(f"renormalize: expected True or False, got {renormalize!r}")
    e = router_logits.shape[1]
    if not 1 <= e <= 1024:
        raise ValueError(f"router_logits: expected 1 <= E <= 1024 experts, got E={e}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= min(e, 32):
        raise ValueError(f"top_k: expected an int in [1, min(E, 32)] = [1, {min(e, 32)}], got {top_k!r}")


def _launch_per_token(name, router_logits, top_k, extra):
    """topk_weights float32 [M, A] and topk_ids int32 [M, A] from a routing kernel of kernels/moe_layer.cu: one
    warp per token, E floats of shared memory per warp, arguments (logits, weights, ids, M, E, A, *extra)."""
    cp = require_gpu(f"{name.split('<')[0]} on CuPy arrays")
    m, e = router_logits.shape
    weights = cp.empty((m, top_k), cp.float32)
    ids = cp.empty((m, top_k), cp.int32)
    if m:
        warps = _THREADS // 32
        _compile.launch(_compile.get_kernel(_FILE, name), (-(-m // warps),), (_THREADS,),
                        (cp.ascontiguousarray(router_logits), weights, ids, np.int32(m), np.int32(e),
                         np.int32(top_k), *extra), warps * e * 4)
    return weights, ids


def _linear_f32(x, w):
    """x [M, H] @ w[E, H].T in float32 -> [M, E]. On the GPU one router_logits launch (capturable in a CUDA graph;
    a token's logits are the same bits whatever M)."""
    if not is_device_array(x):
        return x.astype(np.float32) @ w.astype(np.float32).T
    cp = require_gpu("router logits")
    if w.dtype not in (np.float16, np.float32):
        w = w.astype(np.float32)
    x, w = cp.ascontiguousarray(x), cp.ascontiguousarray(w)
    m, h = x.shape
    e = w.shape[0]
    out = cp.empty((m, e), cp.float32)
    if m:
        one, few, many = _ROUTER_TILES
        ec, tm = one if m == 1 else many if x.nbytes > _ROUTER_L2_BYTES else few
        vec = h % 4 == 0 and x.data.ptr % 8 == 0 and w.data.ptr % (4 * w.itemsize) == 0
        name = (f"router_logits<{_ctype('hidden_states', x.dtype)}, {_CTYPES[np.dtype(w.dtype).name]}, "
                f"{ec}, {tm}>")
        _compile.launch(_compile.get_kernel(_FILE, name), (-(-m // tm), -(-e // ec)), (_THREADS,),
                        (x, w, out, np.int32(m), np.int32(e), np.int32(h), np.int32(vec)))
    return out


_GROUP_MODES = {"group_limited_greedy": 1, "noaux_tc": 2}  # route_experts' group score: best, sum of the two best


def _route_numpy(logits, top_k, scoring_func, bias, group_mode, n_group, topk_group, renormalize, scaling):
    """route_experts on the host: the definition the route_experts kernel mirrors (float32 throughout)."""
    m, e = logits.shape
    if scoring_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    choice = scores if bias is None else scores + bias

    def take_top(values, k):  # [M, X] -> indices [M, k] by repeated argmax (ties to the lower index), and values
        picked = []           # with those entries masked to -inf
        for _ in range(k):
            idx = values.argmax(axis=1)
            picked.append(idx)
            values = np.where(np.arange(values.shape[1])[None, :] == idx[:, None], -np.inf, values)
        return np.stack(picked, axis=1), values

    if group_mode:
        per_group = choice.reshape(m, n_group, e // n_group)                # [M, groups, E/groups]
        group_score = per_group.max(axis=2)                                 # mode 1 (V2): its best expert
        if group_mode == 2:                                                 # V3: the sum of its two best
            _, rest = take_top(per_group.reshape(m * n_group, e // n_group), 1)
            group_score = group_score + rest.reshape(m, n_group, e // n_group).max(axis=2)
        kept, _ = take_top(group_score, topk_group)                         # [M, topk_group]
        keep = (np.arange(n_group)[None, :, None] == kept[:, None, :]).any(axis=2)  # [M, groups]
        # Experts of the other groups score 0, as in transformers' and DeepSeek's own routers.
        choice = np.where(keep[:, :, None], per_group, np.float32(0)).reshape(m, e)
    ids, _ = take_top(choice, top_k)
    ids = ids.astype(np.int32)
    weights = np.take_along_axis(scores, ids, axis=1).astype(np.float32)
    if renormalize:
        weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
    if scaling != 1.0:
        weights = weights * np.float32(scaling)
    return weights, ids


def route_experts(router_logits, top_k, *, scoring_func="softmax", e_score_correction_bias=None,
                  topk_method="greedy", n_group=None, topk_group=None, renormalize=False,
                  routed_scaling_factor=1.0):
    """The routing of DeepSeek's config.json keys (and the plain softmax top-k with them at their defaults).

    router_logits: float32 [M, E], E <= 1024. top_k: A, 1 <= A <= min(E, 32).
    scoring_func: "softmax" or "sigmoid" scores. e_score_correction_bias: float32 [E] or None, added to the scores
    to choose experts (the weights stay the scores). topk_method: "greedy" (or None), or with n_group > 1 groups of
    E / n_group experts "group_limited_greedy" (a group scores its best expert) or "noaux_tc" (the sum of its two
    best): only the topk_group best groups' experts can be chosen, so A <= topk_group * E / n_group. Ties go to the
    lower index, for groups and experts. renormalize: weights / (their sum + 1e-20); then times
    routed_scaling_factor (positive and finite).
    Returns topk_weights float32 [M, A] and topk_ids int32 [M, A]: one kernel launch on the GPU. The kernel's
    limits (E, A, n_group <= 32) hold on both paths.
    """
    check_input("router_logits", router_logits, ("float32",), "[M, E]")
    _check_matrix("router_logits", router_logits, "[M, E]")
    m, e = router_logits.shape
    device = is_device_array(router_logits)
    _check_routing_args(router_logits, top_k, renormalize)  # the kernel's limits, on both paths
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    if topk_method not in (None, "greedy", *_GROUP_MODES):
        raise ValueError(f"topk_method: expected 'greedy', 'group_limited_greedy' or 'noaux_tc', got {topk_method!r}")
    if n_group is not None and (isinstance(n_group, bool) or not isinstance(n_group, (int, np.integer))
                                or n_group < 1):
        raise ValueError(f"n_group: expected None or a positive int, got {n_group!r}")
    rsf = routed_scaling_factor
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float, np.integer, np.floating)) or not 0 < rsf < np.inf:
        raise ValueError(f"routed_scaling_factor: expected a positive finite number, got {rsf!r}")
    groups = n_group or 1
    group_mode = _GROUP_MODES.get(topk_method, 0) if groups > 1 else 0
    if group_mode:
        if e % groups or groups > 32:
            raise ValueError(f"n_group: expected a divisor of E = {e} of at most 32, got {n_group!r}")
        if group_mode == 2 and e // groups < 2:
            raise ValueError(f"n_group: expected groups of at least 2 experts with topk_method 'noaux_tc' (a group "
                             f"scores its two best), got E = {e}, n_group = {groups}")
        if isinstance(topk_group, bool) or not isinstance(topk_group, (int, np.integer)) or not (
                1 <= topk_group <= groups):
            raise ValueError(f"topk_group: expected an int in [1, n_group = {groups}], got {topk_group!r}")
        if top_k > topk_group * (e // groups):
            raise ValueError(f"top_k: expected at most topk_group * E / n_group = {topk_group * (e // groups)} (the "
                             f"experts of the kept groups), got {top_k}")
    bias = e_score_correction_bias
    if bias is not None:
        check_input("e_score_correction_bias", bias, ("float32",), "[E]", ndim=(1,))
        if bias.shape != (e,) or is_device_array(bias) != device:
            raise ValueError(f"e_score_correction_bias: expected float32 [E] = [{e}] where router_logits is, got "
                             f"{type(bias).__name__} {bias.shape}")
    if not device:
        return _route_numpy(router_logits, int(top_k), scoring_func, bias, group_mode, groups, topk_group,
                            renormalize, routed_scaling_factor)
    return _launch_per_token("route_experts", router_logits, top_k, (
        np.uintp(0) if bias is None else bias.ravel(), np.int32(scoring_func == "sigmoid"), np.int32(group_mode),
        np.int32(groups), np.int32(topk_group or 1), np.int32(bool(renormalize)), np.float32(routed_scaling_factor)))


def _check_weights(w13, w2):
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, StackedGptqWeight):
            raise TypeError(f"{name}: expected a StackedGptqWeight, got {type(w).__name__}")
    if w13.n != 2 * w2.k:
        raise ValueError(f"w13: expected N = 2I = {2 * w2.k} (twice w2's K), got N={w13.n}")
    if w2.n != w13.k:
        raise ValueError(f"w2: expected N = H = {w13.k}, got N={w2.n}")
    if w2.num_experts != w13.num_experts:
        raise ValueError(f"w2: expected E = {w13.num_experts} experts (as w13), got E={w2.num_experts}")
    if w13.is_device != w2.is_device:
        raise TypeError(f"w2: expected {'CuPy' if w13.is_device else 'NumPy'} arrays, as w13")


def _check_layer_args(hidden_states, w13, w2, topk_weights, topk_ids, out):
    _check_weights(w13, w2)
    check_input("hidden_states", hidden_states, ACTIVATION_DTYPES, "[M, H]")
    check_input("topk_ids", topk_ids, ("int32", "int64"), "[M, A]")
    check_input("topk_weights", topk_weights, ("float32",), "[M, A]")
    device = is_device_array(hidden_states)
    for name, x in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13.qweight), ("w2", w2.qweight)):
        if is_device_array(x) != device:
            raise TypeError(f"{name}: expected {'CuPy' if device else 'NumPy'} arrays, as hidden_states, got "
                            f"{'CuPy' if is_device_array(x) else 'NumPy'} ones")
    m, h = hidden_states.shape
    if w13.k != h:
        raise ValueError(f"w13: expected K = H = {h} (hidden_states' columns), got K={w13.k}")
    _check_matrix("topk_ids", topk_ids, "[M, A]", rows=m)
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: expected A >= 1 columns (experts per token), got shape {tuple(topk_ids.shape)}")
    _check_matrix("topk_weights", topk_weights, "[M, A]", rows=m, cols=topk_ids.shape[1])
    if out is not None and not ((is_device_array(out) if device else isinstance(out, np.ndarray))
                                and out.shape == (m, h) and out.dtype == hidden_states.dtype
                                and out.flags.c_contiguous):
        raise ValueError(f"out: expected a C-contiguous {'CuPy' if device else 'NumPy'} array [M, H] = [{m}, {h}] of "
                         f"{hidden_states.dtype}, got {type(out).__name__} {getattr(out, 'shape', None)} "
                         f"{getattr(out, 'dtype', None)}")


def _problem(m, a, w13, w2):
    """What a layer plan depends on: M, A, H, I, E and each weight's bits, group size and act-order."""
    return (m, a, w13.k, w2.k, w13.num_experts,
            w13.bits, w13.group_size, w13.g_idx is not None, w2.bits, w2.group_size, w2.g_idx is not None)


@dataclass(frozen=True)
class MoEPlan:
    """What `fused_moe` launches for one problem (M tokens, top-k A, one pair of weights): the configuration of
    each GEMM phase, whether the down phase reads pair-ordered activations, whether each pair gets a 16-row block
    of its own (`one_pair`: no align launch; the GEMMs take topk_ids as the pairs' expert ids), and the split-K
    workspace of both phases (None for host weights), allocated when the plan is made. Made by `plan_moe`; with it,
    a `fused_moe` call chooses nothing and allocates only its output and intermediates."""
    problem: tuple  # _problem(...): (M, A, H, I, E, w13 bits, G, act-order, w2 bits, G, act-order)
    up: configs.GemmConfig
    down: configs.GemmConfig
    pair_order: bool
    one_pair: bool
    workspace: SplitKWorkspace | None = field(default=None, compare=False, repr=False)


def _choose(m, a, w13, w2, gpu, allocate, overlapped=False):
    """The one place where fused_moe's configurations are chosen (`plan_moe`, fused_moe without a plan, and
    MoELayer's shared experts). overlapped: the launches run beside other work (the shared experts' side stream),
    where the align launch is off the critical path (MoELayer at M = 4 took 1.04-1.07x the time with one block per
    token there), so one pair per block only at M = 1."""
    e, h, i = w13.num_experts, w13.k, w2.k
    one_pair = m == 1 if overlapped else configs.one_pair_blocks(m, a, (w13.nbytes + w2.nbytes) / e)
    up = configs.choose_config(m, e, a, h, 2 * i, w13.bits, w13.group_size, act_order=w13.g_idx is not None,
                               gpu=gpu, one_pair=one_pair)
    down = configs.choose_config(m * a, e, 1, i, h, w2.bits, w2.group_size, act_order=w2.g_idx is not None,
                                 gpu=gpu, one_pair=one_pair)
    # act in the 4-bit dequantizer's pair order on 16-row blocks (gemm.py); their shapes all read it
    pair = configs.down_pair_order(w2.bits, down.block_m)
    workspace = None
    if allocate and w13.is_device:
        workspace = SplitKWorkspace.for_launches([SplitKWorkspace.size(up, h, 2 * i, m * a, e, one_pair=one_pair),
                                                  SplitKWorkspace.size(down, i, h, m * a, e, one_pair=one_pair)])
    return MoEPlan(_problem(m, a, w13, w2), up, down, pair, one_pair, workspace)


def plan_moe(num_tokens, w13, w2, top_k, *, gpu=None) -> MoEPlan:
    """The plan of `fused_moe` for num_tokens tokens of top_k experts each on these weights: both phases'
    configurations and, for device weights, their split-K workspace on the current device, allocated here.
    Pass it as `fused_moe(..., plan=)` to calls of that shape (one stream at a time). gpu: the target
    (`configs.GpuInfo`); None = the current device."""
    _check_weights(w13, w2)
    for name, value, high in (("num_tokens", num_tokens, None), ("top_k", top_k, w13.num_experts)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1 or (high is not None and value > high):
            raise ValueError(f"{name}: expected an int in [1, {high or 'inf'}], got {value}")
    if gpu is None:
        gpu = configs.gpu_info()
    return _choose(int(num_tokens), int(top_k), w13, w2, gpu, allocate=True)


def _check_plan(plan, m, a, w13, w2):
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"plan: expected a MoEPlan (plan_moe(...)) or None, got {type(plan).__name__}")
    want = _problem(m, a, w13, w2)
    if plan.problem != want:
        raise ValueError(f"plan: expected a plan of (M, A, H, I, E, w13 bits, G, act-order, w2 bits, G, act-order) = "
                         f"{want} (plan_moe for these inputs), got one of {plan.problem}")


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, *, out=None, plan=None):
    """The routed experts of one MoE layer: sum over a token's A experts of weight * down(SiLU(gate) * up).

    hidden_states: float16 or bfloat16 [M, H]. w13: StackedGptqWeight [E, H*bits/32, 2I] (gate columns, then
    up). w2: StackedGptqWeight [E, I*bits/32, H]. topk_weights: float32 [M, A]. topk_ids: int32/int64 [M, A] in
    [0, E): not checked on the GPU (that needs a host synchronization), where a slot with an id outside adds
    nothing to its token's row; the NumPy path raises.
    out: [M, H] of hidden_states' dtype to write into, or None.
    Returns [M, H] in hidden_states' dtype. Roundings as `cupy_moe.reference.fused_moe`: x1, act, x2 and the
    output are each rounded once to the dtype; everything between is float32 on the GPU (float64 inside the
    reference's GEMMs).
    NumPy inputs run the reference. On the GPU the intermediates come from CuPy's memory pool; to replay the
    call in a CUDA graph, capture it with `cupy_moe.layer.capture(fused_moe, ...)` (or `MoELayer.capture`),
    which gives the graph a private pool.
    plan: `plan_moe(M, w13, w2, A)`, made once for calls of this shape: the call then chooses no configuration
    and uses the plan's split-K workspace. None: chosen here, with a split-K workspace cached per stream.
    """
    _check_layer_args(hidden_states, w13, w2, topk_weights, topk_ids, out)
    if plan is not None:
        _check_plan(plan, hidden_states.shape[0], topk_ids.shape[1], w13, w2)
    if not is_device_array(hidden_states):
        result = reference.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)
        if out is not None:
            out[...] = result
            return out
        return result
    cp = require_gpu("fused_moe on CuPy arrays")
    m, h = hidden_states.shape
    dtype = hidden_states.dtype
    if out is None:
        out = cp.empty((m, h), dtype)
    return out if m == 0 else _launch_experts(hidden_states, w13, w2, topk_weights, topk_ids, out, plan)


def _launch_experts(hidden_states, w13, w2, topk_weights, topk_ids, out, plan, ids_in_range=False):
    """fused_moe's launches on checked device inputs, M > 0; plan None: chosen here. topk_weights None: every slot's
    weight is 1 (nothing multiplied: the same bits). ids_in_range: every id is in [0, E), so that a one-slot call
    needs no zero fill of `out` (the shared experts' ids are all 0)."""
    ctype = _ctype("hidden_states", hidden_states.dtype)
    m, h = hidden_states.shape
    a = topk_ids.shape[1]
    p, i, e = m * a, w2.k, w13.num_experts
    dtype = hidden_states.dtype
    # One configuration per phase, chosen once and passed down: what the plan says is what launches.
    if plan is None:
        plan = _choose(m, a, w13, w2, configs.gpu_info(), allocate=False)
    if plan.one_pair:  # the GEMMs take topk_ids as the pairs' expert ids
        aligned = None, cupy.ascontiguousarray(topk_ids, dtype=cupy.int32), None
    else:
        aligned = moe_align_block_size(topk_ids, plan.up.block_m, e)
    # Every pair is in the list, so every row of x1 and x2 is written: no zero fill needed.
    x1 = fused_moe_gemm(hidden_states, w13, *aligned, a, out=cupy.empty((p, 2 * i), dtype), config=plan.up,
                        workspace=plan.workspace)
    if plan.down.block_m != plan.up.block_m:  # another block size: a second align launch (pair ids are shared)
        aligned = moe_align_block_size(topk_ids, plan.down.block_m, e)
    act = cupy.empty((p, i), dtype)
    _compile.launch(_compile.get_kernel(_FILE, f"silu_and_mul<{ctype}>"), _grid(p * i // 8), (_THREADS,),
                    (x1, act, np.int64(p), np.int32(i), np.int32(plan.pair_order)))
    vec = out.data.ptr % 16 == 0  # H is a multiple of 32 and x2 is ours: only a caller's `out` can be unaligned
    if a == 1 and vec:  # one slot per token (shared experts): the down GEMM writes the sum's values into out
        if not ids_in_range:
            out.data.memset_async(0, out.nbytes)  # a token whose id is outside [0, E) gets zeros, as from the sum
        return fused_moe_gemm(act, w2, *aligned, 1, topk_weights=topk_weights, out=out,
                              a_pair_order=plan.pair_order, config=plan.down, workspace=plan.workspace)
    x2 = fused_moe_gemm(act, w2, *aligned, 1, topk_weights=topk_weights, out=cupy.empty((p, h), dtype),
                        a_pair_order=plan.pair_order, config=plan.down, workspace=plan.workspace)
    ids = cupy.ascontiguousarray(topk_ids)  # the sum skips ids outside [0, E), as the GEMMs did
    itype = "int" if ids.dtype == np.int32 else "long long"
    _compile.launch(_compile.get_kernel(_FILE, f"moe_sum<{ctype}, {itype}>"), _grid(m * h // (8 if vec else 1)),
                    (_THREADS,), (x2, ids, out, np.int64(m), np.int32(a), np.int32(h), np.int32(e), np.int32(vec)))
    return out


def _add_shared(routed, shared, gate):
    """routed + shared / (1 + exp(-gate)) (gate None: + shared) in float32, rounded once to routed's dtype: the
    NumPy lines of MoELayer.__call__ in one launch. routed, shared [M, H], H a multiple of 8, as the experts'
    paths return them (contiguous, aligned); gate float32 [M, 1] or None."""
    out = cupy.empty_like(routed)
    m, h = routed.shape
    if m:
        _compile.launch(_compile.get_kernel(_FILE, f"add_shared<{_ctype('hidden_states', routed.dtype)}>"),
                        _grid(m * h // 8), (_THREADS,),
                        (routed, shared, np.uintp(0) if gate is None else gate, out, np.int64(m), np.int32(h)))
    return out


def _xp_of(x):
    return cupy if is_device_array(x) else np


def _fused_takes(w13, w2, b13, b2):
    """Whether `fused_moe` runs these experts: GPTQ weights, no biases (else `_experts_general`)."""
    return isinstance(w13, StackedGptqWeight) and isinstance(w2, StackedGptqWeight) and b13 is None and b2 is None


def _experts(x, w13, w2, b13, b2, weights, ids):
    """Routed or shared experts: `fused_moe` where it takes the weights, else `_experts_general`."""
    if _fused_takes(w13, w2, b13, b2):
        return fused_moe(x, w13, w2, weights, ids)
    return _experts_general(x, w13, w2, b13, b2, weights, ids)


# (device, stream) -> the side stream that MoELayer runs the shared experts of calls on that stream on. A side stream
# per stream: memory a side stream frees goes back to the pool for that side stream only, and its next work waits
# for the stream's later work, so nothing it allocates is reused while the stream may still read it.
_SIDE_STREAMS: dict = {}


def _side_stream():
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    side = _SIDE_STREAMS.get(key)
    if side is None:
        side = _SIDE_STREAMS[key] = cupy.cuda.Stream(non_blocking=True)
    return side


def take_stream_scratch(stream):
    """Remove what calls on `stream` cached for it (on the current device) from the caches and return it: the
    split-K workspace of its GEMMs, and its side stream with that stream's workspace. A CUDA graph captured on the
    stream holds it, so that its memory lives as long as the graph and no later call uses it under the graph."""
    side = _SIDE_STREAMS.pop((cupy.cuda.Device().id, stream.ptr), None)
    return take_stream_workspace(stream), side, None if side is None else take_stream_workspace(side)


def _experts_general(x, w13, w2, b13, b2, weights, ids):
    """The routed experts for what `fused_moe` does not take: dense experts or non-zero expert biases.

    x [M, H]; w13 StackedGptqWeight or dense [E, H, 2I]; w2 likewise [E, I, H]; b13 [E, 2I] / b2 [E, H] float32
    or None; weights float32 [M, A]; ids [M, A]. Biases are added after each GEMM's rounding; a down bias is
    scaled by the routing weight like the rest of that expert's output. Dense experts loop over E on the host.
    """
    xp = _xp_of(x)
    dtype = x.dtype
    m, a = ids.shape
    if m == 0:
        return xp.zeros((0, x.shape[1]), dtype)
    e_p = ids.reshape(-1)                                  # [P] expert of each pair
    w_p = weights.reshape(-1).astype(np.float32)           # [P]

    def phase(rows, w, top_k):                             # rows [M', K] -> [P, N] float32
        if isinstance(w, StackedGptqWeight):
            block_m = configs.SUPPORTED_BLOCK_M[0]
            aligned = moe_align_block_size(ids, block_m, w.num_experts)
            return fused_moe_gemm(rows, w, *aligned, top_k).astype(np.float32)
        per_pair = rows[xp.arange(m * a) // top_k].astype(np.float32)  # [P, K]
        y = xp.zeros((m * a, w.shape[2]), np.float32)
        for e in range(w.shape[0]):
            sel = xp.nonzero(e_p == e)[0]
            if sel.size:
                y[sel] = per_pair[sel] @ w[e].astype(np.float32)
        return y

    x1 = phase(x, w13, a)
    if b13 is not None:
        x1 += b13[e_p]
    x1 = x1.astype(dtype).astype(np.float32)
    i = x1.shape[1] // 2
    gate, up = x1[:, :i], x1[:, i:]
    act = (gate / (1.0 + xp.exp(-gate)) * up).astype(dtype)
    x2 = phase(act, w2, 1)
    if b2 is not None:
        x2 += b2[e_p]
    x2 = (x2 * w_p[:, None]).astype(dtype).astype(np.float32)
    return x2.reshape(m, a, -1).sum(axis=1).astype(dtype)


class MoELayer:
    """One MoE layer, callable on hidden states: routing, routed experts, shared experts.

    weights: a `cupy_moe.checkpoint.MoELayerWeights` (what `load_layer_weights` returns). CuPy weights run on the
    GPU, NumPy weights through the reference; hidden states must live where the weights do.

        layer = cupy_moe.MoELayer.from_checkpoint("ckpt/", layer=0)
        y = layer(x)          # x: cupy float16/bfloat16 [M, H] -> y [M, H]

    Routing (`route`): logits = x @ router.T (+ bias) in float32; softmax or sigmoid scores; DeepSeek's
    group-limited selection and score-correction bias when the config asks for them; top-k with ties to the
    lower expert; optional renormalization; times `routed_scaling_factor`. Shared experts (Qwen2-MoE, DeepSeek)
    run as one always-selected expert and are added, Qwen2-MoE's scaled by sigmoid(x @ shared_gate.T).
    """

    def __init__(self, weights):
        from .checkpoint import MoELayerWeights
        if not isinstance(weights, MoELayerWeights):
            raise TypeError(f"weights: expected a cupy_moe.checkpoint.MoELayerWeights (load_layer_weights, or "
                            f"MoELayer.from_checkpoint), got {type(weights).__name__}")
        self.weights = weights

    @classmethod
    def from_checkpoint(cls, path, layer, *, device=True, scheme=None):
        """Load layer `layer` of the checkpoint folder `path` (see `cupy_moe.load_moe_layer`)."""
        from .checkpoint import load_layer_weights
        return cls(load_layer_weights(path, layer, device=device, scheme=scheme))

    def _check_input(self, x):
        w = self.weights
        if is_device_array(x) != is_device_array(w.router_weight):
            where = "CuPy" if is_device_array(w.router_weight) else "NumPy"
            raise TypeError(f"hidden_states: expected a {where} array (where the layer's weights are), "
                            f"got {type(x).__name__}")
        check_current_device("the layer's weights", w.router_weight)
        check_input("hidden_states", x, ACTIVATION_DTYPES, "[M, H]")
        _check_matrix("hidden_states", x, "[M, H]", cols=w.hidden_size)

    def route(self, hidden_states):
        """topk_weights float32 [M, A] and topk_ids int32 [M, A] for hidden_states [M, H]."""
        self._check_input(hidden_states)
        return self._route(hidden_states)

    def _route(self, hidden_states):
        w = self.weights
        logits = _linear_f32(hidden_states, w.router_weight)  # [M, E] float32
        if w.router_bias is not None:
            logits += w.router_bias
        grouped = w.topk_method in _GROUP_MODES and (w.n_group or 1) > 1
        if w.scoring_func == "softmax" and w.e_score_correction_bias is None and not grouped:
            weights, ids = select_experts(logits, w.top_k, w.renormalize)
            if w.routed_scaling_factor != 1.0:
                weights = weights * np.float32(w.routed_scaling_factor)
            return weights, ids
        return route_experts(logits, w.top_k, scoring_func=w.scoring_func,
                             e_score_correction_bias=w.e_score_correction_bias, topk_method=w.topk_method,
                             n_group=w.n_group, topk_group=w.topk_group, renormalize=w.renormalize,
                             routed_scaling_factor=w.routed_scaling_factor)

    def __call__(self, hidden_states):
        """The layer's output [M, H] in hidden_states' dtype (float16 or bfloat16 on the GPU)."""
        self._check_input(hidden_states)
        w = self.weights
        started = None if w.shared is None else self._shared_experts(hidden_states)
        weights, ids = self._route(hidden_states)
        out = _experts(hidden_states, w.w13, w.w2, w.w13_bias, w.w2_bias, weights, ids)
        if started is None:
            return out
        shared, gate, done = started
        if done is not None:
            cupy.cuda.get_current_stream().wait_event(done)
        if is_device_array(out) and out.shape[1] % 8 == 0:  # add_shared takes 8 columns at a time (dense: any H)
            return _add_shared(out, shared, gate)
        xp = _xp_of(out)
        shared = shared.astype(np.float32)
        if gate is not None:
            shared = shared / (1.0 + xp.exp(-gate))
        return (out.astype(np.float32) + shared).astype(hidden_states.dtype)

    def _shared_experts(self, x):
        """(the shared experts' output [M, H], the sigmoid gate's logits float32 [M, 1] or None, an event or None).
        On the GPU they run on the side stream of the current one, as they need nothing of the routing: the two
        overlap, and the caller waits for the event before it reads them."""
        w = self.weights
        s = w.shared
        xp = _xp_of(x)

        def run():
            m, h = x.shape
            zeros = xp.zeros((m, 1), np.int32)  # the one expert's id
            if xp is np or not _fused_takes(s.gate_up, s.down, s.gate_up_bias, s.down_bias):
                shared = _experts(x, s.gate_up, s.down, s.gate_up_bias, s.down_bias, xp.ones((m, 1), np.float32),
                                  zeros)
            else:  # fused_moe's launches without a ones fill for the weights or a zero fill for the output
                shared = cupy.empty((m, h), x.dtype)
                if m:
                    plan = _choose(m, 1, s.gate_up, s.down, configs.gpu_info(), allocate=False, overlapped=True)
                    _launch_experts(x, s.gate_up, s.down, None, zeros, shared, plan, ids_in_range=True)
            return shared, None if w.shared_gate_weight is None else _linear_f32(x, w.shared_gate_weight)

        if xp is np:
            return (*run(), None)
        main, side = cupy.cuda.get_current_stream(), _side_stream()
        side.wait_event(main.record(cupy.cuda.Event(disable_timing=True)))
        with side:
            shared, gate = run()
            return shared, gate, side.record(cupy.cuda.Event(disable_timing=True))

    def capture(self, hidden_states):
        """Capture one forward on `hidden_states`' buffer into a CUDA graph (see `capture`)."""
        self._check_input(hidden_states)
        return capture(self, hidden_states)


def capture(fn, *args):
    """Capture `fn(*args)` (GPU work only, no host reads) into a CUDA graph.

    Runs fn once eagerly (compiling kernels, sizing cached workspaces), then captures a second call on a private
    stream with a private memory pool. The returned `CapturedForward` holds the pool and what the calls cached for
    that stream (`take_stream_scratch`), so that the graph's intermediates and scratch live as long as it does.
    Write new values into the same input arrays, then `replay()`; read `.out`.
    """
    cp = require_gpu("capturing a CUDA graph")
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with stream:
        fn(*args)
        stream.synchronize()
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                out = fn(*args)
            finally:
                graph = stream.end_capture()
    return CapturedForward(graph, stream, (pool, take_stream_scratch(stream)), args, out)


class CapturedForward:
    """A captured call: `replay()` reruns it on the current contents of its input arrays (`.args`)."""

    def __init__(self, graph, stream, memory, args, out):
        self.graph, self.stream, self._memory = graph, stream, memory  # memory: what the graph's pointers hold
        self.args, self.out = args, out

    def replay(self):
        """Launch the graph on its stream and return `out` (synchronize or use the stream before reading)."""
        self.graph.launch(stream=self.stream)
        return self.out


def load_moe_layer(path, layer, *, device=True, scheme=None) -> MoELayer:
    """A callable `MoELayer` for decoder layer `layer` of the checkpoint folder `path`.

    device: True puts the weights on the GPU (bits 4 and 8), False keeps them in NumPy (the reference path).
    scheme: a `cupy_moe.checkpoint.NamingScheme` for a family that is not detected automatically.
    The loaded arrays are in `.weights` (a `cupy_moe.checkpoint.MoELayerWeights`).
    """
    return MoELayer.from_checkpoint(path, layer, device=device, scheme=scheme)


def load_moe_model(path, *, device=True, progress=None, scheme=None, layers=None) -> dict:
    """{layer index: MoELayer} for every MoE layer of a checkpoint (dense layers skipped).

    progress: None shows a progress line on stderr when it is a terminal; True/False force it; a callable is
    called as progress(done, total, layer). layers: only these indices. Other arguments as `load_moe_layer`.
    """
    from .checkpoint import load_model_weights
    loaded = load_model_weights(path, device=device, progress=progress, scheme=scheme, layers=layers)
    return {index: MoELayer(weights) for index, weights in loaded.items()}

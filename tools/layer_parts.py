"""What each launch of a whole layer costs at small M: fused_moe's launches replayed in a CUDA graph (as
benchmarks/bench_layer.py times them) with parts left out. Timing only: the variants that leave something out do not
compute the layer.

    python tools/layer_parts.py MODELS [--m 1,8] [--rounds 2]      e.g. Qwen3-30B-A3B,DeepSeek-V2-Lite

Variants (fp16, 4-bit, G = 128, random weights, 8 routings in turn):
  full      fused_moe's launches (checked bitwise against fused_moe itself)
  no_silu   without the SiLU-and-mul launch
  no_sum    without the top-k sum launch
  hot_down  the down GEMM always on the experts of the first routing, whose down weights then stay in L2: the most
            that reading them from L2 instead of HBM could save
  pf_side   a kernel on a forked stream asks L2 for the down weights of the call's experts while gate/up runs
            (compute capability 9.0 and later: cp.async.bulk.prefetch)
  up_only   the gate/up GEMM alone
Each variant's best of --rounds rounds, in us.
"""
from __future__ import annotations

import argparse

import numpy as np

import cupy as cp
from cupy_moe import _compile
from cupy_moe.align import moe_align_block_size
from cupy_moe.gemm import fused_moe_gemm
from cupy_moe.layer import _FILE, _THREADS, _grid, fused_moe, plan_moe
from cupy_moe.models import get_model
from cupy_moe.timing import graph_time
from cupy_moe.weights import StackedGptqWeight

# One CTA per (pair, chunk): thread j < 3 asks L2 for chunk blockIdx.y of array j of the pair's expert.
PREFETCH_SRC = r"""
extern "C" __global__ void prefetch_experts(const int* ids, const char* qw, long long qw_b, const char* sc,
                                            long long sc_b, const char* qz, long long qz_b) {
  const char* base[3] = {qw, sc, qz};
  const long long bytes[3] = {qw_b, sc_b, qz_b};
  if (threadIdx.x >= 3 || base[threadIdx.x] == nullptr) return;
  const long long per = bytes[threadIdx.x], chunk = (per / gridDim.y + 15) / 16 * 16;
  const long long lo = chunk * blockIdx.y, hi = lo + chunk < per ? lo + chunk : per;
  if (lo < hi)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                 :: "l"(base[threadIdx.x] + ids[blockIdx.x] * per + lo), "r"(static_cast<unsigned>(hi - lo))
                 : "memory");
}
"""
PREFETCH_CHUNKS = 32


class Layer:
    """One model's random weights and fused_moe's launches for one plan, with parts switched off."""

    def __init__(self, model: str):
        shape = get_model(model)
        self.h, self.i, self.e, self.a = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
        self.w13 = StackedGptqWeight.random(self.e, self.h, 2 * self.i, seed=1)
        self.w2 = StackedGptqWeight.random(self.e, self.i, self.h, seed=2)
        self._prefetch = None
        self._side = cp.cuda.Stream(non_blocking=True)

    def align(self, plan, ids, block_m):
        """The pair list fused_moe gives a phase of block_m-row blocks (the ids themselves at one pair per block)."""
        if plan.one_pair:
            return None, cp.ascontiguousarray(ids, dtype=cp.int32), None
        return moe_align_block_size(ids, block_m, self.e)

    def _prefetch_down(self, ids):
        """Forks a stream that asks L2 for the down weights of `ids`' experts; returns the event to join."""
        if self._prefetch is None:
            self._prefetch = cp.RawModule(code=PREFETCH_SRC, options=(f"--gpu-architecture={_compile.device_arch()}",)
                                          ).get_function("prefetch_experts")
        flat = cp.ascontiguousarray(ids, dtype=cp.int32).ravel()  # made on this stream before the fork: the side
        fork = cp.cuda.Event(disable_timing=True)                   # stream reads it
        fork.record()
        self._side.wait_event(fork)
        w2 = self.w2
        arrays = (w2.qweight, w2.scales, w2.qzeros)
        args = (flat,) + sum(((x if x is not None else np.uintp(0), np.int64(0 if x is None else x.nbytes // self.e))
                              for x in arrays), ())
        with self._side:
            self._prefetch((flat.size, PREFETCH_CHUNKS), (32,), args)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self._side)
        return done

    def launch(self, x, tw, ids, plan, out, *, silu=True, msum=True, down=True, down_list=None, pf=False):
        """fused_moe's launches; down_list: the down phase's pair list, made beforehand (hot_down), else as fused_moe
        makes it."""
        m, p, dtype = x.shape[0], x.shape[0] * self.a, x.dtype
        joined = self._prefetch_down(ids) if pf else None
        up_list = self.align(plan, ids, plan.up.block_m)
        x1 = fused_moe_gemm(x, self.w13, *up_list, self.a,
                            out=cp.empty((p, 2 * self.i), dtype), config=plan.up, workspace=plan.workspace)
        act = cp.empty((p, self.i), dtype)
        if silu:
            _compile.launch(_compile.get_kernel(_FILE, "silu_and_mul<f16>"), _grid(p * self.i // 8), (_THREADS,),
                            (x1, act, np.int64(p), np.int32(self.i), np.int32(plan.pair_order)))
        if joined is not None:
            cp.cuda.get_current_stream().wait_event(joined)
        if not down:
            return out
        if down_list is None:  # as fused_moe: one align launch for both phases where they take the same block size
            down_list = up_list if plan.down.block_m == plan.up.block_m else self.align(plan, ids, plan.down.block_m)
        x2 = fused_moe_gemm(act, self.w2, *down_list, 1, topk_weights=tw, out=cp.empty((p, self.h), dtype),
                            a_pair_order=plan.pair_order, config=plan.down, workspace=plan.workspace)
        if msum:
            _compile.launch(_compile.get_kernel(_FILE, "moe_sum<f16, int>"), _grid(m * self.h // 8), (_THREADS,),
                            (x2, ids, out, np.int64(m), np.int32(self.a), np.int32(self.h), np.int32(self.e),
                             np.int32(1)))
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", help="comma-separated model names of cupy_moe.models")
    ap.add_argument("--m", default="1,8", help="token counts (default 1,8)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    side_prefetch = int(cp.cuda.Device().compute_capability) >= 90
    for model in args.models.split(","):
        layer = Layer(model)
        for m in (int(v) for v in args.m.split(",")):
            rng = np.random.default_rng(m)
            x = cp.asarray(rng.standard_normal((m, layer.h)).astype(np.float16))
            sets = [(cp.asarray(rng.dirichlet(np.ones(layer.a), size=m).astype(np.float32)),
                     cp.asarray(np.stack([rng.permutation(layer.e)[:layer.a] for _ in range(m)]).astype(np.int32)))
                    for _ in range(8)]
            plan = plan_moe(m, layer.w13, layer.w2, layer.a)
            out = cp.empty((m, layer.h), cp.float16)
            ref = fused_moe(x, layer.w13, layer.w2, *sets[0], plan=plan)
            if not bool((layer.launch(x, *sets[0], plan, cp.empty_like(out)) == ref).all()):
                raise SystemExit(f"layer_parts: {model} M={m}: the full variant differs from fused_moe")
            hot_list = layer.align(plan, sets[0][1], plan.down.block_m)  # hot_down's pairs: the first routing's
            cp.cuda.Device().synchronize()  # made on this stream, read on graph_time's
            variants = {"full": {}, "no_silu": dict(silu=False), "no_sum": dict(msum=False),
                        "hot_down": dict(down_list=hot_list), "pf_side": dict(pf=True),
                        "up_only": dict(silu=False, msum=False, down=False)}
            if not side_prefetch:
                del variants["pf_side"]
            times = {}
            for _ in range(args.rounds):
                for name, kw in variants.items():
                    calls = [lambda tw=tw, ids=ids, kw=kw: layer.launch(x, tw, ids, plan, out, **kw)
                             for tw, ids in sets]
                    times.setdefault(name, []).append(graph_time(calls, reps=20, warmup=3) * 1e6)
            print(f"{model:18s} M={m:<4d} up={plan.up.spec} down={plan.down.spec}")
            print("   " + "  ".join(f"{name} {min(t):.1f}" for name, t in times.items()), flush=True)
        layer = None  # its weights go back to the pool before the next model's
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()

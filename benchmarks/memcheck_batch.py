"""A small fuzz batch of GEMM cases, the multi-CTA align path and a layer forward, for compute-sanitizer."""
import sys, numpy as np
sys.path.insert(0, "tests")
import test_gpu_gemm as t
rng = np.random.default_rng(7)
for i in range(6):
    case = dict(e=int(rng.choice([1, 8, 60])), m=int(rng.choice([0, 1, 17, 70])), a=1, k=int(rng.choice([64, 256])),
                n=int(rng.choice([32, 96])), bits=int(rng.choice([4, 8])), group_size=int(rng.choice([32, 64, -1])),
                sym=bool(i % 2), act_order=bool(i % 3 == 0), dtype_name="float16", routed=bool(i % 2),
                kind="uniform", block_m=[16, 32, 64, 128][i % 4])
    case["a"] = int(min(case["e"], 1 + i % 3))
    t.run_case(rng, **case)
# the prefill kernel with an odd number of 32-k chunks (its last 64-k stage half zero-filled), 32-row blocks with a
# partial 256-column tile (on sm_90a the swapped-operand kernel) and split-K, and the 16-row decode instance compiled
# for 4 CTAs per SM (4-bit, one group per stage) with a partial column tile; the 16 x 32 shape with 4 warps along K,
# whose last warp has no chunks (K = 768: 3 slices of 8 chunks), and with split-K across CTAs on top (K = 4096)
common = dict(bits=4, sym=False, act_order=False, dtype_name="float16", routed=True, kind="uniform")
t.run_case(rng, e=3, m=90, a=2, k=96, n=96, group_size=32, block_m=128, **common)
t.run_case(rng, e=4, m=20, a=2, k=1120, n=160, group_size=32, block_m=32, **common)
t.run_case(rng, e=4, m=3, a=2, k=512, n=160, group_size=128, block_m=16, **common)
t.run_case(rng, e=4, m=1, a=2, k=768, n=96, group_size=128, block_m=16, **common)
t.run_case(rng, e=1, m=1, a=1, k=4096, n=96, group_size=128, block_m=16, **common)
import cupy as cp
from cupy_moe.align import moe_align_block_size
moe_align_block_size(cp.asarray(rng.integers(0, 64, size=(5000, 4)).astype(np.int32)), 16, 64)  # multi-CTA path
# activations in pair order (a_pair_order) on the decode and the tc kernel, a partial column tile
from cupy_moe import fused_moe_gemm
from cupy_moe.reference import to_pair_order
w = t.make_weight(rng, 3, 256, 96, 4, 128, False, False).to_device()
ids = cp.asarray(t.route(rng, 40, 3, 2, "uniform"))
x = to_pair_order(cp.asarray(rng.standard_normal((40, 256)).astype(np.float16)))
for bm in (16, 64):
    fused_moe_gemm(x, w, *moe_align_block_size(ids, bm, 3), 2, a_pair_order=True)
cp.cuda.Device().synchronize()
# A whole layer forward through the layer kernels (select_experts, silu_and_mul, moe_sum) too.
import tempfile
import cupy_moe
from cupy_moe.testing import write_checkpoint
with tempfile.TemporaryDirectory() as folder:
    write_checkpoint(folder, family="qwen2_moe", hidden=128, intermediate=192, num_experts=8, top_k=3,
                     return_weights=False)
    layer = cupy_moe.load_moe_layer(folder, 0)
    for m in (1, 7, 40):
        layer(cp.asarray(rng.standard_normal((m, 128)).astype(np.float16)))
cp.cuda.Device().synchronize()
print("fuzz batch ok")

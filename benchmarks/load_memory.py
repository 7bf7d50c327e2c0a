"""Peak host memory (RSS) while loading one MoE layer from a GPTQ checkpoint, against the layer's packed bytes.

    python benchmarks/load_memory.py                       # H=1024, I=2816, E=8, 4-bit, G=128, 3 shards
    python benchmarks/load_memory.py --model Mixtral-8x7B  # one layer of that shape (cupy_moe.models)

Writes a checkpoint with cupy_moe.testing.write_checkpoint, then measures each way of loading in a fresh
process: the peak RSS counter is reset (/proc/self/clear_refs, Linux) after imports, and the reported number is
peak RSS during the load minus RSS before it. "packed" = the bytes of the loaded layer (qweight + scales +
qzeros + g_idx of w13 and w2, router, shared experts). Ways measured:
  load_layer_weights cupy_moe.checkpoint.load_layer_weights(device=False): per tensor, into preallocated stacks
  device             load_layer_weights(device=True) (needs a GPU): host peak as above, plus the device bytes the
                     CuPy memory pool holds afterwards (live arrays and any freed temporaries) vs the layer's bytes
  from_experts       safe_open(framework="numpy").get_tensor per tensor into per-expert lists, then
                     StackedGptqWeight.from_experts + concat_n (the obvious way; for comparison)
  load_file          safetensors.numpy.load_file of every shard (reads the whole model; for comparison)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cupy_moe import _peak_rss
from cupy_moe.models import get_model
from cupy_moe.testing import write_checkpoint

_FROM_EXPERTS = r"""
import json, os
from safetensors import safe_open
from cupy_moe.weights import StackedGptqWeight, concat_n

def via_from_experts(folder, layer):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    q = json.load(open(os.path.join(folder, "quantize_config.json")))
    idx_path = os.path.join(folder, "model.safetensors.index.json")
    wmap = json.load(open(idx_path))["weight_map"] if os.path.exists(idx_path) else None
    def get(name):
        fname = wmap[name] if wmap else "model.safetensors"
        with safe_open(os.path.join(folder, fname), "numpy") as f:
            return f.get_tensor(name)
    pre = f"model.layers.{layer}.block_sparse_moe.experts"
    def stack(proj):
        E = cfg["num_local_experts"]
        return StackedGptqWeight.from_experts(
            [get(f"{pre}.{e}.{proj}.qweight") for e in range(E)], [get(f"{pre}.{e}.{proj}.scales") for e in range(E)],
            [get(f"{pre}.{e}.{proj}.qzeros") for e in range(E)], [get(f"{pre}.{e}.{proj}.g_idx") for e in range(E)],
            bits=q["bits"], group_size=q["group_size"], checkpoint_format=q["checkpoint_format"])
    w13 = concat_n(stack("w1"), stack("w3"))
    w2 = stack("w2")
    return w13.nbytes + w2.nbytes
"""

# mode -> (setup: imports, not measured; work: sets result_bytes and maybe device_bytes; args = folder, layer)
MODES = {
    "load_layer_weights": ("from cupy_moe.checkpoint import load_layer_weights",
                           "result_bytes = load_layer_weights(args[0], int(args[1]), device=False).nbytes"),
    "device": ("import cupy\nfrom cupy_moe.checkpoint import load_layer_weights\n"
               "pool = cupy.get_default_memory_pool()\n"
               "cupy.zeros(1)  # create the CUDA context before the counters start\n"
               "pool_before = pool.total_bytes()",
               "out = load_layer_weights(args[0], int(args[1]), device=True)\n"
               "cupy.cuda.Device().synchronize()\n"
               "result_bytes, device_bytes = out.nbytes, pool.total_bytes() - pool_before"),
    "from_experts": (_FROM_EXPERTS, "result_bytes = via_from_experts(args[0], int(args[1]))"),
    "load_file": ("import os\nfrom safetensors.numpy import load_file",
                  "files = sorted(f for f in os.listdir(args[0]) if f.endswith('.safetensors'))\n"
                  "tensors = [load_file(os.path.join(args[0], f)) for f in files]\n"
                  "result_bytes = sum(a.nbytes for t in tensors for a in t.values())"),
}


def measure(folder, mode: str, layer: int = 0) -> dict:
    """Run one load in a fresh Python process (it imports the same cupy_moe as this one) and return its report
    (see cupy_moe._peak_rss.measure)."""
    setup, work = MODES[mode]
    return _peak_rss.measure(setup, work, folder, layer)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="take H, I and E from this cupy_moe.models shape")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--modes", default="load_layer_weights,from_experts,load_file")
    args = ap.parse_args(argv)
    if args.model is not None:
        shape = get_model(args.model)
        args.hidden, args.intermediate, args.experts = shape.hidden, shape.intermediate, shape.num_experts
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(tmp, family="mixtral", num_layers=1, hidden=args.hidden, intermediate=args.intermediate,
                         num_experts=args.experts, bits=args.bits, group_size=args.group_size,
                         num_shards=args.shards, return_weights=False)
        files = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors"))
        print(f"checkpoint: Mixtral-style layer H={args.hidden} I={args.intermediate} E={args.experts} "
              f"bits={args.bits} G={args.group_size}, {args.shards} shard(s), {files / 2**20:.1f} MiB on disk, "
              f"written in {time.perf_counter() - t0:.1f} s")
        print(f"{'mode':<20}{'result MiB':>12}{'extra peak RSS MiB':>20}{'peak / result':>15}{'seconds':>10}")
        for mode in args.modes.split(","):
            r = measure(tmp, mode)
            print(f"{mode:<20}{r['result_bytes'] / 2**20:>12.1f}{r['extra_peak_bytes'] / 2**20:>20.1f}"
                  f"{r['extra_peak_bytes'] / r['result_bytes']:>15.2f}{r['seconds']:>10.2f}"
                  + ("" if r["peak_reset"] else "  (peak counter not resettable: includes import peak)")
                  + ("" if r["device_bytes"] is None else
                     f"  device pool: {r['device_bytes'] / 2**20:.1f} MiB "
                     f"({r['device_bytes'] / r['result_bytes']:.3f} x the layer)"))


if __name__ == "__main__":
    main()

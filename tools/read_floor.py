"""What a kernel that only reads a decode row's bytes costs, timed the way bench_gemm.py times our GEMM.

    python tools/read_floor.py [--models Mixtral-8x7B,...] [--m 1,16]

For small rows the traffic floor (bytes over the copy bandwidth) leaves out what every launch pays: the launch gap
inside a CUDA graph and the DRAM latency before the first bytes arrive. Per row this prints the traffic floor, the
per-call time of an empty kernel, and of a plain streaming read (grid-stride 16-byte loads, 8 warps x 1056 CTAs) of
the same number of bytes from 8 rotated buffers, both replayed as a CUDA graph of 8 calls (median). `read/floor`
(floor time / read time) is the best fraction of the traffic floor a kernel that did nothing but read the row's
bytes could reach. Rows use 4-bit weights with G = 128 and the expected number of touched experts under uniform
routing (the tile heuristic's estimate).
"""
from __future__ import annotations

import argparse

import cupy as cp

from cupy_moe.configs import expected_experts
from cupy_moe.models import BENCHMARK_MODELS, get_model
from cupy_moe.timing import copy_bandwidth, graph_time

BITS, G = 4, 128

_SRC = r"""
extern "C" __global__ void empty_kernel(int* sink) {}
extern "C" __global__ void stream_read(const int4* __restrict__ src, long long n16, int* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16;
       i += (long long)gridDim.x * blockDim.x) {
    const int4 v = __ldg(src + i);
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x7fffffff) sink[0] = 1;  // keeps the loads; never true for zeros
}
"""
CALLS = 8


def calls_time(fn, reps=20):
    """Median per-call seconds of a CUDA graph holding fn(0..CALLS-1)."""
    return graph_time([lambda i=i: fn(i) for i in range(CALLS)], reps=reps)


def read_time(kernel, n16, sink):
    """Per-call seconds of `kernel` streaming n16 x 16 bytes from one of CALLS buffers (no L2 reuse)."""
    bufs = [cp.zeros(n16 * 4, cp.int32) for _ in range(CALLS)]
    return calls_time(lambda i: kernel((1056,), (256,), (bufs[i], cp.int64(n16), sink)))


def row_bytes(model, phase, m):
    """Bytes one GEMM phase moves at M tokens: touched experts' packed weights + activations read + outputs."""
    shape = get_model(model)
    k, n, top_k = shape.phases()[phase]
    rows = m if phase == "gate_up" else m * shape.top_k  # down runs one row per (token, expert) pair
    groups = -(-k // G)
    w_bytes = k * n * BITS // 8 + groups * n * 2 + groups * n * BITS // 8  # qweight + fp16 scales + qzeros
    touched = expected_experts(m, shape.num_experts, shape.top_k)
    return touched * w_bytes + rows * k * 2 + rows * top_k * n * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(BENCHMARK_MODELS))
    ap.add_argument("--m", default="1")
    args = ap.parse_args(argv)
    module = cp.RawModule(code=_SRC)
    empty, read = module.get_function("empty_kernel"), module.get_function("stream_read")
    sink = cp.zeros(1, cp.int32)
    bw = copy_bandwidth()
    t_empty = calls_time(lambda i: empty((1056,), (256,), (sink,)))
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s; empty kernel (1056 x 256) {t_empty * 1e6:.2f} us per call")
    print(f"{'model':18s} {'phase':7s} {'M':>4s} {'MiB':>7s} {'floor us':>9s} {'read us':>8s} {'read/floor':>10s}")
    for model in args.models.split(","):
        for phase in ("gate_up", "down"):
            for m in (int(v) for v in args.m.split(",")):
                nbytes = row_bytes(model, phase, m)
                n16 = -(-int(nbytes) // 16)
                t = read_time(read, n16, sink)
                floor = nbytes / bw
                print(f"{model:18s} {phase:7s} {m:4d} {nbytes / 2**20:7.1f} {floor * 1e6:9.2f} {t * 1e6:8.2f} "
                      f"{floor / t:10.2f}")


if __name__ == "__main__":
    main()

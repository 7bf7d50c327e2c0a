"""What a kernel that only reads a decode row's bytes costs, timed the way bench_gemm.py times our GEMM.

    python tools/read_floor.py [--models Mixtral-8x7B,...] [--m 1,16]

For small rows the traffic floor (bytes over the copy bandwidth) leaves out what every launch pays: the launch gap
inside a CUDA graph and the DRAM latency before the first bytes arrive. Per row this prints the traffic floor, the
per-call time of an empty kernel, and of kernels that read the same number of bytes from 8 rotated buffers, all
replayed as a CUDA graph of 8 calls (median):

- stream: grid-stride 16-byte loads, 8 warps x 1056 CTAs;
- burst: every thread issues all its U 16-byte loads at once (U = 1, 2, 4, 8; the fastest is printed, with its U),
  one CTA of 8 warps per 256 * U chunks, so that one pass covers the bytes;
- burst after an index: the same, with the loads' addresses depending on one 4-byte load before them, as the GEMM
  reads its expert id before it can address the expert's weights (same U as burst).

`best/floor` (floor time / the fastest read) is the best fraction of the traffic floor a kernel that did nothing
but read the row's bytes, one contiguous buffer, could reach. Rows use 4-bit weights with G = 128 and the expected
number of touched experts under uniform routing (the tile heuristic's estimate).
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
// U 16-byte loads per thread, all in flight before the first is used; with_idx: their addresses depend on one 4-byte
// load before them (*idx, a zero)
template <int U>
__global__ void burst_read(const int4* __restrict__ src, long long n16, const int* __restrict__ idx, int with_idx,
                           int* sink) {
  const long long first = (long long)blockIdx.x * 256 * U + threadIdx.x + (with_idx ? __ldg(idx) : 0);
  int4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = first + u * 256 < n16 ? __ldg(src + first + u * 256) : make_int4(0, 0, 0, 0);
  int acc = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x7fffffff) sink[0] = 1;
}
"""
CALLS = 8


def calls_time(fn, reps=20):
    """Median per-call seconds of a CUDA graph holding fn(0..CALLS-1)."""
    return graph_time([lambda i=i: fn(i) for i in range(CALLS)], reps=reps)


BURST_U = (1, 2, 4, 8)


def read_times(module, n16, sink, idx):
    """Per-call seconds of reading n16 x 16 bytes from one of CALLS buffers (no L2 reuse): the stream kernel, and
    {U: (burst, burst after an index)}."""
    bufs = [cp.zeros(n16 * 4, cp.int32) for _ in range(CALLS)]
    stream = module.get_function("stream_read")
    t_stream = calls_time(lambda i: stream((1056,), (256,), (bufs[i], cp.int64(n16), sink)))
    bursts = {}
    for u in BURST_U:
        kernel, grid = module.get_function(f"burst_read<{u}>"), (-(-n16 // (256 * u)),)
        bursts[u] = tuple(calls_time(lambda i: kernel(grid, (256,), (bufs[i], cp.int64(n16), idx, cp.int32(w), sink)))
                          for w in (0, 1))
    return t_stream, bursts


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
    module = cp.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=[f"burst_read<{u}>" for u in BURST_U])
    empty = module.get_function("empty_kernel")
    sink, idx = cp.zeros(1, cp.int32), cp.zeros(1, cp.int32)
    bw = copy_bandwidth()
    t_empty = calls_time(lambda i: empty((1056,), (256,), (sink,)))
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s; empty kernel (1056 x 256) {t_empty * 1e6:.2f} us per call")
    print(f"{'model':18s} {'phase':7s} {'M':>4s} {'MiB':>7s} {'floor us':>9s} {'stream us':>9s} {'burst us':>8s} "
          f"{'U':>2s} {'+index us':>9s} {'best/floor':>10s}")
    for model in args.models.split(","):
        for phase in ("gate_up", "down"):
            for m in (int(v) for v in args.m.split(",")):
                nbytes = row_bytes(model, phase, m)
                t_stream, bursts = read_times(module, -(-int(nbytes) // 16), sink, idx)
                u = min(bursts, key=lambda k: bursts[k][0])
                floor = nbytes / bw
                best = min(t_stream, *(t for pair in bursts.values() for t in pair))
                print(f"{model:18s} {phase:7s} {m:4d} {nbytes / 2**20:7.1f} {floor * 1e6:9.2f} {t_stream * 1e6:9.2f} "
                      f"{bursts[u][0] * 1e6:8.2f} {u:2d} {bursts[u][1] * 1e6:9.2f} {floor / best:10.2f}")


if __name__ == "__main__":
    main()

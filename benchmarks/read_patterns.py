"""How fast can the raw GPTQ qweight layout be streamed? Pure-read kernels (no math), measurement only.

The decode GEMM reads each touched expert's qweight [K/8, N] int32 once; a CTA owns a column strip and walks
down K, so its reads are row segments of a few hundred bytes, N*4 bytes apart. This script times three ways of
reading the same bytes, against the device-to-device copy bandwidth measured in the same run:

- linear: 16-byte loads, grid-stride over the whole buffer (the best case, layout ignored);
- cpasync D: the decode kernel's pattern (128 threads, a 512-byte strip, 16 rows per stage, a lane-private
  cp.async ring, D stages deep, D-1 in flight);
- bulk SEG/RPS/D: one thread issues cp.async.bulk copies (TMA, no L1 bookkeeping) of RPS row segments of SEG
  bytes per stage into a shared-memory ring D stages deep, completion on an mbarrier; 128 threads consume.

    python benchmarks/read_patterns.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import bench_gemm as bg  # noqa: E402

_SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

extern "C" __global__ void read_linear(const uint4* __restrict__ src, long long n16, u32* __restrict__ sink) {
  u32 acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride)
    acc ^= fold(__ldg(src + i)) ^ fold(__ldg(src + i + stride)) ^ fold(__ldg(src + i + 2 * stride)) ^
           fold(__ldg(src + i + 3 * stride));
  for (; i < n16; i += stride) acc ^= fold(__ldg(src + i));
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

// 128 threads, strip of 128 words (512 B), 16 rows per stage: lane (g, t) of warp w copies 16 B of rows 4u + t
template <int D>
__global__ void read_strip_cpasync(const int* __restrict__ w, int rows, int nw, int rows_per_cta, u32* sink) {
  __shared__ uint4 ring[D][4][128];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int col = blockIdx.x * 128 + warp * 32 + 4 * g;
  const int r0 = blockIdx.y * rows_per_cta, nst = (min(rows, r0 + rows_per_cta) - r0) / 16;
  auto issue = [&](int s) {
    if (s < nst)
      for (int u = 0; u < 4; ++u) {
        const int* src = w + (long long)(r0 + 16 * s + 4 * u + t) * nw + col;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem(&ring[s % D][u][threadIdx.x])), "l"(src)
                     : "memory");
      }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  u32 acc = 0;
  for (int s = 0; s < D - 1; ++s) issue(s);
  for (int s = 0; s < nst; ++s) {
    issue(s + D - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(D - 1) : "memory");
    for (int u = 0; u < 4; ++u) acc ^= fold(ring[s % D][u][threadIdx.x]);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

// bulk: thread 0 fills stage s with RPS row segments of SEG bytes (one cp.async.bulk each) on mbarrier full[s % D]
template <int SEG, int RPS, int D>
__global__ void read_strip_bulk(const int* __restrict__ w, int rows, int nw, int rows_per_cta, u32* sink) {
  extern __shared__ uint4 ring[];  // [D][RPS][SEG / 16]
  __shared__ unsigned long long full[D];
  const int r0 = blockIdx.y * rows_per_cta, nst = (min(rows, r0 + rows_per_cta) - r0) / RPS;
  const int* base = w + (long long)r0 * nw + blockIdx.x * (SEG / 4);
  if (threadIdx.x == 0) {
    for (int s = 0; s < D; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int s) {
    if (threadIdx.x != 0 || s >= nst) return;
    const u32 bar = smem(&full[s % D]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(RPS * SEG) : "memory");
    for (int r = 0; r < RPS; ++r)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem(ring + ((s % D) * RPS + r) * (SEG / 16))), "l"(base + (long long)(s * RPS + r) * nw),
                   "r"(SEG), "r"(bar) : "memory");
  };
  for (int s = 0; s < D; ++s) issue(s);
  u32 acc = 0;
  for (int s = 0; s < nst; ++s) {
    const u32 bar = smem(&full[s % D]), parity = (s / D) & 1;
    asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
                 ::"r"(bar), "r"(parity) : "memory");
    for (int i = threadIdx.x; i < RPS * SEG / 16; i += blockDim.x) acc ^= fold(ring[(s % D) * RPS * (SEG / 16) + i]);
    __syncthreads();  // everyone is done with this slot
    issue(s + D);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""

CPASYNC = [2, 4, 6]
BULK = [(512, 16, 4), (512, 16, 8), (1024, 8, 4), (1024, 8, 8), (2048, 4, 8), (2048, 8, 6), (4096, 4, 6)]
# (name, rows of the stacked [rows, N] int32 matrix read, N words, rows per CTA): Mixtral-8x7B gate/up at M=1
# (2 experts of K/8 = 512 rows, N = 28672) and Qwen3-30B-A3B gate/up at M=1 (8 experts of 256 rows, N = 1536)
PROBLEMS = [("Mixtral gate_up M=1", 1024, 28672, 64), ("Qwen3-30B gate_up M=1", 2048, 1536, 64)]


def main():
    names = ["read_linear"] + [f"read_strip_cpasync<{d}>" for d in CPASYNC] + \
        [f"read_strip_bulk<{s}, {r}, {d}>" for s, r, d in BULK]
    mod = cp.RawModule(code=_SRC, options=("-std=c++17", "-arch=sm_90a"), name_expressions=names)
    copy_bw = bg.copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); figures are read TB/s and their ratio to it")
    sink = cp.zeros(1, cp.uint32)
    for label, rows, nw, rpc in PROBLEMS:
        nbytes = rows * nw * 4
        copies = max(1, -(-256 * 2**20 // nbytes))  # rotate over >= 256 MiB so that L2 (50 MiB) does not help
        bufs = [cp.random.randint(0, 2**31 - 1, size=(rows, nw), dtype=cp.int32) for _ in range(copies)]
        print(f"## {label}: {nbytes / 2**20:.1f} MiB per call, {copies} copies rotated")
        runs = {"linear": lambda b: mod.get_function("read_linear")(
            (132 * 8,), (256,), (b, np.int64(nbytes // 16), sink))}
        for d in CPASYNC:
            k = mod.get_function(f"read_strip_cpasync<{d}>")
            runs[f"cpasync D={d}"] = (lambda k: lambda b: k((nw // 128, -(-rows // rpc)), (128,),
                                                            (b, np.int32(rows), np.int32(nw), np.int32(rpc), sink)))(k)
        for seg, rps, d in BULK:
            if nw * 4 % seg:
                continue
            k = mod.get_function(f"read_strip_bulk<{seg}, {rps}, {d}>")
            smem = d * rps * seg
            k.max_dynamic_shared_size_bytes = smem
            runs[f"bulk {seg}B x {rps} rows, D={d} ({smem // 1024} KiB)"] = (
                lambda k, smem: lambda b: k((nw * 4 // seg, -(-rows // rpc)), (128,),
                                            (b, np.int32(rows), np.int32(nw), np.int32(rpc), sink),
                                            shared_mem=smem))(k, smem)
        for name, fn in runs.items():
            t = bg.timed(lambda i: fn(bufs[i % copies]), 20, warmup=3)
            print(f"{name:40s} {t * 1e6:8.1f} us {nbytes / t / 1e12:6.2f} TB/s {nbytes / t / copy_bw:6.2f}",
                  flush=True)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()

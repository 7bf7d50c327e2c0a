"""How fast can the raw GPTQ qweight layout be streamed? Pure-read kernels (no math), measurement only.

The decode GEMM reads each touched expert's qweight [K/8, N] int32 once; a CTA owns a column strip and walks
down K, so its reads are row segments of a few hundred bytes, N*4 bytes apart. This script times three ways of
reading the same bytes, against the device-to-device copy bandwidth measured in the same run: a CTA reads a
strip SEG bytes wide down a slice of rows (linear: the buffer seen as contiguous 16 KiB segments), with

- loads: 16-byte loads into registers, 4 in flight per thread;
- cp.async: a lane-private shared-memory ring 4 stages deep (like the decode kernel's ring; 512 B strips are its
  pattern);
- bulk: one thread issues cp.async.bulk copies (the TMA engine, no per-thread requests) of each row segment into a
  ring 4 stages deep, completion on mbarriers.
Each pattern xors every word it reads into a checksum that the host verifies.

    python tools/read_patterns.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from cupy_moe.timing import copy_bandwidth, event_time

_SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// A CTA (256 threads) reads rows [r0, r0 + rows_per_cta) x bytes [SEG * blockIdx.x, + SEG) of a [rows, row_words]
// int32 matrix, in stages of 256 * 16 * U bytes (RPS = that / SEG rows). Chunk c = tid + 256 u of a stage is row
// c / (SEG / 16), 16-byte column c % (SEG / 16). MODE 0: plain 16-byte loads, U in flight per thread; 1: cp.async
// into a lane-private ring of D stages (D - 1 in flight); 2: thread 0 issues one cp.async.bulk per row segment into
// a ring of D stages completed on mbarriers. Every mode xors all words it read into *sink (checked by the host).
template <int MODE, int SEG, int U, int D>
__global__ void __launch_bounds__(256) read_tiles(const int* __restrict__ w, int rows, int row_words,
                                                  int rows_per_cta, u32* sink) {
  constexpr int CPR = SEG / 16, RPS = 256 * U / CPR;  // 16-byte chunks per row segment, rows per stage
  extern __shared__ uint4 ring[];                      // MODE 1: [D][U][256]; MODE 2: [D][RPS * CPR]
  __shared__ unsigned long long full[D];
  const int tid = threadIdx.x;
  const int r0 = blockIdx.y * rows_per_cta, nst = (min(rows, r0 + rows_per_cta) - r0) / RPS;
  const int* base = w + (long long)r0 * row_words + blockIdx.x * (SEG / 4);
  auto src = [&](int s, int u) {
    const int c = tid + 256 * u;
    return reinterpret_cast<const uint4*>(base + (long long)(s * RPS + c / CPR) * row_words) + c % CPR;
  };
  u32 acc = 0;
  if constexpr (MODE == 0) {
    for (int s = 0; s < nst; ++s) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldg(src(s, u));
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
    }
  } else if constexpr (MODE == 1) {
    auto issue = [&](int s) {
      if (s < nst)
#pragma unroll
        for (int u = 0; u < U; ++u)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem(ring + ((s % D) * U + u) * 256 + tid)),
                       "l"(src(s, u)) : "memory");
      asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int s = 0; s < D - 1; ++s) issue(s);
    for (int s = 0; s < nst; ++s) {
      issue(s + D - 1);
      asm volatile("cp.async.wait_group %0;" ::"n"(D - 1) : "memory");
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(ring[((s % D) * U + u) * 256 + tid]);
    }
  } else {
    if (tid == 0) {
      for (int s = 0; s < D; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&full[s])));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int s) {
      if (tid != 0 || s >= nst) return;
      const u32 bar = smem(&full[s % D]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(RPS * SEG) : "memory");
      for (int r = 0; r < RPS; ++r)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem(ring + ((s % D) * RPS + r) * CPR)),
                     "l"(base + (long long)(s * RPS + r) * row_words), "r"(SEG), "r"(bar) : "memory");
    };
    for (int s = 0; s < D; ++s) issue(s);
    for (int s = 0; s < nst; ++s) {
      const u32 bar = smem(&full[s % D]), parity = (s / D) & 1;
      asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
                   ::"r"(bar), "r"(parity) : "memory");
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= fold(ring[(s % D) * RPS * CPR + tid + 256 * u]);
      __syncthreads();  // every thread is done with this slot before it is refilled
      issue(s + D);
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((tid & 31) == 0) atomicXor(sink, acc);
}
"""

# (label, MODE, SEG bytes, U, D, linear): linear views the buffer as contiguous segments (row stride = SEG)
PATTERNS = [("linear, loads", 0, 16384, 4, 1, True), ("linear, cp.async", 1, 16384, 4, 4, True),
            ("linear, bulk", 2, 16384, 4, 4, True),
            ("strip 512B, loads", 0, 512, 4, 1, False), ("strip 512B, cp.async (decode)", 1, 512, 2, 4, False),
            ("strip 512B, bulk", 2, 512, 4, 4, False),
            ("strip 2KiB, loads", 0, 2048, 4, 1, False), ("strip 2KiB, cp.async", 1, 2048, 4, 4, False),
            ("strip 2KiB, bulk", 2, 2048, 4, 4, False),
            ("strip 8KiB, loads", 0, 8192, 4, 1, False), ("strip 8KiB, cp.async", 1, 8192, 4, 4, False),
            ("strip 8KiB, bulk", 2, 8192, 4, 4, False)]
# (name, rows of the stacked [rows, N] int32 matrix read, N words): Mixtral-8x7B gate/up at M=1 (2 experts of
# K/8 = 512 rows, N = 28672) and Qwen3-30B-A3B gate/up at M=1 (8 experts of 256 rows, N = 1536)
PROBLEMS = [("Mixtral gate_up M=1", 1024, 28672), ("Qwen3-30B gate_up M=1", 2048, 1536)]
TARGET_CTAS = 8 * 132


def main():
    names = {p: f"read_tiles<{p[1]}, {p[2]}, {p[3]}, {p[4]}>" for p in PATTERNS}
    mod = cp.RawModule(code=_SRC, options=("-std=c++17", "-arch=sm_90a"), name_expressions=list(names.values()))
    copy_bw = copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); figures are read TB/s and their ratio to it")
    sink = cp.zeros(1, cp.uint32)
    for label, rows, nw in PROBLEMS:
        nbytes = rows * nw * 4
        copies = max(1, -(-256 * 2**20 // nbytes))  # rotate over >= 256 MiB so that L2 (50 MiB) does not help
        bufs = [cp.random.randint(0, 2**31 - 1, size=(rows, nw), dtype=cp.int32) for _ in range(copies)]
        want = [int(np.bitwise_xor.reduce(cp.asnumpy(b).view(np.uint32).ravel())) for b in bufs]
        print(f"## {label}: {nbytes / 2**20:.1f} MiB per call, {copies} copies rotated")
        for pat in PATTERNS:
            name, mode, seg, u, d, linear = pat
            if (nw * 4) % seg and not linear:
                continue
            r, rw = (nbytes // seg, seg // 4) if linear else (rows, nw)
            strips = rw * 4 // seg
            rps = 256 * u * 16 // seg
            rpc = max(rps, -(-(r * strips // TARGET_CTAS) // rps) * rps)
            k = mod.get_function(names[pat])
            smem = 0 if mode == 0 else d * 256 * u * 16
            k.max_dynamic_shared_size_bytes = max(smem, 1)
            args = lambda b: (b, np.int32(r), np.int32(rw), np.int32(rpc), sink)
            grid = (strips, -(-r // rpc))
            ok = True
            for i in range(copies):  # checksum: every word read exactly once
                sink.fill(0)
                k(grid, (256,), args(bufs[i]), shared_mem=smem)
                ok &= int(sink.get()[0]) == want[i]
            t = event_time(lambda i: k(grid, (256,), args(bufs[i % copies]), shared_mem=smem), reps=20, warmup=3)
            print(f"{name:32s} {t * 1e6:8.1f} us {nbytes / t / 1e12:6.2f} TB/s {nbytes / t / copy_bw:6.2f}  "
                  f"grid {grid[0]}x{grid[1]} {'checksum ok' if ok else 'CHECKSUM WRONG'}", flush=True)
        bufs.clear()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()

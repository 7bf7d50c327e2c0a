// Split-K of the GEMM kernels, deterministic and without atomics on the output. The K slices of one output tile run
// in separate CTAs (blockIdx.z = slice); each CTA writes its fp32 partial tile to a workspace [S, C, N] (slice,
// slot of the aligned pair list, column), then takes a ticket of the tile. The CTA that arrives last sums the
// partials of every slice in the fixed order s = 0 .. S-1, so the result is bitwise the same whatever the arrival
// order, rounds once, writes the output and resets the ticket for the next launch (and CUDA graph replay).
//
// Each kernel walks its own fragments (its accumulator layout); the workspace layout, the ticket protocol and the
// fixed-order sum are the functions below. A fragment is the tensor-core accumulator pair: 2 consecutive columns of
// one slot. moe_gemm (8-column rows) uses the ticket protocol only and keeps its own workspace writes and reads.
// Two slices of its 16-row blocks, and of moe_gemm_tc's wgmma tiles, can also reduce inside a thread-block cluster
// (the second half of this file).
#pragma once

namespace splitk {

// Writes this CTA's partial sums (slice blockIdx.z) of columns col, col + 1 of `slot` into the workspace.
__device__ __forceinline__ void publish(float* partials, int capacity, int N, int slot, int col, const float (&v)[2]) {
  float* dst = partials + (static_cast<long long>(blockIdx.z) * capacity + slot) * N + col;
  *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
}

// Called by every thread of the CTA after its publish(): true in the CTA that completes the tile (blockIdx.x,
// blockIdx.y), which then owns every slice's partials and must call reset_ticket().
// last: a __shared__ int of the kernel (declared there: one declared in here moves the kernel's other shared arrays
// and changes its code).
__device__ __forceinline__ bool last_arrival(int* tickets, int split_k, int& last) {
  __threadfence();  // partials visible device-wide before the ticket
  __syncthreads();
  int* ticket = tickets + static_cast<long long>(static_cast<int>(blockIdx.x)) * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == split_k - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();  // the other slices' partials are read after their tickets
  return true;
}

// In the CTA that arrived last (thread 0 acts): the tile's ticket back to zero for the next launch and CUDA graph
// replay. Anywhere after last_arrival() (no other CTA touches the ticket any more); each kernel calls it where its
// code came out shortest.
__device__ __forceinline__ void reset_ticket(int* tickets) {
  int* ticket = tickets + static_cast<long long>(static_cast<int>(blockIdx.x)) * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) *ticket = 0;
}

// The tile's sums of columns col, col + 1 of `slot`: every slice's partials added in slice order (L2 reads: the
// other CTAs wrote them). Two scalars rather than an array: the same sums written as arrays and unrolled loops
// changed the register allocation of the whole kernel (NVRTC 12.9).
__device__ __forceinline__ void sum_slices(const float* partials, int split_k, int capacity, int N, int slot, int col,
                                           float (&v)[2]) {
  float v0 = 0.f, v1 = 0.f;
  for (int s = 0; s < split_k; ++s) {  // fixed order: bitwise the same result on every run
    const float2 x =
        __ldcg(reinterpret_cast<const float2*>(partials + (static_cast<long long>(s) * capacity + slot) * N + col));
    v0 += x.x;
    v1 += x.y;
  }
  v[0] = v0;
  v[1] = v1;
}

// ---- Split-K inside a thread-block cluster (sm_90 and later): when the launch makes the split_k slices of a tile
// one cluster (cluster dims 1 x 1 x split_k, so the slice blockIdx.z is the CTA's rank in it), each CTA leaves its
// partial tile in its own shared memory and the CTAs of the cluster read each other's tiles (distributed shared
// memory) instead of the workspace round trip: no fence to global memory, no ticket, no last CTA that reads
// everything. The sums are still taken in slice order s = 0 .. S-1, so the result is bitwise that of the workspace.

// The number of CTAs in this CTA's cluster (1 when launched without clusters, and below sm_90).
__device__ __forceinline__ int cluster_size() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return static_cast<int>(n);
#else
  return 1;
#endif
}

// Every thread of every CTA of the cluster: this thread's earlier shared-memory writes are visible to the cluster's
// reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// 16 bytes at shared address `addr` of this CTA's layout, read from the CTA of cluster rank `rank`.
__device__ __forceinline__ float4 ld_cluster16(unsigned addr, int rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
#endif
  return v;
}

}  // namespace splitk

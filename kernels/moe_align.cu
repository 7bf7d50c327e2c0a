// moe_align_block_size on the GPU: sort (token, expert) pairs by expert, pad each expert's run to a multiple of B.
//
// Shape letters: M tokens, A top-k, P = M*A pairs (pair p = token*A + slot), E experts, B block size,
// C = (P + min(E, P) * (B - 1)) / B * B the capacity (the host computes it from shapes alone).
// Outputs: sorted [C] int32 pair ids (sentinel P in padding), expert_ids [C/B] int32 (-1 past the padded total),
// post_padded [1] int32 (the padded total, stays on the device).
//
// Determinism: pairs inside an expert must come out in ascending p, so no atomic decides an order. Pairs are cut
// into contiguous chunks, one chunk per warp; a warp walks its chunk 32 pairs at a time in order, ranks equal
// experts inside the 32 with __match_any_sync, and keeps a warp-private counter per expert in shared memory.
// Chunk offsets per expert come from an exclusive scan over the chunks (in chunk order), so the result is the
// stable counting sort, bit for bit the reference's.
//
// Two paths: `moe_align_fused` does everything in one CTA (small P: one launch, no workspace, decode);
// `moe_align_count` -> `moe_align_scan` -> `moe_align_scatter` spread the chunks over many CTAs (large P), with a
// workspace counts [chunks, E] int32 that the scan turns into absolute start positions.
//
// Expert ids outside [0, E) are skipped (the GPU cannot raise without a host sync; the reference raises).

#include "pdl.cuh"

namespace {

template <typename IdT>
__device__ __forceinline__ int load_expert(const IdT* __restrict__ topk_ids, long long p, int num_experts) {
  const long long e = static_cast<long long>(topk_ids[p]);
  return (e >= 0 && e < num_experts) ? static_cast<int>(e) : -1;
}

// One warp walks pairs [begin, end) in order. cnt_e is this warp's private counter per expert (shared memory):
// counting mode adds the number of pairs per expert; scatter mode starts at the absolute position of the chunk's
// first pair of each expert and writes sorted[pos] = p.
template <typename IdT, bool kScatter>
__device__ __forceinline__ void warp_walk(const IdT* __restrict__ topk_ids, int begin, int end, int num_experts,
                                          int* cnt_e, int* __restrict__ sorted) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 32) {
    const int p = base + lane;
    const int e = p < end ? load_expert(topk_ids, p, num_experts) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);  // lanes holding the same expert
    const int leader = __ffs(same) - 1;
    const int rank = __popc(same & ((1u << lane) - 1u));      // earlier lanes (smaller p) with this expert
    int slot = 0;
    if (e >= 0 && lane == leader) {
      slot = cnt_e[e];
      cnt_e[e] = slot + __popc(same);
    }
    slot = __shfl_sync(0xffffffffu, slot, leader);
    __syncwarp();  // the next leader of this expert may be another lane: order its read after this write
    if (kScatter && e >= 0) sorted[slot + rank] = p;
  }
}

// Exclusive scan of data[0..n) in shared memory by the whole block, any blockDim; returns the total.
__device__ int block_exclusive_scan(int* data, int n, int* warp_sums /* [32] */) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int per = (n + nthreads - 1) / nthreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int local = 0;
  for (int i = lo; i < hi; ++i) local += data[i];
  // inclusive warp scan of the per-thread sums
  const int lane = tid & 31, warp = tid >> 5;
  int incl = local;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (nthreads + 31) >> 5;
    int w = lane < nwarps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int run = incl - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  const int total = warp_sums[31];
  for (int i = lo; i < hi; ++i) {
    const int v = data[i];
    data[i] = run;
    run += v;
  }
  __syncthreads();
  return total;
}

// Given per-expert pair counts total_e and their padded sizes scanned into start_e (exclusive, start_e[E] = T),
// write expert_ids for every block, the sentinels of every padding slot and the padded total.
__device__ void write_layout(const int* total_e, const int* start_e, int num_experts, int block_size, int capacity,
                             int sentinel, int* __restrict__ sorted, int* __restrict__ expert_ids,
                             int* __restrict__ post_padded) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int padded_total = start_e[num_experts];
  if (tid == 0) post_padded[0] = padded_total;
  const int num_blocks = capacity / block_size;
  for (int blk = tid; blk < num_blocks; blk += nthreads) {
    const int pos = blk * block_size;
    int owner = -1;
    if (pos < padded_total) {  // last expert whose start <= pos: the run that holds pos
      int lo = 0, hi = num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start_e[mid] <= pos) lo = mid; else hi = mid - 1;
      }
      owner = lo;
    }
    expert_ids[blk] = owner;
  }
  for (int e = tid; e < num_experts; e += nthreads) {  // each run's padding (< B slots)
    for (int i = start_e[e] + total_e[e]; i < start_e[e + 1]; ++i) sorted[i] = sentinel;
  }
  for (int i = padded_total + tid; i < capacity; i += nthreads) sorted[i] = sentinel;  // past the padded total
}

}  // namespace

// Single CTA. The first W warps (walkers) walk one chunk of pairs each; every thread of the CTA (blockDim >= 32*W)
// shares the per-expert work (counter sums, scan, layout), so that a small P with many experts does not leave it to
// one warp. Dynamic shared memory: (W*E + 2*(E+1) + 32) ints.
template <typename IdT>
__global__ void moe_align_fused(const IdT* __restrict__ topk_ids, int num_pairs, int num_experts, int block_size,
                                int capacity, int* __restrict__ sorted, int* __restrict__ expert_ids,
                                int* __restrict__ post_padded, int walkers) {
  pdl::enter();
  extern __shared__ int smem[];
  const int warp = threadIdx.x >> 5, tid = threadIdx.x;
  int* cnt = smem;                                 // [W, E] warp-private counters
  int* total_e = cnt + walkers * num_experts;      // [E + 1]
  int* start_e = total_e + (num_experts + 1);      // [E + 1]
  int* warp_sums = start_e + (num_experts + 1);    // [32]
  for (int i = tid; i < walkers * num_experts; i += blockDim.x) cnt[i] = 0;
  __syncthreads();

  const int chunk = (num_pairs + walkers - 1) / walkers;
  const int begin = min(num_pairs, warp * chunk), end = min(num_pairs, begin + chunk);
  if (warp < walkers) warp_walk<IdT, false>(topk_ids, begin, end, num_experts, cnt + warp * num_experts, sorted);
  __syncthreads();

  for (int e = tid; e < num_experts; e += blockDim.x) {  // chunk offsets inside each expert, in chunk order
    int run = 0;
    for (int w = 0; w < walkers; ++w) {
      const int c = cnt[w * num_experts + e];
      cnt[w * num_experts + e] = run;
      run += c;
    }
    total_e[e] = run;
    start_e[e] = (run + block_size - 1) / block_size * block_size;
  }
  if (tid == 0) start_e[num_experts] = 0;
  __syncthreads();
  block_exclusive_scan(start_e, num_experts + 1, warp_sums);
  write_layout(total_e, start_e, num_experts, block_size, capacity, num_pairs, sorted, expert_ids, post_padded);
  for (int i = tid; i < walkers * num_experts; i += blockDim.x) cnt[i] += start_e[i % num_experts];
  __syncthreads();
  if (warp < walkers) warp_walk<IdT, true>(topk_ids, begin, end, num_experts, cnt + warp * num_experts, sorted);
}

// Many CTAs of 8 warps; chunk c = blockIdx.x*8 + warp covers pairs [c*chunk, (c+1)*chunk).
// Dynamic shared memory: 8*E ints. Writes counts[c, e].
template <typename IdT>
__global__ void moe_align_count(const IdT* __restrict__ topk_ids, int num_pairs, int num_experts, int chunk,
                                int num_chunks, int* __restrict__ counts) {
  pdl::enter();
  extern __shared__ int smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * (blockDim.x >> 5) + warp;
  int* cnt = smem + warp * num_experts;
  for (int e = lane; e < num_experts; e += 32) cnt[e] = 0;
  __syncwarp();
  if (c >= num_chunks) return;
  const int begin = min(num_pairs, c * chunk), end = min(num_pairs, begin + chunk);
  warp_walk<IdT, false>(topk_ids, begin, end, num_experts, cnt, nullptr);
  for (int e = lane; e < num_experts; e += 32) counts[static_cast<long long>(c) * num_experts + e] = cnt[e];
}

// One CTA: counts [chunks, E] -> absolute start position of each chunk's run of each expert; writes the layout.
// Dynamic shared memory: 2*(E+1) + 32 ints.
__global__ void moe_align_scan(int* __restrict__ counts, int num_pairs, int num_experts, int num_chunks,
                               int block_size, int capacity, int* __restrict__ sorted,
                               int* __restrict__ expert_ids, int* __restrict__ post_padded) {
  pdl::enter();
  extern __shared__ int smem[];
  int* total_e = smem;
  int* start_e = total_e + (num_experts + 1);
  int* warp_sums = start_e + (num_experts + 1);
  const int tid = threadIdx.x;
  for (int e = tid; e < num_experts; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < num_chunks; ++c) {  // threads e, e+1, ... read one row together: coalesced
      const long long i = static_cast<long long>(c) * num_experts + e;
      const int v = counts[i];
      counts[i] = run;
      run += v;
    }
    total_e[e] = run;
    start_e[e] = (run + block_size - 1) / block_size * block_size;
  }
  __syncthreads();
  if (tid == 0) start_e[num_experts] = 0;
  __syncthreads();
  block_exclusive_scan(start_e, num_experts + 1, warp_sums);
  write_layout(total_e, start_e, num_experts, block_size, capacity, num_pairs, sorted, expert_ids, post_padded);
  for (int e = tid; e < num_experts; e += blockDim.x) {
    const int s = start_e[e];
    for (int c = 0; c < num_chunks; ++c) counts[static_cast<long long>(c) * num_experts + e] += s;
  }
}

// Same chunking as moe_align_count; each warp starts from its chunk's absolute positions and scatters.
template <typename IdT>
__global__ void moe_align_scatter(const IdT* __restrict__ topk_ids, int num_pairs, int num_experts, int chunk,
                                  int num_chunks, const int* __restrict__ counts, int* __restrict__ sorted) {
  pdl::enter();
  extern __shared__ int smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = blockIdx.x * (blockDim.x >> 5) + warp;
  if (c >= num_chunks) return;
  int* cnt = smem + warp * num_experts;
  for (int e = lane; e < num_experts; e += 32) cnt[e] = counts[static_cast<long long>(c) * num_experts + e];
  __syncwarp();
  const int begin = min(num_pairs, c * chunk), end = min(num_pairs, begin + chunk);
  warp_walk<IdT, true>(topk_ids, begin, end, num_experts, cnt, sorted);
}

// Fused GPTQ MoE GEMM: out[p, :] = a[p // top_k, :] @ W[expert(p)] (* topk_weights[p]) for every pair p of the
// aligned pair list, straight from the stacked raw GPTQ layout (no repacking), one launch per phase.
//
// Shapes: a [M, K] fp16/bf16; qweight [E, K*bits/32, N] int32 (packed along K); scales [E, ceil(K/G), N] fp16;
// qzeros [E, ceil(K/G), N*bits/32] int32 real zeros or null (symmetric: zero = 2^(bits-1)); g_idx [E, K] or null;
// sorted [C] pair ids (sentinel P), expert_ids [C/B_M], post_padded [1]; out [P, N] in a's dtype.
// Blocks whose expert id is outside [0, E) are skipped (num_experts = E), so a bad id never reads past the weights.
// One pair per block (moe_gemm only; sorted and post_padded null): block b holds pair b alone and expert_ids is the
// pairs' expert ids [P] (topk_ids itself), C = P * B_M; at M = 1 this saves the align launch.
//
// Tiling: CTA = BLOCK_M (= the align block size) rows of one expert x BLOCK_N columns x one K slice (split-K).
// Warp = MT m16 tiles x NG groups of 32 columns. Grid = (C/BLOCK_M blocks, N/BLOCK_N, split_k): blockIdx.x is
// fastest so the CTAs that share a weight tile run together and the tile is read from HBM once (L2 hits after).
//
// Column mapping (why every load and store is 16 bytes): in a 32-column group, n8 tile j's mma column g (the
// lane's B column, g = lane / 4) is real column n0 + 4g + j. So a lane's B words for tiles j = 0..3 are the 4
// consecutive columns n0+4g .. n0+4g+3 (one uint4 load per K row), and the lane's accumulators (mma columns 2t,
// 2t+1 of each tile, t = lane % 4) are the 8 consecutive real columns n0+8t .. n0+8t+7 (one uint4 store).
// K mapping: a lane loads the 8 codes k0+8t .. +7 of its columns (one int32 for 4-bit) and the 8 activations of
// the same k (one uint4); gptq_dequant.cuh orders both the same way.
//
// Split-K without atomics on the output: each CTA writes its fp32 partial tile to a cached workspace; a per-tile
// ticket counter picks the last arriving CTA, which sums the partials in fixed order s = 0..S-1 (bitwise
// deterministic whatever the arrival order), rounds once, writes out and resets the ticket for the next call.

#include "gptq_dequant.cuh"
#include "hopper.cuh"
#include "pdl.cuh"

using gptq::u32;

// Measurement probes (benchmarks/probe_kernels.py compiles with -DCUPY_MOE_PROBE=bits): each bit leaves one part of
// the work out, so that timing differences show where the time goes. Results are wrong under a probe.
// 1: no weight loads (compute on stale shared memory), 2: no dequantization, 4: no mma (decode: a cheap fold keeps
// the dequantized values alive; tc: no ldmatrix either).
#ifndef CUPY_MOE_PROBE
#define CUPY_MOE_PROBE 0
#endif
constexpr int kProbe = CUPY_MOE_PROBE;

// GM (group mode): 0 = scale/zero per 32-k chunk (any G multiple of 32); 1 = one group per pipeline stage and every
// stage whole (the launcher guarantees G % (32*KU) == 0, K % (32*KU) == 0 and stage-aligned split-K slices), so
// scale/zero are loaded and unpacked once per stage and the scale is applied to the stage's fp32 sums; 2 = act-order
// (g_idx: every k has its own group).
// MINB: CTAs per SM the compiler must fit in registers (1: no bound), chosen by configs.GemmConfig.min_ctas: 4 for the
// 16 x 128 decode shape in group modes 0 and 1 (nvcc 13.0, sm_90a: 120-128 registers, no spills), 3 for it with
// act-order and for the 32 x 128 shape (at most 168 registers). The kernel is latency-bound (Nsight Compute at 3
// CTAs: about one eligible warp per scheduler). H200, 2026-12-03 18:23 UTC, same splits, 4-bit mode 1: 4 CTAs per SM
// took 0.89-0.97 of the 3-CTA time on 12 of 32 decode rows and 0.97-1.01 on 19; 20:19 UTC (split estimate
// included): 4-bit G = 32 0.83-0.91 on 7 of 8 rows, 8-bit 0.84-1.06 (geometric mean 0.98), act-order 0.96-1.18.
// WK: warps side by side along K. A CTA's K slice is cut into WK warp slices that run at once; warp wk > 0 hands its
// sums to warp 0 of its (wm, wn) through shared memory, which adds them in the fixed order 1 .. WK-1 (bitwise
// deterministic). It is split-K without the workspace round trip: the 16 x 32 shape with WK = 4 covers 4 slices of
// 32 columns in one CTA, where the 16 x 128 shape needs 4 CTAs, their partials in global memory, a fence, a ticket and
// the last CTA's reads (configs.choose_config says when).
// kPairA (4-bit; moe_gemm_tc too): `a` is in pair order, each 8-k run stored as k0 k4 k1 k5 k2 k6 k3 k7, the order
// in which the 4-bit dequantizer yields its pairs. Then neither side needs re-pairing: the activation loads are the
// mma pairs, and the tc kernel stores its dequantized pairs as they come (the same permutation on both sides of every
// dot product). nvcc 13.0, fp16 4-bit: tc 128 x 256 365 -> 333 instructions per 64-k stage; moe_gemm 16 and 32 PRMT
// fewer per stage (swapped and plain loop). fused_moe's silu-and-mul writes the down phase's activations this way.
template <bool kBf16, int kBits, int MT, int WM, int WN, int WK, int NG, int KU, int STAGES, int GM, int MINB,
          bool kPairA>
__global__ void __launch_bounds__(WM * WN * WK * 32, MINB)
moe_gemm(const unsigned short* __restrict__ a,        // [M, K]
         const int* __restrict__ qweight,             // [E, K*bits/32, N]
         const unsigned short* __restrict__ scales,   // [E, groups, N] fp16 bits
         const int* __restrict__ qzeros,              // [E, groups, N*bits/32] or null
         const int* __restrict__ g_idx,               // [E, K] or null
         const float* __restrict__ topk_weights,      // [P] or null
         const int* __restrict__ sorted,              // [C]
         const int* __restrict__ expert_ids,          // [C / BLOCK_M]
         const int* __restrict__ post_padded,         // [1]
         unsigned short* __restrict__ out,            // [P, N]
         float* __restrict__ partials,                // [S, C, N] when split_k > 1
         int* __restrict__ tickets,                   // [C / BLOCK_M, N / BLOCK_N] zeros when split_k > 1
         int K, int N, int group_len, int num_groups, int top_k, int num_pairs, int capacity,
         int split_k, int chunks_per_split, int num_experts) {
  constexpr int BLOCK_M = WM * MT * 16;
  constexpr int BLOCK_N = WN * NG * 32;
  constexpr int WPR = kBits / 4;  // qweight words per lane per column per 32-k chunk
  constexpr bool kActOrder = GM == 2;
  constexpr int KS = GM == 1 ? 1 : KU;  // scale/zero sets per stage
  // GM 1: the weights are dequantized to q - z (exact) and each stage's fp32 sums are scaled once, in the
  // accumulator layout (sa: the scales of the lane's 8 output columns)
  constexpr bool kFold = GM == 1;
  constexpr bool kWhole = GM == 1;  // every stage whole: the launcher picks GM 1 only when K % (32 * KU) == 0
  // Prologue: one dependent load before the first weight copy. The padded total and the expert id are loaded
  // together (expert_ids has an entry for every block of the grid); the pair ids, which only the activation loads
  // and the epilogue need, are loaded after the first weight stages are issued.
  const int blk = blockIdx.x;
  pdl::enter();  // before the first global access (pdl.cuh)
  const bool one_pair = post_padded == nullptr;  // one pair per block (header)
  const int padded = one_pair ? capacity : __ldg(post_padded);
  const int expert = __ldg(expert_ids + blk);
  if (blk * BLOCK_M >= padded || expert < 0 || expert >= num_experts) return;  // past the total, or a padding block
  // the pair id in a slot of the aligned list (the sentinel num_pairs in padding)
  auto pair_at = [&](int slot) {
    return !one_pair ? __ldg(sorted + slot) : slot % BLOCK_M == 0 ? slot / BLOCK_M : num_pairs;
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wmn = WK == 1 ? warp : warp % (WM * WN), wk = WK == 1 ? 0 : warp / (WM * WN);  // (WK 1: no runtime work)
  const int wm = wmn / WN, wn = wmn % WN;
  const int g = lane >> 2, t = lane & 3;

  // rows of this lane: (mt, h) -> block row (wm*MT + mt)*16 + g + 8h; filled after the first weight copies, then
  // stepped to the k of the next stage load() reads
  const unsigned short* a_row[MT][2];
  int pair_of[MT][2];

  // n0: the lane's 32-column groups; nc: the group it loads and computes, the last one of N for a group past N (its
  // sums are never stored), so the main loop needs no column checks
  int n0[NG], nc[NG];
  bool n_ok[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    n0[ng] = blockIdx.y * BLOCK_N + (wn * NG + ng) * 32;
    n_ok[ng] = n0[ng] < N;  // N % 32 == 0, so a group is all in or all out
    nc[ng] = n_ok[ng] ? n0[ng] : N - 32;
  }

  const long long rows_q = static_cast<long long>(K) * kBits / 32;
  const int* qw_e = qweight + expert * rows_q * N;
  const unsigned short* sc_e = scales + static_cast<long long>(expert) * num_groups * N;
  const int zwords = N * kBits / 32;
  const int* qz_e = qzeros ? qzeros + static_cast<long long>(expert) * num_groups * zwords : nullptr;
  // act-order is a template flag: its per-k scale gathers would otherwise cost the plain path registers
  const int* gi_e = kActOrder ? g_idx + static_cast<long long>(expert) * K : nullptr;
  constexpr int kSymZero = 1 << (kBits - 1);

  float acc[MT][NG][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][ng][j][r] = 0.f;

  const int total_chunks = K / 32;
  // chunks_per_split: of one warp slice; slice blockIdx.z * WK + wk (empty past the end)
  const int c_begin = min(total_chunks, static_cast<int>(blockIdx.z * WK + wk) * chunks_per_split);
  const int c_end = min(total_chunks, c_begin + chunks_per_split);

  // One stage = KU chunks of 32 k: activations, weight words, and (without act-order) scales and zeros.
  // Weights: a ring of stages in shared memory, so that many stages stay in flight at no register cost. Each warp
  // fills and reads its own 512-byte slots (layout [stage][word][warp's 32 pieces]), so no CTA barrier is needed.
  constexpr int THREADS = WM * WN * WK * 32;
  constexpr int WORDS = KU * NG * WPR;
  // ring depth under the 48 KiB static shared-memory limit: 8-bit stages hold twice the bytes, so half as many (at
  // least 2, so loads overlap compute) keep the bytes in flight.
  constexpr int NST = kBits == 8 ? ((STAGES + 1) / 2 > 2 ? (STAGES + 1) / 2 : 2) : STAGES;
  static_assert(NST >= 2, "ring depth");
  __shared__ uint4 ring[NST * WORDS * THREADS];
  // A warp's copy instruction covers four 128-byte row runs (one per t). Lane l copies piece l: row l / 8, the
  // 16 bytes that reader (g, t) = ((l % 8 - 2 * (l / 8)) % 8, l / 8) needs, so each quarter-warp reads one whole run
  // and the warp writes 512 contiguous bytes; the reader finds its piece at 8t + (g + 2t) % 8 (the 8 lanes of a
  // 16-byte shared-memory phase hit 8 different bank quads). Lanes read what other lanes copied, hence the two
  // __syncwarp() in the main loop. (H200, 2026-12-03, benchmarks/ab_kernels.sh: against each lane copying its own
  // piece, 0.6-12% faster with 16-row blocks, most at M = 1, and within 1.5% with 32-row blocks. Nsight Compute had
  // counted 32 shared-memory wavefronts per copy instruction of the old mapping, against 4 ideal.)
  const int cp_row = lane >> 3;
  const int cp_col = ((lane & 7) - 2 * cp_row) & 7;
  // Slot (u, ng, r) of a stage is uint4 number ((u * NG + ng) * WPR + r) * THREADS (+ the lane's position) after the
  // stage's start: compile-time offsets from one base per stage (one add instead of an index computation per access).
  constexpr int RING_STAGE = KU * NG * WPR * THREADS;  // uint4 per stage
  auto ring_off = [](int u, int ng, int r) { return ((u * NG + ng) * WPR + r) * THREADS; };
  const int rd_pos = static_cast<int>(gptq::kept(warp * 32 + 8 * t + ((g + 2 * t) & 7)));
  // The lane's copy source: qweight row kBits * c + WPR * cp_row (+ r) of chunk c, column nc + 4 cp_col; a running
  // pointer (one add per chunk).
  const long long chunk_words = static_cast<long long>(kBits) * N;
  const int* w_src = qw_e + (c_begin * chunk_words + WPR * cp_row * N) + nc[0] + 4 * cp_col;
  const unsigned ring_cp = gptq::smem_u32(ring + threadIdx.x);  // the lane's copy slot, as a shared address
  // Scales and zero words travel in the same ring, a small one beside it (gring): per stage, scale/zero set u and
  // column group ng, the warp's SZ pieces of 16 bytes: 4 of scales (columns n0 .. n0 + 31), then ZQ of zero words.
  // (Loaded into registers one stage ahead, as they were until 2026-12-04, the register copy at the end of each
  // iteration waited for the load issued in the same iteration: every stage paid a full HBM latency.)
  // Lane l < GPIECES copies piece l of every stage, from g_src (its columns) plus the row of the group.
  constexpr int ZQ = kBits / 4, SZ = kActOrder ? 1 : 4 + ZQ, GPIECES = kActOrder ? 0 : KS * NG * SZ;
  constexpr int G_STAGE = KS * NG * (THREADS / 32) * SZ;  // uint4 per stage
  static_assert(GPIECES <= 32, "one gring piece per lane");
  __shared__ uint4 gring[kActOrder ? 1 : NST * G_STAGE];
  // the warp's pieces of set u, group ng in a stage that starts at gs (gstage)
  auto gstage = [&](int stage) -> const uint4* { return gring + stage * G_STAGE + warp * SZ; };
  auto gslot = [&](const uint4* gs, int u, int ng) -> const uint4* { return gs + (u * NG + ng) * (THREADS / 32) * SZ; };
  const int g_piece = lane % SZ, g_ng = lane / SZ % NG, g_u = lane / (SZ * NG);
  const bool g_do = lane < GPIECES && (g_piece < 4 || qz_e != nullptr);
  const unsigned char* g_src = reinterpret_cast<const unsigned char*>(
      g_piece < 4 || !qz_e ? static_cast<const void*>(sc_e + nc[g_ng] + 8 * (g_piece & 3))
                           : static_cast<const void*>(qz_e + nc[g_ng] * kBits / 32 + 4 * (g_piece - 4)));
  const long long g_row = g_piece < 4 ? 2ll * N : 4ll * zwords;  // bytes per group
  const unsigned g_dst = gptq::smem_u32(gring + ((g_u * NG + g_ng) * (THREADS / 32) + warp) * SZ + g_piece);
  const int chunks_per_group = group_len / 32;
  // GM 1: g_src steps to the next group's row every stages_per_group stages (slices start on stage boundaries);
  // g_left counts the stages left in the current one
  const int stages_per_group = GM == 1 ? chunks_per_group / KU : 1;
  int g_left = stages_per_group - (GM == 1 ? c_begin % chunks_per_group / KU : 0);
  if (GM == 1) g_src += (c_begin / chunks_per_group) * g_row;
  auto issue_weights = [&](int stage, int c0) {
    const unsigned dst = ring_cp + 16u * static_cast<unsigned>(stage * RING_STAGE);
    const int* src = w_src;
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      // chunks past the slice end are not computed, so their slots are left as they are (kWhole: the slice ends on a
      // stage boundary, one test per stage)
      const bool ok = (kWhole ? c0 : c0 + u) < c_end && !(kProbe & 1);
#pragma unroll
      for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int r = 0; r < WPR; ++r)
          if (ok) gptq::cp_async16(dst + 16u * ring_off(u, ng, r), src + r * N + (nc[ng] - nc[0]), true);
      src += chunk_words;
    }
    w_src = src;
    if constexpr (GM == 1) {  // the stage's group
      if (g_do && c0 < c_end) gptq::cp_async16(g_dst + 16u * G_STAGE * stage, g_src, true);
      if (--g_left == 0) {
        g_left = stages_per_group;
        g_src += g_row;
      }
    } else if constexpr (GM == 0) {  // set u = the group of chunk c0 + u
      const int c = c0 + g_u;
      if (g_do && c < c_end)
        gptq::cp_async16(g_dst + 16u * G_STAGE * stage, g_src + (c / chunks_per_group) * g_row, true);
    }
    gptq::cp_async_commit();
  };

  // Activations: registers, loaded at the top of their own stage.
  struct Stage {
    uint4 x[KU][MT][2];
  };
  // Activation loads are unconditional: padding rows read row 0 of a (their sums are never stored), and chunks
  // past the slice end (not computed; only without kWhole) read the slice's last chunk.
  // k of chunk u of the stage at c0, from the stage's start (a chunk past the slice end: the slice's last one)
  auto chunk_k = [&](int c0, int u) { return (kWhole ? u : min(c0 + u, c_end - 1) - c0) * 32; };
  auto load = [&](Stage& st, int c0) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int k0 = chunk_k(c0, u);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) st.x[u][mt][h] = __ldg(reinterpret_cast<const uint4*>(a_row[mt][h] + k0));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) a_row[mt][h] += 32 * KU;  // a running pointer: the next stage's k
  };
  // per-(set, ng, col) dequantization constants of the lane's columns n0 + 4g .. + 3, from the stage's gring pieces
  auto unpack = [&](const uint4* gst, int u, int ng, gptq::GroupConst (&gc)[4]) {
    const unsigned char* gs = reinterpret_cast<const unsigned char*>(gslot(gst, u, ng));
    const uint2 sv = kFold ? make_uint2(0u, 0u) : *reinterpret_cast<const uint2*>(gs + 8 * g);
    const u32 zw = qz_e ? *reinterpret_cast<const u32*>(gs + 64 + 4 * (g * kBits / 8)) : 0u;
#pragma unroll
    for (int col = 0; col < 4; ++col) {
      const u32 sw = col < 2 ? sv.x : sv.y;
      const unsigned short sb = static_cast<unsigned short>(sw >> (16 * (col & 1)));
      int zc = kSymZero;
      if (qz_e) zc = kBits == 4 ? (zw >> (16 * (g & 1) + 4 * col)) & 15u : (zw >> (8 * col)) & 255u;
      gc[col] = gptq::group_const<kBf16>(sb, zc);
    }
    if constexpr (kBits == 4) gptq::zero_consts4<kBf16>(qz_e ? zw >> (16 * (g & 1)) : kSymZero * 0x1111u, gc);
  };

  auto compute = [&](const Stage& st, int stage, int c0) {
    float part[kFold ? MT : 1][kFold ? NG : 1][4][4];  // kFold: this stage's sums before scaling
    gptq::GroupConst gcs[NG][4];
    const uint4* gst = gstage(stage);
    const uint4* rs = ring + rd_pos + stage * RING_STAGE;  // the lane's pieces of this stage
    if constexpr (GM == 1) {  // once per stage: every chunk of the stage is in the same group
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) unpack(gst, 0, ng, gcs[ng]);
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int c = c0 + u;
      if (!kWhole && c >= c_end) break;
      const int k0 = c * 32;
      u32 a0[MT][4], a1[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) gptq::a_operands<kBits, kPairA>(st.x[u][mt][0], st.x[u][mt][1], a0[mt], a1[mt]);
      // act-order: each of the lane's 8 k has its own group
      int gk[8];
      if constexpr (kActOrder) {
        const int4 g0 = __ldg(reinterpret_cast<const int4*>(gi_e + k0 + 8 * t));
        const int4 g1 = __ldg(reinterpret_cast<const int4*>(gi_e + k0 + 8 * t + 4));
        gk[0] = g0.x; gk[1] = g0.y; gk[2] = g0.z; gk[3] = g0.w;
        gk[4] = g1.x; gk[5] = g1.y; gk[6] = g1.z; gk[7] = g1.w;
      }
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        unsigned short s_bits[4][8];
        int z[4][8];
        if constexpr (GM == 0) {
          unpack(gst, u, ng, gcs[ng]);
        } else if constexpr (kActOrder) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint2 sv = __ldg(reinterpret_cast<const uint2*>(sc_e + static_cast<long long>(gk[j]) * N + nc[ng] + 4 * g));
            const u32 zw = qz_e ? static_cast<u32>(__ldg(qz_e + static_cast<long long>(gk[j]) * zwords +
                                                         (nc[ng] + 4 * g) * kBits / 32))
                                : 0u;
#pragma unroll
            for (int col = 0; col < 4; ++col) {
              const u32 sw = col < 2 ? sv.x : sv.y;
              s_bits[col][j] = static_cast<unsigned short>(sw >> (16 * (col & 1)));
              z[col][j] = !qz_e ? kSymZero
                                : kBits == 4 ? int((zw >> (16 * (g & 1) + 4 * col)) & 15u) : int((zw >> (8 * col)) & 255u);
            }
          }
        }
        uint4 wq[WPR];
#pragma unroll
        for (int r = 0; r < WPR; ++r) wq[r] = rs[ring_off(u, ng, r)];
#pragma unroll
        for (int col = 0; col < 4; ++col) {
          u32 q[WPR];
#pragma unroll
          for (int r = 0; r < WPR; ++r) {
            const uint4 w = wq[r];
            q[r] = col == 0 ? w.x : col == 1 ? w.y : col == 2 ? w.z : w.w;
          }
          u32 b[4];
          if constexpr (kProbe & 2) {
#pragma unroll
            for (int i = 0; i < 4; ++i) b[i] = q[i % WPR] + i;
          } else if constexpr (kActOrder) {
            gptq::dequant8<kBf16, kBits>(q, s_bits[col], z[col], b);
          } else {
            gptq::dequant8u<kBf16, kBits, !kFold>(q, gcs[ng][col], b);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if constexpr (kProbe & 4) {
              acc[mt][ng][col][0] += __uint_as_float((b[0] ^ b[1] ^ b[2] ^ b[3] ^ a0[mt][0] ^ a1[mt][0]) & 0x3FFFFFFFu);
            } else if constexpr (kFold) {
              if (u == 0) {
                gptq::mma16816_zero<kBf16>(part[mt][ng][col], a0[mt], b[0], b[1]);
              } else {
                gptq::mma16816<kBf16>(part[mt][ng][col], a0[mt], b[0], b[1]);
              }
              gptq::mma16816<kBf16>(part[mt][ng][col], a1[mt], b[2], b[3]);
            } else {
              gptq::mma16816<kBf16>(acc[mt][ng][col], a0[mt], b[0], b[1]);
              gptq::mma16816<kBf16>(acc[mt][ng][col], a1[mt], b[2], b[3]);
            }
          }
        }
      }
    }
    if constexpr (kFold) {  // acc += part * scale; accumulator column r of tile col is real column 8t + col + 4(r & 1)
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        const uint4 sa = gslot(gst, 0, ng)[t];  // the scales of real columns nc + 8t .. + 7
        const u32 sw[4] = {sa.x, sa.y, sa.z, sa.w};
        float sf[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const unsigned short sb = static_cast<unsigned short>(sw[i >> 1] >> (16 * (i & 1)));
          sf[i] = gptq::half_bits_to_float(sb);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int col = 0; col < 4; ++col)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              acc[mt][ng][col][r] = fmaf(part[mt][ng][col][r], sf[col + 4 * (r & 1)], acc[mt][ng][col][r]);
      }
    }
  };

  // Pipeline: NST-1 stages of weights, scales and zeros in flight ahead of the one computed.
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) issue_weights(s, c_begin + s * KU);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int slot = blk * BLOCK_M + (wm * MT + mt) * 16 + g + 8 * h;
      const int p = pair_at(slot);
      const bool valid = p >= 0 && p < num_pairs;  // padding rows hold the sentinel P
      pair_of[mt][h] = valid ? p : -1;
      a_row[mt][h] = a + static_cast<long long>(valid ? p / top_k : 0) * K + 32 * c_begin + 8 * t;
    }
  // ---- Swapped operands for a 16-row block with at most 8 rows (M = 1, or experts with few tokens): the weights
  // are the mma's m16 side and the block's first 8 rows its n8 side, so one mma covers 16 columns instead of 8 and
  // only row g is loaded and paired. Rows 8..15 are padding exactly when row 8 is (an expert's padding ends its last
  // block), the same for the whole CTA. m16 tile h of a lane's column group: rows g and g + 8 are its columns
  // n0 + 4g + 2h and n0 + 4g + 2h + 1 (the words the lane holds anyway), so the ring, the copies and the
  // dequantization are those of the plain path. Sums: sw[ng][h][r] = column 4g + 2h + (r >> 1), row 2t + (r & 1);
  // moved into acc's layout after the loop, so the epilogue is shared.
  constexpr bool kCanSwap = BLOCK_M == 16 && !kActOrder && kProbe == 0;
  float sw[NG][2][4];
  auto compute_n8 = [&](const uint4 (&xs)[KU], int stage, int c0) {
    float part[kFold ? NG : 1][2][4];
    gptq::GroupConst gcs[NG][4];
    const uint4* gst = gstage(stage);
    const uint4* rs = ring + rd_pos + stage * RING_STAGE;
    if constexpr (GM == 1) {
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) unpack(gst, 0, ng, gcs[ng]);
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      if (!kWhole && c0 + u >= c_end) break;
      u32 b[2][2];  // [k16 half][register]: row g's activations in the dequantizer's k order
      gptq::row_pairs<kBits, kPairA>(xs[u], b[0], b[1]);
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        if constexpr (GM == 0) unpack(gst, u, ng, gcs[ng]);
        uint4 wq[WPR];
#pragma unroll
        for (int r = 0; r < WPR; ++r) wq[r] = rs[ring_off(u, ng, r)];
        u32 w[4][4];  // the 4 columns' dequantized pairs
#pragma unroll
        for (int col = 0; col < 4; ++col) {
          u32 q[WPR];
#pragma unroll
          for (int r = 0; r < WPR; ++r) q[r] = col == 0 ? wq[r].x : col == 1 ? wq[r].y : col == 2 ? wq[r].z : wq[r].w;
          gptq::dequant8u<kBf16, kBits, !kFold>(q, gcs[ng][col], w[col]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int kh = 0; kh < 2; ++kh) {
            const u32 a[4] = {w[2 * h][2 * kh], w[2 * h + 1][2 * kh], w[2 * h][2 * kh + 1], w[2 * h + 1][2 * kh + 1]};
            float (&d)[4] = kFold ? part[kFold ? ng : 0][h] : sw[ng][h];
            if (kFold && u == 0 && kh == 0) {
              gptq::mma16816_zero<kBf16>(d, a, b[kh][0], b[kh][1]);
            } else {
              gptq::mma16816<kBf16>(d, a, b[kh][0], b[kh][1]);
            }
          }
      }
    }
    if constexpr (kFold) {  // sw += part * scale of the row's column
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        const uint2 sv = reinterpret_cast<const uint2*>(gslot(gst, 0, ng))[g];  // columns n0 + 4g .. + 3
        const float sf[4] = {gptq::half_bits_to_float(static_cast<unsigned short>(sv.x)),
                             gptq::half_bits_to_float(static_cast<unsigned short>(sv.x >> 16)),
                             gptq::half_bits_to_float(static_cast<unsigned short>(sv.y)),
                             gptq::half_bits_to_float(static_cast<unsigned short>(sv.y >> 16))};
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 4; ++r) sw[ng][h][r] = fmaf(part[ng][h][r], sf[2 * h + (r >> 1)], sw[ng][h][r]);
      }
    }
  };

  // Activations are loaded at the top of their own stage (mostly L1 hits: the CTA's warps share them).
  const int row8 = kCanSwap ? pair_at(blk * BLOCK_M + 8) : 0;
  if (kCanSwap && (row8 < 0 || row8 >= num_pairs)) {
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) sw[ng][h][r] = 0.f;
    uint4 xs[KU];
    int stage = 0;
    for (int c0 = c_begin; c0 < c_end; c0 += KU) {
      __syncwarp();
      issue_weights((stage + NST - 1) % NST, c0 + (NST - 1) * KU);
#pragma unroll
      for (int u = 0; u < KU; ++u)
        xs[u] = __ldg(reinterpret_cast<const uint4*>(a_row[0][0] + chunk_k(c0, u)));
      a_row[0][0] += 32 * KU;
      gptq::cp_async_wait<NST - 1>();
      __syncwarp();
      compute_n8(xs, stage, c0);
      stage = (stage + 1) % NST;
    }
    // into acc's layout: acc[0][ng][j][0 / 1] = row g, column 8t + j / 8t + 4 + j; lane 4(2t + q) + g / 2 holds
    // those columns (q = 0 / 1) in sw[ng][j / 2][2 (j % 2) + g % 2]; rows 8..15 are zero (padding, never stored)
    const int src0 = 4 * (2 * t) + (g >> 1), src1 = src0 + 4;
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float e0 = __shfl_sync(0xffffffffu, sw[ng][j >> 1][2 * (j & 1)], src0);
        const float o0 = __shfl_sync(0xffffffffu, sw[ng][j >> 1][2 * (j & 1) + 1], src0);
        const float e1 = __shfl_sync(0xffffffffu, sw[ng][j >> 1][2 * (j & 1)], src1);
        const float o1 = __shfl_sync(0xffffffffu, sw[ng][j >> 1][2 * (j & 1) + 1], src1);
        acc[0][ng][j][0] = g & 1 ? o0 : e0;
        acc[0][ng][j][1] = g & 1 ? o1 : e1;
        acc[0][ng][j][2] = acc[0][ng][j][3] = 0.f;
      }
  } else {
    Stage cur;
    int stage = 0;
    for (int c0 = c_begin; c0 < c_end; c0 += KU) {
      __syncwarp();  // every lane is done reading the slot refilled next
      issue_weights((stage + NST - 1) % NST, c0 + (NST - 1) * KU);  // past the end: not copied (never computed)
      load(cur, c0);
      gptq::cp_async_wait<NST - 1>();  // this stage's weights, scales and zeros have landed
      __syncwarp();  // ... including the pieces other lanes copied
      compute(cur, stage, c0);
      stage = (stage + 1) % NST;
    }
  }
  gptq::cp_async_wait<0>();

  // ---- WK > 1: the warp slices' sums meet in warp wk = 0 (the ring is free once every warp is past its loop)
  const bool owner = wk == 0;  // the warp that stores
  if constexpr (WK > 1) {
    constexpr int kAcc = MT * NG * 16;
    static_assert((WK - 1) * WM * WN * 32 * kAcc * 4 <= sizeof(ring), "the reduction reuses the ring");
    float* red = reinterpret_cast<float*>(ring) + lane;  // [WK-1][WM*WN][kAcc][32 lanes]: conflict-free
    __syncthreads();
    if (!owner) {
      float* dst = red + ((wk - 1) * WM * WN + wmn) * kAcc * 32;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) dst[32 * i] = (&acc[0][0][0][0])[i];
    }
    __syncthreads();
    if (owner) {
      for (int w = 1; w < WK; ++w) {  // fixed order
        const float* src = red + ((w - 1) * WM * WN + wmn) * kAcc * 32;
#pragma unroll
        for (int i = 0; i < kAcc; ++i) (&acc[0][0][0][0])[i] += src[32 * i];
      }
    }
  }

  // ---- epilogue: lane holds rows g, g+8 of each m tile x real columns n0 + 8t .. n0 + 8t + 7
  auto row_values = [&](int mt, int h, int ng, float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = acc[mt][ng][j][2 * h];          // mma column 2t   -> real n0 + 8t + j
      v[4 + j] = acc[mt][ng][j][2 * h + 1];  // mma column 2t+1 -> real n0 + 8t + 4 + j
    }
  };
  auto store = [&](int p, int col0, const float (&v)[8]) {
    const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
    uint4 o;
    o.x = gptq::pack2<kBf16>(v[0] * w, v[1] * w);
    o.y = gptq::pack2<kBf16>(v[2] * w, v[3] * w);
    o.z = gptq::pack2<kBf16>(v[4] * w, v[5] * w);
    o.w = gptq::pack2<kBf16>(v[6] * w, v[7] * w);
    *reinterpret_cast<uint4*>(out + static_cast<long long>(p) * N + col0) = o;
  };

  if (split_k == 1) {
    if (!owner) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair_of[mt][h];
        if (p < 0) continue;
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) {
          if (!n_ok[ng]) continue;
          float v[8];
          row_values(mt, h, ng, v);
          store(p, n0[ng] + 8 * t, v);
        }
      }
    return;
  }

  // split-K: publish this slice's partial tile, then the last CTA of the tile reduces in fixed order
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (pair_of[mt][h] < 0 || !owner) continue;
      const int slot = blk * BLOCK_M + (wm * MT + mt) * 16 + g + 8 * h;
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        if (!n_ok[ng]) continue;
        float v[8];
        row_values(mt, h, ng, v);
        float4* dst = reinterpret_cast<float4*>(
            partials + (static_cast<long long>(blockIdx.z) * capacity + slot) * N + n0[ng] + 8 * t);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  __shared__ int last;
  __threadfence();  // partials visible device-wide before the ticket
  __syncthreads();
  int* ticket = tickets + static_cast<long long>(blk) * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == split_k - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (and graph replay); thread 0 is an owner
  if (!owner) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = pair_of[mt][h];
      if (p < 0) continue;
      const int slot = blk * BLOCK_M + (wm * MT + mt) * 16 + g + 8 * h;
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        if (!n_ok[ng]) continue;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < split_k; ++s) {  // fixed order: bitwise the same result on every run
          const float4* src = reinterpret_cast<const float4*>(
              partials + (static_cast<long long>(s) * capacity + slot) * N + n0[ng] + 8 * t);
          const float4 lo = __ldcg(src), hi = __ldcg(src + 1);
          v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
          v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
        }
        store(p, n0[ng] + 8 * t, v);
      }
    }
}

__device__ __forceinline__ void require_dyn_smem(int bytes) {
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  if (dyn < static_cast<unsigned>(bytes)) __trap();  // launcher / kernel layout mismatch
}

// ================================================================================================================
// Prefill kernel (block_m 64 / 128, no act-order): every weight is dequantized ONCE per CTA into shared memory and
// both mma operands come from shared memory: through ldmatrix + mma.sync, or (kWg, sm_90a) read by wgmma itself.
//
// CTA = BM rows (= the align block size) x BN (128 or 256) columns x one K slice; 8 warps of WTM x WTN (32 x 32,
// 32 x 64 or 64 x 64). Per 32-k step: a ring of NS stages filled by cp.async holds the gathered activation rows
// A [BM][32], the raw qweight rows [32*bits/32][BN] and the step's scale [BN] / zero words; the step's weights are
// dequantized by all 256 threads (16-byte k-runs of one column each, natural k order) into one of two B tiles
// [BN n][32 k], while the warps run ldmatrix + mma.sync on the other (the previous step). A wider BN reads the
// gathered activation rows (L2 traffic BM*32*2 bytes per step) for more columns. A and B rows are 64 bytes;
// 16-byte chunk c of row r lives at c ^ ((r >> 1) & 3), so the 8 row addresses of every ldmatrix phase and every
// 16-byte store hit 8 different bank quads. That is also the layout wgmma's 64-byte swizzle mode expects
// (hopper.cuh), so with kWg the two warpgroups issue m64nNk16 ops on the same tiles asynchronously and dequantize the
// next step while the tensor cores work; N = BN (BM 128, warpgroup = 64 rows) or BN/2 (BM 64, warpgroup = columns).
// A pipeline stage is KT such 32-k steps laid out one after the other (and a B buffer KT tiles), so that one barrier
// and one wgmma wait cover KT steps of tensor work.
// Split-K: the same partials + ticket protocol as moe_gemm (fixed-order reduction by the last CTA).
template <int BM, int BN, int kBits, int NS, int KT, bool kWg>
struct TcSmem {
  static constexpr int kA = BM * 64;                  // bytes of one 32-k step's A tile
  static constexpr int kQ = kBits * BN * 4;           // qweight rows of one 32-k step
  static constexpr int kS = BN * 2;                   // scales
  static constexpr int kZ = BN * kBits / 8;           // zero words (bytes)
  // all multiples of 16; wgmma descriptors need every A and B tile 512-byte aligned (the 64-byte swizzle period)
  static constexpr int kStep = kWg ? (kA + kQ + kS + kZ + 511) / 512 * 512 : kA + kQ + kS + kZ;
  static constexpr int kStage = KT * kStep;
  static constexpr int kB = BN * 64;                  // one dequantized 32-k B tile
  static constexpr int kBuf = KT * kB;                // one B buffer (two: double-buffered)
  static constexpr int kAlign = kWg ? 1024 : 0;       // slack to align the dynamic shared-memory base
  static constexpr int kTotal = NS * kStage + 2 * kBuf + kAlign;
};

template <bool kBf16, int kBits, int BM, int BN, int NS, int KT, bool kWg, bool kPairA>
__global__ void __launch_bounds__(256)
moe_gemm_tc(const unsigned short* __restrict__ a,        // [M, K]
            const int* __restrict__ qweight,             // [E, K*bits/32, N]
            const unsigned short* __restrict__ scales,   // [E, groups, N] fp16 bits
            const int* __restrict__ qzeros,              // [E, groups, N*bits/32] or null
            const int* __restrict__ g_idx,               // unused (act-order runs moe_gemm)
            const float* __restrict__ topk_weights,      // [P] or null
            const int* __restrict__ sorted,              // [C]
            const int* __restrict__ expert_ids,          // [C / BM]
            const int* __restrict__ post_padded,         // [1]
            unsigned short* __restrict__ out,            // [P, N]
            float* __restrict__ partials,                // [S, C, N] when split_k > 1
            int* __restrict__ tickets,                   // [C / BM, N / BN] zeros when split_k > 1
            int K, int N, int group_len, int num_groups, int top_k, int num_pairs, int capacity,
            int split_k, int chunks_per_split, int num_experts) {
  using L = TcSmem<BM, BN, kBits, NS, KT, kWg>;
  constexpr int THREADS = 256;
  // warps along M and N. wgmma: warpgroup i (warps 4i..4i+3) computes rows 64i.. (BM 128: 64 x BN each) or columns
  // i*BN/2.. (BM 64: 64 x BN/2 each); its warp w holds 16 rows, so as a grid of warps that is WM x WN = BM/16 x 8/WM.
  constexpr int WM = kWg ? BM / 16 : BN == 256 ? 2 : BM / 32, WN = 8 / WM;
  constexpr int WTM = BM / WM, MTL = WTM / 16, WTN = BN / WN, NT = WTN / 8;
  static_assert(BM == 64 || BM == 128, "BM");
  static_assert(BN == 128 || BN == 256, "BN");
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  static_assert(!kWg || (gptq::kHaveWgmma && MTL == 1), "wgmma: sm_90a only");
  extern __shared__ uint4 smem_dyn[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_dyn);
  if constexpr (kWg) {
    smem += gptq::kept((L::kAlign - (gptq::smem_u32(smem) & (L::kAlign - 1))) & (L::kAlign - 1));
  }

  const int blk = blockIdx.x;
  pdl::enter();  // before the first global access (pdl.cuh)
  const int padded = __ldg(post_padded);
  const int expert = __ldg(expert_ids + blk);  // loaded together with the padded total (see moe_gemm)
  if (blk * BM >= padded || expert < 0 || expert >= num_experts) return;
  require_dyn_smem(L::kTotal);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = kWg ? warp % WM : warp / WN, wn = kWg ? warp / WM : warp % WN;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.y * BN;
  const long long rows_q = static_cast<long long>(K) * kBits / 32;
  const int* qw_e = qweight + expert * rows_q * N;
  const unsigned short* sc_e = scales + static_cast<long long>(expert) * num_groups * N;
  const int zwords = N * kBits / 32;
  const int* qz_e = qzeros ? qzeros + static_cast<long long>(expert) * num_groups * zwords : nullptr;
  constexpr int kSymZero = 1 << (kBits - 1);

  // ---- copy assignments, fixed per thread: a source pointer that advances by one 32-k chunk per issued step, and a
  // shared-memory offset within a step. Padding rows are zero-filled (no L2 traffic: with 20-60 rows per expert a
  // 64-row tile is largely padding); columns past N read column 0 (their sums are never stored). Steps are issued
  // in chunk order c_begin, c_begin + 1, ..., so nothing is recomputed per step: every warp issues its copies between
  // barriers, and index arithmetic was once half of the main loop's instructions.
  const int total_chunks = K / 32;
  const int c_begin = min(total_chunks, static_cast<int>(blockIdx.z) * chunks_per_split);
  const int c_end = min(total_chunks, c_begin + chunks_per_split);
  const int nsteps = (c_end - c_begin + KT - 1) / KT;  // pipeline steps of KT chunks (the last may be partial)
  const int chunks_per_group = group_len / 32;
  const int grp0 = c_begin / chunks_per_group;
  int grp_next = (grp0 + 1) * chunks_per_group;  // first chunk of the next quantization group

  // A: row r = tid / 4 + i * THREADS / 4, 16-byte chunk c = tid % 4; the rows of one thread share a swizzle key
  constexpr int A_PER = BM * 4 / THREADS;  // 16-byte A chunks per thread per step (1 or 2)
  static_assert((THREADS / 4) % 8 == 0, "the rows of one thread share a swizzle key");
  const unsigned short* a_src[A_PER];
  bool a_ok[A_PER];
  const unsigned a_dst = gptq::kept((tid >> 2) * 64 + (((tid & 3) ^ ((tid >> 3) & 3)) << 4));  // + i*(THREADS/4)*64
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int p = __ldg(sorted + blk * BM + (tid >> 2) + i * (THREADS / 4));
    a_ok[i] = p >= 0 && p < num_pairs;
    a_src[i] = a + (a_ok[i] ? static_cast<long long>(p / top_k) * K : 0) + 8 * (tid & 3) + c_begin * 32;
  }
  // qweight: kBits rows x BN/4 chunks of 16 bytes per step
  constexpr int Q_ROW = BN / 4, Q_PER = (kBits * Q_ROW + THREADS - 1) / THREADS;
  const long long q_step = static_cast<long long>(kBits) * N;  // qweight words per 32-k chunk
  const int* q_src[Q_PER];
#pragma unroll
  for (int i = 0; i < Q_PER; ++i) {
    const int idx = tid + i * THREADS, q_row = idx / Q_ROW, q_chunk = idx % Q_ROW;
    const bool ok = idx < kBits * Q_ROW && n_base + 4 * q_chunk < N;
    q_src[i] = qw_e + (ok ? static_cast<long long>(q_row) * N + n_base + 4 * q_chunk : 0) + c_begin * q_step;
  }
  // the group's scales (BN/8 chunks, the last threads) and zero words (BN*bits/128 chunks, the threads just below,
  // when there are zeros): one 16-byte copy per step for those threads, the source advancing by x_step bytes per group
  constexpr int S_CHUNKS = BN / 8, Z_CHUNKS = L::kZ / 16;
  const int s_chunk = tid - (THREADS - S_CHUNKS), z_chunk = tid - (THREADS - S_CHUNKS - Z_CHUNKS);
  const bool x_do = gptq::kept(s_chunk >= 0 || (qz_e != nullptr && z_chunk >= 0));
  const unsigned char* x_src;
  unsigned x_dst;
  long long x_step;
  if (s_chunk >= 0) {
    const int n = n_base + 8 * s_chunk < N ? n_base + 8 * s_chunk : 0;
    x_src = reinterpret_cast<const unsigned char*>(sc_e + static_cast<long long>(grp0) * N + n);
    x_dst = L::kA + L::kQ + s_chunk * 16;
    x_step = 2ll * N;
  } else {
    const int w = qz_e != nullptr && n_base + z_chunk * 128 / kBits < N ? n_base * kBits / 32 + 4 * z_chunk : 0;
    x_src = reinterpret_cast<const unsigned char*>(qz_e != nullptr ? qz_e + static_cast<long long>(grp0) * zwords + w
                                                                   : qw_e);
    x_dst = L::kA + L::kQ + L::kS + z_chunk * 16;
    x_step = 4ll * zwords;
  }

  // one 32-k step's copies into the step at shared address st; `in` false (the rest of a partial last step past the
  // slice end): the A rows and the scales zero-filled without reading, the raw weights left as they are (any codes
  // are finite), so the step adds nothing even in a slot never written before. Called with a literal, so each call
  // site compiles to straight copies.
  auto copy_step = [&](unsigned st, bool in) {
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      gptq::cp_async16(st + a_dst + i * (THREADS / 4) * 64, in ? a_src[i] : a, in && a_ok[i]);
      if (in) a_src[i] += 32;
    }
    if (x_do) gptq::cp_async16(st + x_dst, in ? x_src : reinterpret_cast<const unsigned char*>(qweight), in);
    if (!in) return;
#pragma unroll
    for (int i = 0; i < Q_PER; ++i) {
      if ((i + 1) * THREADS <= kBits * Q_ROW || tid + i * THREADS < kBits * Q_ROW)  // else the thread has no chunk
        if (!(kProbe & 1)) gptq::cp_async16(st + L::kA + (tid + i * THREADS) * 16, q_src[i], true);
      q_src[i] += q_step;
    }
  };
  // one 32-k step (chunk c, the next in order)
  auto issue_step = [&](unsigned st, int c) {
    if (KT == 1 || c < c_end) {  // with KT == 1 every issued step is inside the slice
      if (c >= grp_next) {
        grp_next += chunks_per_group;
        x_src += x_step;
      }
      copy_step(st, true);
    } else {
      copy_step(st, false);
    }
  };
  const unsigned smem_base = gptq::smem_u32(smem);
  auto issue = [&](int slot, int c) {
#pragma unroll
    for (int s = 0; s < KT; ++s) issue_step(smem_base + slot * L::kStage + s * L::kStep, c + s);
  };

  // ---- dequantization assignment: column dn, k-runs of 8 (4 runs per 32-k step, RPT per thread)
  constexpr int RPT = 4 * BN / THREADS;
  const int dn = tid % BN, dk = BN == THREADS ? 0 : tid / BN;  // runs RPT*dk .. RPT*dk + RPT-1
  unsigned char* bs = smem + NS * L::kStage;  // B buffers
  // run r of column dn goes to 16-byte chunk r ^ key of the column's 64-byte row: b_col (chunk key) XOR r * 16; the
  // wgmma variant's B tiles are 512-byte aligned (TcSmem), so there the XOR may follow the add of the tile address
  const unsigned b_col = gptq::kept(dn * 64 + (((dn >> 1) & 3) << 4));
  // The column's scale and zero (GroupConst) are read from the ring at the first step of each quantization group
  // and kept in registers until the next: dq_left counts the chunks left in the current group.
  gptq::GroupConst gc{};
  int dq_left = 0, dq_first = (grp0 + 1) * chunks_per_group - c_begin;

  // q: the step's raw words, loaded by dequant before any store (each st.shared is a compiler memory barrier, so
  // loads left between the stores would each wait out their latency in turn)
  auto dequant_step = [&](const unsigned char* st, unsigned bt, const u32 (&q)[RPT][kBits / 4]) {
    if (dq_left == 0) {
      const unsigned short sb = reinterpret_cast<const unsigned short*>(st + L::kA + L::kQ)[dn];
      int zc = kSymZero;
      if (qz_e) {
        const u32 zw = reinterpret_cast<const u32*>(st + L::kA + L::kQ + L::kS)[dn * kBits / 32];
        zc = kBits == 4 ? (zw >> (4 * (dn & 7))) & 15u : (zw >> (8 * (dn & 3))) & 255u;
      }
      gc = gptq::group_const<kBf16>(sb, zc);
      dq_left = dq_first;
      dq_first = chunks_per_group;
    }
    --dq_left;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int run = RPT * dk + i;  // k = 8*run .. 8*run+7 of the step
      const uint4 v = gptq::dequant8_natural<kBf16, kBits, kPairA>(q[i], gc);
      gptq::st_shared16(kWg ? (bt + b_col) ^ (run << 4) : bt + (b_col ^ (run << 4)), v);
    }
  };
  const unsigned bs_base = gptq::smem_u32(bs);
  auto dequant = [&](int slot, int buf) {
    u32 q[KT][RPT][kBits / 4];  // every raw word of the stage, in one batch of loads
#pragma unroll
    for (int s = 0; s < KT; ++s) {
      const u32* qs = reinterpret_cast<const u32*>(smem + slot * L::kStage + s * L::kStep + L::kA);
#pragma unroll
      for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int r = 0; r < kBits / 4; ++r) q[s][i][r] = qs[((RPT * dk + i) * (kBits / 4) + r) * BN + dn];
    }
#pragma unroll
    for (int s = 0; s < KT; ++s)
      dequant_step(smem + slot * L::kStage + s * L::kStep, bs_base + buf * L::kBuf + s * L::kB, q[s]);
  };

  float acc[MTL][NT][4];
#pragma unroll
  for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][j][r] = 0.f;

  // ldmatrix lane addresses: matrix q = lane / 8, row lane % 8; the swizzle key of all rows used is (lane >> 1) & 3
  const int lq = lane >> 3, lr = lane & 7, lkey = (lane >> 1) & 3;
  const int a_ld_row = wm * WTM + (lq & 1) * 8 + lr;  // + mt * 16
  const int a_ld_hi = lq >> 1;                        // k 8..15 half of a k16 step
  const int b_ld_row = wn * WTN + (lq >> 1) * 8 + lr;  // + jp * 16
  const int b_ld_hi = lq & 1;

  auto mma_step = [&](int slot, int buf) {
#pragma unroll
    for (int kq = 0; kq < 2 * KT; ++kq) {  // k16 slices: step kq / 2, half kk
      const int kk = kq & 1;
      const unsigned as_base = smem_base + slot * L::kStage + (kq >> 1) * L::kStep;
      const unsigned b_base = bs_base + buf * L::kBuf + (kq >> 1) * L::kB;
      u32 af[MTL][4];
#pragma unroll
      for (int mt = 0; mt < MTL; ++mt)
        gptq::ldmatrix_x4(af[mt], as_base + (a_ld_row + mt * 16) * 64 + (((2 * kk + a_ld_hi) ^ lkey) << 4));
#pragma unroll
      for (int jp = 0; jp < NT / 2; ++jp) {
        u32 bf[4];
        gptq::ldmatrix_x4(bf, b_base + (b_ld_row + jp * 16) * 64 + (((2 * kk + b_ld_hi) ^ lkey) << 4));
#pragma unroll
        for (int mt = 0; mt < MTL; ++mt) {
          gptq::mma16816<kBf16>(acc[mt][2 * jp], af[mt], bf[0], bf[1]);
          gptq::mma16816<kBf16>(acc[mt][2 * jp + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  };

  // wgmma (sm_90a): the warpgroup's 64 x WTN block, both operands read by the tensor cores from the swizzled
  // shared-memory tiles (A rows 64*wg.. for BM 128; B columns WTN*wg.. for BM 64); issued asynchronously, so the
  // dequantization of the next step runs while it computes.
  // The descriptors of slot 0 / buffer 0 are built once; a tile at byte offset o from them has start field + o / 16
  // (smem addresses < 256 KiB: the 14-bit field does not overflow), so a step's descriptors are one add each.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);  // warp-uniform to the compiler: descriptors in uniform registers
  const unsigned wg_a_off = BM == 128 ? wg * 64 * 64 : 0, wg_b_off = BM == 128 ? 0 : wg * WTN * 64;
  const unsigned a_desc0 = kWg ? gptq::wg_desc_sw64_lo(smem_base + wg_a_off) : 0u;
  const unsigned b_desc0 = kWg ? gptq::wg_desc_sw64_lo(bs_base + wg_b_off) : 0u;
  // BM 128: warpgroup 1 owns rows 64 .. 127 of the block. Padding sits at the end of each expert's rows, so they are
  // all padding when row 64 is (an expert's last block with at most 64 rows: about half the blocks when experts get
  // 64 +- 8 rows); that warpgroup then issues no wgmma, its sums stay zero and are never stored.
  bool wg_live = true;
  if constexpr (kWg && BM == 128) {
    const int p64 = __ldg(sorted + blk * BM + 64);
    wg_live = __shfl_sync(0xffffffffu, wg == 0 || (p64 >= 0 && p64 < num_pairs), 0);
  }
  auto wg_issue = [&](int slot, int buf) {
    if constexpr (kWg) {
      if (!wg_live) return;
      gptq::wg_fence_operands(acc[0]);
      gptq::wg_fence();
#pragma unroll
      for (int kq = 0; kq < 2 * KT; ++kq) {  // step kq / 2, k16 half kq & 1
        const unsigned ka = slot * L::kStage + (kq >> 1) * L::kStep + 32 * (kq & 1);
        const unsigned kb = buf * L::kBuf + (kq >> 1) * L::kB + 32 * (kq & 1);
        gptq::wgmma_m64k16<kBf16, WTN>(acc[0], gptq::wg_desc_sw64_at(a_desc0 + (ka >> 4)),
                                       gptq::wg_desc_sw64_at(b_desc0 + (kb >> 4)));
      }
      gptq::wg_commit();
    }
  };

  // ---- main loop (a step = KT chunks of 32 k): LOOK raw steps in flight, B double-buffered, one barrier per step.
  // Iteration `it` dequantizes step it+1 into B[(it+1)&1] while the tensor cores work on step it from B[it&1]. The
  // barrier at the top of iteration it orders: raw step it+1 landed for all; B[it&1] (dequantized in iteration it-1)
  // complete; every warp done with the raw slot refilled next.
  // mma.sync: LOOK = NS-1 (the slot refilled is step it-1's, done by then).
  // wgmma: the warpgroup's step-it group stays in flight across the next barrier (wait_group 1 after issuing it
  // only waits for step it-1), so the tensor cores need not drain between steps; hence LOOK = NS-2 (step it-1's A
  // may still be read when iteration it refills a slot: it refills step it-2's). Unless each warpgroup reads only
  // the B columns its own threads dequantize (BM 64 x BN 256: thread t writes column t, warpgroup i reads columns
  // 128i..), a second barrier makes sure no warpgroup still reads B[(it+1)&1] (step it-1) when it is rewritten.
  constexpr int LOOK = kWg ? NS - 2 : NS - 1;
  static_assert(LOOK >= 2, "raw step it+1 must be in flight while step it is dequantized");
  // kEarly: the wgmma path with the second barrier refills the slot of step it-1 right after that barrier (every
  // warpgroup is done with it there) with step it+LOOK+1, instead of the slot of step it-2 after the next top
  // barrier: one more step in flight. H200, 2026-12-04 14:07 UTC (benchmarks/ab_kernels.sh, 14 rows on 128 x 256
  // tiles, M = 1024 and 4096): 0.930 of the time on the geometric mean (Qwen2-57B-A14B down M = 1024 493 -> 453 us).
  // Issuing the copies after the dequantization instead took 1.35x as long: these tiles wait on their loads.
  constexpr bool kEarly = kWg && !(BM == 64 && BN == 256);  // the wgmma path with the second barrier
  constexpr int PRE = LOOK + kEarly;  // steps issued before the loop
#pragma unroll
  for (int s = 0; s < PRE; ++s) {
    if (s < nsteps) issue(s, c_begin + s * KT);
    gptq::cp_async_commit();
  }
  gptq::cp_async_wait<PRE - 1>();
  __syncthreads();
  if (nsteps > 0 && !(kProbe & 2)) dequant(0, 0);
  int rd = 0;  // raw slot of step it
  for (int it = 0; it < nsteps; ++it) {
    gptq::cp_async_wait<PRE - 2>();
    if constexpr (kWg) gptq::fence_proxy_async_smem();  // this thread's A copies and B stores -> wgmma reads
    __syncthreads();
    if constexpr (!kEarly) {
      const int nx = it + LOOK;
      if (nx < nsteps) issue(rd + LOOK < NS ? rd + LOOK : rd + LOOK - NS, c_begin + nx * KT);
      gptq::cp_async_commit();
    }
    const int rd1 = rd + 1 == NS ? 0 : rd + 1;
    if constexpr (kWg) {
      if (!(kProbe & 4)) wg_issue(rd, it & 1);
      gptq::wg_wait<1>();  // this warpgroup's step it-1 is done
      if constexpr (kEarly) {  // the second barrier, then the early refill
        __syncthreads();
        const int nx = it + PRE;
        if (nx < nsteps) issue(rd == 0 ? NS - 1 : rd - 1, c_begin + nx * KT);
        gptq::cp_async_commit();
      }
      if (it + 1 < nsteps && !(kProbe & 2)) dequant(rd1, (it + 1) & 1);
    } else {
      if (it + 1 < nsteps && !(kProbe & 2)) dequant(rd1, (it + 1) & 1);
      if (!(kProbe & 4)) mma_step(rd, it & 1);
    }
    rd = rd1;
  }
  gptq::cp_async_wait<0>();
  if constexpr (kWg) {
    gptq::wg_wait<0>();
    gptq::wg_fence_operands(acc[0]);
  }

  // ---- epilogue: lane holds rows g, g+8 of each m16 tile x columns 2t, 2t+1 of each n8 tile
  int pair_of[MTL][2], slot_of[MTL][2];
#pragma unroll
  for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int slot = blk * BM + wm * WTM + mt * 16 + g + 8 * h;
      const int p = __ldg(sorted + slot);
      pair_of[mt][h] = (p >= 0 && p < num_pairs) ? p : -1;
      slot_of[mt][h] = slot;
    }
  const int col_w = n_base + wn * WTN + 2 * t;  // + j * 8

  if (split_k == 1) {
#pragma unroll
    for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair_of[mt][h];
        if (p < 0) continue;
        const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int col = col_w + j * 8;
          if (col >= N) continue;
          *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + col) =
              gptq::pack2<kBf16>(acc[mt][j][2 * h] * w, acc[mt][j][2 * h + 1] * w);
        }
      }
    return;
  }

#pragma unroll
  for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (pair_of[mt][h] < 0) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = col_w + j * 8;
        if (col >= N) continue;
        *reinterpret_cast<float2*>(partials + (static_cast<long long>(blockIdx.z) * capacity + slot_of[mt][h]) * N +
                                   col) = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
      }
    }
  __shared__ int last;
  __threadfence();
  __syncthreads();
  int* ticket = tickets + static_cast<long long>(blk) * gridDim.y + blockIdx.y;
  if (tid == 0) last = atomicAdd(ticket, 1) == split_k - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = pair_of[mt][h];
      if (p < 0) continue;
      const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = col_w + j * 8;
        if (col >= N) continue;
        float v0 = 0.f, v1 = 0.f;
        for (int s = 0; s < split_k; ++s) {  // fixed order: bitwise the same result on every run
          const float2 x = __ldcg(reinterpret_cast<const float2*>(
              partials + (static_cast<long long>(s) * capacity + slot_of[mt][h]) * N + col));
          v0 += x.x;
          v1 += x.y;
        }
        *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + col) = gptq::pack2<kBf16>(v0 * w, v1 * w);
      }
    }
  if (tid == 0) *ticket = 0;
}

// ================================================================================================================
// Hopper kernel with the operands swapped (sm_90a, no act-order): out^T = W^T a^T. The weights are the wgmma M side,
// dequantized straight into registers as its A fragment (gptq_dequant.cuh, frag_chunk); the gathered activation rows
// of the block, T = 16 .. 128 of them (the align block size), are its N side, read by the tensor cores from shared
// memory. So a block of T rows costs T rows of tensor work (the tc kernel's wgmma M side is 64 or 128 rows, mostly
// padding when experts get 20-60 rows), and no dequantized tile goes through shared memory.
//
// CTA = T rows x BN = 128 * MW columns x one K slice, 8 warps = 2 warpgroups; warpgroup i owns columns
// i * 64 * MW .. as MW m64 tiles, in which warp w holds columns 16w + g and 16w + g + 8 (g = lane / 4, t = lane % 4).
// Per 32-k step a ring of NS stages (KT steps each) filled by cp.async holds the activation rows [T][32] (the 64-byte
// swizzled K-major layout of the tc kernel, now the wgmma B operand), the raw qweight rows [bits][BN] (rows padded by
// 32 bytes: the 8-bit lanes read two rows at once), the scales [BN] and the zero words. Each thread turns its
// columns' words into A fragments (two register sets, so that the next stage is dequantized while the tensor cores
// still read the current one), and the warpgroup issues MW x 2 m64nTk16 ops per step with them.
// Main loop as in the tc kernel's wgmma path: LOOK = NS - 2 stages in flight, one barrier per stage.
template <int T, int BN, int kBits, int NS, int KT>
struct WsSmem {
  static constexpr int kA = T * 64;            // activation rows of one 32-k step (a multiple of 512)
  static constexpr int kQRow = BN * 4 + 32;    // bytes per qweight row
  static constexpr int kQ = kBits * kQRow;
  static constexpr int kS = BN * 2;
  static constexpr int kZ = BN * kBits / 8;
  static constexpr int kStep = (kA + kQ + kS + kZ + 511) / 512 * 512;
  static constexpr int kStage = KT * kStep;
  static constexpr int kTotal = NS * kStage + 1024;  // + slack to align the base to 1024 bytes
};

template <bool kBf16, int kBits, int T, int MW, int NS, int KT>
__global__ void __launch_bounds__(256)
moe_gemm_ws(const unsigned short* __restrict__ a,        // [M, K]
            const int* __restrict__ qweight,             // [E, K*bits/32, N]
            const unsigned short* __restrict__ scales,   // [E, groups, N] fp16 bits
            const int* __restrict__ qzeros,              // [E, groups, N*bits/32] or null
            const int* __restrict__ g_idx,               // unused (act-order runs moe_gemm)
            const float* __restrict__ topk_weights,      // [P] or null
            const int* __restrict__ sorted,              // [C]
            const int* __restrict__ expert_ids,          // [C / T]
            const int* __restrict__ post_padded,         // [1]
            unsigned short* __restrict__ out,            // [P, N]
            float* __restrict__ partials,                // [S, C, N] when split_k > 1
            int* __restrict__ tickets,                   // [C / T, N / BN] zeros when split_k > 1
            int K, int N, int group_len, int num_groups, int top_k, int num_pairs, int capacity,
            int split_k, int chunks_per_split, int num_experts) {
  constexpr int BN = 128 * MW, THREADS = 256, NJ = T / 8, NC = 2 * MW;
  using L = WsSmem<T, BN, kBits, NS, KT>;
  static_assert(T == 16 || T == 32 || T == 64 || T == 128, "T");
  static_assert(MW == 1 || MW == 2, "MW");
  static_assert(gptq::kHaveWgmma, "moe_gemm_ws: sm_90a only");
  extern __shared__ uint4 smem_dyn[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_dyn);
  smem += (1024 - (gptq::smem_u32(smem) & 1023)) & 1023;

  const int blk = blockIdx.x;
  pdl::enter();  // before the first global access (pdl.cuh)
  const int padded = __ldg(post_padded);
  const int expert = __ldg(expert_ids + blk);
  if (blk * T >= padded || expert < 0 || expert >= num_experts) return;
  require_dyn_smem(L::kTotal);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wg = warp >> 2;
  const int n_base = blockIdx.y * BN;
  const long long rows_q = static_cast<long long>(K) * kBits / 32;
  const int* qw_e = qweight + expert * rows_q * N;
  const unsigned short* sc_e = scales + static_cast<long long>(expert) * num_groups * N;
  const int zwords = N * kBits / 32;
  const int* qz_e = qzeros ? qzeros + static_cast<long long>(expert) * num_groups * zwords : nullptr;
  constexpr int kSymZero = 1 << (kBits - 1);

  const int total_chunks = K / 32;
  const int c_begin = min(total_chunks, static_cast<int>(blockIdx.z) * chunks_per_split);
  const int c_end = min(total_chunks, c_begin + chunks_per_split);
  const int nsteps = (c_end - c_begin + KT - 1) / KT;
  const int chunks_per_group = group_len / 32;
  const int grp0 = c_begin / chunks_per_group;
  int grp_next = (grp0 + 1) * chunks_per_group;

  // ---- copy assignments (as in moe_gemm_tc): per-thread source pointers advanced one 32-k chunk per issued step.
  // Written out again on purpose: one helper struct for both kernels changed moe_gemm_tc's register allocation and
  // cost its 128 x 256 instance 3-7% (H200, 2026-12-03 17:45, same-run A/B, docs/performance-history.md).
  constexpr int A_CH = 4 * T, A_PER = (A_CH + THREADS - 1) / THREADS;
  const unsigned short* a_src[A_PER];
  bool a_ok[A_PER];
  const unsigned a_dst = (tid >> 2) * 64 + (((tid & 3) ^ ((tid >> 3) & 3)) << 4);  // + i * (THREADS / 4) * 64
#pragma unroll
  for (int i = 0; i < A_PER; ++i) {
    const int row = (tid >> 2) + i * (THREADS / 4);
    const int p = row < T ? __ldg(sorted + blk * T + row) : -1;
    a_ok[i] = p >= 0 && p < num_pairs;
    a_src[i] = a + (a_ok[i] ? static_cast<long long>(p / top_k) * K + 8 * (tid & 3) : 0) + c_begin * 32;
  }
  constexpr int Q_ROW = BN / 4, Q_CH = kBits * Q_ROW, Q_PER = (Q_CH + THREADS - 1) / THREADS;
  const long long q_step = static_cast<long long>(kBits) * N;
  const int* q_src[Q_PER];
  bool q_ok[Q_PER];
  unsigned q_dst[Q_PER];
#pragma unroll
  for (int i = 0; i < Q_PER; ++i) {
    const int idx = tid + i * THREADS, q_row = idx / Q_ROW, q_chunk = idx % Q_ROW;
    q_ok[i] = idx < Q_CH && n_base + 4 * q_chunk < N;
    q_src[i] = qw_e + (q_ok[i] ? static_cast<long long>(q_row) * N + n_base + 4 * q_chunk : 0) + c_begin * q_step;
    q_dst[i] = L::kA + q_row * L::kQRow + q_chunk * 16;
  }
  constexpr int S_CHUNKS = BN / 8, Z_CHUNKS = L::kZ / 16;
  const int s_chunk = tid - (THREADS - S_CHUNKS);
  const bool s_do = s_chunk >= 0;
  const bool s_ok = s_do && n_base + 8 * s_chunk < N;
  const unsigned short* s_src = sc_e + static_cast<long long>(grp0) * N + (s_ok ? n_base + 8 * s_chunk : 0);
  const int z_thread = tid - (THREADS - S_CHUNKS - Z_CHUNKS);
  const bool zc_do = z_thread >= 0 && z_thread < Z_CHUNKS;
  const bool zc_ok = zc_do && qz_e != nullptr && n_base + z_thread * 128 / kBits < N;
  const int z_step = zc_ok ? zwords : 0;
  const int* z_src = zc_ok ? qz_e + static_cast<long long>(grp0) * zwords + n_base * kBits / 32 + 4 * z_thread : qw_e;

  auto copy_step = [&](unsigned st, bool in) {
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      if ((i + 1) * THREADS <= A_CH || tid + i * THREADS < A_CH)
        gptq::cp_async16(st + a_dst + i * (THREADS / 4) * 64, in ? a_src[i] : a, in && a_ok[i]);
      if (in) a_src[i] += 32;
    }
#pragma unroll
    for (int i = 0; i < Q_PER; ++i) {
      if ((i + 1) * THREADS <= Q_CH || tid + i * THREADS < Q_CH)
        gptq::cp_async16(st + q_dst[i], in ? q_src[i] : qweight, in && q_ok[i]);
      if (in) q_src[i] += q_step;
    }
    if (s_do) gptq::cp_async16(st + L::kA + L::kQ + s_chunk * 16, in ? s_src : scales, in && s_ok);
    if (zc_do) gptq::cp_async16(st + L::kA + L::kQ + L::kS + z_thread * 16, in ? z_src : qweight, in && zc_ok);
  };
  auto issue_step = [&](unsigned st, int c) {
    if (c < c_end) {
      if (c >= grp_next) {
        grp_next += chunks_per_group;
        s_src += N;
        z_src += z_step;
      }
      copy_step(st, true);
    } else {
      copy_step(st, false);
    }
  };
  const unsigned smem_base = gptq::smem_u32(smem);
  auto issue = [&](int slot, int c) {
#pragma unroll
    for (int s = 0; s < KT; ++s) issue_step(smem_base + slot * L::kStage + s * L::kStep, c + s);
  };

  // ---- A fragments: column ci = 2 * mw + h is tile column 16 * (warp % 4) + g + 8h of m64 tile mw
  int col[NC];
#pragma unroll
  for (int ci = 0; ci < NC; ++ci) col[ci] = wg * 64 * MW + (ci >> 1) * 64 + 16 * (warp & 3) + g + 8 * (ci & 1);
  const u32 sel = gptq::frag_select(kBits, t);
  gptq::GroupConst fc[NC];
  int group_left = 0;  // chunks left in the group of the constants in fc
  using Frag = u32[KT][MW][2][4];  // [step][m64 tile][k16 half][register]
  auto dequant = [&](int slot, int c0, Frag& fr) {
#pragma unroll
    for (int s = 0; s < KT; ++s) {
      const unsigned char* st = smem + slot * L::kStage + s * L::kStep;
      if (group_left == 0) {  // first chunk of a group (or of the slice): this step's scales and zeros
        const int c = c0 + s;
        group_left = chunks_per_group - c % chunks_per_group;
#pragma unroll
        for (int ci = 0; ci < NC; ++ci) {
          const unsigned short sb = reinterpret_cast<const unsigned short*>(st + L::kA + L::kQ)[col[ci]];
          int zc = kSymZero;
          if (qz_e) {
            const u32 zw = reinterpret_cast<const u32*>(st + L::kA + L::kQ + L::kS)[col[ci] * kBits / 32];
            zc = kBits == 4 ? (zw >> (4 * (col[ci] & 7))) & 15u : (zw >> (8 * (col[ci] & 3))) & 255u;
          }
          fc[ci] = gptq::group_const<kBf16>(sb, zc);
        }
      }
      --group_left;
      const u32* qs = reinterpret_cast<const u32*>(st + L::kA);
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) {
        u32 f0[4], f1[4];  // columns g and g + 8
        gptq::frag_chunk<kBf16, kBits>(qs + col[2 * mw], L::kQRow / 4, t, sel, fc[2 * mw], f0);
        gptq::frag_chunk<kBf16, kBits>(qs + col[2 * mw + 1], L::kQRow / 4, t, sel, fc[2 * mw + 1], f1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          fr[s][mw][h][0] = f0[2 * h];
          fr[s][mw][h][1] = f1[2 * h];
          fr[s][mw][h][2] = f0[2 * h + 1];
          fr[s][mw][h][3] = f1[2 * h + 1];
        }
      }
    }
  };

  float acc[MW][NJ][4];
#pragma unroll
  for (int mw = 0; mw < MW; ++mw)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mw][j][r] = 0.f;

  auto wg_issue = [&](int slot, const Frag& fr) {
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) gptq::wg_fence_operands(acc[mw]);
    gptq::wg_fence();
#pragma unroll
    for (int s = 0; s < KT; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned long long desc = gptq::wg_desc_sw64(smem_base + slot * L::kStage + s * L::kStep + 32 * h);
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) gptq::wgmma_m64k16_rs<kBf16, T>(acc[mw], fr[s][mw][h], desc);
      }
    gptq::wg_commit();
  };

  constexpr int LOOK = NS - 2;
  static_assert(LOOK >= 2, "raw step it+1 must be in flight while step it is dequantized");
#pragma unroll
  for (int s = 0; s < LOOK; ++s) {
    if (s < nsteps) issue(s, c_begin + s * KT);
    gptq::cp_async_commit();
  }
  Frag fr0, fr1;
  gptq::cp_async_wait<LOOK - 1>();
  __syncthreads();
  if (nsteps > 0) dequant(0, c_begin, fr0);
  int rd = 0;
  // iteration it: tensor work of stage it from `cur` while stage it+1 is dequantized into `nxt`
  auto body = [&](int it, const Frag& cur, Frag& nxt) {
    gptq::cp_async_wait<LOOK - 2>();
    gptq::fence_proxy_async_smem();  // this thread's activation copies -> wgmma reads
    __syncthreads();
    const int nx = it + LOOK;
    if (nx < nsteps) issue(rd + LOOK < NS ? rd + LOOK : rd + LOOK - NS, c_begin + nx * KT);
    gptq::cp_async_commit();
    wg_issue(rd, cur);
    gptq::wg_wait<1>();  // stage it-1's ops are done: `nxt` may be overwritten
    const int rd1 = rd + 1 == NS ? 0 : rd + 1;
    if (it + 1 < nsteps) dequant(rd1, c_begin + (it + 1) * KT, nxt);
    rd = rd1;
  };
  for (int it = 0; it < nsteps; it += 2) {
    body(it, fr0, fr1);
    if (it + 1 < nsteps) body(it + 1, fr1, fr0);
  }
  gptq::cp_async_wait<0>();
  gptq::wg_wait<0>();
#pragma unroll
  for (int mw = 0; mw < MW; ++mw) gptq::wg_fence_operands(acc[mw]);

  // ---- epilogue: acc[mw][j][r] = column col[2 mw + (r >> 1)], block row 8j + 2t + (r & 1). Lanes g and g ^ 1
  // swap one value so that each stores two adjacent columns: even g columns g, g + 1; odd g columns g + 7, g + 8.
  const bool odd = g & 1;
  int pair_of[NJ][2];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = __ldg(sorted + blk * T + 8 * j + 2 * t + e);
      pair_of[j][e] = (p >= 0 && p < num_pairs) ? p : -1;
    }
  // the two columns this lane writes for (mw, j, e): v = (left, right) at column c2
  auto columns = [&](int mw, int j, int e, float& left, float& right) {
    const float lo = acc[mw][j][e], hi = acc[mw][j][2 + e];  // columns col[2mw] and col[2mw] + 8
    const float other = __shfl_xor_sync(0xffffffffu, odd ? lo : hi, 4);
    left = odd ? other : lo;
    right = odd ? hi : other;
  };
  const int c2_off = odd ? 7 : 0;

  if (split_k == 1) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int p = pair_of[j][e];
        const float w = (p >= 0 && topk_weights) ? __ldg(topk_weights + p) : 1.f;
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) {
          float left, right;
          columns(mw, j, e, left, right);
          const int c2 = n_base + col[2 * mw] + c2_off;
          if (p >= 0 && c2 < N)
            *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + c2) = gptq::pack2<kBf16>(left * w, right * w);
        }
      }
    return;
  }

#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int slot = blk * T + 8 * j + 2 * t + e;
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) {
        float left, right;
        columns(mw, j, e, left, right);
        const int c2 = n_base + col[2 * mw] + c2_off;
        if (pair_of[j][e] >= 0 && c2 < N)
          *reinterpret_cast<float2*>(partials + (static_cast<long long>(blockIdx.z) * capacity + slot) * N + c2) =
              make_float2(left, right);
      }
    }
  __shared__ int last;
  __threadfence();
  __syncthreads();
  int* ticket = tickets + static_cast<long long>(blk) * gridDim.y + blockIdx.y;
  if (tid == 0) last = atomicAdd(ticket, 1) == split_k - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = pair_of[j][e];
      if (p < 0) continue;
      const int slot = blk * T + 8 * j + 2 * t + e;
      const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) {
        const int c2 = n_base + col[2 * mw] + c2_off;
        if (c2 >= N) continue;
        float v0 = 0.f, v1 = 0.f;
        for (int s = 0; s < split_k; ++s) {  // fixed order: bitwise the same result on every run
          const float2 x = __ldcg(
              reinterpret_cast<const float2*>(partials + (static_cast<long long>(s) * capacity + slot) * N + c2));
          v0 += x.x;
          v1 += x.y;
        }
        *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + c2) = gptq::pack2<kBf16>(v0 * w, v1 * w);
      }
    }
  if (tid == 0) *ticket = 0;
}

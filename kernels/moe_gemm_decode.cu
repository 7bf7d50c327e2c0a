// Decode GEMM kernel `moe_gemm` (kind "reg" in cupy_moe/configs.py): 16- and 32-row blocks, and act-order weights
// at every block size. Each lane dequantizes its B fragments in registers from a warp-private cp.async ring and runs
// mma.sync m16n8k16; a 16-row block with at most 8 rows swaps the mma operands (weights as the m16 side). Arguments
// and tiling: moe_gemm_common.cuh. One pair per block (this kernel only; sorted and post_padded null): block b holds
// pair b alone and expert_ids is the pairs' expert ids [P] (topk_ids itself), C = P * B_M; at M = 1 this saves the
// align launch.
//
// Warp = MT m16 tiles x NG groups of 32 columns.
// Column mapping (why every load and store is 16 bytes): in a 32-column group, n8 tile j's mma column g (the
// lane's B column, g = lane / 4) is real column n0 + 4g + j. So a lane's B words for tiles j = 0..3 are the 4
// consecutive columns n0+4g .. n0+4g+3 (one uint4 load per K row), and the lane's accumulators (mma columns 2t,
// 2t+1 of each tile, t = lane % 4) are the 8 consecutive real columns n0+8t .. n0+8t+7 (one uint4 store).
// K mapping: a lane loads the 8 codes k0+8t .. +7 of its columns (one int32 for 4-bit) and the 8 activations of
// the same k (one uint4); gptq_dequant.cuh orders both the same way.

#include "moe_gemm_common.cuh"

// GM (group mode): 0 = scale/zero per 32-k chunk (any G multiple of 32); 1 = one group per pipeline stage and every
// stage whole (the launcher guarantees G % (32*KU) == 0, K % (32*KU) == 0 and stage-aligned split-K slices), so
// scale/zero are loaded and unpacked once per stage and the scale is applied to the stage's fp32 sums; 2 = act-order
// (g_idx: every k has its own group).
// MINB: CTAs per SM the compiler must fit in registers (1: no bound), chosen by configs.GemmConfig.min_ctas: 4 for the
// 16 x 128 decode shape in group modes 0 and 1 (nvcc 13.0, sm_90a: 120-128 registers, no spills), 3 for it with
// act-order and for the 32 x 128 shape (at most 168 registers). The kernel is latency-bound (Nsight Compute at 3
// CTAs: about one eligible warp per scheduler). H200, same-run A/B with the same splits, 4-bit mode 1: 4 CTAs per SM
// took 0.89-0.97 of the 3-CTA time on 12 of 32 decode rows and 0.97-1.01 on 19; with the split estimate
// included: 4-bit G = 32 0.83-0.91 on 7 of 8 rows, 8-bit 0.84-1.06 (geometric mean 0.98), act-order 0.96-1.18.
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
  // With 16-row blocks it also holds the partial tile of a cluster split-K ([16][BLOCK_N] fp32) after the loop.
  constexpr bool kClusterK = BLOCK_M == 16;
  constexpr int RING_U4 = NST * WORDS * THREADS, TILE_U4 = kClusterK ? BLOCK_M * BLOCK_N / 4 : 0;
  __shared__ uint4 ring[RING_U4 > TILE_U4 ? RING_U4 : TILE_U4];
  // A warp's copy instruction covers four 128-byte row runs (one per t). Lane l copies piece l: row l / 8, the
  // 16 bytes that reader (g, t) = ((l % 8 - 2 * (l / 8)) % 8, l / 8) needs, so each quarter-warp reads one whole run
  // and the warp writes 512 contiguous bytes; the reader finds its piece at 8t + (g + 2t) % 8 (the 8 lanes of a
  // 16-byte shared-memory phase hit 8 different bank quads). Lanes read what other lanes copied, hence the two
  // __syncwarp() in the main loop. (H200, same-run A/B of the two kernels: against each lane copying its own
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
  // (Loaded into registers one stage ahead instead, the register copy at the end of each iteration would wait
  // for the load issued in the same iteration: every stage would pay a full HBM latency.)
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
      const bool ok = (kWhole ? c0 : c0 + u) < c_end;
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
          if constexpr (kActOrder) {
            gptq::dequant8<kBf16, kBits>(q, s_bits[col], z[col], b);
          } else {
            gptq::dequant8u<kBf16, kBits, !kFold>(q, gcs[ng][col], b);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if constexpr (kFold) {
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
  constexpr bool kCanSwap = BLOCK_M == 16 && !kActOrder;
  // SWC: with the scale folded and the activations in pair order, a stage's sums of one m16 tile are 4 independent
  // mma chains (k16 step i of the stage adds to chain i % 4), added in a fixed order before the scaling, instead of
  // one chain of 8 dependent mmas. fp16, H200, same run, five rounds: 0.93-1.01 of the time on the 32 down rows at
  // M = 1, 2, 8 and 16 (median 0.97). bf16, H100, two runs of three and five rounds against one chain: 0.83-1.04 of
  // the time on the 40 down rows at M = 1-16 (median 0.97), the whole layer 0.94-1.01 (median 0.99). Only where a
  // stage has 8 k16 steps (KU 4): in the 64-k stages of rule 7's shape each of 4 chains would be one mma, and one chain
  // took 0.96-1.00 of the time of 4 on its down rows at M = 1-4 (2 chains: 0.97-1.01; H100, five rounds, both
  // dtypes). With the activations in natural order (4 PRMT per chunk between the mmas) 2 or 4 chains gained nothing
  // (H100, gate/up rows at M = 1: median 1.00 with 2 chains).
  constexpr int SWC = kFold && kPairA && KU >= 4 ? 4 : 1;
  float sw[NG][2][4];
  auto compute_n8 = [&](const uint4 (&xs)[KU], int stage, int c0) {
    float part[kFold ? SWC : 1][kFold ? NG : 1][2][4];
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
            float (&d)[4] = kFold ? part[(2 * u + kh) % SWC][kFold ? ng : 0][h] : sw[ng][h];
            if (kFold && 2 * u + kh < SWC) {  // the chain's first mma
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
          for (int r = 0; r < 4; ++r) {
            float v = part[0][ng][h][r];
#pragma unroll
            for (int c = 1; c < SWC; ++c) v += part[c][ng][h][r];
            sw[ng][h][r] = fmaf(v, sf[2 * h + (r >> 1)], sw[ng][h][r]);
          }
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
    gptq::store8<kBf16>(out + static_cast<long long>(p) * N + col0, v, w);
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

  // split-K inside a cluster (split_k.cuh; the launcher makes the tile's slices one cluster where it can): each CTA
  // leaves its partial tile [BLOCK_M][BLOCK_N] fp32 in its ring, then the slices' CTAs take the tile's 8-column
  // pieces in turn and sum each over the slices in slice order.
  if (kClusterK && splitk::cluster_size() == split_k) {
    constexpr int PIECES = BLOCK_N / 8;  // 8-column pieces per tile row (32 bytes of fp32)
    float4* tile = reinterpret_cast<float4*>(ring);
    __syncthreads();  // every warp is done with the ring (and with the WK reduction, which used it)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (pair_of[mt][h] < 0 || !owner) continue;
        const int r = (wm * MT + mt) * 16 + g + 8 * h;
#pragma unroll
        for (int ng = 0; ng < NG; ++ng) {
          float v[8];
          row_values(mt, h, ng, v);
          float4* dst = tile + 2 * (r * PIECES + (wn * NG + ng) * 4 + t);
          dst[0] = make_float4(v[0], v[1], v[2], v[3]);
          dst[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
      }
    splitk::cluster_sync();
    const unsigned tile_at = gptq::smem_u32(tile);
    for (int u = blockIdx.z * THREADS + threadIdx.x; u < BLOCK_M * PIECES; u += split_k * THREADS) {
      const int r = u / PIECES, col = blockIdx.y * BLOCK_N + 8 * (u % PIECES);
      const int p = pair_at(blk * BLOCK_M + r);
      if (p < 0 || p >= num_pairs || col >= N) continue;  // rows the writers skipped are never read
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int s = 0; s < split_k; ++s) {  // fixed order: bitwise the workspace path's sums
        const float4 lo = splitk::ld_cluster16(tile_at + 32u * u, s);
        const float4 hi = splitk::ld_cluster16(tile_at + 32u * u + 16u, s);
        v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
        v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
      }
      store(p, col, v);
    }
    splitk::cluster_sync();  // no CTA exits while another still reads its tile
    return;
  }

  // split-K (split_k.cuh's ticket protocol): publish this slice's partial tile, then the last CTA of the tile reduces
  // in fixed order. The workspace writes and reads are this kernel's own copy: split_k.cuh's publish / sum_slices
  // change its register allocation and instruction order (NVRTC 12.9), and its code must stay as measured.
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
  if (!splitk::last_arrival(tickets, split_k, last)) return;
  splitk::reset_ticket(tickets);  // thread 0 is an owner
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

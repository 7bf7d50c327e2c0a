// Fused GPTQ MoE GEMM: out[p, :] = a[p // top_k, :] @ W[expert(p)] (* topk_weights[p]) for every pair p of the
// aligned pair list, straight from the stacked raw GPTQ layout (no repacking), one launch per phase.
//
// Shapes: a [M, K] fp16/bf16; qweight [E, K*bits/32, N] int32 (packed along K); scales [E, ceil(K/G), N] fp16;
// qzeros [E, ceil(K/G), N*bits/32] int32 real zeros or null (symmetric: zero = 2^(bits-1)); g_idx [E, K] or null;
// sorted [C] pair ids (sentinel P), expert_ids [C/B_M], post_padded [1]; out [P, N] in a's dtype.
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

using gptq::u32;

// GM (group mode): 0 = scale/zero per 32-k chunk (any G multiple of 32); 1 = one group per pipeline stage (the
// launcher guarantees G % (32*KU) == 0 and stage-aligned split-K slices), so scale/zero are loaded and unpacked once
// per stage; 2 = act-order (g_idx: every k has its own group).
template <bool kBf16, int kBits, int MT, int WM, int WN, int NG, int KU, int STAGES, int GM>
__global__ void __launch_bounds__(WM * WN * 32)
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
         int split_k, int chunks_per_split) {
  constexpr int BLOCK_M = WM * MT * 16;
  constexpr int BLOCK_N = WN * NG * 32;
  constexpr int WPR = kBits / 4;  // qweight words per lane per column per 32-k chunk
  constexpr bool kActOrder = GM == 2;
  constexpr int KS = GM == 1 ? 1 : KU;  // scale/zero sets per stage
  const int blk = blockIdx.x;
  if (blk * BLOCK_M >= __ldg(post_padded)) return;  // past the padded total: nothing to do
  const int expert = __ldg(expert_ids + blk);
  if (expert < 0) return;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane >> 2, t = lane & 3;

  // rows of this lane: (mt, h) -> block row (wm*MT + mt)*16 + g + 8h
  const unsigned short* a_row[MT][2];
  int pair_of[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int slot = blk * BLOCK_M + (wm * MT + mt) * 16 + g + 8 * h;
      const int p = __ldg(sorted + slot);
      const bool valid = p >= 0 && p < num_pairs;  // padding rows hold the sentinel P
      pair_of[mt][h] = valid ? p : -1;
      a_row[mt][h] = valid ? a + static_cast<long long>(p / top_k) * K + 8 * t : nullptr;
    }

  int n0[NG];
  bool n_ok[NG];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    n0[ng] = blockIdx.y * BLOCK_N + (wn * NG + ng) * 32;
    n_ok[ng] = n0[ng] < N;  // N % 32 == 0, so a group is all in or all out
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
  const int c_begin = min(total_chunks, static_cast<int>(blockIdx.z) * chunks_per_split);
  const int c_end = min(total_chunks, c_begin + chunks_per_split);

  // One stage = KU chunks of 32 k: activations, weight words, and (without act-order) scales and zeros.
  // Weights: a lane-private ring of STAGES stages in shared memory filled by cp.async (16 bytes per lane and
  // request, no register cost while in flight, so many stages stay in flight). Each lane reads back only what it
  // copied, so no barrier is needed. Slot layout [stage][word][lane]: a warp touches 512 contiguous bytes.
  constexpr int THREADS = WM * WN * 32;
  constexpr int WORDS = KU * NG * WPR;
  // 8-bit stages hold twice the bytes: half as many (at least 2, so loads overlap compute) keep the bytes in
  // flight and the ring under the 48 KiB static shared-memory limit.
  constexpr int NST = kBits == 8 ? ((STAGES + 1) / 2 > 2 ? (STAGES + 1) / 2 : 2) : STAGES;
  __shared__ uint4 ring[NST * WORDS * THREADS];
  auto ring_slot = [&](int stage, int u, int ng, int r) -> uint4* {
    return ring + ((stage * KU + u) * NG * WPR + ng * WPR + r) * THREADS + threadIdx.x;
  };
  auto issue_weights = [&](int stage, int c0) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int c = c0 + u;
      const int k0 = c * 32;
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        const bool ok = c < c_end && n_ok[ng];
#pragma unroll
        for (int r = 0; r < WPR; ++r) {
          const int* src = ok ? qw_e + static_cast<long long>(k0 / (32 / kBits) + WPR * t + r) * N + n0[ng] + 4 * g
                              : qw_e;
          gptq::cp_async16(ring_slot(stage, u, ng, r), src, ok);
        }
      }
    }
    gptq::cp_async_commit();
  };

  // Activations, scales and zeros: registers, one stage ahead.
  struct Stage {
    uint4 x[KU][MT][2];
    uint2 s[KS][NG];
    u32 z[KS][NG];
  };
  auto load = [&](Stage& st, int c0) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int c = c0 + u;
      const bool in = c < c_end;
      const int k0 = c * 32;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          st.x[u][mt][h] = (in && a_row[mt][h]) ? __ldg(reinterpret_cast<const uint4*>(a_row[mt][h] + k0))
                                                : make_uint4(0, 0, 0, 0);
      const int grp = k0 / group_len;
#pragma unroll
      for (int ng = 0; ng < NG; ++ng) {
        const bool ok = in && n_ok[ng];
        if constexpr (!kActOrder) {
          if (u >= KS) continue;
          st.s[u][ng] = ok ? __ldg(reinterpret_cast<const uint2*>(sc_e + static_cast<long long>(grp) * N + n0[ng] + 4 * g))
                           : make_uint2(0, 0);
          st.z[u][ng] = (ok && qz_e) ? static_cast<u32>(__ldg(qz_e + static_cast<long long>(grp) * zwords +
                                                                  (n0[ng] + 4 * g) * kBits / 32))
                                     : 0u;
        }
      }
    }
  };

  // per-(set, ng, col) dequantization constants, built from the stage's scale/zero words
  auto unpack = [&](const Stage& st, int u, int ng, int col) -> gptq::GroupConst {
    const u32 sw = col < 2 ? st.s[u][ng].x : st.s[u][ng].y;
    const unsigned short sb = static_cast<unsigned short>(sw >> (16 * (col & 1)));
    int zc = kSymZero;
    if (qz_e) zc = kBits == 4 ? (st.z[u][ng] >> (16 * (g & 1) + 4 * col)) & 15u : (st.z[u][ng] >> (8 * col)) & 255u;
    return gptq::group_const<kBf16>(sb, zc);
  };

  auto compute = [&](const Stage& st, int stage, int c0) {
    gptq::GroupConst gcs[NG][4];
    if constexpr (GM == 1) {  // once per stage: every chunk of the stage is in the same group
#pragma unroll
      for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int col = 0; col < 4; ++col) gcs[ng][col] = unpack(st, 0, ng, col);
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int c = c0 + u;
      if (c >= c_end) break;
      const int k0 = c * 32;
      u32 a0[MT][4], a1[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) gptq::a_operands<kBits>(st.x[u][mt][0], st.x[u][mt][1], a0[mt], a1[mt]);
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
        if (!n_ok[ng]) continue;
        unsigned short s_bits[4][8];
        int z[4][8];
        if constexpr (GM == 0) {
#pragma unroll
          for (int col = 0; col < 4; ++col) gcs[ng][col] = unpack(st, u, ng, col);
        } else if constexpr (kActOrder) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint2 sv = __ldg(reinterpret_cast<const uint2*>(sc_e + static_cast<long long>(gk[j]) * N + n0[ng] + 4 * g));
            const u32 zw = qz_e ? static_cast<u32>(__ldg(qz_e + static_cast<long long>(gk[j]) * zwords +
                                                         (n0[ng] + 4 * g) * kBits / 32))
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
        for (int r = 0; r < WPR; ++r) wq[r] = *ring_slot(stage, u, ng, r);
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
            gptq::dequant8u<kBf16, kBits>(q, gcs[ng][col], b);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            gptq::mma16816<kBf16>(acc[mt][ng][col], a0[mt], b[0], b[1]);
            gptq::mma16816<kBf16>(acc[mt][ng][col], a1[mt], b[2], b[3]);
          }
        }
      }
    }
  };

  // Pipeline: STAGES-1 weight stages in flight ahead of the one computed; activations one stage ahead.
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) issue_weights(s, c_begin + s * KU);
  Stage cur, nxt;
  load(cur, c_begin);
  int stage = 0;
  for (int c0 = c_begin; c0 < c_end; c0 += KU) {
    issue_weights((stage + NST - 1) % NST, c0 + (NST - 1) * KU);  // past the end: zero-fill, no read
    if (c0 + KU < c_end) load(nxt, c0 + KU);
    gptq::cp_async_wait<NST - 1>();  // this stage's weights have landed
    compute(cur, stage, c0);
    cur = nxt;
    stage = (stage + 1) % NST;
  }
  gptq::cp_async_wait<0>();

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
      if (pair_of[mt][h] < 0) continue;
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
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (and graph replay)
}

// Swapped-operand GEMM kernel `moe_gemm_swapped` (kind "swapped" in cupy_moe/configs; sm_90a only, no act-order):
// out^T = W^T a^T. Arguments and tiling: moe_gemm_common.cuh. The weights are the wgmma M side, dequantized
// straight into registers as its A fragment (gptq_dequant.cuh, frag_words); the gathered activation rows
// of the block, T = 16 .. 128 of them (the align block size), are its N side, read by the tensor cores from shared
// memory. So a block of T rows costs T rows of tensor work (the tc kernel's wgmma M side is 64 or 128 rows, mostly
// padding when experts get 20-60 rows), and no dequantized tile goes through shared memory.
//
// CTA = T rows x BN = 128 * MW columns x one K slice, 8 warps = 2 warpgroups; warpgroup i owns columns
// i * 64 * MW .. as MW m64 tiles. The m64 rows are mapped to columns so that each lane's 2 * MW columns are adjacent:
// row 16w + g + 8h of tile mw (warp w of the warpgroup, g = lane / 4, t = lane % 4) is column
// 16 * MW * w + 2 * MW * g + 2 * mw + h of the warpgroup's. So one 16-byte (MW 2) or 8-byte load of a qweight row
// gives the lane the words of all its columns, the 8 lane groups of a warp read 8 adjacent pieces (whole
// shared-memory wavefronts; the 4 lanes of a group read the same piece), and each lane stores its columns' outputs
// of a row as one piece. (H100, same-run A/B on 9 rows at 32-row blocks: 0.89-0.90 of the time of a lane holding
// columns g and g + 8 of each tile, whose raw words came in 4-byte loads that used a quarter of each wavefront.)
// Per 32-k step a ring of NS stages (KT steps each) filled by cp.async holds the activation rows [T][32] (the 64-byte
// swizzled K-major layout of the tc kernel, now the wgmma B operand), the raw qweight rows [bits][BN], the scales
// [BN] and the zero words. Each thread turns its columns' words into A fragments, one 32-k step at a time into one of
// two register sets, so that the next step is dequantized while the tensor cores still read the current one (whatever
// KT: a set per step of the stage would cost one CTA per SM), and the warpgroup issues MW x 2 m64nTk16 ops per step.
// Main loop as in the tc kernel's wgmma path: LOOK = NS - 2 stages in flight, one wait, fence and barrier per stage.
// Split-K: split_k.cuh.
// Launch bound: two CTAs per SM at T = 48, whose 48 accumulators per thread (MW 2) would otherwise take 136
// registers and leave one (ptxas, sm_90a, 4 bits: 128 registers and 20-32 bytes spilled); the other T keep theirs.

#include "hopper.cuh"
#include "moe_gemm_common.cuh"

// Byte layout of one CTA's dynamic shared memory; configs.GemmConfig.smem_bytes computes kTotal the same way.
template <int T, int BN, int kBits, int NS, int KT>
struct SwappedSmem {
  static constexpr int kA = T * 64;            // activation rows of one 32-k step (a multiple of 512)
  static constexpr int kQRow = BN * 4;         // bytes per qweight row
  static constexpr int kQ = kBits * kQRow;
  static constexpr int kS = BN * 2;
  static constexpr int kZ = BN * kBits / 8;
  static constexpr int kStep = (kA + kQ + kS + kZ + 511) / 512 * 512;
  static constexpr int kStage = KT * kStep;
  static constexpr int kTotal = NS * kStage + 1024;  // + slack to align the base to 1024 bytes
};

template <bool kBf16, int kBits, int T, int MW, int NS, int KT>
__global__ void __launch_bounds__(256, T == 48 ? 2 : 1)
moe_gemm_swapped(const unsigned short* __restrict__ a,        // [M, K]
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
            int split_k, int chunks_per_split, int num_experts,
            int n_band) {  // tile order: bands of n_band column tiles (configs.COLUMN_BAND)
  constexpr int BN = 128 * MW, THREADS = 256, NJ = T / 8, NC = 2 * MW;
  using L = SwappedSmem<T, BN, kBits, NS, KT>;
  static_assert(T == 16 || T == 32 || T == 48 || T == 64 || T == 128, "T");
  static_assert(MW == 1 || MW == 2, "MW");
  static_assert(gptq::kHaveWgmma, "moe_gemm_swapped: sm_90a only");
  extern __shared__ uint4 smem_dyn[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_dyn);
  smem += (1024 - (gptq::smem_u32(smem) & 1023)) & 1023;

  const int2 tile = gptq::banded_tile(n_band);  // launch order -> (row block, column tile)
  const int blk = tile.x;
  pdl::enter();  // before the first global access (pdl.cuh)
  const int padded = __ldg(post_padded);
  const int expert = __ldg(expert_ids + blk);
  if (blk * T >= padded || expert < 0 || expert >= num_experts) return;
  gptq::require_dyn_smem(L::kTotal);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, wg = warp >> 2;
  const int n_base = tile.y * BN;
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
  // cost its 128 x 256 instance 3-7% (H200, same-run A/B).
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

  // ---- A fragments: the lane's column ci = 2 * mw + h (row 16 * (warp % 4) + g + 8h of m64 tile mw) is col0 + ci
  const int col0 = wg * 64 * MW + 16 * MW * (warp & 3) + NC * g;
  const u32 sel = gptq::frag_select(kBits, t);
  gptq::GroupConst fc[NC];
  int group_left = 0;  // chunks left in the group of the constants in fc
  int group_next = chunks_per_group - c_begin % chunks_per_group;  // chunks of the next group met (the slice's first)
  using Frag = u32[MW][2][4];  // one 32-k step: [m64 tile][k16 half][register]
  // step s of the stage in ring slot `slot` -> fr
  auto dequant = [&](int slot, int s, Frag& fr) {
    const unsigned char* st = smem + slot * L::kStage + s * L::kStep;
    if (group_left == 0) {  // first chunk of a group (or of the slice): this step's scales and zeros
      group_left = group_next;
      group_next = chunks_per_group;
#pragma unroll
      for (int ci = 0; ci < NC; ++ci) {
        const int col = col0 + ci;
        const unsigned short sb = reinterpret_cast<const unsigned short*>(st + L::kA + L::kQ)[col];
        int zc = kSymZero;
        if (qz_e) {
          const u32 zw = reinterpret_cast<const u32*>(st + L::kA + L::kQ + L::kS)[col * kBits / 32];
          zc = kBits == 4 ? (zw >> (4 * (col & 7))) & 15u : (zw >> (8 * (col & 3))) & 255u;
        }
        fc[ci] = gptq::group_const<kBf16>(sb, zc);
      }
    }
    --group_left;
    // the lane's raw words: qweight rows i (4-bit) or 2i + (t >> 1) (8-bit) of its NC columns, one load per row
    u32 w[NC][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned char* q = st + L::kA + (kBits == 4 ? i : 2 * i + (t >> 1)) * L::kQRow + col0 * 4;
      if constexpr (NC == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(q);
        w[0][i] = v.x; w[1][i] = v.y; w[2][i] = v.z; w[3][i] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(q);
        w[0][i] = v.x; w[1][i] = v.y;
      }
    }
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
      u32 f0[4], f1[4];  // columns 2 mw and 2 mw + 1 of the lane (m64 rows g and g + 8)
      gptq::frag_words<kBf16, kBits>(w[2 * mw], t, sel, fc[2 * mw], f0);
      gptq::frag_words<kBf16, kBits>(w[2 * mw + 1], t, sel, fc[2 * mw + 1], f1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        fr[mw][h][0] = f0[2 * h];
        fr[mw][h][1] = f1[2 * h];
        fr[mw][h][2] = f0[2 * h + 1];
        fr[mw][h][3] = f1[2 * h + 1];
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

  auto wg_issue = [&](int slot, int s, const Frag& fr) {
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) gptq::wg_fence_operands(acc[mw]);
    gptq::wg_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned long long desc = gptq::wg_desc_sw64(smem_base + slot * L::kStage + s * L::kStep + 32 * h);
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) gptq::wgmma_m64k16_rs<kBf16, T>(acc[mw], fr[mw][h], desc);
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
  if (nsteps > 0) dequant(0, 0, fr0);
  int rd = 0;
  // stage it: one wait, fence and barrier, then per 32-k step s the tensor work of step s from one register set
  // while step s + 1 (or the next stage's first step) is dequantized into the other. Steps alternate between fr0
  // and fr1; with KT even every stage starts on fr0.
  auto body = [&](int it, Frag& even, Frag& odd) {
    gptq::cp_async_wait<LOOK - 2>();
    gptq::fence_proxy_async_smem();  // this thread's activation copies -> wgmma reads
    __syncthreads();
    const int nx = it + LOOK;
    if (nx < nsteps) issue(rd + LOOK < NS ? rd + LOOK : rd + LOOK - NS, c_begin + nx * KT);
    gptq::cp_async_commit();
    const int rd1 = rd + 1 == NS ? 0 : rd + 1;
#pragma unroll
    for (int s = 0; s < KT; ++s) {
      wg_issue(rd, s, s % 2 == 0 ? even : odd);
      gptq::wg_wait<1>();  // step s-1's ops are done: its register set may be overwritten
      Frag& nxt = s % 2 == 0 ? odd : even;
      if (s + 1 < KT) {
        dequant(rd, s + 1, nxt);
      } else if (it + 1 < nsteps) {
        dequant(rd1, 0, nxt);
      }
    }
    rd = rd1;
  };
  for (int it = 0; it < nsteps; it += 2) {
    body(it, fr0, fr1);
    if (it + 1 < nsteps) {
      if constexpr (KT % 2 == 0) {
        body(it + 1, fr0, fr1);
      } else {
        body(it + 1, fr1, fr0);
      }
    }
  }
  gptq::cp_async_wait<0>();
  gptq::wg_wait<0>();
#pragma unroll
  for (int mw = 0; mw < MW; ++mw) gptq::wg_fence_operands(acc[mw]);

  // ---- epilogue: acc[mw][j][r] = column col0 + 2 mw + (r >> 1), block row 8j + 2t + (r & 1): for each of its rows
  // the lane holds the outputs of its NC adjacent columns
  int pair_of[NJ][2];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = __ldg(sorted + blk * T + 8 * j + 2 * t + e);
      pair_of[j][e] = (p >= 0 && p < num_pairs) ? p : -1;
    }
  const int c0 = n_base + col0;  // N is a multiple of 32: the lane's columns are all inside or all past it

  if (split_k == 1) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int p = pair_of[j][e];
        if (p < 0 || c0 >= N) continue;
        const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
        u32 v[MW];
#pragma unroll
        for (int mw = 0; mw < MW; ++mw) v[mw] = gptq::pack2<kBf16>(acc[mw][j][e] * w, acc[mw][j][2 + e] * w);
        unsigned short* dst = out + static_cast<long long>(p) * N + c0;
        if constexpr (MW == 2) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(v[0], v[1]);
        } else {
          *reinterpret_cast<u32*>(dst) = v[0];
        }
      }
    return;
  }

  // split-K (split_k.cuh): publish this slice's partial tile, then the last CTA of the tile reduces in fixed order
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (pair_of[j][e] < 0 || c0 >= N) continue;
      const int slot = blk * T + 8 * j + 2 * t + e;
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) {
        const float v[2] = {acc[mw][j][e], acc[mw][j][2 + e]};
        splitk::publish(partials, capacity, N, slot, c0 + 2 * mw, v);
      }
    }
  __shared__ int last;
  if (!splitk::last_arrival(tickets, split_k, last)) return;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = pair_of[j][e];
      if (p < 0 || c0 >= N) continue;
      const int slot = blk * T + 8 * j + 2 * t + e;
      const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
#pragma unroll
      for (int mw = 0; mw < MW; ++mw) {
        float v[2];
        splitk::sum_slices(partials, split_k, capacity, N, slot, c0 + 2 * mw, v);
        *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + c0 + 2 * mw) =
            gptq::pack2<kBf16>(v[0] * w, v[1] * w);
      }
    }
  splitk::reset_ticket(tickets);
}

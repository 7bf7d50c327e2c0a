// Prefill GEMM kernel `moe_gemm_tc` (kind "tc" in cupy_moe/configs.py): block_m 64 / 128 without act-order (act-order
// weights run moe_gemm_decode.cu's kernel at these block sizes). Arguments and tiling: moe_gemm_common.cuh.
// Every weight is dequantized ONCE per CTA into shared memory and both mma operands come from shared memory: through
// ldmatrix + mma.sync, or (kWg, sm_90a) read by wgmma itself.
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
// Split-K: split_k.cuh (fixed-order reduction by the last CTA, or with kWg inside a cluster of the 2 slices).

#include "hopper.cuh"
#include "moe_gemm_common.cuh"

// Byte layout of one CTA's dynamic shared memory; configs.GemmConfig.smem_bytes computes kTotal the same way.
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
            int split_k, int chunks_per_split, int num_experts,
            int n_band) {  // tile order: bands of n_band column tiles (configs.COLUMN_BAND)
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

  const int2 tile = gptq::banded_tile(n_band);  // launch order -> (row block, column tile)
  const int blk = tile.x, n_tile = tile.y;
  pdl::enter();  // before the first global access (pdl.cuh)
  const int padded = __ldg(post_padded);
  const int expert = __ldg(expert_ids + blk);  // loaded together with the padded total (see moe_gemm)
  if (blk * BM >= padded || expert < 0 || expert >= num_experts) return;
  gptq::require_dyn_smem(L::kTotal);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = kWg ? warp % WM : warp / WN, wn = kWg ? warp / WM : warp % WN;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = n_tile * BN;
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
        gptq::cp_async16(st + L::kA + (tid + i * THREADS) * 16, q_src[i], true);
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
  // barrier: one more step in flight. H200, same-run A/B of the two kernels (14 rows on 128 x 256
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
  if (nsteps > 0) dequant(0, 0);
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
      wg_issue(rd, it & 1);
      gptq::wg_wait<1>();  // this warpgroup's step it-1 is done
      if constexpr (kEarly) {  // the second barrier, then the early refill
        __syncthreads();
        const int nx = it + PRE;
        if (nx < nsteps) issue(rd == 0 ? NS - 1 : rd - 1, c_begin + nx * KT);
        gptq::cp_async_commit();
      }
      if (it + 1 < nsteps) dequant(rd1, (it + 1) & 1);
    } else {
      if (it + 1 < nsteps) dequant(rd1, (it + 1) & 1);
      mma_step(rd, it & 1);
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
    // The tile goes out through shared memory, so that each pair's BN outputs leave as whole 16-byte pieces of one
    // contiguous row (a fragment's own stores are 4 bytes, 8 rows of 16 bytes per warp instruction). The ring and
    // the B buffers are free once every warp is past its last wgmma wait / mma. Row r's 16-byte chunk c sits at
    // c ^ (r & 7): the fragment writes (8 rows x one chunk per instruction) and the row reads are conflict-free.
    static_assert(BM * BN * 2 <= L::kTotal - L::kAlign, "the output tile fits in the kernel's shared memory");
    constexpr int RW = BN / 2;  // u32 words per tile row
    u32* tile = reinterpret_cast<u32*>(smem);
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair_of[mt][h];
        if (p < 0) continue;
        const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
        const int r = wm * WTM + mt * 16 + g + 8 * h;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int c = (wn * WTN) / 8 + j;  // the fragment's 16-byte chunk of the row; t picks the word in it
          tile[r * RW + ((c ^ (r & 7)) << 2) + t] =
              gptq::pack2<kBf16>(acc[mt][j][2 * h] * w, acc[mt][j][2 * h + 1] * w);
        }
      }
    __syncthreads();
    constexpr int CPR = BN / 8, RPI = THREADS / CPR;  // 16-byte chunks per row; rows per pass of the CTA
    const int oc = tid % CPR, col = n_base + 8 * oc;
#pragma unroll 4
    for (int r = tid / CPR; r < BM; r += RPI) {
      const int p = __ldg(sorted + blk * BM + r);
      if (p < 0 || p >= num_pairs || col >= N) continue;
      *reinterpret_cast<uint4*>(out + static_cast<long long>(p) * N + col) =
          *reinterpret_cast<const uint4*>(tile + r * RW + ((oc ^ (r & 7)) << 2));
    }
    return;
  }

  // split-K inside a cluster (split_k.cuh; the launcher makes the tile's slices one cluster where it can): each CTA
  // leaves its fp32 partial tile in its shared memory (free by then), 32-byte pieces of 8 columns, piece j of row r
  // at j ^ (r & 7) so that a fragment store's 8 rows hit 8 different bank groups; then the slices' CTAs take the
  // tile's pieces in turn and sum each over the slices in slice order (bitwise the workspace path's sums).
  if constexpr (kWg) {
    if (splitk::cluster_size() == split_k) {
      constexpr int PIECES = BN / 8;
      static_assert(BM * BN * 4 <= L::kTotal - L::kAlign, "the fp32 tile fits in the kernel's shared memory");
      float2* tile = reinterpret_cast<float2*>(smem);
      __syncthreads();  // every warp is past its last wgmma wait
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (pair_of[0][h] < 0) continue;
        const int r = wm * WTM + g + 8 * h;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int piece = ((wn * WTN) / 8 + j) ^ (r & 7);
          tile[(r * PIECES + piece) * 4 + t] = make_float2(acc[0][j][2 * h], acc[0][j][2 * h + 1]);
        }
      }
      splitk::cluster_sync();
      const unsigned tile_at = gptq::smem_u32(tile);
      for (int u = blockIdx.z * THREADS + tid; u < BM * PIECES; u += split_k * THREADS) {
        const int r = u / PIECES, piece = u % PIECES, col = n_base + 8 * piece;
        const int p = __ldg(sorted + blk * BM + r);
        if (p < 0 || p >= num_pairs || col >= N) continue;  // rows the writers skipped are never read
        const unsigned at = tile_at + 32u * (r * PIECES + (piece ^ (r & 7)));
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < split_k; ++s) {  // fixed order
          const float4 lo = splitk::ld_cluster16(at, s), hi = splitk::ld_cluster16(at + 16u, s);
          v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
          v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
        }
        const float w = topk_weights ? __ldg(topk_weights + p) : 1.f;
        gptq::store8<kBf16>(out + static_cast<long long>(p) * N + col, v, w);
      }
      splitk::cluster_sync();  // no CTA exits while another still reads its tile
      return;
    }
  }

  // split-K (split_k.cuh): publish this slice's partial tile, then the last CTA of the tile reduces in fixed order
#pragma unroll
  for (int mt = 0; mt < MTL; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (pair_of[mt][h] < 0) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = col_w + j * 8;
        if (col >= N) continue;
        const float v[2] = {acc[mt][j][2 * h], acc[mt][j][2 * h + 1]};
        splitk::publish(partials, capacity, N, slot_of[mt][h], col, v);
      }
    }
  __shared__ int last;
  if (!splitk::last_arrival(tickets, split_k, last)) return;
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
        float v[2];
        splitk::sum_slices(partials, split_k, capacity, N, slot_of[mt][h], col, v);
        *reinterpret_cast<u32*>(out + static_cast<long long>(p) * N + col) = gptq::pack2<kBf16>(v[0] * w, v[1] * w);
      }
    }
  splitk::reset_ticket(tickets);
}

// The small kernels around the two GEMM phases of one MoE layer:
//   select_experts  router logits [M, E] -> topk_weights [M, A] fp32, topk_ids [M, A] int32
//   route_experts   the same for DeepSeek-style routing: sigmoid or softmax scores, a selection bias, group limits
//   silu_and_mul    gate/up output [P, 2I] -> SiLU(gate) * up [P, I]
//   moe_sum         down output [M*A, H] (routing weights already applied by the GEMM) -> [M, H]
//   add_shared      routed [M, H] + shared experts [M, H] (scaled by a sigmoid gate) -> [M, H]
//   router_logits   hidden [M, H] x router [E, H] -> logits [M, E] in float32
// Each mirrors cupy_moe.reference exactly in where it rounds: float32 math, one rounding to T at the end.
// No CUDA headers: NVRTC installs without cuda_fp16.h, so the 16-bit types are plain storage structs with
// PTX conversions (round to nearest even, as numpy's astype does).
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

#include "pdl.cuh"

namespace {

// -inf without <math.h>, which NVRTC does not provide.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }

// 4 consecutive values (8 or 16 bytes, aligned) as floats
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
template <typename T>  // f16 or bf16
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  const unsigned words[2] = {q.x, q.y};
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = to_float(T{static_cast<unsigned short>(words[j / 2] >> (16 * (j % 2)))});
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
  bf16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}

// 8 consecutive 16-bit values (16 bytes, aligned) as floats, and back, each rounded once
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = to_float(T{static_cast<unsigned short>(words[j / 2] >> (16 * (j % 2)))});
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  unsigned words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    words[j] = static_cast<unsigned>(from_float<T>(v[2 * j]).bits) |
               static_cast<unsigned>(from_float<T>(v[2 * j + 1]).bits) << 16;
  *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// Larger value wins; on equal values the lower expert index wins (the reference's tie rule).
__device__ __forceinline__ void argmax_step(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// The warp's best (v, i) by a fixed butterfly: every lane ends with the same pair (bitwise reproducible).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1)
    argmax_step(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

// Takes the best of a warp's row of E values in shared memory (lane l holds entries l, l + 32, ...): returns its
// value, sets `id` (every lane) and marks it taken (-inf) so that the next call finds the next best. A row of NaN
// finds none: id 0, so that ids and every access stay in range.
__device__ __forceinline__ float take_best(float* row_e, int E, int lane, int& id) {
  float v = neg_inf();
  int i = 0x7fffffff;
  for (int e = lane; e < E; e += 32) argmax_step(v, i, row_e[e], e);
  warp_argmax(v, i);
  if (i >= E) i = 0;
  __syncwarp();
  if (lane == (i & 31)) row_e[i] = neg_inf();
  __syncwarp();
  id = i;
  return v;
}

}  // namespace

// One warp per token. Probabilities live in shared memory ([WARPS, E] floats), so E <= 1024 fits in
// 32 KiB for 8 warps; the launcher sizes dynamic shared memory as WARPS * E * 4 bytes.
// Warp reductions use a fixed butterfly order, so results are bitwise reproducible.
template <typename T>
__global__ void select_experts(const T* __restrict__ logits_me, float* __restrict__ weights_ma,
                               int* __restrict__ ids_ma, int M, int E, int A, int renormalize) {
  pdl::enter();
  extern __shared__ float probs[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int m = blockIdx.x * (blockDim.x >> 5) + warp;
  if (m >= M) return;
  float* p_e = probs + warp * E;
  const T* row = logits_me + static_cast<long long>(m) * E;

  float mx = neg_inf();
  for (int e = lane; e < E; e += 32) { p_e[e] = to_float(row[e]); mx = fmaxf(mx, p_e[e]); }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) { p_e[e] = expf(p_e[e] - mx); sum += p_e[e]; }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  for (int e = lane; e < E; e += 32) p_e[e] = p_e[e] / sum;
  __syncwarp();

  float picked = 0.f;
  float w_slot = 0.f;  // lane s keeps the weight of slot s (A <= 32 is checked by the launcher)
  int id_slot = 0;
  for (int s = 0; s < A; ++s) {
    int i;
    const float v = take_best(p_e, E, lane, i);
    if (lane == s) { w_slot = v; id_slot = i; }
    picked += v;
  }
  if (lane < A) {
    weights_ma[static_cast<long long>(m) * A + lane] = renormalize ? w_slot / picked : w_slot;
    ids_ma[static_cast<long long>(m) * A + lane] = id_slot;
  }
}

// DeepSeek-style routing, one warp per token, as cupy_moe.layer's NumPy definition (_route_numpy) computes it:
//   score[e] = softmax(logits)[e] (scoring 0) or sigmoid(logits[e]) (scoring 1); choice[e] = score[e] + bias[e]
//   (bias null: score[e]); with groups (group_mode 1: a group scores its best choice, 2: the sum of its two best;
//   n_group <= 32 groups of E / n_group experts) only the topk_group best groups stay, the choices of the others
//   become 0; the A best choices are picked (ties to the lower index, groups too); weight = score (not choice),
//   divided by (sum of the A weights + 1e-20) when renormalize, then times scaling.
// choice lives in shared memory ([WARPS, E] floats, as select_experts).
__global__ void route_experts(const float* __restrict__ logits_me, float* __restrict__ weights_ma,
                              int* __restrict__ ids_ma, int M, int E, int A, const float* __restrict__ bias_e,
                              int scoring, int group_mode, int n_group, int topk_group, int renormalize,
                              float scaling) {
  pdl::enter();
  extern __shared__ float choice[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int m = blockIdx.x * (blockDim.x >> 5) + warp;
  if (m >= M) return;
  float* c_e = choice + warp * E;
  const float* row = logits_me + static_cast<long long>(m) * E;

  float mx = neg_inf(), sum = 0.f;  // softmax: the row's maximum and the sum of exp(logit - max)
  if (scoring == 0) {
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, row[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int e = lane; e < E; e += 32) sum += expf(row[e] - mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  auto score = [&](int e) {
    const float x = row[e];
    return scoring == 0 ? expf(x - mx) / sum : 1.0f / (1.0f + expf(-x));
  };
  for (int e = lane; e < E; e += 32) c_e[e] = bias_e ? score(e) + bias_e[e] : score(e);
  __syncwarp();

  if (group_mode != 0) {
    const int size = E / n_group;
    float gs = neg_inf();  // lane g < n_group: the score of group g
    if (lane < n_group) {
      float v1 = neg_inf(), v2 = neg_inf();  // its best choice, and the best of the others (a tie counts twice)
      for (int j = 0; j < size; ++j) {
        const float x = c_e[lane * size + j];
        if (x > v1) {
          v2 = v1;
          v1 = x;
        } else {
          v2 = fmaxf(v2, x);
        }
      }
      gs = group_mode == 2 ? v1 + v2 : v1;
    }
    unsigned kept = 0u;
    for (int s = 0; s < topk_group; ++s) {  // a group taken scores -inf from then on, as in the NumPy definition
      float v = (kept >> lane) & 1u ? neg_inf() : gs;
      int i = lane;
      warp_argmax(v, i);
      kept |= 1u << i;
    }
    for (int e = lane; e < E; e += 32)
      if (!((kept >> (e / size)) & 1u)) c_e[e] = 0.f;
    __syncwarp();
  }

  int id_slot = 0;  // lane s keeps the expert of slot s (A <= 32 is checked by the launcher)
  for (int s = 0; s < A; ++s) {
    int i;
    take_best(c_e, E, lane, i);
    if (lane == s) id_slot = i;
  }
  float w = lane < A ? score(id_slot) : 0.f;
  if (renormalize) {
    float picked = w;
    for (int o = 16; o > 0; o >>= 1) picked += __shfl_xor_sync(0xffffffffu, picked, o);
    w = w / (picked + 1e-20f);
  }
  if (lane < A) {
    weights_ma[static_cast<long long>(m) * A + lane] = w * scaling;
    ids_ma[static_cast<long long>(m) * A + lane] = id_slot;
  }
}

// out[p, i] = SiLU(x[p, i]) * x[p, I + i], in float32, rounded once to T. pair_order: column i is stored at its place
// in pair order instead (each run of 8 as i0 i4 i1 i5 i2 i6 i3 i7; moe_gemm_decode.cu, kPairA). A thread takes 8
// columns at once (16-byte loads and stores): I is a multiple of 32 (the GEMMs' K and N) and the rows are aligned.
template <typename T>
__global__ void silu_and_mul(const T* __restrict__ x_p2i, T* __restrict__ out_pi, long long P, int I,
                             int pair_order) {
  pdl::enter();
  const int I8 = I / 8;
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; t < P * I8;
       t += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long p = t / I8;
    const int i = static_cast<int>(t - p * I8) * 8;
    float g[8], u[8], o[8];
    load8(x_p2i + p * 2 * I + i, g);
    load8(x_p2i + p * 2 * I + I + i, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int j = pair_order ? (k >> 1) + 4 * (k & 1) : k;  // the column that place k of the run holds
      o[k] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    store8(out_pi + p * I + i, o);
  }
}

// out[m, h] = sum over slots s (in order) of x[m * A + s, h], in float32, rounded once to T; a slot whose expert
// id is outside [0, E) adds nothing (the GEMMs skip such pairs, so their rows of x were never written).
// vec (out 16-byte aligned; H is a multiple of 32): a thread takes 8 columns at once; else one. The same sums.
template <typename T, typename I>
__global__ void moe_sum(const T* __restrict__ x_pah, const I* __restrict__ ids_ma, T* __restrict__ out_mh,
                        long long M, int A, int H, int E, int vec) {
  pdl::enter();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  // Each slot's id and value are loaded unconditionally (row m * A + s of x exists even where the GEMMs skipped
  // it), so no load waits for an id; the select keeps a skipped slot's unwritten bits out of the sum.
  if (vec) {
    const int H8 = H / 8;
    for (long long t = first; t < M * H8; t += stride) {
      const long long m = t / H8;
      const int h = static_cast<int>(t - m * H8) * 8;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 8  // every model's top-k fits one round: all its loads in flight at once
      for (int s = 0; s < A; ++s) {
        const I e = ids_ma[m * A + s];
        float v[8];
        load8(x_pah + (m * A + s) * H + h, v);
        const bool keep = e >= 0 && e < E;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = keep ? acc[j] + v[j] : acc[j];
      }
      store8(out_mh + m * H + h, acc);
    }
    return;
  }
  for (long long t = first; t < M * H; t += stride) {
    const long long m = t / H;
    const int h = static_cast<int>(t - m * H);
    float acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < A; ++s) {
      const I e = ids_ma[m * A + s];
      const float v = to_float(x_pah[(m * A + s) * H + h]);
      acc = (e >= 0 && e < E) ? acc + v : acc;
    }
    out_mh[t] = from_float<T>(acc);
  }
}

// out[m, h] = routed[m, h] + shared[m, h] / (1 + exp(-gate[m])) (gate null: + shared[m, h]), in float32, rounded
// once to T: a layer's routed and shared experts, each already rounded to T (as cupy_moe.reference rounds them).
// A thread takes 8 columns: the launcher runs it where H is a multiple of 8 (every array is the layer's own, aligned).
template <typename T>
__global__ void add_shared(const T* __restrict__ routed_mh, const T* __restrict__ shared_mh,
                           const float* __restrict__ gate_m, T* __restrict__ out_mh, long long M, int H) {
  pdl::enter();
  const int H8 = H / 8;
  for (long long t = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; t < M * H8;
       t += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long m = t / H8, at = m * H + static_cast<int>(t - m * H8) * 8;
    float r[8], v[8];
    load8(routed_mh + at, r);
    load8(shared_mh + at, v);
    const float scale = gate_m ? 1.0f + expf(-gate_m[m]) : 1.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] += gate_m ? v[j] / scale : v[j];
    store8(out_mh + at, r);
  }
}

// logits[m, e] = sum over h of x[m, h] * w[e, h] in float32. A CTA computes EC experts x TM tokens, so each
// router row is read once per TM tokens and each token row once per EC experts (reading the router once per token
// would move gigabytes through L2 at M = 1024). Its 8 warps split H: warp j takes the chunks of 128
// at j * 128, j * 128 + 1024, ...; lane l the 4 values at 4l of each chunk, added to its sums in h order. A warp sums
// its lanes by the xor butterfly (16, 8, 4, 2, 1; each step halves the values a lane holds while it holds more than
// one, which adds the same pairs), and the 8 warp sums are added in warp order. That order depends on H alone, not on
// M, EC, TM or `vec`, so a token's logits do not depend on the batch it is in. vec (H % 4 == 0, rows aligned for it):
// each lane loads its 4 values at once; else one at a time, with the same sums. Rows past M or E read the last row.
// Deterministic, and (unlike cuBLAS through CuPy) usable inside a CUDA graph capture.
template <typename TX, typename TW, int EC, int TM>
__global__ void __launch_bounds__(256) router_logits(const TX* __restrict__ x_mh, const TW* __restrict__ w_eh,
                                                     float* __restrict__ out_me, int M, int E, int H, int vec) {
  constexpr int V = EC * TM, WARPS = 8, CHUNK = 128;
  static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "EC * TM: a power of two up to 32");
  __shared__ float red[WARPS][V];
  pdl::enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long m0 = static_cast<long long>(blockIdx.x) * TM;
  const int e0 = blockIdx.y * EC;
  const TX* xr[TM];
  const TW* wr[EC];
#pragma unroll
  for (int t = 0; t < TM; ++t) xr[t] = x_mh + min(m0 + t, static_cast<long long>(M) - 1) * H;
#pragma unroll
  for (int e = 0; e < EC; ++e) wr[e] = w_eh + static_cast<long long>(min(e0 + e, E - 1)) * H;
  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;
  auto add = [&](const float (&wv)[EC][4], const float (&xv)[TM][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < EC; ++e)
#pragma unroll
        for (int t = 0; t < TM; ++t) acc[e * TM + t] = __fmaf_rn(xv[t][j], wv[e][j], acc[e * TM + t]);
  };
  const int h0 = warp * CHUNK + 4 * lane;
  if (vec) {
#pragma unroll 2
    for (int h = h0; h < H; h += WARPS * CHUNK) {  // two chunks' loads in flight
      float wv[EC][4], xv[TM][4];
#pragma unroll
      for (int e = 0; e < EC; ++e) load4(wr[e] + h, wv[e]);
#pragma unroll
      for (int t = 0; t < TM; ++t) load4(xr[t] + h, xv[t]);
      add(wv, xv);
    }
  } else {
    for (int h = h0; h < H; h += WARPS * CHUNK) {
      float wv[EC][4], xv[TM][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = h + j < H;  // out of range: 0 * 0 adds nothing
#pragma unroll
        for (int e = 0; e < EC; ++e) wv[e][j] = in ? to_float(wr[e][h + j]) : 0.f;
#pragma unroll
        for (int t = 0; t < TM; ++t) xv[t][j] = in ? to_float(xr[t][h + j]) : 0.f;
      }
      add(wv, xv);
    }
  }
  // butterfly; while a lane holds n > 1 sums it keeps one half (the upper one where its bit o is set), sends the
  // other, and adds its partner's copy of the half it keeps
  int base = 0, own = 1;  // after the loop the lane holds the sum of value `base`; own: it writes it
#pragma unroll
  for (int step = 0; step < 5; ++step) {
    const int o = 16 >> step, n = V >> (step + 1);  // n: the sums a lane keeps if it still holds more than one
    if (n >= 1) {
      const bool up = lane & o;
#pragma unroll
      for (int i = 0; i < n; ++i) {
        const float send = up ? acc[i] : acc[i + n];
        const float keep = up ? acc[i + n] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      if (up) base += n;
    } else {
      acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
      if (lane & o) own = 0;
    }
  }
  if (own) red[warp][base] = acc[0];
  __syncthreads();
  if (threadIdx.x < V) {
    const int e = e0 + threadIdx.x / TM;
    const long long m = m0 + threadIdx.x % TM;
    if (e < E && m < M) {
      float s = red[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) s += red[w][threadIdx.x];
      out_me[m * E + e] = s;
    }
  }
}

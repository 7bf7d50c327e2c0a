// Dequantization and register-level math of the GPTQ MoE GEMM kernels: PTX wrappers (NVRTC ships no cuda_fp16.h,
// so no header is needed), GPTQ dequantization into mma-ready half2/bf162 pairs, and the m16n8k16 tensor-core op.
// Copies into shared memory are in smem_pipeline.cuh, the Hopper-only ops in hopper.cuh.
#pragma once

namespace gptq {

typedef unsigned int u32;

// (a & b) | c in one LOP3: builds the fp16 magic number around a masked nibble pair.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Byte permute in one PRMT: re-pairs activations and dequantized pairs, puts 8-bit codes under the fp16 magic number.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) { return __byte_perm(a, b, sel); }

// fp16x2 a - b (exact for the magic-number codes: q - z in one op).
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// fp16x2 a * b: the scale, one rounding per dequantized weight.
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// fp16x2 a * b + c: the 4-bit odd nibbles, taken in place (16 q), become q - z in one op (dequant8u).
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// bf16x2 a * b + c: 4-bit bf16 codes 128 + q become q - z in one op (exact), before the fp32 scaling.
__device__ __forceinline__ u32 bf16_fma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Four 8x8 b16 matrices from shared memory (lane l gives the row address of matrix l / 8, row l % 8).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], unsigned smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

// fp16 bits -> float: scales are stored as fp16 bits, and the fp32 sums of a group are scaled in float.
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// bf16 bits -> float: exact, a shift.
__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) { return __uint_as_float(u32(h) << 16); }

// Two floats -> packed pair, lo in the low 16 bits; one rounding each (round to nearest even).
template <bool kBf16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 d;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
}

// Eight fp32 sums of consecutive columns times the routing weight w, rounded once each: one 16-byte store at dst.
template <bool kBf16>
__device__ __forceinline__ void store8(unsigned short* dst, const float (&v)[8], float w) {
  uint4 o;
  o.x = pack2<kBf16>(v[0] * w, v[1] * w);
  o.y = pack2<kBf16>(v[2] * w, v[3] * w);
  o.z = pack2<kBf16>(v[4] * w, v[5] * w);
  o.w = pack2<kBf16>(v[6] * w, v[7] * w);
  *reinterpret_cast<uint4*>(dst) = o;
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulate.
template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// d = a * b: the accumulator starts from zero (ptxas reads RZ for it, no register zeroing).
template <bool kBf16>
__device__ __forceinline__ void mma16816_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  d[0] = d[1] = d[2] = d[3] = 0.f;
  mma16816<kBf16>(d, a, b0, b1);
}

// ---- dequantization ---------------------------------------------------------------------------------------------
// One thread holds, for one output column, the 8 codes of k = k0+8t .. k0+8t+7 (t = lane % 4) and returns them
// as 4 packed pairs ready to be the B operand of two m16n8k16 mmas. The pair order is chosen to be cheap to build;
// the A operand is permuted to the same k order (the dot product does not care which k goes where, as long as
// A and B agree).
//
// 4-bit GPTQ word (packed along K, nibble j = k0+8t+j, least significant first):
//     bits 31..28 27..24 23..20 19..16 15..12 11..8 7..4 3..0
//          k7     k6     k5     k4     k3     k2    k1   k0
//   (q >> 4i) & 0x000F000F puts k_i in the low half and k_{i+4} in the high half, so the pairs are
//   P0 = (k0, k4), P1 = (k1, k5), P2 = (k2, k6), P3 = (k3, k7);  mma#0 uses {P0, P1}, mma#1 {P2, P3}.
// 8-bit GPTQ words w0 = k0..k3, w1 = k4..k7 (byte j = k_j): pairs (k0,k1), (k2,k3), (k4,k5), (k6,k7).
//
// fp16: OR-ing a code q < 2048 into the mantissa of 1024.0 (0x6400) gives the half 1024 + q exactly; subtracting
// 1024 + z (also exact) gives q - z exactly, and one multiply by the scale rounds once: w = fp16((q - z) * s).
// bf16: 0x4B000000 | q is the float 2^23 + q; subtract 2^23 + z, multiply by the scale in fp32, round once to bf16.
//
// s_bits[j], z[j]: fp16 scale bits and real zero of element j (all equal unless act-order g_idx is used).

template <bool kBf16, int kBits>
__device__ __forceinline__ void dequant8(const u32 (&q)[kBits / 4], const unsigned short (&s_bits)[8],
                                         const int (&z)[8], u32 (&out)[4]) {
  if constexpr (!kBf16) {
    if constexpr (kBits == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 codes = and_or(q[0] >> (4 * i), 0x000F000Fu, 0x64006400u);
        const u32 zz = (0x6400u | u32(z[i])) | ((0x6400u | u32(z[i + 4])) << 16);
        const u32 ss = u32(s_bits[i]) | (u32(s_bits[i + 4]) << 16);
        out[i] = hmul2(hsub2(codes, zz), ss);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 codes = prmt(q[i >> 1], 0x64646464u, (i & 1) ? 0x7352u : 0x7150u);
        const u32 zz = (0x6400u + u32(z[2 * i])) | ((0x6400u + u32(z[2 * i + 1])) << 16);
        const u32 ss = u32(s_bits[2 * i]) | (u32(s_bits[2 * i + 1]) << 16);
        out[i] = hmul2(hsub2(codes, zz), ss);
      }
    }
  } else {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const u32 code = kBits == 4 ? (q[0] >> (4 * j)) & 15u : (q[j >> 2] >> (8 * (j & 3))) & 255u;
      const float qz = __uint_as_float(0x4B000000u | code) - (8388608.0f + float(z[j]));  // exact q - z
      v[j] = qz * half_bits_to_float(s_bits[j]);
    }
    if constexpr (kBits == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = pack2<true>(v[i], v[i + 4]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = pack2<true>(v[2 * i], v[2 * i + 1]);
    }
  }
}

// ---- dequantization with one scale and zero for all 8 codes (no act-order) -------------------------------------
// The per-group constants are built once per group (GroupConst) instead of once per 32-k chunk.
// fp16: ss = scale pair; zlo = (1024 + z) pair; zhi = -(64 + z) pair; zmix = -(1024 + z) | -(64 + z) (frag_words).
// bf16: sf = scale as float; zf = 2^23 + z as float.
struct GroupConst {
  u32 ss, zlo, zhi, zmix;
  float sf, zf;
};

// A group's constants from its fp16 scale bits and zero, built once per group and column.
template <bool kBf16>
__device__ __forceinline__ GroupConst group_const(unsigned short s_bits, int z) {
  GroupConst c;
  if constexpr (!kBf16) {
    c.ss = u32(s_bits) * 0x10001u;
    c.zlo = (0x6400u | u32(z)) * 0x10001u;
    c.zhi = (0xD400u + (u32(z) << 4)) * 0x10001u;  // fp16 -(64 + z): ulp at 64 is 1/16
    c.zmix = (0xE400u | u32(z)) | ((0xD400u + (u32(z) << 4)) << 16);
    c.sf = 0.f;
    c.zf = 0.f;
  } else {
    c.ss = c.zhi = c.zmix = 0u;
    c.zlo = (0xC300u | u32(z)) * 0x10001u;  // bf16 -(128 + z), 4-bit codes (dequant8u without kScale)
    c.sf = half_bits_to_float(s_bits);
    c.zf = 8388608.0f + float(z);
  }
  return c;
}

// 4-bit: the zero fields of four columns whose codes are the nibbles of z16 (column i at bits 4i .. 4i + 3), as
// group_const sets them (fp16 zlo, zhi; bf16 zlo), in a few instructions instead of about 9 per column.
template <bool kBf16>
__device__ __forceinline__ void zero_consts4(u32 z16, GroupConst (&c)[4]) {
  const u32 d = prmt(z16, z16, 0x1010u);  // the four codes in both halves
#pragma unroll
  for (int col = 0; col < 4; ++col) {
    if constexpr (kBf16) {
      c[col].zlo = and_or(d >> (4 * col), 0x000F000Fu, 0xC300C300u);  // -(128 + z)
    } else {
      c[col].zlo = and_or(d >> (4 * col), 0x000F000Fu, 0x64006400u);                            // 1024 + z
      c[col].zhi = and_or(col == 0 ? d << 4 : d >> (4 * col - 4), 0x00F000F0u, 0xD400D400u);  // -(64 + z)
    }
  }
}

// Same pair order as dequant8 (4-bit: (k0,k4) (k1,k5) (k2,k6) (k3,k7); 8-bit: natural), same values
// (w = round((q - z) * s), q - z exact). kScale false: w = q - z (exact in fp16 and bf16 for 4 and 8 bits); the
// caller applies the scale to the fp32 sums of the group instead.
// fp16 4-bit: the odd nibbles are taken in place (16 q), 1024 + 16 q is exact, and one fma by 1/16 with
// -(64 + z) gives q - z exactly, so only one shift per word is needed.
template <bool kBf16, int kBits, bool kScale = true>
__device__ __forceinline__ void dequant8u(const u32 (&q)[kBits / 4], const GroupConst& c, u32 (&out)[4]) {
  const auto scaled = [&](u32 w) { return kScale ? hmul2(w, c.ss) : w; };
  if constexpr (!kBf16) {
    if constexpr (kBits == 4) {
      const u32 q8 = q[0] >> 8;
      const u32 p0 = and_or(q[0], 0x000F000Fu, 0x64006400u);
      const u32 p1 = and_or(q[0], 0x00F000F0u, 0x64006400u);
      const u32 p2 = and_or(q8, 0x000F000Fu, 0x64006400u);
      const u32 p3 = and_or(q8, 0x00F000F0u, 0x64006400u);
      out[0] = scaled(hsub2(p0, c.zlo));
      out[1] = scaled(hfma2(p1, 0x2C002C00u, c.zhi));
      out[2] = scaled(hsub2(p2, c.zlo));
      out[3] = scaled(hfma2(p3, 0x2C002C00u, c.zhi));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 codes = prmt(q[i >> 1], 0x64646464u, (i & 1) ? 0x7352u : 0x7150u);
        out[i] = scaled(hsub2(codes, c.zlo));
      }
    }
  } else if constexpr (kBits == 4) {
    // bf16 128 + q is exact (7 mantissa bits), and one fma by 1 with -(128 + z) (zlo) gives q - z exactly; with
    // kScale each half is widened to fp32 (a shift or a mask), multiplied by the scale and rounded once, as below
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 d = bf16_fma2(and_or(q[0] >> (4 * i), 0x000F000Fu, 0x43004300u), 0x3F803F80u, c.zlo);
      out[i] = kScale ? pack2<true>(__uint_as_float(d << 16) * c.sf, __uint_as_float(d & 0xFFFF0000u) * c.sf) : d;
    }
  } else {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const u32 code = kBits == 4 ? (q[0] >> (4 * j)) & 15u : (q[j >> 2] >> (8 * (j & 3))) & 255u;
      v[j] = __uint_as_float(0x4B000000u | code) - c.zf;
      if constexpr (kScale) v[j] *= c.sf;
    }
    if constexpr (kBits == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = pack2<true>(v[i], v[i + 4]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = pack2<true>(v[2 * i], v[2 * i + 1]);
    }
  }
}

// 8 codes k0..k7 of one column -> 16 bytes in the activations' k order, for a shared-memory B tile read back by
// ldmatrix or wgmma: natural (k0,k1) (k2,k3) (k4,k5) (k6,k7); kPairA (4-bit, activations in pair order, see
// row_pairs): the dequantizer's own (k0,k4) (k1,k5) (k2,k6) (k3,k7), as they come.
template <bool kBf16, int kBits, bool kPairA = false>
__device__ __forceinline__ uint4 dequant8_natural(const u32 (&q)[kBits / 4], const GroupConst& c) {
  u32 p[4];
  dequant8u<kBf16, kBits>(q, c, p);
  if constexpr (kBits == 4 && !kPairA) {
    return make_uint4(prmt(p[0], p[1], 0x5410u), prmt(p[2], p[3], 0x5410u), prmt(p[0], p[1], 0x7632u),
                      prmt(p[2], p[3], 0x7632u));
  } else {
    return make_uint4(p[0], p[1], p[2], p[3]);
  }
}

// ---- register A fragments of the swapped Hopper kernel (moe_gemm_swapped): the weights are the wgmma M side ----
// For one output column and one 32-k chunk, f[i] = the pair k (8i + 2t, 8i + 2t + 1) (t = lane % 4): f[0], f[1] are
// the column's k 2t and 2t + 8 pairs of the chunk's first k16 step, f[2], f[3] those of the second. 4-bit: the pair
// is byte t of word i (words = the chunk's 4 qweight rows); 8-bit: half (t & 1) of word 2i + (t >> 1) (8 rows).
// Values as everywhere: w = round((q - z) * s), q - z exact; c from group_const.
// fp16 4-bit: one PRMT puts byte t of two words at bytes 0/2 and 1/3; masking 0x00F0000F then leaves the low code at
// bits 0-3 and the high code at bits 20-23, i.e. the halves 1024 + lo and 1024 + 16 hi, and one fma with
// (1, 1/16) and (-(1024 + z), -(64 + z)) (zmix) gives (lo - z, hi - z) exactly.
// The lane's PRMT selector for frag_words, computed once per thread.
__device__ __forceinline__ u32 frag_select(int kBits, int t) {
  return kBits == 4 ? u32(t) | (u32(t + 4) << 4) | (u32(t) << 8) | (u32(t + 4) << 12)  // byte t of a, b, a, b
                    : u32(2 * (t & 1)) | (4u << 4) | (u32(2 * (t & 1) + 1) << 8) | (4u << 12);  // half (t&1), 0x64
}

// One column's A fragment of one 32-k chunk from the raw words the lane needs (4-bit: qweight rows 0..3 of the chunk;
// 8-bit: rows 2i + (t >> 1), i = 0..3), loaded by the caller; sel from frag_select.
template <bool kBf16, int kBits>
__device__ __forceinline__ void frag_words(const u32 (&w)[4], int t, u32 sel, const GroupConst& c, u32 (&f)[4]) {
  if constexpr (kBits == 4) {
    if constexpr (!kBf16) {
      const u32 x01 = prmt(w[0], w[1], sel), x23 = prmt(w[2], w[3], sel);
      const u32 p[4] = {and_or(x01, 0x00F0000Fu, 0x64006400u), and_or(x01 >> 8, 0x00F0000Fu, 0x64006400u),
                        and_or(x23, 0x00F0000Fu, 0x64006400u), and_or(x23 >> 8, 0x00F0000Fu, 0x64006400u)};
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = hmul2(hfma2(p[i], 0x2C003C00u, c.zmix), c.ss);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 b = w[i] >> (8 * t);
        f[i] = pack2<true>((__uint_as_float(0x4B000000u | (b & 15u)) - c.zf) * c.sf,
                           (__uint_as_float(0x4B000000u | ((b >> 4) & 15u)) - c.zf) * c.sf);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (!kBf16) {
        f[i] = hmul2(hsub2(prmt(w[i], 0x64646464u, sel), c.zlo), c.ss);
      } else {
        const u32 b = w[i] >> (16 * (t & 1));
        f[i] = pack2<true>((__uint_as_float(0x4B000000u | (b & 255u)) - c.zf) * c.sf,
                           (__uint_as_float(0x4B000000u | ((b >> 8) & 255u)) - c.zf) * c.sf);
      }
    }
  }
}

// One row's activations as mma operand pairs in the dequantizer's k order (4-bit (k0,k4) (k1,k5) | (k2,k6) (k3,k7);
// 8-bit natural): for k16 half kh of a 32-k chunk, p_kh[0] / p_kh[1] = the pairs at A slots 2t, 2t+1 / 2t+8, 2t+9.
// x: the row's 8 activations k0+8t .. k0+8t+7 (a 16-byte load). They are the B operand of the swapped decode mmas
// (weights as the m16 side, rows as the n8 side) and half of the A operand below.
// kPairA: the activations are stored in pair order already (each 8-k run as k0 k4 k1 k5 k2 k6 k3 k7; 4-bit only),
// so the load is the pairs.
template <int kBits, bool kPairA = false>
__device__ __forceinline__ void row_pairs(const uint4& x, u32 (&p0)[2], u32 (&p1)[2]) {
  static_assert(!kPairA || kBits == 4, "pair order is the 4-bit dequantizer's");
  if constexpr (kBits == 4 && !kPairA) {
    p0[0] = prmt(x.x, x.z, 0x5410u); p0[1] = prmt(x.x, x.z, 0x7632u);
    p1[0] = prmt(x.y, x.w, 0x5410u); p1[1] = prmt(x.y, x.w, 0x7632u);
  } else {
    p0[0] = x.x; p0[1] = x.y;
    p1[0] = x.z; p1[1] = x.w;
  }
}

// The A operand (16x16 row-major fragment) for the two mmas of one 32-wide k chunk, in the k order above.
// x, y: the 8 activations k0+8t .. k0+8t+7 of rows g and g+8 (16-byte loads).
template <int kBits, bool kPairA = false>
__device__ __forceinline__ void a_operands(const uint4& x, const uint4& y, u32 (&a0)[4], u32 (&a1)[4]) {
  if constexpr (kPairA) {  // one PRMT per register all the same: it writes the operand quad in place (plain moves
    // instead made nvcc 13.0 copy the loaded registers about three times over: 329 -> 391 instructions per stage)
    const u32 id = 0x3210u;
    a0[0] = prmt(x.x, 0u, id); a0[1] = prmt(y.x, 0u, id); a0[2] = prmt(x.y, 0u, id); a0[3] = prmt(y.y, 0u, id);
    a1[0] = prmt(x.z, 0u, id); a1[1] = prmt(y.z, 0u, id); a1[2] = prmt(x.w, 0u, id); a1[3] = prmt(y.w, 0u, id);
    return;
  }
  u32 x0[2], x1[2], y0[2], y1[2];
  row_pairs<kBits>(x, x0, x1);
  row_pairs<kBits>(y, y0, y1);
  a0[0] = x0[0]; a0[1] = y0[0]; a0[2] = x0[1]; a0[3] = y0[1];
  a1[0] = x1[0]; a1[1] = y1[0]; a1[2] = x1[1]; a1[3] = y1[1];
}

}  // namespace gptq

// Hopper-only PTX: warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for the 64-byte swizzled K-major
// tiles the tc kernel stages (rows of 32 k = 64 bytes, 16-byte chunk c of row r stored at c ^ ((r >> 1) & 3), tile
// bases 512-byte aligned), the m64n128k16 / m64n256k16 ops with fp32 accumulation in registers, the m64nNk16 ops
// with A in registers (N = 16 .. 128, for moe_gemm_swapped), and their fences.
//
// Accumulator fragment (PTX ISA, wgmma .m64nNk16 D layout): warp w of the warpgroup holds rows 16w + g and
// 16w + g + 8 (g = lane / 4); d[j][0..1] are columns 8j + 2t, 8j + 2t + 1 of row 16w + g (t = lane % 4) and
// d[j][2..3] the same columns of row 16w + g + 8: the mma.sync m16n8 layout, one n8 tile per j.
#pragma once

namespace gptq {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kHaveWgmma = true;
#else
constexpr bool kHaveWgmma = false;
#endif

// Descriptor of a K-major tile with 64-byte swizzle: start address / 16 (bits 0-13), leading-dimension offset
// 16 B / 16 (bits 16-29; unused when one k16 slice lies inside the 64-byte swizzle span), stride between 8-row
// groups 512 B / 16 (bits 32-45), layout 2 = 64-byte swizzle (bits 62-63). Advancing the start by 32 bytes selects
// the second k16 slice of a 64-byte row; the hardware applies the swizzle to the final address.
// The descriptor is built from its low word (start field and leading-dimension offset); the high word is the same
// for every tile. Tiles at byte offset o from a base have the base's low word + o / 16 (shared-memory addresses are
// below 256 KiB, so the 14-bit start field does not overflow), one 32-bit add per tile in the main loop.
// The low word of a tile's descriptor: built once per base, then stepped by one add per tile.
__device__ __forceinline__ unsigned wg_desc_sw64_lo(unsigned smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4) | (1u << 16);
}
// The full descriptor from a low word (the high word is a constant).
__device__ __forceinline__ unsigned long long wg_desc_sw64_at(unsigned lo) {
  return static_cast<unsigned long long>(lo) | (32ull << 32) | (2ull << 62);
}
// The descriptor of the tile at a shared address, where a kernel computes the address anyway.
__device__ __forceinline__ unsigned long long wg_desc_sw64(unsigned smem_addr) {
  return wg_desc_sw64_at(wg_desc_sw64_lo(smem_addr));
}

// Orders this thread's earlier accumulator and register-operand writes before the wgmma ops that read them.
__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
// Closes the wgmma ops issued since the last commit into one group, which wg_wait retires as a whole.
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// Waits until at most N wgmma groups are in flight: the operands and accumulators of the older ones are free.
template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Shared-memory writes of the generic proxy (st.shared, cp.async) become visible to wgmma (async proxy) reads;
// each writing thread runs it before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// Keeps the compiler from touching accumulator registers across an in-flight wgmma (issue ... wait).
template <int NT>
__device__ __forceinline__ void wg_fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[j][r])::"memory");
}

// Inline PTX takes no operand arrays, so the accumulator operands are written out: n8 tiles o, o+1, ... (4 floats
// each), and the operand names %0 ... of the first 8, 16, 32, 64 floats and %64 ... %127 of the next 64.
#define CUPY_MOE_ACC1(d, o) "+f"(d[o][0]), "+f"(d[o][1]), "+f"(d[o][2]), "+f"(d[o][3])
#define CUPY_MOE_ACC2(d, o) CUPY_MOE_ACC1(d, o), CUPY_MOE_ACC1(d, o + 1)
#define CUPY_MOE_ACC4(d, o) CUPY_MOE_ACC2(d, o), CUPY_MOE_ACC2(d, o + 2)
#define CUPY_MOE_ACC8(d, o) CUPY_MOE_ACC4(d, o), CUPY_MOE_ACC4(d, o + 4)
#define CUPY_MOE_ACC16(d, o) CUPY_MOE_ACC8(d, o), CUPY_MOE_ACC8(d, o + 8)
#define CUPY_MOE_REGS_0_7 "%0, %1, %2, %3, %4, %5, %6, %7"
#define CUPY_MOE_REGS_0_15 CUPY_MOE_REGS_0_7 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define CUPY_MOE_REGS_0_23 CUPY_MOE_REGS_0_15 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define CUPY_MOE_REGS_0_31 CUPY_MOE_REGS_0_15 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUPY_MOE_REGS_0_63 CUPY_MOE_REGS_0_31 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUPY_MOE_REGS_64_127 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUPY_MOE_WGMMA(N, TY, REGS, DESC_A, DESC_B, SCALE_D, ...)                                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                                            \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, " DESC_A ", " DESC_B  \
               ", p, 1, 1, 0, 0;\n}\n"                                                                         \
               : __VA_ARGS__                                                                                   \
               : "l"(desc_a), "l"(desc_b), "r"(1))
#define CUPY_MOE_WGMMA_N128(TY) \
  CUPY_MOE_WGMMA(128, TY, CUPY_MOE_REGS_0_63, "%64", "%65", "%66", CUPY_MOE_ACC16(d, 0))
#define CUPY_MOE_WGMMA_N256(TY)                                                                  \
  CUPY_MOE_WGMMA(256, TY, CUPY_MOE_REGS_0_63 ", " CUPY_MOE_REGS_64_127, "%128", "%129", "%130", \
                 CUPY_MOE_ACC16(d, 0), CUPY_MOE_ACC16(d, 16))
// A from registers: {a0..a3} follow the accumulators, then the B descriptor and the scale-d flag; B K-major.
#define CUPY_MOE_WGMMA_RS(N, TY, REGS, A, DESC_B, SCALE_D, ...)                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                                            \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, {" A "}, " DESC_B     \
               ", p, 1, 1, 0;\n}\n"                                                                            \
               : __VA_ARGS__                                                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

// D[64 x N] += A[64 x 16] * B[16 x N], N = 128 or 256; A rows and B columns K-major in shared memory (descriptors
// above); d[j] is the j-th n8 tile of the fragment described at the top.
template <bool kBf16, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 8][4], unsigned long long desc_a,
                                             unsigned long long desc_b) {
  static_assert(N == 128 || N == 256, "wgmma width");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (N == 128 && kBf16) {
    CUPY_MOE_WGMMA_N128("bf16");
  } else if constexpr (N == 128) {
    CUPY_MOE_WGMMA_N128("f16");
  } else if constexpr (kBf16) {
    CUPY_MOE_WGMMA_N256("bf16");
  } else {
    CUPY_MOE_WGMMA_N256("f16");
  }
#endif
}

// The same with A in registers: a[0..3] is the mma.sync m16n8k16 A fragment of warp w's rows 16w .. 16w + 15 (rows
// g, g + 8 x k 2t, 2t + 1 in a[0], a[1]; k 2t + 8, 2t + 9 in a[2], a[3]); N = 16, 32, 48, 64 or 128. The registers
// of a must keep their values until a wg_wait retires the op.
template <bool kBf16, int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 8][4], const unsigned (&a)[4],
                                                unsigned long long desc_b) {
  static_assert(N == 16 || N == 32 || N == 48 || N == 64 || N == 128, "wgmma width");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUPY_MOE_RS(TY)                                                                                         \
  if constexpr (N == 16) {                                                                                      \
    CUPY_MOE_WGMMA_RS(16, TY, CUPY_MOE_REGS_0_7, "%8, %9, %10, %11", "%12", "%13", CUPY_MOE_ACC2(d, 0));       \
  } else if constexpr (N == 32) {                                                                               \
    CUPY_MOE_WGMMA_RS(32, TY, CUPY_MOE_REGS_0_15, "%16, %17, %18, %19", "%20", "%21", CUPY_MOE_ACC4(d, 0));    \
  } else if constexpr (N == 48) {                                                                               \
    CUPY_MOE_WGMMA_RS(48, TY, CUPY_MOE_REGS_0_23, "%24, %25, %26, %27", "%28", "%29", CUPY_MOE_ACC4(d, 0),       \
                      CUPY_MOE_ACC2(d, 4));                                                                     \
  } else if constexpr (N == 64) {                                                                               \
    CUPY_MOE_WGMMA_RS(64, TY, CUPY_MOE_REGS_0_31, "%32, %33, %34, %35", "%36", "%37", CUPY_MOE_ACC8(d, 0));    \
  } else {                                                                                                      \
    CUPY_MOE_WGMMA_RS(128, TY, CUPY_MOE_REGS_0_63, "%64, %65, %66, %67", "%68", "%69", CUPY_MOE_ACC16(d, 0));  \
  }
  if constexpr (kBf16) {
    CUPY_MOE_RS("bf16")
  } else {
    CUPY_MOE_RS("f16")
  }
#undef CUPY_MOE_RS
#endif
}
#undef CUPY_MOE_WGMMA_RS
#undef CUPY_MOE_WGMMA_N128
#undef CUPY_MOE_WGMMA_N256
#undef CUPY_MOE_WGMMA
#undef CUPY_MOE_REGS_64_127
#undef CUPY_MOE_REGS_0_63
#undef CUPY_MOE_REGS_0_31
#undef CUPY_MOE_REGS_0_23
#undef CUPY_MOE_REGS_0_15
#undef CUPY_MOE_REGS_0_7
#undef CUPY_MOE_ACC16
#undef CUPY_MOE_ACC8
#undef CUPY_MOE_ACC4
#undef CUPY_MOE_ACC2
#undef CUPY_MOE_ACC1

}  // namespace gptq

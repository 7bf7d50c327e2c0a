// Copies and pipelines of the GEMM kernels: cp.async copies from global into shared memory (the stage rings every
// kernel keeps in flight), their commit and wait groups, 32-bit shared-memory addresses and stores, and the check
// that a launch gave a kernel the dynamic shared memory its layout needs. The rings themselves are laid out by each
// kernel (their slot layouts differ); what they share is here.
#pragma once

namespace gptq {

// 16-byte global -> shared copy that bypasses registers and L1, so a stage's loads stay in flight at no register
// cost; `full` false zero-fills without reading (padding rows, steps past the slice end).
// dst: a shared-memory address (smem_u32) or a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* gmem, bool full) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(full ? 16 : 0)
               : "memory");
}
// The same from a generic pointer into shared memory (callers that index a __shared__ array).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
  cp_async16(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem, full);
}
// Closes the copies issued since the last commit into one group: one group per ring stage, waited for as a whole.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N groups are pending, i.e. the oldest stages of the ring have landed while N stay in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The value, which the compiler then keeps in a register: without it, values derived from the thread index or the
// shared-memory base are recomputed in the main loop (rematerialized) at a few instructions each time.
__device__ __forceinline__ unsigned kept(unsigned x) {
  asm volatile("" : "+r"(x));
  return x;
}

// 16-byte shared-memory store at a 32-bit shared address (addresses computed with XOR, which a pointer cannot keep)
__device__ __forceinline__ void st_shared16(unsigned addr, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The 32-bit shared-memory address of a generic pointer: what cp.async, ldmatrix and the wgmma descriptors take.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Traps when the launch gave less dynamic shared memory than the kernel's layout needs: the launcher computes the
// size in Python (configs.GemmConfig.smem_bytes), so a mismatch would otherwise overwrite memory silently.
__device__ __forceinline__ void require_dyn_smem(int bytes) {
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  if (dyn < static_cast<unsigned>(bytes)) __trap();  // launcher / kernel layout mismatch
}

}  // namespace gptq

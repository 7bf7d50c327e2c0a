// Programmatic dependent launch (sm_90 and later). cupy_moe._compile.launch starts every cupy_moe kernel with the
// programmatic-serialization attribute, so a kernel may be scheduled while the previous kernel of its stream is
// still running: its launch latency and CTA rasterization overlap the previous kernel's tail. Hence every kernel
// calls pdl::wait() before its first global-memory access (it returns once the previous grid has finished and its
// writes are visible; transitively every earlier one too), then pdl::trigger(), which lets the next kernel be
// scheduled once every CTA of this grid has called it or exited. Launched without the attribute, or compiled below
// sm_90, both are no-ops.
#pragma once

namespace pdl {
// Blocks until the previous grid of the stream has finished and its writes are visible: before any global access.
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel of the stream be scheduled (once every CTA has called it or exited): overlaps its launch.
__device__ __forceinline__ void trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// both, at the top of a kernel
__device__ __forceinline__ void enter() {
  wait();
  trigger();
}
}  // namespace pdl

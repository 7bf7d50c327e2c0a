"""The accuracy bar of the GPU GEMM, in one place.

Measured: relative L2 error ||out - ref|| / ||ref|| against a reference computed in float64 (float32 activations
in, so nothing is rounded before the end). Reasoning:
- fp16: the kernel rounds each dequantized weight to fp16 (relative error <= 2^-11, rms ~2^-11/sqrt(3) ~ 2.8e-4)
  and the output once (~2.8e-4 rms); fp32 accumulation adds far less. Together ~4e-4 rms, so 1e-3 leaves 2.5x
  margin and still catches a wrong group, zero, scale or k order (those give errors of order 1e-1 to 1).
- bf16: the same two roundings at 2^-8 (~2.2e-3 rms each), ~3.2e-3 together: bar 8e-3.
NaN never passes. Never loosen these to make a test green.
"""
REL_L2 = {"float16": 1e-3, "bfloat16": 8e-3}

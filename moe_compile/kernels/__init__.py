"""Kernels of the fused MoE op: reference (the oracle), cpu (fast CPU path), triton/ (GPU)."""

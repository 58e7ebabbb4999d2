"""Triton (GPU) kernels of the fused MoE op, one op per file.

    align.py         slots sorted by expert, padded to BLOCK_M, on the device
    grouped_gemm.py  FC1 / FC2 grouped GEMM: gathered A rows, per-expert B (stacked or pointer
                     table), activation and routing weight in the epilogue
    fused_moe.py     the host wrapper ``fused_moe_triton`` and the combine over K
    autotune.py      tile configs per shape class and device, cached on disk

Nothing here is imported by ``import moe_compile``; ``kernels/triton_dispatch.py`` imports it on
the first CUDA call.  Run the kernels on CPU tensors with ``TRITON_INTERPRET=1`` (fp16/fp32 only).
"""

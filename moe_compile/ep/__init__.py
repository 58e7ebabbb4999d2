"""Expert parallelism: the fused dispatch-experts-combine op over a symmetric heap or collectives.

``call_fused_moe_ep`` registers ``torch.ops.moe_compile.fused_moe_ep`` on first use (importing
``moe_compile.ep`` alone registers nothing and starts nothing).
"""

from __future__ import annotations


def call_fused_moe_ep(*args, **kwargs):
    from moe_compile.ep.op import call_fused_moe_ep as _call

    return _call(*args, **kwargs)


def register() -> None:
    """Import the op module (registers the op, its fake and its autograd)."""
    import moe_compile.ep.op  # noqa: F401


__all__ = ["call_fused_moe_ep", "register"]

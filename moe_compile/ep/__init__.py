"""Expert parallelism: the fused dispatch-experts-combine op over a symmetric heap or collectives,
and the 2D all-to-all ops in torch's ``all_to_all_vdev_2d`` contract (``ep_dispatch`` / ``ep_combine``).

``call_fused_moe_ep`` registers ``torch.ops.moe_compile.fused_moe_ep`` on first use, ``register()``
registers every op of the package here (importing ``moe_compile.ep`` alone registers nothing and
starts nothing).
"""

from __future__ import annotations


def call_fused_moe_ep(*args, **kwargs):
    from moe_compile.ep.op import call_fused_moe_ep as _call

    return _call(*args, **kwargs)


def register() -> None:
    """Import the op modules (register the ops, their fakes and their autograd)."""
    import moe_compile.ep.a2a  # noqa: F401
    import moe_compile.ep.op  # noqa: F401


__all__ = ["call_fused_moe_ep", "register"]

"""The rewrite step's quantization decision for one matched MoE layer.

    plan_layer(spec, policy, budget_db, differentiated, device, tag) -> QuantPlan
      policy "none"                       -> unquantized op, no note
      training graph / expert-parallel op -> unquantized op, the reason in the report
      layout not quantizable (biases, not SwiGLU, weight on the input, K not a multiple of the
      group)                              -> unquantized op, the reason in the report
      explicit format this CPU cannot run -> ValueError naming the variants it runs
      otherwise                           -> ``fused_moe_quant`` with the policy ("auto" chooses
                                             on the first real call, ``kernels/cpu/quant.py``)
"""

from __future__ import annotations

import dataclasses

from moe_compile.quant.common import QuantRefusal, check_group
from moe_compile.quant.formats import default_group


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    policy: str  # "" (unquantized op) or the format / "auto" the op call carries
    note: str = ""  # why the layer stays unquantized, when it does
    tag: str = ""  # the layer's name in the op call and in explain()
    budget_db: float = 0.0  # auto's accuracy budget


def _layout_refusal(spec, policy: str) -> str | None:
    if spec.fc1_bias or spec.fc1_up_bias or spec.fc2_bias:
        return "the experts have biases (quantized variants cover SwiGLU experts without biases)"
    a = spec.attrs
    if a.gate_up == "none" or a.activation != "silu":
        return f"activation {a.activation!r} / gate_up {a.gate_up!r}: quantized variants cover SwiGLU only"
    if a.weight_on == "input":
        return "the routing weight multiplies the input (weight_on='input')"
    if policy == "auto":
        return None
    try:
        check_group(spec.hidden, default_group(policy, spec.hidden), policy)
        check_group(spec.ffn, default_group(policy, spec.ffn), policy)
    except QuantRefusal as exc:
        return str(exc)
    return None


def plan_layer(spec, policy: str, budget_db: float, differentiated: bool, device: str, tag: str) -> QuantPlan:
    if policy == "none":
        return QuantPlan("")
    if differentiated:
        return QuantPlan("", f"quant={policy!r} ignored: training graph (quantized variants are inference-only); "
                             f"the unquantized op runs")
    if spec.family == "expert_parallel":
        return QuantPlan("", f"quant={policy!r} ignored: the expert-parallel op has no quantized variants yet")
    reason = _layout_refusal(spec, policy)
    if reason:
        return QuantPlan("", f"quant={policy!r} refused: {reason}; the unquantized op runs")
    if device != "cpu":
        if policy == "auto":
            return QuantPlan("", f"quant='auto': no verified quantized variant on {device} (GPU variants are "
                                 f"not built); the unquantized op runs")
        raise ValueError(f"moe_compile quant={policy!r}: no native kernel on {device} (GPU quantized variants are "
                         f"not built; see `moe-compile devices`); use quant='none' or 'auto'")
    if policy != "auto":
        from moe_compile.kernels.cpu import quant as cpu_quant

        cpu_quant.check_explicit(policy, spec.num_experts, spec.hidden, spec.ffn)
    return QuantPlan(policy, tag=tag, budget_db=budget_db)

"""The MoE IR: what every matcher produces and what the fused op consumes.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Three frozen, validated pieces:

* ``FFNAttrs``      static attributes of the experts' FFN (layout, activation, where the routing
                    weight multiplies).  They become the op's non-tensor arguments.
* ``ExpertWeights`` the experts' weight tensors *as the model holds them*: each role is either one
                    stacked 3-D tensor ``[E, out, in]`` (``[E, in, out]`` when ``transposed``) or a
                    list of E per-expert 2-D tensors.  Nothing is stacked or copied per call.
* ``MoESpec``       a matched region lifted to the IR: FX nodes for x / ids / weights / expert
                    tensors, the attributes, and what ``explain()`` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

GATE_UP_LAYOUTS = ("separate", "concat", "interleaved", "none")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "gptoss")
WEIGHT_PLACEMENTS = ("output", "between", "input")
FAMILIES = ("loop", "sorted", "gathered", "dense", "expert_parallel")
WEIGHT_ROLES = ("fc1", "fc1_up", "fc2")
ROLES = (*WEIGHT_ROLES, "fc1_bias", "fc1_up_bias", "fc2_bias")  # ExpertWeights' tensors, the op's args 3..8


@dataclasses.dataclass(frozen=True)
class FFNAttrs:
    """How one expert computes.

    gate_up:     "separate" (gate and up are two tensors), "concat" ([gate; up] along the output
                 dim), "interleaved" (gate0, up0, gate1, up1, ... — GPT-OSS), "none" (no gate:
                 act(up) only).
    transposed:  weights are stored [in, out] (``x @ W``) instead of [out, in] (``F.linear``).
    activation:  the gate's activation; "gptoss" is GPT-OSS's clamped ``(up+1) * g*sigmoid(alpha g)``.
    limit:       clamp of gate (max) and up (both sides) before the activation; 0 means none.
    alpha:       the sigmoid slope of "gptoss".
    weight_on:   where g_{t,k} multiplies: "output" (HF, Mixtral), "between" activation and down
                 (DeepSeek-V4, Megatron), or "input" (Llama4; not equivalent to the others).
    """

    gate_up: str = "concat"
    transposed: bool = False
    activation: str = "silu"
    limit: float = 0.0
    alpha: float = 1.702
    weight_on: str = "output"

    def __post_init__(self) -> None:
        _check_choice("gate_up", self.gate_up, GATE_UP_LAYOUTS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("weight_on", self.weight_on, WEIGHT_PLACEMENTS)
        if self.limit < 0:
            raise ValueError(f"FFNAttrs.limit must be >= 0 (0 = no clamp), got {self.limit}")
        if self.activation == "gptoss" and self.limit <= 0:
            raise ValueError("FFNAttrs.activation='gptoss' needs a positive clamp limit")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def is_stacked(role: Sequence[torch.Tensor], stacked_dim: int = 3) -> bool:
    """Whether a role is one stacked tensor (weights: 3-D, biases: 2-D) rather than E per-expert ones."""
    return len(role) == 1 and role[0].dim() == stacked_dim


def _role_experts(role: Sequence[torch.Tensor], stacked_dim: int = 3) -> int:
    """E of a weight role (stacked: one 3-D tensor) or bias role (stacked: one 2-D tensor)."""
    if is_stacked(role, stacked_dim):
        return role[0].shape[0]
    return len(role)


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Per-role expert tensors; each role is [stacked 3-D] or [E x 2-D], biases [E, n] or E x [n]."""

    fc1: tuple[torch.Tensor, ...]
    fc1_up: tuple[torch.Tensor, ...]
    fc2: tuple[torch.Tensor, ...]
    fc1_bias: tuple[torch.Tensor, ...] = ()
    fc1_up_bias: tuple[torch.Tensor, ...] = ()
    fc2_bias: tuple[torch.Tensor, ...] = ()
    transposed: bool = False

    def __post_init__(self) -> None:
        if not self.fc1 or not self.fc2:
            raise ValueError("ExpertWeights needs fc1 and fc2 tensors")
        counts = {
            name: _role_experts(getattr(self, name), 2 if name.endswith("bias") else 3)
            for name in ("fc1", "fc1_up", "fc2", "fc1_bias", "fc1_up_bias", "fc2_bias")
            if getattr(self, name)
        }
        for name, role in (("fc1", self.fc1), ("fc1_up", self.fc1_up), ("fc2", self.fc2)):
            if role and any(t.dim() != (3 if len(role) == 1 and role[0].dim() == 3 else 2) for t in role):
                raise ValueError(f"{name}: give one stacked 3-D tensor or a list of 2-D tensors")
        values = list(counts.values())
        if any(v != values[0] for v in values):
            raise ValueError(f"expert counts differ between weight roles: {counts}")

    @property
    def num_experts(self) -> int:
        return _role_experts(self.fc1)

    @staticmethod
    def _pick(role: tuple[torch.Tensor, ...], e: int) -> torch.Tensor | None:
        if not role:
            return None
        if is_stacked(role):
            return role[0][e]
        return role[e]

    def fc1_of(self, e: int) -> torch.Tensor:
        return self._pick(self.fc1, e)

    def fc1_up_of(self, e: int) -> torch.Tensor:
        return self._pick(self.fc1_up, e)

    def fc2_of(self, e: int) -> torch.Tensor:
        return self._pick(self.fc2, e)

    def fc1_bias_of(self, e: int):
        return _pick_bias(self.fc1_bias, e)

    def fc1_up_bias_of(self, e: int):
        return _pick_bias(self.fc1_up_bias, e)

    def fc2_bias_of(self, e: int):
        return _pick_bias(self.fc2_bias, e)

    def hidden(self) -> int:
        w = self.fc2_of(0)
        return w.shape[1] if self.transposed else w.shape[0]

    def ffn(self) -> int:
        w = self.fc2_of(0)
        return w.shape[0] if self.transposed else w.shape[1]

    def fc1_width(self) -> int:
        """F2: the width of FC1's output, gate and up together (2F gated, F for gate_up "none")."""
        dim = 1 if self.transposed else 0
        up = self.fc1_up_of(0).shape[dim] if self.fc1_up else 0
        return self.fc1_of(0).shape[dim] + up


def _pick_bias(role: tuple[torch.Tensor, ...], e: int) -> torch.Tensor | None:
    """Biases: one stacked [E, n] tensor, or E tensors [n]."""
    if not role:
        return None
    if is_stacked(role, 2):
        return role[0][e]
    return role[e]


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """A matched MoE region, lifted.

    Node fields hold ``torch.fx.Node`` objects of the graph the match was found in; the role
    tuples hold nodes whose runtime values form an ``ExpertWeights``.
    """

    family: str
    x: object  # fx.Node  [T, H]
    topk_ids: object  # fx.Node  [T, K]
    topk_weights: object  # fx.Node  [T, K]
    output: object  # fx.Node  [T, H] — the region's result, replaced by the op
    fc1: tuple
    fc1_up: tuple
    fc2: tuple
    fc1_bias: tuple
    fc1_up_bias: tuple
    fc2_bias: tuple
    attrs: FFNAttrs
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    region: tuple = ()  # fx.Nodes of the region, in graph order (for dump and erase)
    source: str = ""  # module path when known ("model.layers.0.mlp.experts")
    variant: str = "a16w16"
    # Weight roles the model holds in the other orientation than ``attrs.transposed`` (DBRX: w1 / v1
    # used as ``x @ W.t()``, w2 as ``h @ W``): the op reads them as ``transpose(-2, -1)`` views of the
    # model's tensors — the same storage with swapped strides, never a copy.
    flipped: tuple = ()
    # (role, (E, out, in)) for roles held as one [E*out, in] weight (experts as one ``nn.Linear(H, E*F)``
    # whose output is viewed [T, E, F]): the op reads ``param.view(E, out, in)``, then flips it if asked;
    # (role + "_bias", (E, out)) for that Linear's [E*out] bias, read as ``bias.view(E, out)``.
    unflattened: tuple = ()

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        for name in ("num_experts", "top_k", "hidden", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoESpec.{name} must be a positive int, got {value!r}")
        if not self.fc1 or not self.fc2:
            raise ValueError("MoESpec needs fc1 and fc2 weight nodes")
        for role in self.flipped:
            _check_choice("flipped role", role, WEIGHT_ROLES)
        for role, shape in self.unflattened:
            _check_choice("unflattened role", role, (*WEIGHT_ROLES, *(f"{r}_bias" for r in WEIGHT_ROLES)))
            if len(shape) != (2 if role.endswith("bias") else 3):
                raise ValueError(f"MoESpec.unflattened: {role} must be viewed [E, out, in] (a bias [E, out]), "
                                 f"got {shape}")

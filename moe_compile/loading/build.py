"""The model a loader fills: built on the meta device from its config, then given its tensors one at
a time, each packed (or cast) as it arrives, so no full-precision copy of the model ever exists.

    target = Target(config, dtype, quant, quant_dense)
    for each tensor of the checkpoint:  target.put(name, tensor)          # a plain tensor, any dtype
                                        target.put_packed(name, qweight)  # a QuantWeight already
    model = target.finish()            # every parameter filled, buffers made, report attached

Which weights are packed (``role``):
  expert stacks ``*.experts.gate_up_proj`` [E, 2F, H] / ``*.experts.down_proj`` [E, H, F]: ``quant``
  ``nn.Linear`` weights (attention, lm_head, shared experts), not a router: ``quant_dense``
  everything else (embeddings, norms, routers, biases): kept as it is stored, cast to ``dtype``
A packed weight becomes a ``PackedWeight`` parameter (``quant/packed.py``), held as qgemm's panels
alone where the decode and prefill kernels both read those (4- and 8-bit integer codes), else in
its canonical bytes.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from moe_compile.quant.packed import PackedWeight

EXPERT_STACKS = re.compile(r".*\.experts\.(gate_up_proj|down_proj)$")
# modules whose weight picks experts: kept in their own dtype (quantizing them changes which experts run)
ROUTER_NAMES = re.compile(r".*\.(gate|router|gate_inp|shared_expert_gate)$")


@dataclasses.dataclass(frozen=True)
class LoadedTensor:
    """One row of the load report."""

    name: str  # the model's parameter
    stored: str  # the checkpoint's type ("bf16", "q4_0", ...)
    kept: str  # what the model holds: a dtype or "<format> (<packing>)"
    nbytes: int  # bytes the model holds for it
    sqnr_db: float | None = None  # a converted weight's error against the stored values (None: exact)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    source: str
    tensors: tuple[LoadedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __str__(self) -> str:
        kinds: dict[tuple, list] = {}
        for t in self.tensors:
            kinds.setdefault((t.stored, t.kept), []).append(t)
        lines = [f"moe_compile.load: {self.source}: {len(self.tensors)} tensors, {self.nbytes / 2**30:.2f} GiB held"]
        for (stored, kept), ts in sorted(kinds.items()):
            worst = [t.sqnr_db for t in ts if t.sqnr_db is not None]
            err = f", converted: worst SQNR {min(worst):.1f} dB" if worst else ""
            lines.append(f"  {len(ts):4d} x {stored} -> {kept} ({sum(t.nbytes for t in ts) / 2**20:.1f} MiB{err})")
        return "\n".join(lines)


def role(model: torch.nn.Module, name: str) -> str:
    """"experts", "linear" or "other" for parameter ``name`` of ``model`` (see the module docstring)."""
    if EXPERT_STACKS.match(name):
        return "experts"
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(module, torch.nn.Linear) and leaf == "weight" and not ROUTER_NAMES.match(module_name):
        return "linear"
    return "other"


def packed_parameter(qw, dtype: torch.dtype, linear: bool) -> PackedWeight:
    """The PackedWeight of a canonical QuantWeight: panels alone where the kernels read panels at
    every T, else the canonical bytes."""
    from moe_compile.kernels.cpu import qdecode, qgemm

    panels = qgemm.code_panels_only(qw) and qdecode.rows16_runs(qw)
    return PackedWeight.of(qw, dtype, linear=linear, packing="panels" if panels else "rows")


def _kept(p: torch.Tensor) -> str:
    if isinstance(p, PackedWeight):
        return f"{p.fmt} g{p.group} ({p.packing})"
    return str(p.dtype).removeprefix("torch.")


def _nbytes(p: torch.Tensor) -> int:
    return p.packed_nbytes if isinstance(p, PackedWeight) else p.numel() * p.element_size()


class Target:
    """The meta-device model being filled; see the module docstring."""

    def __init__(self, config, dtype: torch.dtype, quant: str | None, quant_dense: str | None, source: str):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.dtype, self.quant, self.quant_dense, self.source = dtype, quant, quant_dense, source
        self.rows: dict[str, LoadedTensor] = {}

    def wanted(self, name: str) -> str | None:
        """The format ``name`` is to be packed in (None: kept in ``dtype``)."""
        kind = role(self.model, name)
        return self.quant if kind == "experts" else self.quant_dense if kind == "linear" else None

    def expected_shape(self, name: str) -> tuple:
        try:
            return tuple(self.model.get_parameter(name).shape)
        except AttributeError:
            raise KeyError(f"moe_compile.load: {self.source}: the checkpoint's {name!r} is no parameter of "
                           f"{type(self.model).__name__}") from None

    def put(self, name: str, tensor: torch.Tensor, stored: str) -> None:
        """A plain tensor for parameter ``name``: packed in ``wanted(name)``, else cast to ``dtype``."""
        shape = self.expected_shape(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"moe_compile.load: {self.source}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                             f"model's config asks for {shape}")
        fmt = self.wanted(name)
        if fmt is not None and fmt != "none":
            from moe_compile import quant

            w = tensor.detach().float()
            qw = quant.pack(fmt, w if w.dim() == 3 else w[None], _group(fmt, w.shape[-1]))
            self._set(name, packed_parameter(qw, self.dtype, linear=w.dim() == 2), stored)
        else:
            self._set(name, tensor.detach().to(self.dtype).clone(), stored)

    def put_packed(self, name: str, qw, stored: str, sqnr_db: float | None = None) -> None:
        """A QuantWeight (canonical, [E, N, K] or [1, N, K]) for parameter ``name``."""
        shape = self.expected_shape(name)
        linear = len(shape) == 2
        if tuple(qw.shape) != ((1, *shape) if linear else shape):
            raise ValueError(f"moe_compile.load: {self.source}: tensor {name!r} holds {list(qw.shape)}, the model's "
                             f"config asks for {list(shape)}")
        if role(self.model, name) == "other":  # an embedding table: its rows (F.embedding reads rows)
            param = PackedWeight.of(qw, self.dtype, linear=linear)
        else:
            param = packed_parameter(qw, self.dtype, linear)
        self._set(name, param, stored, sqnr_db)

    def _set(self, name: str, value: torch.Tensor, stored: str, sqnr_db: float | None = None) -> None:
        module_name, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        setattr(module, leaf, torch.nn.Parameter(value, requires_grad=False))
        self.rows[name] = LoadedTensor(name, stored, _kept(value), _nbytes(value), sqnr_db)

    def finish(self) -> torch.nn.Module:
        """The filled model: tied weights tied, the buffers its modules compute made (rotary
        frequencies), every parameter checked to be loaded."""
        model = self.model
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"moe_compile.load: {self.source} has no tensor for {len(missing)} of the model's "
                             f"parameters, e.g. {missing[:4]}: the file does not match {type(model).__name__}")
        for module in model.modules():
            buffers = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
            for n in buffers:
                setattr(module, n, torch.empty_like(getattr(module, n), device="cpu"))
            if buffers:
                model._init_weights(module)  # transformers' own init recomputes computed buffers (rotary)
        left = [n for n, b in model.named_buffers() if b.is_meta]
        if left:
            raise ValueError(f"moe_compile.load: buffers {left[:4]} could not be made off the meta device")
        model.moe_compile_load = LoadReport(self.source, tuple(self.rows.values()))
        return model


def _group(fmt: str, K: int) -> int | None:
    """The group a loaded weight is packed with: 32 for the group-wise integer formats (q4_0's
    block, what the decode kernels' rows16 loops take), else the format's own default."""
    return 32 if fmt in ("w4-int", "w8-int", "a8w4-int") and K % 32 == 0 else None


def cat_rows(gate, up):
    """FC1 [E, 2F, K]: the gate rows, then the up rows (one QuantWeight of two of one format)."""
    from moe_compile import quant

    if (gate.fmt, gate.group, gate.shape) != (up.fmt, up.group, up.shape):
        raise ValueError(f"moe_compile.load: {gate.fmt} gate and {up.fmt} up experts differ in format or shape")
    E, F, K = gate.shape
    return quant.QuantWeight(gate.fmt, torch.cat([gate.data, up.data], dim=1), torch.cat([gate.scale, up.scale], dim=1),
                             gate.group, (E, 2 * F, K))

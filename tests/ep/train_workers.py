"""What each rank runs in the kept-rows backward tests (importable by spawned processes).

A compiled training step of an all-to-all EP block (``zoo_ep.AllToAllEPMoE``): Dynamo's graph,
rewritten by the backend's pass, then AOTAutograd (``aot_eager``: the joint graph traced,
functionalized and partitioned, as under Inductor, without Inductor's compile time), against
``kernels/reference.py`` on every rank's tokens (``zoo_ep.GlobalReference``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

H = 64  # zoo_ep's default hidden size
ROUTES = {"uniform": None, "rank0": "rank0", "rank1_empty": "rank1_empty"}


def _bias(kind, world: int, E: int):
    """A router bias that sends every token to rank 0's experts, or none to rank 1's."""
    if kind is None:
        return None
    local = E // world
    if kind == "rank0":
        return [100.0 if e < local else 0.0 for e in range(E)]
    return [-100.0 if local <= e < 2 * local else 0.0 for e in range(E)]


def _tokens(r: int, T: int, dtype):
    gen = torch.Generator().manual_seed(100 + r)
    x = torch.randn(1, T, H, generator=gen)
    return x.to(dtype), torch.randn(1, T, H, generator=gen).to(dtype)  # x, cotangent


def _backend(reports: list):
    """backend="moe"'s rewrite, then AOTAutograd (aot_eager)."""
    from torch._dynamo import lookup_backend

    from moe_compile.compiler import rewrite_graph
    from moe_compile.config import MoEConfig

    def backend(gm, example_inputs):
        reports.append(rewrite_graph(gm, example_inputs, MoEConfig()))
        reports.append([str(n.target) for n in gm.graph.nodes if "moe_compile" in str(n.target)])
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _reference(rank: int, world: int, Ts, top_k: int, bias, dtype):
    """y and the gradients of sum_r <ref(x_r), cot_r> on the global model: this rank's x and its
    local experts' w1 / w3 / w2 slices (every rank's tokens reach them); the router's from this
    rank's tokens only (each rank trains its own copy of the router)."""
    from moe_compile.models import zoo_ep

    E = 8
    el = E // world
    out = {}
    ref = zoo_ep.GlobalReference(top_k=top_k, route_bias=bias).to(dtype)
    for t in (ref.w1, ref.w3, ref.w2):
        t.requires_grad_()
    for r in range(world):
        x, cot = _tokens(r, Ts[r], dtype)
        x.requires_grad_(r == rank)
        y = ref(x)
        (y.float() * cot.float()).sum().backward()
        if r == rank:
            out["y"], out["x"] = y.detach(), x.grad
    sl = slice(rank * el, (rank + 1) * el)
    out.update({"w1": ref.w1.grad[sl], "w3": ref.w3.grad[sl], "w2": ref.w2.grad[sl]})
    own = zoo_ep.GlobalReference(top_k=top_k, route_bias=bias).to(dtype)
    x, cot = _tokens(rank, Ts[rank], dtype)
    (own(x).float() * cot.float()).sum().backward()
    out["gate.weight"] = own.gate.weight.grad
    return out


def compiled_training(rank: int, world: int, cases: list) -> dict:
    """Per (name, Ts, route, dtype): the errors of y and of every gradient against the reference,
    the row width of each backward dispatch, and the EP ops the rewritten graph calls."""
    from moe_compile.models import zoo_ep
    from moe_compile.api import capture_flags
    from tests.ep.a2a_workers import _DispatchBytes, rel

    out = {}
    for name, Ts, route, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        torch._dynamo.reset()
        bias = _bias(ROUTES[route], world, 8)
        model = zoo_ep.AllToAllEPMoE(top_k=2, route_bias=bias).to(dtype)
        want = _reference(rank, world, Ts, 2, bias, dtype)
        x, cot = _tokens(rank, Ts[rank], dtype)
        x.requires_grad_()
        reports = []
        with capture_flags():
            y = torch.compile(model, backend=_backend(reports), fullgraph=False)(x)
        with _DispatchBytes() as sent:
            (y.float() * cot.float()).sum().backward()
        params = dict(model.named_parameters())
        errs = {"y": rel(y, want["y"]), "x": rel(x.grad, want["x"])}
        errs.update({k: rel(params[k].grad, want[k]) for k in ("w1", "w3", "w2", "gate.weight")})
        out[name] = {"errs": errs, "bwd_dispatch_row_bytes": sent.rows, "H": H, "itemsize": x.element_size(),
                     "ops": reports[1] if len(reports) > 1 else [],
                     "rewritten": len(reports[0].rewritten) if reports else 0}
    dist.barrier()
    return out


def kept_checks(rank: int, world: int, scenarios: list, transports, chunks: int, cases: list) -> dict:
    """The default tests' work in one spawn (starting ranks costs seconds on 2 cores): the op on
    each transport (``a2a_workers.transports_scenarios``) and the compiled training step."""
    from tests.ep.a2a_workers import transports_scenarios

    return {"op": transports_scenarios(rank, world, scenarios, transports, chunks),
            "compiled": compiled_training(rank, world, cases)}

"""What each rank runs in the gathered-dispatch / ETP tests (importable by spawned processes).

A case builds one zoo_ep block on this rank, runs it eagerly, compiles it with backend="moe"
(inner compiler "eager": the rewrite is what is tested) and returns the report and the errors.
Ranks are laid out as Megatron lays out its tp_ep group: expert-TP ranks adjacent,
rank = ep_rank * tp + tp_rank; the ETP group of a rank holds one EP rank's experts, its EP group
one F-shard index.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

H = 64  # zoo_ep's default hidden size


def groups(rank: int, world: int, tp: int):
    """(ep_group, etp_group) of this rank; every rank creates every group, in one order."""
    ep = world // tp
    etp = [dist.new_group([e * tp + t for t in range(tp)]) for e in range(ep)]
    eps = [dist.new_group([e * tp + t for e in range(ep)]) for t in range(tp)]
    return eps[rank % tp], etp[rank // tp]


def build(rank: int, world: int, case: dict):
    """(model, the seed of this rank's tokens) for one case."""
    from moe_compile.models import zoo_ep

    kwargs = dict(case.get("kwargs", {}))
    kind, tp = case["kind"], case.get("tp", 1)
    if kind == "all_gather":  # tokens sharded over the whole group: each rank its own
        return zoo_ep.AllGatherEPMoE(tp=tp, **kwargs), rank
    if kind == "all_gather_two_layers":  # two blocks in one graph: the second gathers the first's output
        layers = [zoo_ep.AllGatherEPMoE(tp=tp, seed=s, **kwargs) for s in (0, 5)]
        return torch.nn.Sequential(*layers), rank
    if kind == "etp_all_reduce":  # tokens replicated over the ETP group (the whole world here)
        return zoo_ep.ETPMoE(**kwargs), 0
    if kind == "ep_etp_all_to_all":  # tokens replicated over each ETP group, dispatched over EP
        ep_group, etp_group = groups(rank, world, tp)
        replicated = kwargs.get("etp_tokens", "replicated") == "replicated"
        return zoo_ep.AllToAllEPMoE(group=ep_group, etp_group=etp_group, **kwargs), rank // tp if replicated else rank
    raise ValueError(kind)


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from moe_compile.models import zoo_ep
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports
    from tests.conftest import rel_err

    out = []
    for case in cases:
        torch._dynamo.reset()
        model, seed = build(rank, world, case)
        dtype = getattr(torch, case.get("dtype", "float32"))
        model = model.to(dtype)
        x = torch.randn(1, case.get("tokens", 6), H, generator=torch.Generator().manual_seed(100 + seed))
        top_k = case.get("kwargs", {}).get("top_k", 2)
        with torch.no_grad():
            ref = zoo_ep.GlobalReference(top_k=top_k)(x)
            x = x.to(dtype)
            want = model(x)
            if case["kind"] == "all_gather_two_layers":
                ref = zoo_ep.GlobalReference(top_k=top_k, seed=5)(ref)
            compiled = torch.compile(model, backend="moe", options={"inner": case.get("inner", "eager")})
            with capture_flags(), collecting_reports() as report:
                got = compiled(x)
            again = compiled(x)  # a second call runs the compiled graph alone
        out.append({
            "name": case["name"], "err": rel_err(got, want), "err_again": rel_err(again, want),
            "eager_vs_global": rel_err(want, ref),
            "rewritten": [(r.family, r.world_size, r.local_experts, r.ep_style, r.ffn) for r in report.rewritten],
            "skipped": [s.reason for s in report.skipped], "text": str(report),
            "notes": [n.text for n in report.notes],
        })
    return out


def grads(rank: int, world: int, case: dict) -> dict:
    """A training step: forward and backward (input and every weight gradient) against eager."""
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports
    from tests.conftest import rel_err

    torch._dynamo.reset()
    model, seed = build(rank, world, case)
    twin, _ = build(rank, world, case)  # the same weights: every block is built from one seed
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(1, case.get("tokens", 6), H, generator=gen)
    cot = torch.randn(x.shape, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = twin(xa)
    (want * cot).sum().backward()
    with capture_flags(), collecting_reports() as report:
        got = torch.compile(model, backend="moe", options={"inner": "eager"})(xb)
    (got * cot).sum().backward()
    errs = {"y": rel_err(got.detach(), want.detach()), "x": rel_err(xb.grad, xa.grad)}
    eager_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        q = eager_params[name]
        if q.grad is not None or p.grad is not None:
            errs[name] = rel_err(p.grad, q.grad) if p.grad is not None and q.grad is not None else float("inf")
    return {"errs": errs, "rewritten": [(r.family, r.ep_style) for r in report.rewritten],
            "skipped": [s.reason for s in report.skipped], "text": str(report)}


def simulated_vs_real(rank: int, world: int) -> dict:
    """The lockstep simulation's all_gather / reduce_scatter against gloo's on one graph."""
    import torch.distributed._functional_collectives as funcol

    from moe_compile.passes.expert_parallel import simulate

    def block(x, w):  # x [T, H] -> [T, H]: gather, a row-wise op, reduce-scatter
        x_all = funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # [R*T, H]
        return funcol.reduce_scatter_tensor(torch.tanh(x_all @ w), "sum", 0, dist.group.WORLD)

    gm = torch.fx.experimental.proxy_tensor.make_fx(block)(torch.zeros(3, 4), torch.zeros(4, 4))
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(99))
    real = block(xs[rank], w)
    sims = simulate(gm, [[x, w] for x in xs])
    return {"err": (sims[rank] - real).abs().max().item(), "shape": list(sims[rank].shape)}


def refused(rank: int, world: int) -> dict:
    """Gathered blocks the matcher must leave alone, each with its reason: experts that gate with
    tanh (no FFN hypothesis fits), weights from a gathered softmax taken before the top-k."""
    from moe_compile.models import zoo_ep
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports
    from tests.conftest import rel_err

    class TanhExperts(zoo_ep.AllGatherEPMoE):
        def _expert(self, e, rows):
            mlp = self.experts[e]
            return mlp.down_proj(torch.tanh(mlp.gate_proj(rows)) * mlp.up_proj(rows))

    class ScoresGathered(zoo_ep.AllGatherEPMoE):
        """Weights read from the router's whole softmax [N, E], gathered before its top-k."""

        def forward(self, hidden_states):
            x = hidden_states.view(-1, hidden_states.shape[-1])
            scores = torch.softmax(x @ self.gate.weight.t(), dim=-1)  # [T, E]
            ids = torch.topk(scores, self.top_k, dim=-1)[1]
            x_all, ids_all, scores_all = self._gather(x), self._gather(ids), self._gather(scores)
            y = torch.zeros_like(x_all)
            for e in range(self.local):
                rows, _ = torch.where(ids_all == self.start + e)
                y = y.index_add(0, rows, self._expert(e, x_all[rows]) * scores_all[rows, self.start + e, None])
            return self._reduce_scatter(y).view(hidden_states.shape)

    out = {}
    for name, model in (("tanh", TanhExperts()), ("dense_probs_only", ScoresGathered())):
        torch._dynamo.reset()
        x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            want = model(x)
            with capture_flags(), collecting_reports() as report:
                got = torch.compile(model, backend="moe", options={"inner": "eager"})(x)
        out[name] = {"rewritten": len(report.rewritten), "reasons": [s.reason for s in report.skipped],
                     "err": rel_err(got, want)}
    return out


def reduced_single_device(rank: int, world: int) -> dict:
    """A gpt-fast-style MoE (weights gathered per token, family C) whose output an all_reduce
    sums: left to its own family, rewritten there, the all_reduce kept."""
    import torch.distributed._functional_collectives as funcol

    from moe_compile.models import zoo
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports
    from tests.conftest import rel_err

    class Reduced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(rank)
            self.moe = zoo.GatheredMoE(H, 48, 8, 2)

        def forward(self, x):
            return funcol.all_reduce(self.moe(x), "sum", dist.group.WORLD)

    torch._dynamo.reset()
    model = Reduced()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x)
        with capture_flags(), collecting_reports() as report:
            got = torch.compile(model, backend="moe", options={"inner": "eager"})(x)
    return {"err": rel_err(got, want), "rewritten": [r.family for r in report.rewritten], "text": str(report)}


def world2(rank: int, world: int, cases: list[dict], grad_cases: list[dict]) -> dict:
    """Everything the world-2 tests check, in one spawn (spawning costs seconds on 2 cores)."""
    return {"cases": run_cases(rank, world, cases), "grads": [grads(rank, world, c) for c in grad_cases],
            "refused": refused(rank, world), "simulated": simulated_vs_real(rank, world),
            "single_device": reduced_single_device(rank, world)}


def world4(rank: int, world: int, cases: list[dict], grad_cases: list[dict]) -> dict:
    return {"cases": run_cases(rank, world, cases), "grads": [grads(rank, world, c) for c in grad_cases]}

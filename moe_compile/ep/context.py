"""Per-group state of the expert-parallel op: group, rank, store, config check, heaps, deadlines.

Everything that must agree across ranks is checked once per distinct configuration, through the
process group's store (not a collective, so a missing rank turns into a ``TimeoutError`` naming
it instead of a hang): E, K, H, dtypes, local experts, FFN attributes, transport, bounds.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_CONTEXTS: dict[str, "EPContext"] = {}


class EPConfigError(RuntimeError):
    """Ranks called the expert-parallel op with different configurations."""


def resolve_group(group_name: str):
    if not dist.is_initialized():
        raise RuntimeError("fused_moe_ep: torch.distributed is not initialised (init_process_group first)")
    return c10d._resolve_process_group(group_name)


@dataclasses.dataclass
class EPContext:
    group: object
    group_name: str
    rank: int
    world: int
    store: object
    configs: dict = dataclasses.field(default_factory=dict)  # config tuple -> check index
    heaps: dict = dataclasses.field(default_factory=dict)  # key -> heap (transport state)
    calls: int = 0  # forward/backward exchanges on this group by this process
    checks: int = 0  # configuration checks done (one per distinct configuration)
    # "forward" / "backward" -> (bytes of one dispatched row with its fp32 gate, rows sent to the
    # peers, pieces per block) of the last symm / collectives exchange: what tests and bench_ep.py read
    sent: dict = dataclasses.field(default_factory=dict)

    def key(self, *parts) -> str:
        return "moec_ep/" + "/".join(str(p) for p in parts)

    def wait_keys(self, keys_by_rank: dict, timeout_s: float, what: str) -> None:
        """Wait until every rank's key exists; else TimeoutError naming the ranks that never came."""
        deadline = time.monotonic() + timeout_s
        pending = dict(keys_by_rank)
        delay = 1e-4
        while pending:
            pending = {r: k for r, k in pending.items() if not self.store.check([k])}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fused_moe_ep: rank(s) {sorted(pending)} of group {self.group_name!r} did not arrive "
                    f"within timeout_s={timeout_s:g}s ({what}; this is rank {self.rank})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def check_config(self, config: tuple, timeout_s: float) -> None:
        """First call with this configuration: every rank publishes it and compares (E/K/H/...)."""
        if config in self.configs:
            return
        n = self.checks  # counted on every rank alike, failed checks included
        self.checks += 1
        self.store.set(self.key("cfg", self.group_name, n, self.rank), repr(config))
        keys = {r: self.key("cfg", self.group_name, n, r) for r in range(self.world)}
        self.wait_keys(keys, timeout_s, "configuration check")
        seen = {r: self.store.get(k).decode() for r, k in keys.items()}
        mine = repr(config)
        bad = {r: v for r, v in seen.items() if v != mine}
        if bad:
            names = _CONFIG_FIELDS
            diffs = []
            for r, v in sorted(bad.items()):
                theirs = eval(v, {"torch": torch})  # noqa: S307 — our own repr of ints/strs/dtypes
                diffs.append(
                    f"rank {r}: " + ", ".join(
                        f"{f}={b!r} (rank {self.rank} has {a!r})"
                        for f, a, b in zip(names, config, theirs) if a != b
                    )
                )
            raise EPConfigError(
                "fused_moe_ep: ranks disagree on the MoE configuration — " + "; ".join(diffs)
            )
        self.configs[config] = n


_CONFIG_FIELDS = (
    "num_experts", "top_k", "hidden", "x_dtype", "local_experts", "weight_dtype", "ffn",
    "gate_up", "transposed", "activation", "limit", "alpha", "weight_on", "transport", "max_tokens", "chunks",
)


def config_tuple(x, topk_ids, w, attrs, num_experts, transport, max_tokens, chunks) -> tuple:
    return (
        int(num_experts), int(topk_ids.shape[1]), int(x.shape[1]), str(x.dtype), int(w.num_experts),
        str(w.fc2_of(0).dtype), int(w.ffn()), attrs.gate_up, bool(attrs.transposed), attrs.activation,
        float(attrs.limit), float(attrs.alpha), attrs.weight_on, transport, int(max_tokens), int(chunks),
    )


def get_context(group_name: str) -> EPContext:
    ctx = _CONTEXTS.get(group_name)
    if ctx is None:
        group = resolve_group(group_name)
        store = c10d._get_process_group_store(group)
        ctx = EPContext(group, group_name, dist.get_rank(group), dist.get_world_size(group), store)
        _CONTEXTS[group_name] = ctx
    return ctx


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)

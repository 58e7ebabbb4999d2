"""Shared helpers for the CPU benchmarks: timing, threads, measured roofs, table/JSON writers.

Every figure a benchmark reports is measured in the same process, side by side (docs/architecture.md#measuring):
median of repeated runs after warm-up, with the min..max spread.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch


def setup_threads(n: int = 2) -> int:
    """Pin torch's intra-op pool (the benchmark machine has 2 cores)."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


@dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    samples: list[float] = field(default_factory=list)

    @property
    def spread(self) -> str:
        return f"{self.min_s * 1e3:.2f}..{self.max_s * 1e3:.2f}"

    def to_dict(self) -> dict:
        return asdict(self)


def time_fn(fn, *, warmup: int = 2, repeats: int = 7, min_time_s: float = 0.0) -> Timing:
    """Median (and min/max) wall time of ``fn()`` after ``warmup`` untimed calls.

    ``min_time_s``: keep repeating (beyond ``repeats``) until this much time was measured, so
    microsecond-scale calls get enough samples.
    """
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        total = 0.0
        while len(samples) < repeats or (total < min_time_s and len(samples) < 200):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            samples.append(dt)
            total += dt
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples), samples)


def time_interleaved(fns: dict, *, warmup: int = 2, repeats: int = 7, min_time_s: float = 0.0,
                     before=None) -> dict:
    """Like ``time_fn`` for several variants, timed round-robin (one call of each per round, the
    starting variant rotating), so slow drifts and other load on the machine hit every variant alike.
    ``before()``, when given, runs untimed before every timed call (``cache_flush``).
    """
    names = list(fns)
    samples: dict = {k: [] for k in names}
    with torch.no_grad():
        for k in names:
            for _ in range(warmup):
                fns[k]()
        r = 0
        while r < repeats or (min(sum(v) for v in samples.values()) < min_time_s and r < 200):
            for i in range(len(names)):
                k = names[(r + i) % len(names)]
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fns[k]()
                samples[k].append(time.perf_counter() - t0)
            r += 1
    return {k: Timing(statistics.median(v), min(v), max(v), len(v), v) for k, v in samples.items()}


def cache_flush(mib: int = 64):
    """``fn()`` reading ``mib`` MiB of unrelated memory (``torch.sum``): run before each timed call
    of a memory-bound cell, every variant then starts with the caches holding none of the weights,
    as a layer's decode step does in a model whose weights exceed the cache.  Without it a variant
    gains from the one timed before it: right after moe had streamed 120 MiB of touched experts, a
    sum over the same weights read them at 44 GB/s against ~30 GB/s from memory (the last-read part
    still in the 32 MiB L3)."""
    buf = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    return lambda: buf.sum()


def load_average() -> str:
    """The 1/5/15-minute load average (other processes on the cores distort every timing)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def read_bandwidth(mib: int = 512, repeats: int = 7) -> tuple[float, Timing]:
    """Measured read bandwidth in bytes/s: ``torch.sum`` over a ``mib`` MiB fp32 tensor (median)."""
    n = mib * 1024 * 1024 // 4
    buf = torch.ones(n, dtype=torch.float32)
    t = time_fn(lambda: buf.sum(), warmup=2, repeats=repeats)
    buf = None  # free it (not del: the timed lambda names it)
    return n * 4 / t.median_s, t


def dense_gemm(m: int, k: int, n: int):
    """``fn()`` running one dense fp32 ``torch.mm`` [m, k] x [k, n] (2*m*k*n FLOPs): the roof a
    benchmark times round-robin with its variants (``time_interleaved``), so the VM's drifts hit
    the roof and the variants alike.

    For an MoE whose expert GEMMs do 2*T*K*3*H*F FLOPs (SwiGLU: gate+up [H->2F], down [F->H]),
    the equal-FLOP dense shape is m=T*K, k=H, n=3F.
    """
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    out = torch.empty(m, n)
    return lambda: torch.mm(a, b, out=out)


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (both cast to fp32)."""
    y, ref = y.float(), ref.float()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def machine_info() -> dict:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        model = ""
    return {
        "cpu": model or platform.processor(),
        "cores_visible": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "avx2": " avx2" in flags,
        "avx512f": " avx512f" in flags,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str | None, stem: str, markdown: str, data: dict) -> None:
    """Write ``{stem}.md`` and ``{stem}.json`` into ``out_dir`` (if given)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)

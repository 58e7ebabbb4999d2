"""Shared helpers for the CPU benchmarks: timing, threads, measured roofs, table/JSON writers.

Every figure a benchmark reports is measured in the same process, side by side (docs/architecture.md#measuring):
median of repeated runs after warm-up, with the min..max spread.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import random
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


def time_shuffled(fns: dict, rounds: int, *, before=None, warmup: int = 3) -> dict:
    """Seconds per call of each variant, one call of each per round in an order shuffled every
    round (seeded), so no variant always follows the same one (a call right after a large read
    runs slower); ``before()`` runs before each call (e.g. a cache flush), outside the timing."""
    names, samples, rng = list(fns), {k: [] for k in fns}, random.Random(0)
    with torch.no_grad():
        for k in names:
            for _ in range(warmup):
                fns[k]()
        for _ in range(rounds):
            rng.shuffle(names)
            for k in names:
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fns[k]()
                samples[k].append(time.perf_counter() - t0)
    return samples


def best_read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of the fastest of ``repeats`` ``torch.sum`` reads over ``mib`` MiB (whole-model and
    dense-layer roofs: 1 GiB, beyond any last-level cache of these machines)."""
    _, t = read_bandwidth(mib, repeats)
    return mib * 1024 * 1024 / t.min_s


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache sysfs reports for cpu0 (the last level), or None where it says nothing."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        unit = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * unit)
    return max(sizes) if sizes else None


def flush_mib() -> int:
    """MiB to read between timed calls so that they start with none of their weights in any cache:
    twice the last-level cache, at least 64 (a 2-core Xeon VM reports 300 MiB of L3: after a 64 MiB
    read a 7 MiB buffer still read at 42 GB/s, from L3; after 256 MiB or more at 19-21 GB/s), at
    most 1024."""
    llc = last_level_cache_bytes()
    return 64 if llc is None else min(1024, max(64, 2 * llc // (1024 * 1024)))


def cache_flush(mib: int | None = None):
    """``fn()`` reading ``mib`` MiB (default ``flush_mib()``: twice the last-level cache, at least
    64) of unrelated memory (``torch.sum``): run before each timed call
    of a memory-bound cell, every variant then starts with the caches holding none of the weights,
    as a layer's decode step does in a model whose weights exceed the cache.  Without it a variant
    gains from the one timed before it: right after moe had streamed 120 MiB of touched experts, a
    sum over the same weights read them at 44 GB/s against ~30 GB/s from memory (the last-read part
    still in the 32 MiB L3)."""
    buf = torch.ones((mib or flush_mib()) * 1024 * 1024 // 4, dtype=torch.float32)
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


def machine_line(m: dict) -> str:
    """The machine of a ``machine_info()`` dict in one phrase, for a table's heading."""
    return (f"{m['torch_threads']} threads, {m['cpu']} (AVX2={m['avx2']}, AVX-512={m['avx512f']}), torch {m['torch']}, "
            f"{m['date']}")


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo (what lscpu reads), {} where there is none."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def machine_kind(gpu: bool = False) -> str:
    """The machine a result is measured on, as ``results/<bench>/<kind>-<date>.*`` names it.

    ``gpu``: the CUDA device's model (``h200``, ``h100``). Otherwise the CPU's, from its vendor, cpuid
    family / model and flags: ``epyc-zen3-avx2`` (no AVX-512), ``epyc-zen4``, ``epyc-zen5``,
    ``xeon-amx`` (AMX tiles), ``xeon-avx512``, ``xeon-avx2``; another CPU is named by its architecture.
    """
    if gpu:
        name = torch.cuda.get_device_name(0).split()
        return (name[1] if name[0] == "NVIDIA" and len(name) > 1 else name[0]).lower()
    cpu = _cpuinfo()
    flags, model_name = cpu.get("flags", "").split(), cpu.get("model name", "").lower()
    isa = "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else ""
    if cpu.get("vendor_id") == "AuthenticAMD":
        family = int(cpu.get("cpu family", "0"))
        zen = {23: "zen2", 25: "zen4" if "avx512f" in flags else "zen3", 26: "zen5"}.get(family, f"family{family}")
        line = "epyc" if "epyc" in model_name else "ryzen" if "ryzen" in model_name else "amd"
        return f"{line}-{zen}" + ("" if "avx512f" in flags else f"-{isa}" if isa else "")
    if cpu.get("vendor_id") == "GenuineIntel":
        return ("xeon" if "xeon" in model_name else "intel") + (f"-{isa}" if isa else "")
    return platform.machine() or "cpu"


def result_stem(bench: str, tag: str | None = None, gpu: bool = False) -> str:
    """The default ``--out`` of a benchmark: ``benchmarks/results/<bench>/<machine kind>-<date>[-<tag>]``.

    A run under the AVX2 switch (``MOE_COMPILE_FUSED_ISA=avx2`` on a CPU with AVX-512) gets the tag
    ``avx2-switch`` too: the same machine, running the AVX2 kernels.
    """
    tags = [tag] if tag else []
    avx2_switch = os.environ.get("MOE_COMPILE_FUSED_ISA", "").lower() == "avx2"
    if not gpu and avx2_switch and "avx512f" in _cpuinfo().get("flags", "").split():
        tags.append("avx2-switch")
    name = "-".join([machine_kind(gpu), time.strftime("%Y-%m-%d"), *tags])
    return os.path.join(RESULTS, bench, name)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines) + "\n"


def output_path(out: str, stem: str, ext: str) -> str:
    """Where a script writes its ``ext`` file for ``--out out``: ``out/{stem}{ext}`` when ``out`` is an
    existing directory, else ``out{ext}`` (``out`` a path prefix, such as ``result_stem``'s), its
    folder made."""
    if os.path.isdir(out):
        return os.path.join(out, stem + ext)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return out + ext


def write_outputs(out: str | None, stem: str, markdown: str, data: dict) -> None:
    """Write the table (``.md``), every raw sample (``.json``) and, with matplotlib, the plot (``.png``)
    at ``output_path(out, stem, ...)``; nothing when ``out`` is empty."""
    if not out:
        return
    with open(output_path(out, stem, ".md"), "w") as f:
        f.write(markdown)
    with open(output_path(out, stem, ".json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    try:  # the table and JSON are the record; a plot that cannot be drawn never loses them
        plot_results(json.loads(json.dumps(data, default=str)), output_path(out, stem, ".png"), stem)
    except Exception as err:  # noqa: BLE001
        print(f"# no plot for {stem}: {type(err).__name__}: {err}")


# ----------------------------------------------------------------------------- plots
#
# One picture per results file: moe against its peers and the roof, per shape, across T (or across
# ranks for expert parallel, or as bars where a benchmark has no T axis).  The panels are read from
# the JSON every script already writes, so old results can be plotted too:
#     python benchmarks/harness.py plot benchmarks/results/cpu_moe/epyc-zen4-2026-11-30.json


@dataclass(frozen=True)
class Panel:
    """One subplot: series name -> [(x, median, low, high)] in ``unit``; ``roof`` names the bound."""

    title: str
    x_label: str
    unit: str
    series: dict
    roof: str | None = "roof"
    bars: bool = False


def _spread(t: dict, scale: float) -> tuple[float, float, float]:
    """(median, low, high) of a timing dict: ``median_s/min_s/max_s`` or GPU ``ms/p20/p80``."""
    if "median_s" in t:
        return t["median_s"] * scale, t.get("min_s", t["median_s"]) * scale, t.get("max_s", t["median_s"]) * scale
    return t["ms"] * scale / 1e3, t.get("p20", t["ms"]) * scale / 1e3, t.get("p80", t["ms"]) * scale / 1e3


def _dims(row: dict) -> str:
    return f"H={row['H']} F={row['F']} E={row['E']} K={row['K']}"


def _cpu_moe_panels(data: dict) -> list[Panel]:
    panels: dict[str, dict] = {}
    for row in data["results"]:
        series = panels.setdefault(f"{row.get('shape', '')} ({_dims(row)})", {})
        for name, timing in row["times"].items():
            series.setdefault(name, []).append((row["T"], *_spread(timing, 1e3)))
        roof = row.get("roof") or {}
        if "timing" in roof or "time_s" in roof:
            t = roof.get("timing") or {"median_s": roof["time_s"]}
            series.setdefault("roof", []).append((row["T"], *_spread(t, 1e3)))
    return [Panel(title, "tokens T", "ms per call", series) for title, series in panels.items()]


def _rows_panels(data: dict) -> list[Panel]:
    """cpu_train (one row per variant and T) and gpu_moe (one row per shape, variants inside)."""
    panels: dict[str, dict] = {}
    for row in data["rows"]:
        series = panels.setdefault(_dims(row), {})
        if "results" in row:
            variants = row["results"]
        elif isinstance(row.get("ms"), dict):  # cpu_llamacpp: {variant: median ms} (+ its roof)
            variants = {name: {"ms": ms} for name, ms in {**row["ms"], "roof": row.get("roof_ms")}.items()
                        if isinstance(ms, (int, float))}
        else:
            variants = {row["variant"]: row}
        for name, timing in variants.items():
            series.setdefault(name, []).append((row["T"], *_spread(timing, 1e3)))
    return [Panel(title, "tokens T", "ms per call", series) for title, series in panels.items()]


def _compile_time_panels(data: dict) -> list[Panel]:
    s = data["summary"]
    first = {name: [(name, v["first_call_median_s"], v["first_call_min_s"], v["first_call_max_s"])]
             for name, v in s.items()}
    steady = {name: [(name, *(v["steady_call_median_s"] * 1e3,) * 3)] for name, v in s.items()}
    steady["eager"] = [("eager", *(next(iter(s.values()))["eager_call_median_s"] * 1e3,) * 3)]
    return [Panel("first call (compile + run)", "", "s", first, None, True),
            Panel("steady call", "", "ms", steady, None, True)]


def _train_gemms_panels(data: dict) -> list[Panel]:
    series = {name: [(name, *_spread(p["timing"], 1e3))] for name, p in data["passes"].items()}
    shape = data.get("shape", {})
    dims = " ".join(f"{k}={v}" for k, v in shape.items()) if isinstance(shape, dict) else str(shape)
    return [Panel(f"expert GEMMs of one training step ({dims})", "", "ms", series, "roof", True)]


def _ep_panels(data: dict) -> list[Panel]:
    panels: dict[str, dict] = {}
    for world, shapes in data["results"].items():
        for shape, variants in shapes.items():
            series = panels.setdefault(shape, {})
            for name, seconds in variants.items():
                # Times only (not row counts), and not each chunking of the sweep: their table has those.
                if isinstance(seconds, (int, float)) and not re.search(r"^comm_|^recv_|_c\d+$", name):
                    series.setdefault(name, []).append((int(world), seconds * 1e3, seconds * 1e3, seconds * 1e3))
    return [Panel(f"{shape}, T={data.get('config', {}).get('tokens', '?')} per rank", "ranks", "ms per call",
                  series, "compute") for shape, series in panels.items()]


def result_panels(data: dict) -> list[Panel]:
    """The panels of a results JSON, by the shape of its data; [] for a schema not known here."""
    if isinstance(data.get("results"), list) and data["results"] and "times" in data["results"][0]:
        return _cpu_moe_panels(data)
    if isinstance(data.get("rows"), list) and data["rows"] and "T" in data["rows"][0]:
        return _rows_panels(data)
    if "summary" in data and "moe_over_default" in data:
        return _compile_time_panels(data)
    if "passes" in data and "gemms_ms" in data:
        return _train_gemms_panels(data)
    if isinstance(data.get("results"), dict) and "config" in data:
        return _ep_panels(data)
    return []


def plot_results(data: dict, png_path: str, title: str) -> str | None:
    """Write the plot of ``data`` to ``png_path``; None (and why, on stdout) when there is none."""
    panels = result_panels(data)
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("harness: no plot (pip install matplotlib, or the package's [bench] extra)")
        return None
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.2 * cols, 8.0), 3.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        (_draw_bars if panel.bars else _draw_lines)(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    machine = data.get("machine") or data.get("meta") or {}
    note = ", ".join(str(machine[k]) for k in ("cpu", "date") if isinstance(machine, dict) and machine.get(k))
    fig.suptitle(f"{title}" + (f" — {note}" if note else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


_MOE = dict(color="tab:red", linewidth=2.4, zorder=5)  # this project's op: the one red line
_STYLE = {"moe": _MOE, "triton": _MOE, "fused_symm": _MOE, "roof": dict(color="black", linestyle="--"),
          "compute": dict(color="black", linestyle="--")}
_PEER_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
                "tab:olive", "tab:cyan")


def _draw_lines(ax, panel: Panel) -> None:
    xs = sorted({p[0] for pts in panel.series.values() for p in pts})
    peers = iter(_PEER_COLORS * 2)
    for name, pts in panel.series.items():
        pts = sorted(pts)
        style = _STYLE.get(name) or {"color": next(peers)}
        x = [p[0] for p in pts]
        y = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        label = name + (" (bound)" if name == panel.roof else "")
        ax.errorbar(x, y, yerr=err, marker="o", markersize=4, capsize=2, label=label, **style)
    if len(xs) > 1 and xs[-1] / max(xs[0], 1) >= 8:
        ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_yscale("log")
    ax.set_xlabel(panel.x_label)
    ax.set_ylabel(f"{panel.unit} (lower is better)")
    ax.set_title(panel.title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _draw_bars(ax, panel: Panel) -> None:
    names = list(panel.series)
    values = [panel.series[n][0] for n in names]
    colors = [_STYLE.get(n, {}).get("color", "tab:blue") if n != panel.roof else "grey" for n in names]
    ax.bar(names, [v[1] for v in values], yerr=[[v[1] - v[2] for v in values], [v[3] - v[1] for v in values]],
           color=colors, capsize=3)
    ax.set_ylabel(f"{panel.unit} (lower is better)")
    ax.set_title(panel.title, fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Plot benchmark results JSON files (PNG beside each).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="write FILE.png beside each FILE.json")
    p.add_argument("files", nargs="+", help="results JSON files")
    args = parser.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        stem = os.path.splitext(path)[0]
        written = plot_results(data, stem + ".png", os.path.relpath(stem))
        print(written or f"{path}: no plot for this results format")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tile configs of the fused MoE kernels: small candidate lists per shape class, tuned once per
shape and cached on disk.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Shape classes, by the mean rows per expert  m = T*K / E  (the M of each expert's GEMM):

* decode   (m <= 32):  the GEMMs are weight-bandwidth bound; BLOCK_M = 16 wastes the least
                       padding, a deep BLOCK_K keeps many weight bytes in flight per program.
* prefill  (m > 32):   compute bound; 64/128-row tiles, BLOCK_K = 64, 3-4 pipeline stages.

The candidates are the shapes that vLLM's fused_moe sweeps most often pick on sm90 (H100/H200
bf16 tables for E=8, H=4096, F=14336 and DeepSeek-like E>=64 shapes), trimmed to four per class so
that a new shape tunes in a few seconds (each candidate: 2 kernel compiles + ~20 ms of timing).
FC2 is tuned second (key prefix ``fc2|``) among FC1's pick and two wider / narrower tiles with
the same BLOCK_M (one align serves both GEMMs): its single accumulator affords 128 x 256 tiles,
which the gated FC1 (two accumulators) cannot hold in registers.
Note the gated FC1 keeps two fp32 accumulators and two B tiles per stage, so 128x128x64 with 3
stages is the largest tile that fits sm90's shared memory; nothing here has been swept on this
stack yet (no GPU in the development sandbox) — rerun ``benchmarks/bench_gpu_moe.py`` and
revise these lists with what it finds.

Cache: ``$MOE_COMPILE_CACHE_DIR`` or ``~/.cache/moe_compile/`` / ``triton_autotune.json``, keyed by
device name and capability, Triton version, dtype, E, H, F, K, the layout and T rounded up to a
power of two.  ``MOE_COMPILE_AUTOTUNE=0`` skips timing and takes the first candidate of the class.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading

import torch
import triton


@dataclasses.dataclass(frozen=True)
class TileConfig:
    BLOCK_M: int = 64
    BLOCK_N: int = 64
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def launch_kwargs(self) -> dict:
        return dataclasses.asdict(self)


DECODE_CONFIGS = (
    TileConfig(16, 64, 128, 1, num_warps=4, num_stages=4),
    TileConfig(16, 128, 128, 1, num_warps=4, num_stages=3),
    TileConfig(16, 64, 256, 1, num_warps=4, num_stages=3),
    TileConfig(32, 64, 128, 1, num_warps=4, num_stages=4),
    TileConfig(16, 32, 128, 1, num_warps=2, num_stages=5),  # T=1: more, smaller programs in flight
)
PREFILL_CONFIGS = (
    TileConfig(64, 128, 64, 8, num_warps=4, num_stages=4),
    TileConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
    TileConfig(128, 128, 64, 8, num_warps=8, num_stages=4),  # 192 KB on sm90: deeper pipeline
    TileConfig(128, 64, 64, 8, num_warps=4, num_stages=4),
    TileConfig(64, 256, 64, 8, num_warps=8, num_stages=3),  # shrinks to 2 stages on sm90
)
# FC2 (one accumulator, N = H): candidates besides FC1's own config, with FC1's BLOCK_M.
# 128 x 256 keeps one fp32 accumulator in 128 registers per thread at 8 warps.
FC2_PREFILL_EXTRA = (
    TileConfig(0, 256, 64, 8, num_warps=8, num_stages=3),
    TileConfig(0, 128, 64, 8, num_warps=8, num_stages=4),
)
# Decode FC2: D = F is short and N = H wide; narrower N tiles give more programs per expert.
FC2_DECODE_EXTRA = (
    TileConfig(0, 32, 256, 1, num_warps=4, num_stages=3),
    TileConfig(0, 64, 128, 1, num_warps=4, num_stages=5),
)
# The interpreter runs tiles as numpy arrays: a few mid-sized tiles beat many small ones.
INTERPRETER_CONFIG = TileConfig(16, 32, 32, 4, num_warps=1, num_stages=1)

DECODE_ROWS_PER_EXPERT = 32

_lock = threading.Lock()
_memory: dict[str, TileConfig] = {}
_disk_loaded = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def candidates(num_tokens: int, top_k: int, num_experts: int, dtype=torch.bfloat16, device=None) -> tuple[TileConfig, ...]:
    """The shape class's configs, each shrunk to fit the device's shared memory for this dtype."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    configs = DECODE_CONFIGS if rows_per_expert <= DECODE_ROWS_PER_EXPERT else PREFILL_CONFIGS
    limit = shared_memory_limit(device)
    item = torch.empty((), dtype=dtype).element_size()
    return tuple(dict.fromkeys(fit_shared_memory(cfg, item, limit) for cfg in configs))


def fc2_candidates(fc1: TileConfig, num_tokens: int, top_k: int, num_experts: int, dtype=torch.bfloat16,
                   device=None) -> tuple[TileConfig, ...]:
    """FC2 tiles to try after FC1's pick: FC1's config first, then wider ones with its BLOCK_M."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    extra = FC2_DECODE_EXTRA if rows_per_expert <= DECODE_ROWS_PER_EXPERT else FC2_PREFILL_EXTRA
    limit = shared_memory_limit(device)
    item = torch.empty((), dtype=dtype).element_size()
    out = [fc1]
    for cfg in extra:
        cfg = dataclasses.replace(cfg, BLOCK_M=fc1.BLOCK_M, GROUP_M=fc1.GROUP_M)
        out.append(fit_shared_memory(cfg, item, limit, b_tiles=1))
    return tuple(dict.fromkeys(out))


def shared_memory_limit(device=None) -> int:
    """Usable shared memory per program in bytes (opt-in maximum, less a margin for the epilogue)."""
    if device is None or not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return 227 * 1024 - 8192
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return optin - 8192


def fit_shared_memory(cfg: TileConfig, itemsize: int, limit: int, b_tiles: int = 2) -> TileConfig:
    """Fewer stages, then a shorter BLOCK_K, until the gated FC1's pipeline buffers fit: per stage
    one A tile [BM, BK] and two B tiles [BK, BN] (gate and up; ``b_tiles=1`` for FC2).  fp32 needs
    this on every GPU."""

    def need(c):
        return (c.BLOCK_M * c.BLOCK_K + b_tiles * c.BLOCK_K * c.BLOCK_N) * itemsize * c.num_stages

    while need(cfg) > limit:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.BLOCK_K > 16:
            cfg = dataclasses.replace(cfg, BLOCK_K=cfg.BLOCK_K // 2)
        elif cfg.BLOCK_N > 16:
            cfg = dataclasses.replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
        else:
            break
    return cfg


def cache_path() -> pathlib.Path:
    root = os.environ.get("MOE_COMPILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moe_compile")
    return pathlib.Path(root) / "triton_autotune.json"


def shape_key(x: torch.Tensor, num_experts: int, hidden: int, ffn: int, top_k: int, layout: str) -> str:
    if x.is_cuda:
        major, minor = torch.cuda.get_device_capability(x.device)
        device = f"{torch.cuda.get_device_name(x.device)}|sm{major}{minor}"
    else:
        device = "cpu"
    t_bucket = triton.next_power_of_2(max(x.shape[0], 1))
    dtype = str(x.dtype).removeprefix("torch.")
    return f"{device}|triton{triton.__version__}|{dtype}|E{num_experts}|H{hidden}|F{ffn}|K{top_k}|{layout}|T{t_bucket}"


def _load_disk() -> None:
    global _disk_loaded
    if _disk_loaded:
        return
    _disk_loaded = True
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return
    for key, fields in data.items():
        try:
            _memory.setdefault(key, TileConfig(**fields))
        except TypeError:
            continue  # an entry written by another version of TileConfig


def _save_disk() -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({k: dataclasses.asdict(v) for k, v in sorted(_memory.items())}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home is not an error: the in-memory cache still works


def pick_config(key: str, choices: tuple[TileConfig, ...], run) -> TileConfig:
    """The cached config for ``key``, else the fastest of ``choices`` timed with ``run(config)``."""
    if interpreting():
        return INTERPRETER_CONFIG
    with _lock:
        _load_disk()
        if key in _memory:
            return _memory[key]
    if os.environ.get("MOE_COMPILE_AUTOTUNE", "1") == "0":
        return choices[0]  # untuned: not cached, so a later tuned run is not shadowed
    best = choices[0] if len(choices) == 1 else _time_choices(choices, run)
    with _lock:
        _memory[key] = best
        _save_disk()
    return best


def _time_choices(choices, run) -> TileConfig:
    from triton.testing import do_bench

    timings = {}
    for cfg in choices:
        try:
            timings[cfg] = do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20)
        except Exception:  # noqa: BLE001 - e.g. out of shared memory on a smaller GPU: skip it
            continue
    if not timings:
        return choices[-1]
    return min(timings, key=timings.get)

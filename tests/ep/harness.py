"""Start W gloo ranks on this host (spawned processes, a FileStore) and collect what they return."""

from __future__ import annotations

import os
import queue as queue_mod
import time
import tempfile
import traceback

import torch.multiprocessing as mp


def _entry(rank, world, store_path, fn_path, args, queue):
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        mod_name, fn_name = fn_path.rsplit(".", 1)
        fn = getattr(importlib.import_module(mod_name), fn_name)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 — report everything to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_world(world: int, fn_path: str, *args, timeout: float = 120.0) -> dict:
    """{rank: ("ok", result) | ("error", text)} of ``fn(rank, world, *args)`` on W spawned ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store_path, fn_path, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world and time.monotonic() < deadline:
                try:
                    rank, status, value = queue.get(timeout=0.2)
                    results[rank] = (status, value)
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                    for r in dead:
                        results[r] = ("error", f"rank {r} exited with code {procs[r].exitcode}")
            for r in range(world):
                results.setdefault(r, ("error", f"rank {r} gave no result within {timeout}s"))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return results

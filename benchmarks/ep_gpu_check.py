"""One-GPU check of the EP pieces (world size 1, NCCL): the CUDA symmetric heap and fused_moe_ep.

Run on the GPU machine: ``python benchmarks/ep_gpu_check.py``.  Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    g = dist.group.WORLD
    # 1. the CUDA heap: allocate, address own buffer through the handle, signal + wait, barrier
    try:
        from moe_compile.symm.cuda import CudaSymmHeap

        heap = CudaSymmHeap(g.group_name, 1 << 20, 4, dev)
        t = heap.tensor(0, 256, (8,), torch.float32)
        t.copy_(torch.arange(8.0, device=dev))
        peer_view = heap._handle.get_buffer(0, (8,), torch.float32, 64)
        heap.signal(0, 1)
        heap.wait([1], 1, 5.0, who=lambda s: 0)
        heap.barrier(5.0)
        torch.cuda.synchronize()
        out["heap"] = {"ok": peer_view.tolist() == list(map(float, range(8))), "rank": heap.rank,
                       "world": heap.world}
    except Exception as exc:  # noqa: BLE001
        out["heap"] = f"{type(exc).__name__}: {exc}"
    # 2. fused_moe_ep end to end on CUDA tensors (world 1: every expert is local)
    try:
        from moe_compile.ep.op import call_fused_moe_ep
        from moe_compile.ir import ExpertWeights, FFNAttrs
        from moe_compile.kernels.reference import fused_moe_reference

        T, H, F, E, K = 512, 1024, 512, 64, 8
        x = torch.randn(T, H, device=dev)
        gw, ids = torch.rand(T, E, device=dev).topk(K, dim=1)
        gw = torch.softmax(gw, 1)
        w = ExpertWeights((torch.randn(E, 2 * F, H, device=dev) * H**-0.5,), (),
                          (torch.randn(E, H, F, device=dev) * F**-0.5,))
        want = fused_moe_reference(x, ids, gw, w, FFNAttrs())
        y = call_fused_moe_ep(x, ids, gw, w, FFNAttrs(), g, E, transport="auto")
        torch.cuda.synchronize()
        err = ((y - want).abs().max() / want.abs().max()).item()
        t0 = time.perf_counter()
        for _ in range(10):
            call_fused_moe_ep(x, ids, gw, w, FFNAttrs(), g, E, transport="auto")
        torch.cuda.synchronize()
        out["fused_moe_ep"] = {"rel_err": err, "ms": (time.perf_counter() - t0) * 100}
    except Exception as exc:  # noqa: BLE001
        import traceback

        out["fused_moe_ep"] = f"{type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}"
    out["ep_a2a"] = {path: _check_a2a(dev, g.group_name, path) for path in ("nvshmem", "triton")}
    print(json.dumps(out))
    dist.destroy_process_group()


def _check_a2a(dev, group_name: str, path: str):
    """ep_dispatch / ep_combine / ep_combine_t on CUDA (world 1) against the pure-torch model, and
    the exchange's time at decode (T=8, H=1024, K=8, 64 local experts); path "triton" forces the
    rendezvous + Triton form (MOE_COMPILE_EP_NVSHMEM=0)."""
    os.environ["MOE_COMPILE_EP_NVSHMEM"] = "1" if path == "nvshmem" else "0"
    try:
        import moe_compile.ep.a2a  # noqa: F401
        from moe_compile.ep import a2a_cuda
        from moe_compile.ep.a2a_reference import combine_reference, dispatch_reference

        if path == "nvshmem" and not a2a_cuda._nvshmem_ok("dispatch"):
            return "NVSHMEM not available"
        ops = torch.ops.moe_compile
        ne, H, T, K = 64, 1024, 8, 8
        splits = torch.bincount(torch.randint(0, ne, (T * K,)), minlength=ne)
        x = torch.randn(T * K, H)
        rows = T * K + ne * 16
        ref = dispatch_reference([x], [splits], ne, rows, 16)[0]
        out, oso = ops.ep_dispatch(x.to(dev), splits.to(dev), group_name, rows, 16)
        back, _ = ops.ep_combine(out, oso, group_name, T * K)
        t = ops.ep_combine_t(back, oso, group_name, rows)
        torch.cuda.synchronize()
        ok = (torch.equal(out.cpu(), ref[0]) and torch.equal(oso.cpu(), ref[1])
              and torch.equal(back.cpu(), combine_reference([ref[0]], [ref[1]], ne, T * K)[0][0])
              and torch.equal(t.cpu(), ref[0]))
        xd, sd = x.to(dev), splits.to(dev)
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, oso = ops.ep_dispatch(xd, sd, group_name, rows, 16)
            ops.ep_combine(out, oso, group_name, T * K)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"equal_to_model": ok, "dispatch_combine_ms_median": sorted(times)[len(times) // 2]}
    except Exception as exc:  # noqa: BLE001
        import traceback

        return f"{type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}"


if __name__ == "__main__":
    main()

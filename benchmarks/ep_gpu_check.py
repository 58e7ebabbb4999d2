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
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

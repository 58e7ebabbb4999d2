"""Expert parallelism compiled with backend="moe": both EP styles, checked against eager.

    torchrun --nproc-per-node 2 examples/expert_parallel.py          # gloo on CPU
    torchrun --nproc-per-node 4 examples/expert_parallel.py --tokens 64

Each rank builds the same global model from one seed and keeps its slice of the experts
(moe_compile/models/zoo_ep.py):

* torchtitan / Megatron style — local routing, per-expert counts and tokens exchanged with
  ``all_to_all_single``, local experts, reverse all-to-all, weighted combine.  The backend rewrites
  the region into one ``moe_compile::fused_moe_ep`` call (dispatch + experts + combine).
* DeepSeek official style — every rank runs its local experts on all tokens and ``all_reduce``s.
  The backend rewrites the local loop into ``moe_compile::fused_moe`` on shifted ids and keeps the
  model's all_reduce.

Rank 0 prints the explain report of each; every rank checks the compiled output against eager
(``zoo_ep.demo``: ``torch.compile(block, backend="moe")`` under ``moe_compile.api.capture_flags()``,
which lets Dynamo keep the ``.tolist()`` split sizes in the graph).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from moe_compile.models import zoo_ep


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("run me with torchrun, e.g.: torchrun --nproc-per-node 2 examples/expert_parallel.py", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        ok = zoo_ep.demo(args.tokens)  # compile both blocks, compare with eager, print on rank 0
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, ok)
        return 0 if all(flags) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

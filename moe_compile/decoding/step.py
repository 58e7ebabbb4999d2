"""Decode steps with Inductor's C++ wrapper: on by default for CPU decode steps
(``MOE_COMPILE_CPP_WRAPPER=0`` turns it off).

A generative model's decode step runs a few hundred small kernels on one token (norms, rotary,
the cache write, top-k glue) between the weight-reading matmuls, each called from Python by
Inductor's default wrapper.  Inductor's C++ wrapper (``torch._inductor.config.cpp_wrapper``)
calls them, and moe_compile's ops, from C++.  It is turned on for a CPU inference graph that
writes a tensor it was given in place through an index (``index_copy_``, ``index_put_``,
``x[..., pos] = ...``, ``narrow(...).copy_``): a static KV cache's update, which is what a decode
step looks like (HF ``cache_implementation="static"``, gpt-fast-style caches).  Training graphs and
graphs without such a write never get it.

Measured on a 4-layer Qwen3-MoE LM (2-core Xeon, 2026-12-02, one process each way,
A then B): a8w4-int decode 113.5 -> 121.3 tok/s through ``moe_compile.generate`` and 105.9 -> 114.0
through HF ``generate``; fp32 and w16 level (22.4 / 22.3, 38.7 / 39.1 tok/s).  Its four
alternating plain-loop runs: 7.4-8.2 ms a step with the Python wrapper, 6.9-7.3 with this one.
Earlier runs measured no gain (when the 4-bit kernels' own fixed costs hid it) and once,
through HF generate, a 3x slowdown that was not reproduced since.

``options={"cpp_wrapper": False}`` (an Inductor option, passed through) or
``MOE_COMPILE_CPP_WRAPPER=0`` keeps the Python wrapper; ``options={"cpp_wrapper": True}`` turns it on
for any graph.  Where the C++ wrapper fails to build a graph, that graph compiles with the Python
wrapper (``compiler._compile_rewritten``) and the report says so.
"""

from __future__ import annotations

import operator
import os

import torch
import torch.fx as fx

ENV = "MOE_COMPILE_CPP_WRAPPER"
# The C++ wrapper of a graph is one source file that g++ compiles on one core, in time growing
# with the graph: seconds for a 4-layer model, over 8 minutes for a 48-layer one (Qwen3-30B-A3B's
# shapes, 2-core EPYC), where the ~1 ms a step it saves is under 1% of that model's step.  Graphs
# writing more cache tensors than this (K and V per layer) keep the Python wrapper.
CPP_WRAPPER_MAX_WRITES = 32
# Inductor splits a CPU kernel across the threads when each gets at least cpp.min_chunk_size
# elements (512 by default).  A decode step's kernels (a norm over 2048, rotary over 32 x 128) are
# then two OpenMP regions of ~1 us work each, and the fork and join cost more than the work: at
# 16384 they run on one thread (4-layer Qwen3-MoE a8w4-int step, 2 threads, alternating runs:
# 9.3-10.2 -> 7.2-8.8 ms a step; its ten largest kernels' own time 185 -> 82 us).  Prefill-size
# kernels (a 512-token norm: 1M elements) stay parallel.
MIN_CHUNK_KEY, MIN_CHUNK_ENV, DECODE_MIN_CHUNK = "cpp.min_chunk_size", "TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE", 16384
# in-place writes through an index: how static KV caches are updated
_INDEXED_WRITES = frozenset({"index_copy_", "index_put_", "index_fill_", "scatter_", "copy_"})
# what a cache slot is cut with before an in-place copy_ (k_cache[:, :, a:b].copy_(k)): views only,
# not passes/graph.is_view_like's set, which also passes casts and reshapes that may copy (a write
# into a copy is not a write into the input)
_VIEWS = frozenset({"narrow", "select", "view", "__getitem__", "slice", "transpose", "unsqueeze"})


def cache_write(gm: fx.GraphModule) -> fx.Node | None:
    """The first node of gm that writes one of its inputs in place through an index, else None."""
    for node in gm.graph.nodes:
        if _writes_input(node):
            return node
    return None


def _writes_input(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _INDEXED_WRITES and node.args:
        target = node.args[0]
        # a plain whole-tensor copy_ is not a cache write; a copy_ into a cut slot is
        if node.target == "copy_" and not _is_view(target):
            return False
        return _root_is_input(target)
    if node.op == "call_function" and node.target is operator.setitem and node.args:
        return _root_is_input(node.args[0])
    return False


def _is_view(node) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target in _VIEWS)
        or (node.op == "call_function" and node.target in (operator.getitem, torch.narrow, torch.select)))


def _root_is_input(node) -> bool:
    """node is a graph input, or a view chain of one (the cache tensor itself, not a temporary)."""
    for _ in range(16):  # a view chain is short; anything deeper is not a cache slot
        if not isinstance(node, fx.Node):
            return False
        if node.op == "placeholder":
            return True
        if not _is_view(node):
            return False
        node = node.args[0]
    return False


def inductor_patches(gm: fx.GraphModule, example_inputs, patches: dict | None) -> tuple[dict | None, str | None]:
    """(Inductor config patches for gm, the report's line or None), for a CPU inference graph that
    writes a cache in place: ``cpp_wrapper=True`` unless the user set ``cpp_wrapper`` themselves or
    ``MOE_COMPILE_CPP_WRAPPER=0``, and ``cpp.min_chunk_size`` DECODE_MIN_CHUNK unless the user set
    it (the option or ``TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE``)."""
    patches = dict(patches or {})
    if torch.is_grad_enabled() or not _on_cpu(example_inputs):
        return patches or None, None
    write = cache_write(gm)
    if write is None:
        return patches or None, None
    added, writes = [], sum(1 for node in gm.graph.nodes if _writes_input(node))
    if "cpp_wrapper" not in patches and os.environ.get(ENV) != "0":
        if writes <= CPP_WRAPPER_MAX_WRITES:
            patches["cpp_wrapper"] = True
            added.append(f"Inductor's C++ wrapper, no Python between kernels ({ENV}=0 turns it off)")
        else:
            added.append(f"Inductor's Python wrapper: {writes} cache writes (layers x K, V) are more than "
                         f"{CPP_WRAPPER_MAX_WRITES}, whose C++ wrapper would take minutes to build "
                         f"(options={{'cpp_wrapper': True}} builds it anyway)")
    if MIN_CHUNK_KEY not in patches and MIN_CHUNK_ENV not in os.environ:
        patches[MIN_CHUNK_KEY] = DECODE_MIN_CHUNK
        added.append(f"its small kernels on one thread ({MIN_CHUNK_KEY}={DECODE_MIN_CHUNK})")
    if not added:
        return patches or None, None
    how = write.target if write.op == "call_method" else "x[index] = ..."
    return patches, (f"decode step (writes an input tensor in place with {how}: a static KV cache): compiled "
                     f"with {' and '.join(added)}")


def _on_cpu(example_inputs) -> bool:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)

"""Decoding: ``moe_compile.generate`` and how a decode step is compiled.

    greedy.py   moe_compile.generate: greedy decoding with a static cache, no per-step Python
    step.py     which graphs are decode steps, and the Inductor options they compile with
"""

from moe_compile.decoding.greedy import generate  # noqa: F401

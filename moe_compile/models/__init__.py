"""Models the library ships for its demo, tests and benchmarks, outside the import path of
``torch.compile(backend="moe")`` (nothing under ``moe_compile.passes`` or ``moe_compile.ops`` imports
them):

    zoo.py        small MoE blocks in each pattern family's spellings, and the demo's HF configs
    zoo_ep.py     expert-parallel blocks (all-to-all, all-reduce) for several ranks on one host
    llamacpp.py   a Qwen3-MoE model written as a GGUF and timed in llama.cpp beside moe_compile

Importing this package imports nothing (``moe-compile --help`` needs no torch).
"""

DEMO_MODELS = ("qwen3-moe", "deepseek-v3")  # the demo's model names, read by the CLI's --help

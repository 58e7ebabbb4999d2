"""Memory and time to first token of one GGUF in both engines, each run in a fresh process.

    python benchmarks/e2e_load.py worker GGUF --quant Q --quant-dense D --prompt 512 --gen 64 --reps 3
        [--threads 2] [--logits OUT.npy]        # one moe_compile row, its JSON on stdout's last line

Used by ``bench_e2e_cpu.py --from-gguf`` (the rows of a model loaded quantized): a row is a process
of its own, so its peak resident memory (``ru_maxrss``) is that row's alone, and its time to first
token counts from the process's start (read from ``/proc``), through ``moe_compile.load``, the
compiling first call and the prompt's prefill, to the first generated token.  llama.cpp's row is
its ``greedy_ids`` checker (``PATH MODEL.gguf THREADS IDS.txt N_GEN LOGITS.bin``) in a process of
its own: its peak resident memory and wall time to the first token (load, prefill, one token), and
its greedy tokens and logits, which the worker's are checked against.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def process_start() -> float:
    """This process's start as a time.time() value (``/proc/self/stat``'s field 22, in clock ticks
    after boot, plus ``/proc/stat``'s boot time)."""
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def worker(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("gguf")
    p.add_argument("--quant", default=None)
    p.add_argument("--quant-dense", default=None)
    for name, default in (("prompt", 512), ("gen", 64), ("reps", 3), ("threads", 2), ("check", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--logits", default=None, help="write the first step's logits here (.npy)")
    a = p.parse_args(argv)
    start = process_start()

    import torch

    import moe_compile

    torch.set_num_threads(a.threads)
    t = time.time()
    model = moe_compile.load(a.gguf, quant=a.quant, quant_dense=a.quant_dense)
    load_s, load_rss = time.time() - t, _peak_rss()
    model.compile(backend="moe")
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    stamped = _Stamped(model)
    first = _timed(stamped, prompt, a.gen)
    first_token_s = first["first_stamp"] - start
    runs = [_timed(stamped, prompt, a.gen) for _ in range(a.reps)]
    pre = sorted(r["prefill_s"] for r in runs)[len(runs) // 2]
    dec = sorted(r["decode_s"] for r in runs)[len(runs) // 2]
    with torch.no_grad():
        check = moe_compile.generate(stamped, prompt, a.check, stop_at_eos=False)[0, a.prompt:].tolist()
    if a.logits:  # the prefill's last position, from the compiled generate's own first step
        np.save(a.logits, stamped.first_logits)
    print(json.dumps(dict(engine="moe-load", quant=a.quant, quant_dense=a.quant_dense, load_s=load_s,
                          load_peak_GiB=load_rss, peak_GiB=_peak_rss(), first_token_s=first_token_s,
                          first_call_s=first["call_s"], prefill_tok_s=a.prompt / pre, decode_tok_s=a.gen / dec,
                          held_GiB=model.moe_compile_load.nbytes / 2**30, tokens=check,
                          load_report=str(model.moe_compile_load))))


def _peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def _timed(stamped: _Stamped, prompt, gen: int) -> dict:
    """moe_compile.generate of gen + 1 tokens, stamped as each forward returns (stamp 0: the prompt's
    prefill and the first token)."""
    import moe_compile

    stamped.stamps = []
    t0 = time.time()
    moe_compile.generate(stamped, prompt, gen + 1, stop_at_eos=False)
    t1 = time.time()
    first = stamped.stamps[0]
    return dict(prefill_s=first - t0, decode_s=t1 - first, call_s=t1 - t0, first_stamp=first)


class _Stamped:
    """The model as generate calls it, each call's end stamped outside the compiled forward (a
    wrapper inside it would be traced, and its Python state would make every step recompile); one
    object for every call, as generate keeps its static cache per model object.  ``first_logits``:
    the very first call's last-position logits (the compiled prefill's)."""

    def __init__(self, model):
        self._model, self.stamps, self.first_logits = model, [], None

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        self.stamps.append(time.time())
        if self.first_logits is None:
            self.first_logits = out.logits[0, -1].float().numpy().copy()
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def run_worker(gguf: str, quant, quant_dense, prompt: int, gen: int, reps: int, threads: int,
               logits: str | None = None) -> dict:
    """One worker row in a fresh process (its JSON)."""
    cmd = [sys.executable, os.path.abspath(__file__), "worker", gguf, "--prompt", str(prompt), "--gen", str(gen),
           "--reps", str(reps), "--threads", str(threads)]
    cmd += ["--quant", quant] if quant else []
    cmd += ["--quant-dense", quant_dense] if quant_dense else []
    cmd += ["--logits", logits] if logits else []
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_first_token(greedy: str, gguf: str, prompt_ids: np.ndarray, threads: int, n_gen: int) -> dict:
    """llama.cpp's greedy_ids in a process of its own: peak resident memory, wall time from its
    start to its exit after the first token (n_gen = 1), then its greedy tokens and logits (n_gen)."""
    with tempfile.TemporaryDirectory() as tmp:
        ids, logits = os.path.join(tmp, "ids.txt"), os.path.join(tmp, "logits.bin")
        np.savetxt(ids, prompt_ids, fmt="%d")
        t = time.time()
        proc = subprocess.Popen([greedy, gguf, str(threads), ids, "1", logits], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        first_token_s = time.time() - t
        if status != 0:
            raise RuntimeError(f"greedy_ids failed on {gguf} (status {status})")
        out = subprocess.run([greedy, gguf, str(threads), ids, str(n_gen), logits], check=True, capture_output=True,
                             text=True).stdout
        toks = [int(x) for x in next(ln for ln in out.splitlines() if ln.startswith("gen:")).split()[1:]]
        first = np.fromfile(logits, dtype=np.float32).reshape(n_gen + 1, -1)[0]
    return dict(engine="llama.cpp", peak_GiB=usage.ru_maxrss / 2**20, first_token_s=first_token_s, tokens=toks,
                first_logits=first)


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(((ref.astype(np.float64) - got) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref.astype(np.float64) ** 2).sum()) / noise)


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit(__doc__)
    worker(sys.argv[2:])

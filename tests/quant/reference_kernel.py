"""A stand-in kernel module with the issue-17 kernel contract (``unavailable_reason`` / ``run``),
computing ``quant.reference_moe``: lets the selection and plumbing be tested whatever kernels
this checkout has built.  ``RUNS`` counts calls per format."""

from moe_compile.quant import FORMATS, reference_moe

RUNS: dict = {}
SERVED = FORMATS


def unavailable_reason(fmt: str):
    return None if fmt in SERVED else f"the stand-in serves {SERVED}"


def run(x, ids, weights, w1, w2, attrs, pack_cache):
    RUNS[w1.fmt] = RUNS.get(w1.fmt, 0) + 1
    pack_cache.setdefault("seen", 0)
    return reference_moe(x, ids, weights, w1, w2, attrs)

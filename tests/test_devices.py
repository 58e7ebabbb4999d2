"""``moe-compile devices``: what this machine runs, including which CPU decode path and why."""

from moe_compile import devices
from moe_compile.kernels.cpu import cc as cpu_cc, experts as cpu_experts, onednn as cpu_onednn, prepack as cpu_prepack, rows as cpu_rows, skinny as cpu_skinny


def test_describe_names_the_cpu_decode_path():
    line = next(ln for ln in devices.describe().splitlines() if ln.startswith("cpu decode:"))
    if cpu_skinny.available():
        assert "cpu/skinny.c" in line and str(cpu_cc.cache_dir()) in line
    else:
        assert cpu_skinny.unavailable_reason() in line


def test_describe_names_the_cpu_prefill_path(monkeypatch):
    def line():
        return next(ln for ln in devices.describe().splitlines() if ln.startswith("cpu prefill:"))

    if cpu_prepack.available():
        assert "packs" in line() and "oneDNN" in line()
        assert ("cpu/experts.c" if cpu_experts.available() else cpu_experts.unavailable_reason()) in line()
        assert ("cpu/rows.c" if cpu_rows.available() else cpu_rows.unavailable_reason()) in line()
    monkeypatch.setenv(cpu_onednn.ENV, "0")
    assert f"{cpu_onednn.ENV}=0" in line() and "MKL" in line()
    monkeypatch.setenv(cpu_prepack.ENV, "0")
    assert f"{cpu_prepack.ENV}=0" in line() and "unavailable" in line()

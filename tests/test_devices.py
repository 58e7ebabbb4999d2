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


def test_capability_table_rows():
    # Every CPU row lists every quant format; CPU fp8 and every GPU quant variant are absent,
    # so "auto" (which runs only what a kernel module reports native) can never pick them.
    from moe_compile.quant import FORMATS

    for kind in devices.CPU_KINDS:
        assert {v.name for v in kind.variants} == {"a16w16", *FORMATS}
        assert "a8w8-fp8" not in kind.names()
    assert "a8w8-fp8" in devices.CPU_KINDS[0].variants[-1].name and not devices.CPU_KINDS[0].variants[-1].kernel
    for kind in devices.CUDA_KINDS.values():
        assert kind.names(verified_only=True) == ("a16w16",)
    assert all(k.reference_only and not k.names() for k in devices.ASCEND_KINDS)
    assert devices.ASCEND_VARIANTS["Atlas A2 training / inference"] == ("a16w16", "a8w8-int", "a8w4-int")


def test_describe_separates_this_machine_from_reference_data():
    text = devices.describe()
    here, _, reference = text.partition("reference data (no kernel here):")
    assert here.startswith("this machine:") and devices.cpu_kind().name in here
    assert "ascend Atlas A3" in reference and "cuda sm90" in reference and "ascend" not in here


def test_cli_devices_prints_the_table(capsys):
    from moe_compile import cli

    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "this machine:" in out and "reference data (no kernel here):" in out

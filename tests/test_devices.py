"""``moe-compile devices``: what this machine runs, including which CPU decode path and why."""

import itertools

from moe_compile import devices
from moe_compile.kernels.cpu import cc as cpu_cc, experts as cpu_experts, onednn as cpu_onednn, prepack as cpu_prepack, rows as cpu_rows, skinny as cpu_skinny


def _entry(head: str) -> str:
    """The verbose description's entry that starts with head, its wrapped lines joined."""
    text = devices.describe(verbose=True)
    start = text.index("\n" + head) + 1
    lines = text[start:].splitlines()
    entry = [lines[0]] + [ln for ln in itertools.takewhile(lambda ln: ln.startswith("  "), lines[1:])]
    return " ".join(ln.strip() for ln in entry)


def test_describe_names_the_cpu_decode_path():
    line = _entry("cpu decode:")
    if cpu_skinny.available():
        assert "cpu/skinny.c" in line and str(cpu_cc.cache_dir()) in line
    else:
        assert cpu_skinny.unavailable_reason() in line


def test_describe_names_the_cpu_prefill_path(monkeypatch):
    def line():
        return _entry("cpu prefill:")

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
    text = devices.describe(verbose=True)
    here, _, reference = text.partition("reference data (no kernel here):")
    assert here.startswith("this machine:") and devices.cpu_kind().name in here
    assert "ascend Atlas A3" in reference and "cuda sm90" in reference and "ascend" not in here


def test_cli_devices_prints_a_short_table_and_the_rest_with_verbose():
    import subprocess
    import sys

    def run(*flags):
        done = subprocess.run([sys.executable, "-m", "moe_compile.cli", "devices", *flags], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    short = run()
    lines = short.splitlines()
    assert lines[0].startswith(f"CPU: {devices.cpu_kind().name}") and "variant" in lines[1] and "runs here" in lines[1]
    rows = {ln.split()[0]: ln for ln in lines[2:] if ln.startswith("  ")}
    assert set(rows) == {"a16w16", *devices.CPU_KINDS[0].names(), "a8w8-fp8"}
    assert rows["a8w8-fp8"].split()[1] == "no" and "(no CPU fp8 kernel)" in rows["a8w8-fp8"]
    assert len(lines) <= 16 and max(map(len, lines)) <= 110  # a table a person reads, nothing cut mid-word
    assert "reference data" not in short and "--verbose" in short and "qdecode: qdecode" not in short
    verbose = devices.describe(verbose=True)  # what --verbose prints (test_cli checks the flag parses)
    assert "this machine:" in verbose and "reference data (no kernel here):" in verbose
    assert "qdecode: qdecode" not in verbose and "a8w8-fp8 has no CPU kernel (no fp8 arithmetic here)" in verbose

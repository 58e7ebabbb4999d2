"""moe-compile: version, help for every option, dump's errors and output, the demo (slow)."""

import sys
import tempfile

import pytest

from moe_compile import __version__
from moe_compile.cli import build_parser, main

SCRIPT = """
import torch
from moe_compile.models import zoo
from moe_compile.api import capture_flags

with torch.no_grad(), capture_flags():
    torch.compile(zoo.GatheredMoE(), backend="moe", options={"inner": "eager"})(torch.randn(1, 4, 64))
"""


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moe-compile {__version__}"


@pytest.mark.parametrize("command", [[], ["demo"], ["dump"], ["devices"]])
def test_help_has_text_for_every_option_and_no_rst(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert "``" not in text  # the description is plain text, not RST
    parser = build_parser()
    actions = parser._actions if not command else parser._subparsers._group_actions[0].choices[command[0]]._actions
    for action in actions:
        assert action.help, f"moe-compile {' '.join(command)}: option {action.dest} has no help text"


def test_dump_missing_script_is_a_clear_error_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["dump", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert "no such script" in err and "missing.py" in err
    assert list(tmp_path.iterdir()) == []


def test_dump_runs_the_script_and_lists_the_pictures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_COMPILE_DUMP", "")  # restored after the test (dump sets it)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "dump"
    assert main(["dump", "--dir", str(out_dir), str(script)]) == 0
    out = capsys.readouterr().out
    assert "1 graph(s)" in out and "moe_region_0.dot" in out
    (folder,) = out_dir.iterdir()
    assert "fused_moe" in (folder / "after.py").read_text()


def test_dump_that_compiles_nothing_leaves_no_temporary_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOE_COMPILE_DUMP", "")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    script = tmp_path / "noop.py"
    script.write_text("x = 1\n")
    assert main(["dump", str(script)]) == 0
    assert "compiled nothing" in capsys.readouterr().out
    assert list((tmp_path / "tmp").iterdir()) == []


def test_demo_options_parse():
    args = build_parser().parse_args(["demo", "--model", "deepseek-v3", "--layers", "2", "--tokens", "8"])
    assert (args.model, args.layers, args.tokens) == ("deepseek-v3", 2, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--model", "no-such-model"])


@pytest.mark.slow
def test_demo_small_model_matches_eager(capsys):
    # Two layers, a few tokens: the full demo path (build, three variants, checks) in ~1-2 min.
    assert main(["demo", "--layers", "2", "--tokens", "4", "--prompt", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens same" in out and "demo passed" in out


# ---- the CLI's own words (each in a fresh process: what a user sees)


def _cli(*argv, env=None, timeout=300):
    import os
    import subprocess

    return subprocess.run([sys.executable, "-m", "moe_compile.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_and_version_import_no_torch():
    # --help / --version took ~10 s on a cold disk because importing the CLI imported torch.
    code = ("import sys\nfrom moe_compile.cli import main\n"
            "for argv in (['--version'], ['--help'], ['demo', '--help'], ['dump', '--help'], ['devices', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"moe-compile {__version__}" in done.stdout and "--verbose" in done.stdout


def test_dump_without_a_script_asks_for_one():
    done = _cli("dump")
    assert done.returncode == 2
    assert "give the Python script to run: moe-compile dump SCRIPT [-- ARGS]" in done.stderr
    assert "script_args" not in done.stderr


def test_dump_without_graphviz_says_so_once(tmp_path):
    # Two graphs, no `dot` on PATH: .dot files only, and one line saying how to get .png/.svg.
    script = tmp_path / "two.py"
    script.write_text(SCRIPT + "    torch.compile(zoo.ModuleListMoE(experts=4), backend='moe', options={'inner': 'eager'})"
                               "(torch.randn(1, 4, 64))\n")
    bin_dir = tmp_path / "bin"  # python only: no dot (and no cc: the op's torch path serves these tiny blocks)
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    done = _cli("dump", "--dir", str(tmp_path / "d"), str(script), env={"PATH": str(bin_dir)})
    assert done.returncode == 0, done.stderr
    listing = [ln for ln in done.stdout.splitlines() if ln.startswith("  ")]
    assert "2 graph(s)" in done.stdout and len(listing) == 2 and all("moe_region_0.dot" in ln for ln in listing)
    assert not any(".png" in ln or ".svg" in ln for ln in listing)
    said = (done.stdout + done.stderr).count("Graphviz's `dot` is not installed")
    assert said == 1 and "install Graphviz" in done.stdout


def test_demo_first_call_estimate_is_a_cold_figure():
    # The first compiling call measured 152-208 s cold on 2 cores, not "~30 s".
    from moe_compile import demo

    assert "~30 s" not in demo.FIRST_CALL_NOTE and "min" in demo.FIRST_CALL_NOTE and "cold" in demo.FIRST_CALL_NOTE

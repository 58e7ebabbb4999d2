"""moe-compile: version, help for every option, dump's errors and output, the demo (slow)."""

import sys
import tempfile

import pytest

from moe_compile import __version__
from moe_compile.cli import build_parser, main

SCRIPT = """
import torch
from moe_compile import zoo
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

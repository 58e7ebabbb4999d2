"""pyproject.toml says who made the package and keeps Triton out of what a CPU-only tester must install."""

import pathlib
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_extras_put_triton_where_it_is_wanted():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert not any("triton" in req for req in extras["test-cpu"])  # a CPU-only tester skips the interpreter tests
    assert any(req.startswith("triton") for req in extras["gpu"]) and extras["triton"] == ["moe-compile[gpu]"]
    # `test` (what .ci/run installs) keeps the interpreter tests running: test-cpu plus Triton
    assert "moe-compile[test-cpu]" in extras["test"] and any(req.startswith("triton==") for req in extras["test"])


def test_authors_are_named():
    assert tomllib.loads(PYPROJECT.read_text())["project"]["authors"]

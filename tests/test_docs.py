"""The docs a user reads first say what the code does: every environment variable the package reads
is documented, no page speaks the issue tracker's language, and the README's HF recipe (slow) runs
and prints what the README says it prints."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_environment_variable_read_is_documented():
    read = {m for path in (ROOT / "moe_compile").rglob("*.py")
            for m in re.findall(r"[\"'](MOE_COMPILE_[A-Z0-9_]+)[\"']", path.read_text())}
    documented = set(re.findall(r"`(MOE_COMPILE_[A-Z0-9_]+)`", (ROOT / "docs" / "options.md").read_text()))
    assert read and read <= documented, f"read but not in docs/options.md: {sorted(read - documented)}"


def test_no_page_speaks_the_trackers_language():
    # "the 25 dB" means nothing to a reader who never saw the tracker.
    for page in PAGES:
        found = re.findall(r"[^.\n]*\b(?:the issue|issue \d+|issue #\d+)\b[^.\n]*", page.read_text(), re.IGNORECASE)
        assert not found, f"{page.name}: {found}"


def test_glossary_and_quantization_agree_on_what_explain_runs():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    assert "no rewritten graph is executed" not in glossary  # explain(..., quant=...) runs them
    assert "rewritten when `quant=` is given" in glossary
    assert "`explain(..., quant=...)` runs the rewritten graphs" in (ROOT / "docs" / "quantization.md").read_text()


@pytest.mark.slow
def test_readme_hf_recipe_prints_its_tokens_equal_to_eager(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## With a Hugging Face model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 MoE region(s) rewritten" in done.stdout and "3 graph(s), 6 MoE region(s) rewritten" in done.stdout
    assert "equal to eager: True" in done.stdout

"""What the backend did is logged to ``logging.getLogger("moe_compile")``, and nothing else is printed.

Each case runs in a fresh process (tests.conftest.run_python): logging configuration and
TORCH_LOGS are read once per process, and stderr is what a user would see.
"""

from tests.conftest import run_python

COMPILE = """
import torch, moe_compile
from moe_compile.models import zoo
torch.manual_seed(0)
with torch.no_grad():
    moe_compile.optimize(zoo.ModuleListMoE(experts=4), inner="eager", verify={verify})(torch.randn(1, 5, 64))
    moe_compile.optimize(zoo.DenseMLPLoop(), inner="eager")(torch.randn(3, 64))
print(moe_compile.last_report().summary())
"""


def test_normal_compile_prints_nothing_to_stderr():
    done = run_python(COMPILE.format(verify=False))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.strip() == "2 graph(s), 1 MoE region(s) rewritten, 1 skipped [report v2]"  # last_report(): both graphs


def test_info_one_line_per_graph_debug_the_reasons_verify_its_error():
    setup = "import logging; logging.basicConfig(level='DEBUG', format='%(levelname)s %(name)s %(message)s')\n"
    done = run_python(setup + COMPILE.format(verify=True))
    assert done.returncode == 0, done.stderr
    ours = [ln.split(" ", 2) for ln in done.stderr.splitlines() if ln.split(" ")[1:2] == ["moe_compile"]]
    info = [text for level, _, text in ours if level == "INFO"]
    assert info[0] == "graph 0: 1 MoE region(s) rewritten, 0 skipped" and info[-1].startswith("graph 1: 0 MoE")
    (verify,) = [text for text in info if text.startswith("verify:")]
    assert float(verify.split("max relative error ")[1].split(",")[0]) <= 1e-4  # fp32: summation order only
    debug = [text for level, _, text in ours if level == "DEBUG"]
    assert any(t.startswith("graph 0: rewritten: experts: family=loop E=4") for t in debug), debug
    assert any(t.startswith("graph 1: skipped: 4 same-shaped FFNs but no top-k routing") for t in debug), debug


def test_torch_logs_enables_the_logger():
    # TORCH_LOGS accepts any importable module's logger by name; "+" is DEBUG.
    done = run_python(COMPILE.format(verify=False), TORCH_LOGS="+moe_compile")
    assert done.returncode == 0, done.stderr
    assert "graph 0: 1 MoE region(s) rewritten, 0 skipped" in done.stderr
    assert "graph 0: rewritten: experts: family=loop" in done.stderr

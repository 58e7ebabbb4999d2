#!/usr/bin/env bash
# GPU lane of moe_compile in one go: versions, the GPU tests, the bf16 MoE benchmark.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Everything it writes lands flat in $OUT (default ./gpu_check_out):
#   env.txt              torch / triton / python / GPU versions, nvidia-smi
#   pytest_gpu.log       python -m pytest -m gpu -q tests
#   bench_gpu_moe.log    the benchmark's progress
#   bench_gpu_moe.md     its table            bench_gpu_moe.json   its raw numbers
#                        (incl. deepseek_v3_ep8_train: forward+backward vs grouped_mm autograd)
#   bench_gpu_quant.md   Triton quantized GEMMs (unverified until pytest_gpu passes) vs the bf16 op
#                        bench_gpu_quant.log / .json beside it
#   triton_autotune.json the tile configs the autotuner picked (seed for autotune.py's lists)
#   summary.txt          exit codes of each step
# Time: at most ~8.8 minutes (45 + 180 + 200 + 100 s of timeouts) on an H200 (each step runs under `timeout`; the benchmark also stops
# starting new shapes after --budget-s and keeps what it measured).  Needs no network.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"

# The package is not installed on the GPU machine: try an editable install (registers the "moe"
# dynamo backend entry point for other GPU tests), and put the checkout on the path regardless.
timeout 45 "$PY" -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/pip_install.log" 2>&1
PIP_RC=$?
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# A private autotune cache, copied into $OUT at the end; the autotuner stays on (bounded lists).
export MOE_COMPILE_CACHE_DIR="$(mktemp -d)"
unset TRITON_INTERPRET

{
  echo "date: $(date -u +%FT%TZ)"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
else:
    print("gpu: none visible to torch")
EOF
  nvidia-smi 2>&1 | head -20
  echo "pip install -e . exit code: $PIP_RC"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== pytest -m gpu (timeout 180 s)"
timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests >"$OUT/pytest_gpu.log" 2>&1
TEST_RC=$?
tail -n 25 "$OUT/pytest_gpu.log"

echo "== bench_gpu_moe (timeout 200 s)"
timeout 200 "$PY" benchmarks/bench_gpu_moe.py --out "$OUT/bench_gpu_moe" --budget-s 140 >"$OUT/bench_gpu_moe.log" 2>&1
BENCH_RC=$?
tail -n 30 "$OUT/bench_gpu_moe.log"

echo "== bench_gpu_quant (timeout 100 s)"
timeout 100 "$PY" benchmarks/bench_gpu_quant.py --out "$OUT" --budget-s 70 >"$OUT/bench_gpu_quant.log" 2>&1
QUANT_RC=$?
tail -n 12 "$OUT/bench_gpu_quant.log"

cp "$MOE_COMPILE_CACHE_DIR/triton_autotune.json" "$OUT/triton_autotune.json" 2>/dev/null
{
  echo "pip_install_rc=$PIP_RC"
  echo "pytest_gpu_rc=$TEST_RC (124 = timeout)"
  echo "bench_rc=$BENCH_RC (124 = timeout; partial table/json are still written per shape)"
  echo "bench_gpu_quant_rc=$QUANT_RC (124 = timeout)"
} | tee "$OUT/summary.txt"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]

#!/usr/bin/env bash
# GPU check of the safe kernels, < 5 minutes on one GPU:
#   1. tests/test_kernels.py with COMPILED Pallas kernels (NAN2SAFE_KERNEL_INTERPRET=0; on CPU
#      the same tests run in interpret mode), slow tests included;
#   2. the accuracy + speed table of benchmarks/kernels.py (JSON next to it);
#   3. the tier-1 overhead comparison of benchmarks/overhead.py (plain vs nan2safe vs one
#      attention site in SAFE, demo size; JSON next to it).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]     (PY=python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
OUT_DIR="${1:-${OUT:-/tmp}}"
mkdir -p "$OUT_DIR"

"$PY" - <<'PYEOF'
import jax
backend = jax.default_backend()
print("jax", jax.__version__, "backend", backend, jax.devices())
if backend not in ("gpu", "cuda", "rocm"):
    raise SystemExit(f"gpu_check.sh needs a GPU backend, got {backend!r}")
PYEOF

export NAN2SAFE_KERNEL_INTERPRET=0
status=0
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -rs --durations=10 \
  2>&1 | tee "$OUT_DIR/gpu_kernel_tests.txt" || status=$?
timeout 90 "$PY" benchmarks/kernels.py --repeats 50 --scale 4 \
  --json "$OUT_DIR/kernels_gpu.json" 2>&1 | tee "$OUT_DIR/kernels_gpu.txt" || status=$?
timeout 100 "$PY" benchmarks/overhead.py --arms plain,nan2safe,safe_attn --rounds 7 --steps 4 --chunks 3 \
  --json "$OUT_DIR/overhead_gpu.json" 2>&1 | tee "$OUT_DIR/overhead_gpu.txt" || status=$?
exit "$status"

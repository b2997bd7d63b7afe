#!/usr/bin/env bash
# The GPU benchmark (docs/operations.md#benchmarks): scripts/bench_gpu.py on a CUDA machine,
# ours beside nanoGPT, in under 8 minutes on one H200 (--budget-s, default 420 s, skips what
# would not fit and says so). Its log is kept in $OUT (the device tool's folder) or /tmp.
#
# Before the call, on the machine that sends the working tree (both folders are git-ignored):
#   nanoGPT's source:  git --git-dir=<a clone or mirror of karpathy/nanoGPT> archive HEAD model.py \
#                        | tar -x --one-top-level=third_party/nanoGPT
#   the wheels the device image lacks (its python3 is 3.12):
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl zstandard isal
# then run `scripts/gpu_bench.sh [bench_gpu.py options]` there, carrying third_party and .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/andrea-site .whl/*.whl
  export PYTHONPATH=/tmp/andrea-site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -f third_party/nanoGPT/model.py ] || echo "no third_party/nanoGPT/model.py: no nanoGPT side" >&2
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "torch sees no CUDA device" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader || true
LOG=${OUT:-/tmp}/gpu_bench.log
set -o pipefail
PYTHONUNBUFFERED=1 "$PY" scripts/bench_gpu.py "$@" 2>&1 | tee "$LOG"

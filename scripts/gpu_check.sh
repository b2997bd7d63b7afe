#!/usr/bin/env bash
# GPU check (issue 6): on a machine with CUDA, run andrea-12m and andrea-120m for a few hundred
# steps under the proxy, send SIGUSR1 then SIGTERM, check the checkpoints with
# `python -m proxy inspect`, and print tokens/s and MFU from the run's history.
#
#   scripts/gpu_check.sh [WORKDIR] [STEPS]        (defaults: a fresh temp dir, 300 steps)
#   NPROC=2 scripts/gpu_check.sh                  (also runs each preset with torchrun on 2 GPUs)
#   COMPILE=1 scripts/gpu_check.sh                (adds --compile)
#
# Budget: about 5-8 minutes on one H100/H200 (BPE tokenizer training on the default arms takes
# ~30 s per run). Exits non-zero on the first failed check, saying which.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WORK=${1:-$(mktemp -d /tmp/andrea-gpu-check.XXXXXX)}
STEPS=${2:-300}
NPROC=${NPROC:-1}
EXTRA=()
[ "${COMPILE:-0}" = 1 ] && EXTRA+=(--compile)
[ "$NPROC" -gt 1 ] && EXTRA+=(--nproc-per-node "$NPROC")

fail() { echo "GPU CHECK FAILED: $*" >&2; exit 1; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || fail "torch sees no CUDA device"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

check_preset() {
  local preset=$1 batch=$2 run="$WORK/$1"
  echo "=== $preset: $STEPS steps, batch $batch x 1024 tokens ${EXTRA[*]:-} ==="
  "$PY" -m proxy run --run-dir "$run" --preset "$preset" --batch-size "$batch" \
      --max-steps 100000 --checkpoint-every 100 --sample-every 100 --print-every 25 \
      "${EXTRA[@]}" > "$WORK/$preset.out" 2>&1 &
  local proxy=$!
  # wait for STEPS steps (history tail), then SIGUSR1, 20 more steps, then SIGTERM
  wait_step() {
    local want=$1 deadline=$((SECONDS + 900))
    while :; do
      local s
      s=$("$PY" -c "import sys; sys.path.insert(0, 'tests'); from proc_helpers import last_step; print(last_step('$run'))" 2>/dev/null || echo 0)
      [ "$s" -ge "$want" ] && return 0
      kill -0 $proxy 2>/dev/null || { tail -30 "$WORK/$preset.out"; fail "$preset: proxy exited before step $want"; }
      [ $SECONDS -lt $deadline ] || fail "$preset: step $want not reached in 15 minutes"
      sleep 2
    done
  }
  wait_step "$STEPS"
  kill -USR1 $proxy
  local usr1_from
  usr1_from=$("$PY" -c "import sys; sys.path.insert(0, 'tests'); from proc_helpers import last_step; print(last_step('$run'))")
  wait_step $((usr1_from + 20))
  kill -TERM $proxy
  wait $proxy || fail "$preset: proxy exited non-zero after SIGTERM"
  if pgrep -f -- "--run-dir $run" >/dev/null; then
    pgrep -af -- "--run-dir $run"; fail "$preset: processes left running after SIGTERM"
  fi
  "$PY" - "$run" <<'EOF' || fail "$preset: checkpoint reasons"
import json, sys
m = json.load(open(f"{sys.argv[1]}/checkpoints.json"))["checkpoints"]
reasons = [e["reason"] for e in m]
print("checkpoints:", [(e["step"], e["reason"]) for e in m])
assert "sigusr1" in reasons and reasons[-1] == "sigterm", reasons
EOF
  for f in "$run"/step_*.bin; do
    "$PY" -m proxy inspect "$f" > "$WORK/inspect.txt" || { cat "$WORK/inspect.txt"; fail "$f invalid"; }
    grep -E "^(header|size|valid)" "$WORK/inspect.txt" | sed "s|^|  $(basename "$f"): |"
  done
  "$PY" - "$run" <<'EOF'
import json, statistics, sys
recs = [r for r in json.load(open(f"{sys.argv[1]}/.loss.json")) if "step" in r]
tail = recs[len(recs) // 2:]  # after warm-up / compilation
tps = statistics.median(r.get("tokens_per_s") or 0 for r in tail)
mfus = [r["mfu"] for r in tail if r.get("mfu") is not None]
print(f"  steps {recs[-1]['step']} | loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f} | "
      f"median {tps:,.0f} tokens/s | MFU " + (f"{statistics.median(mfus):.1%}" if mfus else "n/a"))
EOF
}

check_preset andrea-12m 32
check_preset andrea-120m 16
echo "GPU CHECK PASSED (work dir $WORK)"

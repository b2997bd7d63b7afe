#!/usr/bin/env bash
# GPU check: on a machine with CUDA, run andrea-12m and andrea-120m for a few hundred
# steps under the proxy, send SIGUSR1 then SIGTERM, check the checkpoints with
# `python -m proxy inspect`, and print tokens/s and MFU from the run's history.
#
#   scripts/gpu_check.sh [WORKDIR] [STEPS]        (defaults: a fresh temp dir, 300 steps)
#   NPROC=2 scripts/gpu_check.sh                  (also runs each preset with torchrun on 2 GPUs)
#   COMPILE=off scripts/gpu_check.sh              (--compile off|on; default auto: compiled on CUDA)
#   PRECISION=fp32 scripts/gpu_check.sh           (--precision; default auto = bf16 autocast on a
#                                                  GPU with native bf16; weights/m/v/file fp32 always)
#
# Budget: about 5-8 minutes on one H100/H200 (BPE tokenizer training on the default arms takes
# ~30 s per run). Exits non-zero on the first failed check, saying which.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WORK=${1:-$(mktemp -d /tmp/andrea-gpu-check.XXXXXX)}
mkdir -p "$WORK"   # a WORKDIR given on the command line may not exist yet
STEPS=${2:-300}
NPROC=${NPROC:-1}
EXTRA=()
[ -n "${COMPILE:-}" ] && EXTRA+=(--compile "$COMPILE")
[ "$NPROC" -gt 1 ] && EXTRA+=(--nproc-per-node "$NPROC")
PRECISION=${PRECISION:-auto}
[ "$PRECISION" != auto ] && EXTRA+=(--precision "$PRECISION")

fail() { echo "GPU CHECK FAILED: $*" >&2; exit 1; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || fail "torch sees no CUDA device"
INFO=$("$PY" -c "import torch; b = torch.cuda.is_bf16_supported(including_emulation=False)
print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| native bf16:', b)
print(int(b))")
echo "${INFO%$'\n'*}"
NATIVE_BF16=${INFO##*$'\n'}   # 1: --precision auto must train in bf16 autocast

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
  "$PY" - "$run" "$PRECISION" "$NATIVE_BF16" <<'EOF' || fail "$preset: precision / AdamW kernel / fp32 master weights"
import glob, json, sys
import numpy as np
run, asked, native = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
hello = [json.loads(l) for l in open(f"{run}/.reports.jsonl") if '"hello"' in l][-1]
print(f"  worker: precision {hello.get('precision')} | AdamW "
      f"{'fused' if hello.get('fused_adamw') else 'foreach'} | compile {hello.get('compile')} | "
      f"peak {hello.get('peak_source')}")
want = ("bf16" if native else "fp32") if asked == "auto" else asked
assert hello.get("precision") == want, f"precision {hello.get('precision')}, expected {want}"
assert hello.get("fused_adamw") is True, "CUDA must use the fused AdamW kernel"
# the newest checkpoint holds fp32 master weights, not bf16-rounded values (low 16 bits in use)
f = sorted(glob.glob(f"{run}/step_*.bin"))[-1]
n = int(np.fromfile(f, dtype=np.int32, count=2)[1])
w = np.memmap(f, dtype=np.uint32, mode="r", offset=8, shape=(n,))[: 1 << 22]
frac = float(((w[w != 0] & 0xFFFF) != 0).mean())
print(f"  {f.rsplit('/', 1)[-1]}: {frac:.1%} of non-zero weights use the low 16 bits (fp32 master)")
assert frac > 0.9, "weights look bf16-rounded: the fp32 master copy is lost"
EOF
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

#!/usr/bin/env bash
# One session on a lent NVIDIA GPU (an H200: its image has jax with CUDA, flax, chex, pytest), at most
# 8 minutes, from the repository root as the device tool runs it:
#
#   bash benchmarks/device_session.sh            # on the device; logs and the table under $OUT
#   bash benchmarks/device_session.sh --dry-run  # the same steps on this host's CPU, each at its
#                                                # smallest (the test suite runs this)
#
# Steps, each under its own time limit, its output in $OUT/<step>.log:
#   1. kernels:  tests/kernels/test_gpu.py, the Pallas GPU (Triton) kernel compiled for the device against
#                the float64 oracle (on a CPU: a few of its cases in the Pallas interpreter);
#   2. kernel:   benchmarks/kernel.py, one decode step's bytes/s against a copy of the same bytes, and
#                against the XLA path and dense attention;
#   3. engine:   benchmarks/engine.py, the TTS engine pipelined and synchronous, one decode step per
#                dispatch (K = 1) and a block of 8 (K = 8, `engine.decode_steps`), from one run;
#   4. gemma:    benchmarks/gemma_decode.py, Gemma 3 of the 270M geometry (random weights: no model file
#                travels) prefill and decode tokens/s through the engine, K = 1 and 8;
#   5. profile:  benchmarks/trace_summary.py over a profiled run of each of 3 and 4 (`--trace`, one more
#                untimed serve each): the device's busy time, its costliest ops and the host's events.
# Each step has its own time limit; together they stay within 8 minutes. Then one table: each step's
# status, seconds and headline figure. The script exits non-zero if a step failed, after printing it.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  KERNEL_TESTS=(-k "test_empty_step or test_head_dim_not_a_power_of_two")
  KERNEL=(--quick --slots 2 --window 60 --kv-heads 1 --heads 2 --head-dim 16)
  ENGINE=(--quick --batch 2 --streams 3 --repeats 1 --steps 2)
  BLOCK=2
  GEMMA=(--quick --tiny --steps 2)
  declare -A LIMIT=([kernels]=300 [kernel]=300 [engine]=300 [gemma]=300 [profile]=120)
else
  # tests/conftest.py defaults JAX to the CPU for the suite; the device session wants the GPU.
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
  KERNEL_TESTS=()
  KERNEL=(--slots 128)  # 537 MB of keys and values a step: well past launch overhead and the 60 MB L2
  ENGINE=(--batch 64 --streams 128 --repeats 3 --steps 8)
  BLOCK=8
  GEMMA=(--batch 8 --prompt 512 --tokens 128 --repeats 3 --steps 8)
  declare -A LIMIT=([kernels]=80 [kernel]=50 [engine]=170 [gemma]=150 [profile]=30)  # 480 s in all
fi

"$PYTHON" - > "$OUT/device.log" 2> "$OUT/device.err" <<'EOF'
import jax
print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {[d.device_kind for d in jax.devices()]}")
EOF
ok=$?
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >> "$OUT/device.log" 2>> "$OUT/device.err"
if [ $ok -ne 0 ] || { [ "$DRY" = 0 ] && ! grep -q "backend gpu" "$OUT/device.log"; }; then
  cat "$OUT/device.log" "$OUT/device.err" >&2
  echo "no GPU backend: run on the device, or pass --dry-run" >&2
  exit 1
fi

declare -A STATUS ELAPSED
FAILED=0
step() {  # step NAME COMMAND...: run it under the time limit, its output to $OUT/NAME.log
  local name=$1 start=$SECONDS rc
  shift
  timeout "${LIMIT[$name]}" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  ELAPSED[$name]=$((SECONDS - start))
  if [ $rc -eq 0 ]; then STATUS[$name]=ok; elif [ $rc -eq 124 ]; then STATUS[$name]="timed out"; else STATUS[$name]="failed ($rc)"; fi
  [ $rc -eq 0 ] || FAILED=1
}

# -o addopts=: the suite's xdist options (and the pytest-xdist version they need) are not the device's.
step kernels "$PYTHON" -m pytest -q -o addopts= -p no:cacheprovider tests/kernels/test_gpu.py "${KERNEL_TESTS[@]}"
step kernel "$PYTHON" -m benchmarks.kernel "${KERNEL[@]}"
TRACES="$(mktemp -d)"  # the summaries travel, not the traces (tens of MB)
trap 'rm -rf "$TRACES"' EXIT
step engine "$PYTHON" -m benchmarks.engine "${ENGINE[@]}" --trace "$TRACES/engine"
step gemma "$PYTHON" -m benchmarks.gemma_decode "${GEMMA[@]}" --trace "$TRACES/gemma"
step profile "$PYTHON" -m benchmarks.trace_summary "$TRACES/engine" "$TRACES/gemma" --top 20

figure() {  # figure NAME PATTERN: the last line of NAME's log matching PATTERN, trimmed
  grep -E "$2" "$OUT/$1.log" 2>/dev/null | tail -1 | sed -E 's/^ +//; s/ +/ /g'
}
{
  echo "device session$([ "$DRY" = 1 ] && echo ' (dry run on the CPU: not a device figure)'): $(cat "$OUT/device.log")"
  printf '%-8s %-12s %8s  %s\n' step status seconds figure
  printf '%-8s %-12s %8s  %s\n' kernels "${STATUS[kernels]}" "${ELAPSED[kernels]}" "$(figure kernels '(passed|failed)')"
  printf '%-8s %-12s %8s  %s\n' kernel "${STATUS[kernel]}" "${ELAPSED[kernel]}" "$(figure kernel '^(pallas_gpu|xla) +of copy')"
  printf '%-8s %-12s %8s  %s\n' engine "${STATUS[engine]}" "${ELAPSED[engine]}" "$(figure engine 'pipelined +[0-9.]+ .* frames/s')"
  printf '%-8s %-12s %8s  %s\n' "engine$BLOCK" "${STATUS[engine]}" "-" "$(figure engine "pipelined +K=$BLOCK ")"
  printf '%-8s %-12s %8s  %s\n' gemma "${STATUS[gemma]}" "${ELAPSED[gemma]}" "$(figure gemma 'pipelined +prefill')"
  printf '%-8s %-12s %8s  %s\n' "gemma$BLOCK" "${STATUS[gemma]}" "-" "$(figure gemma "pipelined K=$BLOCK +prefill")"
  printf '%-8s %-12s %8s  %s\n' profile "${STATUS[profile]}" "${ELAPSED[profile]}" "$(figure profile '^device busy')"
  echo "logs: $OUT"
} | tee "$OUT/table.txt"
exit $FAILED

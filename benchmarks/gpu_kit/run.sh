#!/usr/bin/env bash
# One device call's worth of GPU checks and studies, on the offline GPU host, run from the repository root with
# the te-kit and this gpu-kit copied beside it (.te-kit/, .gpu-kit/: git-ignored, named in the call's carry):
#
#   TESTS_S=300 SEED_S=120 bash benchmarks/gpu_kit/run.sh
#   FULL_DEPTH_S=400 bash benchmarks/gpu_kit/run.sh               (to resume a store, carry it: see below)
#   NUMERICS_S=300 PLAIN_S=150 TE_PLAIN_S=120 bash benchmarks/gpu_kit/run.sh
#
# A store to resume travels as .gpu-run/results.tar.xz (git-ignored; `tar cJf .gpu-run/results.tar.xz
# juicytalk-results`, a few hundred KB): the working tree, the kits and juicytalk-results as it is came to more
# than the 64 MiB a call carries. It is unpacked here when present. CALL_S (default 590) is the call's own limit:
# each step gets at most what is left of it, less 25 s for the store's .tgz, so that a late step is cut short
# instead of the call (a call cut by its limit returned no .tgz of the study it was running).
#
# Each step runs where its variable gives it seconds (a device call has at most 600 s, the kits' install ~20 s
# of it), in this order: TESTS_S every `-m gpu` test, or those TESTS_K selects (pytest -k; tests/test_disturbance.py
# alone after the rest: it looks for other CUDA processes), SEED_S the seed example's start (benchmarks/sweep_start.py),
# FULL_DEPTH_S the full-depth study (examples/full-depth.yaml;
# a sweep resumes whatever its store under juicytalk-results holds), NUMERICS_S issue 46's numerics study
# (examples/fp8-numerics-shapes.yaml), GRAPHS_S issue 56's graphed full-depth study (examples/full-depth-graphs.yaml,
# or GRAPHS_FILE: a sweep of the same name holding some of its cells), LOSSES_S its graphed cells' loss curves
# against their eager twins' (benchmarks/graph_losses.py; LOSSES_ONLY label substrings, LOSSES_LAYERS, default 4), TE_PLAIN_S / PLAIN_S the full-depth cells' plain loops
# (benchmarks/te_hf_loop.py, hf_loop.py; PLAIN_FILE another sweep's cells, such as examples/full-depth-graphs.yaml;
# TE_ONLY / PLAIN_ONLY: label substrings, space
# separated, pick the cells; ROUNDS, default 2, the interleaved rounds of each; KERNELS=1: both sides profiled,
# kernel ms per class and the GPU's idle gap side by side). What each
# printed, and each study's store as a .tgz, land in $OUT. The host has no plotly: reports are made afterwards,
# off the host, with `juicytalk report`.
set -o pipefail
export PYTHONUNBUFFERED=1 NVTE_FRAMEWORK=pytorch NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
CALL_S=${CALL_S:-590}
[ -f .gpu-run/results.tar.xz ] && tar xJf .gpu-run/results.tar.xz
{ source .te-kit/install.sh && source .gpu-kit/install.sh; } > "$OUT/kit.txt" 2>&1 || { tail -20 "$OUT/kit.txt"; exit 1; }
export PYTHONPATH=.:$PYTHONPATH
quiet() { grep -v -i "warning\|warn(\|^\s*$"; }
echo "== kits in $(el) s; git $(git log -1 --format=%h 2>/dev/null)"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformer_engine, torchao, ray, transformers; print('torch', torch.__version__, 'TE',
transformer_engine.__version__, 'torchao', torchao.__version__, 'ray', ray.__version__, 'transformers',
transformers.__version__)" 2>&1 | quiet

# A step writes to a file, never into a pipe, and its timeout kills 20 s after its TERM (-k): a sweep stopped on
# TERM once ran past the call's limit, the processes it started (Ray's) holding a `| tee` pipe open, and the
# store's .tgz after it was never made. `step NAME SECONDS COMMAND...` runs one and prints its quiet output.
step() {
  local name=$1 secs=$2 left=$(( CALL_S - $(el) - 25 - 20 ))  # 20: the kill after TERM
  shift 2
  if [ "$left" -lt 10 ]; then echo "   ($name: skipped, no time left of CALL_S=${CALL_S})"; return 0; fi
  if [ "$secs" -gt "$left" ]; then secs=$left; echo "   ($name: cut to ${secs} s, what is left of CALL_S=${CALL_S})"; fi
  timeout -k 20 "$secs" "$@" > "$OUT/$name.raw" 2>&1
  quiet < "$OUT/$name.raw" > "$OUT/$name.txt"
  rm -f "$OUT/$name.raw"
}
sweep() {  # $1 seconds, $2 sweep file, $3 name: the sweep into juicytalk-results, its output and its store
  echo "== python3 -m orchestrator.cli sweep $2 --out juicytalk-results --no-progress --no-report at $(el) s"
  step "$3" "$1" python3 -m orchestrator.cli sweep "$2" --out juicytalk-results --no-progress --no-report
  tail -40 "$OUT/$3.txt"
  tar czf "$OUT/$3-store.tgz" -C juicytalk-results "$3"
}

if [ "${TESTS_S:-0}" -gt 0 ]; then
  # -v: each test's name and outcome as it ends, so a run cut by its timeout still says which failed
  whole=${TESTS_K:+no}
  echo "== python3 -m pytest -m gpu -n 4 -v -k '${TESTS_K:=not test_disturbance}' at $(el) s"
  # --timeout (pytest-timeout, on the host): a test that hangs fails with its stack instead of holding the run past
  # TESTS_S, where pytest is killed before its summary and every failure message with it
  step gpu-tests "$TESTS_S" python3 -m pytest -m gpu -n 4 -v -rfE -p no:cacheprovider --durations=15 tests \
    --timeout "${TEST_TIMEOUT_S:-150}" \
    --deselect tests/test_disturbance.py -k "$TESTS_K"
  # every FAILED/ERROR block whole (pytest's FAILURES and ERRORS sections), then the short summary and the rest
  sed -n '/^=* \(FAILURES\|ERRORS\) =*$/,/^=* short test summary info =*$/p' "$OUT/gpu-tests.txt" | head -400
  grep -v " PASSED " "$OUT/gpu-tests.txt" | sed -n '/^=* short test summary info =*$/,$p'
  grep -v " PASSED " "$OUT/gpu-tests.txt" | grep -v '^\(FAILED\|ERROR\) ' | grep -E '::|passed|failed' | tail -30
  if [ -z "$whole" ]; then
    echo "== python3 -m pytest -m gpu tests/test_disturbance.py (alone) at $(el) s"
    step gpu-disturbance 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_disturbance.py
    tail -5 "$OUT/gpu-disturbance.txt"
  fi
fi
if [ "${SEED_S:-0}" -gt 0 ]; then
  echo "== python3 benchmarks/sweep_start.py examples/seed.yaml --out /tmp/seed at $(el) s"
  step seed "$SEED_S" python3 benchmarks/sweep_start.py examples/seed.yaml --out /tmp/seed
  cat "$OUT/seed.txt"
fi
[ "${FULL_DEPTH_S:-0}" -gt 0 ] && sweep "$FULL_DEPTH_S" examples/full-depth.yaml full-depth
[ "${NUMERICS_S:-0}" -gt 0 ] && sweep "$NUMERICS_S" examples/fp8-numerics-shapes.yaml fp8-numerics-shapes
[ "${GRAPHS_S:-0}" -gt 0 ] && sweep "$GRAPHS_S" "${GRAPHS_FILE:-examples/full-depth-graphs.yaml}" full-depth-graphs
if [ "${LOSSES_S:-0}" -gt 0 ]; then
  echo "== python3 benchmarks/graph_losses.py examples/full-depth-graphs.yaml --only ${LOSSES_ONLY:=graphs} --layers ${LOSSES_LAYERS:=4} at $(el) s"
  # shellcheck disable=SC2086 # LOSSES_ONLY: substrings, one argument each
  step graph-losses "$LOSSES_S" python3 benchmarks/graph_losses.py examples/full-depth-graphs.yaml --only $LOSSES_ONLY \
    --layers "$LOSSES_LAYERS" --json "$OUT/graph-losses.json"
  cat "$OUT/graph-losses.txt"
fi
ROUNDS=${ROUNDS:-2}
if [ "${TE_PLAIN_S:-0}" -gt 0 ]; then
  echo "== python3 benchmarks/te_hf_loop.py --sweep ${PLAIN_FILE:=examples/full-depth.yaml} --only ${TE_ONLY:=te-} --rounds $ROUNDS at $(el) s"
  # shellcheck disable=SC2086 # TE_ONLY: substrings, one argument each
  step plain-te "$TE_PLAIN_S" python3 benchmarks/te_hf_loop.py --sweep "$PLAIN_FILE" --only $TE_ONLY \
    --rounds "$ROUNDS" --steps 8 --warmup 3 --json "$OUT/plain-te.json" ${KERNELS:+--kernels}
  cat "$OUT/plain-te.txt"
fi
if [ "${PLAIN_S:-0}" -gt 0 ]; then
  echo "== python3 benchmarks/hf_loop.py --sweep ${PLAIN_FILE:=examples/full-depth.yaml} --only ${PLAIN_ONLY:=L32-} --rounds $ROUNDS at $(el) s"
  # shellcheck disable=SC2086
  step plain "$PLAIN_S" python3 benchmarks/hf_loop.py --sweep "$PLAIN_FILE" --only $PLAIN_ONLY \
    --rounds "$ROUNDS" --steps 8 --warmup 3 --json "$OUT/plain-torch.json" ${KERNELS:+--kernels}
  cat "$OUT/plain.txt"
fi
echo "== done at $(el) s"

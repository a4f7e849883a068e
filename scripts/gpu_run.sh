#!/usr/bin/env bash
# One device call on an H200: GPU tests (kernels, engine CUDA graphs), sm90 gates at Qwen3-0.6B
# dimensions (kernel, whole-model and engine gates, native negative controls), and the kernel and
# engine benchmarks.
# Everything lands under $OUT; the gate artifacts travel as ONE tarball (a device call returns
# at most 8 files). Usage on the GPU machine (commit passed in: the copied tree has no .git):
#   OUT=/some/dir ISOEXEC_COMMIT=<sha> MODE=kernels|rl|gdn|rl_gdn|all [BENCHES="gemm attention ..."] bash scripts/gpu_run.sh
# To run exactly a committed tree while the working tree is being edited, extract `git archive
# HEAD` into an ignored folder, carry it and run this script from there.
# Wheels the GPU image lacks: run scripts/fetch_gpu_wheels.sh here first and carry .whl.
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=/tmp/step2
mkdir -p "$WORK/gates" "$WORK/bench" "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/isoexec_kernels
export PYTHONPATH="$PWD:/tmp/pp:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
MODE=${MODE:-all}
if [ "$MODE" = kernels ] || [ "$MODE" = all ]; then
SECONDS=0
python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/kernels tests/engine} -p no:cacheprovider > "$WORK/gpu_tests.log" 2>&1; echo "gpu tests rc=$? (${SECONDS}s)"
cp "$WORK/gpu_tests.log" "$OUT/"; SECONDS=0
tail -3 "$WORK/gpu_tests.log"
python3 -m isoexec.cli gates run --family dense --composition isoexec --arch sm90 --model dense_qwen3_0p6b \
  --out "$WORK/gates" --json > "$WORK/gates_summary.json" 2> "$WORK/gates.log"; echo "gates rc=$? (${SECONDS}s)"
grep -E "PASS|FAIL|INCONCLUSIVE|gates passed" "$WORK/gates.log" | tail -60
tar -C "$WORK" -czf "$OUT/gates.tgz" gates gates_summary.json gates.log gpu_tests.log
for b in ${BENCHES:-gemm attention rmsnorm logprob engine}; do
  SECONDS=0
  python3 -m isoexec.cli bench $b --out "$WORK/bench/$b.json" > "$WORK/bench/$b.log" 2>&1; echo "bench $b rc=$? (${SECONDS}s)"
  tail -4 "$WORK/bench/$b.log"
  tar -C "$WORK" -czf "$OUT/bench.tgz" bench  # after each bench: a run cut short still returns the finished ones
done
fi
if [ "$MODE" = rl ] || [ "$MODE" = rl_gdn ] || [ "$MODE" = all ]; then
  # DAPO runs, native vs IsoExec, with configs/h200.yaml's rl settings (no snakemake on the GPU machine)
  python3 - <<'PY'
import yaml
c = yaml.safe_load(open("configs/h200.yaml"))
import json, os
rl = dict(c["rl"]["settings"], synthetic=c["rl"].get("synthetic", {}), model=c["models"]["dense"], arch="sm90")
rl.update(json.loads(os.environ.get("RL_OVERRIDES") or "{}"))   # e.g. a shorter run when device time is short
yaml.safe_dump({"rl": rl}, open("/tmp/step2/rl_h200.yaml", "w"))
PY
  for comp in native isoexec; do
    SECONDS=0
    timeout ${RL_TIMEOUT:-1800} python3 -m isoexec.cli run --config /tmp/step2/rl_h200.yaml --composition $comp \
      --out "$WORK/runs/dense/$comp/seed0" > "$WORK/rl_$comp.log" 2>&1; echo "rl $comp rc=$? (${SECONDS}s)"
    tail -4 "$WORK/rl_$comp.log"
    tar -C "$WORK" --exclude=checkpoint.pt -czf "$OUT/runs.tgz" runs $(cd "$WORK" && ls rl_*.log)
  done
fi
if [ "$MODE" = gdn ] || [ "$MODE" = rl_gdn ] || [ "$MODE" = all ]; then
  # hybrid family: GDN core GPU tests (CPR parity, graphs) and the CPR per-layer benchmark
  SECONDS=0
  timeout ${GDN_TEST_TIMEOUT:-600} python3 -m pytest -q -m gpu tests/kernels/test_gdn_core.py -p no:cacheprovider \
    > "$WORK/gdn_tests.log" 2>&1; echo "gdn tests rc=$? (${SECONDS}s)"; tail -15 "$WORK/gdn_tests.log"
  cp "$WORK/gdn_tests.log" "$OUT/"; SECONDS=0
  timeout ${CPR_TIMEOUT:-600} python3 -m isoexec.cli bench cpr --out "$WORK/bench/cpr.json" > "$WORK/bench/cpr.log" 2>&1
  echo "bench cpr rc=$? (${SECONDS}s)"; tail -8 "$WORK/bench/cpr.log"
  tar -C "$WORK" -czf "$OUT/cpr.tgz" bench/cpr.json bench/cpr.log 2>/dev/null
fi

#!/usr/bin/env bash
# One device call on an H200: GPU tests (kernels, engine CUDA graphs), sm90 gates at Qwen3-0.6B
# dimensions (kernel, whole-model and engine gates, native negative controls), and the kernel and
# engine benchmarks.
# Everything lands under $OUT; the gate artifacts travel as ONE tarball (a device call returns
# at most 8 files). Usage on the GPU machine (commit passed in: the copied tree has no .git):
#   OUT=/some/dir ISOEXEC_COMMIT=<sha> bash scripts/gpu_run.sh
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
python3 -m pytest -q -m gpu tests/kernels tests/engine -p no:cacheprovider > "$WORK/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
tail -3 "$WORK/gpu_tests.log"
python3 -m isoexec.cli gates run --family dense --composition isoexec --arch sm90 --model dense_qwen3_0p6b \
  --out "$WORK/gates" --json > "$WORK/gates_summary.json" 2> "$WORK/gates.log"; echo "gates rc=$?"
grep -E "PASS|FAIL|INCONCLUSIVE|gates passed" "$WORK/gates.log" | tail -60
tar -C "$WORK" -czf "$OUT/gates.tgz" gates gates_summary.json gates.log gpu_tests.log
for b in gemm attention rmsnorm logprob engine; do
  python3 -m isoexec.cli bench $b --out "$WORK/bench/$b.json" > "$WORK/bench/$b.log" 2>&1; echo "bench $b rc=$?"
  tail -4 "$WORK/bench/$b.log"
done
tar -C "$WORK" -czf "$OUT/bench.tgz" bench

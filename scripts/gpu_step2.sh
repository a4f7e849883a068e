#!/usr/bin/env bash
# One device call for step 2 on an H200: GPU kernel tests, sm90 gates at Qwen3-0.6B dimensions
# (kernel + whole-model gates, native negative controls), and the four kernel benchmarks.
# Everything lands under $OUT (gates/, bench/, logs). Usage on the GPU machine:
#   OUT=/some/dir bash scripts/gpu_step2.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/gates" "$OUT/bench"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/isoexec_kernels
export PYTHONPATH="$PWD:/tmp/pp:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
python3 -m isoexec.cli gates run --family dense --composition isoexec --arch sm90 --model dense_qwen3_0p6b \
  --out "$OUT/gates" --json > "$OUT/gates_summary.json" 2> "$OUT/gates.log"; echo "gates rc=$?"
grep -E "PASS|FAIL|gates passed" "$OUT/gates.log" | tail -60
for b in gemm attention rmsnorm logprob; do
  python3 -m isoexec.cli bench $b --out "$OUT/bench/$b.json" > "$OUT/bench_$b.log" 2>&1; echo "bench $b rc=$?"
  tail -4 "$OUT/bench_$b.log"
done

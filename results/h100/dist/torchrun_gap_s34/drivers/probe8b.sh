# distributed path (torchrun world 1) vs one process at Qwen3-8B layer dimensions (4 layers), alternating
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=/tmp/w8; mkdir -p $W
python3 - <<'PY'
import json, yaml
c = yaml.safe_load(open("configs/h200.yaml"))
rl = dict(c["rl"]["settings"], synthetic=c["rl"].get("synthetic", {}), family="dense", model="dense_qwen3_8b_dims", arch="sm90")
rl.update(warmup_sft_steps=0, steps=6)
yaml.safe_dump({"rl": rl}, open("/tmp/w8/rl.yaml", "w"))
PY
for how in single torchrun1 single2 torchrun1b; do
  SECONDS=0
  case $how in single*) L="python3";; *) L="torchrun --standalone --nproc_per_node=1";; esac
  timeout 135 $L -m isoexec.cli run --config $W/rl.yaml --composition isoexec --out $W/$how > $W/$how.log 2>&1
  echo "rl $how rc=$? (${SECONDS}s)"; grep "^step\|warm-up" $W/$how.log | tail -8; nvidia-smi --query-gpu=memory.used --format=csv,noheader
  tar -C $W -czf $OUT/probe8b.tgz .
done

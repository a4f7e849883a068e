# torchrun world 1 with train.reshard_after_forward true / false vs one process, dense 0.6B and Qwen3-8B dims (4 layers)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=/tmp/wr; mkdir -p $W
for model in dense_qwen3_0p6b dense_qwen3_8b_dims; do
  for rs in true false; do
    MODEL=$model RS=$rs python3 - <<'PY'
import os, yaml
c = yaml.safe_load(open("configs/h200.yaml"))
rl = dict(c["rl"]["settings"], synthetic=c["rl"].get("synthetic", {}), family="dense", model=os.environ["MODEL"], arch="sm90")
rl.update(warmup_sft_steps=0, steps=6)
rl["train"] = dict(rl.get("train") or {}, reshard_after_forward=os.environ["RS"] == "true")
yaml.safe_dump({"rl": rl}, open(f"/tmp/wr/{os.environ['MODEL']}_{os.environ['RS']}.yaml", "w"))
PY
  done
  for how in single torchrun_true torchrun_false; do
    SECONDS=0
    case $how in single) L="python3"; cfg=$W/${model}_true.yaml;; *) L="torchrun --standalone --nproc_per_node=1"; cfg=$W/${model}_${how#torchrun_}.yaml;; esac
    timeout 110 $L -m isoexec.cli run --config $cfg --composition isoexec --out $W/$model/$how > $W/${model}_$how.log 2>&1
    echo "rl $model $how rc=$? (${SECONDS}s)"; grep "^step" $W/${model}_$how.log | tail -5 | sed 's/reward.*equal 100.00% |//'
    tar -C $W -czf $OUT/reshard_ab.tgz .
  done
done

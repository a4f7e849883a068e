# torchrun world-1 host gap: launcher vs distributed code path vs run order
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
which python python3 torchrun; head -1 $(which torchrun); ls -l $(which python3) $(which python)
DIST="TORCHELASTIC_RUN_ID=manual WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561"
for i in 1 2; do
  python3 launch_probe.py python3 | grep PROBE
  torchrun --standalone --nproc_per_node=1 launch_probe.py torchrun 2>&1 | grep PROBE
  torchrun --standalone --nproc_per_node=1 launch_probe.py torchrun_init --init 2>&1 | grep PROBE
  env $DIST python3 launch_probe.py python3_env_init --init 2>&1 | grep PROBE
done
python3 - <<'PY'
import json, yaml
c = yaml.safe_load(open("configs/h200.yaml"))
rl = dict(c["rl"]["settings"], synthetic=c["rl"].get("synthetic", {}), family="dense", model=c["models"]["dense"], arch="sm90")
rl.update(warmup_sft_steps=0, steps=int(__import__("os").environ.get("STEPS", "8")))
yaml.safe_dump({"rl": rl}, open("/tmp/w/rl.yaml", "w"))
PY
for how in single dist_env torchrun1 single2; do
  SECONDS=0
  case $how in
    single*) L="python3";;
    dist_env) L="env $DIST python3";;
    torchrun1) L="torchrun --standalone --nproc_per_node=1";;
  esac
  timeout 150 $L $([ $how = torchrun1 ] || echo "") -m isoexec.cli run --config /tmp/w/rl.yaml --composition isoexec --out $W/$how > $W/$how.log 2>&1
  echo "rl $how rc=$? (${SECONDS}s)"; grep "^step" $W/$how.log | tail -8
done
tar -C $W -czf $OUT/probe.tgz .

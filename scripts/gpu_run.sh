#!/usr/bin/env bash
# One device call on an H200, by MODE:
#   kernels  GPU tests (kernels, engine CUDA graphs), dense gates at Qwen3-0.6B dimensions (kernel,
#            whole-model and engine gates, native negative controls), the benchmarks in BENCHES
#   rl       native vs IsoExec DAPO runs for each family in RL_FAMILIES and composition in RL_COMPS
#            (configs/h200.yaml settings)
#   gdn      hybrid GPU tests (GDN_TESTS), the native chunk forward's comparison if NATIVE_SWEEP=1
#            (legacy vs WY vs CPR per stage, checked and profiled: native_sweep.json/.log), the CPR
#            kernel variant sweep if CPR_SWEEP=1, `bench cpr` (unless CPR_BENCH=0), hybrid gates at
#            Qwen3.5-9B layer dimensions (unless HYBRID_GATES=0)
#   speed    GPU tests in GPU_TESTS (default: the kernels whose backward is fast and deterministic),
#            the gates named in GATES_ONLY if set (`gates run --only`, dense at Qwen3-0.6B dims),
#            the benchmarks in BENCHES (default: train gemm), the GEMM tile sweep if SWEEP=1, the
#            attention tile sweep if ATTN_SWEEP=1, the engine decode profile if ENGINE_PROFILE=1
#   gates    the gate runs named in GATE_RUNS ("family:model ...", e.g. "hybrid_moe:hybrid_moe_qwen3p5_35b_a3b_dims"),
#            each under its own time limit and packed into gates_<family>.tgz as soon as it ends
#            (GATES_ONLY: a comma list passed to `gates run --only`, e.g. the gates a cut-short run left)
#   tp       on a machine of TP_GPUS GPUs (default: all it has; the nvidia-h200-x2 kind): the engine under
#            tensor parallelism over NCCL against one process (scripts/tp_engine_check.py: trainer
#            logits, engine tokens and logprobs, generate-then-verify, the all-reduce control, tok/s);
#            (TP_CHECK=0 skips it); TP_GATES=1 then runs the topology gates under torchrun on those GPUs
#            for each family:model of TP_GATE_RUNS (gates_<family>_tp<n>.tgz); TP_BENCH=1 then runs
#            `isoexec bench tp_dist` under torchrun on them (tp_dist_tp<n>.json/.log);
#            TP_GPUS=1 is the world-size-1 NCCL path on one GPU
#   rl_profile  one RL step of RL_FAMILIES' first family (configs/h200.yaml rl settings, composition
#            PROFILE_COMP, default isoexec; PROFILE_OVERRIDES: JSON over them, default no SFT warm-up)
#            under torch.profiler, first under `torchrun --nproc_per_node=1` (the distributed path),
#            then in one process (scripts/rl_step_profile.py: stage times, operator tables, threads,
#            garbage collections; rl_profile.tgz)
#   rl_gdn / all   both / everything
# Everything lands under $OUT as a few tarballs (a device call returns at most 8 files). Usage on
# the GPU machine (pass the commit: the copied tree's git metadata, if any, may be stale):
#   OUT=/some/dir ISOEXEC_COMMIT=<sha> MODE=kernels|rl|gdn|rl_gdn|all [BENCHES="gemm attention ..."] [RL_FAMILIES="dense hybrid"] bash scripts/gpu_run.sh
# To run exactly a committed tree while the working tree is being edited, extract `git archive
# HEAD` into an ignored folder, carry it and run this script from there.
# Wheels the GPU image lacks: run scripts/fetch_gpu_wheels.sh here first and carry .whl.
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=/tmp/step2
mkdir -p "$WORK/gates" "$WORK/bench" "$OUT"
write_rl_config() {
  # configs/h200.yaml's rl settings for family $1 (no snakemake on the GPU machine), the JSON
  # overrides $2 over them (may be empty), written as an `isoexec run` config to $3
  FAM=$1 OVERRIDES=$2 DEST=$3 python3 - <<'PY'
import json, os
import yaml
c = yaml.safe_load(open("configs/h200.yaml"))
fam = os.environ["FAM"]
rl = dict(c["rl"]["settings"], synthetic=c["rl"].get("synthetic", {}), family=fam, model=c["models"][fam], arch="sm90")
rl.update(json.loads(os.environ["OVERRIDES"] or "{}"))
yaml.safe_dump({"rl": rl}, open(os.environ["DEST"], "w"))
PY
}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1   # isoexec/ and isoexec_kernels/ import from the checkout
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
MODE=${MODE:-all}
if [ "$MODE" = speed ]; then
  SECONDS=0
  # every stage has its own time limit and packs its results as soon as it ends, so a stage cut
  # short never takes the finished ones with it (the whole call has at most 10 minutes)
  timeout ${GPU_TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/kernels/test_rmsnorm.py \
    tests/kernels/test_logprob.py tests/kernels/test_rope.py tests/kernels/test_gemm_backward.py \
    tests/kernels/test_embedding.py} -p no:cacheprovider > "$WORK/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? (${SECONDS}s)"
  tail -15 "$WORK/gpu_tests.log"; cp "$WORK/gpu_tests.log" "$OUT/"
  if [ -n "${GATES_ONLY:-}" ]; then
    SECONDS=0
    timeout ${GATES_TIMEOUT:-240} python3 -m isoexec.cli gates run --family dense --composition isoexec --arch sm90 \
      --model dense_qwen3_0p6b --only "$GATES_ONLY" --out "$WORK/gates" --json > "$WORK/gates_summary.json" 2> "$WORK/gates.log"
    echo "gates ($GATES_ONLY) rc=$? (${SECONDS}s)"; grep -E "PASS|FAIL|INCONCLUSIVE|gates passed" "$WORK/gates.log"
    tar -C "$WORK" -czf "$OUT/gates.tgz" gates gates_summary.json gates.log gpu_tests.log
  fi
  for b in ${BENCHES:-train gemm}; do
    SECONDS=0
    timeout ${BENCH_TIMEOUT:-240} python3 -m isoexec.cli bench $b --out "$WORK/bench/$b.json" > "$WORK/bench/$b.log" 2>&1
    echo "bench $b rc=$? (${SECONDS}s)"
    tail -${BENCH_TAIL:-30} "$WORK/bench/$b.log"
    tar -C "$WORK" -czf "$OUT/bench.tgz" bench
  done
  if [ "${SWEEP:-0}" = 1 ]; then
    SECONDS=0
    timeout ${SWEEP_TIMEOUT:-400} python3 scripts/gemm_tile_sweep.py ${SWEEP_ARGS:-} --out "$OUT/gemm_sweep.json" > "$WORK/sweep.log" 2>&1
    echo "gemm sweep rc=$? (${SECONDS}s)"; cp "$WORK/sweep.log" "$OUT/"; grep -v "^ " "$WORK/sweep.log" | tail -50
  fi
  if [ "${ENGINE_PROFILE:-0}" = 1 ]; then
    SECONDS=0
    timeout ${ENGINE_PROFILE_TIMEOUT:-180} python3 scripts/engine_profile.py ${ENGINE_PROFILE_ARGS:-} \
      > "$WORK/engine_profile.log" 2>&1
    echo "engine profile rc=$? (${SECONDS}s)"; cp "$WORK/engine_profile.log" "$OUT/"; grep "^====" "$WORK/engine_profile.log"
  fi
  if [ "${ATTN_SWEEP:-0}" = 1 ]; then
    SECONDS=0
    timeout ${ATTN_SWEEP_TIMEOUT:-420} python3 scripts/attention_tile_sweep.py ${ATTN_SWEEP_ARGS:-} --out "$OUT/attention_sweep.json" \
      > "$WORK/attention_sweep.log" 2>&1
    echo "attention sweep rc=$? (${SECONDS}s)"; cp "$WORK/attention_sweep.log" "$OUT/"; tail -40 "$WORK/attention_sweep.log"
  fi
fi
if [ "$MODE" = tp ]; then
  SECONDS=0
  n=${TP_GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
  if [ "${TP_CHECK:-1}" = 1 ]; then
    timeout ${TP_TIMEOUT:-480} torchrun --standalone --nproc_per_node=$n scripts/tp_engine_check.py \
      --out "$OUT/tp_engine_check.json" ${TP_ARGS:-} > "$WORK/tp_engine_check.log" 2>&1
    echo "tp engine check on $n GPUs rc=$? (${SECONDS}s)"; grep -v "^W[0-9]" "$WORK/tp_engine_check.log" | tail -15
    cp "$WORK/tp_engine_check.log" "$OUT/"
  fi
  if [ "${TP_GATES:-0}" = 1 ]; then
    # the topology gates (tp_trainer_logits, tp_trainer_logprobs, tp_engine_generate_verify + the
    # all-reduce control) at tp = the number of GPUs, for each family:model of TP_GATE_RUNS,
    # artifacts under gates_<family>_tp$n
    for run in ${TP_GATE_RUNS:-dense:dense_qwen3_0p6b}; do
      fam=${run%%:*}; model=${run#*:}; d="gates_${fam}_tp$n"; SECONDS=0; mkdir -p "$WORK/$d"
      timeout ${TP_GATES_TIMEOUT:-300} torchrun --standalone --nproc_per_node=$n -m isoexec.cli gates run --family "$fam" \
        --composition isoexec_tp4 --arch sm90 --model "$model" \
        --only tp_trainer_logits,tp_trainer_logprobs,tp_engine_generate_verify --out "$WORK/$d" --json \
        > "$WORK/${d}_summary.json" 2> "$WORK/$d.log"
      echo "topology gates $fam ($model) on $n GPUs rc=$? (${SECONDS}s)"; grep -E "PASS|FAIL|INCONCLUSIVE|gates passed|Error" "$WORK/$d.log"
      tar -C "$WORK" -czf "$OUT/$d.tgz" "$d" "${d}_summary.json" "$d.log"
    done
  fi
fi
if [ "$MODE" = tp ] && [ "${TP_BENCH:-0}" = 1 ]; then
  # the row-parallel linear and the vocabulary-parallel logprob against the stock all-reduce path
  SECONDS=0
  timeout ${TP_BENCH_TIMEOUT:-300} torchrun --standalone --nproc_per_node=$n -m isoexec.cli bench tp_dist \
    --out "$OUT/tp_dist_tp$n.json" > "$WORK/tp_dist_tp$n.log" 2>&1
  echo "bench tp_dist on $n GPUs rc=$? (${SECONDS}s)"; grep -v "^W[0-9]" "$WORK/tp_dist_tp$n.log" | tail -25
  cp "$WORK/tp_dist_tp$n.log" "$OUT/"
fi
if [ "$MODE" = gates ]; then
  for run in ${GATE_RUNS:-}; do
    fam=${run%%:*}; model=${run#*:}; SECONDS=0; mkdir -p "$WORK/gates_$fam"
    timeout ${GATES_TIMEOUT:-480} python3 -m isoexec.cli gates run --family "$fam" --composition isoexec --arch sm90 \
      --model "$model" ${GATES_ONLY:+--only "$GATES_ONLY"} --out "$WORK/gates_$fam" --json > "$WORK/gates_${fam}_summary.json" 2> "$WORK/gates_$fam.log"
    echo "gates $fam ($model) rc=$? (${SECONDS}s)"; grep -E "FAIL|gates passed" "$WORK/gates_$fam.log" | tail -20
    tar -C "$WORK" -czf "$OUT/gates_$fam.tgz" "gates_$fam" "gates_${fam}_summary.json" "gates_$fam.log"
  done
fi
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
  # DAPO runs, native vs IsoExec, with configs/h200.yaml's rl settings (no snakemake on the GPU
  # machine), for each family in RL_FAMILIES (default: dense)
  for fam in ${RL_FAMILIES:-dense}; do
    write_rl_config $fam "${RL_OVERRIDES:-}" /tmp/step2/rl_h200_$fam.yaml   # e.g. a shorter run when device time is short
    for comp in ${RL_COMPS:-native isoexec}; do
      SECONDS=0
      # RL_NPROC=n: the run under `torchrun --nproc_per_node=n` (n = 1: the distributed code path,
      # FSDP2 trainer and NCCL collectives, on one GPU)
      timeout ${RL_TIMEOUT:-1800} ${RL_NPROC:+torchrun --standalone --nproc_per_node=$RL_NPROC} \
        $([ -n "${RL_NPROC:-}" ] || echo python3) -m isoexec.cli run --config /tmp/step2/rl_h200_$fam.yaml --composition $comp \
        --out "$WORK/runs/$fam/$comp/seed0" > "$WORK/rl_${fam}_$comp.log" 2>&1; echo "rl $fam $comp rc=$? (${SECONDS}s)"
      tail -4 "$WORK/rl_${fam}_$comp.log"
      tar -C "$WORK" --exclude=checkpoint.pt -czf "$OUT/runs.tgz" runs $(cd "$WORK" && ls rl_*.log)
    done
  done
fi
if [ "$MODE" = rl_profile ]; then
  fam=$(echo ${RL_FAMILIES:-dense} | cut -d" " -f1)
  overrides='{"warmup_sft_steps": 0}'; [ -z "${PROFILE_OVERRIDES:-}" ] || overrides=$PROFILE_OVERRIDES
  write_rl_config $fam "$overrides" /tmp/step2/rl_profile_$fam.yaml
  mkdir -p "$WORK/rl_profile"
  for how in torchrun1 single; do
    SECONDS=0
    # the torchrun call needs the longer limit: torch.profiler builds its tables slowly there
    timeout ${PROFILE_TIMEOUT:-250} $([ $how = torchrun1 ] && echo "torchrun --standalone --nproc_per_node=1" || echo python3) \
      scripts/rl_step_profile.py --config /tmp/step2/rl_profile_$fam.yaml --composition ${PROFILE_COMP:-isoexec} \
      --steps ${PROFILE_STEPS:-3} --out "$WORK/rl_profile/$how" > "$WORK/rl_profile/$how.log" 2>&1
    echo "rl profile $fam $how rc=$? (${SECONDS}s)"; grep -A20 "^==== " "$WORK/rl_profile/$how.log" | grep -v "^  .*aten::" | head -24
    tar -C "$WORK" -czf "$OUT/rl_profile.tgz" rl_profile
  done
fi
if [ "$MODE" = gdn ] || [ "$MODE" = rl_gdn ] || [ "$MODE" = all ]; then
  # hybrid family: GDN GPU tests (CPR parity, conv/prep/norm kernels, hybrid engine graphs), the
  # CPR per-layer benchmark, then the hybrid gates at Qwen3.5-9B layer dimensions
  SECONDS=0
  timeout ${GDN_TEST_TIMEOUT:-600} python3 -m pytest -q -m gpu ${GDN_TESTS:-tests/kernels/test_gdn_core.py \
    tests/kernels/test_gdn_native_wy.py tests/kernels/test_gdn_chunk_backward.py tests/kernels/test_gdn_conv.py tests/kernels/test_gdn_prep.py \
    tests/kernels/test_gated_rmsnorm.py tests/engine/test_hybrid_engine.py tests/engine/test_hybrid_engine_cpr4.py} -p no:cacheprovider > "$WORK/gdn_tests.log" 2>&1; echo "gdn tests rc=$? (${SECONDS}s)"; tail -15 "$WORK/gdn_tests.log"
  cp "$WORK/gdn_tests.log" "$OUT/"
  if [ "${NATIVE_SWEEP:-0}" = 1 ]; then
    SECONDS=0
    timeout ${NATIVE_SWEEP_TIMEOUT:-360} python3 scripts/cpr_variant_sweep.py --native --out "$OUT/native_sweep.json" \
      > "$WORK/native_sweep.log" 2>&1
    echo "native sweep rc=$? (${SECONDS}s)"; cp "$WORK/native_sweep.log" "$OUT/"; grep -v "^ \|profiler\|^USDT" "$WORK/native_sweep.log" | tail -20
  fi
  if [ "${CPR_SWEEP:-0}" = 1 ]; then
    SECONDS=0
    timeout ${CPR_SWEEP_TIMEOUT:-360} python3 scripts/cpr_variant_sweep.py --out "$OUT/cpr_sweep.json" > "$WORK/cpr_sweep.log" 2>&1
    echo "cpr sweep rc=$? (${SECONDS}s)"; cp "$WORK/cpr_sweep.log" "$OUT/"; grep -v "^ \|profiler" "$WORK/cpr_sweep.log" | tail -20
  fi
  SECONDS=0
  [ "${CPR_BENCH:-1}" = 0 ] || timeout ${CPR_TIMEOUT:-600} python3 -m isoexec.cli bench cpr --out "$WORK/bench/cpr.json" > "$WORK/bench/cpr.log" 2>&1
  echo "bench cpr rc=$? (${SECONDS}s)"; tail -8 "$WORK/bench/cpr.log"
  tar -C "$WORK" -czf "$OUT/cpr.tgz" bench/cpr.json bench/cpr.log 2>/dev/null
  if [ -n "${HYBRID_GATES:-1}" ] && [ "${HYBRID_GATES:-1}" != 0 ]; then
    SECONDS=0; mkdir -p "$WORK/gates_hybrid"
    timeout ${HYBRID_GATES_TIMEOUT:-900} python3 -m isoexec.cli gates run --family hybrid --composition isoexec --arch sm90 \
      --model ${HYBRID_GATES_MODEL:-hybrid_qwen3p5_9b_dims} --out "$WORK/gates_hybrid" --json > "$WORK/gates_hybrid_summary.json" \
      2> "$WORK/gates_hybrid.log"; echo "hybrid gates rc=$? (${SECONDS}s)"
    grep -E "FAIL|gates passed" "$WORK/gates_hybrid.log" | tail -20
    tar -C "$WORK" -czf "$OUT/gates_hybrid.tgz" gates_hybrid gates_hybrid_summary.json gates_hybrid.log
  fi
fi

# Shared settings and path helpers of the workflow (no rules here: the linter wants functions and
# rules in separate files). Everything below is derived from the validated config. Nothing here
# imports the isoexec package (it would load torch into the Snakemake process): the jobs run the
# `isoexec` command (shell:) or a script of workflow/scripts/ (script:), docs/workflow.md.

import json
import os
import re
import shutil
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

SCRIPTS = Path(workflow.current_basedir).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import code_version as _codever  # noqa: E402 - workflow/scripts/code_version.py
import launch as _launch  # noqa: E402 - workflow/scripts/launch.py

# The software every job needs: the project's conda environment (the isoexec package and its
# dependencies), used when Snakemake deploys software itself (--software-deployment-method conda);
# otherwise the jobs run the `isoexec` of the environment Snakemake runs in.
CONDA_ENV = "../../environment.yml"

RUN = config["run_name"]
ARCH = config["arch"]
FAMILIES = list(config["families"])
COMPOSITIONS = list(config["compositions"])
GATE_COMPOSITION = config["gates"]["composition"]
GATE_SEED = int(config["gates"]["seed"])
# GPUs per GPU job (gates, bench, rl_run): one on a GPU arch, none on cpu. Locally each such job
# gets its own device (workflow/scripts/gpus.py); the SLURM profile turns it into --gpus.
JOB_GPUS = 0 if ARCH == "cpu" else 1
# An RL run (the rl_run jobs) on a GPU arch spans `nodes` nodes with `gpus` GPUs on each (per node,
# as torchrun's --nproc_per_node): with more than one GPU it runs under torchrun, one data-parallel
# rank per GPU, and with more than one node srun starts one torchrun per node of its SLURM job
# (workflow/scripts/launch.py, docs/scale_out.md); on cpu one process.
RL_NODES = _launch.rl_nodes(config)
RL_WORLD = _launch.rl_world(config)
RL_GPUS = JOB_GPUS * RL_WORLD
# the dry run shows the command of a multi-rank run (a script rule shows none of its own)
RL_RUN_MESSAGE = (f"rl_run {{wildcards.family}} {{wildcards.arm}} seed {{wildcards.seed}} on "
                  + (f"{RL_NODES} nodes x {RL_WORLD // RL_NODES} GPUs: " if RL_NODES > 1 else f"{RL_WORLD} GPUs: ")
                  + _launch.shown_launcher(RL_WORLD, RL_NODES) + " run --config {output}/rl_config.json --out {output}"
                  # a job with a message shows no resources line of its own: what it asks the scheduler for
                  + ("\n    resources: nodes={resources.nodes}, gres={resources.gres}, tasks={resources.tasks}, "
                     "mpi={resources.mpi}, gpu={resources.gpu}, runtime={resources.runtime}" if RL_NODES > 1 else "")
                  if RL_WORLD > 1 else None)
# What an rl_run job asks the scheduler for, besides runtime (and the profile's memory and CPUs).
# One node: `gpu` GPUs, counted by Snakemake locally (--resources gpu=N) and submitted as --gpus=N
# by the SLURM executor plugin, and `nodes` 1 (--nodes=1: --gpus counts the whole job's GPUs, which
# SLURM could otherwise spread over nodes that --standalone cannot reach). More nodes, in the
# plugin's resource names:
#   nodes          --nodes=<nodes>
#   gres           --gres=gpu:<gpus>, which SLURM counts per node; the plugin's `gpu` (--gpus) is a
#                  count over the whole job that SLURM may spread unevenly, so `gpu` is 0 here (and
#                  the job script then locks no device of its own: srun hands each node's out)
#   mpi            the launcher the job runs itself: with it the plugin's job step runs the job
#                  on the first node as it is, not inside an `srun -n1` step of one node, so that
#                  the job's own srun can start a task on every node
#   tasks          one per node (--ntasks; the plugin wants a task count with `mpi`)
#   tasks_per_gpu  0: no --ntasks-per-gpu, which would ask for a task per GPU
RL_RUN_RESOURCES = ({"gpu": 0, "nodes": RL_NODES, "gres": f"gpu:{RL_WORLD // RL_NODES}", "mpi": "srun",
                     "tasks": RL_NODES, "tasks_per_gpu": 0}
                    if RL_NODES > 1 else {"gpu": RL_GPUS, "nodes": 1})

# Threads per job. On cpu a job's whole work is torch on tiny models, whose ops are too small to
# split: a second intra-op thread only adds fork-join and spin-waits (on a 2-core Xeon the dense
# gates took 329 s with two threads beside other load, 41 s with one), so every job gets one thread
# (OMP_NUM_THREADS, workflow/scripts/jobutil.py) and Snakemake runs as many jobs at once as there
# are cores. On a GPU arch the rules' threads are the host threads feeding the GPU.
def job_threads(gpu_arch_threads):
    return 1 if ARCH == "cpu" else gpu_arch_threads


# The jobs that lead to the RL runs (contracts, gates, data; the runs are the longest jobs) go
# before the benchmarks, which only feed the kernels table and fill the cores left idle.
RL_PATH_PRIORITY = 1


RES = f"{config['results_dir']}/{RUN}"
FIG = f"{config['figures_dir']}/{RUN}"
LOGS = f"{RES}/logs"

# The CLI is given compositions and models by name (their names end up in gate artifacts, and the
# gate runner tells native from isoexec by name); make it resolve those names in this workflow's
# configs/ folder, the same files the rules declare as inputs.
os.environ.update(ISOEXEC_CONFIGS=str(Path("configs").resolve()))
# shell: jobs call `isoexec`; when the environment it is installed in is not activated, find it
# beside the Python that runs Snakemake (last on PATH, so an `isoexec` already on PATH wins).
if shutil.which("isoexec") is None:
    os.environ.update(PATH=os.pathsep.join(p for p in (os.environ.get("PATH"), str(Path(sys.executable).parent)) if p))

# Code version (docs/workflow.md): a hash of the isoexec and kernel sources, written while the
# workflow is parsed and only when it changed; every rule that runs package code takes the file as
# an input, so an edit to the package or the kernels reruns those jobs, and nothing else does.
# Written by write_code_version() at the end of the Snakefile, after every config check, so that a
# refused config leaves nothing behind.
CODE_VERSION = f"{RES}/code_version.txt"


def write_code_version():
    try:
        _codever.write_if_changed(CODE_VERSION, _codever.version_text(_codever.package_dirs()))
    except RuntimeError as exc:
        raise WorkflowError(f"code version: {exc}") from None


_no_model = [f for f in FAMILIES if f not in config["models"]]
if _no_model:
    raise WorkflowError(
        f"config: `models` has no entry for famil{'y' if len(_no_model) == 1 else 'ies'} "
        f"{', '.join(_no_model)}; add e.g. `models: {{{_no_model[0]}: <name in configs/models/ or a YAML path>}}`"
    )

wildcard_constraints:
    family="|".join(map(re.escape, FAMILIES)),
    composition="|".join(map(re.escape, sorted(set(COMPOSITIONS) | {GATE_COMPOSITION}))),


def model_name(family):
    """What the CLI gets for --model: a name in configs/models/ or a YAML path, as configured."""
    return config["models"][family]


def _model_yaml(name):
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return name
    return f"configs/models/{name}.yaml"


def model_file(wildcards):
    """The model config YAML of a family (declared as an input, so editing it reruns the jobs)."""
    return _model_yaml(model_name(wildcards.family))


# The gates rule's model per family: `gates.models.<family>` where set (a model with the run model's
# layer dimensions and fewer layers, for a run model whose whole-model gates do not fit one GPU; the
# Snakefile checked that the dimensions agree: admission matches gate results by region, kernel and
# constants, not by model), else the family's `models` entry.
GATE_MODELS = dict(config["gates"].get("models") or {})


def gate_model_name(family):
    return GATE_MODELS.get(family) or model_name(family)


def gate_model_file(wildcards):
    return _model_yaml(gate_model_name(wildcards.family))


def composition_file(wildcards):
    return f"configs/compositions/{wildcards.composition}.yaml"


def gate_composition_file(wildcards):
    return f"configs/compositions/{GATE_COMPOSITION}.yaml"


def contract_path(family, composition, kind):
    """results/<run>/contracts/<family>/<composition><kind>.json; kind "" is the final contract."""
    return f"{RES}/contracts/{family}/{composition}{kind}.json"


def gates_dir(family):
    return f"{RES}/gates/{family}"


def gate_run_record(family):
    return f"{RES}/gate_runs/{family}.json"


def build_args(wildcards):
    """`isoexec contract build` arguments shared by the draft and the admitted build (no --out)."""
    return ["contract", "build", "--family", wildcards.family, "--composition", wildcards.composition,
            "--model", model_name(wildcards.family), "--arch", ARCH]


def gate_runs():
    """(record, artifact folder) per family, in config order: the gates table's input."""
    return [(gate_run_record(f), gates_dir(f)) for f in FAMILIES]


def contract_items():
    """Per family x composition: the records the contracts table reads."""
    return [{"family": f, "composition": c, "show": contract_path(f, c, ".show"),
             "verify": contract_path(f, c, ".verify"), "admission": contract_path(f, c, ".admission"),
             "gate_run": gate_run_record(f)}
            for f in FAMILIES for c in COMPOSITIONS]


def contract_inputs(wildcards):
    paths = [p for it in contract_items() for k, p in it.items() if k not in ("family", "composition")]
    return list(dict.fromkeys(paths))


BENCHES = list(config["benchmarks"]["names"])
BENCH_QUICK = bool(config["benchmarks"]["quick"])


def bench_path(name):
    return f"{RES}/bench/{name}.json"


RL_CONF = dict(config.get("rl") or {})
RL_SEEDS = list(RL_CONF.get("seeds", [0]))
RL_ON = bool(RL_CONF.get("enabled", False))
# `--config resume=true`: RL runs continue from their checkpoints instead of starting clean
# (workflow/scripts/rl_run.py). Read here and by the job script, never a param: switching it on
# must not count as a change of the runs.
RL_RESUME = config.get("resume", False) in (True, "true")
config["resume"] = RL_RESUME   # a boolean for the job scripts ("true" from --config is a string)


# Arms run side by side (e.g. native, native + token TIS, native + TIS + K3 rejection, IsoExec):
# name -> {composition, settings overrides}; by default one arm per composition, named after it.
RL_ARMS = {name: {"composition": a["composition"], "settings": dict(a.get("settings") or {})}
           for name, a in (RL_CONF.get("arms") or {c: {"composition": c} for c in COMPOSITIONS}).items()}
_arm_comps = sorted({a["composition"] for a in RL_ARMS.values()} - set(COMPOSITIONS))
if RL_ON and _arm_comps:
    raise WorkflowError(f"config: rl.arms use composition(s) {', '.join(_arm_comps)} that are not in "
                        f"`compositions` (no contract is built for them); add them there")

wildcard_constraints:
    arm="|".join(map(re.escape, RL_ARMS)) or "(?!)",


def arm_composition(arm):
    return RL_ARMS[arm]["composition"]


def rl_contract(wildcards):
    return contract_path(wildcards.family, arm_composition(wildcards.arm), "")


def _merged(base, over):
    """`over` on top of `base`; mappings (train, engine, ...) merged key by key, so an arm that sets
    one train key keeps the shared learning rate."""
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Settings overrides per family (`rl.family_settings`; e.g. trainer_ep for the families with routed
# experts only), applied between `rl.settings` and an arm's.
RL_FAMILY_SETTINGS = {f: dict(s or {}) for f, s in (RL_CONF.get("family_settings") or {}).items()}


def arm_settings(family, arm):
    """`rl.settings`, then the family's overrides, then the arm's (mappings merged key by key)."""
    return _merged(_merged(RL_CONF.get("settings") or {}, RL_FAMILY_SETTINGS.get(family, {})),
                   RL_ARMS[arm]["settings"])


def rl_dataset():
    """The data set every run (and warm-up) reads: the workflow's synthetic parquet, or rl.dataset."""
    if RL_CONF.get("dataset", "synthetic") == "synthetic":
        return str(Path(f"{RES}/data/synthetic.parquet").resolve())
    return RL_CONF["dataset"]


# The shared warm-up (the rl_warmup job, `isoexec warmup`; docs/workflow.md) - a family without real
# weights warms its random model up once per seed, with the native composition, and every arm of
# that family and seed starts from the warmed model (a checkpoint folder). These are the settings it
# reads (besides family, model, arch, seed and the data set), as isoexec/rl/warmup.py states them
# (WARMUP_KEYS, WARMUP_TRAIN_KEYS; a test keeps the two equal): they are the warm-up job's params,
# so a change to one of them reruns the warm-up and, through it, the runs, and nothing else does.
WARMUP_COMPOSITION = "native"
WARMUP_KEYS = ("dtype", "tokenizer", "prompt_style", "max_prompt_tokens", "warmup_sft_steps", "warmup_batch_size")
WARMUP_TRAIN_KEYS = ("lr", "betas", "eps", "weight_decay", "grad_clip", "micro_batch_tokens", "seed")


def _warmup_view(s):
    """What the warm-up reads of one arm's settings."""
    out = {k: s[k] for k in WARMUP_KEYS if k in s}
    out["train"] = {k: v for k, v in (s.get("train") or {}).items() if k in WARMUP_TRAIN_KEYS}
    return out


# per family: the warm-up's settings -> the arms that have them (one entry a family; more are
# refused, _rl_refusals). Families may differ (rl.family_settings): each has warm-ups of its own.
_WARMUP_VIEWS = {f: {} for f in FAMILIES}
for _family in FAMILIES:
    for _arm in RL_ARMS:
        _WARMUP_VIEWS[_family].setdefault(json.dumps(_warmup_view(arm_settings(_family, _arm)), sort_keys=True),
                                          []).append(_arm)


def warmup_view(family):
    """The settings the warm-up of `family` reads (those of its first arm; arms that differ are refused)."""
    views = _WARMUP_VIEWS.get(family) or {}
    return json.loads(next(iter(views))) if views else {}


def _random_weights(family):
    """The runs of `family` start from random weights: no `checkpoints.<family>`, and no checkpoint in
    the RL settings (both are loaded as they are, without a warm-up), and no rl.require_checkpoints
    (under which a run has real weights or does not start)."""
    return (RL_ON and not (config.get("checkpoints") or {}).get(family)
            and not RL_CONF.get("require_checkpoints", False)
            and not any(arm_settings(family, a).get("checkpoint") for a in RL_ARMS))


def warmup_applies(family):
    """A shared warm-up for `family`: random weights and warmup_sft_steps > 0."""
    return _random_weights(family) and int(warmup_view(family).get("warmup_sft_steps", 0)) > 0


def warmup_dir(family, seed):
    return f"{RES}/warmup/{family}/seed{seed}"


def warmup_settings(wildcards):
    """The RL settings `isoexec warmup` gets: those the warm-up reads, and the run's identity (no
    composition: the warm-up runs the native one)."""
    return {**warmup_view(wildcards.family), "family": wildcards.family, "model": model_name(wildcards.family),
            "arch": ARCH, "seed": int(wildcards.seed), "dataset": rl_dataset()}


def rl_warmup_input(wildcards):
    return [warmup_dir(wildcards.family, wildcards.seed)] if warmup_applies(wildcards.family) else []


def rl_settings(wildcards):
    """The RLConfig of one run: `rl.settings` with the family's and the arm's overrides, the run's
    identity filled in."""
    comp = arm_composition(wildcards.arm)
    s = arm_settings(wildcards.family, wildcards.arm)
    s.update(family=wildcards.family, composition=comp, model=model_name(wildcards.family),
             arch=ARCH, seed=int(wildcards.seed),
             contract=str(Path(contract_path(wildcards.family, comp, "")).resolve()))
    s["dataset"] = rl_dataset()
    ckpt = (config.get("checkpoints") or {}).get(wildcards.family)
    if ckpt:  # real weights: the checkpoint's own tokenizer, no warm-up
        s.update(checkpoint=ckpt, tokenizer=ckpt, warmup_sft_steps=0)
    elif warmup_applies(wildcards.family):   # the shared warm-up's folder: the run loads it, no warm-up of its own
        s["checkpoint"] = str(Path(warmup_dir(wildcards.family, wildcards.seed)).resolve())
    return s


def _rl_missing():
    """What the RL runs wait for that is simply not there yet (empty: nothing): with
    rl.require_checkpoints a `checkpoints.<family>` for every family, and the rl.dataset file unless
    it is `synthetic`. A dry run shows the plan without them; a real run refuses."""
    out = []
    ckpts = config.get("checkpoints") or {}
    if RL_CONF.get("require_checkpoints", False):
        out += [f"checkpoints.{f} is not set (rl.require_checkpoints: true; random weights and a character "
                "tokenizer are not the paper's setup)" for f in FAMILIES if not ckpts.get(f)]
    ds = RL_CONF.get("dataset", "synthetic")
    if ds != "synthetic" and not Path(ds).exists():
        out.append(f"rl.dataset {ds!r} does not exist (download DAPO-Math-17k, verl parquet schema, to that path)")
    return out


def _rl_refusals():
    """Why the RL runs cannot start as configured, whatever is downloaded (empty: they can): a
    checkpoint named anywhere must be a folder with a config.json; the shared warm-up: every arm must
    have the settings it reads."""
    out = []
    ckpts = config.get("checkpoints") or {}
    for f in FAMILIES:
        path = ckpts.get(f)
        if path and not (Path(path) / "config.json").is_file():
            out.append(f"checkpoints.{f} {path!r} is not a Hugging Face checkpoint folder (no config.json)")
    differing = {}   # (the arms' grouping, the keys) -> the families whose arms differ so
    for f in FAMILIES:
        views = [json.loads(v) for v in _WARMUP_VIEWS[f]]
        if not (len(views) > 1 and _random_weights(f) and any(int(v.get("warmup_sft_steps", 0)) > 0 for v in views)):
            continue

        def differs(get):
            return len({json.dumps(get(w)) for w in views}) > 1

        keys = sorted({k for v in views for k in v if k != "train" and differs(lambda w: w.get(k))}
                      | {f"train.{k}" for v in views for k in v["train"] if differs(lambda w: w["train"].get(k))})
        groups = " vs ".join(", ".join(a) for a in _WARMUP_VIEWS[f].values())
        differing.setdefault((groups, ", ".join(keys)), []).append(f)
    for (groups, keys), fams in differing.items():
        which = "" if len(fams) == len(FAMILIES) else f" ({', '.join(fams)})"
        out.append(f"rl.arms {groups} differ in {keys}{which}, which the supervised warm-up reads (one warm-up per "
                   "family and seed, shared by every arm); set them in rl.settings or rl.family_settings")
    return out


def _dry_run_requested():
    """Whether Snakemake was started as a dry run (`-n`, alone or among other one-letter flags such as
    `-np`, or `--dry-run`). The executor that knows it is not chosen yet while the Snakefile is read,
    so the command line is asked; anything else, a run through Snakemake's Python API included,
    counts as a real run, which refuses what is missing."""
    for a in sys.argv[1:]:
        if a in ("--dry-run", "--dryrun", "--just-print") or (
                a.startswith("-") and not a.startswith("--") and a[1:].isalpha() and "n" in a[1:]):
            return True
    return False


DRY_RUN = _dry_run_requested()
if RL_ON and (_why := ([] if DRY_RUN else _rl_missing()) + _rl_refusals()):
    raise WorkflowError("config: the RL runs cannot start: " + "; ".join(_why)
                        + "; fill these in, or set rl.enabled: false to run only the contracts and gates")
if RL_ON and DRY_RUN and (_waiting := _rl_missing()):
    # a dry run previews the plan the runs will have once their inputs are there (the launch commands
    # of a multi-GPU config among it); the real run refuses above until then
    print("config: the RL runs cannot start yet: " + "; ".join(_waiting) + "; this dry run shows the plan they "
          "will have; a real run refuses until these are filled in (or set rl.enabled: false)", file=sys.stderr)


def rl_data_input(wildcards):
    return [f"{RES}/data/synthetic.parquet"] if RL_CONF.get("dataset", "synthetic") == "synthetic" else []


def rl_run_dir(family, arm, seed):
    return f"{RES}/runs/{family}/{arm}/seed{seed}"


def rl_run_output():
    """The run folder, a directory output: removed by Snakemake before the job (a clean start), or,
    with `--config resume=true`, kept for the run to continue from its checkpoint (update())."""
    out = directory(rl_run_dir("{family}", "{arm}", "{seed}"))
    return update(out) if RL_RESUME else out


def rl_run_outputs():
    return [rl_run_dir(f, a, s) for f in FAMILIES for a in RL_ARMS for s in RL_SEEDS]


def final_targets():
    out = [f"{FIG}/gates.md", f"{FIG}/gates.csv", f"{FIG}/contracts.md", f"{FIG}/contracts.csv"]
    if BENCHES:
        out += [f"{FIG}/kernels.md", f"{FIG}/kernels.csv"]
    if "cpr" in BENCHES:
        out += [f"{FIG}/cpr.md"]
    if RL_ON:
        out += [f"{FIG}/logprob_diff.md", f"{FIG}/step_time.md", f"{FIG}/runs.csv", f"{FIG}/logprob_diff.png",
                f"{FIG}/step_time.png"]
    return out

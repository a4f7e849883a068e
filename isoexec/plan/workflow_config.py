"""What a workflow config asks each GPU to hold: one ``RunShape`` per family and distinct arm.

The config is read as the workflow reads it, so the plan is of the runs Snakemake would start:

1. the Snakefile's ``configfile: configs/config.yaml`` first, then the given file merged over it key
   by key (Snakemake's ``update_config``: mappings merged, everything else replaced), which is what
   ``snakemake --configfile FILE`` does; so a key the file leaves out has the embedded default's
   value, as the configs' own comments say;
2. checked against the workflow's schema (``workflow/schemas/config.schema.yaml``, which refers to the
   package's RL schema for ``rl.settings``), its defaults filled in for the keys read here;
3. per family and arm (``rl.arms``, by default one per composition), the settings a run gets
   (``rl.settings``, then the family's ``rl.family_settings`` overrides, then the arm's, as
   ``workflow/rules/common.smk: arm_settings``), checked by ``RLConfig.from_dict``; the engine it
   builds is ``rl.loop.engine_config``; the page size and GDN chunk are those of the arm's contract.

``gpus`` (per node) times ``nodes`` is the data-parallel size of the trainer (FSDP2). The engine is whole on every GPU, or,
with ``engine_tp: t`` in a run's settings (any family), sharded over t GPUs: its weights are
the largest rank's shards (``tensor_parallel.rank_parameter_count``), its KV pages hold
``num_kv_heads / t`` heads and its recurrent-state slots ``1 / t`` of the value heads and conv channels.
With ``trainer_ep: e`` (the MoE families, e.g. in ``rl.family_settings``) the trainer is the
expert-parallel one: the routed experts over groups of e GPUs (``expert_slices``), the rest sharded
by FSDP2 over every GPU.
Settings either run would refuse are refused here by the run's own checks: ``check_trainer_ep``
(e must divide the world, and a one-process run has no experts to deal) and, as
``ExpertParallelTrainer`` does before its meshes, ``ep_moe.check_ep`` on the model with the arm's
contract installed (the contract's ep claim, more ranks than routed experts); ``RLConfig`` refuses a
family without routed experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..compose import build_contract, load_model_config
from ..enforce import RuntimeFacts, check_topology
from ..engine.engine import contract_page_size
from ..errors import ConfigError, IsoExecError
from ..model import FAMILY_MODELS
from ..model.ep_moe import check_ep
from ..model.hybrid import contract_gdn_chunk, contract_gdn_chunk_form
from ..model.tensor_parallel import tp_serving_problems
from ..model_config import FAMILY_CONFIGS, HybridConfig
from ..paths import configs_dir
from ..rl.distributed import check_engine_tp, check_trainer_ep, check_world
from ..rl.loop import RLConfig, engine_config, kv_page
from ..rl.warmup import resolved_dtype
from ..train.trainer import TrainConfig
from ..yamlio import check_schema, load_yaml

#: The Snakefile's own config file, the base a --configfile is merged over.
EMBEDDED_CONFIG = "config.yaml"
#: The workflow's schema, in the checkout this package belongs to.
WORKFLOW_SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


@dataclass(frozen=True)
class RunShape:
    """Everything the plan of one family's run depends on."""

    family: str
    model: str                      # as configured: a name in configs/models/ or a path
    cfg: object                     # the family's model_config class, from the model YAML
    arms: tuple[str, ...]
    dtype: str                      # "bfloat16" | "float32"
    dp: int
    engine_tp: int                  # the engine's tensor-parallel size (1: whole on every GPU)
    num_pages: int
    page_size: int
    num_state_slots: int            # 0 for families without recurrent state
    gdn_chunk: int
    max_num_seqs: int
    max_num_batched_tokens: int
    micro_batch_budget: int         # TrainConfig.micro_batch_tokens
    longest_sequence: int           # max_prompt_tokens + max_response_tokens
    activation_checkpointing: bool = False   # TrainConfig.activation_checkpointing
    reshard_after_forward: bool = True       # TrainConfig.reshard_after_forward (FSDP2, dp > 1)
    trainer_ep: int = 1             # the trainer's expert-parallel size (1: the experts sharded by FSDP2)
    gdn_chunk_form: bool = False    # the GDN core is a chunk-form impl (CPR version 4: larger state slots)

    def plan_key(self) -> tuple:
        """Arms with equal keys get one row (their numbers are the same)."""
        return tuple(v for k, v in self.__dict__.items() if k != "arms")


@dataclass
class WorkflowPlan:
    path: str
    run_name: str
    arch: str
    gpus: int                       # per node
    rl_enabled: bool
    merged_over: str | None
    shapes: list[RunShape] = field(default_factory=list)
    nodes: int = 1
    gpu_memory_gib: float | None = None     # the config's `gpu_memory_gib`: one GPU's memory (None: not set)

    @property
    def dp(self) -> int:
        """The trainer's data-parallel size: every GPU of every node one rank."""
        return self.gpus * self.nodes


def merge_config(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, as Snakemake's ``update_config``: mappings merged key by key,
    any other value replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge_config(out[k] if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


def _mapping(path: str, what: str) -> dict:
    data = load_yaml(path, what)
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r} must be a mapping of keys to values, got {type(data).__name__}")
    return data


def _default(schema: dict, *keys: str):
    node = schema
    for k in keys:
        node = node["properties"][k]
    return node.get("default")


def check_trainer_ep_topology(family: str, cfg, contract, arch: str, ep: int) -> None:
    """Refuse what ``ExpertParallelTrainer`` refuses before its meshes at ``ep``, with its own check
    (``ep_moe.check_ep``: the contract's ep claim, more ranks than routed experts), on the family's
    model built on the ``meta`` device with ``contract`` installed, as the run installs it."""
    model = FAMILY_MODELS[family][0](cfg, device="meta")
    model.install(contract, RuntimeFacts(arch=arch))
    check_ep(model, ep, arch)


def read_workflow_config(path: str, schema_path: Path = WORKFLOW_SCHEMA) -> WorkflowPlan:
    """The run shapes of every family and arm of the workflow config at ``path`` (module docstring).
    Refuses, with one line naming the problem, a missing or malformed file, a value of the wrong
    type, an unknown family or model, and settings a run would refuse."""
    what = "workflow config"
    data = _mapping(path, what)
    base_path = configs_dir() / EMBEDDED_CONFIG
    merged_over = None
    if base_path.is_file() and base_path.resolve() != Path(path).resolve():
        data = merge_config(_mapping(str(base_path), what), data)
        merged_over = str(base_path)
    if not schema_path.is_file():
        raise ConfigError(f"the workflow schema {str(schema_path)!r} is not there: `isoexec plan` reads workflow "
                          "configs of an isoexec checkout")
    schema = load_yaml(schema_path, "workflow schema")
    check_schema(data, schema, f"{what} {path!r}" + (f" (over {merged_over})" if merged_over else ""), schema_path)

    arch, families = data["arch"], list(data["families"])
    gpus = int(data.get("gpus", _default(schema, "gpus")))
    nodes = int(data.get("nodes", _default(schema, "nodes")))
    compositions = list(data.get("compositions") or _default(schema, "compositions"))
    rl = dict(data.get("rl") or {})
    missing = [f for f in families if f not in data["models"]]
    if missing:
        raise ConfigError(f"{what} {path!r}: `models` has no entry for {', '.join(missing)}")
    arms = rl.get("arms") or {c: {"composition": c} for c in compositions}   # the workflow's default arms
    family_settings = rl.get("family_settings") or {}
    dataset = rl.get("dataset", _default(schema, "rl", "dataset"))
    seed = int((rl.get("seeds") or [0])[0])
    plan = WorkflowPlan(path=path, run_name=data["run_name"], arch=arch, gpus=gpus, nodes=nodes,
                        rl_enabled=bool(rl.get("enabled", False)), merged_over=merged_over,
                        gpu_memory_gib=data.get("gpu_memory_gib"))
    rows: dict[tuple, RunShape] = {}
    for family in families:
        name = data["models"][family]
        model = load_model_config(name)
        if model["family"] != family:
            raise ConfigError(f"{what} {path!r}: models.{family} is {name!r}, a {model['family']} model")
        cfg = FAMILY_CONFIGS[family].from_hf(model["hf_config"])
        for arm, spec in arms.items():
            comp = spec["composition"]
            settings = merge_config(merge_config(rl.get("settings") or {}, family_settings.get(family) or {}),
                                    spec.get("settings") or {})
            where = f"{what} {path!r}: rl settings of {family} arm {arm}"
            try:
                run = RLConfig.from_dict({**settings, "family": family, "composition": comp, "model": name,
                                          "arch": arch, "seed": seed, "dataset": dataset})
                train = TrainConfig.from_dict({"seed": seed, **run.train})
                check_world(run, plan.dp)          # what the run refuses at this world size, refused here
                check_engine_tp(run, plan.dp)
                check_trainer_ep(run, plan.dp)
                contract = build_contract(family, comp, arch, name)
                if run.engine_tp > 1:      # the run's cut refuses a tp the contract or the heads do not allow
                    model = FAMILY_MODELS[family][0](cfg, device="meta")
                    check_topology(contract, RuntimeFacts(arch=arch, tp=run.engine_tp),
                                   tp_serving_problems(model, contract, run.engine_tp))
                if run.trainer_ep > 1:
                    check_trainer_ep_topology(family, cfg, contract, arch, run.trainer_ep)
                page_bytes, page_size = kv_page(run, cfg, contract)
                engine = engine_config(run, plan.dp // run.engine_tp, page_bytes, page_size)   # one per engine group
            except IsoExecError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            recurrent = isinstance(cfg, HybridConfig)
            shape = RunShape(
                family=family, model=name, cfg=cfg, arms=(arm,), dtype=resolved_dtype(run), dp=plan.dp,
                engine_tp=run.engine_tp,
                num_pages=engine.num_pages, page_size=engine.page_size or contract_page_size(contract) or 16,
                num_state_slots=(engine.num_state_slots or engine.max_num_seqs) if recurrent else 0,
                gdn_chunk=contract_gdn_chunk(contract) if recurrent else 0, max_num_seqs=engine.max_num_seqs,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                micro_batch_budget=train.micro_batch_tokens,
                longest_sequence=run.max_prompt_tokens + run.max_response_tokens,
                activation_checkpointing=train.activation_checkpointing,
                reshard_after_forward=train.reshard_after_forward, trainer_ep=run.trainer_ep,
                gdn_chunk_form=recurrent and contract_gdn_chunk_form(contract))
            key = shape.plan_key()
            rows[key] = replace(rows[key], arms=rows[key].arms + (arm,)) if key in rows else shape
    plan.shapes = list(rows.values())
    return plan

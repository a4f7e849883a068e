"""The synchronous RL loop: rollouts, reward, group advantages, dynamic sampling, pre-update
scoring, live bitwise check, mini-batch updates, weight sync with contract handshake.

One process holds the trainer and the engine (colocated, one device): weight sync is an in-place
copy of the trainer's parameters into the engine's model, preceded by the contract handshake.
Every step appends one metrics line; a checkpoint (trainer state, prompt-stream position, step)
is written every ``checkpoint_every`` steps with a temp-file-and-rename, and a restarted run
resumes from it and produces the same (non-timing) metrics as an uninterrupted run: every random
choice is keyed by (seed, step, ...) rather than drawn from a stream that a restart would reset.

A random model is warmed up (supervised) before RL: in the run, with the run's composition, or once
for every arm of a pair by :func:`warm_up` (``isoexec warmup``, the native composition; the run then
starts from its checkpoint folder, :mod:`isoexec.rl.warmup`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

from .. import kernel_compiles
from ..assembly import installed_model
from ..compose import build_contract, load_model_config
from ..contract import check as check_contract
from ..contract import decode, encode
from ..debug import first_divergence
from ..engine import Engine, EngineConfig, SamplingParams
from ..engine.engine import contract_page_size
from ..engine.kv_pool_bytes import kv_bytes_per_page
from ..engine.warmup import warm_up_engine
from ..enforce import RuntimeFacts, check_topology
from ..envinfo import runtime_arch
from ..errors import ConfigError, IsoExecError
from ..model import save_checkpoint
from ..model.ep_moe import EP_FAMILIES
from ..model.tensor_parallel import TENSOR_PARALLEL, tensor_parallel, tp_serving_problems
from ..paths import atomic_write
from ..train.precompile import warm_up_kernel_shapes
from ..train.trainer import TrainBatch, TrainConfig, Trainer
from ..yamlio import check_schema
from .advantages import GroupFiller, TooManyRounds, dynamic_sampling, group_advantages
from .data import PromptStream, load_problems, problems_from_rows, synthetic_arithmetic
from .metrics import MetricsWriter, logprob_diff_stats, summary_line
from .result_gather import gather_results
from .reward import reward
from .tokenizer import CharTokenizer, HFTokenizer, prompt_for
from . import distributed as rl_dist
from . import warmup as shared_warmup


class LiveCheckFailed(IsoExecError):
    """Under a contract claiming tolerance 0, a rollout logprob differed from the trainer's."""

    exit_code = 1


#: The one statement of the run configuration's keys, types and ranges (also the workflow's, which
#: refers to it); package data, so an installed isoexec has it.
SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


@functools.cache
def config_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))


@dataclass
class WandbConfig:
    """Mirror of each metrics line to Weights & Biases. Offline by default: our machines reach no
    server, and an offline run is uploaded later with ``wandb sync <out>/wandb/offline-run-*``."""

    enabled: bool = False
    project: str = "isoexec"
    mode: str = "offline"                   # offline | online | disabled
    name: Optional[str] = None              # None: <family>-<composition>-seed<seed>


@dataclass
class RLConfig:
    family: str = "dense"
    composition: str = "isoexec"
    model: str = "dense_tiny"
    arch: str = "cpu"
    contract: Optional[str] = None          # admitted contract JSON; None = build the draft here
    checkpoint: Optional[str] = None        # HF checkpoint folder; None = random init + SFT warm-up
    dataset: str = "synthetic"              # "synthetic" or a DAPO-schema parquet path
    tokenizer: str = "char"                 # "char" or an HF tokenizer folder
    seed: int = 0
    steps: int = 5
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    # PROMPTS (groups) per optimizer step, as verl's ppo_mini_batch_size: a mini-batch holds
    # mini_batch_size * samples_per_prompt sequences, and a step makes
    # ceil(groups kept / mini_batch_size) updates (prompts_per_step / mini_batch_size when full).
    mini_batch_size: int = 4
    max_prompt_tokens: int = 64             # longer prompts are filtered out of the data set up front
    max_response_tokens: int = 24
    overlong_cache: int = 8
    prompt_style: str = "full"             # full (DAPO instruction) | compact ("<expr>=", synthetic task only)
    temperature: float = 1.0
    top_p: float = 1.0
    dynamic_sampling: bool = True
    max_refill_rounds: int = 2              # extra generation rounds per step; a shortfall is logged
    engine_tp: int = 1                      # engine tensor-parallel size in a distributed run
    trainer_ep: int = 1                     # trainer expert-parallel size in a distributed run (MoE families)
    kv_cache_gib: Optional[float] = None    # cap on each engine's KV pool per GPU (GiB); None: no cap
    warmup_sft_steps: int = 0
    warmup_batch_size: int = 32              # sequences per SFT step (sampled from the solved problems)
    checkpoint_every: int = 1               # steps between checkpoints (and after the last); 0: never
    live_check: Optional[bool] = None       # None: on iff the contract claims tolerance 0
    dtype: str = "auto"                     # auto = bfloat16 on GPU, float32 on CPU
    train: dict = field(default_factory=dict)      # isoexec.train.trainer.TrainConfig fields
    engine: dict = field(default_factory=dict)     # isoexec.engine.EngineConfig fields
    synthetic: dict = field(default_factory=dict)  # isoexec.rl.data.synthetic_arithmetic parameters
    wandb: dict = field(default_factory=dict)      # WandbConfig fields

    @classmethod
    def from_dict(cls, d: Any) -> "RLConfig":
        """Build and check a configuration: every key, type and range by the schema
        (``config.schema.yaml``, the ``train``/``engine``/``synthetic``/``wandb`` sections too), then
        what a schema cannot say. Everything that can be checked without building a model is
        checked here, so a refused config does no work."""
        check_schema(d, config_schema(), "rl config")
        cfg = cls(**d)
        cfg._check()
        return cfg

    def _check(self) -> None:
        """The checks across keys, and those of the section classes' own constructors."""
        def bad(msg):
            raise ConfigError(f"rl config: {msg}")

        if self.mini_batch_size > self.prompts_per_step:
            bad(f"mini_batch_size {self.mini_batch_size} counts prompts (groups of samples_per_prompt "
                f"sequences, as verl's ppo_mini_batch_size) and exceeds prompts_per_step {self.prompts_per_step}")
        if self.overlong_cache >= self.max_response_tokens:
            bad("overlong_cache must be smaller than max_response_tokens")
        if self.engine_tp > 1 and self.family not in TENSOR_PARALLEL:
            bad(f"engine_tp={self.engine_tp}: the engine under tensor parallelism is built for the "
                f"{' and '.join(TENSOR_PARALLEL)} families, not {self.family}")
        if self.engine_tp > 1 and self.family in EP_FAMILIES and self.engine.get("cuda_graphs"):
            # the MoE layer's expert exchange reads its split sizes on the host, which a captured
            # decode step cannot replay (tp_moe.py); refused here, before the warm-up and the engine
            bad(f"engine_tp={self.engine_tp} with engine.cuda_graphs: the {self.family} engine under tensor "
                "parallelism runs eager (its expert exchange sizes are read on the host); set "
                "engine.cuda_graphs: false or engine_tp: 1")
        if self.trainer_ep > 1 and self.family not in EP_FAMILIES:
            bad(f"trainer_ep={self.trainer_ep}: the trainer under expert parallelism is built for the "
                f"{' and '.join(EP_FAMILIES)} families, not {self.family}")
        TrainConfig.from_dict({"seed": self.seed, **self.train})   # e.g. rs_kind needs rs_threshold
        try:
            EngineConfig(**self.engine)
        except AssertionError as exc:      # EngineConfig states its checks as assertions
            bad(f"`engine`: {exc}")
        if self.dataset == "synthetic":    # e.g. min_terms <= max_terms, enough distinct problems
            try:
                synthetic_arithmetic(**{"n": 256, "seed": self.seed, **self.synthetic})
            except ValueError as exc:
                bad(f"`synthetic`: {exc}")

    @property
    def wandb_config(self) -> WandbConfig:
        return WandbConfig(**self.wandb)


def kv_page(cfg: RLConfig, model_cfg, contract) -> tuple[Optional[int], int]:
    """(bytes of one KV page of this run's engine on one GPU, tokens per page): what
    ``kv_cache_gib`` is divided by; (None, page size) without a cap."""
    page_size = cfg.engine.get("page_size") or contract_page_size(contract) or 16
    if cfg.kv_cache_gib is None:
        return None, page_size
    return kv_bytes_per_page(model_cfg, page_size, shared_warmup.resolved_dtype(cfg), cfg.engine_tp), page_size


def check_engine_topology(model, tp: int) -> None:
    """Refuse what the tensor-parallel engine's constructor (``tensor_parallel``) refuses at size
    ``tp``, with its own check, before anything is cut: ``model`` is a model of the run's family
    with the run's contract installed (a distributed run asks on the trainer's model, before the
    trainer's first collective, and builds and cuts the engine's model once the trainer is sharded)."""
    arch = "cpu" if model.embed.device.type == "cpu" else runtime_arch()
    check_topology(model.contract, RuntimeFacts(arch=arch, tp=tp), tp_serving_problems(model, model.contract, tp))


def derive_seed(*parts: Any) -> int:
    """A 40-bit seed from (run seed, step, prompt, sample, ...): independent of batch order."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return int.from_bytes(h[:5], "little")


def engine_config(cfg: RLConfig, engine_groups: int = 1, kv_page_bytes: Optional[int] = None,
                  page_size: int = 16) -> EngineConfig:
    """The engine a run builds: room for every sequence it serves in a generation round at once (one
    running sequence per prompt x sample of its deal: with ``engine_groups`` engines, the largest
    group's ``ceil(prompts_per_step / engine_groups)`` prompts, since prompts are dealt whole; KV
    pages for all of them at full length, as pages of 16 tokens, plus 64 spare), a 2048-token step
    budget, and ``cfg.engine`` over these. The memory plan (isoexec/plan/) sizes the engine's pools
    from the same settings. The size changes no bit: the engine is batch invariant, and an engine
    that runs out of pages preempts and recomputes (``engine.num_pages`` caps the pool).

    ``cfg.kv_cache_gib`` caps the pages at what that many GiB hold, ``kv_page_bytes`` a page of
    ``page_size`` tokens (every attention layer, this GPU's heads: ``kv_page``), as vLLM's memory
    budget does; a cap that cannot hold one longest sequence is a ``ConfigError``. An explicit
    ``engine.num_pages`` wins over both."""
    seqs = -(-cfg.prompts_per_step // engine_groups) * cfg.samples_per_prompt
    longest = cfg.max_prompt_tokens + cfg.max_response_tokens
    pages = seqs * longest // 16 + 64
    if cfg.kv_cache_gib is not None and "num_pages" not in cfg.engine:
        if kv_page_bytes is None:
            raise ValueError("engine_config: kv_cache_gib needs the bytes of one KV page (kv_page_bytes)")
        if kv_page_bytes:          # 0: a model without attention layers has no pages to cap
            cap = int(cfg.kv_cache_gib * (1 << 30)) // kv_page_bytes
            need = -(-longest // page_size)
            if cap < need:
                raise ConfigError(f"rl config: kv_cache_gib={cfg.kv_cache_gib} holds {cap:,} KV pages of "
                                  f"{kv_page_bytes:,} bytes, and one sequence of max_prompt_tokens + "
                                  f"max_response_tokens = {longest:,} tokens needs {need:,}; raise kv_cache_gib")
            pages = min(pages, cap)
    return EngineConfig(**{"max_num_seqs": seqs, "num_pages": pages, "max_num_batched_tokens": 2048, **cfg.engine})


# ---------------------------------------------------------------------------------- what a run reads
# The run and the shared warm-up (`isoexec warmup`, :func:`warm_up`) both go through these, so the
# warm-up sees exactly the problems, prompts, tokenizer and seeds the run would have used.
def run_device(cfg: RLConfig) -> str:
    return "cpu" if cfg.arch == "cpu" else "cuda"


def run_dtype(cfg: RLConfig) -> torch.dtype:
    """``auto`` = bfloat16 on a GPU arch, float32 on cpu."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[shared_warmup.resolved_dtype(cfg)]


def run_tokenizer(cfg: RLConfig, hf_cfg: dict):
    tok = CharTokenizer() if cfg.tokenizer == "char" else HFTokenizer(cfg.tokenizer)
    if tok.vocab_size > hf_cfg["vocab_size"]:
        raise ConfigError(f"tokenizer has {tok.vocab_size} ids but the model's vocab is {hf_cfg['vocab_size']}")
    return tok


def prompt_text(tok, problem, style: str) -> str:
    """The prompt string: the user message through the tokenizer's chat template where it has
    one, else the plain base-model frame (:func:`~isoexec.rl.tokenizer.prompt_for`).
    ``compact`` keeps only the expression of a synthetic problem ("12+7*3=") as the user
    message: the tiny CPU models cannot afford the 250-character DAPO instruction."""
    text = problem.prompt_text
    if style == "compact":
        m = re.search(r"Compute (.+?)\.", text)
        if m:
            return prompt_for(tok, f"{m.group(1)}=", plain="{prompt}")
    return prompt_for(tok, text)


def run_problems(cfg: RLConfig, tok, log: Callable[[str], None]) -> tuple[list, dict, int]:
    """The run's problems, their prompt ids and how many were dropped: the data set (the synthetic
    task from the run's seed, or a parquet) without the problems whose prompt is longer than
    ``max_prompt_tokens`` (verl's ``filter_overlong_prompts``), with a counted warning. Cutting such
    a prompt would train on a question the model never saw whole; the count goes into every
    metrics line."""
    if cfg.dataset == "synthetic":
        problems = problems_from_rows(synthetic_arithmetic(**{"n": 256, "seed": cfg.seed, **cfg.synthetic}))
    else:
        problems = load_problems(cfg.dataset)
    ids = {p.id: tok.encode(prompt_text(tok, p, cfg.prompt_style)) for p in problems}
    kept = [p for p in problems if len(ids[p.id]) <= cfg.max_prompt_tokens]
    dropped = len(problems) - len(kept)
    if dropped:
        longest = max(len(x) for x in ids.values())
        log(f"warning: {dropped} of {len(problems)} prompts are longer than max_prompt_tokens="
            f"{cfg.max_prompt_tokens} tokens (longest {longest}) and were filtered out of the data set")
    if not kept:
        raise ConfigError(f"every one of the {len(problems)} prompts is longer than max_prompt_tokens="
                          f"{cfg.max_prompt_tokens} tokens; raise max_prompt_tokens")
    return kept, {p.id: ids[p.id] for p in kept}, dropped


def supervised_warmup(trainer: Trainer, cfg: RLConfig, tok, problems, prompt_ids, log) -> list[float]:
    """``warmup_sft_steps`` SFT steps of ``trainer`` on the first 128 problems, solved ("<answer>\n
    Answer: <answer>" after the prompt), ``warmup_batch_size`` of them per step; the NLL per step."""
    seqs, prompt_lens = [], []
    for p in problems[:128]:
        prompt = prompt_ids[p.id]
        answer = tok.encode(f" {p.ground_truth}\nAnswer: {p.ground_truth}") + [tok.eos_id]
        seqs.append(prompt + answer)
        prompt_lens.append(len(prompt))
    t0 = time.time()
    stats = trainer.sft(seqs, prompt_lens, steps=cfg.warmup_sft_steps,
                        batch_size=min(cfg.warmup_batch_size, len(seqs)))
    nll = [float(x) for x in stats] if isinstance(stats, (list, tuple)) else []
    shown = f"NLL {nll[0]:.3f} -> {nll[-1]:.3f}" if nll else str(stats)
    log(f"warm-up SFT: {cfg.warmup_sft_steps} steps in {time.time() - t0:.1f}s, {shown}")
    return nll


def warm_up(cfg: RLConfig, out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """The shared warm-up of run config ``cfg`` (``isoexec warmup``, :mod:`isoexec.rl.warmup`): the
    run's warm-up — same tokenizer, problems, prompts, model seed, optimizer and SFT sampling seed —
    with the native composition whatever ``cfg.composition`` says, written to ``out_dir`` as a
    Hugging Face checkpoint folder (config.json, model.safetensors in the model's dtype) and the
    record warmup.json, last. Returns the record."""
    if cfg.checkpoint:
        raise ConfigError(f"rl config: checkpoint {cfg.checkpoint!r} is set: a run from a checkpoint has no "
                          "warm-up (leave checkpoint out to warm up a random model)")
    if not cfg.warmup_sft_steps:
        raise ConfigError("rl config: warmup_sft_steps is 0: there is nothing to warm up")
    hf_cfg = load_model_config(cfg.model)["hf_config"]
    tok = run_tokenizer(cfg, hf_cfg)
    problems, prompt_ids, _ = run_problems(cfg, tok, log)
    data = shared_warmup.data_digest(cfg)
    contract = build_contract(cfg.family, shared_warmup.COMPOSITION, cfg.arch, cfg.model)
    model = installed_model(cfg.family, shared_warmup.COMPOSITION, cfg.arch, cfg.model, seed=cfg.seed,
                            dtype=run_dtype(cfg), device=run_device(cfg), contract=contract).model
    trainer = Trainer(model, TrainConfig.from_dict({"seed": cfg.seed, **cfg.train}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)   # only once every input has been checked
    t0 = time.time()
    nll = supervised_warmup(trainer, cfg, tok, problems, prompt_ids, log)
    seconds = time.time() - t0
    digest = save_checkpoint(model, hf_cfg, out)   # config.json, model.safetensors (the model's dtype)
    record = {"format": shared_warmup.FORMAT, "composition": shared_warmup.COMPOSITION, "model": cfg.model,
              "hf_config": json.loads(json.dumps(hf_cfg)), "settings": shared_warmup.warmup_settings(cfg),
              "data_sha256": data, "weights_sha256": digest,
              "contract_numerical_policy": contract.identities.numerical_policy, "nll": nll, "seconds": seconds}
    atomic_write(out / shared_warmup.RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
    log(f"wrote the shared warm-up to {out} (weights sha256 {record['weights_sha256'][:16]}...)")
    return record


class RLRun:
    """Holds the colocated trainer and engine of one run and executes its steps. In a default
    process group of N > 1 ranks the run is data-parallel (:mod:`isoexec.rl.distributed`): every
    rank builds one and calls ``run`` (or ``run_step``) alike."""

    def __init__(self, cfg: RLConfig, out_dir: str | Path, log: Callable[[str], None] = print):
        self.cfg, self.out, self.log = cfg, Path(out_dir), log
        self.world, self.rank = rl_dist.world()
        # in a process group (torchrun, even of one rank): the sharded trainer and the collectives
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rl_dist.check_engine_tp(cfg, self.world)
        rl_dist.check_trainer_ep(cfg, self.world)
        if self.distributed:
            # refusals from the configuration and the folder alone: every rank, before any collective
            rl_dist.check_world(cfg, self.world)
            self._check_checkpoint_world()
            if self.rank:
                self.log = lambda s: None    # rank 0 speaks for the run
        device, dtype = run_device(cfg), run_dtype(cfg)
        if cfg.contract:
            if not Path(cfg.contract).is_file():
                raise ConfigError(f"contract file {cfg.contract!r} not found")
            self.contract = check_contract(decode(Path(cfg.contract).read_bytes()))
        else:
            self.contract = build_contract(cfg.family, cfg.composition, cfg.arch, cfg.model)
        hf_cfg = load_model_config(cfg.model)["hf_config"]
        # a checkpoint made by `isoexec warmup` must be the warm-up of this run's settings
        self.warmup_record = shared_warmup.check_shared_warmup(cfg, hf_cfg)
        self.tok = run_tokenizer(cfg, hf_cfg)
        where = dict(dtype=dtype, device=device, contract=self.contract)
        self.trainer_model = installed_model(cfg.family, cfg.composition, cfg.arch, cfg.model, seed=cfg.seed,
                                             checkpoint=cfg.checkpoint, **where).model

        def engine_model():
            # no weights of its own: the trainer's are copied in at every weight sync
            return installed_model(cfg.family, cfg.composition, cfg.arch, cfg.model, seed=None, **where).model

        # engine groups: ranks [g * tp, (g + 1) * tp) share one engine sharded over them (a whole
        # engine per rank at tp = 1); group g serves its deal of each round's prompts. Created and
        # checked here, before the trainer's first collective: a tp the contract does not claim is
        # refused on every rank alike (TopologyRefused), by the check the cut itself makes
        self.engine_groups, self.engine_group = self.world // cfg.engine_tp, self.rank // cfg.engine_tp
        engine_group = None
        if cfg.engine_tp > 1:
            groups = rl_dist.engine_groups(self.world, cfg.engine_tp)   # every rank creates every group
            engine_group = groups[self.engine_group]
            check_engine_topology(self.trainer_model, cfg.engine_tp)
        if not self.distributed:
            self.engine_model = engine_model()
        # sized now, so that a kv_cache_gib too small for one sequence refuses before any work
        self.engine_cfg = engine_config(cfg, self.engine_groups, *kv_page(cfg, self.trainer_model.cfg, self.contract))
        self.problems, self._prompt_ids, self.prompts_filtered_overlong = run_problems(cfg, self.tok, self.log)
        train_cfg = TrainConfig.from_dict({"seed": cfg.seed, **cfg.train})
        self.trainer_contract = self.contract
        if self.distributed:
            if self.warmup_record is None and cfg.warmup_sft_steps and not cfg.checkpoint:
                rl_dist.check_warmup_batch(min(cfg.warmup_batch_size, len(self.problems[:128])), self.world)
            from ..dist.fsdp import ExpertParallelTrainer, FSDPTrainer   # the first collectives: the meshes

            if cfg.trainer_ep > 1:   # its own cut of the model (experts over trainer_ep ranks); the contract's
                # ep claim is refused before its first collective, on every rank (TopologyRefused)
                self.trainer = ExpertParallelTrainer(self.trainer_model, train_cfg, cfg.trainer_ep)
                self.trainer_model = self.trainer.model
            else:
                self.trainer = FSDPTrainer(self.trainer_model, train_cfg)
            # every engine handshakes with the trainer contract rank 0 holds; the ranks must agree on it
            mine = encode(self.contract)
            theirs = rl_dist.all_gather(mine)
            if any(x != theirs[0] for x in theirs):
                raise ConfigError("distributed run: the ranks built different trainer contracts (ranks "
                                  f"{[r for r, x in enumerate(theirs) if x != theirs[0]]} differ from rank 0)")
            self.trainer_contract = decode(rl_dist.broadcast_bytes(mine))
            # the engine's model only now, with the trainer's in fp32 shards: its whole copy (and
            # the tensor-parallel cut made from it) never sits beside the trainer's whole copy
            self.engine_model = engine_model()
            if engine_group is not None:
                self.engine_model = tensor_parallel(self.engine_model, engine_group)
        else:
            self.trainer = Trainer(self.trainer_model, train_cfg)
        self.stream = PromptStream(self.problems, cfg.prompts_per_step, cfg.seed)
        self.engine = Engine(self.engine_model, self.contract, self.engine_cfg,
                             trainer_contract=self.trainer_contract)
        wb = cfg.wandb_config
        if wb.enabled:
            try:
                import wandb  # noqa: F401 - asked for by the config: refuse now, not after the first step
            except ImportError:
                raise ConfigError("rl config: wandb.enabled is true but the wandb package is not installed "
                                  "(pip install wandb)") from None
        self.out.mkdir(parents=True, exist_ok=True)   # only once every input has been checked
        # rank 0 writes the metrics of a distributed run
        self.metrics = rl_dist.NullMetrics() if self.rank else MetricsWriter(
            self.out / "metrics.jsonl", wandb=wb.enabled, wandb_project=wb.project, wandb_mode=wb.mode,
            config=asdict(cfg), run_name=wb.name or f"{cfg.family}-{cfg.composition}-seed{cfg.seed}")
        self.live_check = self.contract.claims.claims_zero_tolerance if cfg.live_check is None else cfg.live_check
        self.step = 0
        kernel_compiles.install()
        self._resume_or_start()

    # ------------------------------------------------------------------------------ checkpoints
    @property
    def ckpt_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def _check_checkpoint_world(self, state: Optional[dict] = None) -> None:
        """Refuse to resume a checkpoint written at another world size (every rank reads the same
        file, so all refuse together; a distributed run asks before any collective)."""
        if state is None:
            if not self.ckpt_path.exists():
                return
            state = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
        if state.get("world_size", 1) != self.world:
            raise ConfigError(f"{self.ckpt_path} was written by a run on {state.get('world_size', 1)} rank(s) and "
                              f"this run has {self.world}: resume with the world size it was written at")
        # one rank under torchrun writes sharded trainer state, a plain process one file
        if ("trainer_dcp" in state) != self.distributed:
            made, now = (("under torchrun", "in a plain process") if "trainer_dcp" in state
                         else ("in a plain process", "under torchrun"))
            raise ConfigError(f"{self.ckpt_path} was written by a run {made} and this run is {now}: "
                              "resume it the way it was started")

    def _resume_or_start(self) -> None:
        if self.ckpt_path.exists():
            state = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
            self._check_checkpoint_world(state)
            saved = dict(state.get("config") or {})
            now = asdict(self.cfg)
            for key in ("steps", "wandb"):   # a finished run may be extended; logging changes no result
                saved.pop(key, None)
                now.pop(key, None)
            if saved != now:
                diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
                raise ConfigError(f"{self.ckpt_path} was written by a run with another configuration "
                                  f"(differs in {', '.join(diff)}); use a fresh output folder or the same config")
            if not self.distributed:
                self.trainer.load_state_dict(state["trainer"])
            elif state["trainer_dcp"]:   # None: saved before the first update, a fresh trainer is that state
                self.trainer.load(str(self.out / state["trainer_dcp"]))
            self.stream.load_state_dict(state["stream"])
            self.step = state["step"]
            self.metrics.truncate_after(self.step - 1)
            self.log(f"resumed from {self.ckpt_path} at step {self.step}")
        else:
            self.metrics.truncate_after(-1)
            if self.warmup_record is not None:
                self.log(shared_warmup.describe(self.warmup_record, self.cfg.checkpoint))
            elif self.cfg.warmup_sft_steps and not self.cfg.checkpoint:
                self._warmup()
        # compile every GEMM bucket's kernels now, not inside a timed step (a no-op on a CPU)
        warm_up_kernel_shapes(self.trainer_model, self.tok.vocab_size, self.log)
        if self.distributed:
            from ..dist.fsdp import free_params

            free_params(self.trainer_model)
        self._sync_weights()
        warm_up_engine(self.engine, self.cfg.max_prompt_tokens, self.log)

    def _save(self) -> None:
        if self.distributed:
            return self._save_sharded()
        buf = io.BytesIO()
        torch.save({"config": asdict(self.cfg), "step": self.step, "trainer": self.trainer.state_dict(),
                    "stream": self.stream.state_dict()}, buf)
        atomic_write(self.ckpt_path, buf.getvalue())

    def _save_sharded(self) -> None:
        """A distributed run's checkpoint: the trainer's shards with ``FSDPTrainer.save`` (every rank
        writes its own, ``torch.distributed.checkpoint``) into ``trainer_step<k>/``, then rank 0
        writes checkpoint.pt (configuration, step, prompt stream, world size, that folder's name)
        with a temp-file-and-rename: the checkpoint exists once checkpoint.pt names it, and an
        older trainer folder is removed only after that."""
        import shutil

        import torch.distributed as dist

        name = f"trainer_step{self.step}"
        trained = self.trainer.optimizer.steps > 0   # before the first update a fresh trainer is the state
        if trained:
            self.trainer.save(str(self.out / name))
        dist.barrier()
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save({"config": asdict(self.cfg), "step": self.step, "stream": self.stream.state_dict(),
                        "world_size": self.world, "trainer_dcp": name if trained else None}, buf)
            atomic_write(self.ckpt_path, buf.getvalue())
            for old in self.out.glob("trainer_step*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def _warmup(self) -> None:
        """Supervised warm-up of a random model on solved problems so that rewards carry signal, in
        this run with its own composition (a run started from ``isoexec warmup``'s folder skips it)."""
        supervised_warmup(self.trainer, self.cfg, self.tok, self.problems, self._prompt_ids, self.log)

    def _clock(self) -> float:
        """Seconds on a monotonic clock, after the device has finished the work queued so far: a
        stage boundary must not bill one stage's asynchronous GPU work to the next stage."""
        dev = next(self.trainer_model.parameters()).device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    def _sync_weights(self) -> float:
        t0 = self._clock()
        if self.distributed:
            # the trainer's shards gathered whole (fp32 masters; the engine's copy_ rounds them to
            # its dtype as the single-process trainer rounds its masters into its parameters), one
            # parameter at a time as the engine reads them, not the model's whole fp32 copy at once
            self.engine.update_weights(self.trainer.gathered_parameters(), trainer_contract=self.trainer_contract)
        else:
            self.engine.update_weights(self.trainer_model, trainer_contract=self.contract)
        return self._clock() - t0

    def _prompt_text(self, problem) -> str:
        return prompt_text(self.tok, problem, self.cfg.prompt_style)

    def _decode(self, ids) -> str:
        # the model's vocabulary may be larger than the tokenizer's: ids it does not know read as UNK
        unk = getattr(self.tok, "unk_id", self.tok.eos_id)
        return self.tok.decode([i if i < self.tok.vocab_size else unk for i in ids])

    # ------------------------------------------------------------------------------ one step
    def _generate(self, problems, step: int, round_: int):
        cfg = self.cfg
        prompts, params, owners = [], [], []
        for pi, p in enumerate(problems):
            ids = self._prompt_ids[p.id]          # within max_prompt_tokens: longer ones were filtered out
            for si in range(cfg.samples_per_prompt):
                prompts.append(ids)
                params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                             max_tokens=cfg.max_response_tokens, stop_token_ids=(self.tok.eos_id,),
                                             seed=derive_seed(cfg.seed, step, round_, p.id, si)))
                owners.append(pi)
        if not self.distributed:
            return self.engine.generate(prompts, params), owners
        # whole groups to each engine group; a sample keeps the request id (its index in the round)
        # and the seed the single-process run gives it, so its tokens do not depend on the world
        # size or the engine's tp (every rank of an engine group serves the same requests in step)
        mine = self._engine_share(len(problems))
        idx = [i for i in range(len(prompts)) if owners[i] in mine]
        results = self.engine.generate([prompts[i] for i in idx], [params[i] for i in idx], request_ids=idx) \
            if idx else []
        parts = gather_results(results)      # the logprobs reach every rank on the host, same bits
        # one copy per engine group (its first rank's), in group order: the single-process order
        return [r for part in parts[::self.cfg.engine_tp] for r in part], owners

    def _engine_share(self, n_prompts: int) -> range:
        """The prompts of a round of ``n_prompts`` this rank's engine group serves."""
        return rl_dist.deal(n_prompts, self.engine_groups, self.engine_group)

    def _region_hint(self, seqs, plens, first) -> str:
        """Where the first differing logprob is born (isoexec.debug): trainer vs engine model."""
        if not first:
            return ""
        if self.distributed:   # the trainer's model is sharded
            return "; the region locator runs in a single-process run only"

        seq_i, tok_i = first
        tokens = seqs[seq_i][:plens[seq_i] + tok_i + 1]
        try:
            d = first_divergence(self.trainer_model, self.engine_model, tokens, "decode" if tok_i else "prefill")
        except Exception as exc:  # noqa: BLE001 - a hint must never hide the live-check failure itself
            return f" (locator failed: {exc})"
        return f"; {d}" if d else "; the locator found no differing region (a sampling-path difference?)"

    def run_step(self) -> dict:
        cfg, step = self.cfg, self.step
        compiled_before = kernel_compiles.count()
        t_step = self._clock()
        n = cfg.samples_per_prompt
        # DAPO's dynamic sampling: up to 1 + max_refill_rounds rounds, each asking for the groups
        # still missing; a group is a list of indices into `generated`.
        filler = GroupFiller(cfg.prompts_per_step, max_rounds=cfg.max_refill_rounds + 1)
        generated, t_gen = [], 0.0
        mine = []    # indices into `generated` of what this rank's engine sampled (all of it in one process)
        while not filler.full:
            problems = self.stream.next_batch(filler.deficit)
            t0 = self._clock()
            results, owners = self._generate(problems, step, filler.rounds)
            t_gen += self._clock() - t0
            rs = []
            for r, owner in zip(results, owners):
                total, correct = reward(self._decode(r.ids), problems[owner].ground_truth, len(r.ids),
                                        cfg.max_response_tokens, cfg.overlong_cache)
                rs.append((total, correct))
            # DAPO's dynamic sampling filters on accuracy: a group all right or all wrong has no signal
            keep = dynamic_sampling([float(x[1]) for x in rs], n) if cfg.dynamic_sampling else [True] * len(problems)
            base = len(generated)
            dealt = self._engine_share(len(problems))
            mine += range(base + dealt.start * n, base + dealt.stop * n)
            generated += list(zip(results, rs))
            try:
                filler.add([list(range(base + gi * n, base + gi * n + n)) for gi in range(len(problems))], keep)
            except TooManyRounds:
                break
        groups = filler.kept[:cfg.prompts_per_step]
        if self.distributed and len(groups) * n % self.world:
            # a short step's sequences must still deal out evenly: train on fewer whole groups
            keep = max(g for g in range(len(groups) + 1) if g * n % self.world == 0)
            self.log(f"warning: step {step}: {len(groups)} kept group(s) of {n} do not deal out evenly over "
                     f"{self.world} ranks; training on the first {keep}")
            groups = groups[:keep]
        groups_short = cfg.prompts_per_step - len(groups)
        if groups_short:
            # verl trains on what it kept once max_num_gen_batches is reached; so do we, but loudly
            self.log(f"warning: step {step}: dynamic sampling kept {len(groups)} of {cfg.prompts_per_step} groups "
                     f"after {filler.rounds} generation round(s) ({filler.dropped} of {filler.generated} groups all "
                     f"right or all wrong); training on {len(groups)} group(s), groups_short={groups_short} "
                     f"(raise max_refill_rounds, or check that the prompts are neither all solved nor all failed)")

        # Pre-update scoring of EVERY generated response: the mismatch metric covers all rollouts,
        # and the kept groups' scores are pi_old (recompute) without a second pass.
        all_seqs = [r.prompt + r.ids for r, _ in generated]
        all_plens = [len(r.prompt) for r, _ in generated]
        all_rollout = [r.logprobs for r, _ in generated]
        t0 = self._clock()
        if self.distributed:
            # FSDPTrainer.score deals the list out evenly: pad it with copies of the last sequence
            # (a sequence's scores do not depend on the batch around it) and drop their scores
            pad = -len(all_seqs) % self.world
            all_trainer = self.trainer.score(all_seqs + all_seqs[-1:] * pad, all_plens + all_plens[-1:] * pad)
            all_trainer = all_trainer[:len(all_seqs)]
        else:
            all_trainer = self.trainer.score(all_seqs, all_plens)
        t_score = self._clock() - t0
        stats = logprob_diff_stats(all_rollout, all_trainer)
        # this rank's own engine against the trainer, bitwise; gathered, so every rank sees every count
        own = rl_dist.differing_tokens([all_rollout[i] for i in mine], [all_trainer[i] for i in mine])
        per_rank = rl_dist.all_gather(own) if self.distributed else [own]
        if self.live_check and (stats.get("bitwise_equal_frac", 1.0) < 1.0 or any(per_rank)):
            first = stats.get("first_differing")
            raise LiveCheckFailed(
                f"step {step}: contract claims tolerance 0 but rollout and trainer logprobs differ "
                f"({stats['bitwise_equal_frac']:.6f} of tokens equal); first differing token: response "
                f"{first[0] if first else '?'}, token {first[1] if first else '?'}"
                f"{self._region_hint(all_seqs, all_plens, first)}; stopping before the backward pass.")
        kept = [i for g in groups for i in g]
        rewards_kept = [generated[i][1][0] for i in kept]
        adv = group_advantages(rewards_kept, cfg.samples_per_prompt) if kept else []
        sequences = [all_seqs[i] for i in kept]
        prompt_lens = [all_plens[i] for i in kept]
        rollout_lp = [all_rollout[i] for i in kept]
        trainer_lp = [all_trainer[i] for i in kept]
        all_rewards = [x[1][0] for x in generated]
        t0 = self._clock()
        train_stats = {}
        if kept:
            batch = TrainBatch(sequences=sequences, prompt_lens=prompt_lens, advantages=adv,
                               rollout_logprobs=rollout_lp)
            old = trainer_lp if self.trainer.config.pi_old == "recompute" else rollout_lp
            # mini_batch_size counts prompts: whole groups of samples_per_prompt sequences per update
            train_stats = self.trainer.train(batch, old, cfg.mini_batch_size * n)
        t_train = self._clock() - t0
        t_sync = self._sync_weights()
        lengths = [len(r.ids) for r, _ in generated]
        gen_tokens = sum(lengths)
        line = {
            "step": step,
            "logprob_abs_diff_mean": stats.get("logprob_abs_diff_mean", 0.0),
            "logprob_abs_diff_std": stats.get("logprob_abs_diff_std", 0.0),
            "logprob_abs_diff_max": stats.get("logprob_abs_diff_max", 0.0),
            "bitwise_equal_frac": stats.get("bitwise_equal_frac", 1.0),
            "kl_k1": stats.get("kl_k1", 0.0), "kl_k3": stats.get("kl_k3", 0.0),
            "tokens": stats.get("tokens", 0),
            "reward_mean": sum(all_rewards) / len(all_rewards) if all_rewards else 0.0,
            "accuracy": sum(x[1][1] for x in generated) / len(generated) if generated else 0.0,
            "responses": len(generated), "responses_trained": len(kept),
            "response_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "groups_kept": len(groups), "groups_dropped": filler.dropped, "groups_short": groups_short,
            "generation_rounds": filler.rounds, "prompts_filtered_overlong": self.prompts_filtered_overlong,
            **{f"train_{k}": v for k, v in train_stats.items() if isinstance(v, (int, float))},
            # time_training_s is the mini-batch updates alone (verl's "policy training"); scoring
            # is its own stage. A step that kept no group trained nothing: "trained" is False and
            # the tables keep it out of the training means.
            "trained": bool(kept), "tokens_generated": gen_tokens,
            "time_generation_s": t_gen, "time_scoring_s": t_score, "time_training_s": t_train,
            "time_weight_sync_s": t_sync,
            "time_generation_per_1k_tokens_s": t_gen / gen_tokens * 1000 if gen_tokens else None,
            "time_step_s": self._clock() - t_step,
            # Triton kernels compiled during this step (their compile time is inside the timings)
            "kernels_compiled": kernel_compiles.count() - compiled_before,
            # tokens each rank's engine sampled whose logprob differs from the trainer's, bitwise
            "live_check_differing_per_rank": per_rank, "world_size": self.world,
        }
        self.metrics.write(line)
        self.log(summary_line(line))
        if line["kernels_compiled"]:   # their compile time is inside this step's timings: say which
            names = kernel_compiles.compiled_since(compiled_before)
            self.log(f"step {step}: {len(names)} Triton kernel(s) compiled: " + "; ".join(n[:160] for n in names[:8]))
        self.step += 1
        every = self.cfg.checkpoint_every
        if every and (self.step % every == 0 or self.step == self.cfg.steps):
            self._save()
        return line

    def run(self) -> list[dict]:
        """Run the remaining steps, then close the metrics file (and finish the W&B run)."""
        out = []
        try:
            while self.step < self.cfg.steps:
                out.append(self.run_step())
        finally:
            self.metrics.close()
        return out


def run_rl(cfg: RLConfig, out_dir: str | Path, log: Callable[[str], None] = print) -> list[dict]:
    """Run ``cfg`` to its last step; under torchrun (any world size, one rank included) as one rank
    of a data-parallel run (:mod:`isoexec.rl.distributed`), which joins the process group here and
    leaves it at the end."""
    joined = rl_dist.init_from_env(cfg.arch)
    try:
        run = RLRun(cfg, out_dir, log)
        return run.run()
    finally:
        if joined:
            torch.distributed.destroy_process_group()


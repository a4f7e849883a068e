# RL runs (DAPO by default): the synthetic data set, one supervised warm-up per family x seed of a
# random model (with the native composition; every arm starts from it), one run per family x arm x
# seed (an arm is a composition plus settings overrides; by default one arm per composition), and the
# reproduction tables/figures. A run's folder is its directory output (metrics.jsonl, checkpoint.pt,
# rl_config.json, inputs.json, run.json): it starts clean, unless `--config resume=true` asks the
# runs to continue from their checkpoints (workflow/scripts/rl_run.py, docs/workflow.md).


rule synthetic_data:
    input:
        code=CODE_VERSION,
    output:
        f"{RES}/data/synthetic.parquet",
    log:
        f"{LOGS}/synthetic_data.log",
    params:
        synthetic=json.dumps(RL_CONF.get("synthetic", {"n": 512}), sort_keys=True),
        seed=RL_CONF.get("data_seed", 0),
    priority: RL_PATH_PRIORITY
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "isoexec data synthetic --params {params.synthetic:q} --seed {params.seed} --out {output:q} > {log:q} 2>&1"


# The shared warm-up (`isoexec warmup`): the warm-up every arm of a family and seed starts from, run
# once with the native composition (the stock path; the warmed weights are a starting point and carry
# no bitwise claim), written as a checkpoint folder (config.json, model.safetensors, warmup.json) that
# the runs load. Only for families without real weights and with warmup_sft_steps > 0.
rule rl_warmup:
    input:
        data=rl_data_input,
        model=model_file,
        composition=f"configs/compositions/{WARMUP_COMPOSITION}.yaml",
        code=CODE_VERSION,
    output:
        directory(warmup_dir("{family}", "{seed}")),
    log:
        f"{LOGS}/warmup/{{family}}_seed{{seed}}.log",
    params:
        rl=warmup_settings,
    priority: RL_PATH_PRIORITY
    threads: job_threads(2)
    resources:
        gpu=JOB_GPUS,
        runtime=120,
    conda:
        CONDA_ENV
    script:
        "../scripts/rl_warmup.py"


rule rl_run:
    input:
        contract=rl_contract,
        data=rl_data_input,
        warmup=rl_warmup_input,
        code=CODE_VERSION,
    output:
        rl_run_output(),
    log:
        f"{LOGS}/runs/{{family}}_{{arm}}_seed{{seed}}.log",
    params:
        rl=lambda wc: rl_settings(wc),
    message:
        RL_RUN_MESSAGE
    priority: RL_PATH_PRIORITY
    threads: job_threads(2)
    resources:
        runtime=600,
        **RL_RUN_RESOURCES,
    conda:
        CONDA_ENV
    script:
        "../scripts/rl_run.py"


# An RL run on more than one node needs a SLURM allocation of that many nodes (srun starts a
# torchrun on each); a local run is one machine, one node. Refused once the jobs are planned (the
# executor is not known while the Snakefile is read), before any job starts, and only when rl_run
# jobs are to run; a dry run shows the plan whatever the executor, and --touch runs no job.
onstart:
    if (RL_ON and RL_NODES > 1 and not workflow.touch
            and workflow.executor_plugin.name not in _launch.MULTI_NODE_EXECUTORS):
        if any(j.rule.name == "rl_run" for j in workflow.dag.needrun_jobs()):
            raise WorkflowError(
                f"config: nodes: {RL_NODES} asks for RL runs on {RL_NODES} nodes, which run only on SLURM "
                f"(--profile workflow/profiles/slurm); this run's executor ({workflow.executor_plugin.name}) "
                "is one machine, one node: set nodes: 1 (and gpus: <GPUs of this machine>)"
            )


rule rl_tables:
    input:
        runs=rl_run_outputs(),
        code=CODE_VERSION,
    output:
        lp=report(f"{FIG}/logprob_diff.md", category="RL runs"),
        st=report(f"{FIG}/step_time.md", category="RL runs"),
        csv=report(f"{FIG}/runs.csv", category="RL runs"),
        lp_png=report(f"{FIG}/logprob_diff.png", category="RL runs"),
        st_png=report(f"{FIG}/step_time.png", category="RL runs"),
    log:
        f"{LOGS}/rl_tables.log",
    params:
        run=RUN,
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"

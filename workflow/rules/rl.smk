# RL runs (DAPO by default): the synthetic data set, one run per family x arm x seed (an arm is a
# composition plus settings overrides; by default one arm per composition), and
# the reproduction tables/figures. A run writes metrics.jsonl step by step and checkpoint.pt every
# `checkpoint_every` steps into its folder; its declared output is run.json, written when the run
# finishes, so a run killed mid-way keeps its checkpoint and metrics and resumes when rerun.


rule synthetic_data:
    output:
        f"{RES}/data/synthetic.parquet",
    log:
        f"{LOGS}/synthetic_data.log",
    params:
        synthetic=RL_CONF.get("synthetic", {"n": 512}),
        seed=RL_CONF.get("data_seed", 0),
    localrule: True
    run:
        isorl.make_synthetic(output[0], params.synthetic, params.seed, log[0])


rule rl_run:
    input:
        contract=rl_contract,
        data=rl_data_input,
    output:
        f"{RES}/runs/{{family}}/{{arm}}/seed{{seed}}/run.json",
    log:
        f"{LOGS}/runs/{{family}}_{{arm}}_seed{{seed}}.log",
    params:
        rl=lambda wc: rl_settings(wc),
    threads: 2
    resources:
        gpu=GATE_GPUS,
        runtime=600,
    run:
        isorl.run_job(params.rl, output[0], log[0])


rule rl_tables:
    input:
        rl_run_outputs(),
    output:
        lp=report(f"{FIG}/logprob_diff.md", category="RL runs"),
        st=report(f"{FIG}/step_time.md", category="RL runs"),
        csv=f"{FIG}/runs.csv",
        lp_png=report(f"{FIG}/logprob_diff.png", category="RL runs"),
        st_png=report(f"{FIG}/step_time.png", category="RL runs"),
    log:
        f"{LOGS}/rl_tables.log",
    params:
        run=RUN,
    localrule: True
    run:
        isorl.render(input, output.lp, params.run, log[0])

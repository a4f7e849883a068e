# Bitwise admission gates (docs/gates.md), per family, for the gate composition (isoexec):
#   gates  `isoexec gates run --json` writes one artifact per gate into results/<run>/gates/<family>/
#          (a directory output: Snakemake empties it before a rerun, so no stale artifacts remain)
#          and the run's outcome into results/<run>/gate_runs/<family>.json.
# A failing gate or a run stopped by a kernel that does not exist yet (exit 1) is recorded and
# rendered as missing; bad input (exit 2) fails the job (workflow/scripts/gates.py). On a GPU arch
# the job gets a GPU of its own. The model is the family's `gates.models` entry where set (the run
# model's layer dimensions with fewer layers), else its `models` entry (common.smk, gate_model_name).


rule gates:
    input:
        draft=contract_path("{family}", GATE_COMPOSITION, ".draft"),
        composition=gate_composition_file,
        model=gate_model_file,
        code=CODE_VERSION,
    output:
        artifacts=directory(gates_dir("{family}")),
        record=gate_run_record("{family}"),
    log:
        f"{LOGS}/gates/{{family}}.log",
    params:
        composition=GATE_COMPOSITION,
        model=lambda wc: gate_model_name(wc.family),
        arch=ARCH,
        seed=GATE_SEED,
    priority: RL_PATH_PRIORITY
    threads: job_threads(4)
    resources:
        gpu=JOB_GPUS,
        runtime=60,
    conda:
        CONDA_ENV
    script:
        "../scripts/gates.py"

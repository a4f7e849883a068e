"""Rule bench: `isoexec bench NAME` (ours vs the stock kernel in the same run) on the job's device."""

from jobutil import job

from isoexec.report import run_cli

smk = snakemake  # noqa: F821 - set by Snakemake's script directive
with job(smk) as env, open(smk.log[0], "a") as log:
    run_cli(["bench", smk.wildcards.name, "--out", smk.output[0], "--device", smk.params.device,
             *(["--quick"] if smk.params.quick else [])], log, env=env)

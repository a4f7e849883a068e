"""Rule gates: `isoexec gates run` for one family into its artifact folder, the outcome recorded
(isoexec.report.run_gates: a failing or stopped gate run is recorded, bad input fails the job)."""

from jobutil import job

from isoexec.report import run_gates

smk = snakemake  # noqa: F821 - set by Snakemake's script directive
with job(smk) as env:
    run_gates(family=smk.wildcards.family, composition=smk.params.composition, model=smk.params.model,
              arch=smk.params.arch, seed=smk.params.seed, out_dir=smk.output.artifacts, record=smk.output.record,
              log=smk.log[0], threads=smk.threads, env=env)

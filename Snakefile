# IsoExec reproduction workflow.
#
#   snakemake --cores all                                    # CPU default (configs/config.yaml)
#   snakemake --cores all --configfile configs/h200.yaml     # one H200
#   snakemake --profile workflow/profiles/slurm --configfile configs/paper.yaml
#   snakemake --workflow-profile workflow/profiles/default   # local settings (cores all, ...)
#
# Step 1: per family and composition, build the execution contract; run the bitwise gates of
# the isoexec composition; admit and verify the contracts against the gate artifacts; render
# paper_figures/<run>/gates.md and contracts.md. Raw results go to results/<run>/.
# Rules live in workflow/rules/*.smk; the logic they call lives in the isoexec package
# (isoexec/report.py). Jobs rerun when their config files, params or rule code change; after a
# change to the kernels or the package itself, rerun the gates with `--forcerun gates`.

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "configs/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"


rule all:
    default_target: True
    input:
        final_targets(),


include: "workflow/rules/gates.smk"
include: "workflow/rules/contracts.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/rl.smk"

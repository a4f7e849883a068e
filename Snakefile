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
# Rules live in workflow/rules/*.smk; each job runs the `isoexec` command (shell:) or a script of
# workflow/scripts/ (script:), its output streamed to its log. Jobs rerun when their config files,
# params, rule code or the code version (a hash of the isoexec and kernel sources, results/<run>/
# code_version.txt) change; RL runs start clean unless `--config resume=true` (docs/workflow.md).
# `snakemake --report report.html` collects the tables and figures into one HTML file.

import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "configs/config.yaml"


# `nodes` first: for it the schema's message would dump the key's whole schema entry, where one
# line naming the key says it (workflow/scripts/launch.py)
sys.path.insert(0, f"{workflow.basedir}/workflow/scripts")
from launch import nodes_error  # noqa: E402 - workflow/scripts/launch.py

if _nodes_error := nodes_error(config):
    raise WorkflowError(_nodes_error)

# the per-family keys (rl.family_settings, gates.models) likewise, one line naming the key: their family
# names, and the gate models (they must exist and have the run models' layer dimensions)
from config_checks import per_family_error  # noqa: E402 - workflow/scripts/config_checks.py

if _family_error := per_family_error(config, f"{workflow.basedir}/workflow/schemas/config.schema.yaml"):
    raise WorkflowError(_family_error)

validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


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


# last: every config check above has passed (a refused config writes nothing)
write_code_version()

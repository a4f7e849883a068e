# Tables rendered from results/ into paper_figures/<run>/ by isoexec/report.py
# (workflow/scripts/tables.py):
#   gates_table      gates.md / gates.csv: one row per gate artifact, run status, what is missing
#   contracts_table  contracts.md / contracts.csv: digests, entries, tolerance-0 claim, admission


rule gates_table:
    input:
        records=[r for r, _ in gate_runs()],
        artifacts=[d for _, d in gate_runs()],
        code=CODE_VERSION,
    output:
        md=report(f"{FIG}/gates.md", category="Gates"),
        csv=report(f"{FIG}/gates.csv", category="Gates"),
    log:
        f"{LOGS}/gates_table.log",
    params:
        run=RUN,
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"


rule contracts_table:
    input:
        records=contract_inputs,
        code=CODE_VERSION,
    output:
        md=report(f"{FIG}/contracts.md", category="Contracts"),
        csv=report(f"{FIG}/contracts.csv", category="Contracts"),
    log:
        f"{LOGS}/contracts_table.log",
    params:
        contracts=contract_items(),
        run=RUN,
        arch=ARCH,
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"

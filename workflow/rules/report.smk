# Tables rendered from results/ into paper_figures/<run>/ by isoexec/report.py:
#   gates_table      gates.md / gates.csv: one row per gate artifact, run status, what is missing
#   contracts_table  contracts.md / contracts.csv: digests, entries, tolerance-0 claim, admission


rule gates_table:
    input:
        records=[r for r, _ in gate_runs()],
        artifacts=[d for _, d in gate_runs()],
    output:
        md=report(f"{FIG}/gates.md", category="Gates"),
        csv=f"{FIG}/gates.csv",
    log:
        f"{LOGS}/gates_table.log",
    params:
        run=RUN,
    localrule: True
    run:
        isoreport.write_gates_report(zip(input.records, input.artifacts), output.md, output.csv, params.run,
                                     log=log[0])


rule contracts_table:
    input:
        contract_inputs,
    output:
        md=report(f"{FIG}/contracts.md", category="Contracts"),
        csv=f"{FIG}/contracts.csv",
    log:
        f"{LOGS}/contracts_table.log",
    params:
        run=RUN,
        arch=ARCH,
    localrule: True
    run:
        isoreport.write_contracts_report(contract_items(), output.md, output.csv, params.run,
                                         params.arch, log=log[0])

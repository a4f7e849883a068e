"""The table rules: gates_table, contracts_table, kernels_table, cpr_table and rl_tables render
paper_figures/<run>/ from results/<run>/ (isoexec.report, isoexec.bench.report, isoexec.rl.tables)."""

from pathlib import Path

from jobutil import job

smk = snakemake  # noqa: F821 - set by Snakemake's script directive
rule, log = smk.rule, smk.log[0]
with job(smk):
    if rule == "gates_table":
        from isoexec.report import write_gates_report

        write_gates_report(zip(smk.input.records, smk.input.artifacts), smk.output.md, smk.output.csv,
                           smk.params.run, log=log)
    elif rule == "contracts_table":
        from isoexec.report import write_contracts_report

        write_contracts_report(smk.params.contracts, smk.output.md, smk.output.csv, smk.params.run, smk.params.arch,
                               log=log)
    elif rule == "kernels_table":
        from isoexec.bench.report import write_bench_report

        n = write_bench_report(smk.input.results, smk.output.md, smk.output.csv, smk.params.run)
        Path(log).write_text(f"{n} benchmark rows rendered\n")
    elif rule == "cpr_table":
        from isoexec.bench.report import write_cpr_table

        n = write_cpr_table(smk.input.result, smk.output[0], smk.params.run)
        Path(log).write_text(f"{n} CPR stages rendered\n")
    elif rule == "rl_tables":
        from isoexec.rl.tables import render_tables, run_from_folder

        runs = [run_from_folder(d) for d in smk.input.runs]
        pooled = render_tables(runs, Path(smk.output.lp).parent, smk.params.run)
        Path(log).write_text(f"{len(runs)} runs rendered: {sorted(pooled)}\n")
    else:
        raise SystemExit(f"tables.py: no table for rule {rule}")

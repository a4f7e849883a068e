"""Rules contract_admit and contract_verify (isoexec.report: admit_contract keeps the draft when the
gates do not admit it; verify_contract records the verdict; bad input fails the job)."""

from jobutil import job

from isoexec.report import admit_contract, verify_contract

smk = snakemake  # noqa: F821 - set by Snakemake's script directive
with job(smk):
    if smk.rule == "contract_admit":
        admit_contract(family=smk.wildcards.family, composition=smk.wildcards.composition,
                       build_args=smk.params.args, draft=smk.input.draft, gates_dir=smk.input.gates,
                       out=smk.output.contract, record=smk.output.record, log=smk.log[0])
    else:
        verify_contract(contract=smk.input.contract, gates_dir=smk.input.gates, record=smk.output[0],
                        log=smk.log[0])

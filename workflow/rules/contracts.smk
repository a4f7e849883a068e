# Execution contracts (docs/contract.md), per family x composition:
#   contract_draft   build from the composition YAML; gate discharges stay "pending"
#   contract_admit   verify the draft against the family's gate artifacts; if admitted, rebuild
#                    with --gates (discharges name the passing artifacts), else keep the draft
#   contract_show    digests, entry count, tolerance claims (`contract show --json`)
#   contract_verify  the final verdict (`contract verify --json`), recorded, never a crash
# The CLI runs in a subprocess; exit 2 (bad input) fails the job, "not admitted" is recorded.


rule contract_draft:
    input:
        composition=composition_file,
        model=model_file,
    output:
        contract_path("{family}", "{composition}", ".draft"),
    log:
        f"{LOGS}/contract_draft/{{family}}_{{composition}}.log",
    params:
        args=build_args,
    localrule: True
    run:
        with open(log[0], "w") as lf:
            isoreport.run_cli([*params.args, "--out", output[0]], lf)


rule contract_admit:
    input:
        composition=composition_file,
        model=model_file,
        draft=contract_path("{family}", "{composition}", ".draft"),
        gates=lambda wc: gates_dir(wc.family),
    output:
        contract=contract_path("{family}", "{composition}", ""),
        record=contract_path("{family}", "{composition}", ".admission"),
    log:
        f"{LOGS}/contract_admit/{{family}}_{{composition}}.log",
    params:
        args=build_args,
    localrule: True
    run:
        isoreport.admit_contract(family=wildcards.family, composition=wildcards.composition,
                                 build_args=params.args, draft=input.draft,
                                 gates_dir=input.gates, out=output.contract, record=output.record,
                                 log=log[0])


rule contract_show:
    input:
        contract_path("{family}", "{composition}", ""),
    output:
        contract_path("{family}", "{composition}", ".show"),
    log:
        f"{LOGS}/contract_show/{{family}}_{{composition}}.log",
    localrule: True
    run:
        with open(log[0], "w") as lf:
            isoreport.run_cli(["contract", "show", input[0], "--json"], lf, stdout=output[0])


rule contract_verify:
    input:
        contract=contract_path("{family}", "{composition}", ""),
        gates=lambda wc: gates_dir(wc.family),
    output:
        contract_path("{family}", "{composition}", ".verify"),
    log:
        f"{LOGS}/contract_verify/{{family}}_{{composition}}.log",
    localrule: True
    run:
        isoreport.verify_contract(contract=input.contract, gates_dir=input.gates, record=output[0],
                                  log=log[0])

# Execution contracts (docs/contract.md), per family x composition:
#   contract_draft   build from the composition YAML; gate discharges stay "pending"
#   contract_admit   verify the draft against the family's gate artifacts; if admitted, rebuild
#                    with --gates (discharges name the passing artifacts), else keep the draft
#   contract_show    digests, entry count, tolerance claims (`contract show --json`)
#   contract_verify  the final verdict (`contract verify --json`), recorded, never a crash
# Exit 2 (bad input) fails the job; "not admitted" is recorded (workflow/scripts/contracts.py).


rule contract_draft:
    input:
        composition=composition_file,
        model=model_file,
        code=CODE_VERSION,
    output:
        contract_path("{family}", "{composition}", ".draft"),
    log:
        f"{LOGS}/contract_draft/{{family}}_{{composition}}.log",
    params:
        model=lambda wc: model_name(wc.family),
        arch=ARCH,
    priority: RL_PATH_PRIORITY
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "isoexec contract build --family {wildcards.family} --composition {wildcards.composition}"
        " --model {params.model:q} --arch {params.arch} --out {output:q} > {log:q} 2>&1"


rule contract_admit:
    input:
        composition=composition_file,
        model=model_file,
        draft=contract_path("{family}", "{composition}", ".draft"),
        gates=lambda wc: gates_dir(wc.family),
        code=CODE_VERSION,
    output:
        contract=contract_path("{family}", "{composition}", ""),
        record=contract_path("{family}", "{composition}", ".admission"),
    log:
        f"{LOGS}/contract_admit/{{family}}_{{composition}}.log",
    params:
        args=build_args,
    priority: RL_PATH_PRIORITY
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/contracts.py"


rule contract_show:
    input:
        contract=contract_path("{family}", "{composition}", ""),
        code=CODE_VERSION,
    output:
        contract_path("{family}", "{composition}", ".show"),
    log:
        f"{LOGS}/contract_show/{{family}}_{{composition}}.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "isoexec contract show {input.contract:q} --json > {output:q} 2> {log:q}"


rule contract_verify:
    input:
        contract=contract_path("{family}", "{composition}", ""),
        gates=lambda wc: gates_dir(wc.family),
        code=CODE_VERSION,
    output:
        contract_path("{family}", "{composition}", ".verify"),
    log:
        f"{LOGS}/contract_verify/{{family}}_{{composition}}.log",
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/contracts.py"

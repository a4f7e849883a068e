# Kernel benchmarks (docs/benchmarks.md): `isoexec bench NAME` measures ours and the stock kernel in
# the same run and writes results/<run>/bench/<name>.json (workflow/scripts/bench.py; on a GPU
# arch the job gets a GPU of its own); kernels_table renders them into paper_figures/<run>/kernels.md.
# A benchmark reruns when it is missing, forced, or the code version changed.


rule bench:
    input:
        code=CODE_VERSION,
    output:
        f"{RES}/bench/{{name}}.json",
    log:
        f"{LOGS}/bench/{{name}}.log",
    params:
        device="cpu" if ARCH == "cpu" else "cuda",
        quick=BENCH_QUICK,
    wildcard_constraints:
        name="gemm|attention|rmsnorm|logprob|engine|cpr|train|moe|tp_linear",
    resources:
        gpu=JOB_GPUS,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/bench.py"


rule kernels_table:
    input:
        results=[bench_path(n) for n in BENCHES],
        code=CODE_VERSION,
    output:
        md=report(f"{FIG}/kernels.md", category="Benchmarks"),
        csv=report(f"{FIG}/kernels.csv", category="Benchmarks"),
    log:
        f"{LOGS}/kernels_table.log",
    params:
        run=RUN,
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"


rule cpr_table:
    input:
        result=bench_path("cpr"),
        code=CODE_VERSION,
    output:
        report(f"{FIG}/cpr.md", category="Benchmarks"),
    log:
        f"{LOGS}/cpr_table.log",
    params:
        run=RUN,
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"

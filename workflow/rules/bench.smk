# Kernel benchmarks (docs/benchmarks.md): `isoexec bench NAME` measures ours and the stock kernel in
# the same run and writes results/<run>/bench/<name>.json; kernels_table renders them into
# paper_figures/<run>/kernels.md. GPU results are committed, so on a GPU config an existing JSON
# is kept (Snakemake reruns a benchmark only when it is missing or forced).


rule bench:
    output:
        f"{RES}/bench/{{name}}.json",
    log:
        f"{LOGS}/bench/{{name}}.log",
    params:
        device="cpu" if ARCH == "cpu" else "cuda",
        quick=BENCH_QUICK,
    wildcard_constraints:
        name="gemm|attention|rmsnorm|logprob|engine|cpr|train",
    resources:
        gpu=GATE_GPUS,
        runtime=30,
    run:
        isobench.run_bench(wildcards.name, output[0], params.device, params.quick, log[0])


rule kernels_table:
    input:
        [bench_path(n) for n in BENCHES],
    output:
        md=report(f"{FIG}/kernels.md", category="Benchmarks"),
        csv=f"{FIG}/kernels.csv",
    log:
        f"{LOGS}/kernels_table.log",
    params:
        run=RUN,
    localrule: True
    run:
        isobench.render(input, output.md, output.csv, params.run, log[0])


rule cpr_table:
    input:
        bench_path("cpr"),
    output:
        report(f"{FIG}/cpr.md", category="Benchmarks"),
    log:
        f"{LOGS}/cpr_table.log",
    params:
        run=RUN,
    localrule: True
    run:
        n = isobench.write_cpr_table(input[0], output[0], params.run)
        Path(log[0]).write_text(f"{n} CPR stages rendered\n")

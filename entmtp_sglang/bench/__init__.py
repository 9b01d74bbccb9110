"""`entmtp bench`: the benchmark suite across tasks, systems and batch sizes.

    systems.py    the System interface and the registry (a server-driven system is one new module)
    workload.py   the task streams from the held-out prompt sets (incl. the mixed agent session)
    reference.py  reference-engine systems: plain, static Medusa/Hydra, EAGLE-2 dynamic, adaptive, EntMTP, oracle
    hf.py         the outside peer: transformers greedy and prompt-lookup assisted generation
    runner.py     the interleaved, repeated measurement loop and the per-row metrics
    report.py     Markdown tables, JSON lines, plots
    config.py     BenchConfig, the --quick settings and --quick's side-by-side on SmolLM2
    processor.py  the processor every report names (model name; AVX2, AVX-512, AMX flags)
    cli.py        the `entmtp bench` subcommand
    sglang_benchmark.py  SGLang configurations side by side (bench/experiments/sglang_cpu.py), the server pool;
                         stock SGLang (this package's general plugin not loaded) as the product benchmark's baseline
    sglang_costs.py      ENTMTP's tree costs measured inside an SGLang server (python -m ...bench.sglang_costs)
    sglang_systems.py    those SGLang configurations as `entmtp bench` systems

Every benchmark's library code lives here; bench/ holds the scripts that run them. The SGLang adapter
(entmtp_sglang/sglang/) holds only what SGLang loads; the SGLang server launcher the benchmarks and the tests
start servers with is calibration's (entmtp_sglang/calibrate/server.py).

Import from the submodules (this package imports nothing, so `entmtp --help` stays fast).
"""

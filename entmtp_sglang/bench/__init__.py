"""`entmtp bench`: the benchmark suite across tasks, systems and batch sizes.

    systems.py    the System interface and the registry (a server-driven system is one new module)
    workload.py   the task streams from the held-out prompt sets (incl. the mixed agent session)
    reference.py  reference-engine systems: plain, static Medusa/Hydra, EAGLE-2 dynamic, adaptive, EntMTP, oracle
    hf.py         the outside peer: transformers greedy and prompt-lookup assisted generation
    runner.py     the interleaved, repeated measurement loop and the per-row metrics
    report.py     Markdown tables, JSON lines, plots
    config.py     BenchConfig and the --quick settings
    cli.py        the `entmtp bench` subcommand

Import from the submodules (this package imports nothing, so `entmtp --help` stays fast).
"""

"""Calibration: from a task's calibration prompts to a tree set of Pareto-optimal trees, all of it in this package.

    entmtp calibrate --drafter medusa --task code

1. Decode the calibration prompts greedily; at every position record the drafter's entropy and top-1
   margin for the next position, the target's entropy, and the rank vector of the true continuation
   (see `tree.construct`).
2. Pick the signal that best predicts acceptance (largest |correlation| with the accepted chain length;
   `policy/signals.py`) and split its range into quantile bins.
3. Per bin and node budget, build the tree that maximises the empirical expected accepted length.
4. Measure the step time of the candidate trees in situ (real engine steps, all trees interleaved
   step by step so they share the machine's conditions; batch 1, 8, 32), fit
   seconds = base + per_node * nodes + per_depth * depth, keep the trees that lie on some bin's Pareto
   frontier (cost vs. expected tokens per step) or are some bin's best value, and write the tree set
   with the fitted costs (+ a Pareto plot). With a measured cost table (`--cost-table`, `cost_table.py`)
   the step times of the same grid come from the table (another machine, e.g. a GPU) instead.

The modules, in the order calibration uses them:

    records.py         the reference engine's position records (`record_positions`), saved and loaded
    costs.py           step costs: the one cost grid, in-situ timing, the fitted `StepCostModel`
    cost_table.py      a measured cost table (another machine's step times) in place of in-situ timing
    build.py           signals and bins, greedy trees per bin and budget, the Pareto-optimal set
    through_sglang.py  the same calibration through an SGLang server (`entmtp calibrate --engine sglang`)
    server.py          starting SGLang servers (also used by the benchmarks and the tests)
    replay.py          replaying recorded positions under a policy

What a serving worker and the policy need at run time (online refits, the ragged step cost, a set's provenance)
is `costs/`, below the policy and the SGLang adapter; this package imports it, never the reverse. Nothing is
imported here.
"""

"""Runtime cost models: what a serving worker and the policy price steps with and refit as they run, below both.

    online.py       records of verified steps and online refits of a set's acceptance and step costs
    ragged_cost.py  the cost of a ragged step (the batch budget's divisor), its fit and its online refit
    provenance.py   what a tree set records about how it was made (the refits amend it; calibration builds it)

These import `tree/`, torch, numpy and the standard library, never the policy, the SGLang adapter, the engines,
calibration or the benchmarks, so `policy/`, `sglang/` and `calibrate/` all sit above them. Calibration itself (the
offline grid, in-situ timing, `StepCostModel`) is `calibrate/`. Nothing is imported here, so importing one module
stays light.
"""

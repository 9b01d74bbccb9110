"""Every tree policy by name, in one place: the CLI's `--policy` choices and their help, the EntMTP policies
`policies.entmtp_policy` builds, what SGLang's `ENTMTP_POLICY` accepts (`sglang/config.py`) and the reference
benchmark's system kinds (`bench/reference.py`) all read `POLICIES`. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    summary: str                 # `entmtp generate --help`, one line per line
    tree_set: bool = False       # chooses among the trees of a set (`--tree-set`)
    predictor: bool | None = False  # the set's per-node acceptance predictor: True needs it, None where it has one
    staged: bool = False         # re-chooses after each drafted level
    rebuilds_set: bool = False   # rebuilt from the set's calibration records (not `entmtp_policy`'s)
    server: bool = False         # SGLang's ENTMTP_POLICY accepts it
    cli: bool = True             # `entmtp generate --policy` offers it (oracle: benchmarks only)


POLICIES: dict[str, PolicyInfo] = {p.name: p for p in (
    PolicyInfo("entmtp", "the default: entmtp-predictor where the set carries an acceptance predictor, else\n"
                         "entmtp-bins", tree_set=True, predictor=None, server=True),
    PolicyInfo("entmtp-bins", "the set's signal bins (draft margin or entropy) -> the tree with the most expected\n"
                              "tokens per second, with acceptance feedback and hysteresis", tree_set=True, server=True),
    PolicyInfo("entmtp-predictor", "per-node acceptance predicted from the drafter's probabilities (OPT-Tree's "
                                   "objective)", tree_set=True, predictor=True, server=True),
    PolicyInfo("entmtp-staged", "entmtp-predictor, re-choosing after each drafted level among the prefixes of the\n"
                                "chosen tree, with the drafted nodes' own probabilities (drafts and verifies less "
                                "when\nthe early drafts look weak)", tree_set=True, predictor=True, staged=True),
    PolicyInfo("entmtp-paper", "the paper's rule: a sliding window of target entropy picks the bin (the set is "
                               "rebuilt\nfrom its calibration records, which a checkout ships next to it)",
               tree_set=True, rebuilds_set=True),
    PolicyInfo("static", "one tree (--tree) every step"),
    PolicyInfo("adaptive", "SGLang's --speculative-adaptive rule: an EMA of accepted length picks the chain depth"),
    PolicyInfo("eagle2", "EAGLE-2 style: draft --tree, verify the --keep most confident nodes"),
    PolicyInfo("oracle", "the best tree of the set at every step, in hindsight (the ceiling)", tree_set=True,
               cli=False),
)}

CLI_POLICIES = tuple(n for n, p in POLICIES.items() if p.cli)
ENTMTP_POLICIES = tuple(n for n, p in POLICIES.items() if p.tree_set and p.cli and not p.rebuilds_set)
SERVER_POLICIES = tuple(n for n, p in POLICIES.items() if p.server)


def policy_help() -> str:
    """The `policies (--policy):` lines of `entmtp generate --help`."""
    lines = []
    for p in POLICIES.values():
        if p.cli:
            first, *rest = p.summary.split("\n")
            lines += [f"  {p.name:<16} {first}", *(" " * 19 + line for line in rest)]
    return "\n".join(lines)

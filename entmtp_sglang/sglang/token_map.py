"""ENTMTP drafts over the drafter's own vocabulary by default, where the drafter ships one.

A drafter trained over a draft vocabulary (`draft_vocab.safetensors` beside its weights, as SmolLM2's EAGLE
drafter) drafts in SGLang over the whole target vocabulary unless `--speculative-token-map` names that
vocabulary: an output layer about six times larger for SmolLM2, paid at every draft level and draft extend.
So when ENTMTP starts with such a drafter and no map, it passes the map itself (`--speculative-token-map ''`
is not a thing SGLang accepts; to draft over the whole vocabulary, serve a drafter without the file).
An EAGLE-3 drafter carries its map in its checkpoint (`d2t`, which SGLang loads as the draft's `hot_token_id`
and ENTMTP applies to its drafts the same way) and SGLang ignores a token map for it, so none is passed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .eagle3 import EAGLE3, draft_kind

logger = logging.getLogger("entmtp_sglang.sglang")


def default_token_map(server_args) -> str | None:
    """Set `server_args.speculative_token_map` to the drafter's vocabulary when it ships one and none is given;
    returns the path set, or None."""
    if getattr(server_args, "speculative_token_map", None):
        return None
    draft = getattr(server_args, "speculative_draft_model_path", None)
    if not draft or not (Path(draft) / "draft_vocab.safetensors").exists() or draft_kind(draft) == EAGLE3:
        return None
    from ..model.load import draft_token_map

    try:
        path = str(draft_token_map(draft))
    except OSError as e:   # a read-only drafter directory: SGLang drafts over the whole vocabulary
        logger.warning("ENTMTP: cannot write the draft vocabulary's token map next to %s (%s); drafting over "
                       "the whole vocabulary (pass --speculative-token-map FILE from `entmtp model token-map`)",
                       draft, e.strerror)
        return None
    server_args.speculative_token_map = path
    logger.info("ENTMTP: drafting over the drafter's own vocabulary (--speculative-token-map %s)", path)
    return path

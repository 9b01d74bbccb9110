"""Which drafter kind a draft checkpoint served under ENTMTP is: an EAGLE-3 one or an EAGLE one.

    draft_kind(path) -> "eagle3"   the checkpoint's config names an *Eagle3* architecture (`LlamaForCausalLMEagle3`,
                                   as model/eagle3.py exports): SGLang captures the target's auxiliary hidden
                                   states, the draft reads fc(low, mid, high) at draft extend and its own
                                   output inside the tree, over its own vocabulary (d2t)
                     -> "eagle"    anything else: an EAGLE draft, or a target's own MTP layer (NEXTN)

The kind decides `EntMtpSpecAlgo.is_eagle3()` and which shipped tree set serves by default
(`<model>-eagle3-mixed[-sglang].json`, else the EAGLE set: config.py). A local directory's config.json is read
as it is (no SGLang needed); anything else through SGLang's `get_config` (a Hub id), imported only then.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

logger = logging.getLogger("entmtp_sglang.sglang")

EAGLE3 = "eagle3"
EAGLE = "eagle"


def draft_kind(draft_model_path: str | Path | None) -> str:
    return EAGLE3 if any("Eagle3" in arch for arch in draft_architectures(draft_model_path)) else EAGLE


@functools.lru_cache(maxsize=8)
def draft_architectures(draft_model_path: str | Path | None) -> tuple[str, ...]:
    """The `architectures` of the draft checkpoint's config; () when there is none or it cannot be read (SGLang's
    own loading then reports the problem)."""
    if not draft_model_path:
        return ()
    local = Path(str(draft_model_path)) / "config.json"
    try:
        if local.is_file():
            return tuple(json.loads(local.read_text()).get("architectures") or ())
        from .sglang_api import get_config

        return tuple(getattr(get_config(str(draft_model_path), trust_remote_code=False), "architectures", None)
                     or ())
    except Exception:   # unreadable here: SGLang's own loading reports it
        logger.debug("ENTMTP: cannot read the draft config at %s", draft_model_path, exc_info=True)
        return ()

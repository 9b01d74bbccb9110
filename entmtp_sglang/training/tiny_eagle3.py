"""The bundled model's EAGLE-3 drafter (`entmtp_sglang/models/entmtp-tiny/eagle3/`), made in one command:

    python -m entmtp_sglang.training.tiny_eagle3            # about 2 min of data + 5 min of training on 2 cores

It exists so that CI serves a *trained* EAGLE-3 drafter through SGLang (tests/test_sglang_eagle3.py) and the
reference engine (tests/test_eagle3.py), on a model small enough for the test suite. Two steps, both the project's
own machinery with a small recipe (`RECIPE`, `TRAIN`):

1. a fixed-data set of the bundled target (`training/fixed_data.py`: the same wheel corpus as SmolLM2's, rendered as
   plain "User:/Assistant:" turns since the model has no chat template; 240k positions, sequences of at most 512
   tokens, the model's context), into `$ENTMTP_CACHE/tiny-distill/` (never the repository);
2. EAGLE-3 training with training-time test over it (`training/eagle3_train.py`; 3 levels, a 1,024-token draft
   vocabulary, the target's own intermediate size, one pass over the 5 training shards, the last held out).

The run's `sglang/` checkpoint (SGLang's layout, head included: SGLang only shares the target's head with a draft
over the whole vocabulary) is copied into the package, with `training.json` beside it (the recipe, the held-out
agreement, seconds), and the model card's EAGLE-3 section is rewritten. The target's six layers make SGLang's
default capture [2, 3, 3] repeat a layer, so the drafter fuses the residual streams entering layers 1, 3 and 5
(`fixed_data.eagle3_layers`), written in its config as `eagle_aux_hidden_state_layer_ids` [0, 2, 4].
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from . import eagle3_train as et
from . import fixed_data as fd

RECIPE = fd.Recipe(positions=240_000, shard_positions=40_000, max_tokens=512, batch_tokens=8192, top_k=32)
TRAIN = et.TrainConfig(steps=3, window=512, batch_tokens=2048, lr=2e-3, draft_vocab=1024, minutes=60.0,
                       positions=200_000, eval_windows=64)
CARD_HEADING = "## EAGLE-3 drafter (`eagle3/`)"


def card_section(summary: dict) -> str:
    held = summary["held_out"]
    by_source = ", ".join(f"{k} {v:.2f}" for k, v in held["depth1_agreement_by_source"].items())
    cfg = summary["config"]
    return f"""{CARD_HEADING}
- one Llama decoder layer over the target's fused residual streams entering layers {summary['capture_layers']}
  (`fc`), SGLang's `LlamaForCausalLMEagle3` layout, served as it is with `--speculative-draft-model-path`; its own
  head over a {summary['draft_vocab']}-token draft vocabulary (the target's most frequent next tokens; `d2t`)
- trained by `python -m entmtp_sglang.training.tiny_eagle3`: a fixed-data set of this target
  ({RECIPE.positions:,} positions of the wheel corpus, `training/fixed_data.py`), then {summary['positions']:,}
  positions of training-time test ({cfg['steps']} levels, lr {cfg['lr']}) in {summary['seconds']:.0f} s
- held-out agreement with the target's top token per level {held['agreement']}; level 1 by source: {by_source}
- recipe and numbers: `eagle3/training.json`
"""


def replace_section(card: Path, heading: str, section: str) -> None:
    """Put `section` (starting with `heading`) in the card in place of the section under that heading, or append it."""
    text = card.read_text()
    if heading in text:
        head, _, rest = text.partition(heading)
        nxt = rest.find("\n## ")
        text = head + section + (rest[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    card.write_text(text)


def write_card(card: Path, summary: dict) -> None:
    replace_section(card, CARD_HEADING, card_section(summary))


def run(model_dir: Path, work: Path, out: Path, threads: int = 0) -> dict:
    data = fd.build(model_dir, RECIPE, work / "tiny-distill", threads=threads, self_distilled=[])
    run_dir = work / "tiny-eagle3"
    if run_dir.exists():   # a fresh run: the shipped drafter is one run's output, not a resumed mixture
        shutil.rmtree(run_dir)
    summary = et.train(data, model_dir, run_dir, TRAIN, threads=threads)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir / "sglang", tmp)
    recipe = {"command": "python -m entmtp_sglang.training.tiny_eagle3", "data_recipe": asdict(RECIPE),
              "data": json.loads((data / "summary.json").read_text())["positions_by_source"],
              "train_config": asdict(TRAIN), **{k: summary[k] for k in ("positions", "seconds", "capture_layers",
                                                                        "draft_vocab", "held_out")}}
    (tmp / "training.json").write_text(json.dumps(recipe, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_card(model_dir / "MODEL_CARD.md", summary)
    return summary


def main(argv=None) -> int:
    from ..model.load import BUNDLED_MODEL
    from ..model.prepare import cache_root

    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.tiny_eagle3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="the target (default: the bundled model)")
    p.add_argument("--work", type=Path, default=None, help="data and run folder (default: $ENTMTP_CACHE)")
    p.add_argument("--out", type=Path, default=None, help="where the drafter goes (default: MODEL/eagle3)")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    summary = run(args.model, args.work or cache_root(), args.out or args.model / "eagle3", args.threads)
    print(json.dumps(summary["held_out"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

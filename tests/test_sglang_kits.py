"""SGLang's own speculative-decoding tests against ENTMTP on this CPU.

The sglang wheel ships the test kits its CI runs against every EAGLE / EAGLE-3 server
(`sglang.test.kits.spec_server_kits`: acceptance and EOS, logprobs against a prefill rescoring, penalties under
concurrency, grammar termination, hidden states, abort) together with the fixture they are written for
(`sglang.test.server_fixtures.spec_eagle_fixture.SpecEagleServerBase`). Here they run unchanged, their methods
mixed into one unittest class, against one server launched as an operator launches ENTMTP on CPU
(`--speculative-algorithm ENTMTP` with SmolLM2 and its shipped EAGLE drafter, `SGLangServer.cpu`) instead of the
fixture's CUDA launch. Only the per-config thresholds, which the kits read off the class for each model, are set
for this target (the fixture's EAGLE-3 preset sets its own the same way).

Left out, each with its reason on the skip: the GPU-sized radix-tree stress (about 300 requests and 265k tokens:
hours on 2 cores), the OpenAI `json_object` request without `max_tokens` (SmolLM2-135M does not close its JSON:
stock SGLang and ENTMTP, both float32, wrote the same 1,500 tokens of it and were still going), gsm8k accuracy and
max-token-1 throughput (a dataset download; a GPU throughput floor) and the parity kit (it launches its reference
with FlashInfer; greedy equality with plain SGLang is what the rest of this suite tests). `return_sampling_mask` is
refused under every speculative algorithm but DFlash by SGLang itself
(`spec_sampling_mask.validate_spec_sampling_mask_request`); ENTMTP is held to the same clear refusal, and to serving
on after it.

Slow (`-m slow`, 411 s here): the kits' long generations (5 x 512 and 1024 new tokens, the 160-request logprob sweep
with prompts up to 2,000 tokens, concurrent aborts of 1,024-token requests). The rest run in CI (77 s with the
server's start).
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

import pytest
import requests
from helpers.testing import FIXED_COSTS, import_sglang_or_skip

import_sglang_or_skip()
import_sglang_or_skip("sglang.test.kits.spec_server_kits")

from sglang.test.kits.spec_server_kits import (  # noqa: E402
    SpecCorrectnessKit,
    SpecFeatureKit,
    SpecGrammarKit,
    SpecHiddenStatesKit,
    SpecLogprobKit,
    SpecPenaltyKit,
)
from sglang.test.server_fixtures.spec_eagle_fixture import SpecEagleServerBase  # noqa: E402

from entmtp_sglang.calibrate.server import SGLangServer  # noqa: E402
from entmtp_sglang.model import prepare as prep  # noqa: E402

pytestmark = pytest.mark.sglang


class EntmtpCpuServer(SpecEagleServerBase):
    """The kits' fixture with its launch replaced: ENTMTP on CPU as `SGLangServer.cpu` starts it (SmolLM2, the
    shipped EAGLE drafter and tree set, the machine's linear path), with `--enable-return-hidden-states` for the
    hidden-states kit, as the fixture's knob adds it. The kits read `base_url`, `model`, `process` and
    `tokenizer` (the fixture's property, from `model`)."""

    @classmethod
    def setUpClass(cls):
        model = prep.prepare("smollm2", log=lambda m: None)
        cls.model = cls.target_model = str(model)
        cls._tokenizer = None
        logs = Path(tempfile.mkdtemp(prefix="sglang-kits-"))
        cls.server = SGLangServer.cpu("ENTMTP", model=model, log_path=logs / "entmtp.log",
                                      extra=("--enable-return-hidden-states",), env=FIXED_COSTS)
        cls.server.start()
        cls.base_url, cls.process = cls.server.url, cls.server.proc

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()


def _slow(kit_method):
    """A kit's test method, marked slow for this suite (pytest reads the mark off the function)."""
    def run(self):
        return kit_method(self)
    run.__name__, run.__doc__ = kit_method.__name__, kit_method.__doc__
    return pytest.mark.slow(run)


class TestSGLangSpecKitsOnEntmtp(SpecCorrectnessKit, SpecLogprobKit, SpecPenaltyKit, SpecFeatureKit,
                                 SpecGrammarKit, SpecHiddenStatesKit, EntmtpCpuServer):
    # The kits' acceptance floors are per model (the fixture's EAGLE-3 preset sets 1.6 / 1.3). SmolLM2-135M with
    # its EAGLE drafter trained here, measured on the kits' own prompts (2026-12-07, this CPU): 1.66 accepted per
    # step on the batch kit's four base-model openings, 4.74 on the FastAPI prompt of the acceptance kit; the floors
    # sit below, to catch a drafter or policy that stops speculating, not to restate the figures.
    acc_length_thres = 1.3
    batch_accept_len_thres = 1.3

    test_acc_length = _slow(SpecCorrectnessKit.test_acc_length)
    test_eos_token = _slow(SpecCorrectnessKit.test_eos_token)
    test_logprob_mixed = _slow(SpecLogprobKit.test_logprob_mixed)
    test_logprob_match = _slow(SpecLogprobKit.test_logprob_match)
    test_request_abort = _slow(SpecFeatureKit.test_request_abort)

    @unittest.skip("GPU-sized: about 300 requests and 265k prompt tokens through the radix tree, hours on 2 cores")
    def test_radix_attention(self):
        pass

    @unittest.skip("an OpenAI json_object request without max_tokens: SmolLM2-135M does not close its JSON (past "
                   "1,500 tokens, the same tokens with and without speculation in float32); JSON under schemas is "
                   "tested by the grammar kit and tests/test_sglang_forced.py")
    def test_constrained_decoding(self):
        pass

    def test_sampling_mask_is_refused_as_sglang_refuses_it_for_eagle_and_the_server_serves_on(self):
        """SpecSamplingMaskKit's request: SGLang supports `return_sampling_mask` only for DFlash and refuses it for
        every other speculative algorithm with HTTP 400 and one line; ENTMTP gives the same, and serves the next
        request."""
        body = {"text": ["The capital of France is"] * 2,
                "sampling_params": [{"temperature": 0.0, "max_new_tokens": 7, "ignore_eos": True},
                                    {"temperature": 1.0, "top_k": 10, "max_new_tokens": 7, "ignore_eos": True}],
                "return_sampling_mask": True}
        r = requests.post(self.base_url + "/generate", json=body, timeout=120)
        self.assertEqual(r.status_code, 400, r.text)
        self.assertIn("return_sampling_mask is not supported with speculative decoding", r.text)
        ok = requests.post(self.base_url + "/generate", timeout=120, json={
            "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
        self.assertEqual(ok["meta_info"]["completion_tokens"], 8, ok)
        self.assertIsNone(self.process.poll())

"""The tables of every SGLang function this package hooks and every method the worker replaces on an instance
(`entmtp_sglang/sglang/patches.py`, and each hooking module's own `HOOKED`): each entry resolves in the installed
SGLang with the parameters we rely on, and only a registered instance patch can be installed.

SGLang is imported inside the tests that need it (they skip without it), never when this module is collected.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from entmtp_sglang.sglang import patches

WORKER = Path(__file__).resolve().parents[1] / "entmtp_sglang" / "sglang" / "worker.py"


def _hook_tables() -> dict[str, tuple[str, ...]]:
    """Every HookRegistry target of the package, with its parameters: the plugin's and each hooking module's."""
    from entmtp_sglang.sglang import admission, observe
    from entmtp_sglang.sglang.cpu import linear, rowwise, sampling

    out = dict(patches.HOOKED)
    for module in (admission, observe, sampling, linear, rowwise):
        out.update(module.HOOKED)
    return out


def test_every_hooked_function_resolves_with_its_parameters():
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip("sglang.srt.plugins.hook_registry")
    for dotted, params in _hook_tables().items():
        patches.check_signature(dotted, params)


def test_every_instance_patch_resolves_with_its_parameters():
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip("sglang.srt.speculative.eagle_worker_v2")
    assert set(patches.INSTANCE_PATCHES) == {"draft_forward", "draft_runner_forward", "draft_extend_for_decode",
                                             "target_forward"}
    for dotted, params in patches.INSTANCE_PATCHES.values():
        patches.check_signature(dotted, params)


def test_a_changed_signature_is_refused():
    with pytest.raises(patches.HookSignatureError, match="has parameters"):
        patches.check_signature("pathlib.Path.joinpath", ("self", "other"))
    with pytest.raises(patches.HookSignatureError, match="has no"):
        patches.check_signature("pathlib.Path.no_such_method", ("self",))


def test_an_unregistered_instance_patch_cannot_be_installed():
    obj = types.SimpleNamespace(forward=lambda batch: "sglang's")
    with pytest.raises(patches.UnregisteredPatchError, match="no instance patch 'forward'"):
        patches.patch_instance(obj, "forward", lambda batch: "ours")
    assert obj.forward(None) == "sglang's"


def test_a_registered_patch_is_checked_then_replaces_the_method_on_the_instance_alone(monkeypatch):
    checked = []
    monkeypatch.setattr(patches, "check_signature", lambda dotted, params: checked.append((dotted, params)))

    class Runner:
        def forward(self, forward_batch):
            return "sglang's"

    runner, other = Runner(), Runner()
    original = patches.patch_instance(runner, "target_forward", lambda forward_batch: "ours")
    assert checked == [patches.INSTANCE_PATCHES["target_forward"]]
    assert runner.forward(None) == "ours" and other.forward(None) == "sglang's" and original(None) == "sglang's"


def test_the_worker_assigns_no_sglang_method_itself():
    """Every method the worker replaces on an SGLang object goes through `patch_instance` (so through the table):
    no `obj.<a patched method's name> = ...` in worker.py."""
    names = {dotted.rpartition(".")[2] for dotted, _ in patches.INSTANCE_PATCHES.values()}
    assigned = [(node.lineno, ast.unparse(target)) for node in ast.walk(ast.parse(WORKER.read_text()))
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Attribute) and target.attr in names]
    assert assigned == []

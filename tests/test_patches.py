"""The tables of every SGLang function this package hooks and every method the worker replaces on an instance
(`entmtp_sglang/sglang/patches.py`, the only ones in the package): each entry resolves in the installed SGLang with
the parameters we rely on, and only a registered instance patch can be installed.

SGLang is imported inside the tests that need it (they skip without it), never when this module is collected.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from entmtp_sglang.sglang import patches

SGLANG_DIR = Path(__file__).resolve().parents[1] / "entmtp_sglang" / "sglang"
WORKER = SGLANG_DIR / "worker.py"


def test_every_hooked_function_resolves_with_its_parameters():
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip("sglang.srt.plugins.hook_registry")
    for dotted, params in patches.HOOKED.items():
        patches.check_signature(dotted, params)


def test_every_hooking_module_checks_its_entries_of_the_one_table():
    """Each module's hooks are in `patches.HOOKED` (its names are the table's), with none left over."""
    from entmtp_sglang.sglang import admission, observe, plugin, requests
    from entmtp_sglang.sglang.cpu import linear, rowwise, sampling

    per_module = {
        plugin: ("DRAFT_BACKEND_FACTORY", "OUTPUT_STREAMER", "PENALTIES"),
        admission: ("VALIDATE", "RESERVED", "ROW_HEADROOM", "INPUT_LENGTH", "AVERAGE_ACCEPT"),
        observe: ("SAMPLE",),
        requests: ("RELEASE", "SPECULATIVE_STATE"),
        sampling: ("USES_GREEDY",),
        linear: ("LINEAR_APPLY", "LM_HEAD"),
        rowwise: ("RMSNORM", "SILU_AND_MUL", "ROPE"),
    }
    hooked = [getattr(module, name) for module, names in per_module.items() for name in names]
    assert len(hooked) == len(set(hooked)) == len(patches.HOOKED) == 17
    assert set(hooked) == set(patches.HOOKED)
    assert patches.hooked(patches.SAMPLE) == {patches.SAMPLE: ("verify_input", "batch", "logits_output")}
    with pytest.raises(KeyError):
        patches.hooked("sglang.srt.not_in_the_table")


def test_no_module_but_patches_keeps_a_hook_table():
    """`patches.HOOKED` is the package's only table of hooked SGLang functions: no other module under
    entmtp_sglang/sglang/ assigns a module-level `HOOKED`."""
    found = []
    for path in sorted(SGLANG_DIR.rglob("*.py")):
        if path.name == "patches.py" and path.parent == SGLANG_DIR:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if "HOOKED" in names:
                found.append(f"{path.relative_to(SGLANG_DIR)}:{node.lineno}")
    assert found == []


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

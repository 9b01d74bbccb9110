"""Test-only code, out of the wheel: `testing` (SGLang import-or-skip, a chi-square test) and `tiny_checkpoints`
(tiny checkpoints of the drafter layouts SGLang serves, written at test time). `pythonpath = ["tests"]` in
pyproject.toml puts them on pytest's path."""

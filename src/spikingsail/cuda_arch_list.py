"""``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder reads it (standard library only: the doctor
judges it without importing torch)."""

from __future__ import annotations

import re

_ENTRY = re.compile(r"(\d+\.\d+)(\+PTX)?")
"""An entry as DeepSpeed's op builder reads it: MAJOR.MINOR[+PTX]."""


def unreadable_cuda_archs(arch_list: str | None) -> list[str]:
    """The entries of ``TORCH_CUDA_ARCH_LIST`` that DeepSpeed's op builder cannot read.

    torch also takes arch-specific and named entries ("9.0a", "10.0f", "Hopper"); DeepSpeed reads
    each entry as MAJOR.MINOR[+PTX] and stops with ``ValueError: invalid literal for int()`` before
    it compiles, or loads a compiled, CUDA op (FusedAdam, CPU Adam on a GPU node)."""
    entries = (arch_list or "").replace(";", " ").split()
    return [entry for entry in entries if not _ENTRY.fullmatch(entry)]


def readable_cuda_archs(arch_list: str | None) -> str:
    """The entries DeepSpeed can read, each unreadable "9.0a" as its plain "9.0" ("" if none)."""
    readable: list[str] = []
    for entry in (arch_list or "").replace(";", " ").split():
        plain = re.match(r"\d+\.\d+", entry)
        if plain and plain.group() not in readable and f"{plain.group()}+PTX" not in readable:
            readable.append(entry if _ENTRY.fullmatch(entry) else plain.group())
    return ";".join(readable)


def readable_setting(arch_list: str | None, *, or_unset: bool = False) -> str:
    """The setting to start with instead: ``TORCH_CUDA_ARCH_LIST="9.0"``, or unset where no entry is
    readable; ``or_unset`` adds that unsetting it works too, and what DeepSpeed then builds for."""
    readable = readable_cuda_archs(arch_list)
    unset = "DeepSpeed then builds for the GPUs it sees"
    if not readable:
        return f"TORCH_CUDA_ARCH_LIST unset ({unset})" if or_unset else "TORCH_CUDA_ARCH_LIST unset"
    return f'TORCH_CUDA_ARCH_LIST="{readable}"' + (f" (or unset: {unset})" if or_unset else "")

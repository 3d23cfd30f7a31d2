"""``sail checkpoint``: list, verify and export a run's checkpoints, offline (no GPU, no process group).

sail checkpoint ls DIR                      tags, steps, world size, backend, size; * = latest
sail checkpoint verify DIR [--tag T]        every file against its manifest (size and SHA-256)
sail checkpoint export DIR [--tag T] --out model.safetensors | model.pt [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from spikingsail.checkpoint import export
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.errors import CheckpointError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sail checkpoint",
        description="List, verify and export the checkpoints of a run (its --checkpoints-path / "
        "checkpoint.path), on any machine: no GPU, no process group, whatever backend wrote them.",
    )
    commands = p.add_subparsers(dest="action", required=True, metavar="{ls,verify,export}")
    ls = commands.add_parser("ls", help="the checkpoints: tag, step, world size, backend, size")
    ls.add_argument("directory", type=Path, help="the run's checkpoint directory")
    verify = commands.add_parser("verify", help="check every file against the checkpoint's manifest")
    verify.add_argument("directory", type=Path, help="the run's checkpoint directory")
    verify.add_argument("--tag", help="one checkpoint (default: all of them)")
    out = commands.add_parser(
        "export",
        help="write the model's weights as one state dict (.safetensors or .pt), FSDP shards and "
        "ZeRO partitions gathered",
    )
    out.add_argument("directory", type=Path, help="the run's checkpoint directory")
    out.add_argument("--tag", help="the checkpoint (default: the latest that verifies)")
    out.add_argument("--out", type=Path, required=True, help="model.safetensors, or model.pt / .pth / .bin")
    out.add_argument("--dtype", choices=sorted(export.DTYPES), default="float32",
                     help="floating tensors are written in this dtype (default float32)")  # fmt: skip
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.action == "ls":
        return _ls(args.directory)
    if args.action == "verify":
        return _verify(args.directory, args.tag)
    return _export(args.directory, args.tag, args.out, args.dtype)


def _ls(directory: Path) -> int:
    found = export.describe(directory)
    if not found:
        print(f"{_shown(directory)}: no complete checkpoint")
        return 1
    rows = [("tag", "step", "world", "backend", "size", "written")]
    for info in found:
        written = datetime.datetime.fromtimestamp(info.created).strftime("%Y-%m-%d %H:%M:%S")
        tag = _shown(info.tag) + (" *" if info.latest else "")
        if info.problem:
            rows.append((tag, "?", "?", "DAMAGED", "?", written))
            continue
        rows.append((tag, str(info.global_steps), str(info.world_size), _shown(info.backend),
                     _size(info.size_bytes), written))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print("* latest")
    damaged = [info for info in found if info.problem]
    for info in damaged:
        print(f"{_shown(info.tag)}: DAMAGED: {_shown(info.problem)}")
    if damaged:
        print(f"{len(damaged)} of {len(found)} checkpoint(s) cannot be read; a resume or an export without "
              "--tag falls back to the newest good one", file=sys.stderr)  # fmt: skip
    return 1 if damaged else 0


def _verify(directory: Path, tag: str | None) -> int:
    store = CheckpointStore(directory)
    tags = [tag] if tag is not None else store.tags()
    if not tags:
        raise CheckpointError(f"{directory} holds no complete checkpoint",
                              fix="give the --checkpoints-path of a run")  # fmt: skip
    bad = 0
    for name in tags:
        try:
            store.verify(name)
        except CheckpointError as err:
            bad += 1
            print(f"{_shown(name)}: BAD: {_shown(export._told(err))}")
        else:
            files = len(store.metadata(name)["files"])
            print(f"{_shown(name)}: ok ({files} files match the manifest)")
    if bad:
        print(f"{bad} of {len(tags)} checkpoint(s) failed verification; a resume falls back to the newest "
              "good one", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


def _export(directory: Path, tag: str | None, out: Path, dtype: str) -> int:
    export.check_output_path(out)
    state, engine = export.read_model(directory, tag)
    metadata = export.model_metadata(str(engine.get("backend")), engine.get("global_steps"),
                                     checkpoint=str(Path(directory) / engine["tag"]))  # fmt: skip
    written = export.write_model(export.cast(state, export.DTYPES[dtype]), out, metadata)
    total = sum(t.numel() for t in state.values())
    print(f"{_shown(written)}: {len(state)} tensors, {total:,} values, {dtype}, from {engine['tag']} "
          f"(step {engine.get('global_steps')}, {engine.get('backend')} backend, "
          f"{engine.get('world_size')} process(es))")  # fmt: skip
    return 0


def _shown(text: object) -> str:
    """``text`` printable on any terminal: a file name's bytes that are not UTF-8 as escapes."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"

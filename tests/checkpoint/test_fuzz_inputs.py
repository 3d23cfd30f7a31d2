"""Generated damage to a real run's checkpoint directory, through ``sail checkpoint ls / verify / export``
in this process: manifests of every JSON shape and of raw bytes, ``engine.pt`` files of other
contents, ``latest`` pointers and ``--tag`` values.

Each command must end with its exit status and, when it refuses, SpikingSail's own message — an
exception escaping ``main`` fails the test with its traceback. And what the readers accept must
work later: a manifest ``read_manifest`` accepts (with files that match it) lists and exports from
that checkpoint; one it refuses is listed as damaged and the export falls back to the older tag.
Seeded and bounded (derandomized, no example database), under a minute in all.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spikingsail.checkpoint import export
from spikingsail.checkpoint.store import CheckpointStore, ManifestError, read_manifest
from spikingsail.errors import CheckpointError
from tests.checkpoint.damaged import NEWER, OLDER, copy_run, reseal, sail, write_run

FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Seeded and bounded: the same examples every run, nothing kept between runs."""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
NAMES = st.sampled_from(["files", "created", "global_steps", "micro_steps", "world_size", "format", "tag"])
FILE_NAMES = st.text(max_size=12) | st.sampled_from(["../engine.pt", "/etc/passwd", "a//b", "manifest.json",
                                                     "./engine.pt", "state/../engine.pt"])  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("fuzz") / "ck")


@contextlib.contextmanager
def copied(run: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as scratch:
        yield copy_run(run, Path(scratch) / "ck")


@st.composite
def manifests(draw: st.DrawFn, original: dict[str, Any]) -> bytes:
    """A manifest changed the ways a damaged or foreign one differs: keys replaced or removed, file
    entries changed or added, the whole of another JSON shape, or bytes that are not JSON."""
    kind = draw(st.sampled_from(["key", "drop", "entry", "add", "whole", "bytes", "cut"]))
    manifest = json.loads(json.dumps(original))
    name = draw(st.sampled_from(sorted(manifest["files"])))
    if kind == "key":
        manifest[draw(NAMES | st.text(max_size=8))] = draw(JSON)
    elif kind == "drop":
        manifest.pop(draw(NAMES), None)
    elif kind == "entry":
        manifest["files"][name][draw(st.sampled_from(["size", "sha256", "other"]))] = draw(JSON)
    elif kind == "add":
        manifest["files"][draw(FILE_NAMES)] = manifest["files"][name]
    elif kind == "whole":
        return json.dumps(draw(JSON)).encode()
    elif kind == "bytes":
        return draw(st.binary(max_size=64))
    text = json.dumps(manifest).encode()
    return text[: draw(st.integers(0, len(text)))] if kind == "cut" else text


def check_export(ck: Path, out: Path, expected: str) -> None:
    said = sail("checkpoint", "export", str(ck), "--out", str(out))
    assert said.code == 0, said.err
    assert f"from {expected} " in said.out, said.out + said.err


def test_generated_manifests(run: Path) -> None:
    original = json.loads((run / NEWER / "manifest.json").read_text())

    @settings(FUZZ, max_examples=40)
    @given(data=manifests(original))
    def check(data: bytes) -> None:
        with copied(run) as ck:
            (ck / NEWER / "manifest.json").write_bytes(data)
            try:
                accepted = read_manifest(ck / NEWER / "manifest.json")
            except ManifestError:
                accepted = None
            listed, verified = sail("checkpoint", "ls", str(ck)), sail("checkpoint", "verify", str(ck))
            assert verified.code in (0, 1) and "Traceback" not in verified.err
            try:
                CheckpointStore(ck).verify(NEWER)
                good = True
            except CheckpointError:
                good = False
            assert good <= (accepted is not None)
            if accepted is None:
                assert listed.code == 1 and f"{NEWER}: DAMAGED: " in listed.out, listed.out
            else:
                assert listed.code == 0, listed.out + listed.err
            check_export(ck, ck.parent / "model.pt", NEWER if good else OLDER)

    check()


@st.composite
def engine_files(draw: st.DrawFn, original: dict[str, Any]) -> Any:
    """What engine.pt might hold instead: another value, or the run's dict with a key replaced."""
    if draw(st.booleans()):
        return draw(JSON)
    changed = dict(original)
    key = draw(st.sampled_from(sorted(original)) | st.text(max_size=6))
    changed[key] = draw(JSON | st.sampled_from(["{", "[]", '{"zero_optimization": 3}', "dcp", "deepspeed"]))
    return changed


def test_generated_engine_files(run: Path) -> None:
    original = torch.load(run / NEWER / "engine.pt", weights_only=True)

    @settings(FUZZ, max_examples=25)
    @given(content=engine_files(original))
    def check(content: Any) -> None:
        with copied(run) as ck:
            torch.save(content, ck / NEWER / "engine.pt")
            reseal(ck / NEWER, "engine.pt")
            try:
                export._engine_file(ck / NEWER)
                accepted = True
            except CheckpointError:
                accepted = False
            listed = sail("checkpoint", "ls", str(ck))
            assert listed.code == (0 if accepted else 1), listed.out + listed.err
            named = sail("checkpoint", "export", str(ck), "--tag", NEWER, "--out", str(ck.parent / "m.pt"))
            assert named.code == (0 if accepted else 2), named.err
            if not accepted:
                assert "engine.pt" in named.err and "fix:" in named.err
            check_export(ck, ck.parent / "m.safetensors", NEWER if accepted else OLDER)

    check()


def test_generated_engine_file_bytes(run: Path) -> None:
    @settings(FUZZ, max_examples=10)
    @given(data=st.binary(max_size=200), cut=st.integers(0, 4000))
    def check(data: bytes, cut: int) -> None:
        with copied(run) as ck:
            whole = (ck / NEWER / "engine.pt").read_bytes()
            (ck / NEWER / "engine.pt").write_bytes(whole[:cut] + data)
            reseal(ck / NEWER, "engine.pt")
            listed = sail("checkpoint", "ls", str(ck))
            assert listed.code in (0, 1)
            said = sail("checkpoint", "export", str(ck), "--out", str(ck.parent / "m.pt"))
            assert said.code == 0, said.err

    check()


def test_generated_latest_pointers_and_tags(run: Path) -> None:
    with copied(run) as ck:

        @settings(FUZZ, max_examples=15)
        @given(pointer=st.binary(max_size=24) | st.sampled_from([b"", b"..", b"/etc", OLDER.encode()]),
               tag=st.text(max_size=16) | st.sampled_from(["", ".", "..", "latest", "/etc", OLDER]))  # fmt: skip
        def check(pointer: bytes, tag: str) -> None:
            (ck / "latest").write_bytes(pointer)
            named = pointer.decode("utf-8", "replace").strip()
            expected = named if named in (OLDER, NEWER) else NEWER  # a pointer to no tag: the newest
            check_export(ck, ck.parent / "m.pt", expected)
            assert sail("checkpoint", "ls", str(ck)).code == 0
            said = sail("checkpoint", "verify", str(ck), f"--tag={tag}")
            assert said.code == (0 if tag in (OLDER, NEWER) else 1), said.out + said.err
            exported = sail("checkpoint", "export", str(ck), f"--tag={tag}", "--out", str(ck.parent / "m.pt"))
            assert exported.code == (0 if tag in (OLDER, NEWER) else 2), exported.err

        check()


REFUSALS = {
    "not UTF-8": r"^byte \d+ is not UTF-8$",
    "not JSON": r"^not JSON: ",
    "not an object": r"^it holds a JSON \w+, not an object$",
    "no files": r"^(it has no 'files' object|'files' is a JSON \w+)$",
    "a bad file name": r"^'files' entry .*: not a relative path inside the checkpoint$",
    "a bad entry": r"^'files' entry .*: (a JSON \w+, not an object|'size' is|'sha256' is)",
    "a bad time": r"^'created' is .*, not a time",
    "a bad count": r"^'(global_steps|micro_steps|world_size)' is .*, not an integer",
}


def test_the_generated_manifests_reach_every_refusal(run: Path, tmp_path: Path) -> None:
    """The generator reaches each of the reader's refusals, not only bytes that are not JSON."""
    original = json.loads((run / NEWER / "manifest.json").read_text())
    path, seen = tmp_path / "manifest.json", set()

    @settings(FUZZ, max_examples=200)
    @given(data=manifests(original))
    def collect(data: bytes) -> None:
        path.write_bytes(data)
        try:
            read_manifest(path)
        except ManifestError as err:
            seen.update(name for name, pattern in REFUSALS.items() if re.search(pattern, err.why))

    collect()
    assert seen == set(REFUSALS)

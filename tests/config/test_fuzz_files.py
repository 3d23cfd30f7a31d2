"""Generated config files through the loader: bytes that are not UTF-8 or not JSON, JSON of other
shapes, and working configs with a key's value replaced by generated JSON of any type.

The loader with the chosen backend's checks (what initialize does before anything starts) must accept
a file or refuse it with SpikingSail's own error naming the file; a config they accept must then get
through the rest of what the engine does with it before training (optimizer, scheduler, precision,
one step: ``prepare_and_step`` of the enumerated fuzz in test_fuzz.py) without any error. Seeded and bounded (derandomized, no example database).
"""

from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spikingsail.backends import backend_class, load_config
from spikingsail.backends.horovod import horovod_options
from spikingsail.engine.initialize import _check_offload, _check_zero_stage
from spikingsail.errors import SailError
from tests.config.test_fuzz import configs, eval_path, paths, prepare_and_step, replaced

FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Seeded and bounded: the same examples every run, nothing kept between runs."""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
BASES = configs()


def nearby(value: Any) -> st.SearchStrategy[Any]:
    """Values of the same JSON type as ``value`` (and their edges), which the loader often accepts:
    the ones that must then work."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-(2**64), 2**64) | st.integers(-1, 3) | st.sampled_from([value + 1, value * 1000])
    if isinstance(value, float):
        return st.floats() | st.floats(0, 1) | st.sampled_from([0.0, 1e-300, 1e30, value * 10])
    if isinstance(value, str):
        return st.text(max_size=8) | st.sampled_from([value.upper(), value.lower(), value + " ", ""])
    if isinstance(value, list):
        return st.lists(st.floats(0, 2) | st.integers(0, 4), max_size=len(value) + 1)
    return JSON


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    """A working config with one value replaced (or a key added), written as JSON and maybe damaged
    as bytes; or other JSON; or other bytes."""
    kind = draw(st.sampled_from(["value", "value", "value", "any", "key", "bytes", "json", "cut", "latin-1"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    config, _ = BASES[draw(st.sampled_from(sorted(BASES)))]
    path = draw(st.sampled_from(sorted(paths(config))))
    if kind == "key":
        objects = [p for p in paths(config) if isinstance(eval_path(config, p), dict)]
        where = draw(st.sampled_from(["", *objects]))
        inside = eval_path(config, where) if where else config
        added = {**inside, draw(st.text(max_size=8)): draw(JSON)}
        config = replaced(config, where, added) if where else added
    else:
        original = eval_path(config, path)
        config = replaced(config, path, draw(JSON if kind == "any" else nearby(original)))
    text = json.dumps(config)
    if kind == "cut":
        return text.encode()[: draw(st.integers(0, len(text)))]
    if kind == "latin-1":
        return text.replace('"', '"\xe9', 1).encode("latin-1", "replace")
    return text.encode()


def loaded(data: bytes) -> dict[str, Any] | None:
    """The raw config read from ``data`` as a file, if the loader and the chosen backend's checks of
    it (what initialize does before anything starts) accept it; None when they refuse it."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "ds_config.json"
        path.write_bytes(data)
        try:
            config = load_config(path, world_size=1)
            backend = backend_class(config.sail.backend, config.source)
            _check_zero_stage(config, backend.name, backend.max_zero_stage)
            _check_offload(config, backend)
            if backend.name == "horovod":
                horovod_options(config)
            return dict(config.raw)
        except SailError as err:
            refused = err
    assert str(path) in refused.what  # the message names the file
    return None


@settings(FUZZ, max_examples=150)
@given(data=config_files())
def test_a_generated_config_file_is_refused_or_works(data: bytes) -> None:
    raw = loaded(data)
    if raw is None:
        return
    try:
        prepare_and_step(raw)
    except Exception:
        raise AssertionError(f"accepted, then failed:\n{traceback.format_exc(limit=-3)}") from None


def test_the_generated_files_are_both_accepted_and_refused() -> None:
    found: set[bool] = set()

    @settings(FUZZ, max_examples=60)
    @given(data=config_files())
    def collect(data: bytes) -> None:
        found.add(loaded(data) is not None)

    collect()
    assert found == {True, False}

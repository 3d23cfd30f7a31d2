"""Config files that are not UTF-8 JSON text of a readable size: each is refused by the loader with
the file, the line where it can tell, and the fix, never another exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikingsail.config import load_config
from spikingsail.errors import ConfigError


def refusal(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_config(path, 1)
    return caught.value


def test_a_byte_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_bytes(b'{\n  "train_micro_batch_size_per_gpu": 4,\n  "sail": {"log_dir": "\xe9t\xe9"}\n}\n')
    err = refusal(path)
    assert err.what == f"{path}:3: byte 64 (0xe9) is not UTF-8"
    assert err.fix == "save the file as UTF-8"


def test_an_integer_of_too_many_digits(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}")
    err = refusal(path)
    assert err.what == f"{path}: not a config" and "Exceeds the limit (4300 digits)" in err.why


def test_too_deep_a_nesting(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"sail": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = refusal(path)
    assert err.what == f"{path}: not a config" and "recursion" in err.why

"""Reading a config file: JSON, or hjson (comments, trailing commas) as DeepSpeed reads its config
files, where hjson is installed (it comes with DeepSpeed). A key given twice in one object is an
error naming its line, as DeepSpeed's reader makes it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from spikingsail.errors import ConfigError


def read_config(source: str | Path | dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    if source is None:
        return {}, "<no config>"
    if isinstance(source, dict):
        return dict(source), "<dict>"
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist",
            "--sail-config / --deepspeed_config must name a JSON file",
            "check the path, or pass a dict to spikingsail.initialize(config=...)",
        )
    text = _text(path)
    try:
        try:
            raw = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raw = _hjson(text, path, err)
    except (ValueError, RecursionError) as err:  # an integer of over 4300 digits, too deep a nesting
        raise ConfigError(f"{path}: not a config", str(err).split("; ")[0], "fix the JSON") from None
    except _DuplicateKeyError as err:
        raise ConfigError(
            f"{path}:{_line_of_second(text, err.key)}: the key '{err.key}' appears twice in one object",
            "JSON readers keep only the last one, so the other would be ignored without a word",
            "keep one of them",
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a JSON object", f"found {type(raw).__name__}")
    return raw, str(path)


def _text(path: Path) -> str:
    """The file's text: UTF-8 (JSON's encoding), naming the line of the first byte that is not."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the config file {path}", err.strerror or str(err),
                          "check its permissions") from None  # fmt: skip
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}:{line}: byte {err.start} ({data[err.start]:#04x}) is not UTF-8",
                          "a JSON config is UTF-8 text", "save the file as UTF-8") from None  # fmt: skip


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _line_of_second(text: str, key: str) -> int:
    """The line where an object repeats ``key``, 1-based: found by reading the JSON's objects, or in
    an hjson file (unquoted keys, comments) at the key's second appearance."""
    try:
        return _line_in_json(text, key)
    except (IndexError, AttributeError, ValueError):  # not JSON: hjson
        found = [m.start() for m in re.finditer(rf'(?m)^\s*"?{re.escape(key)}"?\s*:', text)]
        return text.count("\n", 0, found[1]) + 1 if len(found) > 1 else 1


def _line_in_json(text: str, key: str) -> int:
    objects: list[set[str]] = []
    string = re.compile(r'"(?:[^"\\]|\\.)*"')
    i = 0
    while i < len(text):
        char = text[i]
        if char == "{":
            objects.append(set())
        elif char == "}":
            objects.pop()
        elif char == '"':
            end = string.match(text, i).end()  # type: ignore[union-attr]  # valid JSON: a string ends
            name = json.loads(text[i:end])
            is_key = text[end:].lstrip().startswith(":") and objects
            if is_key and name == key and name in objects[-1]:
                return text.count("\n", 0, i) + 1
            if is_key:
                objects[-1].add(name)
            i = end
            continue
        i += 1
    return 1


def _hjson(text: str, path: Path, not_json: json.JSONDecodeError) -> Any:
    """The file as DeepSpeed reads it (``hjson.load``), once it is known not to be plain JSON."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(
            f"{path}:{not_json.lineno}:{not_json.colno}: not valid JSON",
            not_json.msg,
            "fix the JSON at that line; comments and trailing commas, which DeepSpeed reads, need hjson "
            "(pip install hjson, or install DeepSpeed, which brings it)",
        ) from None
    try:
        return hjson.loads(text, object_pairs_hook=_unique_keys)
    except hjson.HjsonDecodeError as err:
        raise ConfigError(
            f"{path}:{err.lineno}:{err.colno}: neither JSON nor hjson (which DeepSpeed reads)",
            err.msg,
            "fix the file at that line",
        ) from None

"""What the installed DeepSpeed makes of a config, asked of DeepSpeed itself: its config class
(``DeepSpeedConfig``, what ``deepspeed.initialize`` builds first) reads the dict SpikingSail would
hand it, and the top-level keys it looked up are the ones it knows. Its refusals — a key it
removed, a value its models reject, a sub-key none of them has — become SpikingSail's, naming the
file, before any process group exists. No list of DeepSpeed's keys is kept here: a DeepSpeed
upgrade changes what is accepted.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, KeysView, Mapping
from typing import Any

from spikingsail.errors import ConfigError


def read(handed: Mapping[str, Any], world_size: int, where: str) -> frozenset[str] | None:
    """The top-level keys DeepSpeed's config class looks up while it reads ``handed`` for a job of
    ``world_size`` data-parallel processes (those it knows); its refusal as a ``ConfigError`` naming
    ``where`` and the key it refuses. None when DeepSpeed does not import here (the deepspeed
    backend then says why when it is chosen)."""
    from spikingsail.backends.deepspeed_import import deepspeed_without_mlflow

    try:
        deepspeed = deepspeed_without_mlflow()
        from deepspeed.runtime import config as _  # noqa: F401
    except Exception:  # a DeepSpeed built for another torch raises more than ImportError
        return None
    seen: set[str] = set()
    try:
        _build(_Recording(handed, seen), world_size)
    except Exception as err:  # DeepSpeed refuses with DeepSpeedConfigError, ValueError, pydantic's errors...
        culprit = _culprit(dict(handed), world_size)
        raise ConfigError(
            f"{where}: DeepSpeed {deepspeed.__version__} refuses "
            + (f"{'.'.join(culprit)}" if culprit else "the config"),
            _reason(err, handed),
            "fix what it names, as for DeepSpeed's own launcher (or remove the key)",
        ) from None
    return frozenset(seen)


def _build(config: dict[str, Any], world_size: int) -> None:
    from deepspeed.runtime import config as ds_config

    with _world(ds_config.dist, world_size), _quiet(ds_config.logger):
        ds_config.DeepSpeedConfig(config)


def _culprit(handed: dict[str, Any], world_size: int) -> tuple[str, ...] | None:
    """The deepest key of ``handed`` whose removal alone makes DeepSpeed take it: what a refusal
    that names no key (a model's own check: "Partial offloading only supported for ZeRO Stage 3")
    is about."""

    def takes(path: tuple[str, ...]) -> bool:
        trial = copy.deepcopy(handed)
        holder = trial
        for key in path[:-1]:
            holder = holder[key]
        del holder[path[-1]]
        try:
            _build(trial, world_size)
        except Exception:
            return False
        return True

    def search(tree: dict[str, Any], path: tuple[str, ...]) -> tuple[str, ...] | None:
        for key, value in tree.items():
            if isinstance(key, str) and takes((*path, key)):
                deeper = search(value, (*path, key)) if isinstance(value, dict) else None
                return deeper or (*path, key)
        return None

    return search(handed, ())


class _Recording(dict[str, Any]):
    """The config, noting every top-level key looked up in it (DeepSpeed reads ``get``, ``in``,
    ``[]`` and ``in .keys()``)."""

    def __init__(self, data: Mapping[str, Any], seen: set[str]) -> None:
        super().__init__(data)
        self._seen = seen

    def __getitem__(self, key: str) -> Any:
        self._seen.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._seen.add(key)
        return super().__contains__(key)

    def keys(self) -> KeysView[str]:  # type: ignore[override]  # a view that notes look-ups
        return _RecordingKeys(self)

    def __copy__(self) -> _Recording:  # DeepSpeedConfig reads a copy.copy of what it is given
        return _Recording(self, self._seen)


class _RecordingKeys(KeysView[str]):
    def __contains__(self, key: object) -> bool:
        return key in self._mapping  # type: ignore[attr-defined]  # KeysView's own attribute: the _Recording


@contextlib.contextmanager
def _world(dist: Any, world_size: int) -> Iterator[None]:
    """DeepSpeed's config class asks ``deepspeed.comm`` for the rank and world size (and reads keys
    such as ``sequence_parallel_size`` only when it gets them): the job's, before its group exists."""
    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda *_args, **_kwargs: 0
    dist.get_world_size = lambda *_args, **_kwargs: world_size
    try:
        yield
    finally:
        dist.get_rank, dist.get_world_size = saved


@contextlib.contextmanager
def _quiet(logger: Any) -> Iterator[None]:
    """DeepSpeed's config class logs what it read at INFO: the engine logs the config itself."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _reason(err: BaseException, handed: Mapping[str, Any]) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):  # pydantic: each field's path in its model, and its message
        with contextlib.suppress(Exception):
            model = getattr(err, "title", "the config")
            return f"{model}: " + "; ".join(
                f"{_path(handed, e['loc'])}: {e['msg']} (found {_short(e.get('input'))})"
                if e["loc"]
                else e["msg"]
                for e in errors()
            )
    text = " ".join(str(err).split())  # DeepSpeed's own messages run over lines, with what to do
    return f"{type(err).__name__}: {text[:800] or type(err).__name__}"


def _path(handed: Mapping[str, Any], loc: tuple[Any, ...]) -> str:
    """A field's path in the config: its path in DeepSpeed's model, under the one section that has
    its first key (``zero_optimization.stagee``)."""
    inner = ".".join(map(str, loc))
    holders = [
        name for name, section in handed.items() if isinstance(section, dict) and loc and loc[0] in section
    ]
    return f"{holders[0]}.{inner}" if len(holders) == 1 else inner


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

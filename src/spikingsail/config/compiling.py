"""The ``compile`` section: ``torch.compile`` through the engine, on every backend.

Its first three keys are those of DeepSpeed's ``compile`` section before DeepCompile (DeepSpeed
0.14 to 0.16: ``enabled``, ``backend``, ``kwargs``), with their meaning: compile the model with that
``torch.compile`` backend and those keyword arguments. The others name ``torch.compile``'s own
arguments. The section's remaining keys are DeepSpeed's DeepCompile settings (``deepcompile``,
``passes``, …): the deepspeed backend hands those to DeepSpeed, whose config class checks them; no
other backend runs DeepCompile, so there they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from spikingsail.errors import ConfigError

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(kw_only=True, slots=True, frozen=True)
class CompileConfig:
    enabled: bool = False
    """Compile the model with ``torch.compile`` (in place: its names, state dict and hooks stay)."""
    backend: str = "inductor"
    """torch.compile's backend: a name of ``torch._dynamo.list_backends()`` or an importable
    ``module.function`` (DeepSpeed's rule)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of torch.compile (``options``, …), as DeepSpeed's key passed them."""
    mode: Mode | None = None
    """torch.compile's mode (None: its default)."""
    dynamic: bool | None = None
    """torch.compile's ``dynamic``: None marks a dimension dynamic once it changes (one recompilation);
    true compiles for any shape from the start; false compiles again for each new shape."""
    fullgraph: bool = False
    """Refuse a graph break (torch.compile's ``fullgraph``) instead of running its parts eagerly."""
    modules: tuple[str, ...] = ()
    """Compile each of these submodules on its own instead of the whole model: dotted names
    (``layers.0``) or class names (``Block``: every submodule of that class). Empty: the backend's
    choice (the whole model; with fsdp each block it shards, as torchtitan does)."""


KEYS = frozenset(f.name for f in fields(CompileConfig))


def deepcompile_keys(section: Any) -> dict[str, Any]:
    """The keys of the file's ``compile`` section that are DeepSpeed's (its DeepCompile settings)."""
    if not isinstance(section, dict):
        return {}
    return {key: value for key, value in section.items() if key not in KEYS}


def refuse_deepcompile(raw: dict[str, Any], where: str, backend: str, *, runs_it: bool) -> None:
    """A ``compile`` key that is not SpikingSail's where the backend does not run DeepCompile
    (``runs_it``: the deepspeed backend) is refused, saying what it likely is; where it does,
    ``deepcompile: true`` needs ``enabled: true``, since the engine compiles only then."""
    foreign = deepcompile_keys(raw.get("compile"))
    if not foreign:
        return
    if runs_it:
        if foreign.get("deepcompile") is True and raw["compile"].get("enabled") is not True:
            raise ConfigError(
                f"{where}: compile.deepcompile is true and compile.enabled is not",
                "DeepCompile works when the model is compiled, which the engine does only with "
                "compile.enabled (DeepSpeed's scripts call engine.compile() themselves)",
                'add "enabled": true to the compile section',
            )
        return
    key = next(iter(foreign))
    raise ConfigError(
        f"{where}: 'compile.{key}' is not a key of SpikingSail's compile section (backend {backend})",
        "the keys besides " + ", ".join(sorted(KEYS)) + " are DeepSpeed's DeepCompile settings, "
        "which only DeepSpeed's engine runs",
        'set "sail": {"backend": "deepspeed"} to use DeepCompile, or remove it (and use '
        '"compile": {"enabled": true} for torch.compile on any backend); check the spelling otherwise',
    )

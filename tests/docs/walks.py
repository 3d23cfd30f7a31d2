"""How far an object the user hands over travels through spikingsail, read off a real run.

A walk follows one object (the user's config, the user's optimizer, a launch request) through the
Python calls of a run (``sys.setprofile`` in every thread):

- **stays**: the functions that receive it as an argument (``self`` included);
- **rooms**: the modules those functions are in;
- **climbs back**: the calls that hand it from a package to one *above* it in the order of
  ``docs/concepts/layout.md`` (a callback up the layers; each caller-callee pair once).

The runs: a two-rank gloo job with the default config plus a checkpoint path, which trains, saves,
closes and resumes (``initialize`` to ``close`` on rank 0), and ``sail launch -n 2`` of a script that
prints one line. ``python -m tests.docs.walks`` prints the figures and every stay.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from tests.docs.test_layout import documented_order

Stay = tuple[str, str]  # (module, function's qualified name)


@dataclass
class Walk:
    """The stays and climbs of the objects ``match`` accepts."""

    match: Callable[[Any], bool]
    stays: dict[Stay, None] = field(default_factory=dict)
    climbs: dict[tuple[Stay, Stay], None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        order = documented_order()
        self.rank = {package: level for level, packages in enumerate(order) for package in packages}

    def see(self, frame: FrameType) -> None:
        module = frame.f_globals.get("__name__") or ""
        if not module.startswith("spikingsail."):
            return
        code = frame.f_code
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        values = frame.f_locals
        if not any(self.match(values.get(name)) for name in arguments):
            return
        here = (module, code.co_qualname)  # Python 3.11: the class and enclosing functions too
        self.stays.setdefault(here)
        caller = frame.f_back
        while caller is not None and not (caller.f_globals.get("__name__") or "").startswith("spikingsail."):
            caller = caller.f_back
        if caller is None:
            return
        source = caller.f_globals["__name__"]
        if self._level(module) < self._level(source):
            self.climbs.setdefault(((source, caller.f_code.co_qualname), here))

    def _level(self, module: str) -> int:
        """The package's place in layout.md's order (top 0); top-level modules sit below all."""
        return self.rank.get(module.split(".")[1], len(self.rank))

    def figures(self) -> tuple[int, int, int]:
        return len(self.stays), len({module for module, _ in self.stays}), len(self.climbs)


@contextmanager
def walking(*walks: Walk) -> Iterator[None]:
    """Trace the calls of this process's threads (those started inside too) into ``walks``."""

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            for walk in walks:
                walk.see(frame)

    os.register_at_fork(after_in_child=_stop_walking)  # a forked child (torchrun's agent) is not walked
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield
    finally:
        _stop_walking()


def _stop_walking() -> None:
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]


def _training_walks(checkpoints: str) -> dict[str, Walk] | None:
    """In each rank of a two-rank job: train, save, close, resume, train, close; rank 0's walks."""
    import torch
    import torch.nn.functional as F

    import spikingsail
    from spikingsail.config.schema import SailConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 4, "checkpoint": {"path": checkpoints}}
    walks = {
        "config": Walk(lambda value: value is config or isinstance(value, SailConfig)),
        "optimizer": Walk(lambda value: value is optimizer),
    }

    def steps(engine: spikingsail.Engine) -> None:
        for _ in range(2):
            x, y = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()

    with walking(*walks.values()):
        engine, _ = spikingsail.initialize(model=model, optimizer=optimizer, config=config)
        steps(engine)
        engine.save_checkpoint(checkpoints)
        engine.close()
        engine, _ = spikingsail.initialize(model=model, optimizer=optimizer, config=config, resume=True)
        steps(engine)
        engine.close()
    return walks if int(os.environ["RANK"]) == 0 else None


def training_walks() -> dict[str, Walk]:
    """The walks of the user's config and optimizer in rank 0 of a two-rank gloo job."""
    from tests.multiprocess import run_ranks

    with tempfile.TemporaryDirectory() as checkpoints:
        found = run_ranks(_as_data, 2, checkpoints)[0]
    assert found is not None
    return {name: Walk(_none, stays, climbs) for name, (stays, climbs) in found.items()}


def _none(value: Any) -> bool:
    return False


def _as_data(checkpoints: str) -> dict[str, tuple[dict[Stay, None], dict[tuple[Stay, Stay], None]]] | None:
    walks = _training_walks(checkpoints)
    return None if walks is None else {name: (w.stays, w.climbs) for name, w in walks.items()}


def launch_walk() -> Walk:
    """The walk of ``sail launch -n 2``'s launch request, in the launching process."""
    from spikingsail.cli.main import main
    from spikingsail.launchers.spec import LaunchRequest

    walk = Walk(lambda value: isinstance(value, LaunchRequest))
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "hello.py")
        with open(script, "w") as file:
            file.write("print('hello')\n")
        with walking(walk):
            code = main(["launch", "-n", "2", script])
    assert code == 0, f"sail launch -n 2 exited with {code}"
    return walk


def main() -> None:
    walks = {**training_walks(), "launch request": launch_walk()}
    for name, walk in walks.items():
        stays, rooms, climbs = walk.figures()
        print(f"{name}: {stays} stays, {rooms} rooms, {climbs} climbs back")
        for module, function in walk.stays:
            print(f"    {module}: {function}")
        for (source, _), (target, function) in walk.climbs:
            print(f"  ^ {source} -> {target}: {function}")


if __name__ == "__main__":
    main()

"""How far the user's config, the user's optimizer and a launch request travel through spikingsail
in a real run (``tests/docs/walks.py``): each part takes the section or object it needs, and what
it is handed does not go back up the layers that ``docs/concepts/layout.md`` orders."""

from __future__ import annotations

from typing import Any

import pytest

from tests.docs.walks import Walk, launch_walk, training_walks, walking

# (stays, rooms, climbs back) at most: docs/concepts/layout.md gives the same figures
LIMITS = {"config": (25, 12, 2), "optimizer": (15, 10, 2), "launch request": (12, 9, 1)}


@pytest.fixture(scope="module")
def walks() -> dict[str, Walk]:
    return {**training_walks(), "launch request": launch_walk()}


@pytest.mark.parametrize("name", list(LIMITS))
def test_a_walk_stays_within_its_limits(walks: dict[str, Walk], name: str) -> None:
    walk, limit = walks[name], LIMITS[name]
    stays, rooms, climbs = walk.figures()
    assert stays <= limit[0] and rooms <= limit[1] and climbs <= limit[2], (
        f"{name}: {stays} stays, {rooms} rooms, {climbs} climbs back (at most {limit}): "
        f"stays {sorted(walk.stays)}; climbs {sorted(walk.climbs)}"
    )


def test_the_measure_counts_the_functions_that_take_the_object_and_the_calls_up_the_layers() -> None:
    """A function of ``environments`` (the lowest package) that hands the object to one of ``cli``
    (the highest) and calls another without it: two stays in two modules, one climb back."""
    low: dict[str, Any] = {"__name__": "spikingsail.environments.example"}
    high: dict[str, Any] = {"__name__": "spikingsail.cli.example"}
    exec("def hand(take, value):\n    take(value)\n    take(None)\n    return take", low)
    exec("def take(value):\n    return value", high)
    marker = object()
    walk = Walk(lambda value: value is marker)
    with walking(walk):
        low["hand"](high["take"], marker)
        high["take"](marker)  # called from outside spikingsail: a stay, no climb
    assert list(walk.stays) == [
        ("spikingsail.environments.example", "hand"),
        ("spikingsail.cli.example", "take"),
    ]
    assert list(walk.climbs) == [
        (("spikingsail.environments.example", "hand"), ("spikingsail.cli.example", "take"))
    ]
    assert walk.figures() == (2, 2, 1)

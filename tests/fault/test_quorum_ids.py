"""Quorum ids that name their members (``replica_transport.QuorumIds``), over torchft's own
``QuorumResult``: what every member of a quorum computes alike, and what tells two quorums apart
when a lighthouse started again reuses a number. ``tests/fault/test_replica_lighthouse.py`` runs the case
end to end (a group that kept its old process group crashed)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from torchft._torchft import QuorumResult

from spikingsail.engine.replica_transport import QuorumIds

numbers = st.integers(min_value=0, max_value=2**40)
members = st.lists(
    st.from_regex(r"sail_[0-9]{1,2}:[0-9a-f]{8}", fullmatch=True), min_size=1, max_size=4, unique=True
)


class Answers:
    """A manager client's ``_quorum`` answering with the quorums given, in turn."""

    def __init__(self, *quorums: tuple[int, list[str]]) -> None:
        self._quorums = list(quorums)
        self.asked: list[dict[str, Any]] = []

    def _quorum(self, **kwargs: Any) -> QuorumResult:
        self.asked.append(kwargs)
        number, ids = self._quorums.pop(0)
        result = QuorumResult()
        result.quorum_id, result.replica_ids, result.max_step, result.store_address = number, ids, 7, "s:1"
        return result


def quorum_id(number: int, ids: list[str]) -> int:
    return int(QuorumIds(Answers((number, ids)))._quorum().quorum_id)


@given(numbers, members)
def test_every_member_computes_the_same_id_and_never_torchfts_unset_one(number: int, ids: list[str]) -> None:
    first, second = quorum_id(number, ids), quorum_id(number, list(ids))
    assert first == second
    assert 0 <= first < 2**62  # torchft's manager starts from -1: the first quorum always configures


@given(numbers, members, members)
def test_the_same_number_with_other_members_is_another_quorum(
    number: int, ids: list[str], others: list[str]
) -> None:
    """A lighthouse started again: its quorum 1 holds other processes than the first one's."""
    assert (quorum_id(number, ids) == quorum_id(number, others)) == (ids == others)


@given(numbers, numbers, members)
def test_the_same_members_under_another_number_is_another_quorum(
    number: int, other: int, ids: list[str]
) -> None:
    """The lighthouse moved on (a commit failure bumps its number with the same members)."""
    assert (quorum_id(number, ids) == quorum_id(other, ids)) == (number == other)


def test_the_rest_of_the_quorum_and_the_call_are_torchfts() -> None:
    answers = Answers((1, ["sail_0:aa"]), (1, ["sail_0:aa", "sail_1:bb"]))
    client = QuorumIds(answers)
    alone = client._quorum(group_rank=0, step=3)
    assert client.lighthouse_id == 1
    met = client._quorum(group_rank=0, step=4)
    assert client.lighthouse_id == 1 and alone.quorum_id != met.quorum_id
    assert (met.max_step, met.store_address, met.replica_ids) == (7, "s:1", ["sail_0:aa", "sail_1:bb"])
    assert answers.asked == [{"group_rank": 0, "step": 3}, {"group_rank": 0, "step": 4}]
    assert client._quorums is answers._quorums  # anything else is the client's own

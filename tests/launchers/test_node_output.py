"""What `sail launch` shows of a node's output (`launchers.node_output`): every line as printed,
except torch's c10d reverse-name line (explained once) and torchrun's traceback for a signal it was
sent (one line). The relay through a real multi-node launch is in `tests/cluster/test_ssh_pdsh.py`."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spikingsail.launchers import node_output
from spikingsail.launchers.node_output import NodeOutput

# torchrun's agent (torch 2.14) stopped by SIGTERM, as `python -m torch.distributed.run` prints it
SIGNALLED = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1142, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 377, in launch_agent
    result = agent.run()
             ^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 10183 got signal: 15""".splitlines()
CRASH = """\
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    1 / 0
ZeroDivisionError: division by zero""".splitlines()
NOISE = (
    "[W1130 07:42:38.934 socket.cpp:752] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
)


def shown(lines: list[str], *, host_prefixed: bool = False) -> list[str]:
    out = NodeOutput(host_prefixed=host_prefixed)
    return [kept for line in lines for kept in out.feed(line)] + out.end()


@pytest.fixture(autouse=True)
def not_explained_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_output, "_explained", threading.Event())
    monkeypatch.delenv("SAIL_LOG_LEVEL", raising=False)


def test_a_signalled_agents_traceback_is_one_line_and_the_lines_around_it_stay() -> None:
    lines = ["W... Received 15 death signal, shutting down workers", *SIGNALLED, "after"]
    assert shown(lines) == [lines[0], node_output.stopped_by(15), "after"]
    assert "SIGTERM" in node_output.stopped_by(15) and "--resume" in node_output.stopped_by(15)


def test_any_other_traceback_is_shown_whole_and_one_cut_short_at_the_end() -> None:
    assert shown(CRASH) == CRASH
    assert shown(["x", *SIGNALLED[:4]]) == ["x", *SIGNALLED[:4]]


def test_pdshs_hosts_are_read_apart() -> None:
    node1 = [f"node1: {line}" for line in SIGNALLED]
    node2 = [f"node2: {line}" for line in CRASH]
    interleaved = [line for pair in zip(node1, node2, strict=False) for line in pair] + node1[len(node2) :]
    out = shown(interleaved, host_prefixed=True)
    assert out == [*node2, "node1: " + node_output.stopped_by(15)]


def test_c10ds_reverse_name_line_is_explained_once() -> None:
    out = shown([NOISE, "a", NOISE, "b"]) + shown([NOISE])
    assert out == [node_output._C10D_EXPLAINED, "a", "b"]


def test_debug_logging_shows_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAIL_LOG_LEVEL", "DEBUG")
    assert shown([NOISE, *SIGNALLED]) == [NOISE, *SIGNALLED]


line = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=30)
traceback_parts = st.sampled_from([SIGNALLED[0], SIGNALLED[1], CRASH[-1], "", " x"])


@given(st.lists(st.one_of(line, traceback_parts), max_size=40), st.booleans())
def test_without_a_signalled_traceback_every_line_is_shown_in_order(lines: list[str], prefixed: bool) -> None:
    if prefixed:
        lines = [f"node{i % 2}: {text}" for i, text in enumerate(lines)]
    out = shown(lines, host_prefixed=prefixed)
    assert sorted(out) == sorted(lines)
    for host in ("node0: ", "node1: ") if prefixed else ("",):
        assert [x for x in out if x.startswith(host)] == [x for x in lines if x.startswith(host)]

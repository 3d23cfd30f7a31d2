"""Where SpikingSail reads a peer's file or flag differently from the peer, on purpose.

Everything else it reads as the peer does: the differential tests (``tests/launchers/test_peer_*``,
``tests/config/test_peer_deepspeed.py``) hand the same generated hostfiles, filters, host lists and
configs to the peer's own code and to SpikingSail's, and a difference fails them unless it is one of
these. The from-DeepSpeed and from-Horovod pages show this list as a table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Deviation:
    peer: str
    """Whose reading differs: ``DeepSpeed`` or ``Horovod``."""
    given: str
    """What the user wrote."""
    peer_does: str
    sail_does: str
    why: str


DEVIATIONS: dict[str, Deviation] = {
    "hostfile-count": Deviation(
        "DeepSpeed", "a hostfile line `HOST N`",
        "refuses the hostfile (a bad entry)",
        "reads N slots",
        "seed 000's hostfiles are written this way; `HOST slots=N` is read the same by both",
    ),
    "hostfile-bare-host": Deviation(
        "DeepSpeed", "a hostfile line `HOST` (no slot count) with `--nproc-per-node N`",
        "refuses the hostfile (a bad entry)",
        "gives the host N slots; without `--nproc-per-node` it refuses, naming the line",
        "a list of host names is how torchrun users keep their nodes",
    ),
    "hostfile-spaced": Deviation(
        "DeepSpeed", "`HOST slots = N` (spaces around `=`)",
        "refuses the hostfile (a bad entry)",
        "reads N slots",
        "Open MPI reads it so",
    ),
    "hostfile-zero-slots": Deviation(
        "DeepSpeed", "`HOST slots=0`",
        "lists the host with no slot",
        "refuses, naming the line",
        "a node in the job runs at least one process: leave the host out instead",
    ),
    "hostfile-trailing-text": Deviation(
        "DeepSpeed", "text after the slot count: `HOST slots=4 gpus`, `HOST slots=2x`",
        "reads the digits after `slots=` and ignores the rest",
        "refuses, naming the line (Open MPI's `max_slots=M` and a `# comment` are read as DeepSpeed reads them)",
        "a typo such as `slots=4,5` would otherwise change the world size without a word",
    ),
    "hostfile-max-slots": Deviation(
        "DeepSpeed", "`HOST slots=N max_slots=M` with M below N",
        "reads N slots and ignores `max_slots`",
        "refuses, naming the line, as Open MPI does",
        "Open MPI, whose hostfiles carry `max_slots`, refuses such a host",
    ),
    "hostfile-host-name": Deviation(
        "DeepSpeed", "a host name with characters other than letters, digits, `.`, `-` and `_` "
        "(`user@node1`, `-oProxyCommand=...`)",
        "hands the name to ssh and pdsh as it is",
        "refuses, naming the line",
        "a name starting with `-` reaches ssh and pdsh as an option (one that runs a command); give the "
        "user with `--ssh-user`",
    ),
    "config-auto": Deviation(
        "DeepSpeed", '`"auto"` for a batch size, `gradient_clipping`, or an optimizer or scheduler parameter',
        "fails on it: at once for a batch size, once training starts for the others (the Hugging Face "
        "Trainer fills these in first)",
        "refuses before any process starts, naming the keys and the Trainer",
        'nothing fills the placeholder outside the Trainer; `"auto"` in `fp16`, `bf16` and '
        "`zero_optimization` is read as DeepSpeed reads it, as the default",
    ),
    "config-typed-keys": Deviation(
        "DeepSpeed", "a value of a key SpikingSail reads too (batch sizes, `fp16`/`bf16.enabled` and the loss "
        "scale, `gradient_clipping`, `zero_optimization.stage`) of the wrong type or range (`\"stage\": \"2\"`, "
        "a negative clipping)",
        "casts it or fails later",
        "refuses, naming the key and the values it takes",
        "the same file runs on every backend, and each reads these keys",
    ),
    "launcher-default": Deviation(
        "DeepSpeed", "`-H hostfile` without `--launcher`",
        "starts the hosts through pdsh",
        "starts them through ssh (`--launcher pdsh` as DeepSpeed)",
        "ssh is on every machine, pdsh is not",
    ),
    "filter-nothing-left": Deviation(
        "DeepSpeed", "`--include`/`--exclude` that leave no host",
        "filters to no host, and its launcher fails later",
        "refuses at once, naming the filters",
        "nothing would run",
    ),
    "filter-slot-spelling": Deviation(
        "DeepSpeed", "a slot written other than with ASCII digits (`+1`, `１`)",
        "reads it with Python's `int`",
        "refuses, naming the flag",
        "a slot is a GPU index, written as one",
    ),
    "hostfile-blank-and-comment-lines": Deviation(
        "Horovod", "a blank line or a `# comment` in a `-hostfile`",
        "fails on it with a traceback (an IndexError)",
        "skips it, as DeepSpeed and Open MPI do",
        "one hostfile serves every launcher",
    ),
    "hosts-bare": Deviation(
        "Horovod", "`-H node1,node2` (a host without `:SLOTS`)",
        "refuses the host list (horovodrun splits each entry at its one `:`)",
        "gives the host 1 slot, as Open MPI's `mpirun -H` does",
        "the host lists of mpirun users read the same",
    ),
    "hosts-host-name": Deviation(
        "Horovod", "an empty host name (`-H :2`) or one with characters other than letters, digits, `.`, `-` "
        "and `_`",
        "hands the name to ssh as it is",
        "refuses, naming the entry",
        "a name starting with `-` reaches ssh as an option (one that runs a command)",
    ),
    "hosts-zero-slots": Deviation(
        "Horovod", "`-H node1:0`",
        "lists the host and starts nothing on it",
        "refuses, naming the entry",
        "a node in the job runs at least one process: leave the host out instead",
    ),
    "hosts-repeated": Deviation(
        "Horovod", "a host named twice in `-H` (`node1:2,node1:2`)",
        "lists it twice, its processes' local ranks starting at 0 in each",
        "refuses, naming the host",
        "two processes of one node would take the same GPU",
    ),
    "hosts-slot-spelling": Deviation(
        "Horovod", "a slot count written other than with ASCII digits (`node1:+2`, `node1:２`)",
        "reads it with Python's `int`",
        "refuses, naming the entry",
        "a slot count is a number of processes, written as one",
    ),
}  # fmt: skip


def table(peer: str) -> str:
    """The deviations from ``peer`` as a Markdown table, for its page in the docs."""
    lines = [
        f"| you write | {peer} | SpikingSail | why |",
        "|---|---|---|---|",
        *(
            f"| {d.given} | {d.peer_does} | {d.sail_does} | {d.why} |"
            for d in DEVIATIONS.values()
            if d.peer == peer
        ),
    ]
    return "\n".join(lines)

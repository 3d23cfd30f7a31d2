"""``sail bench``: measurements. ``sail bench comm`` times collectives on `sail launch`'s ranks.

``sail bench comm [options] [sail launch flags]`` checks its own options here, then runs
``sail launch [flags] -m spikingsail.diagnostics.comm_bench [options]``: the same parsing, host
checks, planning and supervision as any job, so it measures the path training jobs take.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spikingsail.cli import launch
from spikingsail.diagnostics.comm_bench import SweepConfig, add_arguments, sweep_config
from spikingsail.errors import LaunchError
from spikingsail.launchers.request import parser as launch_parser
from spikingsail.launchers.request import with_default_nproc

_USAGE = """usage: sail bench <benchmark> [options]

benchmarks:
  comm    time all-reduce, all-gather and broadcast over a range of message sizes (nccl-tests'
          time, algbw, busbw), on this machine (-n 2) or on a hostfile's nodes (-H)

Run `sail bench <benchmark> --help` for its options.
"""

_EPILOG = """\
Every other argument is a `sail launch` flag (-n, -H, --launcher, --ssh-config, --master-port,
--env, --dry-run, ...); without -n, --nproc-per-node or -H the benchmark runs with -n 2.

columns (as nccl-tests define them, n ranks):
  size    bytes S of the operation (all_gather: the gathered output, n × each rank's share)
  count   elements in each rank's buffer (all_gather: each rank's share)
  time    mean over the ranks of each rank's wall time per operation (us)
  algbw   S / time (GB/s, 10^9 bytes per second)
  busbw   algbw × 2(n-1)/n for all_reduce, × (n-1)/n for all_gather, × 1 for broadcast
  #wrong  elements that differ from the expected result in a checked run, summed over ranks

examples:
  sail bench comm                                  # 2 local processes, 1K..64M, all three ops
  sail bench comm -n 4 --ops all_reduce -b 1M -e 1G --dtype bfloat16
  sail bench comm -H hostfile --launcher pdsh --output results/
"""
_BENCHMARKS = ("comm",)
JOB_MODULE = "spikingsail.diagnostics.comm_bench"


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in _BENCHMARKS:
        print(f"sail bench: unknown benchmark {argv[0]!r}\n\n{_USAGE}", file=sys.stderr, end="")
        return 2
    return run_comm(argv[1:])


def comm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sail bench comm",
        description="Time all-reduce, all-gather and broadcast over a range of message sizes, as "
        "NVIDIA's nccl-tests do, on the ranks `sail launch` starts; print a table per operation and "
        "save a PNG plot of busbw against size and a JSON file of the same numbers.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # sail launch's flags pass through unknown: a prefix of one must not match an option here
        allow_abbrev=False,
    )
    add_arguments(parser)
    return parser


def run_comm(argv: list[str]) -> int:
    ns, launch_flags = comm_parser().parse_known_args(argv)
    config = sweep_config(ns)
    launch_argv = comm_launch_argv(config, launch_flags)
    if "--dry-run" not in launch_flags:
        _prepare_output(config.output)
    return launch.run(launch_argv)


def comm_launch_argv(config: SweepConfig, launch_flags: list[str]) -> list[str]:
    """``[*launch_flags, -m, the job module, *its options]``, with ``-n 2`` unless told otherwise."""
    _check_flags_only(launch_flags)
    flags = with_default_nproc(launch_flags, 2)
    return [*flags, "-m", JOB_MODULE, *config.job_args()]


def _check_flags_only(launch_flags: list[str]) -> None:
    """What is not an option here must be a `sail launch` flag: say so now, in these terms (a stray
    word would otherwise become `sail launch`'s training script, with a confusing error)."""
    ns, unknown = launch_parser().parse_known_args([*launch_flags, "-m", JOB_MODULE])
    if ns.training_script != JOB_MODULE:
        unknown = [*unknown, ns.training_script]  # an unknown flag first: its value is taken for the script
    if unknown:
        raise LaunchError(
            f"unexpected argument {unknown[0]!r}",
            "sail bench comm takes its own options and `sail launch` flags; the program it launches "
            "is the benchmark itself",
            "remove it, or check its spelling against `sail bench comm --help` and `sail launch --help`",
        )


def _prepare_output(prefix: Path) -> None:
    """The nodes share paths, as for `sail launch`; a directory that cannot be made fails now, not
    after the whole sweep."""
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LaunchError(
            f"--output {prefix}: cannot create {prefix.parent}",
            err.strerror or str(err),
            "give --output a directory you can write to",
        ) from err

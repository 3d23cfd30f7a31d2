"""`sail bench comm`: sizes and bandwidths as nccl-tests define them, bad input, and real runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import matplotlib.image
import pytest
import torch
import torch.distributed as dist

from spikingsail.cli import bench
from spikingsail.cli.main import main
from spikingsail.diagnostics import comm_bench
from spikingsail.diagnostics.comm_bench import (
    OPS,
    Group,
    SweepConfig,
    add_arguments,
    bandwidths,
    measure,
    op_shape,
    output_prefix,
    parse_ops,
    parse_size,
    size_sweep,
    sweep_config,
)
from spikingsail.errors import LaunchError
from tests.cluster.harness import NamespaceCluster

SAIL_BENCH = [sys.executable, "-m", "spikingsail.cli.main", "bench", "comm"]
SMALL_SWEEP = ["-b", "1K", "-e", "64K", "--iters", "3", "--warmup", "1"]
SMALL_SIZES = [1024 * 2**k for k in range(7)]  # 1K, 2K, ..., 64K
BUS_FACTOR_2_RANKS = {"all_reduce": 1.0, "all_gather": 0.5, "broadcast": 1.0}  # 2(n-1)/n, (n-1)/n, 1
MIB = 2**20


def config(**overrides: str) -> SweepConfig:
    parser = bench.comm_parser()
    argv = [item for flag, value in overrides.items() for item in (f"--{flag.replace('_', '-')}", value)]
    return sweep_config(parser.parse_args(argv))


# -- sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1024", 1024),
        ("1K", 1024),
        ("1k", 1024),
        ("64M", 64 * MIB),
        ("1G", 2**30),
        ("1.5K", 1536),
        (" 2M ", 2 * MIB),
        ("8", 8),
    ],
)
def test_sizes_read_like_nccl_tests(text: str, size: int) -> None:
    assert parse_size(text, "--min-bytes") == size


@pytest.mark.parametrize("text", ["10Q", "", "K", "-1", "0", "0.1", "1KB", "one"])
def test_a_bad_size_names_the_flag_and_the_fix(text: str) -> None:
    with pytest.raises(LaunchError) as caught:
        parse_size(text, "--max-bytes")
    assert f"--max-bytes {text!r} is not a size" in str(caught.value)
    assert "K, M or G" in caught.value.why
    assert "--max-bytes 64K" in caught.value.fix


def test_the_sweep_multiplies_by_the_factor_up_to_the_maximum() -> None:
    assert size_sweep(1024, 64 * 1024, 2) == SMALL_SIZES
    assert size_sweep(1024, 10 * 1024, 3) == [1024, 3072, 9216]
    assert size_sweep(1000, 5000, 2) == [1000, 2000, 4000]  # the maximum need not be reached
    assert size_sweep(4096, 4096, 2) == [4096]
    assert config(min_bytes="1K", max_bytes="64M").sizes() == [1024 * 2**k for k in range(17)]


def test_sizes_round_down_to_whole_elements_per_rank() -> None:
    assert op_shape("all_reduce", 1024, 4, 2) == (1024, 256)
    assert op_shape("broadcast", 1026, 2, 8) == (1026, 513)
    assert op_shape("all_reduce", 1023, 4, 2) == (1020, 255)
    # all-gather: the size is the gathered output; each rank sends its share of whole elements
    assert op_shape("all_gather", 1024, 4, 2) == (1024, 128)
    assert op_shape("all_gather", 1024, 4, 3) == (1020, 85)
    assert op_shape("all_gather", 8, 4, 4) is None
    assert op_shape("all_reduce", 2, 4, 2) is None


# -- bandwidths: nccl-tests' doc/PERFORMANCE.md, numbers worked out by hand --------------------------


def test_algbw_is_size_over_time() -> None:
    # 64 MiB in 10 ms: 67108864 B / 0.01 s = 6.7108864e9 B/s
    for op in OPS:
        algbw, _ = bandwidths(op, 64 * MIB, 0.01, 4)
        assert algbw == pytest.approx(6.7108864)


@pytest.mark.parametrize(
    ("op", "ranks", "busbw"),
    [
        ("all_reduce", 2, 6.7108864),  # × 2·1/2 = 1
        ("all_reduce", 4, 10.0663296),  # × 2·3/4 = 1.5
        ("all_reduce", 8, 11.7440512),  # × 2·7/8 = 1.75
        ("all_gather", 2, 3.3554432),  # × 1/2
        ("all_gather", 4, 5.0331648),  # × 3/4
        ("broadcast", 2, 6.7108864),  # × 1
        ("broadcast", 8, 6.7108864),
    ],
)
def test_busbw_applies_the_operations_factor(op: str, ranks: int, busbw: float) -> None:
    assert bandwidths(op, 64 * MIB, 0.01, ranks)[1] == pytest.approx(busbw)


def test_an_all_reduce_of_one_gib_on_8_ranks() -> None:
    # 1 GiB in 5 ms: algbw 1073741824 / 0.005 = 214.7483648 GB/s, busbw × 1.75 = 375.8096384 GB/s
    assert bandwidths("all_reduce", 2**30, 0.005, 8) == pytest.approx((214.7483648, 375.8096384))


# -- options -------------------------------------------------------------------------------------


def test_ops_are_normalised_and_kept_in_order() -> None:
    assert parse_ops("broadcast, all-reduce,allgather,broadcast") == ("broadcast", "all_reduce", "all_gather")
    assert config().ops == OPS


def test_output_is_a_directory_or_a_prefix_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert output_prefix(str(tmp_path)) == tmp_path / "sail-bench-comm"
    assert output_prefix("new/") == tmp_path / "new" / "sail-bench-comm"
    assert output_prefix("runs/comm.png") == tmp_path / "runs" / "comm"
    assert output_prefix("runs/comm") == tmp_path / "runs" / "comm"
    assert config().output == tmp_path / "sail-bench-comm"


def test_the_job_gets_the_checked_options_back() -> None:
    checked = config(ops="broadcast", min_bytes="2K", max_bytes="1M", factor="4", dtype="bfloat16")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert sweep_config(parser.parse_args(checked.job_args())) == checked


@pytest.mark.parametrize(
    ("argv", "what", "fix"),
    [
        (["--min-bytes", "10Q"], "--min-bytes '10Q' is not a size", "--min-bytes 64K"),
        (["-b", "1M", "-e", "1K"], "--min-bytes 1M is larger than --max-bytes 1K", "swap"),
        (["-b", "1", "-e", "2"], "--max-bytes 2 is smaller than one float32 element", "--max-bytes 4"),
        (
            ["--ops", "all_reduce,alltoall"],
            "--ops: unknown operation 'alltoall'",
            "all_reduce, all_gather, broadcast",
        ),
        (["--factor", "1"], "--factor 1", "--factor 2"),
        (["--iters", "0"], "--iters 0", "--iters 1 or more"),
        (["--warmup", "-1"], "--warmup -1", "--warmup 1 or more"),
        (["-n", "2", "results"], "unexpected argument 'results'", "sail bench comm --help"),
        (["--bogus", "3"], "unexpected argument '--bogus'", "sail launch --help"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(
    argv: list[str], what: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LaunchError) as caught:
        bench.run(["comm", *argv])
    assert what in caught.value.what
    assert fix in caught.value.fix
    assert main(["bench", "comm", *argv]) == 2
    err = capsys.readouterr().err
    assert what in err and "fix:" in err and "Traceback" not in err


def test_bench_without_a_known_benchmark_prints_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "comm" in capsys.readouterr().err
    assert main(["bench", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nccl'" in err and "comm" in err
    assert main(["bench", "--help"]) == 0
    assert "usage: sail bench" in capsys.readouterr().out


def test_launch_argv_runs_the_job_module_with_two_local_processes_by_default() -> None:
    checked = config()
    job = ["-m", "spikingsail.diagnostics.comm_bench", *checked.job_args()]
    assert bench.comm_launch_argv(checked, []) == ["-n", "2", *job]
    assert bench.comm_launch_argv(checked, ["--nproc-per-node=4"]) == ["--nproc-per-node=4", *job]
    assert bench.comm_launch_argv(checked, ["-n3"]) == ["-n3", *job]
    hosts = ["-H", "hostfile", "--ssh-config", "cfg", "--launcher", "pdsh"]
    assert bench.comm_launch_argv(checked, hosts) == [*hosts, *job]
    # mpirun's ranks run the module through as_torchrun, as torchrun's would
    mpirun = ["-H", "hostfile", "--launcher", "mpirun"]
    assert bench.comm_launch_argv(checked, mpirun) == [*mpirun, *job]


def test_dry_run_prints_the_sail_launch_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "comm", "--dry-run", "-b", "4K", "-e", "8K", "--output", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run --standalone --nproc-per-node 2" in out
    assert "-m" in out.split() and "spikingsail.diagnostics.comm_bench" in out
    assert (
        f"--min-bytes 4096 --max-bytes 8192 --factor 2 --iters 20 --warmup 5 --dtype float32 --output {tmp_path / 'out'}"
        in out
    )
    assert list(tmp_path.iterdir()) == []


# -- the measurement in a one-rank group (this process) --------------------------------------------


@pytest.fixture
def one_rank() -> Iterator[Group]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Group(rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("op", OPS)
def test_measure_counts_every_corrupted_element(
    op: str, one_rank: Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked = config(iters="2", warmup="1")
    row = measure(op, 4096, 1024, checked, one_rank)
    assert (row.op, row.size_bytes, row.count, row.dtype, row.wrong) == (op, 4096, 1024, "float32", 0)
    assert row.time_us > 0 and row.algbw_gbps == pytest.approx(4096 / (row.time_us * 1e3))

    launch = comm_bench._launch

    def corrupting(op: str, data: torch.Tensor, out: torch.Tensor) -> None:
        launch(op, data, out)
        (out if op == "all_gather" else data)[5:8] += 1

    monkeypatch.setattr(comm_bench, "_launch", corrupting)
    assert measure(op, 4096, 1024, checked, one_rank).wrong == 3


# -- real runs -------------------------------------------------------------------------------------


def check_results(out_dir: Path, stdout: str, hosts: list[str] | None = None) -> None:
    document = json.loads((out_dir / "sail-bench-comm.json").read_text())
    assert document["world_size"] == 2 and document["backend"] == "gloo" and document["dtype"] == "float32"
    if hosts is not None:
        assert document["hosts"] == hosts
    assert list(document["results"]) == list(OPS)
    for op, rows in document["results"].items():
        assert [r["size_bytes"] for r in rows] == SMALL_SIZES
        for r in rows:
            per_rank = r["size_bytes"] // 4 // (2 if op == "all_gather" else 1)
            assert (r["op"], r["count"], r["dtype"], r["wrong"]) == (op, per_rank, "float32", 0)
            assert r["time_us"] > 0
            assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e3), rel=1e-9)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * BUS_FACTOR_2_RANKS[op], rel=1e-9)
    assert printed_sizes(stdout) == {op: SMALL_SIZES for op in OPS}

    png = (out_dir / "sail-bench-comm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    image = matplotlib.image.imread(out_dir / "sail-bench-comm.png")
    assert image.shape[:2] == (500, 800) and image.shape[2] in (3, 4)


def printed_sizes(stdout: str) -> dict[str, list[int]]:
    """The size column of every table in the output, by operation; header lines are checked too."""
    tables: dict[str, list[int]] = {}
    op = ""
    for raw in stdout.splitlines():
        line = raw.split("] ", 1)[-1] if raw.startswith("[") else raw  # a node's [host] prefix
        if line.startswith("# ") and line[2:].split(":")[0] in OPS:
            op = line[2:].split(":")[0]
            tables[op] = []
        elif line.startswith("#") and "size" in line:
            assert line.split()[1:] == ["size", "count", "dtype", "time", "algbw", "busbw", "#wrong"]
        elif op and len(fields := line.split()) == 7 and fields[0].isdigit():
            assert fields[2] == "float32" and fields[6] == "0"
            tables[op].append(int(fields[0]))
    return tables


@pytest.mark.multiprocess
def test_two_local_processes_print_save_and_plot(tmp_path: Path) -> None:
    result = subprocess.run(
        [*SAIL_BENCH, "-n", "2", *SMALL_SWEEP, "--output", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_results(tmp_path, result.stdout)


@pytest.mark.cluster
def test_two_nodes_over_ssh(cluster: NamespaceCluster, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [
        *SAIL_BENCH, "-H", str(hostfile), "--ssh-config", str(cluster.ssh_config), *SMALL_SWEEP,
        "--output", f"{tmp_path / 'out'}/",  # a directory that does not exist yet
    ]  # fmt: skip
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_results(tmp_path / "out", result.stdout, hosts=["node1", "node2"])

"""``sail bench comm``'s job: all-reduce, all-gather and broadcast timed over a range of sizes.

Every rank runs ``python -m spikingsail.diagnostics.comm_bench`` (``sail bench comm`` starts it
through ``sail launch``). The numbers mean what they mean in NVIDIA's nccl-tests
(``all_reduce_perf``, ``all_gather_perf``, ``broadcast_perf``; doc/PERFORMANCE.md there):

- time: each rank's wall time for ``iters`` back-to-back operations divided by ``iters``, then the
  mean over the ranks;
- algbw = S / time, S the operation's size in bytes (for all-gather: the whole gathered output);
- busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for all-gather, × 1 for broadcast:
  comparable with the links' peak bandwidth whatever the number of ranks n;
- #wrong: elements that differ from the expected result in one checked run after the timed ones,
  summed over the ranks.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import constants

from spikingsail.backends.process_group import init_default_group, rank_hosts, rendezvous_store, select_device
from spikingsail.diagnostics.comm_plot import table, write_report
from spikingsail.environments import RankInfo, discover_rank_info
from spikingsail.errors import LaunchError, SailError
from spikingsail.exits import exit_now
from spikingsail.monitor.logs import configure_logging

log = logging.getLogger(__name__)

OPS = ("all_reduce", "all_gather", "broadcast")
_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "bcast": "broadcast"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_OUTPUT = "sail-bench-comm"
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgG]?)")
# Integers up to these are exact in each dtype: sums of the check pattern below stay exact (and
# independent of the reduction order) while they do not exceed them.
_EXACT_UP_TO = {torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}
_SUMMED = 3  # all-reduce inputs take the values 0, 1, 2: sums stay small for many ranks
_COPIED = 251  # gathered/broadcast values (0..250) are exact in every dtype and tell ranks apart


# -- sizes and bandwidths ------------------------------------------------------------------------


def parse_size(text: str, flag: str) -> int:
    """nccl-tests' size syntax: bytes, with an optional K, M or G suffix (powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    size = int(float(match[1]) * _UNITS[match[2].lower()]) if match else 0
    if size < 1:
        raise LaunchError(
            f"{flag} {text!r} is not a size",
            "a size is a number of bytes, optionally with a K, M or G suffix (×1024), as in nccl-tests",
            f"write e.g. {flag} 64K, {flag} 1M or {flag} 1048576",
        )
    return size


def parse_ops(text: str) -> tuple[str, ...]:
    ops: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower().replace("-", "_")
        name = _ALIASES.get(name, name)
        if name not in OPS:
            raise LaunchError(
                f"--ops: unknown operation {raw.strip()!r}",
                f"sail bench comm measures {', '.join(OPS)}",
                f"choose from {', '.join(OPS)}, comma-separated (e.g. --ops all_reduce,broadcast)",
            )
        if name not in ops:
            ops.append(name)
    return tuple(ops)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min×factor, min×factor², … up to max, as nccl-tests' -b/-e/-f."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def op_shape(op: str, size: int, element_size: int, world_size: int) -> tuple[int, int] | None:
    """(bytes S, elements per rank) of ``op`` at ``size``, rounded down as nccl-tests does.

    For all-gather ``size`` is the gathered output, so each rank sends ``size / n``; None when a
    rank would have no whole element.
    """
    count = size // element_size
    if op == "all_gather":
        count //= world_size
        return (count * world_size * element_size, count) if count else None
    return (count * element_size, count) if count else None


def bus_factor(op: str, world_size: int) -> float:
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1.0}[op]


def bandwidths(op: str, size: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10⁹ bytes per second) of ``size`` bytes moved in ``seconds``."""
    algbw = size / seconds / 1e9
    return algbw, algbw * bus_factor(op, world_size)


def output_prefix(text: str) -> Path:
    """``--output``: a directory (existing, or written with a trailing slash) gets the default
    file names; anything else is a path prefix for ``.png`` and ``.json``. Always absolute."""
    path = Path(text).expanduser()
    if text.endswith(("/", "\\")) or path.is_dir():
        path = path / DEFAULT_OUTPUT
    elif path.suffix in (".png", ".json"):
        path = path.with_suffix("")
    return path.absolute()


# -- options (shared by `sail bench comm` and the job) ---------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class SweepConfig:
    ops: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    factor: int
    iters: int
    warmup: int
    dtype: str
    output: Path
    """Absolute path prefix: the PNG and JSON files are ``output`` + ``.png`` / ``.json``."""
    dist_backend: str

    def sizes(self) -> list[int]:
        return size_sweep(self.min_bytes, self.max_bytes, self.factor)

    def job_args(self) -> list[str]:
        """The job's command line, every value already checked and the output path absolute."""
        return [
            "--ops", ",".join(self.ops), "--min-bytes", str(self.min_bytes),
            "--max-bytes", str(self.max_bytes), "--factor", str(self.factor), "--iters", str(self.iters),
            "--warmup", str(self.warmup), "--dtype", self.dtype, "--output", str(self.output),
            "--dist-backend", self.dist_backend,
        ]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--ops", default=",".join(OPS), help=f"operations to time, comma-separated (default: {','.join(OPS)})"
    )
    add("-b", "--min-bytes", default="1K", help="smallest size; K, M, G suffixes as nccl-tests (default: 1K)")
    add("-e", "--max-bytes", default="64M", help="largest size (default: 64M)")
    add("-f", "--factor", type=int, default=2, help="each size is the previous one times this (default: 2)")
    add("--iters", type=int, default=20, help="timed operations per size (default: 20)")
    add("--warmup", type=int, default=5, help="untimed operations per size before them (default: 5)")
    add("--dtype", choices=tuple(DTYPES), default="float32", help="element type (default: float32)")
    add(
        "--output",
        default=DEFAULT_OUTPUT,
        help=f"path prefix, or directory, for the PNG plot and JSON results (default: ./{DEFAULT_OUTPUT}.png/.json)",
    )
    add(
        "--dist-backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: nccl on the GPU of the local rank when CUDA is available, gloo on the CPU otherwise",
    )


def sweep_config(ns: argparse.Namespace) -> SweepConfig:
    """Check the options; every mistake is a LaunchError naming the flag and the fix."""
    low, high = parse_size(ns.min_bytes, "--min-bytes"), parse_size(ns.max_bytes, "--max-bytes")
    if low > high:
        raise LaunchError(
            f"--min-bytes {ns.min_bytes} is larger than --max-bytes {ns.max_bytes}",
            "the sweep grows from --min-bytes up to --max-bytes",
            "swap the two values, or give --max-bytes at least --min-bytes",
        )
    element = DTYPES[ns.dtype].itemsize
    if high < element:
        raise LaunchError(
            f"--max-bytes {ns.max_bytes} is smaller than one {ns.dtype} element ({element} bytes)",
            fix=f"give --max-bytes {element} or more",
        )
    if ns.factor < 2:
        raise LaunchError(
            f"--factor {ns.factor}",
            "each size is the previous one times the factor, so the sweep only grows with 2 or more",
            "use --factor 2 (the default) or more; for one size give --min-bytes and --max-bytes the same value",
        )
    for flag, value, least in (("--iters", ns.iters, 1), ("--warmup", ns.warmup, 0)):
        if value < least:
            raise LaunchError(
                f"{flag} {value}",
                f"{flag} counts operations per size, at least {least}",
                f"give {flag} {max(least, 1)} or more (defaults: --iters 20, --warmup 5)",
            )
    return SweepConfig(
        ops=parse_ops(ns.ops), min_bytes=low, max_bytes=high, factor=ns.factor, iters=ns.iters,
        warmup=ns.warmup, dtype=ns.dtype, output=output_prefix(ns.output), dist_backend=ns.dist_backend,
    )  # fmt: skip


# -- the measurement -------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class Group:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype


@dataclass(kw_only=True, slots=True, frozen=True)
class Row:
    op: str
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int


def _launch(op: str, data: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(data)
    elif op == "broadcast":
        dist.broadcast(data, src=0)
    elif hasattr(dist, "all_gather_single"):  # torch 2.13 renamed all_gather_into_tensor
        dist.all_gather_single(out, data)
    else:
        dist.all_gather_into_tensor(out, data)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pattern(count: int, rank: int, modulus: int, device: torch.device) -> torch.Tensor:
    """What rank ``rank`` sends in the checked run: (index + rank) mod ``modulus``, exactly."""
    index = torch.arange(count, dtype=torch.int32 if count + rank < 2**31 else torch.int64, device=device)
    return ((index + rank) % modulus).to(torch.float32)


def _wrong(got: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor | float) -> int:
    return int(((got.float() - expected).abs() > tolerance).sum())


def _count_wrong(op: str, data: torch.Tensor, out: torch.Tensor, group: Group) -> int:
    count, n, device = data.numel(), group.world_size, group.device
    if op == "all_reduce":
        data.copy_(_pattern(count, group.rank, _SUMMED, device))
    elif op == "broadcast" and group.rank == 0:
        data.copy_(_pattern(count, 0, _COPIED, device))
    elif op == "broadcast":
        data.fill_(-1)  # overwritten by the root's values, or counted wrong
    else:
        data.copy_(_pattern(count, group.rank, _COPIED, device))
        out.fill_(-1)
    _launch(op, data, out)
    _sync(device)
    if op == "broadcast":
        return _wrong(data, _pattern(count, 0, _COPIED, device), 0.0)
    if op == "all_gather":
        blocks = out.view(n, count)
        return sum(_wrong(blocks[r], _pattern(count, r, _COPIED, device), 0.0) for r in range(n))
    # n consecutive values of (i + r) mod 3 are n // 3 full cycles (0 + 1 + 2 each) and a remainder
    cycles, rest = divmod(n, _SUMMED)
    expected = torch.full((count,), float(cycles * sum(range(_SUMMED))), device=device)
    for r in range(rest):
        expected += _pattern(count, r, _SUMMED, device)
    exact = (_SUMMED - 1) * n <= _EXACT_UP_TO[group.dtype]
    # past the exact range the sum is rounded: up to (n-1) roundings of half an ulp each
    tolerance = 0.0 if exact else expected * ((n - 1) * torch.finfo(group.dtype).eps / 2)
    return _wrong(data, expected, tolerance)


def measure(op: str, size: int, count: int, config: SweepConfig, group: Group) -> Row:
    """Warm up, time ``iters`` operations, check one; time and #wrong agreed over the ranks."""
    data = torch.zeros(count, dtype=group.dtype, device=group.device)
    out = (
        torch.zeros(count * group.world_size, dtype=group.dtype, device=group.device)
        if op == "all_gather"
        else data
    )
    # Timed on zeros: the values do not change the transfer, and summing non-zero data in place
    # again and again would overflow float16 within a few iterations.
    for _ in range(config.warmup):
        _launch(op, data, out)
    _sync(group.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(config.iters):
        _launch(op, data, out)
    _sync(group.device)
    seconds = (time.perf_counter() - start) / config.iters
    wrong = _count_wrong(op, data, out, group)
    totals = torch.tensor([seconds, wrong], dtype=torch.float64, device=group.device)
    dist.all_reduce(totals)
    mean_seconds = float(totals[0]) / group.world_size
    algbw, busbw = bandwidths(op, size, mean_seconds, group.world_size)
    return Row(
        op=op, size_bytes=size, count=count, dtype=config.dtype, time_us=mean_seconds * 1e6,
        algbw_gbps=algbw, busbw_gbps=busbw, wrong=int(totals[1]),
    )  # fmt: skip


def sweep(config: SweepConfig, group: Group) -> dict[str, list[Row]]:
    results: dict[str, list[Row]] = {}
    for op in config.ops:
        shapes = [op_shape(op, size, group.dtype.itemsize, group.world_size) for size in config.sizes()]
        kept = [s for s in shapes if s is not None]
        log.info("%s: %d sizes on %d ranks (%d skipped: no whole element per rank)", op, len(kept),
                 group.world_size, len(shapes) - len(kept))  # fmt: skip
        results[op] = [measure(op, size, count, config, group) for size, count in kept]
    return results


# -- the job ---------------------------------------------------------------------------------------


def _device_and_backend(wanted: str, info: RankInfo) -> tuple[torch.device, str]:
    """The engine's choice of device (``select_device``: the GPU of the local rank, or the one GPU
    a process sees); gloo measures on the CPU."""
    device = torch.device("cpu") if wanted == "gloo" else select_device(info)
    if wanted == "nccl" and device.type != "cuda":
        raise LaunchError(
            "--dist-backend nccl on a node without a visible GPU",
            "NCCL only moves tensors between GPUs",
            "use --dist-backend gloo (or auto, which picks gloo here)",
        )
    return device, "nccl" if device.type == "cuda" else "gloo"


def run_job(config: SweepConfig) -> int:
    info = discover_rank_info()
    configure_logging(info.rank)
    device, backend = _device_and_backend(config.dist_backend, info)
    # torch's own default for the backend (init_process_group's, when no timeout is given)
    timeout = (
        constants.default_pg_nccl_timeout if backend == "nccl" else None
    ) or constants.default_pg_timeout
    init_default_group(backend, timeout, rendezvous_store(info, timeout), rank_info=info, device=device)
    try:
        group = Group(rank=info.rank, world_size=info.world_size, device=device, dtype=DTYPES[config.dtype])
        hosts = rank_hosts(info.world_size)
        results = sweep(config, group)
    finally:
        dist.destroy_process_group()
    meta: dict[str, object] = {
        "world_size": info.world_size, "backend": backend, "device": device.type, "dtype": config.dtype,
        "iters": config.iters, "warmup": config.warmup, "hosts": hosts, "torch": torch.__version__,
    }  # fmt: skip
    wrong = sum(r.wrong for rows in results.values() for r in rows)
    if info.rank == 0:
        print("\n\n".join(table(op, rows, meta) for op, rows in results.items()), flush=True)
        write_report(results, meta, config.output)
        if wrong:
            log.error("%d elements arrived wrong: the transport corrupts data (see #wrong above)", wrong)
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spikingsail.diagnostics.comm_bench",
        description="One rank of `sail bench comm`; start it with `sail bench comm` or torchrun.",
    )
    add_arguments(parser)
    try:
        return run_job(sweep_config(parser.parse_args(argv)))
    except SailError as err:
        print(f"sail bench comm: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())

"""``sail.balance: auto`` on ranks made unequal for real: rank 1 runs in a cgroup with a CPU quota.

The cgroup v1 ``cpu`` controller caps the whole process (every thread) at a share of one core, so
rank 1 computes slower than rank 0 the way an older GPU would. Each rank also times the model on
its own before training (``standalone``), under the same conditions.

The quota is 10% of a core. A quota is not the constant slowdown of a slower GPU: what it costs
a process depends on how the process's work falls into the 10 ms periods, the throttled rank's side
of the gradient all-reduce included (which ``auto`` counts as communication, not compute). In the
job rank 1 measures less slow than standalone: 1.7-1.8× against 2.6-3.0× standalone at a 40% quota
on a 2-core machine (1.47 once, on a busier one), 3.0-4.3× against 5.5-8.9× at 20%; at 10% 20-23×
standalone (11× with another process busy on a core), the first split 5-7 : 1. At 40% the
measured ratio sits too near the 1.5 these tests ask of the split.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from tests.cgroups import cpu_quota_group
from tests.multiprocess import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone, pytest.mark.speed]

GLOBAL_MICRO = 512  # two ranks × 256: compute well above the all-reduce's time
UNTHROTTLE_AT = 14
STEPS = 30


@pytest.fixture
def slower_group() -> Iterator[Path]:
    """10% of a core: under a quota a rank is measured less slow in the job than alone (it also
    waits in every all-reduce), most with an all-reduce at every step; at 20% the measured split of
    some cases stayed within 1.5 : 1 on a busy host, and the speed-up when the quota is lifted was
    too small to be told from the noise within 10 steps once in CI (one rank's step times vary by
    20-45% from step to step there)."""
    with cpu_quota_group(10) as group:
        yield group


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip


def standalone(net: torch.nn.Module, seconds: float = 1.0) -> torch.Tensor:
    """Every rank's forward samples per second when timed alone, at the same moment on every rank."""
    x = torch.randn(32, 256)
    dist.barrier()
    samples, start = 0, time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - start < seconds:
            net(x)
            samples += len(x)
    mine = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    mine[dist.get_rank()] = samples / (time.perf_counter() - start)
    dist.all_reduce(mine)
    return mine


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(16384, 256, generator=g), torch.randint(0, 10, (16384,), generator=g))


def config(micro: int, **sail: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "sail": {"progress_bar": False, **sail},
    }


def params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.named_parameters()}


def one_process() -> dict[str, torch.Tensor]:
    engine, _ = spikingsail.initialize(
        model=model(), config=config(GLOBAL_MICRO), rank_info=RankInfo.single()
    )
    batches = iter(engine.dataloader(data()))
    while engine.global_steps < STEPS:
        x, y = next(batches)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    out = params(engine)
    engine.close()
    return out


def auto_run(group: str, metrics: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    engine, _ = spikingsail.initialize(
        model=model(), config=config(GLOBAL_MICRO // 2, balance="auto", metrics_path=metrics)
    )
    if rank == 1:  # throttled from here on: the set-up is not what the test measures
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    before = standalone(engine.module)
    splits: list[list[int]] = []
    batches = iter(engine.dataloader(data()))
    while engine.global_steps < STEPS:
        x, y = next(batches)
        assert engine.balancer is not None and len(x) == engine.balancer.split[rank]
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        splits.append(list(engine.balancer.split))
        if engine.global_steps == UNTHROTTLE_AT and rank == 1:
            (Path(group) / "cpu.cfs_quota_us").write_text("-1")
    changes = list(engine.balancer.changes)
    out = {"before": before.tolist(), "splits": splits, "changes": changes, "params": params(engine)}
    engine.close()
    return out


def ratio(split: list[int]) -> float:
    return split[0] / split[1]


def test_auto_follows_the_ranks_speeds_and_still_trains_like_one_process(
    slower_group: Path, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    result = run_ranks(auto_run, 2, str(slower_group), str(metrics))[0]
    standalone_ratio = result["before"][0] / result["before"][1]
    assert standalone_ratio > 1.8, f"the quota did not slow rank 1 down: {result['before']}"
    splits, changes = result["splits"], result["changes"]
    assert splits[0] == [256, 256], "equal micro-batches until measured"
    # measured over steps 2-9 (step 1 warms up): rank 0 takes the larger share, never more than
    # its standalone speed says (rank 1 also waits in the all-reduce, where the quota costs it less)
    throttled = splits[UNTHROTTLE_AT - 1]
    assert changes[0]["step"] <= 1 + 8, changes
    assert 1.5 <= ratio(throttled) <= standalone_ratio * 1.1, (throttled, standalone_ratio)
    # the quota is lifted at step 14: a new split within 10 steps, towards equal shares
    later = [c for c in changes if c["step"] > UNTHROTTLE_AT]
    assert later and later[0]["step"] <= UNTHROTTLE_AT + 10, changes
    assert ratio(splits[-1]) < ratio(throttled) / 1.25, (splits[-1], throttled)
    # whatever the splits, the weights are one process's on the same global batches
    for key, value in one_process().items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # rank 0 logs every change to the metrics file
    logged = [
        line["balance"] for line in map(json.loads, metrics.read_text().splitlines()) if "balance" in line
    ]
    assert [entry["split"] for entry in logged] == [c["split"] for c in changes]


# `auto` under every supported backend, precision and accumulation, and a spiking network (without
# batch norm: synchronised batch norm hides a slow rank, and `auto` refuses it): rank 1 stays throttled, so the split moves away from equal after the
# measurement, and the weights must still be one process's on the same global batches.
AUTO_CASES = {
    "ddp-bf16-acc2": ("ddp", "bf16", 2, False),
    "horovod-fp32-acc2": ("horovod", "fp32", 2, False),
    "horovod-bf16-acc1": ("horovod", "bf16", 1, False),
    "ddp-fp32-acc1-snn": ("ddp", "fp32", 1, True),
}
AUTO_STEPS = 12
SAVE_AT = 10  # after the first change of split (at step 9 at the latest)
BF16 = {"rtol": 2e-2, "atol": 2e-3}  # tests/matrix/cells.py's BF16: each rank rounds its own share
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def spiking_model() -> torch.nn.Module:
    from spikingjelly.activation_based import layer

    from tests.snn.models import lif

    torch.manual_seed(0)
    return torch.nn.Sequential(
        layer.Linear(256, 512), lif(), layer.Linear(512, 512), lif(), layer.Linear(512, 10),
    )  # fmt: skip


def case_config(case: str, micro: int, **sail: Any) -> dict[str, Any]:
    backend, precision, accumulation, snn = AUTO_CASES[case]
    cfg = config(micro, backend=backend, seed=3, **sail)
    cfg["gradient_accumulation_steps"] = accumulation
    cfg["bf16"] = {"enabled": precision == "bf16"}
    if snn:
        cfg["snn"] = {"step_mode": "m", "time_steps": 4}
    return cfg


def case_run(
    case: str, group: str | None, steps: int, checkpoints: str | None = None, resume: bool = False
) -> dict[str, Any]:
    """Train ``case`` to ``steps``: balanced on two ranks, or as the reference on one."""
    torch.set_num_threads(1)
    single = os.environ["WORLD_SIZE"] == "1"
    snn = AUTO_CASES[case][3]
    engine, _ = spikingsail.initialize(
        model=spiking_model() if snn else model(),
        config=case_config(case, GLOBAL_MICRO if single else GLOBAL_MICRO // 2, balance="off" if single else "auto"),
        checkpoints_path=checkpoints, resume=resume,
    )  # fmt: skip
    if group and int(os.environ["RANK"]) == 1:  # throttled from here on (the set-up runs at full speed)
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    batches = iter(engine.dataloader(data()))
    splits: list[list[int]] = []
    while engine.global_steps < steps:
        x, y = next(batches)
        out = engine(engine.encode(x)).mean(0) if snn else engine(x)
        engine.backward(F.cross_entropy(out, y))
        engine.step()
        if engine.balancer is not None:
            splits.append(list(engine.balancer.split))
        if (
            checkpoints
            and not resume
            and engine.global_steps == SAVE_AT
            and engine.micro_steps % engine.config.gradient_accumulation_steps == 0
        ):
            engine.save_checkpoint(checkpoints)
    result = {"splits": splits, "params": params(engine)}
    engine.close()
    return result


def assert_like(case: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    tolerance = BF16 if AUTO_CASES[case][1] == "bf16" else FP32
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=key, **tolerance)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_trains_like_one_process_for_each_backend_precision_and_accumulation(
    case: str, slower_group: Path
) -> None:
    result = run_ranks(case_run, 2, case, str(slower_group), AUTO_STEPS)[0]
    assert max(ratio(s) for s in result["splits"]) >= 1.5, (
        f"auto never moved off equal shares: {result['splits']}"
    )
    assert_like(case, result["params"], run_ranks(case_run, 1, case, None, AUTO_STEPS)[0]["params"])


def test_auto_resumes_exactly_with_its_split_on_two_ranks_and_on_one(
    slower_group: Path, tmp_path: Path
) -> None:
    case = "ddp-fp32-acc1-snn"
    saved = run_ranks(case_run, 2, case, str(slower_group), SAVE_AT, str(tmp_path))[0]
    assert ratio(saved["splits"][-1]) >= 1.5, saved["splits"]  # saved with an unequal split
    reference = run_ranks(case_run, 1, case, None, AUTO_STEPS)[0]["params"]
    on_two = run_ranks(case_run, 2, case, None, AUTO_STEPS, str(tmp_path), True)[0]
    assert on_two["splits"][0] == saved["splits"][-1], "the resumed run continues with the saved split"
    assert_like(case, on_two["params"], reference)
    on_one = run_ranks(case_run, 1, case, None, AUTO_STEPS, str(tmp_path), True)[0]
    assert_like(case, on_one["params"], reference)

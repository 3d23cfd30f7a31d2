"""Neuron state is the reset value at the start of every micro-batch and every eval batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from spikingjelly.activation_based import functional
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from tests.snn.models import spiking_mlp

T = 4


def engine_for(snn: dict[str, Any], accumulation: int = 2) -> spikingsail.Engine:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "snn": {"time_steps": T, **snn},
              "sail": {"progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=spiking_mlp(), config=config, rank_info=RankInfo.single())
    return engine


def record_state(engine: spikingsail.Engine) -> list[bool]:
    """Per neuron call: was its membrane potential the reset value when the call began?"""
    seen: list[bool] = []

    def hook(module: torch.nn.Module, _args: Any) -> None:
        v = module.v
        seen.append(isinstance(v, float) and v == module.v_reset)

    for neuron in engine.snn.modules:
        neuron.register_forward_pre_hook(hook)
    return seen


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.rand(24, 6, generator=g) * 3, torch.randint(0, 3, (24,), generator=g))


def run_multi_step(engine: spikingsail.Engine, carry_state: bool = False) -> None:
    for x, y in engine.dataloader(data()):
        out = engine(engine.encode(x)).mean(0)
        engine.backward(torch.nn.functional.cross_entropy(out, y))
        engine.step()
        if carry_state:  # what a script that keeps state across batches must do (truncated BPTT)
            functional.detach_net(engine.module)
    engine.eval()
    with torch.no_grad():
        for x, _ in engine.dataloader(data(), shuffle=False, pad=False):
            engine(engine.encode(x))
    engine.train()


def test_multi_step_state_is_reset_for_every_micro_batch_and_eval_batch() -> None:
    engine = engine_for({"step_mode": "m"})
    assert engine.snn.active and engine.snn.multi_step and len(engine.snn.modules) == 2
    seen = record_state(engine)
    run_multi_step(engine)
    assert len(seen) == 2 * (6 + 6)  # 2 neuron layers × (6 train micro-batches + 6 eval batches)
    assert all(seen)
    engine.close()


def test_without_the_reset_state_leaks_and_the_check_sees_it() -> None:
    engine = engine_for({"step_mode": "m", "reset": "off"})
    seen = record_state(engine)
    run_multi_step(engine, carry_state=True)
    assert seen[:2] == [True, True]  # the very first call starts from the initial state
    assert not any(seen[2:])  # every later one inherits the previous batch's potentials
    engine.close()


def test_single_step_state_carries_over_the_time_steps_of_a_batch_only() -> None:
    engine = engine_for({"step_mode": "s"}, accumulation=1)
    assert not engine.snn.multi_step
    seen = record_state(engine)
    batches = 0
    for x, y in engine.dataloader(data()):
        out = sum(engine(x) for _ in range(T)) / T  # T calls, one time step each
        engine.backward(torch.nn.functional.cross_entropy(out, y))
        engine.step()
        batches += 1
    per_batch = [seen[i : i + 2 * T] for i in range(0, len(seen), 2 * T)]
    assert len(per_batch) == batches == 6
    for calls in per_batch:
        assert calls[:2] == [True, True] and not any(calls[2:])  # reset at the batch, carried inside
    engine.close()


def test_state_is_reset_after_a_checkpoint_load(tmp_path: Path) -> None:
    engine = engine_for({"step_mode": "m", "reset": "off"})
    engine.save_checkpoint(tmp_path)
    engine(engine.encode(torch.rand(4, 6) * 3))
    assert all(isinstance(n.v, torch.Tensor) for n in engine.snn.modules)
    assert "v" not in "".join(engine.module.state_dict())  # state is not saved as a parameter or buffer
    engine.load_checkpoint(tmp_path)
    assert all(n.v == n.v_reset for n in engine.snn.modules)
    engine.close()


def test_snn_can_be_switched_off_and_must_find_neurons_when_forced() -> None:
    engine = engine_for({"enabled": False})
    assert not engine.snn.active
    engine.close()
    with pytest.raises(
        spikingsail.ConfigError, match=r"snn\.enabled is true, but the model has no spiking neurons"
    ):
        spikingsail.initialize(model=torch.nn.Linear(2, 2), rank_info=RankInfo.single(),
                               config={"train_micro_batch_size_per_gpu": 1, "snn": {"enabled": True},
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})  # fmt: skip


def test_snn_config_values_are_checked() -> None:
    with pytest.raises(spikingsail.ConfigError, match=r"snn.step_mode is 'multi'") as err:
        engine_for({"step_mode": "multi"})
    assert "use one of 's', 'm' (or leave it out)" in str(err.value)

"""snn.check_state: every kind of leak made for real, on spikingjelly, snntorch and norse models, is caught
naming the neuron and the boundary; clean runs are never flagged. And snntorch's neuron state, kept in
buffers, stays each rank's own under DDP."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import norse.torch as norse
import pytest
import snntorch
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import neuron
from torch import nn
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.snn import firing_rate
from spikingsail.snn.support import StateLeakError
from tests.multiprocess import run_ranks
from tests.snn.models import spiking_mlp

T = 3


def engine_for(model: nn.Module, reset: str = "per_batch", step_mode: str | None = "m", accumulation: int = 1,
               checkpoints: str | None = None, lr: float = 0.01, single: bool = True, check: bool = True) -> Any:  # fmt: skip
    snn: dict[str, Any] = {"check_state": check, "reset": reset, "time_steps": T}
    if step_mode:
        snn["step_mode"] = step_mode
    engine, _ = spikingsail.initialize(
        model=model, rank_info=RankInfo.single() if single else None, checkpoints_path=checkpoints,
        config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
                "optimizer": {"type": "SGD", "params": {"lr": lr}}, "snn": snn,
                "sail": {"progress_bar": False, "seed": 1}},
    )  # fmt: skip
    return engine


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.rand(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))


def multi_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    engine.backward(F.mse_loss(firing_rate(engine(engine.encode(x))), F.one_hot(y, 3).float()))
    engine.step()


# -- spikingjelly --------------------------------------------------------------------------------


def test_a_clean_spikingjelly_run_is_never_flagged(tmp_path: Path) -> None:
    """Accumulation windows, evaluation, save and load, with the engine's own resets."""
    engine = engine_for(spiking_mlp(), accumulation=2, checkpoints=str(tmp_path))
    for x, y in engine.dataloader(data()):
        multi_step(engine, x, y)
    engine.eval()
    with torch.no_grad():
        for x, _ in engine.dataloader(data(), shuffle=False):
            engine(engine.encode(x))
    engine.train()
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))
    for x, y in engine.dataloader(data()):
        multi_step(engine, x, y)
    assert engine.snn.resets > 0
    engine.close()


def test_a_forgotten_reset_is_caught_at_the_next_micro_batch() -> None:
    engine = engine_for(spiking_mlp(), reset="off", accumulation=2)
    (x, y), *_ = list(engine.dataloader(data()))
    multi_step(engine, x, y)  # the window's first micro-batch
    with pytest.raises(StateLeakError, match=r"neuron '1' \(spikingjelly LIFNode\) carries state \(v\) across a "
                                             r"micro-batch's end \(backward\)"):  # fmt: skip
        engine(engine.encode(x))
    engine.close()


def test_a_leak_across_an_accumulation_boundary_is_named_so() -> None:
    """The script resets after every micro-step but the window's last: the state crosses the optimizer step."""
    engine = engine_for(spiking_mlp(), reset="off", accumulation=2)
    batches = list(engine.dataloader(data()))

    def train_resetting_inside_windows_only() -> None:
        for x, y in batches:
            boundary = engine.is_gradient_accumulation_boundary()
            multi_step(engine, x, y)
            if not boundary:
                engine.reset_neurons()

    with pytest.raises(StateLeakError, match=r"neuron '1' .* across an accumulation boundary"):
        train_resetting_inside_windows_only()
    assert engine.global_steps == 1  # caught at the first micro-batch after the first step
    engine.close()


def test_a_leak_across_a_train_eval_switch_is_named_so() -> None:
    engine = engine_for(spiking_mlp(), reset="off")
    x = torch.rand(4, 6)
    with torch.no_grad():
        engine(engine.encode(x))  # a look at the outputs in training mode, state left behind
        engine.eval()
        with pytest.raises(StateLeakError, match="across a train/eval switch"):
            engine(engine.encode(x))
    engine.close()


class BrokenReset(neuron.LIFNode):
    """A neuron whose reset() forgets its potential: the engine's resets do not take."""

    def reset(self) -> None:
        pass


def test_a_neuron_whose_reset_misses_its_state_is_caught_after_a_checkpoint_load(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 8), BrokenReset(tau=2.0))
    engine = engine_for(model, checkpoints=str(tmp_path))
    x = torch.rand(4, 6)
    with torch.no_grad():
        engine(engine.encode(x))  # the engine's first call: fresh
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))
    with pytest.raises(StateLeakError, match=r"neuron '1' \(spikingjelly BrokenReset\) carries state \(v\) across "
                                             r"a checkpoint load") as error:  # fmt: skip
        engine(engine.encode(x))
    assert "fix its reset" in str(error.value)
    engine.close()


# -- snntorch ------------------------------------------------------------------------------------


class SnnTorchNet(nn.Module):
    """Two snntorch Leaky layers with init_hidden=True (state in the module); one step per call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.lif1 = snntorch.Leaky(beta=0.8, init_hidden=True)
        self.lif2 = snntorch.Leaky(beta=0.8, init_hidden=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif2(self.fc2(self.lif1(self.fc1(x))))


def single_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    spikes = torch.stack([engine(x) for _ in range(T)])  # the script loops over time
    engine.backward(F.mse_loss(spikes.mean(0), F.one_hot(y, 3).float()))
    engine.step()
    return spikes


def test_the_snntorch_adapter_finds_resets_and_reads_the_neurons() -> None:
    engine = engine_for(SnnTorchNet(), step_mode=None, accumulation=2)
    assert engine.snn.adapter.name == "snntorch" and len(engine.snn.modules) == 2
    for x, y in engine.dataloader(data()):
        single_step(engine, x, y)
    engine.eval()
    with torch.no_grad():
        for x, _ in engine.dataloader(data(), shuffle=False):
            for _ in range(T):
                engine(x)
    assert engine.snn.resets > 0
    engine.close()


def test_a_forgotten_snntorch_reset_is_caught() -> None:
    engine = engine_for(SnnTorchNet(), reset="off", step_mode=None)
    (x, y), *_ = list(engine.dataloader(data()))
    single_step(engine, x, y)
    with pytest.raises(StateLeakError, match=r"neuron 'lif1' \(snntorch Leaky\) carries state \(mem\)"):
        engine(x)
    engine.close()


def test_snntorch_has_no_multi_step_mode_to_set() -> None:
    with pytest.raises(spikingsail.errors.ConfigError, match="snntorch neurons take one time step per call"):
        engine_for(SnnTorchNet(), step_mode="m")


# -- norse ---------------------------------------------------------------------------------------


class NorseNet(nn.Module):
    """A norse LIF cell (stateless: state in, state out) whose state the model keeps between calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.cell, self.fc2 = nn.Linear(6, 8), norse.LIFCell(), nn.Linear(8, 3)
        self.state: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, self.state = self.cell(self.fc1(x) * 4, self.state)
        return self.fc2(z)


def test_the_norse_adapter_finds_resets_and_reads_the_kept_state(tmp_path: Path) -> None:
    model = NorseNet()
    engine = engine_for(model, step_mode=None, accumulation=2, checkpoints=str(tmp_path))
    assert engine.snn.adapter.name == "norse" and engine.snn.modules == [model]
    for x, y in engine.dataloader(data()):
        single_step(engine, x, y)
        assert model.state is None  # reset after the backward
    engine.eval()
    with torch.no_grad():
        for x, _ in engine.dataloader(data(), shuffle=False):
            for _ in range(T):
                engine(x)
    engine.train()
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))
    for x, y in engine.dataloader(data()):
        single_step(engine, x, y)
    engine.close()


def test_a_forgotten_norse_reset_is_caught() -> None:
    engine = engine_for(NorseNet(), reset="off", step_mode=None)
    (x, y), *_ = list(engine.dataloader(data()))
    single_step(engine, x, y)
    with pytest.raises(
        StateLeakError, match=r"neuron '<the model>' \(norse NorseNet\) carries state \(state\)"
    ):
        engine(x)
    engine.close()


def test_norse_step_modes_are_module_classes() -> None:
    with pytest.raises(spikingsail.errors.ConfigError, match="norse fixes the step mode by module class"):
        engine_for(NorseNet(), step_mode="s")


def streaming(lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps with the state carried (reset off); returns this rank's membrane potentials after the
    second and what the same rank computes alone from the same model, inputs and carried state."""
    model = SnnTorchNet()
    alone = copy.deepcopy(model)
    engine = engine_for(model, reset="off", step_mode=None, lr=lr, single=False, check=False)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    first, second = torch.rand(4, 6, generator=g) * 2, torch.rand(4, 6, generator=g) * 2
    engine.backward(engine(first).sum())
    engine.step()
    engine(second)
    alone(first)
    alone(second)
    got = torch.cat([model.lif1.mem.flatten(), model.lif2.mem.flatten()]).detach()
    engine.close()
    return got, torch.cat([alone.lif1.mem.flatten(), alone.lif2.mem.flatten()]).detach()


@pytest.mark.multiprocess
def test_snntorch_state_stays_each_ranks_own_under_ddp() -> None:
    """snntorch keeps mem in (non-persistent) buffers, which DDP would overwrite with rank 0's at every
    forward; the engine tells DDP to leave them alone. lr 0: the weights stay those of the replay."""
    for rank, (out, expected) in run_ranks(streaming, 2, 0.0).items():
        assert torch.equal(out, expected), rank
        assert expected.abs().sum() > 0

"""``snn.backend``: which of spikingjelly's neuron kernels run, set from the config.

On a CPU spikingjelly runs its torch reference ops whatever is chosen; what these tests prove here is
that the engine sets spikingjelly's own per-kind choice (the object its ``SJ_<KIND>_CUDA_IMPLEMENTATION``
variables set), trains exactly as the plain loop on the chosen kernels does, and refuses what the
device cannot run before the first step. The fused kernels themselves run in tests/gpu.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import functional
from spikingjelly.activation_based.functional import neuron_implementation

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from spikingsail.snn import firing_rate
from spikingsail.snn.kernels import selections
from tests.snn.models import chunkable_snn

T, BATCH, STEPS = 6, 4, 3


def engine_for(model: torch.nn.Module, **snn: Any) -> Any:
    engine, _ = spikingsail.initialize(
        model=model, rank_info=RankInfo.single(),
        config={"train_micro_batch_size_per_gpu": BATCH, "snn": {"step_mode": "m", **snn},
                "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
                "sail": {"progress_bar": False, "hang_timeout_seconds": 0, "straggler_window": 0}},
    )  # fmt: skip
    return engine


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs in [0, 5): chunkable_snn's first neurons fire on about 5 % of them (on [0, 1) none did, and
    the Linear after them trained nothing)."""
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.rand(T, BATCH, 1, 4, 4, generator=generator) * 5,
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        for _ in range(STEPS)
    ]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(firing_rate(out), F.one_hot(y, 3).float())


@pytest.fixture(autouse=True)
def _spikingjellys_own_choice() -> Any:
    """Every test leaves spikingjelly's choice as its import made it (from the environment)."""
    yield
    engine_for(chunkable_snn(T), backend="auto").close()


@pytest.mark.parametrize("snn", [{"backend": "torch"}, {"backend": "torch", "time_chunk": 2}])
def test_the_torch_kernels_train_as_the_plain_loop_does(snn: dict[str, Any]) -> None:
    model = chunkable_snn(T, batch_norm=False)
    functional.set_step_mode(model, "m")
    plain = copy.deepcopy(model)
    start = copy.deepcopy(plain.state_dict())
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    engine = engine_for(model, **snn)
    try:
        kinds = selections()
        assert len(kinds) >= 9 and {s._namespace for s in kinds} >= {"sj_lif", "sj_if", "sj_plif"}
        assert all(s._requested == "torch" for s in kinds)
        assert neuron_implementation("lif", torch.device("cpu"))["implementation"] == "torch-reference"
        for x, y in batches():
            torch.manual_seed(1)  # the dropout masks
            optimizer.zero_grad()
            loss_of(plain(x), y).backward()
            optimizer.step()
            functional.reset_net(plain)
            torch.manual_seed(1)
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
        for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
            if "time_chunk" in snn:  # a recompute's sums round differently (as in test_chunking)
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
            else:
                assert torch.equal(mine, theirs), name
        assert [name for name, value in plain.state_dict().items() if torch.equal(value, start[name])] == []
    finally:
        engine.close()


def test_auto_gives_the_choice_back_to_spikingjellys_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    engine_for(chunkable_snn(T), backend="torch").close()
    monkeypatch.setenv("SJ_LIF_CUDA_IMPLEMENTATION", "triton")
    engine_for(chunkable_snn(T), backend="auto").close()
    chosen = {s._namespace: s._requested for s in selections()}
    assert chosen.pop("sj_lif") == "triton"
    assert set(chosen.values()) == {"auto"}


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("triton", r"snn.backend is 'triton', but the engine's device is cpu(.|\n)*run on a GPU"),
        ("cuda", r"snn.backend is 'cuda', but the engine's device is cpu"),
        ("cupy", r"no CuPy kernels(.|\n)*replaced the neurons' cupy backend(.|\n)*\"cuda\""),
    ],
)
def test_kernels_the_device_cannot_run_are_refused_before_the_first_step(backend: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_for(chunkable_snn(T), backend=backend)


def test_a_variable_that_chooses_other_kernels_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = {s._namespace: s._requested for s in selections()}
    monkeypatch.setenv("SJ_PLIF_CUDA_IMPLEMENTATION", "cuda")
    with pytest.raises(ConfigError, match=r"environment sets SJ_PLIF_CUDA_IMPLEMENTATION=cuda(.|\n)*unset"):
        engine_for(chunkable_snn(T), backend="torch")
    assert {s._namespace: s._requested for s in selections()} == before  # nothing half-applied
    monkeypatch.setenv("SJ_PLIF_CUDA_IMPLEMENTATION", "torch")
    engine_for(chunkable_snn(T), backend="torch").close()  # the same choice twice is no conflict


def test_a_backend_for_neurons_that_have_none_is_refused() -> None:
    import snntorch  # the test environment has it (scripts/install.sh)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), snntorch.Leaky(beta=0.9, init_hidden=True))
    with pytest.raises(ConfigError, match=r"neurons are snntorch's(.|\n)*no neuron kernels(.|\n)*compile"):
        engine_for(model, backend="torch", step_mode=None)
    with pytest.raises(ConfigError, match=r"snn.backend is 'torch', but the model has no spiking neurons"):
        engine_for(torch.nn.Linear(4, 4), backend="torch", step_mode=None)

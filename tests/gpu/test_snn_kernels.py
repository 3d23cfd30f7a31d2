"""``snn.backend`` on a CUDA device: spikingjelly's Triton and native kernels through the engine."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from spikingjelly.activation_based import functional
from spikingjelly.activation_based.functional import neuron_implementation

from spikingsail.errors import ConfigError
from tests.snn.models import chunkable_snn
from tests.snn.test_kernels import T, batches, engine_for, loss_of

pytestmark = pytest.mark.requires_cuda


@pytest.fixture(autouse=True)
def _spikingjellys_own_choice() -> Any:
    yield
    engine_for(chunkable_snn(T), backend="auto").close()


def _on_gpu(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].cuda(), batch[1].cuda()


@pytest.mark.parametrize("snn", [{"backend": "triton"}, {"backend": "triton", "time_chunk": 2}])
def test_the_triton_kernels_train_as_the_plain_loop_on_them_does(snn: dict[str, Any]) -> None:
    """In chunks, without torch's per-element dropout: CUDA's Philox generator starts each kernel
    launch at a rounded-up offset, so three chunks' draws are not the whole step's one draw (on an
    H200 the first convolution's gradients after one step differed by 17% of the largest, on the
    torch ops and on Triton alike; by 1e-10 without that dropout). The chunks replay their own draws in the recompute."""
    model = chunkable_snn(T, batch_norm=False, elementwise_dropout="time_chunk" not in snn)
    functional.set_step_mode(model, "m")
    plain = copy.deepcopy(model).cuda()
    start = copy.deepcopy(plain.state_dict())
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    engine = engine_for(model, **snn)
    try:
        assert neuron_implementation("lif", engine.device)["implementation"] == "triton"
        for batch in batches():
            x, y = _on_gpu(batch)
            torch.manual_seed(1)
            optimizer.zero_grad()
            loss_of(plain(x), y).backward()
            optimizer.step()
            functional.reset_net(plain)
            torch.manual_seed(1)
            engine.backward(loss_of(engine(x), y))
            engine.step()
        for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
        assert [name for name, value in plain.state_dict().items() if torch.equal(value, start[name])] == []
    finally:
        engine.close()


def test_native_kernels_run_where_built_and_are_refused_naming_the_build_where_not() -> None:
    from spikingjelly._ops.native_loader import _native_available

    if _native_available("spikingjelly._ops.lif", torch.cuda.current_device()):
        engine = engine_for(chunkable_snn(T), backend="cuda")
        assert neuron_implementation("lif", engine.device)["implementation"] == "cuda"
        engine.close()
    else:
        with pytest.raises(ConfigError, match=r"does not load on cuda(.|\n)*SJ_BUILD_NATIVE_CUDA=1"):
            engine_for(chunkable_snn(T), backend="cuda")

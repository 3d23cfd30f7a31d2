"""snn.time_chunk: time-chunked gradient checkpointing, against the unchunked run as the reference.

The tolerance of every comparison with the unchunked model is float rounding (rtol 1e-5, atol 1e-6):
a weight's gradient is summed chunk by chunk instead of in one reduction over T × N samples.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spikingjelly.activation_based import base, functional, layer
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.config.parse import load_config
from spikingsail.config.schema import SNNConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from spikingsail.snn import firing_rate
from spikingsail.snn.chunking import MIB, _memory_slots, choose_chunk, time_chunked
from tests.multiprocess import run_ranks, train_micro_steps
from tests.snn.models import chunkable_snn, lif, spiking_cnn

T = 8
RTOL, ATOL = 1e-5, 1e-6


def sequence(n: int = 6, seed: int = 4) -> torch.Tensor:
    return torch.rand(T, n, 1, 4, 4, generator=torch.Generator().manual_seed(seed)) * 3


def gradients(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(11)  # the dropout draws
    out = model(x)
    (out.mean(0) - 0.3).pow(2).sum().backward()
    functional.reset_net(model)
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def chunked(model: nn.Module, k: int | str, **snn: Any) -> nn.Module:
    config = SNNConfig(step_mode="m", time_chunk=k, **snn)
    return time_chunked(model, config, "spikingjelly", True, "test")


@pytest.mark.parametrize("k", [1, 3, 4])
def test_chunked_gradients_equal_the_unchunked_ones(k: int) -> None:
    """Chunks of 1, of 3 (8 = 3 + 3 + 2) and of 4 steps, with dropout of both kinds and BNTT."""
    plain = chunkable_snn(T)
    functional.set_step_mode(plain, "m")
    wrapped = chunked(copy.deepcopy(plain), k)
    calls: list[int] = []
    wrapped[0].register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))  # the first conv
    out, grads = gradients(plain, sequence())
    out_chunked, grads_chunked = gradients(wrapped, sequence())
    sizes = [len(piece) for piece in torch.tensor_split(torch.arange(T), -(-T // k))]
    # the first chunked forward is checked once (no grad): the first two chunks' steps whole, then in those
    # chunks; then the chunks forward, and backward recomputes every one but the last, whose activations were kept
    assert calls == [sizes[0] + sizes[1], *sizes[:2], *sizes, *sizes[:-1][::-1]]
    assert torch.equal(out, out_chunked)
    assert any(g.abs().sum() > 0 for g in grads)
    for g, g_chunked in zip(grads, grads_chunked, strict=True):
        torch.testing.assert_close(g_chunked, g, rtol=RTOL, atol=ATOL)
    # running statistics and num_batches_tracked updated once per step, as whole, not again in the recompute
    buffers = dict(plain.named_buffers())
    assert buffers and buffers["1.bn_list.0.num_batches_tracked"] == 1
    state = wrapped.state_dict()
    for name, buffer in buffers.items():
        assert torch.equal(state[name], buffer), name


def test_a_chunked_forward_leaves_the_neuron_state_the_unchunked_one_does() -> None:
    plain = chunkable_snn(T)
    functional.set_step_mode(plain, "m")
    wrapped = chunked(copy.deepcopy(plain), 3)
    for model in (plain, wrapped):
        torch.manual_seed(11)
        model(sequence())
    states, chunked_states = base.extract_memories(plain), base.extract_memories(wrapped)
    assert len(states) == len(chunked_states) > 0
    for state, chunked_state in zip(states, chunked_states, strict=True):
        torch.testing.assert_close(chunked_state, state, rtol=RTOL, atol=ATOL)


def test_the_memory_slots_are_spikingjellys_memories_in_its_order() -> None:
    """A nested, residual spikingjelly model: one slot per memory, in ``extract_memories`` order."""
    from spikingjelly.activation_based import neuron
    from spikingjelly.activation_based.model import sew_resnet

    net = sew_resnet.sew_resnet18(num_classes=4, cnf="ADD", spiking_neuron=neuron.IFNode)
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        net(torch.rand(2, 2, 3, 16, 16))  # every state a tensor of its own
    slots = _memory_slots(net, base.MemoryModule)
    assert [id(memory._memories[name]) for memory, name in slots] == [
        id(v) for v in base.extract_memories(net)
    ]
    assert len({id(v) for v in base.extract_memories(net)}) == len(slots) > 10


def test_the_dropout_a_recompute_draws_is_the_forwards() -> None:
    """Per-element dropout in a chunk draws again in backward: with the RNG replayed, the mask is the same."""
    net = nn.Sequential(layer.Linear(5, 5), layer.SeqToANNContainer(nn.Dropout(0.5)), lif())
    functional.set_step_mode(net, "m")
    x = torch.rand(T, 3, 5).requires_grad_()
    wrapped = chunked(copy.deepcopy(net), 2)
    torch.manual_seed(2)
    wrapped(x).sum().backward()
    assert x.grad is not None
    chunked_grad = x.grad.clone()
    x.grad = None
    torch.manual_seed(2)
    net(x).sum().backward()
    torch.testing.assert_close(chunked_grad, x.grad, rtol=RTOL, atol=ATOL)


def test_a_chunked_forward_keeps_a_fraction_of_the_activations() -> None:
    """What autograd holds after the forward (what backward needs): chunks keep boundary state, not steps."""

    def kept_bytes(model: nn.Module) -> int:
        seen: set[int] = {p.data_ptr() for p in model.parameters()}
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.rand(32, 16, 1, 4, 4))
        return total

    plain = chunkable_snn(32)
    functional.set_step_mode(plain, "m")
    unchunked = kept_bytes(plain)
    functional.reset_net(plain)
    in_chunks = kept_bytes(chunked(plain, 4))
    assert in_chunks < unchunked / 4, (in_chunks, unchunked)


def test_eval_and_no_grad_run_the_model_whole() -> None:
    net = chunkable_snn(T)
    functional.set_step_mode(net, "m")
    wrapped = chunked(net, 2)
    calls: list[int] = []
    wrapped[0].register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    with torch.no_grad():
        wrapped(sequence())
    functional.reset_net(wrapped)
    wrapped.eval()
    wrapped(sequence())
    assert calls == [T, T]


def test_batch_norm_over_time_is_refused_naming_it() -> None:
    net = spiking_cnn()  # layer.BatchNorm2d: statistics over T × N
    functional.set_step_mode(net, "m")
    wrapped = chunked(net, 2)
    with pytest.raises(ConfigError, match=r"batch norm '1' normalises with batch statistics") as error:
        wrapped(torch.rand(4, 2, 1, 4, 4))
    assert "BatchNormThroughTime2d" in str(error.value) and "per_chunk" in str(error.value)
    net.eval()  # frozen statistics split exactly
    wrapped.train()
    net[1].eval()
    wrapped(torch.rand(4, 2, 1, 4, 4)).sum().backward()


def test_per_chunk_batch_norm_normalises_each_chunk_by_itself() -> None:
    """The opt-in equals running the chunks one after another as separate multi-step calls."""
    net = spiking_cnn()
    functional.set_step_mode(net, "m")
    x = torch.rand(4, 2, 1, 4, 4) * 3
    wrapped = chunked(copy.deepcopy(net), 2, chunk_batchnorm="per_chunk")
    out = wrapped(x)
    separately = torch.cat([net(x[:2]), net(x[2:])])
    torch.testing.assert_close(out, separately)
    state = wrapped.state_dict()
    for name, buffer in net.named_buffers():
        torch.testing.assert_close(state[name], buffer, msg=name)  # running statistics committed once


class Masked(nn.Module):
    """Multiplies by a fixed buffer: a buffer that is not a batch norm's, read and never changed."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.linspace(0.5, 1.5, shape[0]).reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


def test_a_model_with_other_buffers_takes_spikingjellys_path_and_is_exact() -> None:
    """Buffers that are not a batch norm's take spikingjelly's path, which hands each chunk (and its
    recompute) the buffers as they were before it. (A buffer that changes on every call is refused.)"""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(5, 5), Masked(5), lif(), layer.Linear(5, 2), lif())
    functional.set_step_mode(net, "m")
    x = torch.rand(4, 3, 5) * 3
    wrapped = chunked(copy.deepcopy(net), 2)
    assert wrapped.checkpoint_fn.func._other_buffers
    out, grads = gradients(net, x)
    out_chunked, grads_chunked = gradients(wrapped, x)
    assert torch.equal(out, out_chunked)
    assert any(g.abs().sum() > 0 for g in grads)
    for g, g_chunked in zip(grads, grads_chunked, strict=True):
        torch.testing.assert_close(g_chunked, g, rtol=RTOL, atol=ATOL)


def test_state_dict_keys_and_parameters_are_the_models() -> None:
    net = chunkable_snn(T)
    functional.set_step_mode(net, "m")
    wrapped = chunked(net, 2)
    assert list(wrapped.state_dict()) == list(net.state_dict())
    assert [p for p in wrapped.parameters()] == [p for p in net.parameters()]
    wrapped.load_state_dict(net.state_dict())


def test_choose_chunk_takes_the_largest_chunk_that_fits() -> None:
    # k steps of 10 MiB while a chunk is recomputed, 1 MiB per boundary after the first chunk
    assert choose_chunk(16, 10 * MIB, MIB, 1000 * MIB).steps_per_chunk == 16  # all of it fits
    choice = choose_chunk(16, 10 * MIB, MIB, 45 * MIB)
    assert (choice.steps_per_chunk, choice.chunks, choice.fits) == (4, 4, True)
    assert choice.estimate_bytes == 4 * 10 * MIB + 3 * MIB
    tight = choose_chunk(16, 10 * MIB, MIB, 5 * MIB)  # nothing fits: the smallest estimate, said so
    assert (tight.steps_per_chunk, tight.fits) == (1, False)
    assert "over the 5 MiB budget" in tight.describe(5)


def test_auto_picks_a_chunk_from_the_budget_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    net = chunkable_snn(32)
    functional.set_step_mode(net, "m")
    reference = copy.deepcopy(net)
    x = torch.rand(32, 16, 1, 4, 4)
    wide = chunked(copy.deepcopy(net), "auto", memory_budget_mb=10_000.0)
    with caplog.at_level(logging.INFO, logger="spikingsail.snn.chunking"):
        wide(x)
    assert "T=32 in 1 chunk(s) of ≤32 step(s)" in caplog.text
    caplog.clear()
    wrapped = chunked(net, "auto", memory_budget_mb=0.2)
    with caplog.at_level(logging.INFO, logger="spikingsail.snn.chunking"):
        out, grads = gradients(wrapped, x)
    (choice,) = wrapped.checkpoint_fn.func.choices.values()
    assert 1 < choice.chunks < 32 and choice.fits, choice
    assert f"in {choice.chunks} chunk(s) of ≤{choice.steps_per_chunk} step(s)" in caplog.text
    assert 0 < choice.bytes_per_boundary < choice.bytes_per_step
    out_ref, grads_ref = gradients(reference, x)  # the measuring left state, buffers and RNG alone
    assert torch.equal(out, out_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=RTOL, atol=ATOL)


ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


# -- the config, checked where it is read ---------------------------------------------------


@pytest.mark.parametrize(
    ("snn", "message"),
    [
        ({"time_chunk": "auto"}, 'snn.time_chunk is "auto" but snn.memory_budget_mb is not set'),
        ({"time_chunk": 4, "memory_budget_mb": 100}, "snn.memory_budget_mb is set but snn.time_chunk is 4"),
        ({"time_chunk": -1}, "snn.time_chunk"),
        ({"time_chunk": "half"}, "snn.time_chunk is 'half'"),
        ({"time_chunk": 2.5}, "snn.time_chunk"),
        ({"time_chunk": 2, "step_mode": "s"}, "snn.step_mode is 's'"),
        ({"time_chunk": 2, "enabled": False}, "snn.enabled is false"),
        ({"time_chunk": "auto", "memory_budget_mb": 0}, "snn.memory_budget_mb"),
    ],
)
def test_bad_time_chunk_settings_are_refused(snn: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_micro_batch_size_per_gpu": 2, "snn": snn}, 1)


def test_a_model_without_spiking_neurons_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"snn\.time_chunk is 2, but the model has no spiking neurons"):
        spikingsail.initialize(model=nn.Linear(2, 2), rank_info=RankInfo.single(),
                               config={"train_micro_batch_size_per_gpu": 2, "snn": {"time_chunk": 2}, **ADAM,
                                       "sail": {"progress_bar": False}})  # fmt: skip


def test_single_step_neurons_are_refused() -> None:
    with pytest.raises(ConfigError, match="not all in multi-step mode"):
        spikingsail.initialize(model=chunkable_snn(T), rank_info=RankInfo.single(),
                               config={"train_micro_batch_size_per_gpu": 2, "snn": {"time_chunk": 2}, **ADAM,
                                       "sail": {"progress_bar": False}})  # fmt: skip


# -- through the engine, on real gloo ranks ---------------------------------------------------

STEPS_T = 4


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(9)
    return TensorDataset(torch.rand(48, 1, 4, 4, generator=g) * 2, torch.randint(0, 3, (48,), generator=g))


def config(micro: int, accumulation: int, backend: str, time_chunk: int, precision: str,
           stage: int, model: str) -> dict[str, Any]:  # fmt: skip
    snn: dict[str, Any] = {"step_mode": "m", "time_steps": STEPS_T, "time_chunk": time_chunk}
    if model == "batchnorm":
        snn |= {"sync_batchnorm": True, "chunk_batchnorm": "per_chunk"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "zero_optimization": {"stage": stage},
        "snn": snn,
        "sail": {"seed": 3, "progress_bar": False, "backend": backend},
    }


def train(single: bool, micro: int, accumulation: int, backend: str = "ddp", time_chunk: int = 0,
          precision: str = "fp32", stage: int = 0, model: str = "chunkable", checkpoints: str | None = None,
          stop_at: int | None = None, resume: bool = False) -> dict[str, torch.Tensor] | None:  # fmt: skip
    net = spiking_cnn() if model == "batchnorm" else chunkable_snn(STEPS_T, batch_norm=model == "chunkable")
    if model == "masked":
        net[1] = Masked(4, 1, 1)  # in the batch norm's place
    engine, _ = spikingsail.initialize(
        model=net, config=config(micro, accumulation, backend, time_chunk, precision, stage, model),
        rank_info=RankInfo.single() if single else None, checkpoints_path=checkpoints, resume=resume,
    )  # fmt: skip
    loader = engine.dataloader(data())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        rate = firing_rate(engine(engine.encode(x)))
        engine.backward(F.mse_loss(rate.float(), F.one_hot(y, 3).float()))
        engine.step()

    if not train_micro_steps(engine, loader, 8, step, stop_at=stop_at, checkpoints=checkpoints):
        return None
    if backend == "deepspeed":
        state = engine.backend.consolidated_state_dict(engine.wrapped_module)
    else:
        state = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    result = {k: v.detach().float().clone() for k, v in state.items()}
    engine.close()
    return result


def assert_same_model(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=key)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("backend", "stage", "accumulation", "precision", "model"),
    [("ddp", 0, 2, "fp32", "chunkable"), ("fsdp", 3, 1, "fp32", "chunkable"), ("fsdp", 3, 2, "fp32", "no-buffers"),
     ("deepspeed", 2, 2, "fp32", "chunkable"), ("deepspeed", 3, 1, "fp32", "no-buffers"),
     ("ddp", 0, 1, "bf16", "chunkable"), ("ddp", 0, 2, "fp16", "chunkable")],
)  # fmt: skip
def test_chunked_ranks_train_like_unchunked_ones(backend: str, stage: int, accumulation: int, precision: str,
                                                 model: str) -> None:  # fmt: skip
    """8 micro-steps on 2 gloo ranks, in chunks of 2 of the 4 steps and whole; the same dropout draws.
    With and without batch norms through time: FSDP2 and ZeRO-3 must gather in the chunks' recomputes."""
    whole = run_ranks(train, 2, False, 4, accumulation, backend, 0, precision, stage, model)
    in_chunks = run_ranks(train, 2, False, 4, accumulation, backend, 2, precision, stage, model)
    # bf16/fp16: the chunks' weight gradients are rounded to 16 bits chunk by chunk (as the matrix's 16-bit rows)
    rtol, atol = (RTOL, ATOL) if precision == "fp32" else (2e-2, 2e-3)
    for rank in (0, 1):
        assert_same_model(in_chunks[rank], whole[rank], rtol, atol)


@pytest.mark.multiprocess
def test_a_model_with_other_buffers_trains_alike_in_chunks_on_fsdp_and_ddp() -> None:
    """spikingjelly's all-buffers path runs the model through torch.func.functional_call: FSDP2 must still gather."""
    fsdp = run_ranks(train, 2, False, 4, 1, "fsdp", 2, "fp32", 3, "masked")
    whole = run_ranks(train, 2, False, 4, 1, "ddp", 0, "fp32", 0, "masked")
    assert "1.mask" in fsdp[0]
    for rank in (0, 1):
        assert_same_model(fsdp[rank], whole[rank], RTOL, ATOL)


@pytest.mark.multiprocess
def test_synchronised_per_chunk_batch_norm_on_two_ranks_equals_one_process() -> None:
    """SyncBN over each chunk's k × N samples of both ranks = one process's BN over the chunk of 2N."""
    reference = train(True, 8, 1, time_chunk=2, model="batchnorm")
    ranks = run_ranks(train, 2, False, 4, 1, "ddp", 2, "fp32", 0, "batchnorm")
    assert reference is not None and any("running_mean" in key for key in reference)
    assert_same_model(ranks[0], reference, RTOL, ATOL)
    assert_same_model(ranks[1], reference, RTOL, ATOL)


@pytest.mark.multiprocess
def test_a_chunked_run_resumes_exactly_and_its_checkpoint_loads_without_chunks(tmp_path: Path) -> None:
    whole = run_ranks(train, 2, False, 4, 2, "ddp", 2)
    checkpoints = str(tmp_path / "ckpt")
    run_ranks(train, 2, False, 4, 2, "ddp", 2, "fp32", 0, "chunkable", checkpoints, 4)
    resumed = run_ranks(train, 2, False, 4, 2, "ddp", 2, "fp32", 0, "chunkable", checkpoints, None, True)
    for rank in (0, 1):
        for key, value in whole[rank].items():
            assert torch.equal(resumed[rank][key], value), key  # bit-exact
    # the same checkpoint resumes a run without chunks (the state_dict keys are the model's)
    unchunked = run_ranks(train, 2, False, 4, 2, "ddp", 0, "fp32", 0, "chunkable", checkpoints, None, True)
    assert_same_model(unchunked[0], whole[0], RTOL, ATOL)

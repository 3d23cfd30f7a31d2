"""``torch.compile`` through the engine: the ``compile`` section as DeepSpeed's earlier format and
torch.compile's arguments, DeepSpeed's DeepCompile keys left to DeepSpeed, a compiled engine that
trains like the compiled plain loop, and recompilations counted and reported.

The matrix (``tests/matrix``) runs compiled cells on every backend against a compiled one-process
reference; these tests pin what a sample may not draw."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.backends.compiling import compile_kwargs, named_modules
from spikingsail.backends.deepspeed import deepspeed_config
from spikingsail.config.compiling import CompileConfig
from spikingsail.config.parse import load_config
from spikingsail.engine.compiling import CompileWatch
from spikingsail.engine.state import StepCounters
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from tests.multiprocess import run_ranks

BATCH = {"train_micro_batch_size_per_gpu": 8}


def test_deepspeeds_earlier_compile_keys_and_torch_compiles_own_are_read() -> None:
    # DeepSpeed 0.14-0.16's section: {"enabled", "backend", "kwargs"}, meaning torch.compile(model, backend, **kwargs)
    config = load_config(
        {**BATCH, "compile": {"enabled": True, "backend": "aot_eager", "kwargs": {"options": {}}}}, 1
    )
    assert config.compile == CompileConfig(enabled=True, backend="aot_eager", kwargs={"options": {}})
    config = load_config({**BATCH, "compile": {"enabled": True, "mode": "max-autotune", "dynamic": True,
                                               "fullgraph": True, "modules": ["Block", "head"]}}, 1)  # fmt: skip
    assert compile_kwargs(config.compile, "f") == {
        "mode": "max-autotune", "dynamic": True, "fullgraph": True, "backend": "inductor"}  # fmt: skip
    assert load_config(BATCH, 1).compile == CompileConfig()  # off unless asked


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "horovod"])
def test_deepcompile_keys_are_refused_where_deepspeed_does_not_run_them(backend: str) -> None:
    raw = {**BATCH, "compile": {"enabled": True, "deepcompile": True}, "sail": {"backend": backend}}
    with pytest.raises(ConfigError, match=r"(?s)'compile\.deepcompile' is not a key .*DeepCompile"):
        load_config(raw, 1)


def test_the_deepspeed_backend_hands_deepspeed_its_deepcompile_keys_only() -> None:
    from deepspeed.compile.config import CompileConfig as DeepSpeedCompile

    from spikingsail.backends import load_config as load_for_backend

    raw = {**BATCH, "sail": {"backend": "deepspeed"},
           "compile": {"enabled": True, "mode": "default", "deepcompile": True, "free_activation": True}}  # fmt: skip
    config = load_for_backend(raw, 1)
    handed = deepspeed_config(config)["compile"]
    assert handed == {"deepcompile": True, "free_activation": True}
    DeepSpeedCompile(**handed)  # DeepSpeed's own class takes what it is handed ...
    with pytest.raises(ValueError, match="enabled"):  # ... and refuses SpikingSail's keys (extra="forbid")
        DeepSpeedCompile(**raw["compile"])
    assert "compile" not in deepspeed_config(load_for_backend({**raw, "compile": {"enabled": True}}, 1))
    # DeepCompile needs the engine to compile; without "enabled" it would silently not run
    with pytest.raises(ConfigError, match=r"compile\.deepcompile is true and compile\.enabled is not"):
        load_for_backend({**raw, "compile": {"deepcompile": True}}, 1)
    # a DeepCompile key DeepSpeed does not know is refused by DeepSpeed's class, before anything starts
    with pytest.raises(ConfigError, match="deepcompil"):
        load_for_backend({**raw, "compile": {"enabled": True, "deepcompil": True}}, 1)


def test_what_torch_compile_cannot_take_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"compile\.kwargs\.mode is set, and so is compile\.mode"):
        compile_kwargs(CompileConfig(mode="default", kwargs={"mode": "max-autotune"}), "f")
    with pytest.raises(ConfigError, match=r"compile\.kwargs\.backend"):
        compile_kwargs(CompileConfig(kwargs={"backend": "eager"}), "f")
    with pytest.raises(ConfigError, match="'no_such_backend', which is neither"):
        compile_kwargs(CompileConfig(backend="no_such_backend"), "f")
    assert compile_kwargs(CompileConfig(backend="torch.nn.functional.relu"), "f")["backend"] is F.relu
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert named_modules(model, ("1.0", "Linear"), "f") == [model[1][0], model[0]]
    with pytest.raises(ConfigError, match=r"(?s)'Block', which is neither .* Linear, Sequential"):
        named_modules(model, ("Block",), "f")


def slow_backend(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Any:
    """A torch.compile backend that takes 1.2 s, as a large model's compilation takes minutes."""
    time.sleep(1.2)
    return gm.forward


def test_recompilations_count_from_the_first_compiled_step_and_a_compilation_is_progress() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    counters, events, pulses = StepCounters(accumulation=1, global_steps=3), [], []
    watch = CompileWatch(counters, lambda *event: events.append(event), 0, lambda: pulses.append(1), 0.2)
    try:
        fn = torch.compile(lambda x: x * 2, backend=slow_backend, dynamic=False)  # each shape compiles
        fn(torch.ones(2))  # a resumed run's first compilation, at step 3: not a recompilation
        assert len(pulses) >= 4  # the hang watch's record beat while dynamo compiled
        fn(torch.ones(3))  # a new shape in that first step (an accumulation window's, a graph break's)
        counters.global_steps = 4
        fn(torch.ones(4))  # then one at a later step: a recompilation, with dynamo's reason
        assert watch.stats() == {"compiles": 3, "recompiles": 1}
        [(kind, message, step)] = events
        assert (kind, step) == ("recompile", 4) and "size mismatch" in message, message
    finally:
        watch.close()
        torch._dynamo.reset()
    beats = len(pulses)
    time.sleep(0.5)
    assert len(pulses) == beats  # no pulse between compilations


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)  # 36 samples: every epoch ends with a step of 4
    return TensorDataset(torch.randn(36, 6, generator=g), torch.randint(0, 3, (36,), generator=g))


def train(
    compile: dict[str, Any] | None, metrics: str, engine_loop: bool = True, by_call: bool = False
) -> dict[str, Any]:
    """Two epochs of 5 steps (the last of 4 samples), by the engine or by the plain loop a user writes;
    ``by_call``: compiled by DeepSpeed's ``engine.compile()`` after the engine is made, not by the config."""
    torch.set_num_threads(1)
    model = net()
    if not engine_loop:  # the compiled plain loop: torch.compile and an SGD step
        if compile:
            model.compile(backend="inductor")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for x, y in torch.utils.data.DataLoader(data(), batch_size=8):
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        from torch._dynamo.utils import counters

        return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "cache_hits": counters["inductor"]["fxgraph_cache_hit"]}  # fmt: skip
    config = {**BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sail": {"progress_bar": False, "metrics_path": metrics}}  # fmt: skip
    if compile is not None and not by_call:
        config["compile"] = compile
    engine, _ = spikingsail.initialize(model=model, config=config, rank_info=RankInfo.single())
    if by_call:
        assert not engine.is_compiled
        with pytest.raises(ConfigError, match=r"schedule and compiled_autograd_enabled are not supported"):
            engine.compile(compiled_autograd_enabled=True)
        engine.compile(backend="inductor", compile_kwargs={})  # DeepSpeed's arguments, as its scripts call it
        engine.compile()  # once compiled, a call does nothing
        assert engine.is_compiled
    for _ in range(2):
        for x, y in engine.dataloader(data(), shuffle=False):
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
    out = {
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "stats": engine.compiled.stats() if engine.compiled else None,
    }
    engine.close()
    return out


@pytest.mark.multiprocess
def test_a_compiled_engine_trains_like_the_compiled_plain_loop_and_reports_its_recompilation(
    tmp_path: Path,
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    compiled = run_ranks(train, 1, {"enabled": True}, str(metrics))[0]
    plain = run_ranks(train, 1, {"enabled": True}, str(tmp_path / "plain.jsonl"), False)[0]
    eager = run_ranks(train, 1, None, str(tmp_path / "eager.jsonl"))[0]
    by_call = run_ranks(train, 1, {}, str(tmp_path / "by_call.jsonl"), True, True)[0]
    assert compiled["params"].keys() == eager["params"].keys()  # compiled in place: the same names
    # the plain loop's process found the engine's graphs in inductor's cache, as a resume does
    assert plain["cache_hits"] > 0
    for key, value in plain["params"].items():
        assert torch.equal(compiled["params"][key], value), key  # the same kernels, bit for bit
        assert torch.equal(by_call["params"][key], value), key
        torch.testing.assert_close(eager["params"][key], value, rtol=1e-5, atol=1e-6)
    # the first epoch's short last step (4 samples after 8) compiles again, once: dynamo then marks
    # the batch dimension dynamic, and the second epoch's short step fits
    assert compiled["stats"] == by_call["stats"] == {"compiles": 2, "recompiles": 1}
    events = [line for line in map(json.loads, metrics.read_text().splitlines()) if "event" in line]
    assert [(e["step"], e["event"]) for e in events] == [(4, "recompile")]
    assert "size mismatch at index 0. expected 8, actual 4" in events[0]["message"]


@pytest.mark.multiprocess
def test_dynamic_shapes_from_the_start_compile_once(tmp_path: Path) -> None:
    result = run_ranks(train, 1, {"enabled": True, "dynamic": True}, str(tmp_path / "m.jsonl"))[0]
    assert result["stats"] == {"compiles": 1, "recompiles": 0}


def deepspeed_steps(steps: int) -> dict[str, int]:
    torch.set_num_threads(1)
    config = {**BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "compile": {"enabled": True},
              "sail": {"backend": "deepspeed", "progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=net(), config=config)
    loader = engine.dataloader(data(), drop_last=True)  # 2 steps of 16 an epoch
    while engine.global_steps < steps:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
    assert engine.compiled is not None
    stats = engine.compiled.stats()
    engine.close()
    return stats


@pytest.mark.multiprocess
def test_the_deepspeed_backend_compiles_without_compiling_again_at_every_step() -> None:
    # DeepSpeed's engine.compile() compiles its forward hook too, whose step counter dynamo guards
    # on: it compiled again at every step (8 times, then ran uncompiled); forward alone does not
    assert run_ranks(deepspeed_steps, 2, 4)[0]["recompiles"] == 0

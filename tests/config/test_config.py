"""Config validation: every mistake gets a message that names the key and the fix."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from spikingsail.backends import backend_class
from spikingsail.config import load_config
from spikingsail.engine.initialize import _check_balance, _check_offload, _check_zero_stage, _report_unused
from spikingsail.errors import ConfigError

MICRO = {"train_micro_batch_size_per_gpu": 4}


def error(config: Any, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size)
    return str(info.value)


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 32)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2, 32)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (4, 3, 24)),
        ({"train_batch_size": 16}, 4, (4, 1, 16)),
        ({"train_micro_batch_size_per_gpu": 8}, 3, (8, 1, 24)),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            4,
            (2, 3, 24),
        ),
    ],
)
def test_any_two_batch_keys_imply_the_third(
    given: dict[str, int], world: int, expected: tuple[int, ...]
) -> None:
    config = load_config(given, world)
    assert (
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        config.train_batch_size,
    ) == expected


def test_inconsistent_batch_sizes_spell_out_the_identity() -> None:
    message = error(
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
        world_size=4,
    )
    assert (
        "train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size"
        in message
    )
    assert "4 × 2 × 4 = 32 ≠ 30" in message


def test_train_batch_size_not_divisible_by_world_size() -> None:
    message = error({"train_batch_size": 10}, world_size=4)
    assert "world_size 4" in message and "≠ 10" in message


def test_no_batch_size_at_all() -> None:
    assert "neither 'train_batch_size' nor 'train_micro_batch_size_per_gpu'" in error({})


def test_unknown_key_lists_valid_ones_and_suggests() -> None:
    message = error({**MICRO, "gradient_clip": 1.0})
    assert "unknown key 'gradient_clip'" in message
    assert "did you mean 'gradient_clipping'?" in message
    assert "train_micro_batch_size_per_gpu" in message


def test_unknown_key_inside_a_section() -> None:
    message = error({**MICRO, "fp16": {"enabled": True, "loss_scale_windw": 100}})
    assert "unknown key 'loss_scale_windw' in 'fp16'" in message and "loss_scale_window" in message


def test_wrong_type_names_the_key() -> None:
    assert "'fp16.enabled' must be bool" in error({**MICRO, "fp16": {"enabled": "yes"}})
    assert "'train_micro_batch_size_per_gpu' must be int" in error({"train_micro_batch_size_per_gpu": 2.5})


def test_unknown_optimizer() -> None:
    message = error({**MICRO, "optimizer": {"type": "Lamb", "params": {}}})
    assert "optimizer.type 'Lamb' is not supported" in message and "AdamW" in message


def test_unknown_optimizer_param() -> None:
    message = error({**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}})
    assert "'betas', which SGD does not take" in message and "momentum" in message


def test_optimizer_needs_a_type() -> None:
    assert "'optimizer' needs the key 'type'" in error({**MICRO, "optimizer": {"params": {"lr": 1}}})


def test_fp16_and_bf16_together() -> None:
    assert "fp16.enabled and bf16.enabled are both true" in error(
        {**MICRO, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    )


def test_scheduler_checks() -> None:
    assert "scheduler.type 'Cosine' is not supported" in error({**MICRO, "scheduler": {"type": "Cosine"}})
    assert "WarmupDecayLR needs scheduler.params.total_num_steps" in error(
        {**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": {}}}
    )
    assert "'warmup_steps', which WarmupLR does not take" in error(
        {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}
    )


def test_zero_optimization_forms() -> None:
    assert load_config({**MICRO, "zero_optimization": True}, 1).zero_optimization.stage == 1
    assert load_config({**MICRO, "zero_optimization": False}, 1).zero_optimization.stage == 0
    zero = load_config(
        {**MICRO, "zero_optimization": {"stage": 2, "overlap_comm": True}}, 1
    ).zero_optimization
    assert (zero.stage, zero.options) == (2, {"overlap_comm": True})
    assert "ZeRO has stages 0 (off), 1, 2 and 3" in error({**MICRO, "zero_optimization": {"stage": 4}})
    assert "unknown key 'stages'" in error({**MICRO, "zero_optimization": {"stages": 1}})


def test_a_file_is_read_as_deepspeed_reads_it_and_a_bad_one_names_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed reads config files as hjson: comments and trailing commas. A file that is neither
    names its line; without hjson installed, a file that is not JSON says what would read it."""
    import hjson

    path = tmp_path / "ds.json"
    path.write_text('{\n  // the global batch\n  "train_batch_size": 8,\n  "fp16": {"enabled": true},\n}\n')
    assert (
        load_config(path, world_size=1).train_batch_size
        == 8
        == hjson.loads(path.read_text())["train_batch_size"]
    )
    path.write_text('{\n  "train_batch_size": 8\n  "fp16": [1,\n}\n')
    assert f"{path}:4:1: neither JSON nor hjson (which DeepSpeed reads)" in error(path)
    monkeypatch.setitem(sys.modules, "hjson", None)  # not installed
    path.write_text('{\n  "train_batch_size": 8,\n}\n')
    message = error(path)
    assert f"{path}:3:1: not valid JSON" in message and "pip install hjson" in message


def test_a_key_given_twice_names_the_line_of_the_second(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    # the same key in two objects is fine; twice in one object, one of them would be dropped
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": false},\n'
                    '  "bf16": {\n    "enabled": true,\n    "enabled": false\n  }\n}\n')  # fmt: skip
    message = error(path)
    assert message.startswith(f"{path}:6: the key 'enabled' appears twice in one object")
    assert "fix: keep one of them" in message
    path.write_text('{"train_batch_size": 8,\n"train_batch_size": 16}')
    assert error(path).startswith(f"{path}:2: the key 'train_batch_size' appears twice")


@pytest.mark.parametrize(
    ("key", "section", "value", "fix"),
    [
        ("sail.dist_backend", {"sail": {"dist_backend": "mpi"}}, "'mpi'", "use one of 'auto', 'nccl', 'gloo'"),
        ("snn.step_mode", {"snn": {"step_mode": "multi"}}, "'multi'", "use one of 's', 'm' (or leave it out)"),
        ("snn.encoding", {"snn": {"encoding": 1}}, "1", "use one of 'repeat', 'poisson'"),
        ("snn.reset", {"snn": {"reset": None}}, "None", "use one of 'per_batch', 'off'"),
    ],
)  # fmt: skip
def test_a_choice_outside_its_fields_values(key: str, section: dict[str, Any], value: str, fix: str) -> None:
    message = error({**MICRO, **section})
    assert message.startswith(f"<dict>: {key} is {value}") and f"fix: {fix}" in message


def test_a_backends_own_section_is_checked_at_the_boundary_and_kept_from_deepspeed() -> None:
    from spikingsail import backends
    from spikingsail.backends.deepspeed import deepspeed_config
    from spikingsail.backends.horovod import HorovodConfig

    raw = {"train_micro_batch_size_per_gpu": 1, "horovod": {"compression": "FP16", "op": "adasum"}}
    with pytest.raises(ConfigError, match="unknown key 'horovod' in the top level"):
        load_config(raw, world_size=1)  # the table alone knows no backend's section
    config = backends.load_config(raw, world_size=1)  # what initialize and spikingsail.load_config use
    assert config.backend_sections == {"horovod": HorovodConfig(compression="fp16", op="Adasum")}
    assert "horovod" not in deepspeed_config(config)
    with pytest.raises(ConfigError, match=r"<dict>: horovod\.op is 'Sum'"):  # checked whatever the backend
        backends.load_config({**raw, "horovod": {"op": "Sum"}}, world_size=1)


def test_missing_file(tmp_path: Path) -> None:
    assert "does not exist" in error(tmp_path / "nope.json")


def test_messages_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**MICRO, "optimiser": {}}))
    assert error(path).startswith(f"{path}: unknown key 'optimiser'")


def test_deepspeed_keys_without_effect_warn(caplog: pytest.LogCaptureFixture) -> None:
    raw = {**MICRO, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5,
                                 "offload_param": {"device": "none"}}}  # fmt: skip
    config = load_config(raw, 1)
    for name in ("ddp", "fsdp", "horovod"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _report_unused(config, backend_class(name))
        for key in ("zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
                    "zero_optimization.offload_param"):  # fmt: skip
            assert (
                f"'{key}' is accepted for DeepSpeed compatibility but has no effect with backend {name} "
                '(it takes effect with "sail": {"backend": "deepspeed"}; remove it to silence this)'
            ) in caplog.text
        assert (  # and what does it on every backend
            f"'wall_clock_breakdown' is accepted for DeepSpeed compatibility but has no effect with backend {name} "
            '(it takes effect with "sail": {"backend": "deepspeed"}; on any backend: sail.straggler_window: '
            "each rank's data, forward, backward and step times; remove it to silence this)"
        ) in caplog.text
        assert "stage" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _report_unused(config, backend_class("deepspeed"))  # DeepSpeed takes them all
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("zero", "named"),
    [
        ({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, "zero_optimization.offload_optimizer.device is 'cpu'"),
        ({"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "zero_optimization.offload_param.device is 'nvme'"),
        ({"cpu_offload": True}, "zero_optimization.cpu_offload is True"),
    ],
)  # fmt: skip
def test_an_offload_the_backend_does_not_do_is_refused(zero: dict[str, Any], named: str) -> None:
    config = load_config({**MICRO, "zero_optimization": {"stage": 1, **zero}}, 1)
    for name in ("ddp", "fsdp", "horovod"):
        with pytest.raises(
            ConfigError, match=re.escape(f"{named}, an offload that backend {name} does not do")
        ) as err:
            _check_offload(config, backend_class(name))
        assert 'set "sail": {"backend": "deepspeed"}, or remove zero_optimization.' in str(err.value)
    _check_offload(config, backend_class("deepspeed"))  # handed to DeepSpeed
    off = load_config(
        {**MICRO, "zero_optimization": {"offload_optimizer": {"device": "none"}, "cpu_offload": False}}, 1
    )
    _check_offload(off, backend_class("ddp"))  # asks for nothing


def test_a_zero_stage_the_backend_does_not_implement_is_refused() -> None:
    config = load_config({**MICRO, "zero_optimization": {"stage": 2}}, 1)
    with pytest.raises(
        ConfigError, match=r"stage is 2, which backend ddp does not implement \(it shards up to stage 1\)"
    ) as err:
        _check_zero_stage(config, "ddp", 1)
    assert 'set "sail": {"backend": ...} to one of: deepspeed, fsdp; or lower the stage to 1' in str(
        err.value
    )


def test_seed_000_config_loads() -> None:
    path = Path(__file__).parents[2] / "examples" / "seed000" / "ds_config.json"
    config = load_config(path, 2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (8, 4)
    assert config.fp16.enabled and config.zero_optimization.stage == 1


@pytest.mark.parametrize(
    ("balance", "world", "expected"),
    [
        ("off", 2, "off"),
        ("auto", 2, "auto"),
        ([3, 1], 2, (3.0, 1.0)),
        ({"node1": 2, "node2": 1.5}, 4, {"node1": 2.0, "node2": 1.5}),
    ],
)
def test_balance_forms(balance: Any, world: int, expected: Any) -> None:
    config = load_config({**MICRO, "sail": {"balance": balance}}, world)
    assert config.sail.balance == expected


@pytest.mark.parametrize(
    ("balance", "world", "message"),
    [
        ("fast", 2, "sail.balance is 'fast'"),
        ([], 2, "sail.balance is []"),
        ([3, 1, 1], 2, "sail.balance has 3 weight(s) for 2 process(es)"),
        ([3, 0], 2, "sail.balance[1] is 0"),
        ([3, -1], 2, "sail.balance[1] is -1"),
        ({"node1": "x"}, 2, "sail.balance.node1"),
        ([100, 1], 2, "sail.balance gives rank 1 0.08 of the 8 samples of a global micro-batch"),
    ],
)
def test_bad_balance_is_refused(balance: Any, world: int, message: str) -> None:
    assert message in error({"train_micro_batch_size_per_gpu": 4, "sail": {"balance": balance}}, world)


@pytest.mark.parametrize(
    ("backend", "balance", "message"),
    [
        ("deepspeed", [3, 1], "sail.balance is (3.0, 1.0), which backend deepspeed does not support"),
        ("deepspeed", "auto", "which backend deepspeed does not support"),
        ("fsdp", "auto", "sail.balance is 'auto', which backend fsdp cannot measure"),
    ],
)
def test_balance_a_backend_cannot_honour_is_refused(backend: str, balance: Any, message: str) -> None:
    config = load_config({**MICRO, "sail": {"backend": backend, "balance": balance}}, 2)
    with pytest.raises(ConfigError, match=re.escape(message)):
        _check_balance(config, backend_class(backend))


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "horovod"])
def test_weights_are_accepted_where_gradients_are_averaged(backend: str) -> None:
    _check_balance(
        load_config({**MICRO, "sail": {"backend": backend, "balance": [3, 1]}}, 2), backend_class(backend)
    )


def test_auto_with_synchronised_batch_norm_is_refused_and_weights_are_not() -> None:
    import torch

    from spikingsail.snn import convert_sync_batchnorm

    synced = {**MICRO, "snn": {"sync_batchnorm": True}, "sail": {"balance": "auto"}}
    with pytest.raises(
        ConfigError, match=r"'auto' together with snn\.sync_batchnorm(.|\n)*hides a slow rank"
    ):
        _check_balance(load_config(synced, 2), backend_class("ddp"))
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
    auto = load_config({**MICRO, "sail": {"balance": "auto"}}, 2)
    with pytest.raises(ConfigError, match="together with the model's SyncBatchNorm layers"):
        _check_balance(auto, backend_class("ddp"), model)
    ours = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))  # spikingsail.snn's own
    with pytest.raises(ConfigError, match="together with the model's SyncBatchNorm layers"):
        _check_balance(auto, backend_class("ddp"), ours)
    weights = load_config({**synced, "sail": {"balance": [3, 1]}}, 2)
    _check_balance(weights, backend_class("ddp"), model)

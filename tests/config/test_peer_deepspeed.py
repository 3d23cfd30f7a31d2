"""DeepSpeed configs as the installed DeepSpeed reads them: the same files handed to DeepSpeed's own
config class (``DeepSpeedConfig``, for the job's world size) and to SpikingSail's loader under the
deepspeed backend accept and refuse alike, but for the documented deviations
(``spikingsail.launchers.deviations``); under the other backends a key DeepSpeed removed is refused
with DeepSpeed's own reason, and one it reads is accepted and named as having no effect there."""

from __future__ import annotations

import copy
import json
import logging
import sys
from typing import Any

import pytest
from deepspeed.runtime import config as ds_config
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spikingsail.backends import load_config
from spikingsail.config.zero import ZERO_KEYS
from spikingsail.errors import ConfigError
from spikingsail.launchers.deviations import DEVIATIONS

WORLD = 2
DEEPSPEED = {"sail": {"backend": "deepspeed"}}

# Keys of real DeepSpeed 0.19.8 files that SpikingSail refused before it asked DeepSpeed.
REAL = {
    "compile": {"compile": {"deepcompile": False}},
    "tensor_parallel": {"tensor_parallel": {"autotp_size": 1}},
    "torch_autocast": {"torch_autocast": {"enabled": False}},
    "sequence_parallel_size": {"sequence_parallel_size": 1},
    "zenflow": {"zero_optimization": {"stage": 2, "zenflow": None}},
    "bf16 master weights": {
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
        "zero_optimization": {"stage": 2},
    },
    "bf16 optimizer states": {"bf16": {"enabled": True, "bf16_optimizer_states": False}},
    "gradient_allreduce_op": {"gradient_allreduce_op": "mean"},
    "Lamb": {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3, "min_coeff": 0.01}}},
    "Adam bias_correction": {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}}},
    "auto in fp16 and zero": {
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    },
}


def deepspeed_accepts(raw: dict[str, Any]) -> bool:
    """Whether DeepSpeed's config class, for a job of WORLD processes, takes the dict."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    saved = ds_config.dist.get_rank, ds_config.dist.get_world_size
    ds_config.dist.get_rank, ds_config.dist.get_world_size = (lambda *a, **k: 0), (lambda *a, **k: WORLD)
    try:
        ds_config.DeepSpeedConfig(copy.deepcopy({k: v for k, v in raw.items() if k != "sail"}))
    except Exception:  # DeepSpeedConfigError, ValueError, AssertionError, pydantic's ValidationError, ...
        return False
    finally:
        ds_config.dist.get_rank, ds_config.dist.get_world_size = saved
    return True


def sail_accepts(raw: dict[str, Any]) -> bool:
    try:
        load_config(copy.deepcopy(raw), WORLD)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("name", list(REAL))
def test_real_deepspeed_keys_run_under_the_deepspeed_backend(name: str) -> None:
    raw = {"train_batch_size": 8, **REAL[name], **DEEPSPEED}
    assert deepspeed_accepts(raw)
    assert sail_accepts(raw), name


# (fragment, the deviations that may make SpikingSail's answer differ from DeepSpeed's)
fragments = st.sampled_from([
    ({}, ()),
    *(({**fragment}, ()) for fragment in REAL.values()),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}}, ()),
    ({"zero_optimization": {"stage": 2, "stagee": 1}}, ()),  # a typo: DeepSpeed's model refuses it
    ({"zero_optimization": {"stage": 2, "mics_shard_size": 2}}, ()),  # removed in 0.19.8
    ({"amp": {"enabled": True}}, ()),  # removed
    ({"wall_clock_breakdown": True, "tensorboard": {"enabled": False}}, ()),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ()),  # both refuse two precisions
    ({"gradient_clipping": "auto"}, ("config-auto",)),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, ("config-auto",)),
    ({"zero_optimization": {"stage": "2"}}, ("config-typed-keys",)),
    ({"gradient_clipping": -1.0}, ("config-typed-keys",)),
    ({"train_micro_batch_size_per_gpu": 3}, ()),  # 8 is not 3 × accumulation × 2: both refuse
])  # fmt: skip


@given(parts=st.lists(fragments, min_size=1, max_size=3))
@example(parts=[({"compile": {"deepcompile": False}}, ()), ({"amp": {"enabled": True}}, ())])
@settings(max_examples=60, deadline=None)
def test_configs_load_where_deepspeeds_config_class_takes_them(
    parts: list[tuple[dict[str, Any], tuple[str, ...]]],
) -> None:
    raw: dict[str, Any] = {"train_batch_size": 8}
    for fragment, _ in parts:
        raw.update(copy.deepcopy(fragment))
    raw.update(DEEPSPEED)
    allowed = {why for _, whys in parts for why in whys}
    assert allowed <= DEVIATIONS.keys()
    if sail_accepts(raw) != deepspeed_accepts(raw):
        assert allowed, (
            f"{raw}: DeepSpeed {deepspeed_accepts(raw)}, SpikingSail {sail_accepts(raw)}, undocumented"
        )


@pytest.mark.parametrize("key", sorted(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS))
def test_a_key_deepspeed_removed_is_refused_with_its_reason_under_every_backend(key: str) -> None:
    for backend in ("ddp", "deepspeed"):
        with pytest.raises(ConfigError) as err:
            load_config({"train_batch_size": 8, key: {}, "sail": {"backend": backend}}, WORLD)
        assert " ".join(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS[key].split()) in str(err.value)


def test_under_ddp_a_key_deepspeed_reads_is_accepted_and_a_typo_is_not() -> None:
    config = load_config({"train_batch_size": 8, "tensorboard": {"enabled": False}}, WORLD)
    assert config.inert_keys == ("tensorboard",)  # named in the engine's warning: no effect with ddp
    with pytest.raises(ConfigError, match="did you mean 'compile'"):
        load_config({"train_batch_size": 8, "compiel": {}}, WORLD)


def _zero_fields() -> list[tuple[str, Any]]:
    """Every option of DeepSpeed's ``zero_optimization`` model (by the name a file uses) with its
    default, where the default is a value a JSON file can hold."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = []
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        default = field.default
        if name == "stage" or not (default is None or isinstance(default, (bool, int, float, str))):
            continue
        fields.append((field.alias or name, json.loads(json.dumps(default))))  # DeepSpeed's pp_int: an int
    return fields


def test_the_zero_options_checked_where_deepspeed_does_not_import_are_deepspeeds() -> None:
    """``ZERO_KEYS`` (what SpikingSail checks without DeepSpeed) names exactly the options of the
    installed DeepSpeed's ``zero_optimization`` model, by field name or alias."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names = {
        spelling
        for name, field in DeepSpeedZeroConfig.model_fields.items()
        for spelling in (name, field.alias)
        if spelling
    }
    assert set(ZERO_KEYS) == names


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize(("key", "value"), _zero_fields())
def test_every_zero_option_deepspeed_has_is_read_as_deepspeed_reads_it_under_other_backends(
    backend: str, key: str, value: Any
) -> None:
    """An option of DeepSpeed's ZeRO model, at its default: accepted wherever DeepSpeed takes it
    (and named as having no effect), refused wherever DeepSpeed refuses it."""
    zero = {"stage": 1, key: value}
    raw = {"train_batch_size": 8, "zero_optimization": zero, "sail": {"backend": backend}}
    assert sail_accepts(raw) == deepspeed_accepts(raw), (key, value)
    if sail_accepts(raw):
        assert load_config(copy.deepcopy(raw), WORLD).zero_optimization.options == {key: value}


@pytest.mark.parametrize(
    ("zero", "named"),
    [
        ({"stage": 1, "mics_shard_size": 2}, "zero_optimization.mics_shard_size"),  # removed in 0.19.8
        ({"stage": 1, "reduce_bucket_size": "big"}, "zero_optimization.reduce_bucket_size"),
        ({"stage": 1, "reduce_buckt_size": 5}, "zero_optimization.reduce_buckt_size"),
    ],
)
def test_a_zero_option_deepspeed_refuses_is_refused_under_ddp_naming_it(
    zero: dict[str, Any], named: str
) -> None:
    raw = {"train_batch_size": 8, "zero_optimization": zero}
    assert not deepspeed_accepts(raw)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(raw, WORLD)


def test_where_deepspeed_does_not_import_the_zero_options_are_checked_against_its_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        sys.modules, "deepspeed", None
    )  # `import deepspeed` fails, as on a machine without it
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 1, "zenflow": None}}, WORLD)
    assert config.zero_optimization.options == {"zenflow": None}
    for zero, named in [({"stage": 1, "reduce_buckt_size": 5}, "reduce_buckt_size"),
                        ({"stage": 1, "zenflow": 3}, "zero_optimization.zenflow")]:  # fmt: skip
        with pytest.raises(ConfigError, match=named):
            load_config({"train_batch_size": 8, "zero_optimization": zero}, WORLD)

"""`sail launch` and `sail submit` read the config a training script is given (``--sail-config``,
``--deepspeed_config``) as its engine will, before anything starts: a mistake is reported once, not
by every rank after the workers started; and nothing the engine accepts is refused."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from spikingsail.backends import backend_class, load_config
from spikingsail.cli.main import main
from spikingsail.engine import initialize as engine
from spikingsail.errors import SailError
from spikingsail.launchers.preflight import CONFIG_FLAGS, check_config, config_paths
from tests.docs.snippets import blocks, pages

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIGS = sorted((ROOT / "examples").rglob("*.json"))
DOC_CONFIGS = [b for page in pages() for b in blocks(page) if b.language == "json"]


def write(path: Path, config: dict[str, object]) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_a_bad_config_fails_once_before_any_process_starts(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (job / "train.py").write_text("open('started', 'w').close()\n")
    bad = write(job / "bad.json", {"train_batch_size": 7, "sail": {"backend": "ddp"}})
    status = main(["launch", "-n", "2", "train.py", "--lr", "1", "--sail-config", bad])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("inconsistent batch sizes for 2 process(es)") == 1, err
    assert not (job / "started").exists()


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["-n", "2"], {"train_batch_size": 7}, "inconsistent batch sizes for 2 process(es)"),
        (["-H", "a:2,b:1"], {"train_batch_size": 4}, "inconsistent batch sizes for 3 process(es)"),
        (["--ft-replicas", "2", "-n", "2"], {"train_batch_size": 6}, "for 4 process(es)"),
        (["-n", "2"], {"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu is 0"),
        (["-n", "2", "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:29400"],
         {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
         "not a multiple of"),
        (["-n", "2"], {"train_batch_size": 8, "sail": {"backend": "horovod"}, "zero_optimization": {"stage": 3}},
         "zero_optimization.stage is 3"),
        (["--ft-replicas", "2", "-n", "1"], {"train_batch_size": 8, "fp16": {"enabled": True}},
         "fp16 is enabled, and the job runs as replica groups"),
        (["-n", "2"], {"sail": {"backend": "nccl"}}, "'nccl'"),
    ],
)  # fmt: skip
def test_the_engines_refusals_are_made_with_the_jobs_world_size(
    job: Path, capsys: pytest.CaptureFixture[str], argv: list[str], world: dict[str, object], message: str
) -> None:
    config = write(job / "config.json", world)
    (job / "train.py").write_text("import spikingsail\n")  # the engine's script: the config is the engine's
    status = main(["launch", "--dry-run", *argv, "train.py", "--deepspeed_config", config])
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.startswith(f"sail launch: {config}"), err


def test_sail_submit_checks_the_config_for_its_nodes(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(job / "config.json", {"train_batch_size": 6})
    assert (
        main(["submit", "--dry-run", "-N", "2", "--nproc-per-node", "2", "train.py", "--sail-config", config])
        == 2
    )
    assert "inconsistent batch sizes for 4 process(es)" in capsys.readouterr().err
    assert (
        main(["submit", "--dry-run", "-N", "3", "--nproc-per-node", "2", "train.py", "--sail-config", config])
        == 0
    )
    # an --sbatch-arg that sizes the job itself: only what holds for every size is checked
    assert (
        main(
            ["submit", "--dry-run", "-N", "2", "--sbatch-arg=--ntasks=3", "train.py", "--sail-config", config]
        )
        == 0
    )
    assert main(["submit", "--dry-run", "train.py", "--sail-config", str(job / "missing.json")]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def test_a_config_without_a_batch_size_is_left_to_the_script(job: Path) -> None:
    """examples/imagenet sets the batch size from --batch-size and hands the engine a dict."""
    config = write(job / "config.json", {"bf16": {"enabled": True}, "sail": {"backend": "ddp"}})
    check_config(config, 2)
    with pytest.raises(SailError, match=f"^{re.escape(config)}: 'sail' must be an object"):
        check_config(write(job / "config.json", {"sail": 3}), 2)


def test_deepspeeds_own_script_keeps_its_config_for_deepspeed(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DeepSpeed script that does not import SpikingSail reads --deepspeed_config with DeepSpeed
    (ZeRO-3 there needs no "sail" key); the same file for a SpikingSail script is the engine's."""
    zero3 = write(job / "ds.json", {"train_batch_size": 8, "zero_optimization": {"stage": 3}})
    (job / "ds_train.py").write_text("import deepspeed\nimport torch\n")
    (job / "sail_train.py").write_text("import torch\nfrom spikingsail import SpikingSail\n")
    assert main(["launch", "-n", "2", "--dry-run", "ds_train.py", "--deepspeed_config", zero3]) == 0
    assert main(["launch", "-n", "2", "--dry-run", "sail_train.py", "--deepspeed_config", zero3]) == 2
    assert "zero_optimization.stage is 3" in capsys.readouterr().err
    assert config_paths(["--sail-config", zero3], "ds_train.py") == [zero3]  # our flag: always ours


def test_the_flags_are_read_with_the_engines_spellings() -> None:
    parser = engine.add_config_arguments(argparse.ArgumentParser())
    spelled = {
        s: a.dest
        for a in parser._actions
        if a.dest in ("sail_config", "deepspeed_config")
        for s in a.option_strings
    }
    assert spelled == CONFIG_FLAGS
    assert config_paths(["--sail-config", "a.json", "--epochs", "2"]) == ["a.json"]
    assert config_paths(["--sail_config=a.json", "--deepspeed-config", "b.json"]) == ["a.json", "b.json"]
    assert config_paths(["--deepspeed_config", "a.json", "--deepspeed_config", "b.json"]) == ["b.json"]
    assert config_paths(["--", "--sail-config", "a.json"]) == []
    assert config_paths(["--sail-conf", "a.json", "--sail-config"]) == []  # no abbreviation, no value


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("world", [None, 1, 2, 4, 8])
def test_every_example_config_the_engine_accepts_passes(path: Path, world: int | None) -> None:
    if world is not None and not _engine_accepts(path, world):
        pytest.skip(f"the engine itself refuses it for {world} process(es)")
    check_config(str(path), world)


@pytest.mark.parametrize("block", DOC_CONFIGS, ids=lambda b: b.id)
def test_every_config_in_the_docs_passes(tmp_path: Path, block: object) -> None:
    text = block.code.strip()  # type: ignore[attr-defined]
    path = tmp_path / "config.json"
    path.write_text(text if text.startswith("{") else "{" + text + "}")  # a fragment: the object holding it
    check_config(str(path), None)


def test_the_examples_launch_commands_pass(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    seed = [
        "examples/seed000/train.py",
        "--deepspeed",
        "--deepspeed_config",
        "examples/seed000/ds_config.json",
    ]
    assert main(["launch", "--dry-run", "-n", "2", *seed]) == 0
    digits = ["examples/train_digits.py", "--sail-config", "examples/configs/digits.json"]
    assert main(["launch", "--dry-run", "-n", "2", *digits]) == 0, capsys.readouterr().err


def _engine_accepts(path: Path, world: int) -> bool:
    try:
        config = load_config(str(path), world)
        backend = backend_class(config.sail.backend, config.source)
        engine._check_zero_stage(config, backend.name, backend.max_zero_stage)
        engine._check_offload(config, backend)
        engine._check_balance(config, backend)
    except SailError:
        return False
    return True

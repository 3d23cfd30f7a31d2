"""What only a real GPU shows: device placement by local rank, nccl groups, pinned memory, bf16 on
real capability, checkpoints of CUDA tensors, resume onto another GPU. Skipped, with the reason,
where torch sees no GPU; ``scripts/gpu-smoke.sh`` runs them. The CPU imitations of the same paths
are in tests/engine/test_stand_in_device.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spikingsail
from spikingsail.checkpoint.rank_state import capture_rng, restore_rng
from spikingsail.data.digits import load_digits_split
from spikingsail.errors import BackendError
from spikingsail.precision import BF16Precision
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.requires_cuda
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(autouse=True)
def _cublas_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    # sail.deterministic sets it when absent; set here, the test leaves the environment as it was
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def digits_config(directory: Path, **changes: Any) -> str:
    settings = json.loads((EXAMPLES / "configs" / "digits.json").read_text())
    settings["sail"].pop("metrics_path")
    settings["sail"]["deterministic"] = True
    for key, value in changes.items():
        settings[key] = {**settings.get(key, {}), **value} if isinstance(value, dict) else value
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "digits.json"
    path.write_text(json.dumps(settings))
    return str(path)


def model() -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    from train_digits import DigitsNet

    torch.manual_seed(0)
    return DigitsNet()


def _placement(directory: str) -> dict[str, Any]:
    engine, _ = spikingsail.SpikingSail(None, model(), config=digits_config(Path(directory))).run()
    train_set, _ = load_digits_split()
    loader = engine.dataloader(train_set)
    images, labels = next(iter(loader))
    loss = F.cross_entropy(engine(images), labels)
    engine.backward(loss)
    engine.step()
    local_rank = int(os.environ["LOCAL_RANK"])
    facts = {
        "device": str(engine.device),
        "expected": f"cuda:{local_rank}",
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "pinned": bool(loader.loader.pin_memory),
        "batch": str(labels.device),
        "params": {str(p.device) for p in engine.module.parameters()},
    }
    engine.close()
    return facts


def test_each_process_uses_the_gpu_of_its_local_rank_over_nccl(tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())
    results = run_ranks(_placement, nproc, str(tmp_path))
    for facts in results.values():
        assert facts["device"] == facts["expected"] == facts["batch"]
        assert facts["params"] == {facts["expected"]}
        assert facts["pinned"]
        assert facts["backend"] == ("nccl" if nproc > 1 else None)


def test_bf16_is_accepted_exactly_where_the_hardware_has_it() -> None:
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device)[0] >= 8:
        assert BF16Precision(device).dtype == torch.bfloat16
    else:
        with pytest.raises(BackendError, match="has no bfloat16 support"):
            BF16Precision(device)


def _train(
    directory: Path, micro_steps: int, *, save_after: int | None = None, resume: bool = False
) -> dict[str, torch.Tensor]:
    """Train the digits net one micro-step at a time (accumulation 2), saving or resuming."""
    config = digits_config(directory, gradient_accumulation_steps=2, train_batch_size=64,
                           fp16={"enabled": False})  # fmt: skip
    engine, _ = spikingsail.SpikingSail(None, model(), config=config).run()
    if resume:
        engine.load_checkpoint(directory / "ckpt")
    loader = engine.dataloader(load_digits_split()[0])
    done = engine.micro_steps
    for images, labels in loader:
        if done == micro_steps:
            break
        engine.backward(F.cross_entropy(engine(images), labels))
        engine.step()
        done += 1
        if done == save_after:
            engine.save_checkpoint(directory / "ckpt")
            break
    state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return state


def test_a_save_inside_an_accumulation_window_resumes_exactly_on_the_gpu(tmp_path: Path) -> None:
    reference = _train(tmp_path / "a", 7)
    _train(tmp_path / "b", 7, save_after=3)  # inside the second window: CUDA gradients saved
    resumed = _train(tmp_path / "b", 7, resume=True)
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key


def test_a_ranks_gpu_stream_is_restored_onto_another_gpu_index() -> None:
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    with torch.cuda.device(last):
        torch.cuda.manual_seed(1234)
    saved = capture_rng(last)
    expected = torch.rand(4, device=last)
    restore_rng(saved, torch.device("cuda", 0))  # resumed where this rank now has GPU 0
    assert torch.equal(torch.rand(4, device="cuda:0").cpu(), expected.cpu())

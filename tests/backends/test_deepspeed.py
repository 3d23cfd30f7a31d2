"""The DeepSpeed backend on 2 real gloo ranks (DeepSpeed's CPU accelerator): ZeRO stages 0-3 train
like DDP, resume exactly, and refuse what they cannot do with a clear message."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.backends.deepspeed_import import _without
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError, SailError
from tests.multiprocess import run_ranks, train_micro_steps

pytestmark = pytest.mark.multiprocess
MICRO_STEPS = 12


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def config(backend: str, stage: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        # threshold 0: ZeRO-3 partitions even these small parameters
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sail": {"backend": backend, "seed": 4, "progress_bar": False},
        **extra,
    }


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def full_parameters(engine: spikingsail.Engine) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (ZeRO-3 gathers its partitions for the read)."""
    gather: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if engine.backend.name == "deepspeed" and engine.config.zero_optimization.stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
    with gather:
        return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def train(cfg: dict[str, Any], checkpoints: str | None = None, stop_at: int | None = None,
          resume: bool = False, client_optimizer: bool = True) -> dict[str, Any] | None:  # fmt: skip
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01) if client_optimizer else None
    engine, ds_optimizer = spikingsail.initialize(model=net, optimizer=optimizer, config=cfg,
                                                  checkpoints_path=checkpoints, resume=resume)  # fmt: skip
    loader = engine.dataloader(data())
    losses: list[float] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(engine(x).float(), y)
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()

    if not train_micro_steps(engine, loader, MICRO_STEPS, step, stop_at=stop_at, checkpoints=checkpoints):
        return None
    sharded = [getattr(p, "ds_numel", p.numel()) > p.numel() for p in engine.module.parameters()]
    inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
    result = {"params": full_parameters(engine), "steps": engine.global_steps, "losses": losses,
              "partitioned": all(sharded), "optimizer": type(inner).__name__,
              "dtype": str(next(engine.module.parameters()).dtype)}  # fmt: skip
    engine.close()
    return result


@pytest.fixture(scope="module")
def ddp() -> dict[int, Any]:
    return run_ranks(train, 2, config("ddp"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_train_like_ddp(ddp: dict[int, Any], stage: int) -> None:
    ds = run_ranks(train, 2, config("deepspeed", stage))
    for rank in (0, 1):
        assert ds[rank]["steps"] == ddp[rank]["steps"] == MICRO_STEPS // 2
        assert ds[rank]["partitioned"] == (stage == 3)  # only ZeRO-3 shards the parameters themselves
        for key, value in ddp[rank]["params"].items():
            # ZeRO reduces flat gradient buckets and clips by the norm of its partitions'
            # norms: the same sums as DDP in another order, so float32 rounding differs.
            torch.testing.assert_close(ds[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_the_configs_optimizer_is_built_by_deepspeed(ddp: dict[int, Any]) -> None:
    optimizer = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    ds = run_ranks(train, 2, config("deepspeed", 2, optimizer=optimizer), None, None, False, False)
    for rank in (0, 1):
        assert ds[rank]["optimizer"] == "FusedAdam"  # DeepSpeed's own, as with `deepspeed` itself
        for key, value in ddp[rank]["params"].items():
            # FusedAdam's kernel computes the same update as torch.optim.AdamW in another order
            torch.testing.assert_close(ds[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("stage", "optimizer"), [(2, "client"), (3, "client"), (2, "config")])
def test_resume_is_exact(tmp_path: Path, stage: int, optimizer: str) -> None:
    # "config": the config's optimizer, which DeepSpeed builds itself (FusedAdam) and checkpoints
    # with its own state (step counts, moments)
    extra = (
        {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
        if optimizer == "config"
        else {}
    )
    cfg = config("deepspeed", stage, **extra)
    client = optimizer == "client"
    straight = run_ranks(train, 2, cfg, None, None, False, client)
    assert run_ranks(train, 2, cfg, str(tmp_path), 6, False, client) == {0: None, 1: None}
    state = tmp_path / "global_step3" / "state" / "deepspeed"
    assert sorted(p.name for p in state.glob("zero_pp_rank_*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # fmt: skip
    resumed = run_ranks(train, 2, cfg, str(tmp_path), None, True, client)
    for rank in (0, 1):
        assert resumed[rank]["steps"] == MICRO_STEPS // 2
        assert resumed[rank]["optimizer"] == straight[rank]["optimizer"]
        for key, value in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][key], value), key


def test_bf16_casts_the_model_and_its_inputs_and_trains_like_fp32(ddp: dict[int, Any]) -> None:
    result = run_ranks(train, 2, config("deepspeed", 2, bf16={"enabled": True}))
    initial = dict(model().named_parameters())
    for rank in (0, 1):
        assert result[rank]["dtype"] == "torch.bfloat16"  # the script's float32 inputs were cast
        for key, value in ddp[rank]["params"].items():
            moved = (value - initial[key]).abs().max()
            off = (result[rank]["params"][key] - value).abs().max()
            # bf16 keeps 8 bits of mantissa: the weights DeepSpeed hands the forward are the fp32
            # master weights rounded to ~0.4%, so the run tracks fp32 training, not bit for bit.
            assert off < 0.2 * moved, (key, float(off), float(moved))


def error_of(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except SailError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def cross_backend(tmp: str) -> str:
    train(config("ddp"), tmp, 6)
    return error_of(train, config("deepspeed", 2), tmp, None, True)


def test_a_ddp_checkpoint_under_deepspeed_is_refused_with_the_reason(tmp_path: Path) -> None:
    message = run_ranks(cross_backend, 1, str(tmp_path))[0]
    assert message.startswith("CheckpointError:")
    assert "holds dcp state; backend deepspeed reads deepspeed checkpoints" in message
    assert "resume with the backend that wrote it (ddp)" in message


def save_mid_window(tmp: str) -> str:
    net = model()
    engine, _ = spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                       config=config("deepspeed", 1))  # fmt: skip
    engine.backward(engine(torch.randn(4, 6)).sum())
    engine.step()  # micro-step 1 of a window of 2
    message = error_of(engine.save_checkpoint, tmp)
    engine.close()
    return message + f" | written: {sorted(p.name for p in Path(tmp).rglob('*'))}"


def test_a_save_inside_an_accumulation_window_is_refused_before_writing(tmp_path: Path) -> None:
    message = run_ranks(save_mid_window, 2, str(tmp_path / "ckpt"))[0]
    assert message.startswith("CheckpointError: cannot save inside a gradient accumulation window")
    assert "save after engine.step() on an accumulation boundary" in message
    assert message.endswith("| written: []")


def removed_key() -> str:
    # in range for SpikingSail's own check of zero_optimization; DeepSpeed 0.19.8 removed MiCS sharding
    cfg = config("deepspeed", 2)
    cfg["zero_optimization"]["mics_shard_size"] = 2
    return error_of(train, cfg)


def unknown_optimizer() -> str:
    # DeepSpeed's config class takes any optimizer name; deepspeed.initialize builds it
    return error_of(train, config("deepspeed", 2, optimizer={"type": "NoSuchOptimizer", "params": {"lr": 0.1}}),
                    None, None, False, False)  # fmt: skip


def channels_last_weights() -> str:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    net = net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    return error_of(
        lambda: spikingsail.initialize(model=net, optimizer=optimizer, config=config("deepspeed", 2))
    )


def test_a_key_deepspeed_refuses_is_named_before_any_process_group_and_initializes_refusal_after() -> None:
    removed = run_ranks(removed_key, 1)[0]
    assert removed.startswith(
        "ConfigError: <dict>: DeepSpeed 0.19.8 refuses zero_optimization.mics_shard_size"
    )
    assert "MiCS ZeRO-3 sharding has been removed" in removed
    refused = run_ranks(unknown_optimizer, 1)[0]
    assert refused.startswith(
        "BackendError: <dict>: deepspeed.initialize refused the model, optimizer or config"
    )
    assert "nosuchoptimizer" in refused.lower()
    # DeepSpeed's own words for it would be "self.stride(-1) must be 1 to view Float as Byte"
    layout = run_ranks(channels_last_weights, 1)[0]
    assert layout.startswith("BackendError: <dict>: the deepspeed backend cannot take parameter '0.weight'")
    assert "channels_last" in layout and "default layout" in layout


# A Transformers-style ZeRO-2 file, as people write them for DeepSpeed: hjson comments and "auto"
# where DeepSpeed reads it as the default (fp16, bf16, zero_optimization); the numbers the Trainer
# would fill in are given, as with DeepSpeed's own launcher.
TRANSFORMERS_STYLE = """{
  // mixed precision: "auto" is DeepSpeed's default (off)
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "none", "pin_memory": true},
    "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
    "reduce_scatter": true, "reduce_bucket_size": "auto", "contiguous_gradients": true,
  },
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 0.5,
  "steps_per_print": 2000,
  "train_micro_batch_size_per_gpu": 4,
  "wall_clock_breakdown": false,
  "sail": {"backend": "deepspeed", "seed": 4, "progress_bar": false},
}
"""


def test_a_transformers_style_file_runs_unchanged_and_trains_like_ddp(
    ddp: dict[int, Any], tmp_path: Path
) -> None:
    path = tmp_path / "ds_config_zero2.json"
    path.write_text(TRANSFORMERS_STYLE)
    ds = run_ranks(train, 2, str(path))
    for rank in (0, 1):
        assert ds[rank]["steps"] == ddp[rank]["steps"]
        for key, value in ddp[rank]["params"].items():
            torch.testing.assert_close(ds[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_without_deepspeed_installed_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like to import
    net = model()
    with pytest.raises(BackendError, match=r"DeepSpeed cannot be imported(.|\n)*DS_BUILD_OPS=0 pip install"):
        spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                               config=config("deepspeed"), rank_info=RankInfo.single())  # fmt: skip


def test_the_core_and_the_other_backends_never_import_deepspeed(tmp_path: Path) -> None:
    script = (
        "import sys, torch, spikingsail\n"
        "from spikingsail.backends import sharding_backends\n"
        "from spikingsail.environments import RankInfo\n"
        "assert sharding_backends(2) == ['deepspeed', 'fsdp']\n"
        "net = torch.nn.Linear(2, 2)\n"
        "engine, _ = spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),\n"
        "    config={'train_micro_batch_size_per_gpu': 1}, rank_info=RankInfo.single())\n"
        "engine.close()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'horovod'}))\n"
    )
    assert printed(script)[-1:] == ["[]"]


def printed(script: str) -> list[str]:
    """The lines ``script`` prints in a fresh interpreter (which has imported nothing yet)."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()


def test_deepspeed_is_imported_without_mlflow_and_the_scripts_own_import_of_it_works() -> None:
    """DeepSpeed's autotuner imports MLflow where it is installed (a second of every rank's start);
    the backend imports DeepSpeed as where it is not, and the script's own import is unaffected."""
    script = (
        "import sys\n"
        "from spikingsail.backends.deepspeed_import import import_deepspeed\n"
        "import_deepspeed('here')\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(autotuner.has_mlflow, 'mlflow' in sys.modules)\n"
        "import mlflow\n"
        "print(mlflow.__name__, mlflow.__spec__ is not None)\n"
    )
    assert printed(script)[-2:] == ["False False", "mlflow True"]


def test_a_module_the_process_has_imported_stays_while_deepspeed_imports() -> None:
    import colorsys  # noqa: F401  (a module this process has)

    with _without("colorsys"):
        assert importlib.import_module("colorsys").__name__ == "colorsys"
    name = "spikingsail_absent_for_the_test"
    sys.modules.pop(name, None)
    with _without(name), pytest.raises(ImportError):
        importlib.import_module(name)
    assert name not in sys.modules  # hidden only meanwhile


SINGLE = """
import torch, spikingsail
from spikingsail.environments import RankInfo
net = torch.nn.Linear(4, 2)
engine, _ = spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    config={"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
            "sail": {"backend": "deepspeed", "progress_bar": False}}, rank_info=RankInfo.single())
before = net.weight.detach().float().clone()
for _ in range(3):
    engine.backward(engine(torch.randn(2, 4)).float().sum())  # float32 inputs: cast for the fp16 model
    engine.step()
moved = bool((net.weight.detach().float() - before).abs().max() > 0)
print("result", engine.global_steps, next(engine.module.parameters()).dtype, moved, engine.loss_scale,
      engine.skipped_steps)
engine.close()
"""


def deepspeed_supports_fp16() -> bool:
    """The probe DeepSpeed itself makes: its accelerator (here the CPU one, which needs AVX512-FP16
    or AMX-FP16 for fp16) asked in a fresh process, as the engine under test will ask it."""
    probe = "from deepspeed.accelerator import get_accelerator; print(get_accelerator().is_fp16_supported())"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1] == "True"


def test_one_process_without_a_launcher_trains_in_fp16_or_refuses_clearly() -> None:
    # DeepSpeed wants LOCAL_RANK from a launcher, and a process group: the backend provides both
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-c", SINGLE], capture_output=True, text=True, timeout=120, env=env
    )
    if deepspeed_supports_fp16():
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == "result 3 torch.float16 True 256.0 0"
        return
    # a CPU without fp16 instructions (an AMD EPYC without AVX512-FP16, say): SpikingSail's own
    # refusal, naming the key, the reason and what to do, before DeepSpeed's bare ValueError
    assert result.returncode != 0
    assert "fp16.enabled is true with the deepspeed backend" in result.stderr
    assert "DeepSpeed's cpu accelerator has no fp16 support on this machine" in result.stderr
    assert "AVX512-FP16 or AMX-FP16" in result.stderr
    assert "fix: set fp16.enabled to false" in result.stderr
    assert "Type fp16 is not supported on your device" not in result.stderr


TORCH_ADAM = """
import torch
import spikingsail
from spikingsail.environments import RankInfo
for backend in ("deepspeed", "ddp"):
    for kind in ("Adam", "AdamW"):
        engine, optimizer = spikingsail.initialize(
            model=torch.nn.Linear(2, 1), rank_info=RankInfo.single(),
            config={"train_micro_batch_size_per_gpu": 1, "sail": {"backend": backend, "progress_bar": False},
                    "optimizer": {"type": kind, "params": {"lr": 0.1, "torch_adam": True}}})
        inner = getattr(optimizer, "optimizer", optimizer)
        print("decay", backend, kind, type(inner).__name__, inner.param_groups[0]["weight_decay"])
        engine.close()
"""


def test_torch_adam_without_weight_decay_decays_by_0_on_deepspeed_as_elsewhere() -> None:
    # DeepSpeed's torch_adam path builds torch's AdamW, whose own default weight decay is 0.01. The
    # four engines run one after another in one process: closing a deepspeed engine must also drop
    # the groups DeepSpeed cached, or the next deepspeed.initialize fails on a destroyed group.
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-c", TORCH_ADAM], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("decay ")]
    assert lines == [
        f"decay {backend} {kind} AdamW 0.0" for backend in ("deepspeed", "ddp") for kind in ("Adam", "AdamW")
    ]


OP_BUILD = """
import torch, spikingsail
from spikingsail.environments import RankInfo
net = torch.nn.Linear(6, 3)
spikingsail.initialize(model=net, rank_info=RankInfo.single(), config={
    "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "sail": {"backend": "deepspeed", "progress_bar": False}})
"""


def test_an_op_deepspeed_cannot_compile_is_named_with_the_node_as_the_cause(tmp_path: Path) -> None:
    # a fresh extension cache and a C++ compiler that fails: DeepSpeed's first op build on this node
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", OP_BUILD], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 1
    assert re.search(
        r"<dict>: DeepSpeed could not build its \w+ op on this node\n.*why: CalledProcessError: "
        r"Command '\['/bin/false', '--version'\]'.*\n.*fix: `sail doctor` says whether this node can compile",
        result.stderr,
    ), result.stderr[-3000:]
    assert "refused the model, optimizer or config" not in result.stderr


@pytest.mark.parametrize("arch_list", ["9.0", "8.0+PTX", "8.6;9.0", "9.0 8.0+PTX", "10.0"])
def test_arch_lists_deepspeed_reads_are_not_called_unreadable(
    monkeypatch: pytest.MonkeyPatch, arch_list: str
) -> None:
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, on any machine

    from spikingsail.cuda_arch_list import unreadable_cuda_archs

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    assert FusedAdamBuilder().compute_capability_args()  # DeepSpeed's own reading
    assert unreadable_cuda_archs(arch_list) == []


@pytest.mark.parametrize(
    ("arch_list", "unreadable", "fix"),
    [
        ("9.0a", "'9.0a'", 'TORCH_CUDA_ARCH_LIST="9.0"'),
        ("8.0;9.0a+PTX;10.0f", "'9.0a+PTX', '10.0f'", 'TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"'),
        ("9.0+PTX;9.0a", "'9.0a'", 'TORCH_CUDA_ARCH_LIST="9.0+PTX"'),
        ("Hopper", "'Hopper'", "TORCH_CUDA_ARCH_LIST unset"),
    ],
)
def test_arch_lists_deepspeed_cannot_read_stop_with_the_entries_and_a_list_it_reads(
    monkeypatch: pytest.MonkeyPatch, arch_list: str, unreadable: str, fix: str
) -> None:
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from spikingsail.backends.deepspeed_import import initialize_error
    from spikingsail.cuda_arch_list import readable_cuda_archs

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    with pytest.raises(ValueError, match="invalid literal for int") as raised:
        FusedAdamBuilder().compute_capability_args()  # what deepspeed.initialize meets on a GPU node
    message = str(initialize_error("ds.json", raised.value, torch.device("cuda", 0)))
    assert message.startswith(
        f"ds.json: DeepSpeed cannot build its fused_adam op for TORCH_CUDA_ARCH_LIST={arch_list!r}\n"
    )
    assert f"cannot read {unreadable}, a form only torch accepts (ValueError: invalid literal" in message
    assert f"fix: start the job with {fix} " in message and '"torch_adam": true' in message
    # the list offered is one DeepSpeed reads
    readable = readable_cuda_archs(arch_list)
    if readable:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", readable)
        assert FusedAdamBuilder().compute_capability_args()


def _shared_workspaces() -> dict[str, Any]:
    """A DeepSpeed engine on one node as DeepSpeed's launcher starts it, then its shared-memory all-reduce."""
    import deepspeed.comm as ds_comm

    from spikingsail.backends.deepspeed_shm import workspace

    os.environ["LOCAL_SIZE"] = "2"  # DeepSpeed's launcher: every rank of the job on this node
    net = model()
    engine, _ = spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                       config=config("deepspeed"))  # fmt: skip
    backend = ds_comm.comm.cdb
    tensor = torch.full((1000,), float(engine.rank + 1))
    ds_comm.inference_all_reduce(tensor)  # over the workspaces: every rank's mapping of every other's
    seen = {"level": backend.shm_vector_kernel_level, "sum": sorted(set(tensor.tolist())),
            "named": [workspace(r).exists() for r in range(2)], "name": str(workspace(engine.rank))}  # fmt: skip
    engine.close()
    return seen


def test_deepspeeds_shared_memory_workspaces_work_and_leave_nothing_in_dev_shm() -> None:
    """DeepSpeed's CPU communication maps a 66 MB workspace per rank from /dev/shm and never unlinks
    it: every run on one node left them there, memory held until a reboot."""
    ranks = run_ranks(_shared_workspaces, 2)
    for seen in ranks.values():
        assert seen["level"] >= 1  # the kernel that reads the other rank's workspace, not a gloo fallback
        assert seen["sum"] == [3.0] and seen["named"] == [False, False], seen
    assert f"deepspeed_allreduce_buffer_{os.getuid()}_" in ranks[0]["name"]
    assert not Path(ranks[0]["name"]).exists() and not Path(ranks[1]["name"]).exists()

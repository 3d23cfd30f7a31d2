"""DeepSpeed: ZeRO stages 0–3 through ``deepspeed.initialize`` with the user's own JSON.

DeepSpeed's engine owns the step: it averages the loss over the accumulation window, defers and
buckets the gradient reduction, keeps fp16/bf16 master weights and the loss scaler, clips, steps
the optimizer and the scheduler. SpikingSail hands it the config unchanged (minus its own
sections), keeps the counters, data positions and RNG in its checkpoint, and stores the model and
optimizer state in DeepSpeed's own format inside it, read back with ``weights_only=True``.

On machines without a GPU, DeepSpeed's CPU accelerator is selected (``DS_ACCELERATOR=cpu``) and
the default group is gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from spikingsail.backends.compiling import compile_kwargs
from spikingsail.backends.deepspeed_import import import_deepspeed, initialize_error
from spikingsail.backends.deepspeed_shm import release_workspaces
from spikingsail.backends.process_group import (
    ProcessGroupBackend,
    dist_backend_for,
    forget_groups,
    init_default_group,
    rendezvous_store,
)
from spikingsail.checkpoint.deepspeed_format import STATE_TAG, safe_torch_load
from spikingsail.config.compiling import CompileConfig, deepcompile_keys
from spikingsail.config.parse import FOR_DEEPSPEED, NOT_FOR_DEEPSPEED
from spikingsail.config.schema import SailConfig
from spikingsail.errors import BackendError, CheckpointError, ConfigError, first_line
from spikingsail.precision import Precision, native_bf16
from spikingsail.tensors import map_tensors

if TYPE_CHECKING:
    from concurrent.futures import Future

log = logging.getLogger(__name__)

_NEVER = 2**62  # DeepSpeed's own step log is replaced by SpikingSail's monitor


def deepspeed_config(config: SailConfig) -> dict[str, Any]:
    """The dict handed to ``deepspeed.initialize``: the user's file without the sections DeepSpeed
    does not read, with the batch-size triple as SpikingSail resolved it for this world size and
    ``zero_optimization`` as validated (the legacy boolean form as the stage it means)."""
    ds = {
        key: value
        for key, value in config.raw.items()
        if key not in NOT_FOR_DEEPSPEED and key not in config.backend_sections
    }
    ds.update(
        train_batch_size=config.train_batch_size,
        train_micro_batch_size_per_gpu=config.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
    )
    if "compile" in ds:  # SpikingSail runs torch.compile itself (engine.compile): DeepCompile's keys only
        ds.pop("compile")
        if deepcompile := deepcompile_keys(config.raw["compile"]):
            ds["compile"] = deepcompile
    if "zero_optimization" in ds:
        zero = config.zero_optimization
        ds["zero_optimization"] = {"stage": zero.stage, **zero.options}
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        # DeepSpeed's FusedAdam and CPU Adam decay by 0 unless told, but with "torch_adam" it builds
        # torch's AdamW, whose default is 0.01: the same file would train differently here than on
        # the other backends (which follow the first). Say 0 explicitly.
        params = optimizer.get("params") or {}
        if "weight_decay" not in params:
            ds["optimizer"] = {**optimizer, "params": {**params, "weight_decay": 0.0}}
    ds["steps_per_print"] = _NEVER
    return ds


class DeepSpeedBackend(ProcessGroupBackend):
    name = "deepspeed"
    reads_deepspeed_config = True
    max_zero_stage = 3
    honours_zero_options = True  # handed to DeepSpeed
    balances = False  # DeepSpeed's engine checks that every rank's micro-batch is the configured one
    checkpoint_format: ClassVar[str] = "deepspeed"

    @classmethod
    def checked_by_deepspeed(cls) -> frozenset[str]:
        """Every section DeepSpeed reads: its own optimizers (Lamb), ZenFlow, bf16 master weights."""
        return FOR_DEEPSPEED

    @classmethod
    def library_keys(cls, config: SailConfig) -> frozenset[str] | None:
        """What DeepSpeed's config class reads of the dict ``deepspeed.initialize`` will get, for
        this world size; it checks all of it, SpikingSail's keys included."""
        from spikingsail.backends import deepspeed_keys

        # None where DeepSpeed does not import: refused when the backend is chosen, saying why
        return deepspeed_keys.read(deepspeed_config(config), config.world_size, config.source)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ds: Any = None
        self._half: torch.dtype | None = None
        if self.config.fp16.enabled:
            self._half = torch.float16
        elif self.config.bf16.enabled:
            self._half = torch.bfloat16

    def setup(self) -> torch.device:
        self.deepspeed = import_deepspeed(self.config.source)
        device = super().setup()
        if not dist.is_initialized():
            # DeepSpeed always works on a process group; one process gets a group of one.
            timeout = datetime.timedelta(minutes=self.config.sail.timeout_minutes)
            store = rendezvous_store(self.rank_info, timeout)
            init_default_group(dist_backend_for(self.config.sail, self.config.source, device), timeout, store,
                               rank_info=self.rank_info, device=device)  # fmt: skip
            self._owns_group = True
        return device

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module, optimizer, _ = self.setup_module_and_optimizer(model, optimizer, None)
        return module, optimizer

    # DeepSpeed's engine owns the step: it builds the config's optimizer and scheduler, averages the
    # loss over the window, keeps half-precision weights, scales the loss, clips and steps.

    def select_precision(self) -> Precision:
        self.precision = Precision(self.device)  # no autocast: DeepSpeed makes the model half itself
        return self.precision

    def setup_module_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        config = self.config
        ds_config = deepspeed_config(config)
        if optimizer is not None:
            ds_config.pop("optimizer", None)  # the client's wins (the engine warned)
            # a torch optimizer the script chose is what the user wants ZeRO to shard
            ds_config.setdefault("zero_allow_untested_optimizer", True)
        if lr_scheduler is not None:
            ds_config.pop("scheduler", None)
        self._require_precision_support()
        _require_contiguous_parameters(model, config.source)
        try:
            with _local_rank_in_environment(self.rank_info.local_rank):
                engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(
                    model=model,
                    optimizer=optimizer,
                    model_parameters=None if optimizer is not None else list(model.parameters()),
                    lr_scheduler=lr_scheduler,
                    config=ds_config,
                    dist_init_required=False,
                )
        except Exception as err:  # DeepSpeed reports config problems as several exception types
            raise initialize_error(config.source, err, self.device) from err
        release_workspaces()
        engine.checkpoint_engine = _safe_checkpoint_engine(engine)
        self.ds = engine
        self.trained = model, ds_optimizer
        log.info(
            "DeepSpeed %s: ZeRO stage %d, optimizer %s",
            self.deepspeed.__version__,
            engine.zero_optimization_stage(),
            type(ds_optimizer).__name__,
        )
        return engine, ds_optimizer, ds_scheduler

    # DeepSpeed's engine.compile() compiles the model with DeepSpeed's forward hook, whose step
    # counter dynamo guards on: it compiled again at every step until its limit (8), then ran the
    # model uncompiled. So the model's forward is compiled alone, unless DeepCompile is asked for.
    compiles_forward_only = True

    def compile_targets(self, wrapped: torch.nn.Module, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [model]  # not DeepSpeed's engine around it

    def compile(self, wrapped: torch.nn.Module, model: torch.nn.Module, settings: CompileConfig) -> None:
        """With DeepCompile's keys (and no ``compile.modules``), DeepSpeed's ``engine.compile()``;
        else as on the other backends, the model's ``forward`` alone."""
        if settings.modules or not deepcompile_keys(self.config.raw.get("compile")):
            super().compile(wrapped, model, settings)
            return
        where = self.config.source
        kwargs = compile_kwargs(settings, where)
        backend = kwargs.pop("backend")
        try:
            self.ds.compile(backend=backend, compile_kwargs=kwargs)
        except (RuntimeError, ValueError, TypeError) as err:
            raise ConfigError(
                f"{where}: DeepSpeed's engine.compile() refused the compile section: {err}",
                fix="see DeepSpeed's and torch.compile's documentation for what they accept together",
            ) from err

    def _require_precision_support(self) -> None:
        """Refuse fp16/bf16 where DeepSpeed's accelerator lacks them, before DeepSpeed's own bare
        ``ValueError: Type fp16 is not supported on your device``."""
        if self._half is None:
            return
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        key = "fp16" if self._half is torch.float16 else "bf16"
        supported = accelerator.is_fp16_supported() if key == "fp16" else accelerator.is_bf16_supported()
        if key == "bf16" and self.device.type == "cuda":
            supported = native_bf16(self.device)  # DeepSpeed's answer counts emulation (V100, T4)
        if supported:
            return
        name = accelerator.device_name()
        why = f"DeepSpeed's {name} accelerator has no {key} support on this machine"
        if name == "cpu" and key == "fp16":
            why += (
                " (it needs a CPU with AVX512-FP16 or AMX-FP16 instructions: "
                "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False here)"
            )
        raise BackendError(
            f"{self.config.source}: {key}.enabled is true with the deepspeed backend",
            why,
            f"set {key}.enabled to false (fp32{', or bf16.enabled' if key == 'fp16' else ''}), or use the "
            f"ddp or fsdp backend, whose {key} autocast runs on any CPU; on GPUs that support {key} it works as it is",
        )

    def prepare_inputs(self, inputs: Any) -> Any:
        # DeepSpeed turns the model itself into fp16/bf16; floating inputs must follow.
        if self._half is None:
            return inputs
        half = self._half
        return map_tensors(inputs, lambda t: t.to(half) if t.is_floating_point() else t)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, *, boundary: bool) -> bool:
        # every micro-step: DeepSpeed counts the window itself and steps on its boundary
        skipped = int(self.ds.skipped_steps)
        self.ds.step()
        return int(self.ds.skipped_steps) > skipped

    @property
    def loss_scale(self) -> float:
        if self.ds is None or not self.config.fp16.enabled:
            return 1.0
        return float(getattr(self.ds.optimizer, "loss_scale", 1.0))

    def sync_counters(self, micro_steps: int, global_steps: int, global_samples: int, skipped: int) -> None:
        self.ds.micro_steps = micro_steps
        self.ds.global_steps = global_steps
        self.ds.global_samples = global_samples
        self.ds.skipped_steps = skipped

    def clip_grad_norm_(self, parameters: Iterator[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        raise BackendError("DeepSpeed clips gradients itself", fix="set gradient_clipping in the config")

    # -- checkpoints ------------------------------------------------------------------------------

    def check_can_save(self, mid_window: bool) -> None:
        if mid_window:
            raise CheckpointError(
                "cannot save inside a gradient accumulation window with the deepspeed backend",
                "ZeRO keeps the window's partial gradients in its own reduction buckets, which "
                "DeepSpeed's checkpoint does not contain, so the resumed run would differ",
                "save after engine.step() on an accumulation boundary "
                "(engine.is_gradient_accumulation_boundary() before the step)",
            )

    def check_can_load(self, directory: Path, saved_world_size: int) -> None:
        stage = self.config.zero_optimization.stage
        if stage >= 1 and saved_world_size != self.rank_info.world_size:
            raise CheckpointError(
                f"{directory} was saved by {saved_world_size} process(es) with DeepSpeed ZeRO stage {stage}; "
                f"this run has {self.rank_info.world_size}",
                "DeepSpeed's ZeRO checkpoints hold each rank's partition of the optimizer state, and "
                "DeepSpeed 0.19 cannot re-partition them for another world size",
                f"resume on {saved_world_size} process(es), or convert the checkpoint with DeepSpeed's "
                "ds_to_universal.py and load it outside SpikingSail; the ddp, fsdp and horovod backends "
                "resume on any world size",
            )

    def save_state(
        self, directory: Path, group: dist.ProcessGroup | None, background: bool
    ) -> Future[Any] | None:
        if background:
            log.warning("the deepspeed backend writes checkpoints synchronously; async_save is ignored")
        try:
            self.ds.save_checkpoint(str(directory), tag=STATE_TAG, client_state={}, save_latest=False)
        except Exception:
            # A write that failed here (a full disk) left DeepSpeed's closing barrier, in which the
            # ranks whose writes succeeded wait: meet them there, then report the failure.
            if dist.is_initialized():
                dist.barrier()
            raise
        return None

    def load_state(self, directory: Path, group: dist.ProcessGroup | None, *, with_optimizer: bool) -> None:
        try:
            path, _ = self.ds.load_checkpoint(
                str(directory),
                tag=STATE_TAG,
                load_optimizer_states=with_optimizer,
                load_lr_scheduler_states=with_optimizer,
                load_module_only=not with_optimizer,
            )
        except CheckpointError:
            raise
        except Exception as err:  # DeepSpeed raises its own types too (ZeRORuntimeException)
            raise CheckpointError(
                f"DeepSpeed could not load {directory / STATE_TAG}",
                f"{type(err).__name__}: {first_line(err)}",
                "DeepSpeed checkpoints load with the same model and ZeRO stage (any world size "
                "for stages 1-2 with elastic_checkpoint); resume from another checkpoint otherwise",
            ) from err
        if path is None:
            raise CheckpointError(f"{directory / STATE_TAG} holds no DeepSpeed checkpoint",
                                  fix="resume from another checkpoint")  # fmt: skip

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The fp32 master weights where DeepSpeed keeps them (ZeRO 1-3, bf16): gathered from every
        rank's partition by DeepSpeed's ``safe_get_full_fp32_param`` (collective under ZeRO); else the
        weights themselves, gathered under ZeRO-3. Buffers are never partitioned."""
        from deepspeed.utils import safe_get_full_fp32_param

        parameters = {id(p): p for p in module.parameters()}
        state: dict[str, torch.Tensor] = {}
        upcast = []
        for name, value in module.state_dict(keep_vars=True).items():
            param = parameters.get(id(value))
            if param is None:
                state[name] = value.detach().cpu()
                continue
            full = safe_get_full_fp32_param(param)
            if full is None:
                with self.deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                    full = param.detach().clone()
                if full.is_floating_point() and full.dtype != torch.float32 and param.requires_grad:
                    upcast.append(name)
            state[name] = full.detach().cpu()
        if upcast and self.rank_info.is_rank_zero:
            log.warning("DeepSpeed keeps no fp32 copy of %d trained parameter(s) (%s, ...) that this "
                        "model's state can reach: they are saved from the %s weights",
                        len(upcast), upcast[0], state[upcast[0]].dtype)  # fmt: skip
        return state

    def own_state_files(self, directory: Path, rank: int) -> list[Path]:
        return list((directory / STATE_TAG).glob(f"*zero_pp_rank_{rank}_mp_rank_*"))

    def teardown(self) -> None:
        if self.ds is not None:
            with contextlib.suppress(Exception):
                self.ds.destroy()
            forget_groups(self.ds, self.ds.optimizer, *self.ds.module.parameters())
            self.ds = None
        if self._owns_group and "deepspeed" in sys.modules:
            # Through DeepSpeed, which also drops the groups it cloned from this one: torch's own
            # destroy would leave them cached, and the next engine in this process would fail in
            # deepspeed.initialize on a group that no longer exists. (DeepSpeed's communication
            # may never have started, when deepspeed.initialize failed: then torch's is enough.)
            import deepspeed.comm

            if deepspeed.comm.is_initialized():
                try:
                    deepspeed.comm.destroy_process_group()
                except Exception as err:  # torch's destroy below still ends the group
                    log.debug("deepspeed.comm.destroy_process_group failed: %s", err)
                else:
                    self._owns_group = False
        super().teardown()


@contextlib.contextmanager
def _local_rank_in_environment(local_rank: int) -> Iterator[None]:
    """DeepSpeed reads LOCAL_RANK from the environment; a single process started without a
    launcher has none. Set it for ``deepspeed.initialize`` only."""
    if "LOCAL_RANK" in os.environ:
        yield
        return
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        yield
    finally:
        os.environ.pop("LOCAL_RANK", None)


def _require_contiguous_parameters(model: torch.nn.Module, source: str) -> None:
    """DeepSpeed views every parameter's storage as bytes (at every ZeRO stage), which a weight in
    another memory layout cannot give: it fails with ``self.stride(-1) must be 1 to view Float as Byte``."""
    for name, parameter in model.named_parameters():
        if not parameter.is_contiguous():
            raise BackendError(
                f"{source}: the deepspeed backend cannot take parameter '{name}': it is not contiguous "
                f"(strides {parameter.stride()}, e.g. channels_last)",
                "DeepSpeed views every parameter as one flat run of bytes (ZeRO flattens them into "
                "buffers), which needs the default memory layout",
                "leave the model's weights in the default layout (drop model.to(memory_format=...); "
                "inputs may stay channels_last), or use the ddp backend, which takes them",
            )


def _safe_checkpoint_engine(engine: Any) -> Any:
    """DeepSpeed's torch checkpoint engine, reading with ``weights_only=True`` (DeepSpeed's own
    reads with plain pickle, so a checkpoint directory could run code)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):  # type: ignore[misc]
        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_torch_load(path, map_location=map_location)

    safe = SafeTorchCheckpointEngine(engine._config)
    previous = engine.checkpoint_engine
    if previous is not None and type(previous).__name__ != TorchCheckpointEngine.__name__:
        log.warning("keeping DeepSpeed's %s checkpoint engine: its loads are not restricted to weights",
                    type(previous).__name__)  # fmt: skip
        return previous
    return safe


__all__ = ["DeepSpeedBackend", "deepspeed_config", "safe_torch_load"]

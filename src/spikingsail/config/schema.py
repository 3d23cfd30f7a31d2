"""Typed training config: DeepSpeed's keys with DeepSpeed's meaning, plus a ``sail`` section of our own.

Each section is a frozen dataclass whose fields are the keys it accepts: a field's type says its
allowed values (``Literal`` for a choice) and its metadata the range of a number.
``spikingsail.config.parse`` builds the sections from JSON and is the only place that validates
user input.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args, get_type_hints

from spikingsail.checks import FLOAT32_MAX, INT64_MAX, Range
from spikingsail.config.compiling import CompileConfig

MAX_TIMEOUT_MINUTES = 100 * 365 * 24 * 60
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The consumers' bounds, with the reason a message gives when a value is outside them.
_LOSS_SCALE = Range(
    0, FLOAT32_MAX, fix="0, or e.g. 128",
    why="0 selects dynamic scaling; a static scale multiplies the float32 loss, so it must be a float32 number",
)  # fmt: skip
_SCALE_POWER = Range(
    0, 127, integer=True, fix="DeepSpeed's default is 16",
    why="dynamic scaling starts at 2**initial_scale_power, which multiplies the float32 loss: "
    "above 2**127 it is not a float32 number",
)  # fmt: skip
_MIN_LOSS_SCALE = Range(
    0, FLOAT32_MAX, low_open=True, fix="DeepSpeed's default is 1",
    why="the dynamic scale halves down to it, and the loss is scaled in float32",
)  # fmt: skip
_SEED = Range(
    0, 2**32 - 1, integer=True,
    why="numpy's seed (np.random.seed) takes 0 to 2**32-1, and every rank seeds python, numpy and torch with it",
)  # fmt: skip
_TIMEOUT = Range(
    1 / 60, MAX_TIMEOUT_MINUTES, fix="the default is 30",
    why="torch counts its timeouts in whole milliseconds and the deadline of a collective in int64 "
    "nanoseconds (about 292 years), so it must be between 1 second and 100 years",
)  # fmt: skip
_MEMORY_BUDGET = Range(
    0, FLOAT32_MAX, low_open=True, fix="e.g. 2048",
    why="it is the activation memory, in MiB, that time_chunk \"auto\" sizes its chunks to",
)  # fmt: skip
_CLIPPING = Range(
    0, FLOAT32_MAX, fix="e.g. 1.0",
    why="it is the largest global gradient norm (0 = off), compared with the float32 norm",
)  # fmt: skip


# What a key may do between the run that saved a checkpoint and the run that resumes it (a field's
# metadata "resume"; checkpoint.compatibility derives its lists from it):
Resume = Literal["fixed", "free", "split", "chunks"]
"""fixed: it shapes the training, so a resume needs the saved value (the default for every key);
free: where and how the run is kept, or how it is watched (may change);
split: how train_batch_size is divided over processes and micro-steps (may change on a step boundary);
chunks: how a forward is chunked in time (may change, unless batch norm is normalised per chunk)."""


def ranged(default: Any, allowed: Range, *, resume: Resume = "fixed") -> Any:
    """A field whose JSON value ``spikingsail.config.parse`` checks against ``allowed``."""
    return field(default=default, metadata={"range": allowed, "resume": resume})


def any_case(default: str) -> Any:
    """A ``Literal`` field whose JSON value may be written in any case (``"FP16"`` for ``"fp16"``)."""
    return field(default=default, metadata={"any_case": True})


def free(default: Any, **metadata: Any) -> Any:
    """A field that may change when a checkpoint is resumed: where and how the run is kept, or watched."""
    return field(default=default, metadata={**metadata, "resume": "free"})


def section(
    cls: type[Any] | None, *, deepspeed: bool, resume: Resume = "fixed", aliases: tuple[str, ...] = ()
) -> Any:
    """A top-level section of the config file: ``cls``'s keys (None: absent unless given), whether
    DeepSpeed reads the section too (the deepspeed backend hands it over), and other spellings of its name."""
    metadata = {"section": True, "deepspeed": deepspeed, "aliases": aliases, "resume": resume}
    if cls is None:
        return field(default=None, metadata=metadata)
    return field(default_factory=cls, metadata=metadata)


def internal(*, resume: Resume = "fixed", **kwargs: Any) -> Any:
    """A field the engine fills in, not a key of the file."""
    return field(**kwargs, metadata={"internal": True, "resume": resume})


@dataclass(kw_only=True, slots=True, frozen=True)
class FP16Config:
    enabled: bool = False
    """Mixed precision with float16 autocast and loss scaling."""
    loss_scale: float = ranged(0.0, _LOSS_SCALE)
    """0 selects dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = ranged(16, _SCALE_POWER)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = ranged(1000, Range(1, integer=True, fix="DeepSpeed's default is 1000"))
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = ranged(2, Range(1, integer=True, fix="DeepSpeed's default is 2"))
    """Overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: float = ranged(1.0, _MIN_LOSS_SCALE)
    """The dynamic scale never drops below this."""
    auto_cast: bool = free(False)
    """Accepted for DeepSpeed compatibility; the forward always runs under autocast."""


@dataclass(kw_only=True, slots=True, frozen=True)
class BF16Config:
    enabled: bool = False
    """Mixed precision with bfloat16 autocast (no loss scaling needed)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    type: str
    """Optimizer name, case-insensitive: Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, weight_decay, ...)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerConfig:
    type: str
    """WarmupLR, WarmupDecayLR or OneCycle (DeepSpeed's definitions)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the scheduler."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroConfig:
    stage: int = 0
    """0 = off, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters."""
    options: dict[str, Any] = field(default_factory=dict)
    """The other DeepSpeed ``zero_optimization`` keys, validated; the deepspeed backend hands them to DeepSpeed."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    path: str | None = None
    """Where the engine saves on its own (also set by --checkpoints-path)."""
    interval_steps: int = ranged(0, Range(0, integer=True, fix="0 turns it off"))
    """Save every N optimizer steps (0 = never on its own)."""
    interval_seconds: float = ranged(0.0, Range(0, fix="0 turns it off"))
    """Save when this much time has passed since the last save (0 = never on its own)."""
    keep_last: int = ranged(0, Range(0, integer=True, fix="0 keeps all"))
    """Keep only the newest K checkpoints, deleting older ones after a new one is complete (0 = keep all)."""
    async_save: bool = False
    """Copy the state to host memory and write it in the background (torch.distributed.checkpoint's async_save)."""
    save_on_preemption: bool = True
    """With a path set: on SIGTERM or SIGUSR1, finish the step, save, and exit with status 75."""
    on_error: Literal["stop", "continue"] = "continue"
    """When a periodic save fails (a full disk, a read-only or vanished directory): "continue" warns on
    every rank and in the metrics file, keeps training and saves again at the next interval; "stop"
    ends the job with the error. The script's own save_checkpoint() and the preemption save always
    stop (raise the error on every rank); nothing is lost either way: the unfinished checkpoint is
    removed and 'latest' still names the last good one."""
    tag_validation: str = "Warn"
    """DeepSpeed's key, accepted; tags are always the same on every rank here."""
    load_universal: bool = False
    """DeepSpeed's key, accepted; SpikingSail's format loads on any world size."""
    use_node_local_storage: bool = False
    """DeepSpeed's key, accepted; checkpoints go to one shared directory."""
    parallel_write: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's key, accepted without effect."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SNNConfig:
    enabled: bool | None = None
    """None: on when the model has spiking neurons (spikingjelly); false: no SNN handling at all."""
    reset: Literal["per_batch", "off"] = "per_batch"
    """per_batch: the engine resets neuron state between batches and micro-batches; off: the script does."""
    step_mode: Literal["s", "m"] | None = None
    """Set every spiking layer to 's' (one time step per call) or 'm' ([T, N, ...] per call); None keeps the model's."""
    time_steps: int = ranged(
        4, Range(1, INT64_MAX, integer=True, why="it is the length of a tensor dimension")
    )
    """T for engine.encode()."""
    encoding: Literal["repeat", "poisson"] = "repeat"
    """How engine.encode() makes [T, N, ...] from a static input: repeat (direct) or poisson (rate)."""
    sync_batchnorm: bool = False
    """Synchronise batch-norm statistics across ranks, over T × N samples in multi-step mode."""
    time_chunk: int | str = field(default=0, metadata={"parse": "time_chunk", "resume": "chunks"})
    """Multi-step mode: run a training forward's T steps in chunks of at most this many, keep only
    each chunk's boundary state and recompute a chunk in backward (0: off; "auto": the largest
    chunk whose estimated activations fit memory_budget_mb). The first chunked forward is checked
    against the whole one (no grad, once): a module that mixes time steps (a mean, attention or a
    convolution over T), a buffer changed on every call, or a model whose input has no time axis
    (forward(x) that repeats [N, ...] over T inside) is refused, naming it, before the first step."""
    memory_budget_mb: float | None = ranged(None, _MEMORY_BUDGET, resume="chunks")
    """For time_chunk "auto": the activation memory one training forward may keep, in MiB per rank."""
    check_state: bool = False
    """Debug: before a forward that starts a new micro-batch (after a backward, an accumulation
    boundary, a train/eval switch, a checkpoint load), fail naming any neuron whose state is not at
    its reset value."""
    chunk_batchnorm: Literal["refuse", "per_chunk"] = field(default="refuse", metadata={"resume": "chunks"})
    """Batch norm that uses batch statistics spans T × N samples, which time chunks cannot keep:
    refuse (the default) or normalise each chunk over its own k × N samples (a different model)."""
    backend: Literal["auto", "torch", "cuda", "triton", "cupy"] = free("auto")
    """spikingjelly's neuron kernels on a CUDA device, for every neuron kind: "auto" keeps spikingjelly's
    choice (its SJ_<KIND>_CUDA_IMPLEMENTATION variables, else native CUDA, Triton, torch: the first
    that loads); "torch" its reference ops; "cuda" its native kernels (built from source); "triton"
    its Triton kernels. A CPU runs "auto" and "torch" (the reference ops). What the device cannot run
    is refused before the first step; so is "cupy", spikingjelly 0.0.0.0.x's, which 2.0 replaced."""


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultToleranceConfig:
    """Live recovery across replica groups (torchft), in force under ``sail launch --ft-replicas``."""

    min_replicas: int = ranged(1, Range(1, integer=True, fix="e.g. 1"))
    """Replica groups that must take part for a step to commit (torchft's min_replica_size)."""
    timeout_seconds: float = ranged(60.0, Range(0, FLOAT32_MAX, low_open=True, fix="e.g. 60"))
    """A cross-group all-reduce, the commit vote and a healing transfer wait this long."""
    quorum_timeout_seconds: float = ranged(60.0, Range(0, FLOAT32_MAX, low_open=True, fix="e.g. 60"))
    """How long a replica group waits for the lighthouse to form a step's quorum (torchft's quorum_timeout)."""
    connect_timeout_seconds: float = ranged(60.0, Range(0, FLOAT32_MAX, low_open=True, fix="e.g. 60"))
    """How long a replica group waits to connect to the lighthouse and to the other groups (torchft's
    connect_timeout)."""
    quorum_retries: int = ranged(3, Range(0, integer=True, fix="e.g. 3"))
    """Quorum attempts that may fail (a lighthouse restarting) before the replica gives up."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SailSection:
    backend: str = free("ddp")  # within one checkpoint format (checked separately)
    """Which engine backend runs the job (see ``spikingsail.backends.available()``)."""
    dist_backend: Literal["auto", "nccl", "gloo"] = free("auto")
    """torch.distributed backend: auto (nccl with CUDA, gloo otherwise), nccl or gloo."""
    seed: int | None = ranged(None, _SEED)
    """Seed python, numpy and torch on every rank before the model is wrapped."""
    progress_bar: bool = free(True)
    """Show a progress bar with loss and samples/s on rank 0."""
    metrics_path: str | None = free(None)
    """Append one JSON line per optimizer step (rank 0) to this file."""
    timeout_minutes: float = ranged(30.0, _TIMEOUT, resume="free")
    """How long collectives wait before the process group gives up."""
    find_unused_parameters: bool = free(False)
    """Passed to DistributedDataParallel for models with branches not used every step."""
    move_inputs_to_device: bool = free(True)
    """Move tensors passed to ``engine(...)`` onto the engine's device."""
    deterministic: bool = free(False)
    """Deterministic kernels only (torch.use_deterministic_algorithms, cuDNN without autotuning,
    CUBLAS_WORKSPACE_CONFIG): what bit-exact resume needs on GPUs."""
    balance: str | tuple[float, ...] | dict[str, float] = free("off", parse="balance")
    """Per-rank micro-batches for ranks of unequal speed: "off" (equal), "auto" (measured), a
    weight per rank, or {"host": weight}; each rank's share of every global micro-batch."""
    rebalance_factor: float = ranged(
        1.25, Range(1, FLOAT32_MAX, low_open=True, fix="e.g. 1.25"), resume="free"
    )
    """With balance "auto": split again when a rank's share of the total speed moves by more than this factor (surely: by three standard errors)."""
    straggler_window: int = ranged(
        20, Range(0, INT64_MAX, integer=True, fix="e.g. 20, or 0 for off"), resume="free"
    )
    """Every this many optimizer steps the ranks compare their step-time breakdown (0 = off)."""
    straggler_factor: float = ranged(
        1.25, Range(1, FLOAT32_MAX, low_open=True, fix="e.g. 1.25"), resume="free"
    )
    """A rank whose work per step stays this many times the other ranks' (median) for three windows or more, surely (the lower confidence bound too), is warned of."""
    hang_timeout_seconds: float = ranged(
        300.0, Range(0, FLOAT32_MAX, fix="e.g. 300, or 0 for off"), resume="free"
    )
    """When no rank makes progress for this long, report who holds the job up (stacks included) and end it (0 = off)."""
    trackers: tuple[str, ...] = free((), parse="trackers")
    """Where rank 0's metrics go, in log_dir: jsonl (the metrics file), tensorboard, mlflow, wandb
    (spikingsail.monitor.trackers.REGISTRY)."""
    log_dir: str | None = free(None)
    """The run's directory: trackers, hang reports (default runs/DATE-TIME with trackers; else hang
    reports go beside metrics_path, or to the working directory)."""
    ledger: bool = free(False)
    """Record which dataset samples every optimizer step trained on, per process, in log_dir/ledger/
    (``sail report --ledger RUN_DIR`` checks that each finished epoch took every sample once)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SailConfig:
    """A validated config with the batch-size triple resolved for one world size."""

    train_batch_size: int
    """The global batch per optimizer step: train_micro_batch_size_per_gpu × gradient_accumulation_steps
    × world_size; of the three batch keys, any two imply the third."""
    train_micro_batch_size_per_gpu: int = field(metadata={"resume": "split"})
    """The batch each process takes per micro-step (one forward and backward)."""
    gradient_accumulation_steps: int = field(metadata={"resume": "split"})
    """Micro-steps per optimizer step (1 when only one batch key is given)."""
    world_size: int = internal(resume="split")
    """The number of data-parallel replicas the batch sizes were resolved for: every process, unless
    the backend splits the model over several (``Backend.data_parallel_size``)."""
    optimizer: OptimizerConfig | None = section(None, deepspeed=True)
    scheduler: SchedulerConfig | None = section(None, deepspeed=True)
    fp16: FP16Config = section(FP16Config, deepspeed=True)
    bf16: BF16Config = section(BF16Config, deepspeed=True, aliases=("bfloat16",))
    gradient_clipping: float = ranged(0.0, _CLIPPING)
    """The largest global gradient norm: gradients are scaled down to it before each step (0 = off)."""
    steps_per_print: int = ranged(10, Range(1, integer=True), resume="free")
    """Log a line (or update the progress bar) every this many optimizer steps."""
    # how state is sharded, not what it is (read by spikingsail.config.zero: DeepSpeed's own rules)
    zero_optimization: ZeroConfig = section(ZeroConfig, deepspeed=True, resume="free")
    # torch.compile on every backend; the deepspeed backend hands DeepSpeed the DeepCompile keys
    compile: CompileConfig = section(CompileConfig, deepspeed=True, resume="free")
    # DeepSpeed's keys in it are accepted; SpikingSail saves
    checkpoint: CheckpointConfig = section(CheckpointConfig, deepspeed=False, resume="free")
    snn: SNNConfig = section(SNNConfig, deepspeed=False)
    # timeouts and quorum sizes of replica groups
    fault_tolerance: FaultToleranceConfig = section(FaultToleranceConfig, deepspeed=False, resume="free")
    sail: SailSection = section(SailSection, deepspeed=False)
    backend_sections: Mapping[str, Any] = internal(default_factory=dict)
    """Sections a backend owns (name → its validated dataclass), present in the file."""
    inert_keys: tuple[str, ...] = internal(default=(), resume="free")
    """DeepSpeed keys present in the file that SpikingSail accepts but does not act on."""
    source: str = internal(default="<dict>", resume="free")
    """Where the config came from, for messages."""
    raw: dict[str, Any] = internal(default_factory=dict, compare=False, repr=False, resume="free")
    """The config as read (JSON), for backends that hand it to their own engine (DeepSpeed)."""


@dataclass(frozen=True, slots=True)
class Section:
    """A top-level section of the config file, as its ``SailConfig`` field declares it."""

    field: str
    """The ``SailConfig`` field (the canonical name: ``bf16`` for ``bfloat16``)."""
    cls: type[Any]
    deepspeed: bool
    """DeepSpeed reads it too: the deepspeed backend hands it to ``deepspeed.initialize``."""


def sections(config: type[Any] | None = None) -> dict[str, Section]:
    """Every top-level section of ``config`` (SailConfig), by each name the file may give it."""
    config = config or SailConfig
    hints = get_type_hints(config)
    out = {}
    for declared in fields(config):
        if declared.metadata.get("section"):
            found = Section(
                declared.name, section_class(hints[declared.name]), declared.metadata["deepspeed"]
            )
            out.update(dict.fromkeys((declared.name, *declared.metadata["aliases"]), found))
    return out


def scalars(config: type[Any] | None = None) -> dict[str, type[Any]]:
    """The top-level keys of the file that hold one value (not a section, not a batch size), by type."""
    config = config or SailConfig
    hints = get_type_hints(config)
    return {
        declared.name: hints[declared.name]
        for declared in fields(config)
        if not declared.metadata.get("section")
        and not declared.metadata.get("internal")
        and declared.name not in BATCH_KEYS
    }


def keys_where(resume: Resume, config: type[Any] | None = None) -> tuple[str, ...]:
    """Every key of ``config`` (SailConfig) whose field says ``resume`` (dotted; a whole section by its name)."""
    return tuple(_keys_where(config or SailConfig, "", resume))


def _keys_where(cls: type[Any], prefix: str, resume: Resume) -> Iterator[str]:
    hints = get_type_hints(cls)
    for declared in fields(cls):
        name, said = prefix + declared.name, declared.metadata.get("resume", "fixed")
        inner = section_class(hints[declared.name], required=False)
        if inner is not None and said == "fixed":  # a section is its keys, unless it says otherwise of all
            yield from _keys_where(inner, f"{name}.", resume)
        elif said == resume:
            yield name


def section_class(hint: Any, *, required: bool = True) -> Any:
    """The dataclass a section's type names (``X`` or ``X | None``)."""
    for candidate in (hint, *get_args(hint)):
        if isinstance(candidate, type) and is_dataclass(candidate):
            return candidate
    if required:
        raise TypeError(f"{hint} names no dataclass")
    return None


def summary(config: SailConfig, optimizer: str | None = None, lr_scheduler: str | None = None) -> str:
    """An aligned dump of the settings that shape a run, logged once at start; ``optimizer`` and
    ``lr_scheduler`` name the types of the ones passed to the engine, which take the place of the
    config's."""

    def source(given: str | None, section: OptimizerConfig | SchedulerConfig | None, default: str) -> str:
        if given is None:
            return section.type if section else default
        ignored = f" (the config's {section.type} is ignored)" if section else ""
        return f"{given}, passed to the engine{ignored}"

    precision = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    rows = {
        "config": config.source,
        "backend": f"{config.sail.backend} (dist backend {config.sail.dist_backend})",
        "world_size": str(config.world_size),
        "train_batch_size": (
            f"{config.train_batch_size} = micro {config.train_micro_batch_size_per_gpu}"
            f" × accumulation {config.gradient_accumulation_steps} × world {config.world_size}"
        ),
        "optimizer": source(optimizer, config.optimizer, "none"),
        "scheduler": source(lr_scheduler, config.scheduler, "none"),
        "precision": precision,
        "gradient_clipping": str(config.gradient_clipping or "off"),
        "zero_optimization.stage": str(config.zero_optimization.stage),
    }
    width = max(map(len, rows))
    return "\n".join(f"  {key:<{width}} : {value}" for key, value in rows.items())

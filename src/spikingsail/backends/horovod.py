"""Horovod 0.28 (PyTorch, Gloo): ``hvd.DistributedOptimizer`` all-reduces the gradients.

Choose it with ``"sail": {"backend": "horovod"}``. Ranks come from Horovod, which is initialised
according to who started the processes:

- horovodrun (``sail launch --launcher horovodrun -H host:N,...``, or ``horovodrun --gloo -np N -H
  ...`` directly): ``hvd.init()`` meets at horovodrun's rendezvous server;
- mpirun (``horovodrun --mpi``) with a Horovod built with MPI: ``hvd.init()`` on MPI;
- any other launcher (``sail launch -n N`` / torchrun, srun, mpirun): the backend joins
  torch.distributed first, rank 0 runs Horovod's rendezvous server itself, and every rank gets the
  HOROVOD_* variables horovodrun would have set, for the duration of ``hvd.init()`` only;
- one process: Horovod of size 1.

Options, in a ``horovod`` section of the config::

    "horovod": {"compression": "none" | "fp16", "op": "Average" | "Adasum",
                "backward_passes_per_step": <gradient_accumulation_steps, the default>}

How the engine's loop maps onto Horovod:

- ``hvd.DistributedOptimizer(backward_passes_per_step=gradient_accumulation_steps)`` counts the
  backward passes of every parameter itself and starts its all-reduce only on the last one of an
  accumulation window, overlapping it with the rest of that backward pass.
- The engine unscales fp16 gradients and clips them before ``optimizer.step()``, so the averaged
  gradients must be there first: at the end of the window's last backward pass the backend calls
  ``optimizer.synchronize()`` (Horovod's own wait), and the step runs in Horovod's
  ``skip_synchronize()``. fp16/bf16 thus work through the engine's precision, exactly as with DDP.
- At the start, rank 0's parameters and buffers (``hvd.broadcast_parameters``) and optimizer state
  (``hvd.broadcast_optimizer_state``, when the optimizer already has some) reach every rank.
- Besides Horovod's ring, the backend forms a torch.distributed (gloo) group, used for checkpoints,
  metrics and SyncBatchNorm: at MASTER_ADDR/MASTER_PORT when they are set (every launcher but
  plain horovodrun), otherwise at a free port on rank 0's host that rank 0 announces with
  ``hvd.broadcast_object``. Checkpoints are therefore the same torch.distributed.checkpoint files
  as DDP's and FSDP's, and load under either.

With ``op: Adasum`` Horovod applies each rank's optimizer update inside the backward pass and
combines the updates; it needs Horovod running on MPI, and neither loss scaling nor clipping can
come between (both are refused).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import socket
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # public, not re-exported in stubs
from torch.utils.hooks import RemovableHandle

from spikingsail.backends.base import Backend
from spikingsail.backends.process_group import (
    dist_backend_for,
    init_default_group,
    join_process_group,
    leave_process_group,
    select_device,
)
from spikingsail.checks import Range
from spikingsail.config.schema import SailConfig, any_case, ranged
from spikingsail.environments import RankInfo, RankSource
from spikingsail.environments.horovod import store_agreed_by_horovod
from spikingsail.errors import BackendError, ConfigError, first_line

log = logging.getLogger(__name__)

SECTION = "horovod"
GLOO_RENDEZVOUS_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
"""Set by horovodrun --gloo (and Horovod's elastic driver) for hvd.init()."""
INSTALL_HINT = (
    f'pip install "$(bash scripts/build-horovod.sh {sys.executable})"  (the script, in the SpikingSail '
    "source tree, builds Horovod 0.28.1 with PyTorch and Gloo for this torch, once: about 7 minutes)"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class HorovodConfig:
    """The ``horovod`` section: this backend's own keys, checked at the config boundary."""

    compression: Literal["none", "fp16"] = any_case("none")
    """How gradients travel in the all-reduce."""
    op: Literal["Average", "Adasum"] = any_case("Average")
    """How the ranks' gradients are combined."""
    backward_passes_per_step: int | None = ranged(None, Range(1, integer=True))
    """Follows gradient_accumulation_steps; if given, it must equal it."""


@dataclass(frozen=True, slots=True)
class HorovodOptions:
    compression: str = "none"
    op: str = "Average"
    backward_passes_per_step: int = 1


def horovod_options(config: SailConfig) -> HorovodOptions:
    """The config's ``horovod`` section, checked against the rest of the config."""
    where = config.source
    section = config.backend_sections.get(SECTION) or HorovodConfig()
    accumulation = config.gradient_accumulation_steps
    passes = section.backward_passes_per_step
    if passes is not None and passes != accumulation:
        raise ConfigError(
            f"{where}: {SECTION}.backward_passes_per_step is {passes!r}, but gradient_accumulation_steps "
            f"is {accumulation} for {config.world_size} process(es)",
            "the engine steps the optimizer once every gradient_accumulation_steps micro-steps, and "
            "Horovod must all-reduce on exactly those backward passes",
            f"remove {SECTION}.backward_passes_per_step (it follows gradient_accumulation_steps) "
            f"or set it to {accumulation}",
        )
    if section.op == "Adasum":
        for active, what in ((config.gradient_clipping > 0, "gradient_clipping"),
                             (config.fp16.enabled, "fp16.enabled")):  # fmt: skip
            if active:
                raise ConfigError(
                    f"{where}: {SECTION}.op is Adasum together with {what}",
                    "with Adasum, Horovod applies each rank's optimizer update inside the backward "
                    "pass, before the engine could unscale or clip the gradients",
                    f'use "op": "Average", or turn {what} off (bf16 works with Adasum)',
                )
    return HorovodOptions(
        compression=section.compression, op=section.op, backward_passes_per_step=accumulation
    )


def import_horovod(where: str) -> Any:
    """``horovod.torch``, or a BackendError that says how to install it."""
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as err:
        raise BackendError(
            f"{where}: sail.backend is horovod, but horovod.torch cannot be imported",
            str(err) or type(err).__name__,
            f"install Horovod with PyTorch support: {INSTALL_HINT}",
        ) from None


class HorovodBackend(Backend):
    name = "horovod"
    # DeepSpeed keys: none honoured. zero_optimization.stage > 0 is reported by initialize.

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self.options = horovod_options(config)  # before anything starts: a bad option stops every rank alike
        self.hvd: Any = None
        self.optimizer: Any = None
        self._owns_horovod = False
        self._owns_group = False
        self._rendezvous: Any = None
        self._boundary = True
        self._queued = False
        self._hooks: list[RemovableHandle] = []
        self._skip_sync = contextlib.ExitStack()

    # -- processes -------------------------------------------------------------------------------

    def setup(self) -> torch.device:
        where = self.config.source
        self.hvd = import_horovod(where)
        self.device = select_device(self.rank_info)
        try:
            if not self.hvd.is_initialized():
                source = self.rank_info.source
                if (
                    not self.rank_info.distributed
                    or source is RankSource.HOROVOD
                    or (source is RankSource.OPENMPI and self.hvd.mpi_built())
                ):
                    self.hvd.init()  # horovodrun's rendezvous, MPI's world, or one process
                    # Under horovodrun's Gloo rendezvous Horovod stays up until the process exits
                    # (it shuts itself down then), and a later engine in the process uses it: a
                    # second hvd.init() could meet the first one's addresses, which Horovod 0.28's
                    # rendezvous server does not always clear (its DELETE handler forgets other
                    # scopes' finished ranks), and connect to a closed port.
                    self._owns_horovod = GLOO_RENDEZVOUS_ENV not in os.environ
                else:
                    # torchrun, srun, mpirun without Horovod's MPI: torch.distributed first, then
                    # Horovod's Gloo through it
                    self._owns_group = join_process_group(
                        self.config.sail, self.config.source, self.rank_info, self.device
                    )
                    self._rendezvous = _init_through_torch(self.hvd, self.rank_info)
                    self._owns_horovod = True
            self._check_horovod()
            if not dist.is_initialized():
                self._owns_group = self._join_group()
        except BaseException:
            self.teardown()  # the engine tears down only what it built after setup
            raise
        log.info("Horovod %s: rank %d of %d, compression %s, op %s, backward_passes_per_step %d",
                 importlib.import_module("horovod").__version__, self.hvd.rank(), self.hvd.size(),
                 self.options.compression, self.options.op, self.options.backward_passes_per_step)  # fmt: skip
        return self.device

    def _check_horovod(self) -> None:
        hvd, info = self.hvd, self.rank_info
        seen = (hvd.rank(), hvd.size(), hvd.local_rank())
        if seen != (info.rank, info.world_size, info.local_rank):
            raise BackendError(
                f"Horovod sees rank {seen[0]} of {seen[1]} (local rank {seen[2]}), but {info.source} "
                f"describes rank {info.rank} of {info.world_size} (local rank {info.local_rank})",
                "Horovod was initialised for another job layout than the launcher's",
                "let the backend initialise Horovod (do not call hvd.init() yourself), or start the "
                "job with horovodrun (`sail launch --launcher horovodrun`)",
            )
        if self.device.type == "cuda" and not hvd.cuda_built():
            raise BackendError(
                "this Horovod was built without CUDA, and the engine computes on GPUs",
                "Horovod all-reduces GPU tensors only when built with GPU operations",
                "rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL (see scripts/build-horovod.sh)",
            )
        if self.options.op == "Adasum" and hvd.size() > 1 and not hvd.mpi_enabled():
            built = "with" if hvd.mpi_built() else "without"
            raise BackendError(
                f"{self.config.source}: {SECTION}.op is Adasum, but Horovod runs on Gloo here "
                f"(this Horovod was built {built} MPI)",
                "Horovod implements Adasum only on MPI; on Gloo every all-reduce fails with "
                "'No Adasum operation enabled'",
                'use "op": "Average", or a Horovod built with MPI (HOROVOD_WITH_MPI=1) started by '
                "`horovodrun --mpi`",
            )

    def _join_group(self) -> bool:
        """torch.distributed's default group, for checkpoints, metrics and SyncBatchNorm."""
        if not self.rank_info.distributed or dist.is_initialized():
            return False
        if not store_agreed_by_horovod(os.environ):
            return join_process_group(
                self.config.sail, self.config.source, self.rank_info, self.device
            )  # MASTER_ADDR/PORT
        info, hvd = self.rank_info, self.hvd
        timeout = datetime.timedelta(minutes=self.config.sail.timeout_minutes)
        store = None
        address = None
        try:
            if info.rank == 0:
                host = _rank0_host(os.environ)
                store = TCPStore(host, 0, world_size=info.world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False)  # fmt: skip
                address = f"{host}:{store.port}"
            address = hvd.broadcast_object(address, root_rank=0, name="spikingsail.store")
            assert isinstance(address, str)
            if store is None:
                host, _, port = address.rpartition(":")
                store = TCPStore(
                    host, int(port), world_size=info.world_size, is_master=False, timeout=timeout
                )
            backend = dist_backend_for(self.config.sail, self.config.source, self.device)
            prefixed = PrefixStore("spikingsail/horovod", store)
            init_default_group(backend, timeout, prefixed, rank_info=info, device=self.device)
        except (RuntimeError, ValueError) as err:
            raise BackendError(
                f"rank {info.rank} could not join the torch.distributed group at {address or 'rank 0'}",
                first_line(err),
                "export MASTER_ADDR (an address of the first host that every host reaches) before "
                "horovodrun, and GLOO_SOCKET_IFNAME if torch picks the wrong network interface",
            ) from err
        log.debug("torch.distributed group at %s (announced through Horovod)", address)
        return True

    # -- model and optimizer ----------------------------------------------------------------------

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        hvd = self.hvd
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise BackendError(
                f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model",
                "Horovod names every gradient all-reduce after its parameter",
                "build the optimizer from model.parameters()",
            )
        # DistributedOptimizer makes a new optimizer (of a subclass of the given one's class) on the
        # same parameter groups; state the given one already has is carried over.
        state = optimizer.state_dict() if optimizer.state else None
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=[(names[id(p)], p) for p in params],
            compression=hvd.Compression.fp16 if self.options.compression == "fp16" else hvd.Compression.none,
            backward_passes_per_step=self.options.backward_passes_per_step,
            op=hvd.Adasum if self.options.op == "Adasum" else hvd.Average,
        )
        if state is not None:
            wrapped.load_state_dict(state)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if wrapped.state:
            # Only state that exists: for an optimizer without any, Horovod would create it by
            # stepping with zero gradients, which applies weight decay once and advances Adam's
            # step count, so that the run would no longer match DDP's.
            hvd.broadcast_optimizer_state(wrapped, root_rank=0)
        self._patch_zero_grad(wrapped)
        if self.options.op != "Adasum":  # Adasum's optimizer steps inside the backward pass itself
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_gradient))
        self.optimizer = wrapped
        return model, wrapped

    def _patch_zero_grad(self, wrapped: Any) -> None:
        # Horovod 0.28's zero_grad() takes no set_to_none (torch's and DCP's callers pass it). It
        # also ends an accumulation window: leave skip_synchronize and restore the window length.
        horovod_zero_grad = wrapped.zero_grad
        backend = self

        def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            backend._end_window()
            if set_to_none:
                horovod_zero_grad()  # refuses while all-reduces are in flight
            else:
                below_horovod: Any = super(type(opt), opt)  # the given optimizer's class
                below_horovod.zero_grad(set_to_none=False)

        wrapped.zero_grad = types.MethodType(zero_grad, wrapped)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        # Horovod defers the all-reduce by counting backward passes; the engine's flag tells the
        # backend which backward pass ends the window (forwards without autograd do not count).
        if torch.is_grad_enabled():
            self._boundary = enabled
        return contextlib.nullcontext()

    def _on_gradient(self, _param: torch.Tensor) -> None:
        if self._boundary and not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._synchronize)

    def _synchronize(self) -> None:
        """End of the window's last backward pass: wait for Horovod's all-reduces, so that the
        engine unscales and clips averaged gradients, and let step() skip Horovod's own wait."""
        self._queued = False
        self.optimizer.synchronize()
        self._skip_sync.enter_context(self.optimizer.skip_synchronize())

    def _end_window(self) -> None:
        self._skip_sync.close()
        passes = self.options.backward_passes_per_step
        if self.optimizer is not None and self.optimizer.backward_passes_per_step != passes:
            self.optimizer.set_backward_passes_per_step(passes)

    def sync_counters(self, micro_steps: int, global_steps: int, global_samples: int, skipped: int) -> None:
        # After a load: a checkpoint saved inside an accumulation window resumes with its partial
        # gradients, so Horovod's window must end where the engine's does (then it is restored).
        if self.optimizer is not None:
            done = micro_steps % self.options.backward_passes_per_step
            self.optimizer.set_backward_passes_per_step(self.options.backward_passes_per_step - done)

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._skip_sync.close()
        self.optimizer = None
        if self._owns_group:
            leave_process_group()
            self._owns_group = False
        if self._owns_horovod:
            self.hvd.shutdown()
            self._owns_horovod = False
        if self._rendezvous is not None:
            self._rendezvous.stop()
            self._rendezvous = None


def _init_through_torch(hvd: Any, info: RankInfo) -> Any:
    """``hvd.init()`` for processes that another launcher started, on their torch.distributed group.

    Horovod's Gloo ranks meet at an HTTP rendezvous server that normally lives in horovodrun. Here
    rank 0 runs Horovod's own server with the layout gathered from every rank (host, local rank),
    announces its port over torch.distributed, and every rank initialises Horovod with the
    variables horovodrun would have given it. Returns rank 0's server (None elsewhere).
    """
    from horovod.runner.common.util.hosts import SlotInfo  # type: ignore[import-untyped,unused-ignore]
    from horovod.runner.http.http_server import RendezvousServer  # type: ignore[import-untyped,unused-ignore]

    layout: list[Any] = [None] * info.world_size
    dist.all_gather_object(layout, (socket.gethostname(), info.local_rank))
    hosts = list(dict.fromkeys(host for host, _ in layout))
    slots = []
    for rank, (host, local_rank) in enumerate(layout):
        on_host = [r for r, (h, _) in enumerate(layout) if h == host]
        # Horovod's cross communicator joins the ranks with the same local rank on every host
        cross = [h for h in hosts if (h, local_rank) in layout]
        slots.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank, cross_rank=cross.index(host),
                              size=info.world_size, local_size=len(on_host), cross_size=len(cross)))  # fmt: skip
    server = None
    announced: list[Any] = [None]
    if info.rank == 0:
        server = RendezvousServer()
        announced = [(layout[0][0], server.start())]
        server.init(slots)
    dist.broadcast_object_list(announced, src=0)
    (addr, port), slot = announced[0], slots[info.rank]
    variables = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": str(addr), "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }  # fmt: skip
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        variables["HOROVOD_GLOO_IFACE"] = os.environ["GLOO_SOCKET_IFNAME"].split(",")[0]
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)  # hvd.init() reads them, and only then
    try:
        hvd.init()
    except BaseException:
        if server is not None:
            server.stop()
        raise
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return server


def _rank0_host(env: Mapping[str, str]) -> str:
    """An address of this (rank 0's) host that the other ranks reach: MASTER_ADDR when set,
    else this host's address on the interface horovodrun chose for Gloo, else its name."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    iface = env.get("HOROVOD_GLOO_IFACE", "").split(",")[0]
    if iface:
        psutil = importlib.import_module("psutil")  # a dependency of Horovod
        for addr in psutil.net_if_addrs().get(iface, []):
            if addr.family == socket.AF_INET:
                return str(addr.address)
    return env.get("HOROVOD_HOSTNAME") or socket.gethostname()


__all__ = ["HorovodBackend", "HorovodOptions", "horovod_options", "import_horovod"]

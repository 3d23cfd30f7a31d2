"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded over ranks.

Every direct child module that holds parameters becomes one FSDP unit (its parameters are gathered
for its forward and backward only), then the root takes the rest. ``fully_shard`` swaps each
parameter for a sharded DTensor one, so the optimizer's groups are pointed at the new parameters
(it must not have stepped yet; it stays the same object, with its groups and hyperparameters). Mixed precision follows the
config: with ``bf16`` (``fp16``) parameters are gathered in bfloat16 (float16) and gradients reduced
in float32. Checkpoints go through torch.distributed.checkpoint like every backend's, each rank
writing its own shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from spikingsail.backends.process_group import ProcessGroupBackend
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError, CheckpointError


class FSDPBackend(ProcessGroupBackend):
    name = "fsdp"
    replica_groups = True
    """As HSDP: each group shards the model over its ranks; rank r of every group holds the same
    shards, and torchft all-reduces those across the groups, as HSDP's replicate dimension does."""
    max_zero_stage: ClassVar[int] = 3
    measures_balance = False  # its all-gathers in forward make a fast rank wait for a slow one

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self.root: FSDPModule | None = None

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if optimizer.state:
            raise BackendError(
                "the optimizer given to the FSDP backend has already stepped",
                "fully_shard replaces every parameter with a sharded one, and the optimizer's state would belong to the old ones",
                "create the optimizer (or let the config create it) and hand it over before the first step",
            )
        if not self.rank_info.distributed:
            return model, optimizer  # one process: nothing to shard
        names = {id(p): n for n, p in model.named_parameters()}
        unknown = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
        if unknown:
            raise BackendError(
                f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model",
                "the FSDP backend points the optimizer at the model's sharded parameters",
                "build the optimizer from model.parameters()",
            )
        # fully_shard keeps each rank's own slice of the weights it is given: ranks that initialised
        # differently (no seed set before the model was built, weights loaded on rank 0 only) would
        # train a model stitched from several. Start from rank 0's, as DDP and Horovod do.
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                dist.broadcast(tensor, src=0)
        policy = MixedPrecisionPolicy(**self._precision())
        # ZeRO-3 (and no stage given) frees each unit's gathered parameters after its forward and
        # gathers them again for backward; stages 1 and 2 keep them from forward to backward, as
        # DeepSpeed's stages do (FSDP2 has no mode that leaves parameters unsharded at rest).
        reshard = self.config.zero_optimization.stage not in (1, 2)
        for child in _own_units(model):
            fully_shard(child, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
        assert isinstance(model, FSDPModule)
        self.root = model
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:  # it has no state yet, so swapping the tensors is all
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model, optimizer

    def compile_targets(self, wrapped: torch.nn.Module, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Each block FSDP2 shards on its own, as torchtitan compiles them (the root's own layers run
        eagerly); the whole model where nothing was sharded block by block."""
        blocks: list[torch.nn.Module] = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
        return blocks[1:] or [wrapped]  # modules() lists the root first

    def _precision(self) -> dict[str, Any]:
        if self.config.bf16.enabled:
            return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        if self.config.fp16.enabled:
            return {"param_dtype": torch.float16, "reduce_dtype": torch.float32}
        return {}

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        # FSDP2 reads the flag in its post-backward hooks, after the forward's context has closed,
        # so it is set for the whole micro-step: each forward sets it for the backward that follows.
        # Unsynchronised backwards keep the unsharded gradients; the boundary's reduce-scatters them.
        if self.root is not None:
            self.root.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def check_can_save(self, mid_window: bool) -> None:
        if mid_window and self.root is not None:
            raise CheckpointError(
                "cannot save inside a gradient accumulation window with the fsdp backend",
                "FSDP2 keeps the window's unsharded gradients inside its parameter groups, where "
                "no checkpoint can reach them, so the resumed run would differ",
                "save after engine.step() on an accumulation boundary "
                "(engine.is_gradient_accumulation_boundary() before the step)",
            )

    def clip_grad_norm_(self, parameters: Iterator[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def live_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards: its counterpart in a healing group holds the same ones."""
        return {"model": _local(module.state_dict()), "optimizer": _local(optimizer.state_dict())}

    def load_live_state(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """The counterpart rank's shards, copied into this rank's own; its optimizer state's local
        shards made DTensors again, laid out as this rank's parameters (the optimizer may not have
        stepped yet: it has no state to copy into)."""
        own = module.state_dict()
        with torch.no_grad():
            for key, value in state["model"].items():
                target = own[key]
                (target.to_local() if isinstance(target, DTensor) else target).copy_(value)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's order
        for index, entry in state["optimizer"]["state"].items():
            parameter = parameters[index]
            if not isinstance(parameter, DTensor):
                continue
            for key, value in entry.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim()
                    and value.shape == parameter.to_local().shape
                ):
                    entry[key] = DTensor.from_local(value, parameter.device_mesh, parameter.placements,
                                                    run_check=False, shape=parameter.shape, stride=parameter.stride())  # fmt: skip
        optimizer.load_state_dict(state["optimizer"])

    def teardown(self) -> None:
        root, self.root = self.root, None
        owned = self._owns_group
        super().teardown()
        if isinstance(root, torch.nn.Module) and owned:
            _release_process_group(root)


def _own_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children that get an FSDP unit of their own: those with parameters that no other child,
    and not the model itself, holds too. A parameter may belong to one unit only, so children that
    share one (tied weights: an embedding and an output layer) stay in the model's own unit."""
    holders: dict[int, set[int]] = {id(p): {-1} for p in model.parameters(recurse=False)}
    children = list(model.children())
    for index, child in enumerate(children):
        for parameter in child.parameters():
            holders.setdefault(id(parameter), set()).add(index)
    shared = {index for owners in holders.values() if len(owners) > 1 for index in owners}
    return [
        child
        for index, child in enumerate(children)
        if index not in shared and any(True for _ in child.parameters())
    ]


def _release_process_group(root: torch.nn.Module) -> None:
    """Drop FSDP2's references to the process group that was just destroyed.

    The user's model stays an FSDP module after ``close()``, and FSDP2 keeps the gloo group alive
    through its mesh infos and every DeviceMesh's group registry (DTensor's sharding caches keep the
    meshes alive even after the model is gone). gloo's threads then live into interpreter shutdown,
    where joining them can crash the process (SIGSEGV / SIGABRT at exit), as DDP's did before its
    module was dropped. These are torch's private attributes, read with getattr: under another torch
    version this does less, never more.
    """
    meshes: dict[int, Any] = {}
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
            if info is None:
                continue
            meshes[id(info.mesh)] = info.mesh
            for name in ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group"):
                if hasattr(info, name):
                    setattr(info, name, None)
    for parameter in root.parameters():
        mesh = getattr(parameter, "device_mesh", None)
        if mesh is not None:
            meshes[id(mesh)] = mesh
    for mesh in meshes.values():
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def _local(tree: Any) -> Any:
    """``tree`` (a state dict, nested) with every DTensor replaced by its local shard."""
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_local(value) for value in tree)
    return tree.to_local() if isinstance(tree, DTensor) else tree

"""How each global micro-batch is split among the ranks, and what a rank's loss weighs in the step.

One object per engine, chosen once: equal shares (the default), shares by weight or measured
(``sail.balance``), or the groups taking part in a step (replica groups, ``--ft-replicas``). It hands
the training loader its shares or its sampler, learns which loader is the training one, and weighs
each loss by the share of the step its batch was (``loss_weight``): with unequal shares, and on an
epoch's short final step, the mean over the global batch is then what a single process would take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from spikingsail.backends.base import Backend
from spikingsail.backends.process_group import rank_hosts
from spikingsail.checkpoint.checkpointer import refuse_inside_window
from spikingsail.config.parse import check_balance_weights
from spikingsail.config.schema import SailConfig
from spikingsail.data.loader import ShardedLoader
from spikingsail.data.sampler import ReplicaBatchSampler
from spikingsail.engine.balance import Balancer, loss_weight
from spikingsail.engine.hooks import StepNotes
from spikingsail.engine.replicas import ReplicaEnv, ReplicaGroups
from spikingsail.engine.state import StepCounters
from spikingsail.engine.timing import ComputeTimer
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError

log = logging.getLogger(__name__)


class EqualSplit:
    """Every rank an equal share. Losses weigh 1, until a training loader's epochs end with a short
    step: then each loss weighs its batch's share of the step."""

    weighs = False
    """Whether ``backward`` weighs losses (``weigh``): read at every backward."""
    balancer: Balancer | None = None
    replicas: ReplicaGroups | None = None

    def __init__(self, config: SailConfig, counters: StepCounters, ranks: int) -> None:
        """``ranks``: the data-parallel replicas of the job's processes (``Backend.data_parallel``;
        of one replica group's, with replica groups)."""
        self.config, self.counters, self.ranks = config, counters, ranks
        self.loader: ShardedLoader | None = None

    def shares(self) -> Callable[[], list[int]] | None:
        """What gives a training loader its share of every global micro-batch (None: equal)."""
        return None

    def sampler(self, dataset: Dataset[Any], shuffle: bool, seed: int, drop_last: bool,
                loader_kwargs: dict[str, Any]) -> ReplicaBatchSampler | None:  # fmt: skip
        """The training loader's sampler, where the split makes it (None: the loader's own)."""
        return None

    def loader_made(self, loader: ShardedLoader) -> None:
        """``loader`` is the training loader (the last one made): its batches' shares weigh the losses."""
        self.loader = loader
        self.weighs = self.weighs or loader.weighs_losses

    def _share(self) -> tuple[int, int] | None:
        return self.loader.share if self.loader is not None else None

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        share = self._share()
        if share is None:  # a loss from elsewhere than the loader with the short step weighs 1
            return loss
        return loss * loss_weight(*share, self.ranks, self.counters.accumulation)

    def join(self) -> None:
        """Where the split has peers outside the job's process group: take part in their first step."""

    def close(self) -> None:
        pass


class BalancedSplit(EqualSplit):
    """``sail.balance`` with weights: each rank's share of every global micro-batch follows its
    weight; each loss weighs its share."""

    weighs = True

    def __init__(self, config: SailConfig, counters: StepCounters, balancer: Balancer) -> None:
        super().__init__(config, counters, balancer.world_size)
        self.balancer = balancer

    def shares(self) -> Callable[[], list[int]] | None:
        return self.balancer.shares if self.balancer is not None else None

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        share = self._share()
        if share is None:
            raise ConfigError(
                f"{self.config.source}: sail.balance is {self.config.sail.balance!r}, but this loss does not "
                "come from a batch of engine.dataloader(...)",
                "with unequal micro-batches each rank's loss is weighted by its share of the global "
                "micro-batch, which only the engine's loader knows",
                "iterate engine.dataloader(dataset) for training, or turn sail.balance off",
            )
        assert self.balancer is not None
        return loss * self.balancer.loss_weight(*share)

    def close(self) -> None:
        if self.balancer is not None:
            self.balancer.close()


class MeasuredSplit(BalancedSplit):
    """``sail.balance: auto``: the shares follow the ranks' measured speeds. Step hooks: each training
    forward's samples, backward's compute time, and at each optimizer step the measurement."""

    def __init__(
        self, config: SailConfig, counters: StepCounters, balancer: Balancer, model: torch.nn.Module,
        rank: int, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:  # fmt: skip
        super().__init__(config, counters, balancer)
        self.model, self.rank, self._all_reduce_sum = model, rank, all_reduce_sum
        timer = balancer.timer
        assert timer is not None  # auto measures
        self.timer: ComputeTimer = timer

    def forward_begin(self) -> None:
        share = self._share()
        if share is not None and torch.is_grad_enabled() and self.model.training:
            self.timer.samples += share[0]

    def backward_begin(self, _loss: object, _boundary: bool) -> None:
        self.timer.begin_backward()

    def backward_end(self, _boundary: bool) -> None:
        self.timer.end_backward()

    def optimizer_end(self, notes: StepNotes) -> None:
        assert self.balancer is not None
        notes.balance = self.balancer.after_step(notes.step, self._all_reduce_sum, self.rank)


def balanced_split(
    config: SailConfig, counters: StepCounters, model: torch.nn.Module, device: torch.device,
    rank_info: RankInfo, backend: Backend,
) -> EqualSplit:  # fmt: skip
    """The split ``sail.balance`` asks for (equal when off)."""
    balance = config.sail.balance
    if balance == "off":
        return EqualSplit(config, counters, backend.data_parallel.size)
    weights: list[float] | None = None
    if isinstance(balance, tuple):
        weights = list(balance)
    elif isinstance(balance, dict):
        hosts = rank_hosts(rank_info.world_size)
        missing = sorted(set(hosts) - set(balance))
        if missing:
            raise ConfigError(
                f"{config.source}: sail.balance has no weight for host(s) {', '.join(missing)}",
                f"the ranks run on {', '.join(sorted(set(hosts)))}; the map names {', '.join(balance)}",
                'give every host a weight (its GPUs\' relative speed), or use "auto"',
            )
        weights = [balance[host] for host in hosts]
        check_balance_weights(weights, config, hosts)
    balancer = Balancer(
        global_micro_batch=config.train_micro_batch_size_per_gpu * config.world_size,
        world_size=config.world_size,
        weights=weights,
        rebalance_factor=config.sail.rebalance_factor,
        accumulation=config.gradient_accumulation_steps,
    )
    balancer.attach(model, device)
    if rank_info.is_rank_zero:
        log.info("balance %s: micro-batches per rank %s", "auto" if weights is None else "by weight",
                 balancer.split)  # fmt: skip
    if weights is not None:
        return BalancedSplit(config, counters, balancer)
    return MeasuredSplit(config, counters, balancer, model, rank_info.rank, backend.all_reduce_sum)


class ReplicaSplit(EqualSplit):
    """Replica groups (``--ft-replicas``): each step's global batch split among the ranks of the
    groups taking part in it (``engine/replicas.py``); each loss weighs its share. Step hook: the
    groups' vote on committing a step."""

    weighs = True

    def __init__(
        self, config: SailConfig, counters: StepCounters, env: ReplicaEnv, rank_info: RankInfo,
        device: torch.device, module: torch.nn.Module, optimizer: torch.optim.Optimizer, backend: Backend,
        engine_state: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]],
    ) -> None:  # fmt: skip
        """``engine_state``: the engine's ``state_dict`` and ``load_state_dict`` (what a healing group
        takes besides the model and optimizer)."""
        super().__init__(config, counters, rank_info.world_size)
        self.module, self.optimizer, self.backend = module, optimizer, backend
        self._engine_state = engine_state
        if config.checkpoint.path is None and rank_info.is_rank_zero:
            log.warning("replica group %d has no checkpoint path: if it restarts while no other group is "
                        "alive it starts from step 0 (pass --resume --checkpoints-path DIR)", env.group)  # fmt: skip
        self.replicas = ReplicaGroups(
            config.fault_tolerance, env, rank_info, device, (self._live_state, self._load_live_state),
            self._replicated_tensors,
        )  # fmt: skip

    def join(self) -> None:
        """Take the first quorum: a group behind the others heals here and takes part in their step."""
        assert self.replicas is not None
        refuse_inside_window(self.counters, "resume")
        self.replicas.begin_step()
        if self.counters.global_steps:
            log.info(
                "replica group %d in the job at step %d", self.replicas.env.group, self.counters.global_steps
            )

    def vote(self) -> bool:
        assert self.replicas is not None
        return self.replicas.reduce_and_vote(
            p for group in self.optimizer.param_groups for p in group["params"]
        )

    def optimizer_end(self, notes: StepNotes) -> None:
        """Which quorum committed the step, when it held more than this group (the sample ledger
        counts its groups' samples together; the id names the members too, ``QuorumIds``). A group
        alone in its quorum took the whole step with its own ranks, as a job without replica groups
        does, and two groups apart may each take the same step so: it names none."""
        notes.quorum = self.quorum()

    def quorum(self) -> int | None:
        """The step's torchft quorum id, when other groups are in it (None when this group is alone)."""
        assert self.replicas is not None
        manager = self.replicas.manager
        return manager._quorum_id if manager.num_participants() > 1 else None  # no public name

    def sampler(self, dataset: Dataset[Any], shuffle: bool, seed: int, drop_last: bool,
                loader_kwargs: dict[str, Any]) -> ReplicaBatchSampler | None:  # fmt: skip
        if loader_kwargs.get("num_workers", 0):
            raise ConfigError(
                f"engine.dataloader(num_workers={loader_kwargs['num_workers']}) in a job of replica groups "
                "(sail launch --ft-replicas)",
                "each batch follows the step's quorum and whether the last step committed; "
                "worker processes would take batches ahead of both",
                "leave num_workers at 0 for the training loader (an evaluation loader, pad=False, may use workers)",
            )
        assert self.replicas is not None
        counters, accumulation = self.counters, self.counters.accumulation
        return ReplicaBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            micro_samples=self.config.train_micro_batch_size_per_gpu * self.config.world_size,
            accumulation=accumulation,
            ranks=self.config.world_size,
            split=self.replicas.split,
            progress=lambda: (counters.global_steps, counters.micro_steps % accumulation),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """n × accumulation × this rank's samples / the step's: DDP averages over the group's n ranks and
        the groups' gradients are summed, so the step's gradient is the mean over the global batch."""
        share = self._share()
        if share is None:
            raise ConfigError(
                "the job runs as replica groups (sail launch --ft-replicas), but this loss does not "
                "come from a batch of engine.dataloader(...)",
                "while a group is missing the others take its share of every step, which only the "
                "engine's loader knows",
                "iterate engine.dataloader(dataset) for training",
            )
        return loss * loss_weight(*share, self.ranks, self.counters.accumulation)

    def _live_state(self) -> dict[str, Any]:
        """What a healing replica group takes from this one (the backend's parts, and the engine's)."""
        return {**self.backend.live_state(self.module, self.optimizer), "engine": self._engine_state[0]()}

    def _replicated_tensors(self) -> Iterator[torch.Tensor]:
        """What every replica group must hold bit for bit at the same step: the model's state and the
        optimizer's."""
        yield from self.module.state_dict().values()
        for state in self.optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))

    def _load_live_state(self, state: dict[str, Any]) -> None:
        self.backend.load_live_state(self.module, self.optimizer, state)
        self._engine_state[1](state["engine"])

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()

"""How replica groups reach each other (``sail launch --ft-replicas``): on one address, and with a
heal that neither unpickles nor trusts what the network sends.

torchft 0.2.0 as it comes listens on every interface and heals by unpickling: its manager's gRPC
server binds ``[::]`` (``Manager.__init__`` hard-codes it), its default checkpoint transport serves
the state over HTTP on ``[::]`` and the healing group loads it with ``weights_only=False`` from
whatever address the quorum names, and its process-group transport (``PGTransport``) unpickles the
state's metadata. Here:

- the manager's server binds the address the groups reach it at (``ManagerBinding``): loopback when
  the groups share one machine, the node's address towards the lighthouse across nodes;
- the groups' gloo process group listens on that same address (``BoundGloo``), not on whatever the
  host name resolves to;
- a group heals over that process group (``SignedStateTransport``): no HTTP server at all; the live
  group sends its state as ``torch.save`` bytes with an HMAC-SHA256 under the job's secret over the
  healing rank's fresh nonce, and the healing rank checks the MAC before it reads a byte of the
  state, then reads it with ``weights_only=True`` (tensors and plain data: nothing runs). The live
  group sends only to a rank that proves it holds the secret too;
- a quorum's id names its members as well as the lighthouse's count (``QuorumIds``): a lighthouse
  started again counts its quorums from 1 again, and torchft builds a new process group only when
  the id changes, so a group whose last quorum had the same number kept the old group's connections
  (world size, peers) for the new members: a heal over them crashed the process (SIGSEGV in gloo).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import logging
import secrets
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroup, ProcessGroupGloo

from spikingsail.errors import SailError

log = logging.getLogger(__name__)

_NONCE = 32
_MAC = 32
_ASK, _ANSWER = b"sail-heal-ask", b"sail-heal-state"
# message tags of a heal between two ranks of the groups' process group (nothing else sends there)
_TAG_ASK, _TAG_LENGTH, _TAG_MAC, _TAG_STATE = 1, 2, 3, 4


class HealRefusedError(SailError):
    """A heal's message did not come from the job (bad MAC) or did not hold plain state."""


def _mac(secret: bytes, context: bytes, nonce: bytes, step: int, body: bytes = b"") -> bytes:
    return hmac.new(
        secret, context + nonce + step.to_bytes(8, "big", signed=True) + body, hashlib.sha256
    ).digest()


class SignedStateTransport(CheckpointTransport[Any]):  # type: ignore[misc]  # torchft: untyped
    """torchft's checkpoint transport over the groups' own process group, authenticated by the job's
    secret and read weights-only (see the module's docstring)."""

    def __init__(self, pg: ProcessGroup, secret: bytes, device: torch.device) -> None:
        self._pg, self._secret, self._device = pg, secret, device  # NCCL sends only the GPU's tensors
        self.send_error: Exception | None = None

    def _recv(self, size: int, dtype: torch.dtype, src: int, tag: int, timeout: timedelta) -> torch.Tensor:
        tensor = torch.empty(size, dtype=dtype, device=self._device)
        self._pg.recv([tensor], src, tag=tag).wait(timeout)
        return tensor.cpu()

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: timedelta) -> None:
        self._pg.send([tensor.to(self._device)], dst, tag=tag).wait(timeout)

    def metadata(self) -> str:
        return "sail-pg"  # nothing to look up: the state travels over the process group

    def disallow_checkpoint(self) -> None:
        pass

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Send ``state_dict`` to each healing rank in turn; a failure is kept in ``send_error``: it
        fails this step, but the state sent from is this rank's own, unchanged."""
        self.send_error = None
        try:
            self._send_state(dst_ranks, step, state_dict, timeout)
        except Exception as err:
            self.send_error = err
            raise

    def _send_state(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        body = buffer.getvalue()
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        for dst in dst_ranks:
            ask = self._recv(_NONCE + _MAC, torch.uint8, dst, _TAG_ASK, timeout)
            nonce, mac = bytes(ask[:_NONCE].tolist()), bytes(ask[_NONCE:].tolist())
            if not hmac.compare_digest(mac, _mac(self._secret, _ASK, nonce, step)):
                raise HealRefusedError(
                    f"replica rank {dst} asked for this group's state at step {step} without the job's secret",
                    "only a group of this job may take its state",
                    "nothing to do if no such group exists (something else reached the job's process group)",
                )
            signature = torch.tensor(list(_mac(self._secret, _ANSWER, nonce, step, body)), dtype=torch.uint8)
            length = torch.tensor([len(body)], dtype=torch.int64)
            for tensor, tag in ((length, _TAG_LENGTH), (signature, _TAG_MAC), (payload, _TAG_STATE)):
                self._send(tensor, dst, tag, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        nonce = secrets.token_bytes(_NONCE)
        ask = torch.tensor(list(nonce + _mac(self._secret, _ASK, nonce, step)), dtype=torch.uint8)
        self._send(ask, src_rank, _TAG_ASK, timeout)
        size = int(self._recv(1, torch.int64, src_rank, _TAG_LENGTH, timeout).item())
        if size <= 0:
            raise HealRefusedError(f"replica rank {src_rank} announced a state of {size} bytes",
                                   "a state is a torch.save file", "nothing to do: the step is taken again")  # fmt: skip
        signature = bytes(self._recv(_MAC, torch.uint8, src_rank, _TAG_MAC, timeout).tolist())
        body = self._recv(size, torch.uint8, src_rank, _TAG_STATE, timeout).numpy().tobytes()
        return read_state(self._secret, nonce, step, signature, body, src_rank)


def read_state(secret: bytes, nonce: bytes, step: int, signature: bytes, body: bytes, source: int) -> Any:
    """The state in ``body`` once its MAC checks out, read with ``weights_only=True``; else refused."""
    if not hmac.compare_digest(signature, _mac(secret, _ANSWER, nonce, step, body)):
        log.error("refused a replica group's state from replica rank %d: its MAC does not check out", source)
        raise HealRefusedError(
            f"the state sent by replica rank {source} at step {step} is not signed with the job's secret",
            "a healing group loads only a state that a group of this job sent",
            "nothing to do if the job's groups all run; the heal is tried again at the next quorum",
        )
    try:
        return torch.load(io.BytesIO(body), map_location=None, weights_only=True)
    except Exception as err:  # torch raises several types for data that is not plain state
        lines = str(err).splitlines() or [type(err).__name__]
        reason = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[0])
        log.error("refused a replica group's state from replica rank %d: %s", source, reason)
        raise HealRefusedError(
            f"the state sent by replica rank {source} at step {step} is not tensors and plain data",
            f"a heal is read with weights_only=True ({reason})",
            "keep the engine's and the script's state to tensors, numbers, strings and containers of them",
        ) from None


class BoundGloo(ProcessGroupGloo):  # type: ignore[misc]  # torchft: untyped
    """torchft's reconfigurable gloo group, its connections listening on ``address`` only (torch's
    default device listens on the address the host name resolves to)."""

    def __init__(self, address: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._address = address

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        from torch.distributed import ProcessGroup as BaseProcessGroup
        from torch.distributed import ProcessGroupGloo as BaseGloo

        options = BaseGloo._Options()  # type: ignore[attr-defined]  # no stub for torch's own options
        options._devices = [BaseGloo.create_device(hostname=self._address)]
        options._threads = 2  # torch's default: twice the devices
        options._timeout = self._timeout
        backend = BaseGloo(store, rank, world_size, options)
        if self._global_ranks:  # as torchft 0.2.0's own _create_pg
            backend.options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            name = f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
            backend.options.group_name = name  # type: ignore[assignment]  # a GroupName is a str
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda"):
            if device == "cpu" or torch.cuda.is_available():
                pg._register_backend(torch.device(device), BaseProcessGroup.BackendType.GLOO, backend)
        return pg


class QuorumIds:
    """torchft's ``ManagerClient``, but each quorum it returns carries an id taken from the
    lighthouse's and its members' replica ids (with their per-process uuids), the same in every
    member: a process group is built anew for new members even when a lighthouse started again
    reuses the number, and its store keys are not an earlier quorum's."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.lighthouse_id: int | None = None
        """The lighthouse's number of the last quorum."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.lighthouse_id = result.quorum_id
        return _Quorum(result)


class _Quorum:
    """A ``QuorumResult`` whose ``quorum_id`` is the lighthouse's number and its members together."""

    def __init__(self, result: Any) -> None:
        self._result = result
        members = repr((result.quorum_id, list(result.replica_ids))).encode()
        self.quorum_id = int.from_bytes(hashlib.blake2b(members, digest_size=8).digest(), "big") >> 2

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


@contextlib.contextmanager
def manager_bound_to(address: str) -> Iterator[None]:
    """While torchft's ``Manager`` is made: its gRPC server binds ``address`` (the port torchft
    chooses), not ``[::]``."""
    import torchft.manager as torchft_manager

    server = torchft_manager.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[1]
        return server(**{**kwargs, "bind": f"{address}:{port}"})

    torchft_manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft_manager.ManagerServer = server

"""The swarm side of the vLLM backend: a follow-only swarm member on its own thread.

:class:`SwarmMember` runs a :class:`~swarm.roles.peer.RolloutPeer` (with ``work=False``:
it claims no leases) on an asyncio loop in a thread of the vLLM worker process. The peer
fetches, patches and verifies each version against the trainer's signed root, as any
rollout peer does, while vLLM keeps serving. Its "engine" is a :class:`StagingEngine`:
instead of writing into the model, it keeps a copy of the tensors each verified version
changed (:class:`StagedVersions`). vLLM's ``update_weights`` later takes a staged version
and writes it into the model on vLLM's own thread (:mod:`swarm.integrations.vllm.backend`).

Memory: the canonical state (one copy of the model, in the run's dtype), plus the changed
tensors of each staged version (at most ``max_staged`` entries; older ones are folded into
the next, which makes their own version unavailable but keeps later ones applicable).

This module imports no vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swarm.engines import Completion, EngineUpdateError, Sampling
from swarm.engines.tensors import digest_of
from swarm.errors import LocalProtocolError, NodeFailed
from swarm.integrations._thread import NodeThread
from swarm.roles.peer import PeerConfig, RolloutPeer

if TYPE_CHECKING:
    from swarm.content.card import RunCard
    from swarm.content.manifest import SignedManifest

log = logging.getLogger(__name__)


class VersionUnavailable(EngineUpdateError):
    """``update_weights`` named a version this member cannot apply (nothing was written)."""


@dataclass(frozen=True, slots=True)
class MemberConfig:
    """How the backend joins a run (the ``init_info`` of ``init_weight_transfer_engine``)."""

    bootstrap: tuple[str, ...]
    """Full multiaddrs (with ``/p2p/<id>``) of the trainer or bootstrap nodes."""
    trainer: str
    """The trainer's peer id: only versions signed by its key are taken."""
    run: str
    data_dir: Path
    """The member's key (``node.key``), the run card, the last verified state and chunks."""
    listen: str = "/ip4/127.0.0.1/tcp/0"
    """libp2p listen multiaddr of the member (other peers fetch chunks from it)."""
    max_staged: int = 4
    """Verified versions kept ready for ``update_weights``."""
    card_timeout: float = 120.0
    """Seconds to wait for the run card at start."""

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ValueError("bootstrap: at least one multiaddr of the trainer or a bootstrap node")
        if self.max_staged < 1:
            raise ValueError("max_staged must be at least 1")
        if not self.card_timeout > 0:
            raise ValueError("card_timeout must be positive")


@dataclass(slots=True)
class _Entry:
    version: int
    root: bytes
    tensors: dict[str, torch.Tensor]
    """Values at ``version`` of every tensor changed since the entry before it."""
    digests: dict[str, bytes]
    """Per-tensor digests of the whole verified state at ``version``."""
    first: int
    """The oldest version folded into this entry (``version`` when none was)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What writing ``version`` into the model takes."""

    version: int
    root: bytes
    tensors: dict[str, torch.Tensor]
    expected: dict[str, bytes]
    """Digest each written tensor must have afterwards (the verified state's)."""
    digests: dict[str, bytes]
    """The verified state's digests at ``version``, every tensor."""


@dataclass(slots=True)
class StagedVersions:
    """Verified versions waiting for ``update_weights``, and what the model holds. Thread-safe."""

    max_staged: int = 4
    model_version: int = -1
    """The version the model holds (-1: weights that are no version of the run)."""
    model_root: bytes | None = None
    model_digests: dict[str, bytes] = field(default_factory=dict)
    _entries: list[_Entry] = field(default_factory=list)
    _head_digests: dict[str, bytes] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self, version: int, root: bytes | None, digests: Mapping[str, bytes]) -> None:
        """The model (and the canonical state) holds ``version`` (-1: none) with these
        per-tensor digests."""
        with self._cond:
            self.model_version, self.model_root = version, root
            self.model_digests = dict(digests)
            self._head_digests = dict(digests)
            self._entries.clear()

    def stage(self, version: int, root: bytes, tensors: Mapping[str, torch.Tensor]) -> None:
        """A verified version: ``tensors`` (copies, owned from now on) are those it changed."""
        digests = {name: digest_of(t) for name, t in tensors.items()}
        with self._cond:
            head = dict(self._head_digests)
            head.update(digests)
            self._head_digests = head
            self._entries.append(_Entry(version, root, dict(tensors), head, version))
            while len(self._entries) > self.max_staged:
                old, nxt = self._entries[0], self._entries[1]
                nxt.tensors = {**old.tensors, **nxt.tensors}
                nxt.first = old.first
                del self._entries[0]
            self._cond.notify_all()

    def staged(self) -> list[int]:
        with self._cond:
            return [e.version for e in self._entries]

    def wait(self, version: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``version`` (or a later one) to be staged."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(e.version >= version for e in self._entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def plan(self, version: int, root: bytes | None = None) -> Plan:
        """The writes that take the model from its version to ``version``.

        :raises VersionUnavailable: a version at or behind the model's (wrong base), not
            verified (yet), folded into a later staged version, or whose root is not
            ``root`` (root mismatch).
        """
        with self._cond:
            held = self.model_version
            if version <= held:
                raise VersionUnavailable(
                    f"wrong base: the model holds version {held}; version {version} is not "
                    "ahead of it")
            chain = [e for e in self._entries if e.version <= version]
            if not chain or chain[-1].version != version:
                folded = next((e for e in self._entries if e.first <= version < e.version),
                              None)
                if folded is not None:
                    raise VersionUnavailable(
                        f"version {version} was folded into staged version {folded.version} "
                        f"(at most {self.max_staged} are kept apart): apply that one")
                raise VersionUnavailable(
                    f"unknown version {version}: not verified by this member (staged: "
                    f"{[e.version for e in self._entries] or 'none'}; the model holds "
                    f"{held})")
            target = chain[-1]
            if root is not None and root != target.root:
                raise VersionUnavailable(
                    f"root mismatch: version {version} was verified with root "
                    f"{target.root.hex()[:16]}, the update names {root.hex()[:16]}")
            tensors: dict[str, torch.Tensor] = {}
            for e in chain:
                tensors.update(e.tensors)
            if held < 0 and set(tensors) != set(target.digests):
                raise VersionUnavailable(
                    f"wrong base: the model holds no version of the run and version "
                    f"{version} changes only {len(tensors)} of {len(target.digests)} tensors")
            expected = {name: target.digests[name] for name in tensors}
            return Plan(version, target.root, tensors, expected, dict(target.digests))

    def applied(self, plan: Plan) -> None:
        """``plan`` was written and checked: the model holds its version."""
        with self._cond:
            self.model_version, self.model_root = plan.version, plan.root
            self.model_digests = dict(plan.digests)
            self._entries = [e for e in self._entries if e.version > plan.version]


class StagingEngine:
    """The member's engine: keeps each verified version's changed tensors for later."""

    kind = "vllm"

    def __init__(self, staged: StagedVersions, names: Sequence[str]) -> None:
        self._staged = staged
        self._names = list(names)
        self.label: tuple[int, bytes] | None = None
        """The version the next ``apply`` carries (set by the peer before each install)."""
        self._pending: dict[str, torch.Tensor] | None = None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        raise LocalProtocolError("the swarm weight-transfer backend runs no leased work")

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        copies = {name: t.detach().clone() for name, t in update.items()}
        label, self.label = self.label, None
        if label is None:  # a state restored from disk: labelled once the peer knows it
            self._pending = copies
            return
        self._staged.stage(label[0], label[1], copies)

    def label_pending(self, version: int, root: bytes) -> None:
        if self._pending is not None:
            self._staged.stage(version, root, self._pending)
            self._pending = None

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise EngineUpdateError("the staging engine takes whole tensors only")

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def tensor_digests(self, names: Iterable[str] | None = None) -> dict[str, bytes]:
        return {}

    def close(self) -> None:
        return None


class _BackendPeer(RolloutPeer):
    """A rollout peer whose engine learns which version each install carries."""

    def __init__(self, *args: Any, staging: StagingEngine, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staging = staging

    async def _resume(self) -> None:
        self._staging.label = None
        await super()._resume()
        if self.resumed_version >= 0 and self.root is not None:
            self._staging.label_pending(self.version, self.root)

    async def _take_version(self, sm: SignedManifest, root: bytes, changed: frozenset[str]
                            ) -> tuple[frozenset[str], float]:
        self._staging.label = (sm.manifest.step, root)
        return await super()._take_version(sm, root, changed)


#: Builds the canonical state from the run's card (on the member's thread, while the
#: vLLM thread waits in ``init_transfer_engine``).
StateBuilder = Callable[["RunCard"], dict[str, torch.Tensor]]


class SwarmMember(NodeThread):
    """A follow-only swarm member on its own thread and event loop."""

    def __init__(self, config: MemberConfig, build_state: StateBuilder) -> None:
        super().__init__("swarm-member")
        self.config = config
        self.staged = StagedVersions(max_staged=config.max_staged)
        self._build_state = build_state
        self.peer: RolloutPeer | None = None
        self.peer_id = ""
        self.card: RunCard | None = None

    def start(self) -> None:
        """Join the run: returns once the card came and the peer runs.

        :raises SwarmError: no card within ``card_timeout``, a model of another layout,
            or the node could not start.
        """
        self._launch(self.config.card_timeout + 60.0, join=10.0)
        if self.peer is None:
            self.stop()
            raise LocalProtocolError("the swarm member did not start in time")

    def failure(self) -> BaseException | None:
        """Why the member stopped, if it did."""
        if self._error is not None:
            return self._error
        peer = self.peer
        return None if peer is None else peer.failure

    def status(self) -> dict[str, Any]:
        peer = self.peer
        return {
            "peer_id": self.peer_id,
            "verified": -1 if peer is None else peer.version,
            "model_version": self.staged.model_version,
            "staged": self.staged.staged(),
            "failure": None if self.failure() is None else str(self.failure()),
        }

    def stop(self) -> None:
        """Leave the run (idempotent)."""
        self._halt(30.0)

    async def _main(self) -> None:
        from swarm.cli._card import obtain_card
        from swarm.delta.state import state_root_of
        from swarm.identity import Identity
        from swarm.net.node import Libp2pNode, NodeConfig

        cfg = self.config
        stop = self._bind()
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(cfg.data_dir / "node.key")
        self.peer_id = identity.peer_id
        node_cfg = NodeConfig(listen=cfg.listen, bootstrap=cfg.bootstrap, run=cfg.run)
        async with Libp2pNode(identity, node_cfg) as node:
            signed = await obtain_card(
                node, trainer_id=cfg.trainer, run=cfg.run, data_dir=cfg.data_dir,
                timeout=cfg.card_timeout, say=log.info, warn_after=10.0,
                warn=lambda line, here, signers: log.warning("%s", line))
            card = self.card = signed.card
            node.serve_card(signed.encode())
            state = await asyncio.to_thread(self._build_state, card)
            root = await asyncio.to_thread(state_root_of, state, card.piece_size)
            start = (0, root) if root == card.root else None
            digests = {name: digest_of(t) for name, t in state.items()}
            self.staged.start(0 if start else -1, root if start else None, digests)
            staging = StagingEngine(self.staged, list(state))
            peer = _BackendPeer(
                identity, node,
                PeerConfig(run=cfg.run, trainer=cfg.trainer, data_dir=cfg.data_dir,
                           bootstrap=cfg.bootstrap, work=False),
                state, staging, status=_log_status, start=start, staging=staging)
            async with peer:
                self.peer = peer
                self._ready.set()
                log.info("swarm member %s follows run %r (the model holds version %d)",
                         identity.peer_id, cfg.run, self.staged.model_version)
                try:
                    await peer.wait(stop.wait())  # until stopped, or the peer fails
                except NodeFailed as exc:
                    log.error("swarm member stopped: %s", exc)


def _log_status(event: str, fields: dict[str, object]) -> None:
    log.debug("swarm member: %s %s", event, fields)

"""The run card on the command line: a peer gets it (from its data dir, the trainer, or a
neighbour that holds it) before it builds anything; a trainer makes it once and keeps it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.content.card import MAX_CARD_BYTES, SignedCard
from swarm.errors import SignatureError, SwarmError
from swarm.identity import public_key_from_peer_id
from swarm.net.topics import OtherSigners
from swarm.net.transport import PeerUnreachable

if TYPE_CHECKING:
    from swarm.net.node import Libp2pNode

log = logging.getLogger(__name__)
CARD_FILE = "run.card"


class NoCard(SwarmError):
    """No valid run card came within the time allowed."""


def load_card(data_dir: Path | None, *, trainer: bytes, run: str) -> SignedCard | None:
    """The card kept in ``data_dir`` (``None``: none, or one that fails its checks)."""
    path = None if data_dir is None else data_dir / CARD_FILE
    if path is None or not path.is_file():
        return None
    try:
        return SignedCard.decode(path.read_bytes(), trusted_signer=trainer, run=run)
    except (SwarmError, OSError) as exc:
        log.warning("ignoring the run card in %s: %s", path, exc)
        return None


def keep_card(data_dir: Path | None, card: SignedCard) -> None:
    from swarm.roles.persist import write_atomic

    if data_dir is not None:
        write_atomic(data_dir / CARD_FILE, [card.encode()])


async def obtain_card(net: Libp2pNode, *, trainer_id: str, run: str, data_dir: Path | None,
                      timeout: float, say: Callable[[str], None],
                      warn: Callable[[str, bool, list[str]], None], warn_after: float
                      ) -> SignedCard:
    """The run's card, signed by ``trainer_id``: kept in ``data_dir``, else asked of the
    trainer and of connected neighbours until one answers with a valid card. ``warn``
    gets one line, whether the trainer is connected and the other trainers whose valid
    cards neighbours served (a wrong ``--trainer``?) once none came within ``warn_after``
    seconds. A valid card of another trainer is noted, not held against who served it.

    :raises NoCard: none within ``timeout`` seconds.
    """
    trainer = public_key_from_peer_id(trainer_id)
    kept = load_card(data_dir, trainer=trainer, run=run)
    if kept is not None:
        return kept
    start = time.monotonic()
    said = start
    warned = False
    tried: dict[str, str] = {}
    others = OtherSigners()
    attempt = 0
    while True:  # until a card, or the timeout
        await _dial_trainer(net, trainer_id)
        peers = sorted(net.connected_peers(), key=lambda p: p != trainer_id)
        for peer in peers:
            try:
                data = await net.fetch_card(peer, MAX_CARD_BYTES, timeout=10.0)
                if not data:
                    tried[peer] = "holds no card"
                    continue
                card = SignedCard.decode(data, trusted_signer=trainer, run=run)
            except PeerUnreachable as exc:
                tried[peer] = str(exc)
                continue
            except SignatureError as exc:
                other = _other_signer(data, trainer)
                if other is not None:
                    others.add(other)
                    tried[peer] = f"serves the card of trainer {other}"
                else:
                    tried[peer] = f"sent a bad card: {exc}"
                    net.penalize(peer, f"bad run card: {exc}")
                continue
            except SwarmError as exc:
                tried[peer] = f"sent a bad card: {exc}"
                net.penalize(peer, f"bad run card: {exc}")
                continue
            keep_card(data_dir, card)
            return card
        now = time.monotonic()
        if now - start >= timeout:
            why = "; ".join(f"{p[-8:]}: {r}" for p, r in tried.items()) or \
                "no peer connected"
            raise NoCard(f"no run card from trainer {trainer_id} within {timeout:g} s "
                         f"({attempt + 1} tries; {why}); check --trainer and --bootstrap")
        if not warned and now - start >= warn_after:
            warned = True
            here = trainer_id in net.connected_peers()
            if here:
                why = ("it is connected but serves no run card: is --trainer the id of "
                       "a bootstrap node or another peer? It takes the id the trainer "
                       "prints at start")
            else:
                why = (f"it is not connected ({len(net.connected_peers())} other peer(s) "
                       "are): check that --trainer is the id the trainer prints at start, "
                       "and --bootstrap")
            if others.ids:
                why += (f"; saw run cards signed by {', '.join(others.ids)} (pass the "
                        "trainer's as --trainer)")
            warn(f"no run card from trainer {trainer_id} within {warn_after:.0f} s; {why}",
                 here, others.ids)
        elif now - said >= 10:
            said = now
            say(f"waiting for the run card from trainer {trainer_id} ({now - start:.0f} s)")
        await asyncio.sleep(min(1.0, 0.1 * 2 ** min(attempt, 4)))
        attempt += 1


def _other_signer(data: bytes, trainer: bytes) -> str | None:
    """The peer id of who signed card ``data``, if that is not ``trainer`` and its
    signature verifies."""
    try:
        card = SignedCard.decode(data)
    except SwarmError:
        return None
    return None if card.card.signer == trainer else card.card.signer_peer_id


async def _dial_trainer(net: Libp2pNode, trainer_id: str) -> None:
    """Dial the trainer at the addresses the run's peer directory lists for it."""
    if trainer_id in net.connected_peers():
        return
    meta = net.directory().get(trainer_id)
    for addr in () if meta is None else meta.addrs:
        try:
            await net.connect(addr)
            return
        except SwarmError as exc:
            log.debug("dial %s at %s: %s", trainer_id, addr, exc)

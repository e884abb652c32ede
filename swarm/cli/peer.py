"""``swarm peer``: join a swarm as a rollout peer, for whatever model the run names.

Joins through a bootstrap multiaddr and gets the run's card (signed by the trainer) from
the trainer or a neighbour; says why before fetching any weights if it cannot run it;
builds the card's model offline (transformers ``from_config``; ``--engine vllm`` writes a
model dir for vLLM). Then it follows the trainer's versions (fetching chunks from the
trainer and from other peers), verifies every version against the trainer's signed
manifest, and does leased rollout work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from swarm.cli._node import (
    UsageError,
    add_node_arguments,
    add_relay_arguments,
    load_identity,
    node_config,
    reporter,
    run_node,
    shaped,
    stop_on_signals,
)
from swarm.engines import CHEAT_STRATEGIES
from swarm.errors import SwarmError
from swarm.net.logs import expect_dial_failures
from swarm.protocol.exchange import ExchangeConfig

if TYPE_CHECKING:
    import torch

    from swarm.content.card import RunCard
    from swarm.engines import RolloutEngine
    from swarm.net.node import Libp2pNode
    from swarm.roles.common import Network
    from swarm.roles.peer import RolloutPeer
    from swarm.roles.status import Reporter


log = logging.getLogger(__name__)


class TrainerGone(SwarmError):
    """The trainer stayed unreachable longer than ``--trainer-timeout``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    add_relay_arguments(p)
    p.add_argument("--bootstrap", required=True, action="append",
                   help="full multiaddr of a bootstrap node or the trainer (repeatable)")
    p.add_argument("--trainer", required=True, metavar="PEER_ID",
                   help="the trainer's peer id: only its signed manifests and leases count")
    p.add_argument("--name", default="peer", help="name shown in status output")
    p.add_argument("--tasks", type=int, default=4, help="tasks asked for per lease")
    p.add_argument("--last-resort", type=float, default=0.25, metavar="SECONDS",
                   help="wait this long for other peers before fetching a chunk from the trainer")
    p.add_argument("--warn-after", type=float, default=30.0, metavar="SECONDS",
                   help="say so when no manifest from the trainer came within this long, "
                        "and repeat this often while the trainer is unreachable")
    p.add_argument("--trainer-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="exit (status 2) once the trainer was unreachable this long; "
                        "status 0 when it finished the run first and this peer holds its "
                        "last version (0: keep trying forever)")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="what generates rollouts: transformers on torch, or vLLM (needs "
                        "the vllm extra)")
    p.add_argument("--base-weights", type=Path, default=None, metavar="DIR",
                   help="an HF safetensors checkpoint you already have: if it is the run's "
                        "version 0, only deltas are fetched")
    p.add_argument("--card-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="give up (status 2) when no run card came within this long")
    p.add_argument("--check-engine", action="store_true",
                   help="after every update (and at start), compare the engine's per-tensor "
                        "digests with the verified state's; a mismatch stops the peer "
                        "(costs one pass over the weights per version)")
    p.add_argument("--corrupt", action="store_true",
                   help="chaos: serve corrupted chunks (other peers must ban this one)")
    p.add_argument("--chaos-liar", action="store_true",
                   help="chaos: announce every chunk and serve none (other peers must time "
                        "this one out and drop it)")
    p.add_argument("--chaos-flood-haves", action="store_true",
                   help="chaos: send every neighbour, twice a second, have summaries of 8 "
                        "made-up objects of 2^18 chunks with every bit set (other peers "
                        "must bound them, score this one and drop it)")
    p.add_argument("--chaos-cheat", choices=CHEAT_STRATEGIES, default=None, metavar="STRATEGY",
                   help="chaos: return completions the trainer's checks must refuse: "
                        f"{', '.join(CHEAT_STRATEGIES)} (--engine torch)")


def exchange_config(args: argparse.Namespace) -> ExchangeConfig:
    """Exchange tuning for this peer's link. A delta of the demo model is a few chunks of
    64 KiB, so waiting the default second before asking the trainer for a chunk no other
    peer has yet would dominate its sync time."""
    rate = args.uplink_mbps * 1e6 / 8 if args.uplink_mbps else 100e6
    return ExchangeConfig(download_rate=max(rate, 1e6), last_resort_delay=args.last_resort)


def run(args: argparse.Namespace) -> int:
    return run_node(_main, args)


async def _main(args: argparse.Namespace) -> int:
    import torch

    from swarm.cli._card import obtain_card
    from swarm.engines.hf_model import card_summary, check_card
    from swarm.net.node import Libp2pNode
    from swarm.roles.peer import PeerConfig, RolloutPeer

    torch.set_num_threads(1)
    if args.engine == "vllm":
        # vLLM logs to stdout by default: keep stdout for this command's lines (and JSON).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    identity = load_identity(args)
    if identity.peer_id == args.trainer:
        key = args.key or args.data_dir / "node.key"
        raise UsageError(f"--trainer is this peer's own id: its key {key} is the trainer's "
                         "(a peer started in the trainer's directory shares its default "
                         "--data-dir); give the peer a --data-dir of its own")
    if args.base_weights is not None and not args.base_weights.is_dir():
        raise UsageError(f"--base-weights {args.base_weights}: not a directory")
    report = reporter(args.name, args)
    net_cfg = node_config(args, bootstrap=tuple(args.bootstrap))
    async with stop_on_signals(), Libp2pNode(identity, net_cfg) as raw, \
            shaped(raw, args) as net:
        seen_as = raw.reach.observed if raw.reach is not None else None
        report.emit("ready", addr=raw.listen_addresses[0], peer_id=identity.peer_id,
                    region=args.region, reachability=raw.reachability, seen_as=seen_as,
                    upload_bps=net_cfg.upload)
        report.say(f"peer {identity.peer_id} listening on {raw.listen_addresses[0]}; "
                   f"following trainer {args.trainer}"
                   + (f"; advertising a {net_cfg.upload * 8 / 1e6:g} Mbit/s uplink"
                      if net_cfg.upload else ""))
        if raw.reachability == "private":
            relayed = raw.traversal.addresses()
            report.say(f"not reachable from outside (the bootstrap sees us as {seen_as} and "
                       "could not dial back): "
                       + (f"advertising a relayed address ({relayed[0]}); " if relayed else
                          "advertising no address (no relay); ")
                       + "public neighbours are reached by dialling out")
        signed = await obtain_card(raw, trainer_id=args.trainer, run=args.run,
                                   data_dir=args.data_dir, timeout=args.card_timeout,
                                   say=report.say, warn_after=max(0.1, args.warn_after),
                                   warn=lambda line, here, signers: _warn(
                                       report, "no_card", line, trainer=args.trainer,
                                       connected=here, signers=signers))
        card = signed.card
        # Before any weights: an architecture this engine lacks, a missing extra, or too
        # little memory is said here, as one error line.
        nbytes = await asyncio.to_thread(check_card, card, args.engine)
        raw.serve_card(signed.encode())  # neighbours may take it from here
        report.emit("card", id=signed.id.hex(), engine=args.engine, bytes=nbytes,
                    **card_summary(card))
        report.say(f"run card {signed.id.hex()[:12]}: {card.model_type}, "
                   f"{nbytes / 1e6:.1f} MB of {card.dtype} weights; engine {args.engine}")
        state, engine, start = await asyncio.to_thread(_build, card, args)
        if args.check_engine:
            engine = await asyncio.to_thread(_checked, engine, state, report)
        # DATA_DIR keeps the last verified version and received chunks: a restarted peer
        # resumes there; the bootstrap addresses are redialled if the trainer goes away.
        peer = RolloutPeer(identity, net, PeerConfig(run=args.run, trainer=args.trainer,
                                                     region=args.region,
                                                     want_tasks=args.tasks,
                                                     data_dir=args.data_dir,
                                                     bootstrap=(*args.bootstrap,
                                                                *_kept_trainer_addrs(args)),
                                                     exchange=exchange_config(args)),
                           state, engine, status=report, start=start)
        async with peer:
            if args.corrupt:
                peer.driver.corrupt_uploads = True
            peer.driver.lie_about_chunks = args.chaos_liar
            if args.chaos_flood_haves:
                peer.driver.flood_haves()
            watch = asyncio.create_task(_watch(peer, net, args, report))
            traversal = asyncio.create_task(_report_traversal(raw, report))
            closed = asyncio.create_task(peer.closed.wait())
            try:
                await asyncio.wait([watch, closed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                closed.cancel()
                traversal.cancel()
            if watch.done() and not watch.cancelled():
                if watch.exception() is not None:
                    raise cast(BaseException, watch.exception())
                return 0  # the run is over and its trainer gone
            if peer.failure is not None:
                raise peer.failure  # printed as one "swarm: error: ..." line
    return 1


def _build(card: RunCard, args: argparse.Namespace
           ) -> tuple[dict[str, torch.Tensor], RolloutEngine, tuple[int, bytes] | None]:
    """The canonical state (the card's seeded initial weights, or ``--base-weights``),
    the engine, and (0, root) when the state is the run's version 0."""

    from swarm.delta.state import state_root_of
    from swarm.demo.model import inference_state
    from swarm.engines.hf_model import (
        build_model,
        check_layout,
        load_base_weights,
        torch_dtype,
    )

    model = build_model(card)
    if args.base_weights is not None:
        load_base_weights(args.base_weights, model)
    state = inference_state(model, card.dtype)
    check_layout(card, state)
    start = None
    if state_root_of(state, card.piece_size) == card.root:
        start = (0, card.root)
    engine: RolloutEngine
    if args.engine == "vllm":
        engine = _vllm_engine(card, state, args)
        del model
    else:
        from swarm.engines.torch_engine import TorchEngine

        engine = TorchEngine(cast(Any, model).to(torch_dtype(card)))
    if args.chaos_cheat is not None:
        from swarm.engines.cheater import CheatingEngine

        vocab = int(json.loads(card.config).get("vocab_size", 0)) or 1
        engine = CheatingEngine(engine, args.chaos_cheat, vocab_size=vocab)
    return state, engine, start


def _checked(engine: RolloutEngine, state: dict[str, torch.Tensor], report: Reporter
             ) -> RolloutEngine:
    """``--check-engine``: the engine, checked against the state now and after every
    update; each check is an ``engine_checked`` event."""
    from swarm.engines.checked import CheckedEngine

    checked = CheckedEngine(engine, state, lambda fields: report.emit("engine_checked",
                                                                       **fields))
    try:
        checked.check()
    except BaseException:
        engine.close()
        raise
    return checked


def _vllm_engine(card: RunCard, state: dict[str, torch.Tensor], args: argparse.Namespace
                 ) -> RolloutEngine:
    """vLLM over a model dir written from the card and the state (in DATA_DIR, else a
    temporary dir)."""
    import dataclasses
    import tempfile

    from safetensors.torch import save_file

    from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    root = args.data_dir / "model" if args.data_dir is not None else \
        Path(tempfile.mkdtemp(prefix="swarm-model-"))
    card.write_model_dir(root)
    save_file({n: t.contiguous() for n, t in state.items()}, str(root / "model.safetensors"))
    config = VLLMEngineConfig(model_dir=str(root), dtype=card.dtype)
    # vLLM refuses a max_model_len beyond the model's positions (the demo's are 64).
    positions = card.model_config.get("max_position_embeddings")
    if isinstance(positions, int) and 0 < positions < config.max_model_len:
        config = dataclasses.replace(config, max_model_len=positions)
    return VLLMEngine(config)


def _warn(report: Reporter, event: str, line: str, **fields: object) -> None:
    """A warning: one line on stderr, and a status event (JSON with --status-json)."""
    print(f"swarm: warning: {line}", file=sys.stderr, flush=True)
    report.emit(event, **fields)


TRAINER_ADDRS = "trainer.addrs"
"""In DATA_DIR: where the trainer was last reached, redialled after a restart (the run's
peer directory needs a gossip round or more to name it again)."""


def _kept_trainer_addrs(args: argparse.Namespace) -> tuple[str, ...]:
    if args.data_dir is None:
        return ()
    try:
        text = (args.data_dir / TRAINER_ADDRS).read_text()[:4096]
    except (OSError, UnicodeDecodeError):
        return ()
    tail = f"/p2p/{args.trainer}"
    return tuple(a for a in text.split()[:8] if a.startswith("/") and a.endswith(tail))


def _keep_trainer_addrs(args: argparse.Namespace, net: Network, kept: tuple[str, ...]
                        ) -> tuple[str, ...]:
    meta = net.directory().get(args.trainer)
    addrs = tuple(a for a in (meta.addrs if meta else ())
                  if a.endswith(f"/p2p/{args.trainer}"))[:8]
    if args.data_dir is None or not addrs or addrs == kept:
        return kept
    from swarm.roles.persist import write_atomic

    try:
        write_atomic(args.data_dir / TRAINER_ADDRS, ["\n".join(addrs).encode() + b"\n"])
    except SwarmError as exc:
        log.debug("could not keep the trainer's addresses: %s", exc)
        return kept
    return addrs


async def _report_traversal(raw: Libp2pNode, report: Reporter) -> None:
    """A ``traversal`` status event each time the relay and hole-punch counts change."""
    last: dict[str, object] = {}
    while True:
        now = raw.traversal.stats.as_dict()
        if now != last and raw.reachability == "private":
            report.emit("traversal", **now)
            last = now
        await asyncio.sleep(1.0)


async def _watch(peer: RolloutPeer, net: Network, args: argparse.Namespace,
                 report: Reporter) -> None:
    """Say when no manifest came from the named trainer, and while the trainer is gone;
    give up after ``--trainer-timeout`` (an error), or end there (returning) when the
    trainer said it finished the run at the version this peer holds."""
    every = max(0.1, args.warn_after)
    start = time.monotonic()
    warned_manifest = False
    lost_since: float | None = start
    said_at = start
    said_over = False
    said_finished: int | None = None
    kept = _kept_trainer_addrs(args)
    while True:
        await asyncio.sleep(min(1.0, every / 4))
        now = time.monotonic()
        here = args.trainer in net.connected_peers()
        if here:
            kept = _keep_trainer_addrs(args, net, kept)
        if not warned_manifest and peer.verified == 0 and now - start >= every:
            warned_manifest = True
            if peer.version >= 0:
                why = (f"holding version {peer.version} from the data dir; the trainer has "
                       "announced nothing newer")
            elif here:
                why = "it is connected but has announced no version yet"
            else:
                others = len(net.connected_peers())
                why = (f"it is not connected ({others} other peer(s) are): check that "
                       "--trainer is the id the trainer prints at start, and --bootstrap")
            signers = peer.other_signers.ids
            if signers:
                why += f"; saw manifests signed by {', '.join(signers)}"
            _warn(report, "no_manifest",
                  f"no manifest from trainer {args.trainer} within {every:.0f} s; {why}",
                  trainer=args.trainer, seconds=round(now - start, 1), connected=here,
                  signers=signers)
        over = peer.run_over
        if over is not None and over != said_finished:
            said_finished = over
            report.say(f"the trainer finished the run at version {over}, which this peer "
                       "holds; no more work unless it goes on")
        if here:
            lost_since = None  # (the peer's own line says the trainer is back)
            expect_dial_failures(False)
            continue
        if lost_since is None:
            lost_since = said_at = now
            said_over = False
        gone = now - lost_since
        if over is not None and over >= peer.version:
            # a finished run's trainer leaving is no fault: said once (its redials failing
            # are expected), and a time-out ends the peer as done
            if not said_over:
                said_over = True
                expect_dial_failures(True)
                report.say(f"the trainer left after finishing the run at version "
                           f"{over}; waiting in case it goes on"
                           + (f" (for --trainer-timeout {args.trainer_timeout:g} s)"
                              if args.trainer_timeout else " (Ctrl-C to stop)"))
            if args.trainer_timeout and gone >= args.trainer_timeout:
                report.say(f"done: holding version {peer.version}, the run's last")
                return
            continue
        if args.trainer_timeout and gone >= args.trainer_timeout:
            raise TrainerGone(f"trainer {args.trainer} unreachable for {gone:.0f} s; giving "
                              f"up (--trainer-timeout {args.trainer_timeout:g})")
        if now - said_at >= every and (peer.verified > 0 or warned_manifest):
            said_at = now
            _warn(report, "trainer_unreachable",
                  f"trainer {args.trainer} unreachable for {gone:.0f} s; still trying "
                  f"(holding version {peer.version})", trainer=args.trainer,
                  seconds=round(gone, 1), version=peer.version)

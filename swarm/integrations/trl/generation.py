"""The generation backend a TRL ``GRPOTrainer`` gets from :func:`attach`.

TRL 1.16's GRPOTrainer, with ``use_vllm``, holds a ``VLLMGeneration`` as
``trainer.vllm_generation`` and calls two of its methods (``_generate_single_turn`` and
the ``rollout_func`` path):

- ``sync_weights()`` whenever ``trainer.state.global_step`` moved since the last call;
- ``generate(prompts, images, num_generations, profiler)`` with the batch's prompt token
  ids, each prompt repeated ``num_generations`` times in a row; it returns
  ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``, one row per completion,
  ``logprobs[i][t]`` a list whose first entry is the sampled token's log-prob.

:func:`attach` builds the trainer as TRL does without vLLM (``use_vllm=False``: nothing of
vLLM is imported), then sets ``use_vllm``, ``vllm_mode = "server"`` (one generation
service for the whole batch, as a vLLM server is) and ``vllm_generation`` to a
:class:`SwarmGeneration`. TRL's own code does the rest: it masks after the first eos,
computes the loss with its importance-sampling correction against the peers' log-probs
(``vllm_importance_sampling_correction``), and logs its metrics, to which this backend
adds ``swarm/*`` ones (sync seconds, delta bytes, peers per batch).

The swarm side (a libp2p node and a :class:`~swarm.roles.trainer.TrainerNode`) runs on an
asyncio loop in a thread of its own; TRL's thread waits on it for each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarm.errors import LocalProtocolError, SwarmError
from swarm.integrations._thread import NodeThread

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """Where the trainer's swarm node runs, and how it hands out rollouts."""

    run: str
    """Run name: peers join with ``--run`` set to it."""
    data_dir: Path
    """The trainer's key (``node.key``), lease book and published versions (a new run:
    it must not hold versions of an earlier one)."""
    listen: str = "/ip4/127.0.0.1/tcp/0"
    """libp2p listen multiaddr (``/ip4/0.0.0.0/tcp/PORT`` for volunteers elsewhere)."""
    dtype: str = "bfloat16"
    """What the peers run (the published state's dtype)."""
    max_staleness: int = 0
    """Versions a result may lag behind the latest: 0 is on-policy, as TRL is with vLLM
    (a peer still on the previous version updates before its results count)."""
    check_rollouts: bool = True
    """Recompute each result's log-probs under its version, and replay a share of the
    tasks (:class:`~swarm.engines.rollout_check.PolicyWindow`): a peer that lies does not
    reach the loss. Costs about one forward pass per completion on the trainer."""
    replay_fraction: float = 0.1
    """Share of the tasks of torch peers the trainer generates again with their seed
    (chosen at random; each costs the trainer that task's generation)."""
    collect_timeout: float = 600.0
    """Most seconds a batch may wait for its completions."""
    min_peers: int = 1
    """Peers to wait for before the first batch is handed out."""
    peer_timeout: float = 300.0
    """Most seconds to wait for them."""
    linger: float = 60.0
    """On close, most seconds to keep seeding until every connected peer holds the last
    version."""
    model_dir: Path | None = None
    """An HF model dir whose tokenizer and generation files go into the run card; None:
    they are written from the trainer's ``processing_class`` and generation config."""
    record_digests: bool = False
    """Keep each version's weights digest (:attr:`SwarmGeneration.digests`), what
    ``swarm peer --check-engine`` reports as ``state``: one hash pass per version."""
    chunk_target: int = 1 << 20
    """Encoded bytes per delta chunk."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.min_peers < 0:
            raise ValueError("max_staleness and min_peers are >= 0")
        if not self.collect_timeout > 0 or not self.peer_timeout > 0 or self.linger < 0:
            raise ValueError("collect_timeout and peer_timeout > 0, linger >= 0")
        if not 0.0 <= self.replay_fraction <= 1.0:
            raise ValueError("replay_fraction is in [0, 1]")


@dataclass(slots=True)
class Stats:
    """What the backend did so far."""

    versions: int = 0
    sync_seconds: list[float] = field(default_factory=list)
    """Seconds of each ``sync_weights`` that published (state copy and publish)."""
    payload_bytes: list[int] = field(default_factory=list)
    """Encoded bytes of each version published after the first."""
    dense_bytes: int = 0
    """Bytes of the state in the published dtype (what a dense sync moves)."""
    generate_seconds: list[float] = field(default_factory=list)
    completions: int = 0
    holders: set[str] = field(default_factory=set)
    """Peers whose results reached the loss."""


class SwarmGeneration(NodeThread):
    """TRL's generation backend, served by a swarm: see the module docstring.

    Made by :func:`attach`; a context manager (leaving it closes the node, after the
    last version reached the connected peers or ``linger`` seconds).
    """

    def __init__(self, trainer: Any, config: SwarmConfig) -> None:
        super().__init__("swarm-trl")
        self.trainer = trainer
        self.config = config
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        self.stats = Stats()
        #: version -> weights digest (hex) of the published state (``record_digests``).
        self.digests: dict[int, str] = {}
        self.peer_id = ""
        self.address = ""
        self.version = -1
        self._published_at = -1  # the trainer's global_step of the last published version
        self._seed_base = int(getattr(trainer.args, "seed", 0)) << 20
        self._batches = 0
        self._sampling = _sampling_of(trainer)
        self._node: Any = None
        self._net: Any = None
        self._policies: Any = None
        self._closed = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- the two calls GRPOTrainer makes -----------------------------------------------------
    def sync_weights(self) -> None:
        """Publish the model as the next version (a sparse delta), unless it is the one
        published last (TRL calls this before the first batch too, which version 0 is)."""
        step = int(self.trainer.state.global_step)
        if step == self._published_at:
            return
        t0 = time.perf_counter()
        self._publish(step)
        took = time.perf_counter() - t0
        self.stats.sync_seconds.append(took)
        self._metric("swarm/sync_s", took)

    def generate(self, prompts: list[list[int]], images: list[Any] | None,
                 num_generations: int, profiler: Any = None
                 ) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]],
                            list[list[list[int]]]]:
        """Completions of ``prompts`` (each repeated ``num_generations`` times in a row)
        by the swarm's peers, under the latest version, with their log-probs."""
        if images is not None and any(i is not None for i in images):
            raise LocalProtocolError("swarm's TRL backend generates from text prompts only")
        n = int(num_generations)
        if n < 1 or len(prompts) % n:
            raise LocalProtocolError(f"{len(prompts)} prompts are not groups of {n}")
        unique = [list(prompts[i]) for i in range(0, len(prompts), n)]
        for g, first in enumerate(unique):
            if any(list(p) != first for p in prompts[g * n:(g + 1) * n]):
                raise LocalProtocolError("each prompt must come num_generations times in a "
                                         "row (TRL's RepeatSampler order)")
        self._batches += 1
        t0 = time.perf_counter()
        with profiler if profiler is not None else contextlib.nullcontext():
            groups, holders = self._call(self._rollouts(unique, n, self._batches))
        self.stats.generate_seconds.append(time.perf_counter() - t0)
        self.stats.holders |= holders
        out_prompts: list[list[int]] = []
        completions: list[list[int]] = []
        logprobs: list[list[list[float]]] = []
        token_ids: list[list[list[int]]] = []
        for prompt, group in zip(unique, groups, strict=True):
            for tokens, lps in group:
                out_prompts.append(prompt)
                completions.append(list(tokens))
                logprobs.append([[lp] for lp in lps])
                token_ids.append([[t] for t in tokens])
        self.stats.completions += len(completions)
        self._metric("swarm/peers", float(len(holders)))
        self._metric("swarm/generate_s", time.perf_counter() - t0)
        return out_prompts, completions, logprobs, token_ids

    # -- what a user calls -------------------------------------------------------------------
    @property
    def join_command(self) -> str:
        """The ``swarm peer`` command line a volunteer runs to generate for this trainer."""
        return (f"swarm peer --run {self.config.run} --bootstrap {self.address} "
                f"--trainer {self.peer_id}")

    def connected_peers(self) -> int:
        return self._call(self._connected())

    def wait_for_peers(self, n: int, timeout: float) -> int:
        """Wait until ``n`` peers are connected; returns how many are.

        :raises TimeoutError: fewer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while (have := self.connected_peers()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{have} of {n} peers connected within {timeout:.0f} s")
            time.sleep(0.2)
        return have

    def failure(self) -> BaseException | None:
        return self._error

    def close(self, *, publish_last: bool = True) -> None:
        """Publish the trained model if the last step is not published yet (TRL syncs
        before each batch, so the last step's weights would not be), keep seeding until
        the connected peers hold it (at most ``linger`` seconds), then leave
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        running = self._ready.is_set() and self._error is None
        if running and publish_last and \
                int(self.trainer.state.global_step) != self._published_at:
            self.sync_weights()  # TRL syncs before generating: the last step's weights
        if running and self.config.linger > 0:
            try:
                self._call(self._linger(), timeout=self.config.linger + 30.0)
            except Exception as exc:
                log.warning("swarm: could not wait for the last version to spread: %s", exc)
        self._halt(60.0)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SwarmGeneration:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(publish_last=kind is None)  # not after a failed step

    # -- the swarm side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the node, publish the model as version 0 and serve the run card.

        :raises SwarmError: the node could not start (a port in use, ...), or
            ``data_dir`` holds an earlier run.
        """
        self._launch()
        self._published_at = int(self.trainer.state.global_step)

    async def _main(self) -> None:
        from swarm.engines.hf_model import run_card
        from swarm.engines.rollout_check import PolicyWindow, policy_builder
        from swarm.identity import Identity
        from swarm.net.dataplane import DataPlaneConfig
        from swarm.net.node import Libp2pNode, NodeConfig
        from swarm.roles.trainer import TrainerConfig, TrainerNode

        cfg = self.config
        stop = self._bind()
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        me = Identity.load_or_create(cfg.data_dir / "node.key")
        self.peer_id = me.peer_id
        checks: list[Any] = []
        if cfg.check_rollouts:
            self._policies = PolicyWindow(policy_builder(self.model), keep=cfg.max_staleness + 2)
            checks = self._policies.checks(cfg.dtype, replay_fraction=cfg.replay_fraction)
        parts = cfg.listen.split("/")
        host = parts[2] if len(parts) > 2 else "127.0.0.1"
        async with Libp2pNode(me, NodeConfig(listen=cfg.listen, run=cfg.run,
                                             data_plane=DataPlaneConfig(host=host))) as net, \
                TrainerNode(me, net, TrainerConfig(run=cfg.run, data_dir=cfg.data_dir,
                                                   max_staleness=cfg.max_staleness,
                                                   chunk_target=cfg.chunk_target),
                            checks=checks) as node:
            if node.restored_step >= 0:
                raise LocalProtocolError(
                    f"{cfg.data_dir} holds versions up to {node.restored_step} of an earlier "
                    "run: give the TRL adapter a new data_dir")
            self._net, self._node = net, node
            self.address = net.listen_addresses[0]
            state = await asyncio.to_thread(self._state, 0)
            v0 = await node.publish(state)
            self._published(v0, state)
            model_dir = cfg.model_dir or await asyncio.to_thread(self._card_dir)
            net.serve_card(run_card(me, cfg.run, self.model, v0.manifest, dtype=cfg.dtype,
                                    model_dir=model_dir).encode())
            self._ready.set()
            log.info("swarm: TRL trainer %s at %s", me.peer_id, self.address)
            await node.wait(stop.wait())

    def _card_dir(self) -> Path:
        """A dir with the trainer's tokenizer and generation config, for the card."""
        self._tmp = tempfile.TemporaryDirectory(prefix="swarm-trl-card-")
        out = Path(self._tmp.name)
        tokenizer = getattr(self.trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(out)
        return out

    def _state(self, version: int) -> dict[str, torch.Tensor]:
        from swarm.demo.model import inference_state

        state = inference_state(self.model, self.config.dtype)
        if self._policies is not None:
            self._policies.add(version, state)
        return state

    def _publish(self, step: int) -> None:
        async def publish() -> None:
            state = self._state(self.version + 1)  # on the swarm thread: TRL's waits
            self._published(await self._node.publish(state), state)

        self._call(publish())
        self._published_at = step

    def _published(self, pub: Any, state: dict[str, torch.Tensor]) -> None:
        from swarm.engines import weights_digest
        from swarm.engines.tensors import digest_of

        self.version = pub.step
        self.stats.versions += 1
        self.stats.dense_bytes = pub.dense_bytes
        if pub.step > 0:
            self.stats.payload_bytes.append(pub.payload_bytes)
            self._metric("swarm/delta_bytes", float(pub.payload_bytes))
            self._metric("swarm/delta_ratio", pub.ratio)
        self._metric("swarm/version", float(pub.step))
        if self.config.record_digests:
            self.digests[pub.step] = weights_digest(
                {n: digest_of(t) for n, t in state.items()}).hex()

    async def _connected(self) -> int:
        return len(self._net.connected_peers())

    async def _rollouts(self, prompts: Sequence[list[int]], n: int, batch: int
                        ) -> tuple[list[list[tuple[tuple[int, ...], tuple[float, ...]]]],
                                   set[str]]:
        import dataclasses

        node, cfg = self._node, self.config
        if batch == 1 and cfg.min_peers:
            deadline = time.monotonic() + cfg.peer_timeout
            while len(self._net.connected_peers()) < cfg.min_peers:
                if time.monotonic() > deadline:
                    raise SwarmError(f"{len(self._net.connected_peers())} of {cfg.min_peers} "
                                     f"peers connected within {cfg.peer_timeout:.0f} s")
                await asyncio.sleep(0.2)
        sampling = dataclasses.replace(self._sampling,
                                       seed=(self._seed_base + batch * 4096) % (1 << 62))
        tasks = node.add_tasks([(f"v{self.version}-b{batch}-{i}", p)
                                for i, p in enumerate(prompts)],
                               group_size=n, sampling=sampling)
        watch = asyncio.create_task(self._report_waiting(batch, len(tasks)))
        try:
            accepted = await node.collect(tasks, timeout=cfg.collect_timeout)
        except TimeoutError:
            raise SwarmError(
                f"no completions for {len(tasks)} prompts within {cfg.collect_timeout:.0f} s "
                f"({len(self._net.connected_peers())} peers connected{self._bans()}; join "
                f"with: {self.join_command})") from None
        finally:
            watch.cancel()
        results = {r.task_id: r for a in accepted for r in a.results}
        groups = [[(tuple(c.token_ids), tuple(c.logprobs)) for c in results[t.task_id].completions]
                  for t in tasks]
        return groups, {a.holder for a in accepted}

    async def _report_waiting(self, batch: int, prompts: int, every: float = 30.0) -> None:
        """While a batch waits, say every ``every`` seconds what the lease book holds (a
        stalled batch then shows why in the trainer's log: no peers, no claims, refusals)."""
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(every)
            book = self._node.leases
            log.warning(
                "swarm: batch %d has waited %.0f s for %d prompts: %d peers connected%s, "
                "%d tasks queued, %d leases live; lease book %s", batch,
                time.monotonic() - t0, prompts, len(self._net.connected_peers()),
                self._bans(), book.queued, len(book.live_leases()), book.stats.as_dict())

    def _bans(self) -> str:
        """``", N of them banned (...)"``: connected peers whose results failed the
        checks until the lease book banned them, and the last failure; empty when none."""
        scores = self._node.leases.scores
        banned = [p for p in self._net.connected_peers() if scores.banned(p)]
        if not banned:
            return ""
        last = self._node.rejected[-1].reason if self._node.rejected else "?"
        return (f", {len(banned)} of them banned after failed rollout checks (the last: "
                f"{last})")

    async def _linger(self) -> None:
        from swarm.cli.trainer import wait_delivered

        await wait_delivered(self._node, set(self._net.connected_peers()), self.config.linger)

    def _metric(self, name: str, value: float) -> None:
        metrics = getattr(self.trainer, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"][name].append(value)


def _sampling_of(trainer: Any) -> Any:
    """The swarm ``Sampling`` of TRL's generation settings; refuses what peers lack."""
    from swarm.protocol.leases import Sampling

    args = trainer.args
    if float(getattr(trainer, "repetition_penalty", 1.0) or 1.0) != 1.0:
        raise LocalProtocolError("swarm peers sample without a repetition penalty: leave "
                                 "repetition_penalty at 1.0")
    if float(getattr(trainer, "min_p", 0.0) or 0.0) != 0.0:
        raise LocalProtocolError("swarm peers sample without min_p: leave it unset")
    if getattr(args, "generation_kwargs", None):
        raise LocalProtocolError("generation_kwargs are vLLM's: swarm peers take "
                                 "temperature, top_p, top_k and max_completion_length")
    if getattr(args, "vllm_structured_outputs_regex", None):
        raise LocalProtocolError("swarm peers do not do structured outputs")
    return Sampling(max_tokens=int(trainer.max_completion_length),
                    temperature=float(trainer.temperature),
                    top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
                    top_k=int(trainer.top_k or 0),
                    stop_token_ids=tuple(int(t) for t in trainer.eos_token_ids))


def attach(trainer: Any, config: SwarmConfig) -> SwarmGeneration:
    """Make ``trainer`` (a TRL GRPOTrainer built with ``use_vllm=False``) generate
    through a swarm: start the trainer's node, publish version 0 and the run card, and
    put a :class:`SwarmGeneration` where TRL keeps its vLLM backend.

    :raises TRLVersionError: TRL is not a tested version.
    :raises LocalProtocolError: a trainer this backend cannot serve (``use_vllm`` set,
        several processes, a PEFT model, images, sampling settings peers lack).
    :raises SwarmError: the node could not start.
    """
    from swarm.integrations.trl import installed_trl_version

    installed_trl_version()
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise LocalProtocolError(f"attach takes a trl.GRPOTrainer, not {type(trainer).__name__}")
    if trainer.args.use_vllm:
        raise LocalProtocolError("build the GRPOTrainer with use_vllm=False: swarm replaces "
                                 "its vLLM generation")
    if trainer.accelerator.num_processes != 1:
        raise LocalProtocolError("swarm's TRL backend runs in one training process (found "
                                 f"{trainer.accelerator.num_processes})")
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        raise LocalProtocolError("PEFT models are not supported: merge the adapter first")
    gen = SwarmGeneration(trainer, config)
    gen.start()
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer.vllm_generation = gen
    trainer._last_loaded_step = -1
    return gen

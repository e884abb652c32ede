"""The download side of the exchange: which chunk to ask for, of whom, and when.

Rarest-first picking with a strict endgame; requests pipelined to each neighbour's
measured bandwidth-delay product within an in-flight window; sources chosen near and fast
first (same region, then the estimated delivery time), with cross-region imports spread
over the region by rendezvous rank and the trainer as source of last resort; requests a
neighbour leaves unanswered time out and cost it a strike.
"""

from __future__ import annotations

import heapq

from swarm.protocol import picker
from swarm.protocol.exchange_msgs import Cancel, Request, Want
from swarm.protocol.exchange_state import ExchangeState, ObjectState, PeerState


class DownloadSide(ExchangeState):
    """Picking, requests and their time-outs (a part of
    :class:`~swarm.protocol.exchange.Exchange`)."""

    def _timeout(self, p: PeerState) -> float:
        expect = p.rtt + (len(p.out) + 1) * self._avg / max(p.rate, 1.0)
        return min(max(self.config.request_timeout, 4.0 * expect),
                   self.config.max_request_timeout)

    def _inflight_bytes(self) -> int:
        total = 0
        for o in self._objects.values():
            total += len(o.inflight) * o.avg_size
        return total

    def _room(self, p: PeerState) -> int:
        """Requests we may still send to ``p`` (its pipeline depth less those in flight)."""
        return 0 if p.choked_us else p.depth - len(p.out)

    def _set_rate(self, p: PeerState, rate: float) -> None:
        p.rate = rate
        # snubbed (it let requests time out, none delivered since): one request at a time,
        # so a neighbour that advertises and never serves holds back one chunk, not a
        # pipeline of them
        p.depth = 1 if p.strikes else picker.pipeline_depth(
            rate, p.rtt, self._avg, self.config.min_pipeline, self.config.max_pipeline)

    def _budget(self) -> int:
        """Bytes we may still request: the in-flight window less what is in flight."""
        cfg = self.config
        window = min(cfg.max_inflight_bytes,
                     max(4 * self._avg, int(cfg.download_rate * cfg.inflight_window)))
        return window - self._inflight_bytes()

    def _pick_one(self, o: ObjectState, idx: int, p: PeerState, now: float) -> None:
        """``p`` announced ``idx``: request it if ``p`` can take a request and budget is
        left (a busy ``p`` is reconsidered by the next full pick, when a slot frees)."""
        if o.complete_at is not None or p.trainer or not self.config.fetch \
                or self._room(p) <= 0:
            return
        if self._budget() <= 0 and idx not in self._firsts(o):
            return
        src = self._choose_source(o, idx, self._local_peers(), now, ())
        if src is not None:
            self._request(o, idx, src, now)

    def _firsts(self, o: ObjectState) -> frozenset[int]:
        """The chunks of ``o`` whose first importer into my region I am, by the ranks a
        directory gives (none without one)."""
        f = o.firsts
        if f is None:
            rank = self._rank_of
            f = o.firsts = frozenset() if rank is None else frozenset(
                i for i in range(len(o.spec.sizes)) if rank(o.spec.obj, i) == 0)
        return f

    def _pick(self, now: float) -> None:
        """Issue requests, rarest first, until the in-flight window is full."""
        cfg = self.config
        if not cfg.fetch:
            return
        if self._importer_of is not None:
            for o in self._objects.values():
                self._want_firsts(o)
        roomy = {h for h, p in self._unchokers.items()
                 if p.depth > len(p.out)}  # _room(p) > 0
        if not roomy:
            return
        peers, region = self._peers, self.region
        roomy_local = {h for h in roomy if peers[h].region == region and not peers[h].trainer}
        local_peers = self._local_peers()
        # a chunk only region-mates that can hardly upload hold is not waited for (see
        # _usual_source)
        slow = self._slow_locals
        for o in self._objects.values():
            # super-seeded chunks go first and outside the window: they are few, and
            # the trainer's upload must not wait on a busy downloader
            for idx in sorted(o.suggested):
                if idx not in o.have and idx not in o.inflight:
                    src = self._choose_source(o, idx, local_peers, now, ())
                    if src is not None:
                        self._request(o, idx, src, now)
            # so do my first imports into the region: the region waits on them
            for idx in self._firsts(o):
                if idx not in o.have and idx not in o.inflight and not o.local[idx] \
                        and not o.holders[idx].isdisjoint(roomy):
                    src = self._choose_source(o, idx, local_peers, now, ())
                    if src is not None:
                        self._request(o, idx, src, now)
        budget = self._budget()
        if budget <= 0:
            return
        for o in self._objects.values():
            if o.complete_at is not None:
                continue
            wanted = [i for i in range(len(o.spec.sizes))
                      if i not in o.have and i not in o.inflight]
            # only chunks some neighbour with a free slot holds can be asked for now
            # (the others wait for a slot: a piece arrival or a reject calls this again),
            # and of those, not the ones that wait anyway: sorting is most of a pick
            ready = [i for i in wanted
                     if not self._waits(o, i, roomy, roomy_local, slow, now)]
            order = picker.rarest_first(ready, o.local, o.availability, self._salt,
                                        o.suggested, o.tiebreaks)
            seen = (len(roomy), self._wake)  # what the filter above saw
            for idx in order:
                if budget <= 0 or not roomy:
                    return
                # a request shrinks roomy and a source's choice may set an earlier
                # wake-up: only then can a chunk that passed the filter wait after all
                if (len(roomy), self._wake) != seen and \
                        self._waits(o, idx, roomy, roomy_local, slow, now):
                    continue
                src = self._choose_source(o, idx, local_peers, now, ())
                if src is not None:
                    self._request(o, idx, src, now)
                    budget -= o.spec.sizes[idx]
                    if self._room(self._peers[src]) <= 0:
                        roomy.discard(src)
                        roomy_local.discard(src)
            if wanted or not o.inflight:
                continue
            # strict endgame: every missing chunk is requested; ask a second source for
            # those whose source is late (cancelled at the other when one arrives)
            for idx in sorted(o.inflight, key=o.tiebreaks.__getitem__):
                if budget <= 0:
                    return
                asked = o.inflight[idx]
                if len(asked) >= cfg.max_endgame_dups:
                    continue
                late_at = min(sent + cfg.endgame_late * self._eta(self._peers[q], self._avg)
                              for q, sent in asked.items())
                if now < late_at:
                    self._set_wake(late_at)
                    continue
                src = self._choose_source(o, idx, local_peers, now, tuple(asked))
                if src is not None:
                    self._request(o, idx, src, now)
                    budget -= o.spec.sizes[idx]

    def _waits(self, o: ObjectState, idx: int, roomy: set[str], roomy_local: set[str],
               slow: frozenset[str], now: float) -> bool:
        """Whether a pick passes over chunk ``idx`` for now, where
        :meth:`_choose_source` would return None with no effect: no holder has a free
        slot, or (unless suggested) every holder in my region is busy, or it is an import
        whose turn comes later with a wake-up already set by then. A smaller ``roomy``
        or an earlier wake-up never turns a yes into a no."""
        holders = o.holders[idx]
        if holders.isdisjoint(roomy):
            return True
        if idx in o.suggested:
            return False
        if o.local[idx]:
            # in the region, every holder here busy: wait
            peers, region = self._peers, self.region
            return holders.isdisjoint(roomy_local) and (
                not slow or any(h not in slow and peers[h].region == region
                                and not peers[h].trainer for h in holders))
        rank = o.ranks.get(idx)
        if rank is None:
            return False
        # an import whose turn comes at ``early`` or later, with a wake-up already set
        # no later than that
        early = o.first_seen.get(idx, o.added_at) + rank * self.config.import_delay
        wake = self._wake
        return now < early and wake is not None and wake <= early

    def _request(self, o: ObjectState, idx: int, src: str, now: float) -> None:
        ahead = o.wanted.pop(idx, None)
        if ahead is not None and ahead != src:
            self._out.append((ahead, Cancel(o.spec.obj, idx)))
        self._track(o, idx, self._peers[src], now)
        self._out.append((src, Request(o.spec.obj, idx)))

    def _track(self, o: ObjectState, idx: int, p: PeerState, now: float) -> None:
        """``idx`` is on its way from ``p`` (requested now, or wanted ahead and just
        announced): in flight, with a time-out."""
        p.out[(o.spec.obj, idx)] = now
        heapq.heappush(self._deadlines, (now + self.config.request_timeout, now, p.peer,
                                         o.spec.obj, idx))
        o.inflight.setdefault(idx, {})[p.peer] = now

    def _want_firsts(self, o: ObjectState) -> None:
        """Of the chunks I first import into my region, ask for each that nobody but the
        trainer holds yet, ahead (:class:`Want`), of my remote neighbour that first
        imports it into its region: it sends the chunk the moment it lands there, one
        one-way latency later, instead of after have, request and piece. Which region
        is a function of the chunk, so a region's first imports come over all of its WAN
        links at once, not one. Asked as soon as the neighbours are known, not when one
        first unchokes us (remote ones never choke with ``unchoke_remote``)."""
        first = self._importer_of
        peers = self._peers
        todo = [idx for idx in self._firsts(o)
                if idx not in o.have and idx not in o.inflight and idx not in o.wanted
                and all(peers[h].trainer for h in o.holders[idx])]
        if first is None or not todo:
            return
        keys = self._neighbour_keys()
        regions = [r for r in self._regions if r != self.region]
        if not regions:
            return
        for idx in todo:
            key = first(regions[(idx + self._key) % len(regions)], o.spec.obj, idx)
            p = keys.get(key) if key is not None else None
            if p is not None:
                o.wanted[idx] = p.peer
                self._out.append((p.peer, Want(o.spec.obj, idx)))

    def _eta(self, p: PeerState, size: int) -> float:
        return p.rtt + (len(p.out) + 1) * size / max(p.rate, 1.0)

    def _choose_source(self, o: ObjectState, idx: int, local_peers: list[str], now: float,
                       exclude: tuple[str, ...]) -> str | None:
        """The source to ask for ``idx`` now (see :meth:`_usual_source`). A neighbour that
        let requests time out is left out of that choice (it may have dropped the object,
        or lie): it is no reason to wait rather than ask others or the trainer. While the
        chunk waits anyway, it gets one probe at a time: it delivers (and is trusted
        again) or strikes out and is dropped."""
        src = self._usual_source(o, idx, local_peers, now, exclude)
        if src is not None:
            return src
        for h in sorted(o.holders[idx]):
            p = self._peers[h]
            if p.strikes and not p.trainer and not p.out and not p.choked_us \
                    and h not in exclude:
                return h
        return None

    def _usual_source(self, o: ObjectState, idx: int, local_peers: list[str], now: float,
                      exclude: tuple[str, ...]) -> str | None:
        """The best free holder of ``idx``: a same-region peer by estimated delivery time;
        else, when my import rank's turn has come, a peer in another region; the trainer
        only for chunks it suggested to me, chunks that only region-mates that can hardly
        upload hold, or when the swarm has stalled without them."""
        cfg = self.config
        size = o.spec.sizes[idx]
        peers, region = self._peers, self.region
        best_local: PeerState | None = None
        best_remote: PeerState | None = None
        local_key = remote_key = (float("inf"), 0, "")
        trainer: PeerState | None = None
        any_local = any_other = False
        slow = self._slow_locals  # of local_peers: callers computed them just now
        hopeless: PeerState | None = None  # the best free one of those near that
        slow_near = False  # can hardly upload (see _hardly_uploads) hold it
        seeded = False  # the trainer holds it (busy or not)
        for h in o.holders[idx]:
            p = peers[h]
            # usable: not excluded and room for a request (see _room)
            usable = not p.choked_us and p.depth > len(p.out) and h not in exclude
            if not usable and p.choked_us and not p.trainer \
                    and now - p.choked_since >= cfg.choked_wait:
                continue  # choked us for long: see ExchangeConfig.choked_wait
            if p.trainer:
                seeded = True
                if usable:
                    if idx in o.suggested:
                        return h
                    trainer = p
                continue
            if p.strikes:
                continue  # snubbed: see _choose_source
            any_other = True
            is_local = p.region == region
            if slow and h in slow:  # (a region-mate: slow holds only those)
                slow_near = True
                if usable and (hopeless is None or p.upload > hopeless.upload):
                    hopeless = p
                continue
            if not usable:
                any_local = any_local or is_local
                continue
            if is_local:
                any_local = True
            elif best_local is not None:
                continue  # a local source wins over any remote one
            # ties (equal estimates) go by a per-node hash: deterministic, and spread
            key = (p.rtt + (len(p.out) + 1) * size / max(p.rate, 1.0), p.tie, h)
            if is_local:
                if key < local_key:
                    best_local, local_key = p, key
            elif key < remote_key:
                best_remote, remote_key = p, key
        if best_local is not None:
            return best_local.peer
        if any_local:
            return None  # it is in the region already: wait for a local source to free up
        if best_remote is None and slow_near:
            # only hosts that can hardly upload hold it near: each peer here would wait
            # on them in turn, so the trainer serves it (it then sends about one copy
            # per such peer, which nothing else could do faster)
            if trainer is None:
                return None if seeded or hopeless is None else hopeless.peer
            return None if self._sending_me_suggested(o, trainer) else trainer.peer
        if best_remote is None and (trainer is None or any_other):
            return None
        # an import into the region: rendezvous rank decides who goes first
        rank = o.ranks.get(idx)
        if rank is None:
            if self._rank_of is not None:
                rank = o.ranks[idx] = self._rank_of(o.spec.obj, idx)
            else:
                # no local neighbour holds idx here, so this set only changes with
                # neighbours
                weight = self._rank_weight
                lacking = [(self._peers[q].key, weight(self._peers[q].upload))
                           for q in local_peers]
                rank = o.ranks[idx] = picker.import_rank(
                    (self._key, weight(self.config.upload_rate)), idx, o.spec.obj, lacking)
        if best_remote is not None:
            # give the previous rank time to ask, queue and receive it: over a congested
            # WAN link that is the time imports have taken here, longer than the
            # source's rate suggests (several ranks asked at once and every copy slowed
            # the rest)
            wait = max(cfg.import_delay,
                       4 * best_remote.rtt + 2 * size / max(best_remote.rate, 1.0),
                       1.5 * max(self._import_s, self._importing_for(now)))
        else:
            wait = cfg.import_delay
        ready = o.first_seen.get(idx, o.added_at) + rank * wait
        if best_remote is not None:
            if now >= ready:
                return best_remote.peer
            self._set_wake(ready)
            return None
        assert trainer is not None
        if self._sending_me_suggested(o, trainer):
            return None
        if idx not in o.poisoned:
            # the swarm has stalled, or no chunk new to me has turned up for as long: the
            # trainer has handed out every first copy, and this one went to peers since
            # dropped (a corrupt first importer that all its neighbours had banned), so
            # nobody will announce it, while the swarm moving on never looks stalled
            ready = max(ready, min(o.last_progress, o.last_new + rank * wait)
                        + cfg.last_resort_delay)
        if now >= ready:
            return trainer.peer
        self._set_wake(ready)
        return None

    @staticmethod
    def _sending_me_suggested(o: ObjectState, trainer: PeerState) -> bool:
        """The trainer is still sending me a chunk of ``o`` it suggested: its uplink is
        what the swarm waits on, and asking it for one suggested to another peer would
        queue a copy behind that (every peer's last resort firing before the first
        suggested chunk arrived sent the trainer's payload once per peer)."""
        return any(obj == o.spec.obj and i in o.suggested for obj, i in trainer.out)

    def _importing_for(self, now: float) -> float:
        """How long my oldest import still in flight has been waiting (0: none)."""
        oldest = now
        self._local_peers()  # computes _remotes too
        for q in self._remotes:
            if q.out:
                oldest = min(oldest, min(q.out.values()))
        return now - oldest

    def _set_wake(self, t: float) -> None:
        if self._wake is None or t < self._wake:
            self._wake = t
            self._timer_earlier = True

    def _live_deadline(self, entry: tuple[float, float, str, bytes, int]) -> bool:
        _, sent, peer, obj, idx = entry
        p = self._peers.get(peer)
        return p is not None and p.out.get((obj, idx)) == sent

    def _expire_requests(self, now: float) -> list[PeerState]:
        """Cancel the requests past their time-out; each neighbour that had some takes a
        strike and half its rate, and is snubbed until it delivers. Returns the neighbours
        at ``max_strikes`` (to drop), never the trainer: it is the source of last resort,
        and a slow uplink shared by the swarm is no reason to lose it (the halved rate
        lengthens the time-outs of the requests that follow)."""
        late: dict[str, list[tuple[bytes, int]]] = {}
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            entry = heapq.heappop(dl)
            if not self._live_deadline(entry):
                continue
            _, sent, peer, obj, idx = entry
            limit = sent + self._timeout(self._peers[peer])
            if now >= limit:
                late.setdefault(peer, []).append((obj, idx))
            else:
                heapq.heappush(dl, (limit, sent, peer, obj, idx))
        out: list[PeerState] = []
        for peer, expired in late.items():
            p = self._peers.get(peer)
            if p is None:
                continue
            for obj, idx in expired:
                del p.out[(obj, idx)]
                self._out.append((p.peer, Cancel(obj, idx)))
                o = self._objects.get(obj)
                if o is not None:
                    self._drop_inflight(o, idx, p.peer)
            p.strikes += 1
            p.unanswered += len(expired)
            self._set_rate(p, p.rate / 2)
            if p.strikes >= self.config.max_strikes and not p.trainer:
                out.append(p)
        return out

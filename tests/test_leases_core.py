"""Lease protocol core: messages, signatures, acceptance rules, scheduling (fake clock)."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import DecodeError, LocalProtocolError, RemoteProtocolError, SignatureError
from swarm.identity import Identity
from swarm.protocol.leases import (
    Claim,
    Completion,
    Heartbeat,
    Lease,
    LeaseConfig,
    LeaseState,
    MemoryLeaseStore,
    PeerLeases,
    Reason,
    Result,
    RolloutTask,
    Sampling,
    TaskResult,
    TrainerLeases,
    Verdict,
    decode_message,
)
from swarm.protocol.scheduling import SchedulingConfig, SpeedTable, plan_lease, staleness_headroom
from swarm.wire import strict

pytestmark = pytest.mark.timeout(60)

TRAINER = Identity.from_seed(b"T" * 32)
ALICE = Identity.from_seed(b"A" * 32)
BOB = Identity.from_seed(b"B" * 32)
MALLORY = Identity.from_seed(b"M" * 32)
RUN = "run-1"
SCHED = SchedulingConfig(target_lease_s=10.0, default_tokens_per_task=40.0, min_timeout_s=5.0,
                         timeout_base_s=2.0, max_lifetime_factor=3.0)


def make_trainer(n_tasks: int = 20, *, k: int = 1, grace: float = 2.0,
                 store: MemoryLeaseStore | None = None, **kw: object) -> TrainerLeases:
    cfg = LeaseConfig(run=RUN, max_staleness=k, grace_s=grace, scheduling=SCHED, **kw)  # type: ignore[arg-type]
    t = TrainerLeases(TRAINER, cfg, store=store)
    t.publish_version(0, 0.0)
    t.add_tasks([(f"p{i}", [i, 1, 2]) for i in range(n_tasks)], group_size=2,
                sampling=Sampling(max_tokens=10))
    return t


def peer(ident: Identity) -> PeerLeases:
    return PeerLeases(ident, TRAINER.public_key, RUN)


def get_lease(t: TrainerLeases, p: PeerLeases, ident: Identity, now: float, *,
              tps: float = 4.0, version: int = 0, want: int = 64) -> Lease:
    [reply] = t.handle(p.claim(now, tokens_per_s=tps, version=version, want=want).encode(), now,
                       sender=ident.peer_id)
    assert isinstance(reply, Lease), reply
    assert p.receive(reply.encode(), now, sender="trainer") is Reason.ACCEPTED
    return reply


def completions(lease: Lease, n_tokens: int = 5) -> list[TaskResult]:
    return [TaskResult(task.task_id, tuple(
        Completion(tuple(range(n_tokens)), tuple(-0.25 * i for i in range(n_tokens)))
        for _ in range(task.group_size))) for task in lease.tasks]


def submit(t: TrainerLeases, p: PeerLeases, ident: Identity, lease: Lease, now: float, *,
           version: int = 0, results: list[TaskResult] | None = None) -> Verdict:
    res = p.result(lease.lease_id, version, results or completions(lease), now)
    [v] = t.handle(res.encode(), now, sender=ident.peer_id)
    assert isinstance(v, Verdict)
    return v


# --------------------------------------------------------------------------- codec


def test_every_message_round_trips_and_verifies() -> None:
    t = make_trainer()
    p = peer(ALICE)
    claim = p.claim(1.0, tokens_per_s=12.5, version=0, want=3, downloading=1)
    lease = get_lease(t, p, ALICE, 1.5)
    hb = Heartbeat(RUN, lease.lease_id, 1, 2000).sign(ALICE)
    res = p.result(lease.lease_id, 0, completions(lease), 3.0)
    [verdict] = t.handle(res, 3.0, sender=ALICE.peer_id)
    for msg in (claim, lease, hb, res, verdict):
        again = decode_message(msg.encode())
        assert again == msg
        assert again.is_valid()
    assert lease.signer == TRAINER.public_key and lease.holder == ALICE.public_key


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2**32 - 1),
                                   st.floats(-1e30, 0.0, allow_nan=False)),
                         max_size=20), min_size=1, max_size=4),
       st.integers(0, 2**40))
def test_result_codec_round_trips(groups: list[list[tuple[int, float]]], version: int) -> None:
    comps = tuple(Completion(tuple(x[0] for x in g), tuple(x[1] for x in g)) for g in groups)
    res = Result(RUN, b"L" * 16, version, (TaskResult(7, comps),), 5).sign(ALICE)
    back = decode_message(res.encode())
    assert back == res
    assert isinstance(back, Result) and back.results[0].completions == comps


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_bytes_are_refused_with_protocol_errors(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(data)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_lease_bytes_never_crash(data: st.DataObject) -> None:
    lease = Lease(b"x" * 16, RUN, ALICE.public_key, (RolloutTask(1, "p"),), 0, 0, 1, 0, 10,
                  1).sign(TRAINER)
    raw = bytearray(lease.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        msg = decode_message(bytes(raw))
    except RemoteProtocolError:
        return
    assert msg.is_valid()  # a surviving mutation must still carry a valid signature


def test_tampered_body_fails_signature() -> None:
    lease = Lease(b"x" * 16, RUN, ALICE.public_key, (RolloutTask(1, "p"),), 0, 0, 1, 0, 10,
                  1).sign(TRAINER)
    forged = Lease(b"x" * 16, RUN, MALLORY.public_key, (RolloutTask(1, "p"),), 0, 0, 1, 0, 10,
                   1, signer=TRAINER.public_key, signature=lease.signature)
    with pytest.raises(SignatureError):
        decode_message(forged.encode())
    assert not forged.is_valid()


def test_signatures_are_domain_separated() -> None:
    """A heartbeat signature cannot pass as a claim with the same body bytes."""
    hb = Heartbeat(RUN, b"x" * 16, 0, 5).sign(ALICE)
    wire = strict.pack(["claim", hb.body(), hb.signature])
    with pytest.raises((DecodeError, SignatureError)):
        decode_message(wire)


def test_decoder_bounds_and_strictness() -> None:
    claim = Claim(RUN, 1.0, 0, 1, 5).sign(ALICE)
    tag, body, sig = msgpack.unpackb(claim.encode())
    with pytest.raises(DecodeError, match="unknown tag"):
        decode_message(strict.pack(["nope", body, sig]))
    with pytest.raises(DecodeError, match="exceeds"):
        decode_message(strict.pack(["claim", b"\x80" * 5000, sig]))
    with pytest.raises(SignatureError):
        decode_message(strict.pack(["claim", body, sig[:10]]))
    fields = msgpack.unpackb(body)
    fields["v"] = 2
    with pytest.raises(DecodeError, match="format version"):
        decode_message(strict.pack(["claim", strict.pack(fields), sig]))
    fields["v"] = 1
    fields["tps"] = 1  # an int where a float belongs
    with pytest.raises(DecodeError):
        decode_message(strict.pack(["claim", strict.pack(fields), sig]))
    fields["tps"] = math.nan
    with pytest.raises(DecodeError):
        decode_message(strict.pack(["claim", strict.pack(fields), sig]))
    fields["tps"] = 1.0
    fields["extra"] = 1
    with pytest.raises(DecodeError, match="unexpected keys"):
        decode_message(strict.pack(["claim", strict.pack(fields), sig]))
    noncanon = msgpack.packb([tag, body, sig], use_bin_type=False)
    with pytest.raises(DecodeError):
        decode_message(noncanon)
    with pytest.raises(DecodeError):  # token bytes not a multiple of 4
        Completion.from_wire([b"abc", b"", "stop"])
    with pytest.raises(DecodeError):  # NaN log-prob
        Completion.from_wire([b"\0" * 4, b"\0\0\0\0\0\0\xf8\x7f", "stop"])
    with pytest.raises(DecodeError):  # no finish reason
        Completion.from_wire([b"\0" * 4, b"\0" * 8])
    for reason in ("eos", ["stop"], None):  # unknown or unhashable
        with pytest.raises(DecodeError):
            Completion.from_wire([b"\0" * 4, b"\0" * 8, reason])
    one = Completion((7,), (-0.5,), "stop")
    assert Completion.from_wire(one.to_wire()) == one


def test_sampling_reaches_the_peer_whole_and_is_bounded() -> None:
    full = Sampling(max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=123,
                    stop_token_ids=(2, 151645))
    t = TrainerLeases(TRAINER, LeaseConfig(run=RUN, scheduling=SCHED))
    t.publish_version(0, 0.0)
    t.add_tasks([("p", [1, 2, 3])], sampling=full)
    lease = get_lease(t, peer(ALICE), ALICE, 1.0)
    got = decode_message(lease.encode())
    assert isinstance(got, Lease) and got.tasks[0].sampling == full
    assert Sampling.from_wire(Sampling().to_wire()) == Sampling()  # seed None travels too
    assert Sampling(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
    for bad in ({"max_tokens": 0}, {"max_tokens": 1 << 20}, {"max_tokens": True},
                {"temperature": -1.0}, {"temperature": math.inf}, {"top_p": 0.0},
                {"top_p": 1.5}, {"top_k": -1}, {"seed": -1}, {"seed": 1 << 63},
                {"stop_token_ids": (-1,)}, {"stop_token_ids": (1 << 32,)},
                {"stop_token_ids": tuple(range(257))}):
        with pytest.raises(ValueError):
            Sampling(**bad)  # type: ignore[arg-type]
    wire = full.to_wire()
    for key, value in (("max", 0), ("temp", 1), ("temp", math.nan), ("top_p", 0.0),
                       ("top_k", -1), ("top_k", 1.0), ("seed", "1"), ("seed", -1),
                       ("stop", b"abc"), ("stop", [2]), ("stop", b"\0" * 4 * 257)):
        with pytest.raises(DecodeError):
            Sampling.from_wire({**wire, key: value})
    with pytest.raises(DecodeError):
        Sampling.from_wire({**wire, "extra": 1})


def test_unsigned_message_cannot_be_encoded() -> None:
    with pytest.raises(LocalProtocolError):
        Claim(RUN, 1.0, 0, 1, 5).encode()
    assert not Claim(RUN, 1.0, 0, 1, 5).is_valid()


# --------------------------------------------------------------------------- peer side


def test_peer_refuses_foreign_forged_and_misaddressed_leases() -> None:
    p = peer(ALICE)
    task = (RolloutTask(1, "p"),)
    foreign = Lease(b"f" * 16, RUN, ALICE.public_key, task, 0, 0, 1, 0, 10_000, 0).sign(MALLORY)
    assert p.receive(foreign.encode(), 0.0, sender=MALLORY.peer_id) is Reason.FOREIGN_LEASE
    impostor = Lease(b"g" * 16, RUN, ALICE.public_key, task, 0, 0, 1, 0, 10_000, 0,
                     signer=TRAINER.public_key, signature=MALLORY.sign(b"whatever") )
    assert p.receive(impostor.encode(), 0.0, sender=MALLORY.peer_id) is Reason.BAD_SIGNATURE
    assert p.receive(impostor, 0.0, sender=MALLORY.peer_id) is Reason.BAD_SIGNATURE
    for_bob = Lease(b"h" * 16, RUN, BOB.public_key, task, 0, 0, 1, 0, 10_000, 0).sign(TRAINER)
    assert p.receive(for_bob.encode(), 0.0, sender=MALLORY.peer_id) is Reason.NOT_HOLDER
    other_run = Lease(b"i" * 16, "run-2", ALICE.public_key, task, 0, 0, 1, 0, 10_000,
                      0).sign(TRAINER)
    assert p.receive(other_run.encode(), 0.0, sender=MALLORY.peer_id) is Reason.WRONG_RUN
    assert p.receive(b"\x93garbage", 0.0, sender=MALLORY.peer_id) is Reason.MALFORMED
    assert p.held == {}
    assert p.scores.score(MALLORY.peer_id) <= -30
    assert p.refused[Reason.FOREIGN_LEASE.value] == 1
    with pytest.raises(LocalProtocolError):
        p.result(b"f" * 16, 0, [TaskResult(1, ())], 1.0)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_hostile_bytes_never_crash_either_side(data: bytes) -> None:
    t = TrainerLeases(TRAINER, LeaseConfig(run=RUN))
    assert t.handle(data, 1.0, sender=MALLORY.peer_id) == []
    p = peer(ALICE)
    assert p.receive(data, 1.0, sender=MALLORY.peer_id) is not Reason.ACCEPTED
    assert p.held == {}


def test_peer_refuses_to_sign_results_below_the_lease_minimum_version() -> None:
    t = make_trainer()
    t.publish_version(3, 10.0)
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 11.0, version=3)
    assert lease.min_version == 2 and lease.latest_version == 3
    with pytest.raises(LocalProtocolError):
        p.result(lease.lease_id, 1, completions(lease), 12.0)
    assert p.next_deadline() is not None


def test_peer_expiry_follows_lease_duration_and_renewals() -> None:
    t = make_trainer()
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 100.0)
    duration = (lease.expires_ms - lease.issued_ms) / 1000
    assert p.tick(100.0 + duration - 0.1) == []
    [hb] = p.heartbeats(100.0 + duration - 0.1)
    [v] = t.handle(hb.encode(), 100.0 + duration - 0.1, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.ACCEPTED
    assert p.receive(v.encode(), 100.0 + duration - 0.1) is Reason.ACCEPTED
    assert p.tick(100.0 + duration + 0.5) == []  # renewed
    assert p.tick(100.0 + 10 * duration) == [lease.lease_id]


# --------------------------------------------------------------------------- trainer side


def test_result_counts_once_and_lease_completes() -> None:
    t = make_trainer()
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 1.0)
    v = submit(t, p, ALICE, lease, 2.0)
    assert v.reason is Reason.ACCEPTED and set(v.accepted) == set(lease.task_ids)
    assert p.receive(v.encode(), 2.0) is Reason.ACCEPTED
    assert lease.lease_id not in p.held
    assert t.lease_state(lease.lease_id) is LeaseState.COMPLETED
    [acc] = t.take_accepted()
    assert acc.holder == ALICE.peer_id and len(acc.results) == len(lease.tasks)
    res = Result(RUN, lease.lease_id, 0, tuple(completions(lease)), 3000).sign(ALICE)
    [dup] = t.handle(res.encode(), 3.0, sender=ALICE.peer_id)
    assert isinstance(dup, Verdict) and dup.reason is Reason.DUPLICATE
    assert t.stats.tasks_completed == len(lease.tasks)
    assert t.take_accepted() == []


def test_partial_results_and_duplicate_tasks() -> None:
    t = make_trainer()
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 1.0, tps=20.0)
    assert len(lease.tasks) >= 2
    rows = completions(lease)
    assert submit(t, p, ALICE, lease, 2.0, results=rows[:1]).reason is Reason.ACCEPTED
    dup = submit(t, p, ALICE, lease, 2.1, results=rows[:2])
    assert dup.reason is Reason.DUPLICATE and dup.accepted == (rows[0].task_id,)
    # The peer learns that task was counted (its own earlier verdict may have been lost).
    assert p.receive(dup, 2.1) is Reason.DUPLICATE
    assert p.held[lease.lease_id].counted == {rows[0].task_id}
    assert t.lease_state(lease.lease_id) is LeaseState.ACTIVE
    assert submit(t, p, ALICE, lease, 2.2, results=rows[1:]).reason is Reason.ACCEPTED
    assert t.lease_state(lease.lease_id) is LeaseState.COMPLETED
    assert len(t.done) == len(lease.tasks)


def test_replays_and_someone_elses_lease_are_refused_and_scored() -> None:
    t = make_trainer()
    pa, pm = peer(ALICE), peer(MALLORY)
    lease = get_lease(t, pa, ALICE, 1.0)
    honest = pa.result(lease.lease_id, 0, completions(lease), 2.0)
    # Mallory relays Alice's signed result as her own sender: refused.
    [v] = t.handle(honest.encode(), 2.0, sender=MALLORY.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.SENDER_MISMATCH
    # Mallory re-signs Alice's result with her key: she does not hold the lease.
    [v] = t.handle(honest.sign(MALLORY).encode(), 2.0, sender=MALLORY.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.NOT_HOLDER
    # Mallory invents a lease id.
    fake = Result(RUN, b"z" * 16, 0, tuple(completions(lease)), 2000).sign(MALLORY)
    [v] = t.handle(fake.encode(), 2.0, sender=MALLORY.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.UNKNOWN_LEASE
    assert t.scores.score(MALLORY.peer_id) <= -25
    assert t.scores.score(ALICE.peer_id) == 0
    # Alice's own result still counts, once.
    [v] = t.handle(honest.encode(), 2.5, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.ACCEPTED
    # Mallory is banned from claiming work now.
    [v] = t.handle(pm.claim(3.0, tokens_per_s=5.0, version=0, want=4).encode(), 3.0,
                   sender=MALLORY.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.BANNED
    assert t.stats.refused == {"sender_mismatch": 1, "not_holder": 1, "unknown_lease": 1,
                               "banned": 1}


def test_expired_lease_requeues_and_late_result_is_refused() -> None:
    t = make_trainer(grace=2.0)
    pa, pb = peer(ALICE), peer(BOB)
    lease = get_lease(t, pa, ALICE, 0.0)
    expiry = lease.expires_ms / 1000
    # Within grace: still accepted.
    assert t.tick(expiry + 1.9) == []
    assert t.next_deadline() == pytest.approx(expiry + 2.0)
    [ev] = t.tick(expiry + 2.1)
    assert ev.lease_id == lease.lease_id and set(ev.requeued) == set(lease.task_ids)
    assert t.queued == 20
    # Re-issued to Bob, in task-id order (oldest first).
    lease_b = get_lease(t, pb, BOB, expiry + 3.0, want=len(lease.tasks))
    assert lease_b.task_ids == lease.task_ids
    assert t.stats.tasks_reissued == len(lease.tasks)
    v = submit(t, pa, ALICE, lease, expiry + 4.0)
    assert v.reason is Reason.EXPIRED
    assert pa.receive(v.encode(), expiry + 4.0) is Reason.EXPIRED
    assert lease.lease_id not in pa.held
    assert submit(t, pb, BOB, lease_b, expiry + 5.0).reason is Reason.ACCEPTED
    assert t.scores.score(ALICE.peer_id) < 0 < t.scores.score(BOB.peer_id)


def test_result_within_grace_is_accepted_then_not_after() -> None:
    t = make_trainer(grace=2.0)
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 0.0, tps=20.0)
    rows = completions(lease)
    expiry = lease.expires_ms / 1000
    assert submit(t, p, ALICE, lease, expiry + 1.5, results=rows[:1]).reason is Reason.ACCEPTED
    v = submit(t, p, ALICE, lease, expiry + 2.5, results=rows[1:])
    assert v.reason is Reason.EXPIRED
    assert t.lease_state(lease.lease_id) is LeaseState.EXPIRED
    assert t.queued == 20 - 1  # only the uncounted tasks went back


def test_heartbeats_renew_until_the_straggler_cap() -> None:
    t = make_trainer()
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 0.0)
    now, renewed, last = 0.0, [], Reason.ACCEPTED
    for _ in range(100):
        now += 1.0
        hb = Heartbeat(RUN, lease.lease_id, 0, int(now * 1000)).sign(ALICE)
        [v] = t.handle(hb.encode(), now, sender=ALICE.peer_id)
        assert isinstance(v, Verdict)
        last = v.reason
        if last is not Reason.ACCEPTED:
            break
        renewed.append(v.expires_ms / 1000)
        t.tick(now)
    assert last is Reason.EXPIRED  # the cap ended it even though it kept talking
    assert renewed == sorted(renewed) and renewed[-1] > lease.expires_ms / 1000
    assert t.stats.leases_expired == 1
    [replayed] = t.handle(hb.encode(), now, sender=ALICE.peer_id)
    assert isinstance(replayed, Verdict) and replayed.reason is Reason.EXPIRED


def test_heartbeats_that_cross_the_verdict_cost_an_honest_peer_nothing() -> None:
    """A trainer's uplink busy with chunks holds its verdict back for seconds; the peer's
    heartbeats meanwhile reach a lease the trainer already closed. Seen on real processes:
    2 such heartbeats per lease, 2 points each, banned every honest peer by step 4."""
    t = make_trainer(n_tasks=200, max_leases_per_peer=64)
    p = peer(ALICE)
    now, refused = 1.0, []
    for _ in range(20):
        lease = get_lease(t, p, ALICE, now, want=4)
        res = p.result(lease.lease_id, 0, completions(lease), now)
        [verdict] = t.handle(res.encode(), now, sender=ALICE.peer_id)
        assert isinstance(verdict, Verdict) and verdict.reason is Reason.ACCEPTED
        period = (lease.expires_ms - lease.issued_ms) / 1000 / 3
        for _ in range(2):  # sent while the verdict waited in the trainer's queue
            now += period + 0.01
            [hb] = p.heartbeats(now)
            [late] = t.handle(hb.encode(), now, sender=ALICE.peer_id)
            assert isinstance(late, Verdict)
            refused.append(late.reason)
        assert p.receive(verdict, now) is Reason.ACCEPTED and lease.lease_id not in p.held
    assert set(refused) == {Reason.DUPLICATE}
    assert t.scores.score(ALICE.peer_id) > 0 and not t.scores.banned(ALICE.peer_id)
    assert t.stats.results_accepted == 20 and len(refused) == 40


def test_a_heartbeat_refused_because_a_backup_finished_drops_the_lease() -> None:
    t = make_trainer(n_tasks=4)
    pa, pb = peer(ALICE), peer(BOB)
    la = get_lease(t, pa, ALICE, 0.0, tps=16.0)
    lb = get_lease(t, pb, BOB, 16.0, tps=16.0)  # overdue: Bob backs Alice up
    assert submit(t, pb, BOB, lb, 17.0).reason is Reason.ACCEPTED
    hb = Heartbeat(RUN, la.lease_id, 0, 18000).sign(ALICE)
    [v] = t.handle(hb.encode(), 18.0, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.SUPERSEDED
    # Alice stops: no more heartbeats, no generating a lease nobody needs.
    assert pa.receive(v, 18.0) is Reason.SUPERSEDED and la.lease_id not in pa.held
    assert pa.heartbeats(60.0) == [] and pa.next_deadline() is None
    assert t.scores.score(ALICE.peer_id) == 0


def test_replayed_heartbeat_and_claim_are_refused() -> None:
    t = make_trainer()
    p = peer(ALICE)
    claim = p.claim(1.0, tokens_per_s=4.0, version=0, want=2)
    [lease] = t.handle(claim.encode(), 1.0, sender=ALICE.peer_id)
    assert isinstance(lease, Lease)
    [again] = t.handle(claim.encode(), 1.1, sender=ALICE.peer_id)
    assert isinstance(again, Verdict) and again.reason is Reason.REPLAY
    hb = Heartbeat(RUN, lease.lease_id, 0, 1500).sign(ALICE)
    [ok] = t.handle(hb.encode(), 1.5, sender=ALICE.peer_id)
    [rep] = t.handle(hb.encode(), 1.6, sender=ALICE.peer_id)
    assert isinstance(ok, Verdict) and ok.reason is Reason.ACCEPTED
    assert isinstance(rep, Verdict) and rep.reason is Reason.REPLAY
    old = Claim(RUN, 4.0, 0, 1, 0).sign(BOB)
    [stale] = t.handle(old.encode(), 1000.0, sender=BOB.peer_id)
    assert isinstance(stale, Verdict) and stale.reason is Reason.REPLAY


def test_claim_limits_and_empty_queue() -> None:
    t = make_trainer(n_tasks=3, max_leases_per_peer=1)
    p = peer(ALICE)
    get_lease(t, p, ALICE, 1.0, tps=4.0, want=1)
    [v] = t.handle(p.claim(1.1, tokens_per_s=4.0, version=0, want=1).encode(), 1.1,
                   sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.TOO_MANY_LEASES
    pb = peer(BOB)
    get_lease(t, pb, BOB, 1.2, tps=1000.0)
    [v] = t.handle(peer(MALLORY).claim(1.3, tokens_per_s=4.0, version=0, want=1).encode(),
                   1.3, sender=MALLORY.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.NO_WORK
    assert t.scores.score(MALLORY.peer_id) == 0  # no-work costs nothing


def test_a_finished_run_tells_peers_at_its_last_version_and_updates_the_others() -> None:
    """Peers of a finished run warned that the trainer was unreachable, and one with
    --trainer-timeout exited with an error: nothing told them the run was over."""
    t = make_trainer(n_tasks=3)
    t.publish_version(1, 10.0)
    t.finish()
    [over] = t.handle(peer(ALICE).claim(11.0, tokens_per_s=4.0, version=1, want=1).encode(),
                      11.0, sender=ALICE.peer_id)
    assert isinstance(over, Verdict) and over.reason is Reason.RUN_OVER
    assert over.detail == "the run finished at version 1"
    [behind] = t.handle(peer(BOB).claim(11.0, tokens_per_s=4.0, version=0, want=1).encode(),
                        11.0, sender=BOB.peer_id)
    assert isinstance(behind, Verdict) and behind.reason is Reason.STALE_VERSION
    assert t.queued == 3 and not t.live_leases()  # queued tasks are not leased any more
    assert t.scores.score(ALICE.peer_id) == t.scores.score(BOB.peer_id) == 0
    assert peer(ALICE).receive(over.encode(), 11.0, sender="t") is Reason.RUN_OVER


def test_staleness_bound_on_results_and_claims() -> None:
    t = make_trainer(k=1)
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 0.0, tps=20.0)
    rows = completions(lease)
    t.publish_version(1, 10.0)
    assert submit(t, p, ALICE, lease, 10.5, version=0, results=rows[:1]).reason is \
        Reason.ACCEPTED  # 0 >= 1 - 1
    assert submit(t, p, ALICE, lease, 10.6, version=2, results=rows[1:2]).reason is \
        Reason.UNKNOWN_VERSION
    t.publish_version(2, 20.0)
    v = submit(t, p, ALICE, lease, 20.5, version=0, results=rows[1:2])
    assert v.reason is Reason.STALE_VERSION
    # The lease is released at once: its uncounted tasks are back in the queue.
    assert t.lease_state(lease.lease_id) is LeaseState.RELEASED
    assert t.queued == 20 - 1
    [c] = t.handle(p.claim(21.0, tokens_per_s=4.0, version=0, want=4).encode(), 21.0,
                   sender=ALICE.peer_id)
    assert isinstance(c, Verdict) and c.reason is Reason.STALE_VERSION


def test_a_stale_claim_costs_nothing_while_the_peer_fetches_a_newer_version() -> None:
    t = make_trainer(k=1)
    for v in (1, 2, 3):
        t.publish_version(v, float(v))  # the bound is now version 2
    p = peer(ALICE)
    cases = [(3, 0.0), (2, 0.0), (1, 0.0), (None, 0.5), (0, 0.5), (4, 0.5)]
    for i, (downloading, cost) in enumerate(cases):
        before = t.scores.score(ALICE.peer_id)
        now = 4.0 + i
        [v] = t.handle(p.claim(now, tokens_per_s=4.0, version=0, want=4,
                               downloading=downloading).encode(), now, sender=ALICE.peer_id)
        assert isinstance(v, Verdict) and v.reason is Reason.STALE_VERSION
        # fetching 3, 2 or even 1 (the first delta of a chain) is catching up; fetching
        # nothing, the version it holds, or one the trainer never published, is not
        assert before - t.scores.score(ALICE.peer_id) == pytest.approx(cost), downloading
    assert t.stats.refused["stale_version"] == len(cases)
    # A chain catch-up of 5 minutes, claiming every 2 s, leaves the peer in good standing.
    for i in range(150):
        now = 20.0 + 2 * i
        t.handle(p.claim(now, tokens_per_s=4.0, version=0, want=4,
                         downloading=1 + i % 3).encode(), now, sender=ALICE.peer_id)
    assert not t.scores.banned(ALICE.peer_id)


def test_bad_shapes_and_foreign_tasks_are_refused() -> None:
    t = make_trainer()
    pa, pb = peer(ALICE), peer(BOB)
    la = get_lease(t, pa, ALICE, 0.0)
    lb = get_lease(t, pb, BOB, 0.0)
    short = [TaskResult(la.tasks[0].task_id, (Completion((1,), (-1.0,)),))]
    assert submit(t, pa, ALICE, la, 1.0, results=short).reason is Reason.BAD_SHAPE
    too_long = [TaskResult(la.tasks[0].task_id, tuple(
        Completion(tuple(range(11)), (0.0,) * 11) for _ in range(2)))]
    assert submit(t, pa, ALICE, la, 1.0, results=too_long).reason is Reason.BAD_SHAPE
    other = completions(lb)[:1]
    res = Result(RUN, la.lease_id, 0, tuple(other), 1100).sign(ALICE)
    [v] = t.handle(res.encode(), 1.1, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.TASK_NOT_IN_LEASE
    twice = completions(la)[:1] * 2
    res = Result(RUN, la.lease_id, 0, tuple(twice), 1200).sign(ALICE)
    [v] = t.handle(res.encode(), 1.2, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.MALFORMED
    assert t.done == frozenset()


def test_garbage_and_wrong_message_kinds_score_the_sender() -> None:
    t = make_trainer()
    assert t.handle(b"\xc1\xc1", 1.0, sender=MALLORY.peer_id) == []
    lease = Lease(b"x" * 16, RUN, ALICE.public_key, (RolloutTask(1, "p"),), 0, 0, 1, 0, 10,
                  1).sign(MALLORY)
    assert t.handle(lease.encode(), 1.0, sender=MALLORY.peer_id) == []
    unsigned = Claim(RUN, 1.0, 0, 1, 1000, signer=MALLORY.public_key, signature=b"\0" * 64)
    assert t.handle(unsigned, 1.0, sender=MALLORY.peer_id) == []
    assert t.stats.refused == {"malformed": 2, "bad_signature": 1}
    assert t.scores.score(MALLORY.peer_id) == -30


# --------------------------------------------------------------------------- scheduling


def test_lease_size_scales_with_throughput() -> None:
    t = make_trainer(n_tasks=500)
    slow = get_lease(t, peer(ALICE), ALICE, 0.0, tps=8.0, want=500)
    fast = get_lease(t, peer(BOB), BOB, 0.0, tps=80.0, want=500)
    # 10 s target at 40 tokens per task: 2 tasks vs 20 tasks.
    assert len(slow.tasks) == 2 and len(fast.tasks) == 20
    slow_timeout = slow.expires_ms - slow.issued_ms
    fast_timeout = fast.expires_ms - fast.issued_ms
    assert slow_timeout == fast_timeout  # both sized to the same target duration
    capped = get_lease(t, peer(MALLORY), MALLORY, 0.0, tps=80.0, want=3)
    assert len(capped.tasks) == 3


def test_observed_speed_overrides_an_inflated_claim() -> None:
    t = make_trainer(n_tasks=500)
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 0.0, tps=20.0)  # 5 tasks
    # It actually ran 8x slower: 5 tasks * 2 completions * 5 tokens over 20 s = 2.5 tok/s.
    assert submit(t, p, ALICE, lease, 20.0).reason is Reason.ACCEPTED
    assert t.speeds.observed(ALICE.peer_id) == pytest.approx(2.5)
    again = get_lease(t, p, ALICE, 21.0, tps=1000.0, want=500)
    # Planned at 2 * observed = 5 tok/s, not 1000: 10 s * 5 / ~31 tokens per task.
    assert len(again.tasks) == 1


def test_timed_out_peer_gets_smaller_leases() -> None:
    t = make_trainer(n_tasks=500)
    p = peer(ALICE)
    first = get_lease(t, p, ALICE, 0.0, tps=80.0, want=500)
    t.tick(first.expires_ms / 1000 + 10)
    second = get_lease(t, p, ALICE, first.expires_ms / 1000 + 11, tps=80.0, want=500)
    assert len(second.tasks) <= len(first.tasks) // 2


def test_downloading_peer_gets_work_that_fits_its_version() -> None:
    t = make_trainer(n_tasks=500, k=1)
    t.publish_version(1, 30.0)  # step interval learned: 30 s
    t.publish_version(2, 60.0)
    p = peer(ALICE)
    # At version 1 (downloading 2), 5 s after the step: 30 - 5 = 25 s of headroom.
    [lease] = t.handle(p.claim(65.0, tokens_per_s=80.0, version=1, want=500,
                               downloading=2).encode(), 65.0, sender=ALICE.peer_id)
    assert isinstance(lease, Lease) and lease.min_version == 1
    assert len(lease.tasks) == 20  # full 10 s target fits
    # 28 s after the step: 2 s left * 0.75 margin: 1.5 s at 80 tok/s = 3 tasks.
    pb = peer(BOB)
    [small] = t.handle(pb.claim(88.0, tokens_per_s=80.0, version=1, want=500,
                                downloading=2).encode(), 88.0, sender=BOB.peer_id)
    assert isinstance(small, Lease) and len(small.tasks) == 3
    # 35 s after (the step is overdue): version 1 is still inside the bound, so it still
    # gets work, the smallest lease; a trainer waiting for rollouts must not be starved.
    pm = peer(MALLORY)
    [one] = t.handle(pm.claim(95.0, tokens_per_s=80.0, version=1, want=500,
                              downloading=2).encode(), 95.0, sender=MALLORY.peer_id)
    assert isinstance(one, Lease) and len(one.tasks) == 1


def test_plan_lease_bounds() -> None:
    cfg = SchedulingConfig(target_lease_s=30.0, max_tasks=50, min_timeout_s=10.0,
                           max_timeout_s=100.0)
    assert plan_lease(cfg, speed=1e6, tokens_per_task=10, want=1000, available=1000).n_tasks == 50
    tiny = plan_lease(cfg, speed=0.001, tokens_per_task=10, want=10, available=10)
    assert tiny.n_tasks == 1 and tiny.timeout_s == 100.0
    none_left = plan_lease(cfg, speed=10, tokens_per_task=10, want=10, available=0)
    assert none_left.n_tasks == 0
    assert staleness_headroom(peer_version=5, latest=5, max_staleness=2, step_interval_s=None,
                              since_publish_s=0) is None
    assert staleness_headroom(peer_version=3, latest=5, max_staleness=2, step_interval_s=10,
                              since_publish_s=4) == pytest.approx(6.0)
    # An overdue step is imminent, but the peer at the latest version still has k intervals.
    assert staleness_headroom(peer_version=5, latest=5, max_staleness=2, step_interval_s=10,
                              since_publish_s=100) == pytest.approx(20.0)
    table = SpeedTable(cfg)
    assert table.effective("p", 100.0) == 100.0
    table.observe("p", tokens=100, tasks=2, seconds=10.0)
    assert table.effective("p", 100.0) == 20.0
    with pytest.raises(ValueError):
        SchedulingConfig(min_tasks=0)


def test_bounded_queue_and_version_order() -> None:
    t = TrainerLeases(TRAINER, LeaseConfig(run=RUN, max_queue=5))
    t.add_tasks([("a", [1])] * 5)
    with pytest.raises(LocalProtocolError):
        t.add_tasks([("b", [1])])
    t.publish_version(3, 1.0)
    with pytest.raises(LocalProtocolError):
        t.publish_version(3, 2.0)


# --------------------------------------------------------------------------- restart (memory)


def test_restore_keeps_leases_meaningful_and_counts_once() -> None:
    store = MemoryLeaseStore()
    t = make_trainer(store=store)
    pa, pb = peer(ALICE), peer(BOB)
    la = get_lease(t, pa, ALICE, 1.0)
    lb = get_lease(t, pb, BOB, 1.0)
    ra = pa.result(la.lease_id, 0, completions(la), 2.0)
    assert t.handle(ra.encode(), 2.0, sender=ALICE.peer_id)[0].reason is Reason.ACCEPTED  # type: ignore[union-attr]
    del t  # crash: only the store survives
    t2 = TrainerLeases.restore(TRAINER, LeaseConfig(run=RUN, max_staleness=1, grace_s=2.0,
                                                    scheduling=SCHED), store, now=500.0)
    assert t2.done == frozenset(la.task_ids)
    # Alice's result arrives again (her verdict was lost): counted once only.
    [v] = t2.handle(ra.encode(), 500.5, sender=ALICE.peer_id)
    assert isinstance(v, Verdict) and v.reason is Reason.DUPLICATE
    # Bob's lease, issued before the crash, still means what it meant (given restart grace).
    assert submit(t2, pb, BOB, lb, 501.0).reason is Reason.ACCEPTED
    assert t2.done == frozenset(la.task_ids) | frozenset(lb.task_ids)
    # New leases do not reuse old ids.
    lc = get_lease(t2, peer(MALLORY), MALLORY, 502.0)
    assert lc.lease_id not in (la.lease_id, lb.lease_id)
    assert not set(lc.task_ids) & t2.done
    assert t2.outstanding == 20 - len(t2.done)


# --------------------------------------------------------------------------- invariants


def check_invariants(t: TrainerLeases, n_tasks: int) -> None:
    from collections import Counter

    pending = [tid for lease in t.live_leases() for tid in lease.task_ids
               if tid not in t.done]
    queued = sorted(t._queue)  # white-box: the queue itself
    assert max(Counter(pending).values(), default=0) <= 2, "a task in 3 leases (2 backups)"
    assert {k: len(v) for k, v in t._holders.items()} == dict(Counter(pending))
    pending = sorted(set(pending))
    assert not set(queued) & set(pending), "a task is both queued and leased"
    assert not (set(queued) | set(pending)) & t.done, "a counted task is still outstanding"
    assert len(queued) == len(set(queued))
    assert set(queued) | set(pending) | t.done == set(range(n_tasks)), "a task was lost"
    assert t.outstanding == n_tasks - len(t.done)


@pytest.mark.parametrize("seed", range(8))
def test_random_operation_sequences_keep_every_task_exactly_once(seed: int) -> None:
    import random

    rng = random.Random(seed)
    store = MemoryLeaseStore()
    n_tasks = 30
    t = make_trainer(n_tasks, store=store, max_leases_per_peer=2, ban_below=-1e9)
    idents = [ALICE, BOB, MALLORY]
    peers = {i.peer_id: peer(i) for i in idents}
    sent: list[tuple[str, bytes]] = []
    now, version = 1.0, 0
    counted: list[int] = []
    for _ in range(150):
        now += rng.choice([0.1, 0.5, 2.0, 8.0])
        op = rng.random()
        ident = rng.choice(idents)
        p = peers[ident.peer_id]
        if op < 0.3:
            claim = p.claim(now, tokens_per_s=rng.uniform(1, 30), version=version,
                            want=rng.randint(1, 10))
            for reply in t.handle(claim.encode(), now, sender=ident.peer_id):
                p.receive(reply, now)
        elif op < 0.6 and p.held:
            held = rng.choice(list(p.held.values()))
            rows = completions(held.lease)
            rng.shuffle(rows)
            res = p.result(held.lease.lease_id, version, rows[:rng.randint(1, len(rows))], now)
            sent.append((ident.peer_id, res.encode()))
            for reply in t.handle(res.encode(), now, sender=ident.peer_id):
                assert isinstance(reply, Verdict)
                if reply.reason is Reason.ACCEPTED:
                    counted.extend(reply.accepted)
                p.receive(reply, now)
        elif op < 0.7 and sent:  # replay something old, from anyone
            src, data = rng.choice(sent)
            sender = rng.choice([src, ident.peer_id])
            for reply in t.handle(data, now, sender=sender):
                assert isinstance(reply, Verdict) and reply.reason is not Reason.ACCEPTED
        elif op < 0.8:
            for hb in p.heartbeats(now):
                for reply in t.handle(hb.encode(), now, sender=ident.peer_id):
                    p.receive(reply, now)
        elif op < 0.85:
            version += 1
            t.publish_version(version, now)
        elif op < 0.9:  # crash and restore from what was committed
            t = TrainerLeases.restore(TRAINER, t.config, store, now)
        else:
            t.tick(now)
            for p_ in peers.values():
                p_.tick(now)
        check_invariants(t, n_tasks)
    assert len(counted) == len(set(counted)), "a task was acknowledged twice"
    assert set(counted) == t.done
    assert store.load().done == t.done
    print(f"seed={seed} counted={len(counted)} refused={dict(t.stats.refused)}")


def test_overdue_lease_gets_a_backup_and_the_first_result_wins() -> None:
    store = MemoryLeaseStore()
    t = make_trainer(n_tasks=4, store=store)
    pa, pb, pm = peer(ALICE), peer(BOB), peer(MALLORY)
    la = get_lease(t, pa, ALICE, 0.0, tps=16.0)  # 4 tasks of 40 tokens: 10 s expected
    assert len(la.tasks) == 4
    [none] = t.handle(pb.claim(5.0, tokens_per_s=16.0, version=0, want=4).encode(), 5.0,
                      sender=BOB.peer_id)
    assert isinstance(none, Verdict) and none.reason is Reason.NO_WORK  # not overdue yet
    lb = get_lease(t, pb, BOB, 16.0, tps=16.0)  # 16 s > 1.5 * 10 s: a backup
    assert lb.task_ids == la.task_ids and t.stats.tasks_backup == 4
    [none] = t.handle(pm.claim(16.5, tokens_per_s=16.0, version=0, want=4).encode(), 16.5,
                      sender=MALLORY.peer_id)
    assert isinstance(none, Verdict) and none.reason is Reason.NO_WORK  # one backup per task
    assert t.outstanding == 4
    # A restart keeps both leases and who holds what.
    t = TrainerLeases.restore(TRAINER, t.config, store, now=17.0)
    check_invariants(t, 4)
    rows = completions(la)
    assert submit(t, pb, BOB, lb, 18.0, results=rows[:2]).reason is Reason.ACCEPTED
    v = submit(t, pa, ALICE, la, 19.0)
    assert v.reason is Reason.SUPERSEDED and set(v.accepted) == set(la.task_ids[:2])
    assert pa.receive(v, 19.0) is Reason.SUPERSEDED
    assert pa.held[la.lease_id].counted == set(la.task_ids[:2])
    assert submit(t, pa, ALICE, la, 19.5, results=rows[2:]).reason is Reason.ACCEPTED
    assert t.lease_state(la.lease_id) is LeaseState.COMPLETED
    assert t.lease_state(lb.lease_id) is LeaseState.SUPERSEDED
    v = submit(t, pb, BOB, lb, 20.0, results=rows[2:])
    assert v.reason is Reason.SUPERSEDED
    assert pb.receive(v, 20.0) is Reason.SUPERSEDED and lb.lease_id not in pb.held
    assert t.done == frozenset(la.task_ids) and t.outstanding == 0
    assert t.scores.score(ALICE.peer_id) >= 0 and t.scores.score(BOB.peer_id) >= 0
    assert store.load().done == t.done
    check_invariants(t, 4)


def test_expiry_of_a_backed_up_lease_does_not_requeue_the_backed_tasks() -> None:
    t = make_trainer(n_tasks=2)
    pa, pb = peer(ALICE), peer(BOB)
    la = get_lease(t, pa, ALICE, 0.0, tps=8.0)  # 2 tasks, 10 s expected
    lb = get_lease(t, pb, BOB, 16.0, tps=8.0)
    assert lb.task_ids == la.task_ids
    [ev] = t.tick(la.expires_ms / 1000 + 10)
    assert ev.lease_id == la.lease_id and ev.requeued == ()  # Bob still holds them
    assert t.queued == 0 and t.outstanding == 2
    assert submit(t, pb, BOB, lb, la.expires_ms / 1000 + 11).reason is Reason.ACCEPTED
    assert t.outstanding == 0


def test_large_result_round_trips_and_counts() -> None:
    """64 tasks x 8 completions x 512 tokens (262,144 tokens, ~3 MB) in one signed result."""
    import time

    sampling = Sampling(max_tokens=512)
    t = TrainerLeases(TRAINER, LeaseConfig(run=RUN, scheduling=SchedulingConfig(
        max_tasks=64, target_lease_s=1e6)))
    t.add_tasks([(f"p{i}", list(range(100))) for i in range(64)], group_size=8,
                sampling=sampling)
    p = peer(ALICE)
    lease = get_lease(t, p, ALICE, 1.0, tps=1e6, want=64)
    assert len(lease.tasks) == 64
    rows = [TaskResult(task.task_id, tuple(
        Completion(tuple(range(512)), tuple([-0.5] * 512)) for _ in range(8)))
        for task in lease.tasks]
    start = time.perf_counter()
    data = p.result(lease.lease_id, 0, rows, 2.0).encode()
    built = time.perf_counter()
    [v] = t.handle(data, 2.0, sender=ALICE.peer_id)
    done = time.perf_counter()
    assert isinstance(v, Verdict) and v.reason is Reason.ACCEPTED and len(v.accepted) == 64
    [acc] = t.take_accepted()
    assert acc.results == tuple(rows)
    print(f"result: {len(data) / 1e6:.1f} MB, sign+encode {built - start:.3f}s, "
          f"trainer decode+verify+accept {done - built:.3f}s")

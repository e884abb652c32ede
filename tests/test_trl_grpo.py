"""TRL's GRPOTrainer generating through swarm, as a user runs it: ``examples/trl_grpo.py``
trains a tiny Qwen3 for 3 steps with 2 ``swarm peer`` processes generating. TRL logs its
loss and reward each step; every peer verifies every version, and its engine's per-tensor
digests equal the trainer's for that version; the trainer replays every task, and no
honest completion is rejected. The run needs the ``trl`` extra
(``make test-trl``); the version
check does not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trl_grpo.py"
STEPS = 3


@pytest.mark.trl
@pytest.mark.timeout(600)
def test_trl_grpo_trains_with_two_swarm_peers_generating(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--workdir",
                          str(tmp_path / "w"), "--warm-start", "40", "--linger", "30",
                          "--replay-fraction", "1", "--collect-timeout", "120"],
                         capture_output=True, text=True, timeout=540, cwd=tmp_path)
    out = run.stdout.splitlines()
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    # every task replayed by the trainer: an honest peer's tokens are the replay's
    assert "rejected" not in run.stderr, run.stderr[-3000:]
    # TRL's own logging, once a step: its loss, reward and the sampling correction that
    # uses the peers' log-probs; swarm's metrics beside them
    logs = [line for line in out if line.startswith("trl log step ")]
    assert [int(re.match(r"trl log step (\d+):", x)[1]) for x in logs] == [1, 2, 3], out
    for line in logs:
        fields = dict(kv.split("=") for kv in line.split(": ", 1)[1].split(", "))
        for key in ("loss", "reward", "sampling/importance_sampling_ratio/mean"):
            assert re.fullmatch(r"-?[0-9.e+-]+", fields[key]), (key, line)
        assert 0.0 <= float(fields["reward"]) <= 1.0
        assert 0.5 < float(fields["sampling/importance_sampling_ratio/mean"]) < 2.0
    assert "swarm/delta_bytes" in logs[-1] and "swarm/sync_s" in logs[-1]
    assert any(x.startswith("{'loss': ") for x in out)  # TRL's printer callback
    assert any(re.fullmatch(rf"trained {STEPS} steps in .* completions from 2 peer\(s\)", x)
               for x in out), out
    versions = list(range(STEPS + 1))  # version 0, one a step (the last on close)
    for name in ("p0", "p1"):
        assert (f"peer {name}: verified versions {versions}; every one with the trainer's "
                "per-tensor digests") in out, out
    sync = next(x for x in out if x.startswith("sync_weights: "))
    assert re.fullmatch(r"sync_weights: [0-9.]+ s on average; a version is [0-9.]+ kB "
                        r"published vs [0-9.]+ kB dense \([0-9.]+x smaller\)", sync), sync


def test_the_adapter_imports_no_trl_until_attached() -> None:
    code = ("import sys, swarm.integrations.trl as t; t.check_trl_version('1.16.0'); "
            "assert not {'trl', 'accelerate', 'datasets'} & set(sys.modules), sys.modules")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_an_untested_trl_version_is_refused_with_a_clear_error() -> None:
    from swarm.integrations.trl import TRLVersionError, check_trl_version

    check_trl_version("1.16.0")
    with pytest.raises(TRLVersionError, match=r"written for TRL 1\.16\.0; this is TRL 1\.17"):
        check_trl_version("1.17.0")

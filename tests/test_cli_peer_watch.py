"""``swarm peer``'s watch over the trainer, in process: the no-manifest warning names who
else signed manifests on the run's topic (a trainer restarted with another key, a wrong
``--trainer``), on stderr and in its JSON event."""

from __future__ import annotations

import argparse
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest

from swarm.cli import peer as cli_peer
from swarm.identity import Identity
from swarm.net.topics import OtherSigners
from swarm.roles.status import Reporter

pytestmark = pytest.mark.timeout(30)

TRAINER = Identity.from_seed(b"t" * 32).peer_id
OTHER = Identity.from_seed(b"o" * 32).peer_id


async def test_the_no_manifest_warning_names_the_signers_seen(
        capsys: pytest.CaptureFixture[str]) -> None:
    others = OtherSigners()
    others.add(OTHER)
    peer: Any = SimpleNamespace(verified=0, version=3, other_signers=others, run_over=None)
    net: Any = SimpleNamespace(connected_peers=frozenset, directory=dict)
    args = argparse.Namespace(trainer=TRAINER, warn_after=0.1, trainer_timeout=0.3,
                              data_dir=None)
    out = io.StringIO()
    with pytest.raises(cli_peer.TrainerGone):
        await cli_peer._watch(peer, net, args, Reporter("p", json_out=out))
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    warned = [e for e in events if e["event"] == "no_manifest"]
    assert len(warned) == 1 and warned[0]["signers"] == [OTHER]
    err = capsys.readouterr().err
    assert f"no manifest from trainer {TRAINER}" in err
    assert f"saw manifests signed by {OTHER}" in err


def test_a_banned_peer_says_so_once_in_plain_words() -> None:
    """An adversarial trial: a banned cheater, restarted, printed only `version N
    verified ...; leases 0` lines, never why it got no work."""
    out = io.StringIO()
    Reporter("p", human_out=out).emit("work_refused", reason="banned")
    assert out.getvalue() == ("the trainer BANNED this peer and leases it no work (its log "
                              "says which results or messages it refused); versions are "
                              "still followed\n")

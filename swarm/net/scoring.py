"""Moved to :mod:`swarm.protocol.scoring`; kept only until ``swarm/net/node.py`` imports it
from there, then deleted."""

from swarm.protocol.scoring import PeerScores, ScoreConfig

__all__ = ["PeerScores", "ScoreConfig"]

"""The ``swarm`` command."""

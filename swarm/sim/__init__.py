"""Virtual-time simulation of a swarm distributing weight deltas (runs the real exchange core)."""

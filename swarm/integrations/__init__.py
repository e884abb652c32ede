"""Adapters that plug swarm into the stacks RL users run (vLLM's weight-transfer framework).

Nothing here is imported by the core: each adapter imports its framework lazily.
"""

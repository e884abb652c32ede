"""Benchmarks run by ``swarm bench ...``: each prints ratios measured side by side in one run."""

"""The end-to-end demo's learning part: a toy task, a tiny Qwen3 policy and GRPO.

- :mod:`swarm.demo.task`: prompts and the programmatic reward (pure Python, no torch).
- :mod:`swarm.demo.model`: the tiny model built from a config, inference states, delta
  density.
- :mod:`swarm.demo.grpo`: ``generate`` (rollout peers), ``train_step`` (trainer) and
  ``run_local`` (the whole loop in one process).

Importing this package imports nothing heavy; torch loads with ``model`` or ``grpo``.
``python -m swarm.demo`` trains locally and prints the reward curve.
"""

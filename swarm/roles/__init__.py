"""Role drivers (trainer, rollout peer, bootstrap) and their persistent state."""

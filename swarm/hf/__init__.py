"""Hugging Face side of the examples: a shipped offline tokenizer and a text RL task."""

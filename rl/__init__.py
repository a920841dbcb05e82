"""Flyte-free GRPO: config, advantages, loss, KL, rewards, generation and training back-ends."""

"""Flyte tasks: thin adapters that read handles, call pure code in `rl`, write results, return handles."""

"""Flyte workflows: control flow only."""

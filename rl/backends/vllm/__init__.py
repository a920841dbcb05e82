"""The vLLM generation back-end (vLLM's offline engine, in process). Imports vLLM only when used."""

"""The Megatron-core policy back-end."""

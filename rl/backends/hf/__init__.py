"""The transformers (Hugging Face) back-ends: decode loop, shared-prompt logprobs, packed LM head, GRPO update."""

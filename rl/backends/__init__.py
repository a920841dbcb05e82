"""Back-ends behind two interfaces (`rl.backends.interfaces`): generation (transformers, vLLM) and policy
(transformers), chosen by name from the config (`rl.backends.registry`) and imported only when chosen."""

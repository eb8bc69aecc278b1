"""Framework integrations (layer L4): the only modules that import deepspeed or megatron.

Import the submodule you need (``ds_resilience.integrations.deepspeed``); this package imports
nothing heavy by itself.
"""

__all__: list[str] = []

"""Structured outputs in the engine core: backend selection, the grammar manager, the logits bitmask.

The backends are plugins (kind `structured_output`, pagedllm.protocols.structured_output); this package picks
one per request (selection.py), compiles grammars off the step loop and fills each step's batch bitmask
(manager.py), and applies that bitmask to the logits on the device (bitmask.py).
"""

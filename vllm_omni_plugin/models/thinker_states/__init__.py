"""The Qwen3-Omni thinker's hidden states (a decoder layer's input, and the input embeddings) out
of vLLM's engine, per request, as each step produces them (worker.py: in vLLM's worker;
store.py: in the stage process; engine.py: the stage's switch)."""

from .engine import attach, opt_in, requested
from .settings import ADDITIONAL_CONFIG_KEY, REQUEST_KEY
from .store import StatesChunk, StatesOverflow, ThinkerStatesStore

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "REQUEST_KEY",
    "StatesChunk",
    "StatesOverflow",
    "ThinkerStatesStore",
    "attach",
    "opt_in",
    "requested",
]

"""The Qwen3-Omni talker as a batched torch engine (no vLLM import): thinker text -> codec frames.

See `engine.py` (requests, steps), `prompt.py` (the conditioning, as transformers builds it) and
`runner.py` (the batched forward passes over transformers' own talker modules).
"""

from .engine import TalkerCapacityError, TalkerEngine, TalkerOutput

__all__ = ["TalkerCapacityError", "TalkerEngine", "TalkerOutput"]

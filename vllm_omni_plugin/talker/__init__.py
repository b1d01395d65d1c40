"""The Qwen3-Omni talker as a batched torch engine: thinker text -> codec frames.

See `engine.py` (requests, steps), `prompt.py` (the conditioning, as transformers builds it),
`runner.py` (the batched forward passes over transformers' own talker modules), `layers.py`
(one decoder layer with vLLM's fused kernels), `cache.py` (one KV slot per request) and
`graphs.py` (the decode step as CUDA graphs).
"""

from .engine import TalkerCapacityError, TalkerEngine, TalkerOutput, TalkerPromptError

__all__ = ["TalkerCapacityError", "TalkerEngine", "TalkerOutput", "TalkerPromptError"]

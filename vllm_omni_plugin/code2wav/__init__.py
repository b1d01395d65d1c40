"""Code2Wav as a batched generation engine: Qwen3-Omni codec frames -> 24 kHz audio.

torch and transformers only (no vLLM import), like the diffusion engine. `Code2WavEngine`
takes codec frames per request as the talker writes them and decodes the chunks of several
requests in one batched forward; see `engine.py` for the chunking and `decoder.py` for the model.
"""

from .config import Code2WavEngineConfig
from .decoder import Code2WavDecoder
from .engine import AudioChunk, Code2WavEngine

__all__ = ["AudioChunk", "Code2WavDecoder", "Code2WavEngine", "Code2WavEngineConfig"]

"""Qwen3-Omni speech out of the thinker's text: talker engine -> Code2Wav engine, batched.

    gen = SpeechGenerator("/path/to/Qwen3-Omni")         # talker + Code2Wav weights
    gen.add_request(rid, prompt_ids, voice="ethan", max_frames=64)
    gen.add_text(rid, new_thinker_ids, finished=False)    # as the thinker writes them
    for out in gen.step():                                # SpeechOutput per request with news
        out.audio      # float32 mono samples at 24 kHz (SAMPLE_RATE), a piece of the waveform
        out.codes      # [num_code_groups, n] codec frames written this step
        out.finished   # the request's last audio

`prompt_ids` are the thinker's prompt ids (the chat template applied, generation prompt on);
the text ids are the thinker's generated ids, in order, including its EOS if it wrote one.
Pieces of audio concatenate to the request's waveform: the first after 4 frames (0.32 s of
audio), then every 25 frames, each decoded with 25 frames of context (Code2WavEngineConfig).
Greedy: the frames equal transformers' talker (`talker_do_sample=False`) and the waveform its
`generate(..., return_audio=True)` within max abs 0.01 (tests/qwen3_omni).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni_plugin.code2wav import Code2WavEngine, Code2WavEngineConfig
from vllm_omni_plugin.talker import TalkerEngine

SAMPLE_RATE = 24000


@dataclass
class SpeechOutput:
    request_id: str
    #: float32 mono samples at 24 kHz (may be empty)
    audio: np.ndarray
    #: `[num_code_groups, n]` codec frames the talker wrote this step
    codes: torch.Tensor
    #: the request's last output
    finished: bool


class SpeechGenerator:
    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_requests: int = 256,
        first_chunk_frames: int = 4,
        chunk_frames: int = 25,
        left_context_frames: int = 25,
    ):
        self.talker = TalkerEngine(model, device, dtype, max_batch_size, max_requests)
        self.code2wav = Code2WavEngine(
            Code2WavEngineConfig(
                model=model,
                device=device,
                dtype=dtype,
                max_batch_size=max_batch_size,
                max_requests=max_requests,
                first_chunk_frames=first_chunk_frames,
                chunk_frames=chunk_frames,
                left_context_frames=left_context_frames,
            )
        )
        self.num_groups = self.talker.runner.num_groups
        self.voices = sorted(self.talker.speakers)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        voice: str = "ethan",
        max_frames: int = 4096,
        prompt_hidden: torch.Tensor | None = None,
    ) -> None:
        self.talker.add_request(request_id, prompt_ids, voice, max_frames, prompt_hidden)
        try:
            self.code2wav.add_request(request_id)
        except Exception:
            self.talker.abort(request_id)
            raise

    def add_text(self, request_id: str, ids: list[int], finished: bool = False) -> bool:
        return self.talker.add_text(request_id, ids, finished)

    def abort(self, request_id: str) -> None:
        self.talker.abort(request_id)
        self.code2wav.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.talker.has_unfinished() or self.code2wav.has_unfinished()

    def step(self) -> list[SpeechOutput]:
        """One talker step (a frame for every ready request), then one Code2Wav step (a chunk
        for every request with enough frames), all batched."""
        codes: dict[str, torch.Tensor] = {}
        for out in self.talker.step():
            codes[out.request_id] = out.codes
            self.code2wav.add_frames(out.request_id, out.codes, finished=out.finished)
        outputs = {
            chunk.request_id: SpeechOutput(
                chunk.request_id,
                chunk.samples,
                codes.pop(chunk.request_id, self._no_codes()),
                chunk.finished,
            )
            for chunk in self.code2wav.step()
        }
        for rid, frames in codes.items():
            outputs[rid] = SpeechOutput(rid, np.zeros(0, np.float32), frames, False)
        return list(outputs.values())

    def _no_codes(self) -> torch.Tensor:
        return torch.zeros(self.num_groups, 0, dtype=torch.long)

"""transformers' Qwen3-Omni run greedily: the reference the pipeline's parity tests compare to.

`reference_generate(model, input_ids, ...)` runs `Qwen3OmniMoeForConditionalGeneration.generate`
with the thinker greedy (fixed `thinker_max_new_tokens`), the talker greedy
(`talker_do_sample=False`, repetition penalty 1.0, so the code predictor is greedy too) and a
frame cap, and records what each stage wrote:

- `text_ids`: the thinker's generated ids (prompt excluded, EOS included if written);
- `codes`: the codec frames, `[num_code_groups, num_frames]` int64 (all code groups), read off
  Code2Wav's input with a forward pre-hook (transformers decodes up to 300 frames in one call);
- `waveform`: float32 `[num_samples]` at 24 kHz, as `generate(..., return_audio=True)` returns it.

transformers' talker writes a frame's first code group in step k and the other groups at the
start of step k + 1 (its code predictor runs while preparing the next input), so `n` talker
tokens give `n - 1` frames; `max_frames` therefore asks the talker for `max_frames + 1` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_RATE = 24000


@dataclass
class ReferenceOutput:
    text_ids: list[int]
    codes: torch.Tensor  # [num_code_groups, num_frames] int64
    waveform: np.ndarray  # float32, 24 kHz

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[-1])


def load_reference_model(model_dir, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def chat_input_ids(model_dir, text: str) -> torch.Tensor:
    """`[1, L]` ids of one user turn through the checkpoint's chat template (generation prompt on)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


@torch.no_grad()
def reference_generate(
    model,
    input_ids: torch.Tensor,
    speaker: str = "ethan",
    thinker_max_new_tokens: int = 8,
    max_frames: int = 16,
    **inputs,
) -> ReferenceOutput:
    """One request (batch 1), greedy end to end; see the module docstring."""
    if input_ids.shape[0] != 1:
        raise ValueError("reference_generate takes one request (input_ids of shape [1, L])")
    captured: list[torch.Tensor] = []

    def record(_module, args):
        captured.append(args[0].detach().clone())

    hook = model.code2wav.register_forward_pre_hook(record)
    try:
        sequences, wav = model.generate(
            input_ids=input_ids,
            speaker=speaker,
            return_audio=True,
            thinker_max_new_tokens=thinker_max_new_tokens,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            talker_max_new_tokens=max_frames + 1,
            **inputs,
        )
    finally:
        hook.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one Code2Wav call, saw {len(captured)} (over 300 frames?)")
    return ReferenceOutput(
        text_ids=sequences[0, input_ids.shape[1] :].tolist(),
        codes=captured[0][0].to(torch.long),
        waveform=wav.reshape(-1).float().cpu().numpy(),
    )

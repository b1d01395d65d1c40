"""transformers' Qwen3-Omni Code2Wav loaded from the checkpoint, decoding windows in batches.

The decoder is causal (causal convolutions, causal sliding-window attention), so windows of
different lengths are right-padded to one length, decoded together and each cut at its own
length: padding never reaches the samples kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Code2WavDecoder:
    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
        from safetensors import safe_open
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2Wav,
        )

        model_dir = Path(model_dir)
        config = Qwen3OmniMoeConfig.from_pretrained(model_dir).code2wav_config
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        model = Qwen3OmniMoeCode2Wav._from_config(config)
        state = {}
        for shard in _shards(model_dir):
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if key.startswith("code2wav."):
                        state[key[len("code2wav.") :]] = f.get_tensor(key)
        if not state:
            raise ValueError(f"{model_dir}: no code2wav.* weights (a thinker-only checkpoint?)")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "code_offset"]
        if missing or unexpected:
            raise ValueError(f"code2wav weights: missing {missing}, unexpected {unexpected}")
        self.model = model.to(self.device, self.dtype).eval()
        self.num_groups = config.num_quantizers
        self.codebook_size = config.codebook_size
        self.samples_per_frame = int(self.model.total_upsample)
        self.holdback = holdback_samples(config)

    def output_length(self, num_frames: int) -> int:
        """Samples the decoder writes for `num_frames` frames decoded at once."""
        return num_frames * self.samples_per_frame - self.holdback

    @torch.inference_mode()
    def decode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """`windows[i]`: int `[num_groups, T_i]` -> float32 CPU `[T_i * 1920 - holdback]` each."""
        if not windows:
            return []
        for w in windows:
            if w.dim() != 2 or w.shape[0] != self.num_groups or w.shape[1] < 1:
                raise ValueError(f"codes: expected [{self.num_groups}, T>=1], got {list(w.shape)}")
        longest = max(w.shape[1] for w in windows)
        batch = torch.zeros(len(windows), self.num_groups, longest, dtype=torch.long)
        for i, w in enumerate(windows):
            batch[i, :, : w.shape[1]] = w
        if int(batch.min()) < 0 or int(batch.max()) >= self.codebook_size:
            raise ValueError(f"codes: outside the codebook [0, {self.codebook_size})")
        wav = self.model(batch.to(self.device))[:, 0].float().cpu()
        return [wav[i, : self.output_length(w.shape[1])] for i, w in enumerate(windows)]


def holdback_samples(config) -> int:
    """Samples a decode of T frames writes fewer than T * 1920: each decoder block's causal
    transposed convolution (kernel 2r, stride r, r trimmed on both sides) turns L into
    (L - 1) * r, so the last samples wait for the next frame. 555 for (8, 5, 4, 3) x (2, 2)."""
    frames = 16
    length = frames
    for factor in config.upsampling_ratios:
        length *= factor
    for rate in config.upsample_rates:
        length = (length - 1) * rate
    total = 1
    for factor in list(config.upsampling_ratios) + list(config.upsample_rates):
        total *= factor
    return frames * total - length


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    return [model_dir / "model.safetensors"]

"""transformers' Qwen3-Omni Code2Wav loaded from the checkpoint, decoding windows in batches.

The decoder is causal (causal convolutions, causal sliding-window attention), so windows of
different lengths are right-padded to one length, decoded together and each cut at its own
length: padding never reaches the samples kept. Left padding would not be exact: the causal
convolutions and the attention of a window's first frames would read the padding frames.
"""

from __future__ import annotations

import inspect
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
        self._use(model, device, dtype)

    @classmethod
    def from_module(cls, model, device: str = "cpu", dtype: str = "float32") -> Code2WavDecoder:
        """A decoder around an already built `Qwen3OmniMoeCode2Wav` (weights as they are)."""
        decoder = cls.__new__(cls)
        decoder._use(model, device, dtype)
        return decoder

    def _use(self, model, device: str, dtype: str) -> None:
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.model = model.to(self.device, self.dtype).eval()
        config = model.config
        self.num_groups = config.num_quantizers
        self.codebook_size = config.codebook_size
        self.samples_per_frame = int(self.model.total_upsample)
        self.holdback = holdback_samples(config)
        # window length -> (attention masks, positions) of `forward_static`
        self._statics: dict[int, tuple[dict, torch.Tensor]] = {}

    def output_length(self, num_frames: int) -> int:
        """Samples the decoder writes for `num_frames` frames decoded at once."""
        return num_frames * self.samples_per_frame - self.holdback

    def check_codes(self, codes: torch.Tensor) -> None:
        """Codes outside the codebook are refused (on the host: no device sync)."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes: outside the codebook [0, {self.codebook_size})")

    @torch.inference_mode()
    def decode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """`windows[i]`: int `[num_groups, T_i]` -> float32 CPU `[T_i * 1920 - holdback]` each.
        Any lengths, eager (the engine decodes its chunks through `ChunkDecoder`)."""
        if not windows:
            return []
        for w in windows:
            if w.dim() != 2 or w.shape[0] != self.num_groups or w.shape[1] < 1:
                raise ValueError(f"codes: expected [{self.num_groups}, T>=1], got {list(w.shape)}")
        longest = max(w.shape[1] for w in windows)
        batch = torch.zeros(len(windows), self.num_groups, longest, dtype=torch.long)
        for i, w in enumerate(windows):
            batch[i, :, : w.shape[1]] = w
        self.check_codes(batch)
        wav = self.model(batch.to(self.device))[:, 0].float().cpu()
        return [wav[i, : self.output_length(w.shape[1])] for i, w in enumerate(windows)]

    def prepare(self, window: int) -> None:
        """Build the attention masks and positions of `window`-frame batches once (outside any
        CUDA graph capture: transformers' mask builders may inspect their inputs on the host)."""
        if window in self._statics:
            return
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        body = self.model.pre_transformer
        embeds = torch.zeros(
            1, window, body.config.hidden_size, device=self.device, dtype=self.dtype
        )
        positions = torch.arange(window, device=self.device).unsqueeze(0)
        kwargs = {
            "config": body.config,
            "inputs_embeds": embeds,
            "attention_mask": None,
            "past_key_values": None,
            "position_ids": positions,
        }
        if "cache_position" in inspect.signature(create_causal_mask).parameters:
            kwargs["cache_position"] = positions[0]  # transformers before 5.19 takes it
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if body.has_sliding_layers:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        self._statics[window] = (masks, positions)

    def forward_static(self, codes: torch.Tensor) -> torch.Tensor:
        """int `[B, num_groups, W]` on the device -> float32 `[B, W * 1920 - holdback]`.

        transformers' Code2Wav forward with the masks and positions of W built beforehand
        (`prepare(W)`): every call of one shape launches the same kernels and none reads a
        tensor on the host, so it can be captured as a CUDA graph. Call under inference mode."""
        masks, positions = self._statics[codes.shape[2]]
        model = self.model
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        hidden = model.pre_transformer(
            inputs_embeds=hidden, attention_mask=masks, position_ids=positions
        ).last_hidden_state
        hidden = hidden.permute(0, 2, 1)
        for blocks in model.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in model.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)[:, 0].float()


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

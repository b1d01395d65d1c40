"""The talker's conditioning, built from the thinker's ids (and hidden states) as transformers'
`Qwen3OmniMoeForConditionalGeneration.generate` builds it, for one request:

- prefill embeddings: the user turns (text ids -> thinker embedding -> `text_projection`;
  audio/image/video positions -> thinker hidden state at `accept_hidden_layer` ->
  `hidden_projection`), then the assistant head: the projected `<|im_start|>assistant\\n`,
  four `tts_pad`, `tts_bos` and the first generated token, added to the codec ids (zeros,
  nothink, think bos/eos, speaker, codec pad, codec bos);
- trailing text: the projected generated tokens from the second on, then `tts_eos`; the talker
  adds entry k to its input at decode step k (`tts_pad` once past the end).
"""

from __future__ import annotations

import torch


class TalkerConditioner:
    """Projects thinker ids / hidden states into the talker's input space."""

    def __init__(self, config, thinker_embedding: torch.nn.Embedding, talker):
        self.config = config  # Qwen3OmniMoeConfig
        self.embed = thinker_embedding
        self.talker = talker  # Qwen3OmniMoeTalkerForConditionalGeneration
        tcfg = config.talker_config
        self.mm_ids = torch.tensor(
            [
                config.thinker_config.audio_token_id,
                config.thinker_config.image_token_id,
                config.thinker_config.video_token_id,
            ]
        )
        specials = torch.tensor(
            [[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]]
        )
        with torch.inference_mode():
            bos, eos, pad = self.project_text(specials.to(self.device))[0]
        self.tts_bos, self.tts_eos, self.tts_pad = bos, eos, pad
        self.codec_head_ids = [
            tcfg.codec_nothink_id,
            tcfg.codec_think_bos_id,
            tcfg.codec_think_eos_id,
            None,  # speaker
            tcfg.codec_pad_id,
            tcfg.codec_bos_id,
        ]

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def project_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.talker.text_projection(self.embed(ids))

    def check_prompt(self, prompt_ids: list[int], has_hidden: bool) -> None:
        """ValueError for a prompt the talker cannot condition on: no assistant turn to speak
        (e.g. rendered without the generation prompt), or media in a user turn without the
        thinker's hidden states. Checked when a request arrives, so none reaches a step."""
        self._assistant_start(prompt_ids)
        if not has_hidden:
            ids = torch.tensor(prompt_ids)
            if bool((self._user_mask(ids) & torch.isin(ids, self.mm_ids.cpu())).any()):
                raise ValueError(
                    "the prompt has audio/image/video: the thinker's hidden states are required"
                )

    def media_positions(self, prompt_ids: list[int]) -> int:
        """How many prompt positions hold an audio/image/video token: the rows of the thinker's
        `media_hidden` a request with this prompt carries."""
        return int(torch.isin(torch.tensor(prompt_ids), self.mm_ids.cpu()).sum())

    def positions(self, prompt_ids: list[int], grids: list) -> tuple[torch.Tensor, int]:
        """(`[3, prefill_length]` positions, decode delta) of the prefill (positions.py);
        `grids` one VisualGrid per image/video item of the whole prompt, in prompt order (those
        outside the user turns are not spoken to)."""
        from .positions import talker_positions

        tcfg = self.config.talker_config
        visual = (tcfg.image_token_id, tcfg.video_token_id)
        ids = torch.tensor(prompt_ids)
        user = self._user_mask(ids).tolist()
        starts = [
            i
            for i, t in enumerate(prompt_ids)
            if t in visual and (i == 0 or prompt_ids[i - 1] != t)
        ]
        if len(starts) != len(grids):
            raise ValueError(f"{len(starts)} image/video runs in the prompt, {len(grids)} items")
        spoken = [g for start, g in zip(starts, grids, strict=True) if user[start]]
        head = [self.config.tts_pad_token_id] * (self.prefill_length(prompt_ids) - sum(user))
        return talker_positions(
            ids[torch.tensor(user, dtype=torch.bool)].tolist() + head,
            spoken,
            image_token_id=tcfg.image_token_id,
            video_token_id=tcfg.video_token_id,
            spatial_merge_size=tcfg.spatial_merge_size,
            position_id_per_seconds=tcfg.position_id_per_seconds,
        )

    def prefill_length(self, prompt_ids: list[int]) -> int:
        """Positions `prefill` makes of a prompt: its user-turn ids and the 9-entry assistant
        head (3 head ids, 4 pads, text bos, the first generated token)."""
        return int(self._user_mask(torch.tensor(prompt_ids)).sum()) + 9

    def _assistant_start(self, prompt_ids: list[int]) -> int:
        """Index of the last `<|im_start|>assistant\\n` head (its 3 ids open the speech)."""
        cfg = self.config
        starts = [
            i
            for i in range(len(prompt_ids) - 1)
            if prompt_ids[i] == cfg.im_start_token_id
            and prompt_ids[i + 1] == cfg.assistant_token_id
        ]
        if not starts:
            raise ValueError("the prompt has no '<|im_start|>assistant' turn")
        if len(prompt_ids) - starts[-1] < 3:
            raise ValueError("the assistant turn must open with '<|im_start|>assistant\\n'")
        return starts[-1]

    @torch.inference_mode()
    def prefill(
        self,
        prompt_ids: list[int],
        first_token: int,
        speaker_id: int,
        media_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[L, talker_hidden]` prefill embeddings of one request (check_prompt passed).

        `media_hidden` `[media_positions(prompt_ids), thinker_hidden]`: the thinker's hidden
        state at `accept_hidden_layer` of each audio/image/video position of the prompt, in
        order (those of the user turns condition the talker); needed when a user turn has
        media."""
        # Every index is worked out on the host and crosses to the device before any compute
        # is queued, so the only wait on the device is the caller's read of the result. On a
        # GPU shared with busy engines each wait costs a time slice, and a copy from pageable
        # host memory waits for the stream like a read does.
        ids = torch.tensor(prompt_ids)
        user = self._user_mask(ids)
        mm = torch.isin(ids, self.mm_ids)
        sel_mm = mm[user]
        a = self._assistant_start(prompt_ids)
        codec_ids = [speaker_id if i is None else i for i in self.codec_head_ids]
        host = [
            ids[user & ~mm],
            torch.tensor(prompt_ids[a : a + 3] + [first_token]),
            torch.tensor(codec_ids),
            (~sel_mm).nonzero().squeeze(1),
            sel_mm.nonzero().squeeze(1),
        ]
        text_ids, head_ids, codec_ids, text_rows, media_rows = (
            torch.cat(host).to(self.device).split([len(t) for t in host])
        )
        hidden = None
        if len(media_rows):
            rows = user[mm].to(media_hidden.device)
            hidden = media_hidden[rows].to(self.device, self.tts_pad.dtype)

        user_text = self.project_text(text_ids)
        user_part = user_text.new_empty(len(sel_mm), user_text.shape[-1])
        user_part.index_copy_(0, text_rows, user_text)
        if hidden is not None:
            user_part.index_copy_(0, media_rows, self.talker.hidden_projection(hidden))
        head = self.project_text(head_ids)
        text = torch.cat(
            [head[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], head[3:4]], dim=0
        )
        codec = self.talker.get_input_embeddings()(codec_ids)
        codec = torch.cat([codec.new_zeros(3, codec.shape[-1]), codec], dim=0)
        return torch.cat([user_part, text + codec.to(text.dtype)], dim=0)

    @torch.inference_mode()
    def trailing(self, generated_ids: list[int]) -> torch.Tensor:
        """`[n, talker_hidden]`: projected generated tokens 2.. (the entries known so far)."""
        if len(generated_ids) <= 1:
            return self.tts_pad.new_zeros(0, self.tts_pad.shape[-1])
        return self.project_text(torch.tensor(generated_ids[1:], device=self.device))

    def _user_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions whose turn (the token after the latest `<|im_start|>`) is the user's."""
        cfg = self.config
        pos = torch.arange(len(ids), device=ids.device)
        starts = torch.where(ids == cfg.im_start_token_id, pos, torch.full_like(pos, -1))
        previous = torch.cummax(starts, dim=0).values.clamp_min(0)
        role = ids[(previous + 1).clamp_max(len(ids) - 1)]
        return role == cfg.user_token_id


class _ConditionerWeights(torch.nn.Module):
    """The talker tensors the conditioning reads: the two projections and the codec embedding."""

    def __init__(self, talker_config):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        super().__init__()
        self.text_projection = hf.Qwen3OmniMoeTalkerResizeMLP(talker_config)
        self.hidden_projection = hf.Qwen3OmniMoeTalkerResizeMLP(talker_config)
        text = talker_config.text_config
        self.codec_embedding = torch.nn.Embedding(text.vocab_size, text.hidden_size)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.codec_embedding


_OWN = {
    "thinker.model.embed_tokens.weight": "embed",
    "talker.model.codec_embedding.weight": "codec_embedding.weight",
}
_PROJECTIONS = ("talker.text_projection.", "talker.hidden_projection.")


def load_conditioner(model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A TalkerConditioner from a Qwen3-Omni checkpoint, reading only the tensors it needs (the
    thinker's token embedding, the talker's projections and codec embedding), not the talker."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import Qwen3OmniMoeConfig

    model_dir = Path(model_dir)
    config = Qwen3OmniMoeConfig.from_pretrained(model_dir)
    weights = _ConditionerWeights(config.talker_config)
    text = config.thinker_config.text_config
    embed = torch.nn.Embedding(text.vocab_size, text.hidden_size)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state = {}
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for key in f.keys():
                if key in _OWN:
                    state[_OWN[key]] = f.get_tensor(key)
                elif key.startswith(_PROJECTIONS):
                    state[key.removeprefix("talker.")] = f.get_tensor(key)
                else:
                    continue
    if "embed" not in state:
        raise ValueError(f"{model_dir}: no thinker.model.embed_tokens.weight")
    embed.weight.data.copy_(state.pop("embed"))
    missing, unexpected = weights.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: talker conditioning weights missing {missing}")
    weights = weights.to(device, dtype).eval()
    return TalkerConditioner(config, embed.to(device, dtype).eval(), weights)

"""Does a GLM-Image checkpoint's processor give vLLM one image placeholder per image item?

vLLM's multimodal profiling (and vLLM-Omni's GLM-Image AR model, which declares image input for
image-to-image) runs a dummy image of `vision_config.image_size` pixels through the checkpoint's
own `GlmImageProcessor` at start-up. The processor must expand the `<|image|>` token of the
prompt to exactly as many copies of the AR config's `image_token_id` as the image grid it
returns implies (t * h * w of the source grid: one vision patch per token, no spatial merge);
vLLM then looks for one contiguous run of that length per image and refuses to start otherwise
("Expected there to be 1 prompt placeholders corresponding to 1 image items, but instead found
0").

`check(checkpoint_dir)` reproduces that check with transformers alone, both ways a server feeds
the processor: the chat template with an image content item, and a prompt that already holds
the image token. `python -m vllm_omni_plugin.testing.glm_image_placeholders DIR` prints the
result; where vLLM 0.26 and vLLM-Omni are installed (the GPU machine) it also runs vLLM's own
profiling dummy through vLLM-Omni's registered GLM-Image processor and prints what vLLM finds.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

DUMMY_TEXT = "A beautiful image."


@dataclass
class PlaceholderReport:
    path: str  # "chat_template" or "prompt_token"
    image_token_id: int
    source_grid: list[int]
    expected: int  # tokens the grid implies (what vLLM looks for)
    image_tokens: int  # image_token_id occurrences in the prompt ids
    runs: list[int]  # lengths of the contiguous image_token_id runs

    @property
    def ok(self) -> bool:
        return self.expected >= 1 and self.runs == [self.expected]


def _runs(ids: list[int], token: int) -> list[int]:
    runs: list[int] = []
    length = 0
    for i in [*ids, None]:
        if i == token:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def check(checkpoint_dir: str | Path, processor=None) -> list[PlaceholderReport]:
    """One report per way of feeding the processor; each `.ok` when vLLM would find one
    placeholder of the right length for the one dummy image."""
    from PIL import Image
    from transformers import AutoConfig, GlmImageProcessor

    root = Path(checkpoint_dir)
    config = AutoConfig.from_pretrained(root / "vision_language_encoder")
    if processor is None:
        processor = GlmImageProcessor.from_pretrained(root / "processor")
    side = config.vision_config.image_size
    image = Image.new("RGB", (side, side), (127, 127, 127))
    token = config.image_token_id

    chat = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": DUMMY_TEXT},
                ],
            }
        ],
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    direct = processor(
        text=processor.image_token + DUMMY_TEXT,
        images=[image],
        return_tensors="pt",
        target_h=1024,
        target_w=1024,
    )
    reports = []
    for path, out in (("chat_template", chat), ("prompt_token", direct)):
        ids = out["input_ids"][0].tolist()
        # Source grids come first; the target grid(s) of the generated image follow.
        grid = out["image_grid_thw"][0].tolist()
        expected = grid[0] * grid[1] * grid[2]
        reports.append(
            PlaceholderReport(path, token, grid, expected, ids.count(token), _runs(ids, token))
        )
    return reports


def _vllm_profile(root: Path) -> str:
    """vLLM's own profiling dummy and a real non-square image through vLLM-Omni's GLM-Image
    processor (vLLM 0.26 API).

    Also runs on a CPU box without installing either into the project's environment:
    `pip install --no-deps --target DIR vllm-omni==0.26.0` (plus its pure-Python needs, e.g.
    aenum and prettytable, into the same kind of folder), then put DIR and vLLM 0.26's sources
    (`.venv/vllm-seam-sources/0.26.0`, pure Python) first on PYTHONPATH.
    """
    try:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.processing import ProcessorInputs
        from vllm.multimodal.processing.context import TimingContext
        from vllm_omni.engine.arg_utils import register_omni_models_to_vllm
    except ImportError as exc:
        return f"skipped: {exc}"
    if not hasattr(MULTIMODAL_REGISTRY, "get_dummy_mm_inputs"):
        return "skipped: this vLLM has no MULTIMODAL_REGISTRY.get_dummy_mm_inputs (0.26 API)"
    # vLLM-Omni's models reach vLLM's registry through its general plugin; without this the
    # registry answers with vLLM's generic processor and the check proves nothing.
    register_omni_models_to_vllm()
    config = ModelConfig(
        model=str(root / "vision_language_encoder"),
        tokenizer=str(root / "processor"),
        trust_remote_code=True,
    )
    try:
        processor = MULTIMODAL_REGISTRY.create_processor(config)
        out = MULTIMODAL_REGISTRY.get_dummy_mm_inputs(config, {"image": 1})
    except Exception as exc:  # the start-up failure this module is about
        return f"FAILED: {type(exc).__name__}: {exc}"
    found = [f"processor {type(processor).__name__}", f"dummy {_ranges(out)}"]
    from PIL import Image

    image = Image.new("RGB", (96 * 8, 64 * 8), (40, 90, 200))  # non-square, a real upload
    items = processor.info.parse_mm_data({"image": [image]})
    tokenizer = processor.info.ctx.tokenizer
    text = "<|image|>" + DUMMY_TEXT
    for label, prompt in (("text", text), ("tokens", tokenizer.encode(text))):
        try:
            res = processor.apply(
                ProcessorInputs(prompt=prompt, mm_data_items=items), TimingContext()
            )
        except Exception as exc:
            return f"FAILED on a real image ({label} prompt): {type(exc).__name__}: {exc}"
        found.append(f"{image.size[0]}x{image.size[1]} image, {label} prompt {_ranges(res)}")
    return "ok: placeholders " + "; ".join(found)


def _ranges(out) -> dict:
    return {m: [(r.offset, r.length) for r in v] for m, v in out["mm_placeholders"].items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vllm_omni_plugin.testing.glm_image_placeholders CHECKPOINT_DIR")
        return 2
    root = Path(args[0])
    reports = check(root)
    for r in reports:
        status = "ok" if r.ok else "MISMATCH"
        print(
            f"{r.path}: {status}: image_token_id {r.image_token_id}, source grid {r.source_grid} "
            f"-> {r.expected} tokens expected; runs found {r.runs}"
        )
    print("vLLM profiling dummy:", _vllm_profile(root))
    print(json.dumps({"ok": all(r.ok for r in reports)}))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The image-grid logits processor step by step, against a plain reference, and its cost model:
after the batch settles, a step uploads nothing from the host (a per-step upload from pageable
memory is a GPU sync, which would undo async scheduling's overlap on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from vllm_omni_plugin.families.glm_image.processing import GRID_EXTRA_ARG
from vllm_omni_plugin.models.glm_image.logits import ImageGridLogitsProcessor

VOCAB = 200
FORCED_EOS = 7


def grid(num_tokens: int, num_codes: int, eos: int) -> SamplingParams:
    spec = {"num_tokens": num_tokens, "num_codes": num_codes, "eos_token_id": eos}
    return SamplingParams(max_tokens=num_tokens + 1, extra_args={GRID_EXTRA_ARG: spec})


def processor(device: str) -> ImageGridLogitsProcessor:
    proc = ImageGridLogitsProcessor(SimpleNamespace(model_config=None), torch.device(device), False)
    proc.forced_eos = FORCED_EOS  # what a glm_image checkpoint's generation_config sets
    return proc


def expected(logits: torch.Tensor, batch: dict[int, tuple[SamplingParams, list[int]]]):
    """Each row as the module doc states it, one row at a time."""
    out = logits.clone()
    for row, (params, output) in batch.items():
        j = len(output)
        spec = params.extra_args.get(GRID_EXTRA_ARG) if params.extra_args else None
        if spec is not None:
            if j < spec["num_tokens"]:
                out[row, spec["num_codes"] :] = float("-inf")
            else:
                keep = out[row, spec["eos_token_id"]].clone()
                out[row] = float("-inf")
                out[row, spec["eos_token_id"]] = keep
        elif not params.ignore_eos and j >= params.max_tokens - 1:
            keep = out[row, FORCED_EOS].clone()
            out[row] = float("-inf")
            out[row, FORCED_EOS] = keep
    return out


def added(batch, *rows):
    return [(row, batch[row][0], None, batch[row][1]) for row in rows]


def step(proc, batch, update=None, device="cpu"):
    logits = torch.randn(len(batch), VOCAB, device=device)
    want = expected(logits, batch)
    got = proc.apply(logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for _, output in batch.values():
        output.append(3)  # a sampled token, whatever its value


def test_rows_follow_their_rules_through_boundaries_and_batch_changes():
    proc = processor("cpu")
    batch = {
        0: (grid(3, 5, 9), []),
        1: (SamplingParams(max_tokens=4), []),  # forced EOS at its last token
        2: (SamplingParams(max_tokens=4, ignore_eos=True), []),  # left alone
    }
    proc.update_state(BatchUpdate(3, [], added(batch, 0, 1, 2), []))
    for _ in range(5):  # row 0: codes, codes, codes, EOS, EOS; row 1: free, free, free, EOS
        step(proc, batch)
        proc.update_state(None)
    # Row 1 leaves, a new grid request takes its row, then rows 0 and 1 swap.
    batch[1] = (grid(2, 4, 8), [])
    proc.update_state(BatchUpdate(3, [1], added(batch, 1), []))
    step(proc, batch)
    proc.update_state(BatchUpdate(3, [], [], [(0, 1, MoveDirectionality.SWAP)]))
    batch[0], batch[1] = batch[1], batch[0]
    for _ in range(3):
        step(proc, batch)
        proc.update_state(None)


class HostTraffic(TorchDispatchMode):
    """Records every op that reads a CPU tensor (with the processor on `meta`, host data)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in leaves):
            self.ops.append((str(func), kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_settled_batch_uploads_nothing_per_step(rows):
    proc = processor("meta")
    batch = {r: (grid(1000, 16384, 16385), [1] * r) for r in range(rows)}
    proc.update_state(BatchUpdate(rows, [], added(batch, *batch), []))
    logits = torch.empty(rows, VOCAB * 100, device="meta")
    built = mock.MagicMock(side_effect=torch.tensor)
    with HostTraffic() as first, mock.patch("torch.tensor", built):
        proc.apply(logits)  # builds the masks: staged on the host, copied without blocking
    assert built.call_count, "the first step must upload the rows' masks (nothing was checked)"
    direct = [c for c in built.call_args_list if c.kwargs.get("device") not in (None, "cpu")]
    assert not direct, f"built straight on the device (a blocking copy): {direct}"
    assert all(k.get("non_blocking") for op, k in first.ops if "_to_copy" in op), first.ops

    built.reset_mock()
    with HostTraffic() as later, mock.patch("torch.tensor", built):
        for _ in range(4):
            for _, output in batch.values():
                output.append(5)
            proc.update_state(None)
            proc.apply(logits)
    assert later.ops == [] and built.call_count == 0, (later.ops, built.call_args_list)


def test_the_list_form_of_vllm_xargs_is_the_same_rule():
    """`vllm serve --logits-processors` clients send the grid as `vllm_xargs` ([N, C, E]: no
    nested objects there); it masks exactly as the dict form, and a wrong length is refused."""
    listed = SamplingParams(max_tokens=4, extra_args={GRID_EXTRA_ARG: [3, 5, 9]})
    ImageGridLogitsProcessor.validate_params(listed)
    logits = torch.randn(1, VOCAB)
    masked = {}
    for name, params in (("list", listed), ("dict", grid(3, 5, 9))):
        proc, output = processor("cpu"), []
        proc.update_state(BatchUpdate(1, [], [(0, params, None, output)], []))
        masked[name] = []
        for _ in range(4):  # codes, codes, codes, EOS
            masked[name].append(proc.apply(logits.clone()))
            output.append(3)
    for a, b in zip(masked["list"], masked["dict"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (
        torch.isinf(masked["list"][0][0, 5:]).all()
        and torch.isfinite(masked["list"][0][0, :5]).all()
    )
    with pytest.raises(ValueError, match="as a list"):
        ImageGridLogitsProcessor.validate_params(
            SamplingParams(max_tokens=4, extra_args={GRID_EXTRA_ARG: [3, 5]})
        )

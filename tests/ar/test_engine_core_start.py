"""How an AR or talker stage's vLLM engine core process starts (stages/ar_stage.py): forked
from the stage on the CPU when the stage's torch runs one thread (no OpenMP pool to lose in
the fork), vLLM's own choice otherwise."""

from __future__ import annotations

import torch

from vllm_omni_plugin.stages.ar_stage import engine_core_start_method


def test_the_cpu_with_one_torch_thread_forks_and_everything_else_is_left_to_vllm():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert engine_core_start_method("cpu") == "fork"
        assert engine_core_start_method("cuda") is None  # vLLM forks there unless CUDA is up
        torch.set_num_threads(2)
        assert engine_core_start_method("cpu") is None  # vLLM's CPU platform: spawn
    finally:
        torch.set_num_threads(before)

"""How an AR or talker stage's vLLM engine core process starts (stages/ar_stage.py): forked
from the stage on the CPU when the stage's torch runs one thread (no OpenMP pool to lose in
the fork) and has no torch.distributed group (whose threads a child would not have), vLLM's own
choice otherwise."""

from __future__ import annotations

from vllm_omni_plugin.stages.ar_stage import engine_core_start_method


def test_the_cpu_with_one_torch_thread_forks_and_everything_else_is_left_to_vllm():
    assert engine_core_start_method("cpu", torch_threads=1, distributed=False) == "fork"
    # vLLM's CPU platform spawns: an OpenMP pool, or a process group, would not survive a fork.
    assert engine_core_start_method("cpu", torch_threads=2, distributed=False) is None
    assert engine_core_start_method("cpu", torch_threads=1, distributed=True) is None
    # On a GPU vLLM forks unless CUDA is already up in the stage.
    assert engine_core_start_method("cuda", torch_threads=1, distributed=False) is None

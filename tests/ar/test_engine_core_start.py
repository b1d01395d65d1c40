"""How an AR or talker stage's vLLM engine core process starts (stages/ar_stage.py): forked
from the stage on the CPU when the stage's torch runs one thread (no OpenMP pool to lose in
the fork) and has no torch.distributed group (whose threads a child would not have), vLLM's own
choice otherwise."""

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


def test_a_process_with_a_torch_distributed_group_leaves_it_to_vllm(tmp_path):
    """A test process that ran a vLLM engine in-process holds a gloo group; forked, the engine
    core would wait on that group's threads forever."""
    import torch.distributed as dist

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rendezvous = f"file://{tmp_path}/rendezvous"
    dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
    try:
        assert engine_core_start_method("cpu") is None
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)

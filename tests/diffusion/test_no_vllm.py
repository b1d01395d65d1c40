"""The diffusion engine imports and runs with vLLM made unimportable (GPU boxes without vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockVllm(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError("vllm is blocked in this test")
            return None

    sys.meta_path.insert(0, BlockVllm())
    import vllm_omni_plugin.diffusion as d
    from vllm_omni_plugin.diffusion.adapters import flux, generic, glm_image, qwen_image, registry  # noqa

    engine = d.DiffusionEngine(d.DiffusionEngineConfig(model=sys.argv[1]))
    (out,) = engine.generate([d.GenerationRequest("r", "a cat", height=64, width=64,
                                                  num_inference_steps=2, seed=0)])
    loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    print(json.dumps({"error": out.error, "size": list(out.images[0].size), "vllm": loaded}))
    """
)


def test_engine_runs_without_vllm(tiny_models):
    model = str(tiny_models("qwen-image"))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"error": None, "size": [64, 64], "vllm": []}

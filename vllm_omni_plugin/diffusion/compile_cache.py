"""Where torch.compile keeps what it compiled, so a restarted stage loads instead of compiling.

Inductor caches its FX graphs, AOTAutograd graphs and generated kernels on disk under
TORCHINDUCTOR_CACHE_DIR, read each time it looks one up. Its default lies in /tmp, which container
restarts and tmp cleaners wipe; a DiT stage then pays its whole compile again (46 s for
GLM-Image's four shape classes on an H200). The default here sits beside vLLM's own compile cache
(VLLM_CACHE_ROOT, ~/.cache/vllm), the folder deployments already keep on a volume. Dynamo still
traces at every start; only the compile behind it is skipped.
"""

from __future__ import annotations

import os


def default_compile_cache_dir() -> str:
    """The user's TORCHINDUCTOR_CACHE_DIR if set, else `omni_inductor` under vLLM's cache root."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    return os.path.join(root, "omni_inductor")


def use_compile_cache(path: str | None) -> str:
    """Point this process's inductor caches at `path` (None: `default_compile_cache_dir()`)."""
    path = os.path.abspath(os.path.expanduser(path or default_compile_cache_dir()))
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path

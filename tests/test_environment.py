"""The dev environment runs real vLLM on the CPU, and our package imports without side effects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {done.stderr[-2000:]}"
    # The last line is our report; anything printed before it came from an import.
    return {"report": json.loads(lines[-1]), "stray_stdout": lines[:-1]}


def test_vllm_imports_and_reports_cpu_platform():
    out = _run(
        """
        import importlib.metadata, json
        import vllm
        from vllm.platforms import current_platform
        print(json.dumps({
            "version": vllm.__version__,
            "dist_version": importlib.metadata.version("vllm"),
            "device_type": current_platform.device_type,
            "is_cpu": current_platform.is_cpu(),
        }))
        """
    )["report"]
    assert out["is_cpu"] is True
    assert out["device_type"] == "cpu"
    major_minor = tuple(int(x) for x in out["version"].split(".")[:2])
    assert (0, 32) <= major_minor < (0, 34)
    assert "cpu" in out["dist_version"]  # the metadata shim vLLM's platform detection needs


def test_package_import_has_no_side_effects():
    """`import vllm_omni_plugin` loads neither torch nor vllm; importing any subpackage leaves
    the environment (beyond what importing vLLM itself sets), stdout and the root logger alone;
    the diffusion engine never needs vLLM."""
    out = _run(
        """
        import json, logging, os, pkgutil, sys, importlib
        handlers_before = list(logging.getLogger().handlers)
        import vllm_omni_plugin
        top = {"torch": "torch" in sys.modules, "vllm": "vllm" in sys.modules}
        import vllm_omni_plugin.diffusion
        diffusion_pulls_vllm = "vllm" in sys.modules
        # vLLM's own import sets its environment defaults (vllm/env_override.py), as in any vLLM
        # process; whether the pytest process had imported vLLM must not decide this test.
        import vllm
        env_before = dict(os.environ)
        names = sorted(
            m.name for m in pkgutil.walk_packages(vllm_omni_plugin.__path__, "vllm_omni_plugin.")
            if m.ispkg
        )
        names += ["vllm_omni_plugin.entry_points", "vllm_omni_plugin.stage_configs"]
        failed = {}
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # report every broken package, not just the first
                failed[name] = repr(exc)
        print(json.dumps({
            "top": top,
            "diffusion_pulls_vllm": diffusion_pulls_vllm,
            "packages": names,
            "failed": failed,
            "env_changed": sorted(
                k for k in set(env_before) | set(os.environ)
                if env_before.get(k) != os.environ.get(k)
            ),
            "root_handlers_changed": list(logging.getLogger().handlers) != handlers_before,
        }))
        """
    )
    report = out["report"]
    assert report["top"] == {"torch": False, "vllm": False}
    assert report["failed"] == {}
    assert "vllm_omni_plugin.testing" in report["packages"]
    assert report["diffusion_pulls_vllm"] is False
    assert report["env_changed"] == []
    assert report["root_handlers_changed"] is False
    assert out["stray_stdout"] == []

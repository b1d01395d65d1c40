"""Chunk latency and throughput of one streamed edge between two real stage processes (CPU).

    python benchmarks/bench_stream_edges.py                       # 16-value chunks, 2000 of them
    python benchmarks/bench_stream_edges.py --values 4096 --chunks 500

The test-only stream pipeline (tests/streaming/stream_stages.py): a source stage emits `--chunks`
float32 chunks of `--values` values as fast as its window allows, a sink reads them with no
delay and checksums them. Per request, from the stages' own wall-clock stamps:

  * chunk_us: (sink's last chunk - source's first chunk) / chunks: the edge's cost per chunk
    once it streams (throughput = 1e6 / chunk_us chunks per second);
  * first_ms: source's first chunk to the sink's first read (one chunk's latency, idle edge);
  * api_bytes: the bytes the API-server process read from the source stage's control socket
    during the request (what of the edge still passes through it).

Prints the median over --repeats requests as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from vllm_omni_plugin.common.messages import GenerationParams
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.orchestrator import Orchestrator

# The test-only stages: imported here (registering their topologies) and by each stage process.
STAGES_PATH = str(Path(__file__).resolve().parents[1] / "tests" / "streaming")
sys.path.insert(0, STAGES_PATH)
from stream_stages import expected_checksum  # noqa: E402

DEPLOY = """
pipeline: stream_test
stages:
  - {{stage_id: 0, device: cpu, stall_timeout_s: 30, env: {{PYTHONPATH: "{path}"}}}}
  - {{stage_id: 1, device: cpu, stall_timeout_s: 30, env: {{PYTHONPATH: "{path}"}}}}
edges:
  - {{from: 0, to: 1, connector: shm}}
connectors:
  shm: {{type: shm, options: {{shm_dir: "{shm}"}}}}
"""


def read_bytes(orch: Orchestrator, sid: int) -> int:
    proc = orch.stages[sid].proc
    return getattr(proc, "bytes_read", 0) if proc is not None else 0


async def bench(args: argparse.Namespace, root: Path) -> dict:
    deploy = root / "deploy.yaml"
    path = os.pathsep.join([STAGES_PATH, *filter(None, [os.environ.get("PYTHONPATH")])])
    deploy.write_text(DEPLOY.format(shm=root, path=path))
    cfg = load_deploy_config(deploy, model="/unused")
    orch = Orchestrator(cfg, startup_timeout_s=120)
    await orch.start()
    try:
        params = GenerationParams("chunks", seed=1, num_frames=args.chunks, width=args.values)
        await orch.generate("warm-up", params)
        rows = []
        for k in range(args.repeats):
            before = read_bytes(orch, 0)
            result = await orch.generate(f"r{k}", params)
            src, sink = result.metrics["stage_0"], result.metrics["stage_1"]
            assert result.outputs[1] == [expected_checksum(1, args.chunks, args.values).encode()], (
                "wrong checksum"
            )
            rows.append(
                {
                    "chunk_us": (sink["last_chunk_at"] - src["first_chunk_at"]) / args.chunks * 1e6,
                    "first_ms": (sink["first_chunk_at"] - src["first_chunk_at"]) * 1e3,
                    "api_bytes": read_bytes(orch, 0) - before,
                }
            )
        out = {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]}
        out["chunks_per_s"] = round(1e6 / out["chunk_us"])
        return {"chunks": args.chunks, "values": args.values, **out}
    finally:
        await orch.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--values", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("OMNI_TEST_EMIT_DELAY_MS", "0")
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(bench(args, Path(tmp)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GETs inside a network namespace through one long-lived process there
(tests/multinode/ns_client.py `serve`): a poll costs a line over a pipe, where a process per
call costs an interpreter start (0.2 CPU-seconds with httpx, 1 with openai)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NS_CLIENT = REPO / "tests" / "multinode" / "ns_client.py"


class NsHttp:
    """`get(url)` -> {"status": code or None, "text": body or the error} from inside `netns`.
    Close it (or leave its `with`) before the namespace is deleted."""

    def __init__(self, netns: str):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, str(NS_CLIENT), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def get(self, url: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(url + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"ns_client.py serve exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # it exits at EOF
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> NsHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

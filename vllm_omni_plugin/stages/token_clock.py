"""When an AR request's tokens came out of its vLLM engine, as the stage saw them.

The AR stage reads its AsyncLLM's outputs as they arrive; `TokenClock` notes the arrival of
the first output holding a token (time to first token, from the request's entry into the
engine) and of the last new token. The time per output token is vLLM's own definition: the
time between the first and the last token over the tokens that came after the first output
(an output may carry more than one token when the stage's loop fell behind), so one slow
output does not hide in the average and the first token's prefill is not in it.
"""

from __future__ import annotations

import time


class TokenClock:
    def __init__(self) -> None:
        self.start = time.perf_counter()  # the request enters the engine
        self.first_at: float | None = None  # the first output holding a token
        self.first_count = 0  # tokens in that output
        self.last_at: float | None = None  # the output that brought the last new token
        self.count = 0

    def saw(self, count: int) -> None:
        """An engine output with `count` tokens generated so far (cumulative)."""
        if count <= self.count:
            return
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at, self.first_count = now, count
        self.last_at, self.count = now, count

    def metrics(self) -> dict[str, float]:
        """`ttft_s` once a token came; `tpot_s` once a token came after the first output."""
        if self.first_at is None or self.last_at is None:
            return {}
        out = {"ttft_s": self.first_at - self.start}
        later = self.count - self.first_count
        if later > 0:
            out["tpot_s"] = (self.last_at - self.first_at) / later
        return out

"""The talker engine's code predictor measured where it runs, in the engine's worker: its CUDA
graphs against its eager path on the same inputs, and its time per step. vLLM adds these
methods to the talker's worker when the engine is built with
`worker_extension_cls=PREDICTOR_PROBE`; `LLM.collective_rpc(name, args=...)` calls them.

Every method builds its own random inputs (hidden states, first codes, seeds) and returns plain
values, and runs under inference mode as the engine's step does.
"""

from __future__ import annotations

import time

import torch

from .predictor_graphs import PredictorGraphs
from .predictor_sampling import PredictorDraws, predict_eagerly

PREDICTOR_PROBE = f"{__name__}.PredictorProbe"


class PredictorProbe:
    def _predictor(self):
        runner = self.model_runner
        return runner.get_model(), runner._predictor_graphs()

    def predictor_graphed(self) -> bool:
        return self._predictor()[1].captured

    def use_predictor_graphs(self, enabled: bool) -> None:
        """Swap the runner's predictor graphs for an uncaptured (eager) set, or back."""
        runner = self.model_runner
        graphs = runner._predictor_graphs()
        kept = getattr(self, "_kept_predictor_graphs", None)
        if enabled and kept is not None:
            runner._talker_predictor_graphs = kept
        elif not enabled and graphs.captured:
            self._kept_predictor_graphs = graphs
            runner._talker_predictor_graphs = PredictorGraphs(graphs.model, graphs.buckets[-1])

    @torch.inference_mode()
    def compare_predictor_paths(self, rows_list: list[int], seed: int) -> list[dict]:
        """For each batch size: the graphs' codes against the eager path's, all rows greedy
        and with mixed rows (greedy, seeded, global draws). A batch between buckets is also
        compared against the eager path over its bucket (the same shapes as the replay)."""
        model, graphs = self._predictor()
        out = []
        for rows in rows_list:
            bucket = next((s for s in graphs.buckets if s >= rows), rows)
            hidden, code0 = _inputs(model, bucket, seed)
            row = {"rows": rows, "bucket": bucket}
            for name, n in (("", rows), ("padded_", bucket)):
                if name and n == rows:
                    continue
                greedy = PredictorDraws(None)
                graphed = graphs(hidden[:rows], code0[:rows], greedy)
                eager = predict_eagerly(model, hidden[:n], code0[:n], greedy)[:rows]
                row[f"{name}greedy_equal"] = bool(torch.equal(graphed, eager))
                # Over its bucket the global generator's draws would differ (another tensor
                # size): there every sampled row is seeded.
                every = 1 if name else 2
                draws = _mixed(hidden, rows, seed, every)
                graphed = graphs(hidden[:rows], code0[:rows], draws)
                draws = _mixed(hidden, n, seed, every)
                eager = predict_eagerly(model, hidden[:n], code0[:n], draws)
                row[f"{name}mixed_equal"] = bool(torch.equal(graphed, eager[:rows]))
            out.append(row)
        return out

    @torch.inference_mode()
    def compare_compiled_layers(self, rows_list: list[int], seed: int, backend: str) -> list[dict]:
        """The predictor's layers through torch.compile against the same layers uncompiled,
        per batch size: the largest absolute difference of `hidden` over sequences of 2 and
        16 positions, and whether a frame's greedy codes are equal. Compiles with `backend`
        where the layers are not compiled yet, and leaves them as it found them."""
        model = self.model_runner.get_model()
        pred = model.code_predictor
        kept = pred.compiled_hidden
        if kept is None:
            pred.compile_hidden(backend)
        compiled = pred.compiled_hidden
        out = []
        try:
            for rows in rows_list:
                hidden, code0 = _inputs(model, rows, seed)
                gen = torch.Generator(device="cpu").manual_seed(seed)
                diff = 0.0
                for length in (2, 16):
                    x = torch.randn(rows, length, hidden.shape[1], generator=gen)
                    x = x.to(hidden.device, hidden.dtype)
                    diff = max(diff, float((compiled(x) - pred.eager_hidden(x)).abs().max()))
                codes = {}
                for name, fn in (("compiled", compiled), ("eager", None)):
                    pred.compiled_hidden = fn
                    codes[name] = predict_eagerly(model, hidden, code0, PredictorDraws(None))
                equal = bool(torch.equal(codes["compiled"], codes["eager"]))
                out.append({"rows": rows, "hidden_max_abs_diff": diff, "greedy_codes_equal": equal})
        finally:
            pred.compiled_hidden = kept
        return out

    @torch.inference_mode()
    def time_predictor(self, rows_list: list[int], iters: int) -> list[dict]:
        """Milliseconds per step of the predictor alone (every row sampled from the global
        generator, its noise drawn in the step), eager and graphed, per batch size."""
        model, graphs = self._predictor()
        out = []
        for rows in rows_list:
            hidden, code0 = _inputs(model, rows, 0)
            draws = PredictorDraws(torch.zeros(rows, dtype=torch.bool, device=hidden.device))
            paths = {"eager_ms": lambda h, c, d: predict_eagerly(model, h, c, d)}
            if graphs.captured:
                paths["graphed_ms"] = graphs
            row = {"rows": rows}
            for name, step in paths.items():
                for _ in range(3):
                    step(hidden, code0, draws)
                _sync(hidden.device)
                start = time.perf_counter()
                for _ in range(iters):
                    step(hidden, code0, draws)
                _sync(hidden.device)
                row[name] = round((time.perf_counter() - start) * 1e3 / iters, 3)
            out.append(row)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(model, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = model.code_predictor.lm_head[0].weight
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(rows, model.codec_head.weight.shape[1], generator=gen)
    code0 = torch.randint(0, weight.shape[0], (rows,), generator=gen)
    return hidden.to(weight.device, weight.dtype), code0.to(weight.device)


def _mixed(hidden: torch.Tensor, rows: int, seed: int, every: int) -> PredictorDraws:
    """Every third row greedy; of the others, every `every`-th seeded (its own generator,
    seeded from `seed` and the row), the rest from the global generator (seeded here)."""
    device = hidden.device
    torch.manual_seed(seed)
    greedy = torch.arange(rows, device=device) % 3 == 2
    generators = {
        i: torch.Generator(device=device).manual_seed(seed + i)
        for i in range(rows)
        if i % 3 != 2 and (i // 3 * 2 + i % 3) % every == 0
    }
    return PredictorDraws(greedy, generators)

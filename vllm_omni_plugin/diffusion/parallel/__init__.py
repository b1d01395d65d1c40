"""Multi-rank DiT: one image's denoising spread over several processes (one per GPU, or gloo
processes on CPU).

* `cfg_parallel`: a step's rows are split over two ranks (cond rows on one, uncond rows on the
  other) and the predictions gathered back before the CFG combine (cfg.py).
* `ulysses_degree`: each transformer forward runs with its token sequence split over U ranks;
  attention swaps the split from tokens to heads with an all-to-all and back (ulysses.py).
* ranks.py: rank 0 is the engine the stage drives; the other ranks mirror its requests and run
  the same steps, told what to run by rank 0 every step.
"""

from .layout import ParallelLayout
from .ranks import build_engine

__all__ = ["ParallelLayout", "build_engine"]

"""Entry of a follower rank: `python -m vllm_omni_plugin.diffusion.parallel.follower RANK`
(started by ranks.build_engine; the rank in argv only names the process in `ps`)."""

from .ranks import follower_main

if __name__ == "__main__":
    follower_main()

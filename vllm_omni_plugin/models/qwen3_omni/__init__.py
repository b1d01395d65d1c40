"""Qwen3-Omni's talker as a vLLM model (`talker.py`), the runner and worker vLLM's engine steps
it with (`talker_runner.py`), its prefill conditioning from the thinker's ids (`prompt.py`) and
the thinker's text streamed into its worker (`text_feed.py`).

Import the submodules you need: the talker stage loads the conditioning without vLLM's model.
"""

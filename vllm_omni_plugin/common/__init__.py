"""The innermost layer: types every other layer shares, importing nothing of the project.

`messages.py` is the one schema of every message between the API server, stage processes,
headless nodes and replicas (msgspec tagged structs, msgpack on every link, never pickle);
`payload.py` the stage-to-stage payload descriptors those messages carry; `limits.py` the
request bounds a diffusion stage announces. No module here imports torch, vLLM or an engine.
"""

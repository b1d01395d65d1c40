"""LoRA adapters per request inside step batching: rows with different adapters (and none)
share one transformer forward, each row with its own low-rank update (store.py, layers.py);
adapters in diffusers' format, checked against the served transformer (common/lora_files.py)."""

from ...common.lora_files import AdapterFile, LoraError, read_adapter, resolve_folder
from .store import CheckedLora, LoraStore

__all__ = ["AdapterFile", "CheckedLora", "LoraError", "LoraStore", "read_adapter", "resolve_folder"]

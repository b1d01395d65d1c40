"""Model-family adapters, registered by diffusers pipeline class name."""

from .base import DiffusionAdapter, FamilySpec
from .registry import ENTRY_POINT_GROUP, get_adapter_class, register_adapter, registered_adapters

__all__ = [
    "ENTRY_POINT_GROUP",
    "DiffusionAdapter",
    "FamilySpec",
    "get_adapter_class",
    "register_adapter",
    "registered_adapters",
]

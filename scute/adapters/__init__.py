"""PEFT adapters in Scute's normal form: slots, the method registry, checkpoint loading, one file per method."""

from scute.adapters.checkpoint import (
    Adapter,
    AdapterCheckpoint,
    AdapterError,
    LayerCheckpoint,
    convert_checkpoint,
    load_adapter,
    read_checkpoint,
)
from scute.adapters.registry import register_method, supported_methods
from scute.adapters.slots import Slots

__all__ = [
    "Adapter",
    "AdapterCheckpoint",
    "AdapterError",
    "LayerCheckpoint",
    "Slots",
    "convert_checkpoint",
    "load_adapter",
    "read_checkpoint",
    "register_method",
    "supported_methods",
]

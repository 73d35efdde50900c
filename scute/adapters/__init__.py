"""PEFT adapters in Scute's normal form: reading checkpoints, converting them to slots, the method registry,
one module per method in `methods/`."""

from scute.adapters.adapter import Adapter, alora_active, alora_start
from scute.adapters.checkpoint import AdapterCheckpoint, AdapterError, read_checkpoint
from scute.adapters.conversion import AdapterLoad, LayerCheckpoint, convert_checkpoint, load_adapter, start_load
from scute.adapters.registry import LoadOption, SavedShapes, register_method, supported_methods
from scute.ops.slots import Slots

__all__ = [
    "Adapter",
    "AdapterCheckpoint",
    "AdapterError",
    "AdapterLoad",
    "LayerCheckpoint",
    "LoadOption",
    "SavedShapes",
    "Slots",
    "alora_active",
    "alora_start",
    "convert_checkpoint",
    "load_adapter",
    "read_checkpoint",
    "register_method",
    "start_load",
    "supported_methods",
]

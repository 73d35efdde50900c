"""Scute: many PEFT adapters — LoRA, DoRA, (IA)³, VeRA, OFT — served on one base model, in one batch, exactly."""

from scute.config import EngineConfig
from scute.engine.engine import Engine
from scute.engine.request import AdapterRequest
from scute.outputs import CompletionOutput, RequestOutput
from scute.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["AdapterRequest", "CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]

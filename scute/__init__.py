"""Scute: many PEFT adapters — LoRA, DoRA, (IA)³, VeRA, OFT — served on one base model, in one batch, exactly."""

__version__ = "0.1.0"

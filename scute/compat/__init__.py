"""Compatibility with vLLM: a drop-in API (`scute.compat.vllm`) and adapter -> LoRA conversion
(`scute.compat.convert`)."""

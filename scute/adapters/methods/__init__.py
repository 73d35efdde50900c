"""One module per PEFT method (or family), each registering its converter with `scute.adapters.registry`.

Nothing here is imported by name: the registry imports every module of this package (`pkgutil.iter_modules`),
so a new method is a new file. Helpers shared by several methods live beside them (`dense.py`: the dense ΔW
form; `dora.py`, `lora_variants.py`: parts of LoRA's converter).
"""

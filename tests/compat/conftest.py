"""Fixtures of the `scute.compat.vllm` tests: a tiny served model folder with real PEFT adapters."""

from __future__ import annotations

import pytest

WORDS = ["the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs", "sleeps", "red",
         "green", "blue", "one", "two", "three", "user", "assistant", "system", ":"]


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer (no chat template), and a LoRA, a VeRA, a DoRA and an
    IA3 adapter (every tensor random)."""
    from peft import IA3Config, LoraConfig, VeraConfig  # not at the top: the signature tests run in vLLM's venv too
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import make_adapter, tiny_model

    root = tmp_path_factory.mktemp("served")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("llama")  # vocab 128 >= the tokenizer's
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    make_adapter(str(root / "lora"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), seed=3)
    make_adapter(str(root / "vera"), VeraConfig(r=8, target_modules=["q_proj", "up_proj"]), seed=4)
    make_adapter(str(root / "dora"), LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj"]),
                 seed=5)
    make_adapter(str(root / "ia3"), IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
                 seed=6)
    return root



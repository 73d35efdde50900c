"""A real `scute serve` stack for the server tests: a tiny Llama folder (word-level tokenizer, a word per id of
the vocabulary, with a chat template), adapters of the five core methods, the app on a real uvicorn server on
127.0.0.1 (a free port), in a thread of the test process."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest

WORDS = ["the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs", "sleeps", "red",
         "green", "blue", "one", "two", "three", "user", "assistant", "system"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
API_KEY = "test-key"


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import FIVE_METHODS, make_adapter, tiny_model

    root = tmp_path_factory.mktemp("serve")
    words = ["<unk>", "<s>", "</s>", *WORDS]
    words += [f"w{i}" for i in range(len(words), tiny_model("llama").config.vocab_size)]  # every id a word of its own:
    vocab = {w: i for i, w in enumerate(words)}  # text equal to the engine's means the same tokens
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model("llama").save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for i, (name, config) in enumerate(FIVE_METHODS.items()):
        make_adapter(str(root / name), config(), seed=20 + i)
    runtime = root / "runtime"
    runtime.mkdir()
    shutil.copytree(root / "lora", runtime / "late-lora")
    (runtime / "escape").symlink_to(root / "vera")  # a link out of the allowed directory
    (runtime / "broken").mkdir()
    (runtime / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    return root


ENGINE_OPTIONS = dict(dtype="float32", device="cpu", max_model_len=64, max_num_seqs=64, max_adapters=8, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(served):
    """(base URL, ServerState) of a running server; stopped at the end of the session."""
    import uvicorn

    from scute import Engine
    from scute.serve.api import build_app
    from scute.serve.server import make_state

    engine = Engine(str(served / "model"), **ENGINE_OPTIONS)
    adapters = {name: str(served / name) for name in ("lora", "dora", "ia3", "vera", "oft")}
    state = make_state(engine, str(served / "model"), adapters, "tiny", API_KEY, str(served / "runtime"))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    uv.should_exit = True
    thread.join(timeout=10)
    state.engine.shutdown()


@pytest.fixture(scope="session")
def reference(served):
    """An engine of the same model, outside the server: the tokens the server must give."""
    from scute import Engine

    return Engine(str(served / "model"), **ENGINE_OPTIONS)

"""The output text, decoded a few tokens at a time (`OutputProcessor.text`), against the full decode of the same
tokens, on real `tokenizers` tokenizers trained here: byte-level BPE (characters split across tokens), a
SentencePiece-style one (a leading space that a decode drops at its start) and a word-level one, each with
special tokens; and stop strings found across the new text's edge."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scute.engine.output_processor import OutputProcessor
from scute.engine.request import Request
from scute.sampling_params import SamplingParams

SPECIAL = ["<s>", "</s>", "<pad>"]


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdeéüx€中 ") for _ in range(rng.randint(1, 6))) for _ in range(300)]
    return [" ".join(rng.choices(words, k=30)) + rng.choice([" .", "!", " ,", "?"]) for _ in range(300)]


def tokenizer(kind: str) -> PreTrainedTokenizerFast:
    if kind == "byte_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = None
    trainer = (trainers.WordLevelTrainer(special_tokens=SPECIAL + ["<unk>"]) if alphabet is None else
               trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL + ["<unk>"], initial_alphabet=alphabet))
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def request(sp: SamplingParams) -> Request:
    return Request("r", None, [1, 2], sp, None, None, 0)


@pytest.mark.parametrize("kind", ["byte_bpe", "metaspace", "word"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_is_the_full_decode_wherever_a_character_is_complete(kind, skip):
    tok = tokenizer(kind)
    out = OutputProcessor(tok, [], 1 << 20, {})
    assert out.incremental
    rng = random.Random(1)
    for trial in range(6):
        text = " ".join(corpus(trial + 10)[:3])
        ids = tok.encode(text) if trial % 2 else [rng.randrange(len(tok)) for _ in range(120)]  # real and random
        req, seen = request(SamplingParams(max_tokens=1000, skip_special_tokens=skip)), ""
        for k, token in enumerate(ids, 1):
            req.append_token(token)
            got, full = out.text(req), tok.decode(ids[:k], skip_special_tokens=skip)
            assert got.startswith(seen), (kind, trial, k)  # a stream only ever grows
            if not full.endswith("\ufffd"):
                assert got == full, (kind, trial, k)
            seen = got
        assert req.prefix_offset > 0 or len(ids) < 3  # windows moved on: not a full decode every step
        req.finish("length")
        assert out.text(req) == tok.decode(ids, skip_special_tokens=skip) and out.text(req).startswith(seen)


def test_a_tokenizer_that_cleans_up_spaces_decodes_in_full():
    tok = tokenizer("word")
    tok.clean_up_tokenization_spaces = True
    out = OutputProcessor(tok, [], 1 << 20, {})
    words = corpus()[0].split()[:4]
    ids = tok.encode(f"{words[0]} , {words[1]} ! {words[2]} . {words[3]}")
    assert "," in tok.decode(ids) and " ," not in tok.decode(ids)  # cleaned up
    req = request(SamplingParams(max_tokens=100))
    for k, token in enumerate(ids, 1):
        req.append_token(token)
        assert out.text(req) == tok.decode(ids[:k], skip_special_tokens=True)
    assert not out.incremental and req.read_offset == 0


def test_a_bpe_tokenizer_whose_decode_keeps_spaces_is_decoded_incrementally():
    """Llama 3's tokenizer sets clean_up_tokenization_spaces, which transformers ignores for BPE tokenizers: what
    decides is whether the decode cleans up, asked of the decode, and the text still equals the full decode."""
    tok = tokenizer("byte_bpe")
    tok.clean_up_tokenization_spaces = True
    ids = tok.encode(" ".join(corpus(3)[:4]))
    raw = tok.decode(ids, clean_up_tokenization_spaces=False)
    assert " ." in raw or " ," in raw  # the text holds what a clean-up would change
    out = OutputProcessor(tok, [], 1 << 20, {})
    assert out.incremental == (tok.decode(ids) == raw)  # transformers 5.24 keeps a BPE tokenizer's spaces
    req = request(SamplingParams(max_tokens=1000))
    for k, token in enumerate(ids, 1):
        req.append_token(token)
        full = tok.decode(ids[:k], skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            assert out.text(req) == full, k
    assert req.prefix_offset > 0 or not out.incremental  # windows moved on: not a full decode every step


def test_a_stop_string_across_the_new_texts_edge_is_found():
    """Stop strings are searched only where the new text can complete one: one that began in text already
    searched and ends in the new text still stops the request, cut where it starts."""
    tok = tokenizer("word")
    out = OutputProcessor(tok, [], 1 << 20, {})
    ids = tok.encode(corpus()[0])[:12]
    stop = tok.decode(ids[6:8])  # two tokens: its start was searched a step before its end arrives
    assert " " in stop and tok.decode(ids).count(stop) == 1
    req = request(SamplingParams(max_tokens=100, stop=[stop]))
    for token in ids:
        req.append_token(token)
        out.check_stop(req, token)
        if req.is_finished:
            break
    full = tok.decode(ids)
    assert req.is_finished and req.stop_reason == stop and req.text == full[:full.find(stop)]


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_never_shows_text_its_stop_string_cuts(include):
    """While a stop string may still complete, a running request's output holds back the end of its text that
    begins one (the longest suffix that is a stop string's proper prefix): every streamed text is a prefix of the
    final one, as a client that appends the deltas needs. With ``include_stop_str_in_output`` nothing is cut,
    so nothing is held back."""
    tok = tokenizer("word")
    out = OutputProcessor(tok, [], 1 << 20, {})
    ids = tok.encode(corpus()[0])[:12]
    stop = tok.decode(ids[6:9])  # three tokens: two streamed steps end inside it
    req = request(SamplingParams(max_tokens=100, stop=[stop, "never here"], include_stop_str_in_output=include))
    shown = []
    for token in ids:
        req.append_token(token)
        out.check_stop(req, token)
        shown.append(out.make_output(req).outputs[0].text)
        if req.is_finished:
            break
    full = tok.decode(ids)
    final = full[:full.find(stop) + (len(stop) if include else 0)]
    assert req.is_finished and shown[-1] == final
    assert all(final.startswith(text) for text in shown), shown
    held = [len(tok.decode(ids[:k + 1])) - len(text) for k, text in enumerate(shown[:-1])]
    if include:
        assert held == [0] * len(held)
    else:  # after the stop string's first and second tokens, at least they are held back; never a whole stop
        assert held[6] >= len(tok.decode(ids[6:7])) and held[7] >= len(tok.decode(ids[6:8]))
        assert max(held) < len(stop)


def test_the_outputs_bench_runs(tmp_path):
    """`bench/bench_outputs.py` on a few requests: deltas and both ways of decoding timed at each length."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_outputs.py")
    spec = importlib.util.spec_from_file_location("bench_outputs", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--requests", "3", "--lengths", "4,16", "--out", str(tmp_path / "o.json")])
    assert [r["length"] for r in result["rows"]] == [4, 16]
    assert all(r["delta_ms"] > 0 and r["incremental_ms"] > 0 and r["full_ms"] > 0 for r in result["rows"])

"""Host time of a streamed step's outputs: `OutputProcessor.make_output` for every running request after each
appends one token (what `Engine.step` does for a server that streams), with the text decoded incrementally
(`OutputProcessor.text`) as whole outputs (``output_kind="cumulative"``) and as deltas (``"delta"``, what the
server asks for), against whole outputs decoded in full every step (what a tokenizer that cleans up spaces gets),
in one process. ``--requests`` requests at each output length of ``--lengths``; the tokenizer: ``--tokenizer`` (a
folder or hub name of a transformers tokenizer) or, by default, a byte-level BPE of 8000 tokens trained here on
synthetic text (no download). Token ids are random: the decode's cost, not its text, is measured.

Run: ``PYTHONPATH=. python3 bench/bench_outputs.py --out outputs.json`` (CPU only; a minute).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzéü "
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator((" ".join(rng.choices(words, k=50)) + " ." for _ in range(2000)),
                            trainers.BpeTrainer(vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def step_ms(out, length: int, requests: int, kind: str = "cumulative", steps: int = 8) -> float:
    """Median ms of one streamed step's outputs of `kind` once each request has `length` output tokens."""
    from scute.engine.request import Request
    from scute.sampling_params import SamplingParams

    rng = random.Random(length)
    sp = SamplingParams(max_tokens=1 << 20, output_kind=kind)
    reqs = [Request(f"r{i}", None, [1], sp, None, None, i) for i in range(requests)]
    times = []
    for k in range(length + steps):
        for req in reqs:
            req.append_token(rng.randrange(out.tokenizer.vocab_size))
        if k < length - 1 and out.incremental:  # a stream made an output at every step before
            for req in reqs:  # a delta stream's outputs advance its counts; a whole one's decode its text
                if kind == "delta":
                    out.make_output(req)
                else:
                    out.text(req)
        if k >= length - 1:
            start = time.perf_counter()
            for req in reqs:
                out.make_output(req)
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--lengths", default="128,512,2048")
    p.add_argument("--out", default="outputs.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from scute.engine.output_processor import OutputProcessor

    tok = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else byte_bpe()
    result = dict(command="PYTHONPATH=. python3 " + " ".join(sys.argv), tokenizer=args.tokenizer or "byte-level BPE",
                  requests=args.requests, rows=[])
    print(f"{args.requests} requests; ms per streamed step's outputs")
    print("length  deltas  incremental  full decode  ratio")
    for length in map(int, args.lengths.split(",")):
        incremental, full = OutputProcessor(tok, [], 1 << 30, {}), OutputProcessor(tok, [], 1 << 30, {})
        full.incremental = False
        row = dict(length=length, delta_ms=step_ms(incremental, length, args.requests, "delta"),
                   incremental_ms=step_ms(incremental, length, args.requests),
                   full_ms=step_ms(full, length, args.requests))
        row["ratio"] = row["full_ms"] / row["incremental_ms"]
        result["rows"].append(row)
        print(f"{length:6d} {row['delta_ms']:7.2f} {row['incremental_ms']:12.2f} {row['full_ms']:12.2f} "
              f"{row['ratio']:6.1f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

"""Small helpers shared by the engine's files."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def tokenize(tokenizer, vocab_size: int, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's token ids (text through `tokenizer`); raises ValueError for an empty prompt or an id outside
    the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to Engine, or token ids")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def per_prompt(value, n: int, what: str, single) -> list:
    """`value` once per prompt: repeated if it is None or one `single`, else checked to have n entries."""
    if value is None or isinstance(value, single):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries for {n} prompts: give one per prompt, or one for all")
    return values


class Collections:
    """The garbage collector's collections taken off the step loop's critical path: inside a step that overlaps
    the one in flight its automatic collections are off (`held`), and the ones due run (`run_due`) while the step
    loop waits for the GPU: on the step loop before its wait, and on the adapter loader at its pause points
    meanwhile (`Turns.idle`). A collection holds the interpreter lock: run by whichever thread
    allocates, one of up to a millisecond and more lands inside a step's host work (the step loop's, or the
    adapter loader's, which the step loop then waits out). Collections the user turned off stay off; between two
    steps they are on, as the caller left them."""

    full_every_s: float = 60.0  # seconds between two full collections at least (see `run_due`)

    def __init__(self) -> None:
        self.holding = False
        self._last_full = time.monotonic()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Automatic collections off inside, if they are on."""
        if not gc.isenabled():
            yield
            return
        gc.disable()
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            gc.enable()

    def run_due(self, young: float) -> int | None:
        """Collect the oldest generation whose threshold the allocations passed, as the automatic collector
        would, and the young generation from `young` (a fraction) of its threshold on: the rest of the step
        allocates on (its outputs, the loader), and allocations that reach the threshold start a collection inside
        the step's host work as soon as automatic collections are back on after it. The oldest generation (a full
        collection, which walks every tracked object: the model's modules and the libraries' too) at most every
        `full_every_s` seconds, as CPython runs it only once many objects have survived since the last one.
        Returns the generation collected; None: none was due, or collections are not held here."""
        if not self.holding:
            return None
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if counts[0] < thresholds[0] * young:
            return None
        generation = 1 if counts[1] >= thresholds[1] else 0
        if generation == 1 and counts[2] >= thresholds[2] and time.monotonic() - self._last_full >= self.full_every_s:
            generation, self._last_full = 2, time.monotonic()
        gc.collect(generation)
        return generation

"""`Placer`: adapters put into their device slots a slot pool at a time, while the device runs the step in flight.

Placing an adapter is host work in every slot pool of the model (`scute.model.hf.placing`: 128 pools for a
Llama-3-8B, tens of microseconds each, several times that while the adapter loader's thread takes the interpreter
lock in turn). Done in one go between two steps it would delay the next step's launch by as much. The engine
instead advances placements while the step launched before is still running on the device (`run`: a pool, then
while ``more()``), so that they fill the time the step loop would spend waiting for it; one placement may span a
few steps. No request uses a slot until its placement has ended (`AdapterManager.ready`), and a placement takes
effect at its end, so the steps between run as if it had not begun.

When a placement ends, every object alive leaves the cyclic garbage collector's generations (`gc.freeze`, as
vLLM does after start-up). An adapter is some ten thousand Python objects (its slots' tensors, dicts, tuples),
and a full collection walks every object still tracked with the interpreter lock held, stopping the step loop
for as long: frozen, the resident adapters are not walked again, however many there are. Frozen objects are
still freed when their last reference goes; only cycles among them are never collected, so the first freeze
also registers `gc.unfreeze` to run at exit: the interpreter's last collections then free those cycles (frozen,
extension objects in them outlive the interpreter, and nanobind's, Triton's, report themselves leaked at exit).
"""

from __future__ import annotations

import atexit
import gc
from collections import deque
from collections.abc import Callable, Iterator
from functools import cache

from scute.adapters import Adapter
from scute.engine.adapter_loader import Staged
from scute.model.hf import placing
from scute.model.linear import ScuteLinear

_END = object()


class Placer:
    def __init__(self, linears: dict[str, ScuteLinear], units: list[tuple]) -> None:
        """`units`: the `layer_pools` of `linears`, walked once by the caller."""
        self.linears, self.units = linears, units
        self._jobs: deque[tuple[Adapter | None, Iterator[None]]] = deque()  # in order: one slot's may empty it first

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def add(self, slot: int, staged: Staged | None) -> None:
        """Place a staged adapter into `slot` (None: empty it), after the placements added before (call on the
        thread that runs the steps: the adapter is read on its stream from then on)."""
        adapter, prepared = (None, None) if staged is None else (staged.use(), staged.prepared)
        self._jobs.append((adapter, placing(self.linears, slot, adapter, prepared, self.units)))

    def run(self, more: Callable[[], bool]) -> list[Adapter]:
        """Advance the placements in order: one slot pool's work, then more while ``more()``; returns the adapters
        whose placement ended."""
        done, first = [], True
        while self._jobs and (first or more()):
            first = False
            adapter, work = self._jobs[0]
            if next(work, _END) is _END:
                self._jobs.popleft()
                if adapter is not None:
                    done.append(adapter)
                    _unfreeze_at_exit()
                    gc.freeze()
        return done


@cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)

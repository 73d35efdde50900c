"""The one piece of hidden state in Scute: the scoped per-step forward context.

`nn.Linear` modules receive no kwargs from a transformers model, so `ScuteLinear` reads each token's adapter
slot from here; the engine's attention function reads its paged-KV metadata from here too. A context is set
for exactly one forward (``with forward_context(ctx): model(...)``), never nested, and reading it outside one
is a bug that raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # attention.py reads the context: a runtime import would be a cycle
    from scute.model.attention import AttentionMetadata


@dataclass
class ForwardContext:
    """Per-step metadata of one forward.

    token_adapter_slots: [T] int64, the adapter slot of each token of the packed batch (−1 = base model).
    sample_adapter_slots: [S] int64, the slots of the rows that reach the LM head when the model computes
        logits only for some positions (None: the LM head sees all T tokens).
    active_adapter_slots: the distinct slots of the step's tokens, known on the host (None: unknown, any slot).
        The adapter kernels then run only the passes those slots need (`SlotPool.step_kinds`); a CUDA graph
        captured with it may be replayed only for steps whose slots are among them.
    attn: the attention backend's metadata (block tables, slot mapping, ...), None outside the engine.
    slot_rows(num_tokens): the reference op's rows per adapter slot (``scute.ops.reference.slot_rows``) of the
        token or sample slots, computed by the first `ScuteLinear` on the CPU path that needs them (one host
        sync) and reused by every other layer.
    lora_meta(num_tokens, slot_group, group_key): the adapter kernels' token metadata (`scute.ops.meta.LoraMeta`:
        tokens sorted by adapter group, tiles) of the token or sample slots for a pool's slot grouping, built on
        the device by the first layer call that needs it and reused by every other layer.
    """

    token_adapter_slots: Tensor
    sample_adapter_slots: Tensor | None = None
    active_adapter_slots: frozenset[int] | None = None
    attn: AttentionMetadata | None = None
    _rows: dict = field(default_factory=dict, repr=False)  # "token" / "sample" -> the reference op's rows
    _metas: dict = field(default_factory=dict, repr=False)  # ("token" / "sample", group key) -> LoraMeta

    def slot_rows(self, num_tokens: int) -> dict[int, Tensor]:
        """The rows of each adapter slot among the slots of a layer call over `num_tokens` rows."""
        from scute.ops.reference import slot_rows

        key = self._which(num_tokens)
        if key not in self._rows:
            self._rows[key] = slot_rows(self.adapter_slots(num_tokens))
        return self._rows[key]

    def lora_meta(self, num_tokens: int, slot_group: Tensor, group_key: tuple | None):
        """The `LoraMeta` of a layer call over `num_tokens` rows for a pool's grouping (`SlotPool.slot_group`,
        `group_key`: pools of one grouping share it)."""
        from scute.ops.launch import tile_tokens
        from scute.ops.meta import build_lora_meta

        key = (self._which(num_tokens), group_key)
        if key not in self._metas:
            self._metas[key] = build_lora_meta(self.adapter_slots(num_tokens), slot_group,
                                               block_m=tile_tokens(num_tokens))
        return self._metas[key]

    def _which(self, num_tokens: int) -> str:
        return "token" if self.token_adapter_slots.shape[0] == num_tokens else "sample"

    def adapter_slots(self, num_tokens: int) -> Tensor:
        """The slots of a layer call over `num_tokens` rows (all tokens, or only the sampled ones)."""
        if self.token_adapter_slots.shape[0] == num_tokens:
            return self.token_adapter_slots
        if self.sample_adapter_slots is not None and self.sample_adapter_slots.shape[0] == num_tokens:
            return self.sample_adapter_slots
        raise RuntimeError(
            f"a linear layer got {num_tokens} rows but the forward context has adapter slots for "
            f"{self.token_adapter_slots.shape[0]} tokens: pass all tokens of the step as one packed row"
        )


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _context
    assert _context is None, "forward_context is already set: forward contexts do not nest"
    _context = ctx
    try:
        yield ctx
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    assert _context is not None, "no forward context: run the model inside `with forward_context(...)`"
    return _context

"""Whole-model comparison of adapters on one base: logits under the exact adapter vs under its LoRA conversion.

Runs the base model with its linear layers swapped for `ScuteLinear` (the same path Scute serves with on CPU:
`scute.ops.reference`), one forward per adapter slot, on a fixed probe batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from scute.adapters.adapter import Adapter
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import place_adapter, swap_linears
from scute.model.linear import ScuteLinear


@dataclass
class LogitsError:
    """How far logits `L` are from reference logits `R` (both [batch, seq, vocab]), base logits `L0`."""

    effect_error: float  # ‖L − R‖_F / ‖R − L0‖_F: the error as a fraction of the adapter's effect
    max_abs: float  # max |L − R|
    top1_agreement: float  # fraction of positions whose argmax token is the same
    kl: float  # mean over positions of KL(softmax R ‖ softmax L), in nats

    @classmethod
    def of(cls, logits: Tensor, ref: Tensor, base: Tensor) -> LogitsError:
        L, R, L0 = logits.double(), ref.double(), base.double()
        effect = (R - L0).norm().item()
        kl = torch.nn.functional.kl_div(L.log_softmax(-1), R.log_softmax(-1), log_target=True, reduction="none")
        return cls(
            effect_error=(L - R).norm().item() / effect if effect else float("inf"),
            max_abs=(L - R).abs().max().item(),
            top1_agreement=(L.argmax(-1) == R.argmax(-1)).double().mean().item(),
            kl=kl.sum(-1).mean().item(),
        )


class SlotModel:
    """A transformers causal LM whose linears are `ScuteLinear`s with `max_adapters` slots (swapped in place
    on first use; a model already swapped is taken as it is)."""

    def __init__(self, model: nn.Module, max_adapters: int = 4) -> None:
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, ScuteLinear)}
        if not self.linears:
            self.linears = swap_linears(model, max_adapters)
        self.max_adapters = len(next(iter(self.linears.values())).slots)

    def place(self, index: int, adapter: Adapter | None) -> None:
        if adapter is not None and adapter.invocation_tokens is not None:
            raise ValueError(f"{adapter.name}: an aLoRA adapter applies only from its invocation tokens on; "
                             "SlotModel runs an adapter on every token (serve it with the Engine)")
        place_adapter(self.linears, index, adapter)

    @torch.no_grad()
    def logits(self, input_ids: Tensor, slot: int = -1) -> Tensor:
        """Logits [batch, seq, vocab] with every token under adapter `slot` (−1 = the base model)."""
        token_slots = torch.full((input_ids.numel(),), slot, dtype=torch.long, device=input_ids.device)
        with forward_context(ForwardContext(token_adapter_slots=token_slots)):
            return self.model(input_ids).logits


def probe_ids(vocab_size: int, num_tokens: int = 256, seq_len: int = 64, seed: int = 0) -> Tensor:
    """A fixed batch of random token ids, ``[ceil(num_tokens / seq_len), seq_len]``."""
    rows = max(1, -(-num_tokens // seq_len))
    return torch.randint(0, vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed))

"""`ParentRequest`: the n samples of one request (`SamplingParams.n` > 1), scheduled as n requests, reported as one.

Sample 0 is the request itself (its id, its prompt logprobs). The others (`Request.fork`: seed s + i) are held
back until sample 0 has computed its prompt; then they join the queue and, when admitted, take the full blocks
of the prompt that sample 0 holds (`BlockManager.get_computed_blocks`: a reference each, with or without the
prefix cache), computing only the tokens after them (the partly filled last block, at least one token: its logits
give the sample's first token). Each sample then grows blocks of its own. If sample 0 no longer holds its blocks
when a sample is admitted (finished or preempted meanwhile), the sample finds them in the prefix cache, or
computes the prompt itself: sharing saves work, correctness never depends on it.
"""

from __future__ import annotations

from scute.engine.request import Request


class ParentRequest:
    def __init__(self, head: Request) -> None:
        self.head = head
        self.samples = [head] + [head.fork(i) for i in range(1, head.sampling_params.n)]
        self.held = self.samples[1:]  # not queued yet: waiting for the head's prompt
        for sample in self.samples:
            sample.parent = self

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    @property
    def ready(self) -> bool:
        """Whether the held samples may be queued: the head computed its prompt, or finished."""
        head = self.head
        return head.is_finished or head.num_computed_tokens >= head.num_prompt_tokens

    def release(self) -> list[Request]:
        """The held samples to queue now, those not finished (an abort finishes all). A head that failed fails
        them with its error."""
        held, self.held = self.held, []
        if self.head.finish_reason == "error":
            for sample in held:
                sample.finish("error", error=self.head.error)
        return [s for s in held if not s.is_finished]

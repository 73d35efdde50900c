"""`Engine`: many requests, each with its own PEFT adapter (or none), served in one batch per step.

``step()`` = schedule → run the packed batch → append sampled tokens, stop finished requests. `generate` loops
it; callers that stream use `add_request` / `step` / `has_unfinished_requests` / `abort_request`.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext

from tqdm.auto import tqdm

from scute.adapters import Adapter, AdapterError
from scute.adapters.conversion import folder_name
from scute.config import EngineConfig
from scute.engine.adapter_manager import MAX_PREFETCH, AdapterManager
from scute.engine.adapter_memory import adapter_budget
from scute.engine.block_manager import BlockManager
from scute.engine.distributed import tensor_parallel
from scute.engine.kv_plan import plan_kv_cache
from scute.engine.model_runner import InFlight, ModelRunner
from scute.engine.output_processor import OutputProcessor
from scute.engine.parallel_sampling import ParentRequest
from scute.engine.request import AdapterRequest, Request
from scute.engine.scheduler import Scheduler, SchedulerOutput
from scute.engine.utils import Collections, is_token_ids, per_prompt, tokenize
from scute.model.loader import load_model
from scute.outputs import RequestOutput
from scute.sampling_params import SamplingParams

AdapterSpec = None | str | os.PathLike | AdapterRequest | Adapter


class Engine:
    """Serve a base model with many adapters. `model`: a Hugging Face folder, a ``.gguf`` file, or a built
    transformers model (taken over: its linear layers become `ScuteLinear`); `tokenizer` overrides the one
    found beside the weights; `options`: `EngineConfig` fields (an unknown one raises TypeError). With
    ``tensor_parallel_size`` N > 1 this process is rank 0 of N (`scute.engine.distributed`); `close` ends them."""

    def __init__(self, model, tokenizer=None, **options) -> None:
        self.config = EngineConfig.from_kwargs(options)
        with tensor_parallel(model, self.config) as self.tp:  # closes the workers if the rest raises
            loaded = load_model(model, tokenizer, self.config)
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
            self.vocab_size = self.model.get_input_embeddings().num_embeddings
            memory = adapter_budget(self.config, loaded.linears, loaded.dtype, loaded.device, MAX_PREFETCH)
            self.adapters = (AdapterManager if self.tp is None else self.tp.adapter_manager)(
                loaded.adapter_base, loaded.linears, self.config.max_adapters, self.config.max_adapter_rank,
                self.config.max_cpu_adapters, loaded.device, memory_bytes=memory)
            num_blocks, self.max_model_len = plan_kv_cache(loaded, self.config, memory or 0)
            self.runner = ModelRunner(loaded, self.config, num_blocks, self.max_model_len, self.tp and self.tp.send)
            if self.runner.graphs is not None:
                self.runner.capture_graphs()
            self.adapters.warm_tokens = self.runner.step_sizes()
            self.adapters.loader.reserve(memory or 0)  # last: the KV plan and the graphs empty the allocator's cache
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, self.adapters)
        self.requests: dict[str, Request] = {}
        self._reported: list[Request] = []  # finished outside a step (errors, aborts): reported by the next step
        self._in_flight: InFlight | None = None  # a decode step launched, its tokens not read yet
        self.collections = Collections()  # the garbage collector's, run while the GPU runs a step in flight
        # and by the loader meanwhile, at its pause points (`Turns.idle`), from half the young threshold
        self.adapters.loader.turns.idle = functools.partial(self.collections.run_due, young=0.5)
        self._forking: list[ParentRequest] = []  # requests with n > 1 whose other samples wait for the prompt
        self._arrivals, self._ids = itertools.count(), itertools.count()
        # device_wait_s: seconds the host waited for a launched step's tokens (the GPU still ran it): what of the
        # graph steps' time the host did not spend on its own work
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "batched_tokens": 0, "preemptions": 0,
                      "device_wait_s": 0.0}
        self.output_processor = OutputProcessor(self.tokenizer, loaded.eos_token_ids, self.max_model_len, self.stats)

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is collected, and at exit); idempotent."""
        if getattr(self, "tp", None) is not None:
            self.tp.close()

    __del__ = close

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str | os.PathLike, **options) -> Adapter:
        """Load a PEFT folder under `name` (replacing an adapter of that name); raises AdapterError if it
        cannot be served. Requests then name it by `name`. `options` go to the adapter's method, as for
        `scute.adapters.load_adapter`: ``dense=True``, Poly's ``task_id``, ...; one the method does not take
        raises AdapterError naming the method and the options it takes."""
        return self.adapters.load_named(name, path, **options)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def adapter_capacity(self, adapter: str | os.PathLike | Adapter) -> int:
        """How many adapters like `adapter` (a `load_adapter` name, a PEFT folder: read here unless cached, an
        `Adapter`) the device slots hold at once (`AdapterMemory.capacity`, at most `max_adapters`)."""
        if not isinstance(adapter, Adapter):
            adapter = self.adapters.named.get(os.fspath(adapter)) or self.adapters.get_by_path(adapter)
        return self.adapters.memory.capacity(adapter, self.config.max_adapters)

    def _resolve_adapter(self, spec: AdapterSpec) -> tuple[Adapter | None, str | None]:
        if spec is None:
            return None, None
        if isinstance(spec, Adapter):
            return spec, spec.name
        if isinstance(spec, AdapterRequest):
            if spec.path is not None:
                return self.adapters.lookup(spec.path, spec.name), spec.name
            spec = spec.name
        name = os.fspath(spec)
        if name in self.adapters.named:
            return self.adapters.named[name], name
        if os.path.isdir(name) or os.sep in name or isinstance(spec, os.PathLike):
            adapter = self.adapters.lookup(name)  # read on the adapter loader, unless cached
            return adapter, adapter.name
        raise AdapterError(f"adapter {name!r}: no adapter of this name was loaded with Engine.load_adapter, "
                           "and it is not a PEFT folder")

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, adapter: AdapterSpec = None) -> None:
        """Queue a request. A bad adapter or prompt fails this request alone: a later `step()` returns it
        finished with finish_reason "error" and the reason in `error` (the next one, or the one after its load)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        text, error, adapter_obj, adapter_name = (prompt if isinstance(prompt, str) else None), None, None, None
        try:
            token_ids = tokenize(self.tokenizer, self.vocab_size, prompt)
            if sp.stop_strings and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer to match the text against: pass tokenizer= to "
                                 "Engine, or stop_token_ids")
            adapter_obj, adapter_name = self._resolve_adapter(adapter)
        except (AdapterError, OSError, ValueError, TypeError) as e:
            token_ids, error = ([] if isinstance(prompt, str) else list(prompt)), f"{type(e).__name__}: {e}"
            adapter_name = adapter_name or _spec_name(adapter)
        req = Request(request_id, text, token_ids, sp, adapter_obj, adapter_name, next(self._arrivals))
        req.eos_token_ids = self.eos_token_ids
        self.requests[request_id] = req
        if sp.n > 1:  # the other samples start once this one has computed the prompt (`_release_samples`)
            self._forking.append(ParentRequest(req))
        if error is None and len(token_ids) >= self.max_model_len:
            error = (f"ValueError: prompt has {len(token_ids)} tokens, max_model_len is {self.max_model_len} "
                     "(it needs room for at least one generated token): shorten the prompt or raise max_model_len")
        if error is not None:
            for sample in req.samples:
                sample.finish("error", error=error)
            self._forking = [p for p in self._forking if p.head is not req]
            self._reported.append(req)
        else:
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests (all n samples of each); each is reported once more by the next `step()` with
        finish_reason "abort" (samples that had finished keep their reason)."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self.requests.get(rid)
            if req is not None and not all(s.is_finished for s in req.samples):
                for sample in [s for s in req.samples if not s.is_finished]:
                    sample.finish("abort")
                    self.scheduler.finish(sample)
                self._reported.append(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._reported or self._forking or self._in_flight)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the state of every request whose tokens this call read: those of this step, or
        of the decode step launched by the call before (decode steps on CUDA graphs overlap, see `_step`)."""
        return self._step(stream=True)

    def _step(self, stream: bool) -> list[RequestOutput]:
        """`_schedule_and_run`; while a decode step is in flight the loader's Python waits for it (`Turns`), and the
        garbage collector's collections for the step loop's wait for the GPU (`Collections`)."""
        overlap = self._in_flight is not None
        with self.adapters.loader.turns.step_loop() if overlap else nullcontext(), \
                self.collections.held() if overlap else nullcontext():  # collections while the GPU runs (`_land`)
            return self._schedule_and_run(stream)

    def _schedule_and_run(self, stream: bool) -> list[RequestOutput]:
        """Schedule and run one step. A decode step that replays a CUDA graph is launched before the tokens of
        the step in flight are read: the host lands those (appends them, checks stops, builds the outputs this
        call reports) while the GPU runs, and the new step's tokens land in the next call (a request that
        stopped is computed once more, and that token dropped). Placements advance in between, while the step in
        flight runs with the new one queued behind it (`Placer`). Any other step first lands the step in flight:
        its inputs need every token on the host (a penalized request's tokens are on the device: `PenaltyTokens`)."""
        self._release_samples()
        done, self._reported = self._reported, []
        done += self.adapters.poll(self.scheduler.finish)  # adapters loaded meanwhile; failed loads fail their requests
        sched = self.scheduler.schedule()
        self.stats["preemptions"] += len(sched.preempted)
        sampling = [req for req, n in sched.scheduled if req.num_computed_tokens + n == req.num_tokens]
        land_first = self.tp is not None
        flight = self.runner.launch(sched, sampling, self._in_flight) if sched.scheduled and not land_first else None
        placed = self.adapters.place(lambda run=self._in_flight or flight: run is None or not run.event.query())
        landed = self._land()
        if flight is None:  # requests the landing stopped leave the step, which has every token on the host now
            sched.scheduled = [(r, n) for r, n in sched.scheduled if not r.is_finished]
            sched.num_batched_tokens = sum(n for _, n in sched.scheduled)
            sampling = [r for r in sampling if not r.is_finished]
            if land_first and sched.scheduled:
                flight = self.runner.launch(sched, sampling, None)
        if sched.scheduled:
            landed += self._run(sched, sampling, flight)
        elif not landed and not placed:
            done += self._fail_unschedulable()
        done += [r for r in landed if r.is_finished]
        progressed = [r for r in landed if not r.is_finished] if stream else []
        return self._outputs(done + progressed, stream)

    def _run(self, sched: SchedulerOutput, sampling: list[Request], flight: InFlight | None) -> list[Request]:
        """Account for a scheduled step: run it to its end unless it is `flight` (launched, its tokens pending);
        returns the requests whose tokens it appended."""
        result = self.runner.execute(sched, sampling) if flight is None else None
        for req, num_new in sched.scheduled:
            req.num_computed_tokens += num_new
            if not req.is_finished:
                self.block_manager.cache_blocks(req)
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += sched.num_batched_tokens
        if flight is not None:
            for req in sampling:
                req.num_pending += 1
            self._in_flight = flight
            return []
        if result is None:
            return []
        self._append_tokens(sampling, result)
        return sampling

    def _land(self) -> list[Request]:
        """Read the tokens of the step in flight (waiting for the GPU if it is still running), append them and
        stop the requests they end; returns its requests that had not finished before."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        with self.adapters.loader.turns.waiting():
            if not flight.event.query():  # the GPU still runs it: the collections due meanwhile, the young
                self.collections.run_due(young=0.125)  # from an eighth: the step's outputs then stay below it
            start = time.perf_counter()
            result = flight.wait()
            self.stats["device_wait_s"] += time.perf_counter() - start
        live = [r for r in flight.sampling if not r.is_finished]
        for req in flight.sampling:
            req.num_pending -= 1
        self._append_tokens(flight.sampling, result)
        return live

    def _append_tokens(self, sampling: list[Request], result) -> None:
        self.output_processor.append_tokens(sampling, result)
        for req in sampling:
            if req.is_finished:
                self.scheduler.finish(req)

    def _fail_unschedulable(self) -> list[Request]:
        """Nothing runs and the head request cannot start (max_model_len above the KV cache): fail it, unless
        waiting requests' adapters are loading."""
        if self.scheduler.running or not self.scheduler.waiting or self.adapters.wait_for_load():
            return []
        req = self.scheduler.waiting[0]
        req.finish("error", error=f"RuntimeError: request needs {req.num_tokens} tokens of KV cache, which "
                                  f"{self.block_manager.num_blocks} free blocks cannot hold")
        self.scheduler.finish(req)
        return [req]

    def _release_samples(self) -> None:
        """Queue the held samples of the requests whose first sample computed its prompt (or finished)."""
        for parent in [p for p in self._forking if p.ready]:
            self._forking.remove(parent)
            for sample in parent.release():
                self.scheduler.add_request(sample)
            if parent.head.finish_reason == "error":  # its first sample failed before computing the prompt
                self._reported.append(parent.head)

    def _outputs(self, reqs: list[Request], stream: bool) -> list[RequestOutput]:
        """One output per request, its n samples together (reported by the id of sample 0); a request not
        finished is reported only when streaming, and not if its `SamplingParams.output_kind` is "final_only"."""
        heads = dict.fromkeys(r if r.parent is None else r.parent.head for r in reqs)
        return [self._output(h) for h in heads if (h.is_finished if h.parent is None else h.parent.finished)
                or stream and h.sampling_params.output_kind != "final_only"]

    def _output(self, req: Request) -> RequestOutput:
        out = self.output_processor.make_output(req)
        if out.finished:
            self.requests.pop(req.request_id, None)  # reported for the last time
        return out

    @property
    def eos_token_ids(self) -> list[int]:
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.output_processor.eos_token_ids = list(ids)

    # ------------------------------------------------------------------ offline batch
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: AdapterSpec | Sequence[AdapterSpec] = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists); `adapters` has one entry per prompt (None,
        a PEFT folder, a name given to `load_adapter`, or an `AdapterRequest`), any mix of methods. Returns
        the outputs in prompt order; a failed request has finish_reason "error" and `error` set."""
        prompts = [prompts] if isinstance(prompts, str) or is_token_ids(prompts) else list(prompts)
        params = per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params", SamplingParams)
        specs = per_prompt(adapters, len(prompts), "adapters", (str, os.PathLike, AdapterRequest, Adapter))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, sp, spec in zip(ids, prompts, params, specs):
            self.add_request(rid, prompt, sp, spec)
        wanted, results = set(ids), {}
        start, generated = time.perf_counter(), self.stats["generated_tokens"]
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests() and len(results) < len(ids):
                for out in self._step(stream=False):
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
                rate = (self.stats["generated_tokens"] - generated) / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        return [results[rid] for rid in ids]


def _spec_name(spec: AdapterSpec) -> str | None:
    """The name a request's adapter would have had, for one that failed: a folder's own name (as a loaded one's),
    an `AdapterRequest`'s name, or the name given."""
    if isinstance(spec, (str, os.PathLike)):
        return folder_name(spec) or os.fspath(spec)
    return getattr(spec, "name", None)

"""Tensor parallelism over processes: the engine's process is rank 0, and it starts ranks 1..N−1 as workers.

Rank 0 owns everything a one-process engine owns (scheduler, block manager, adapter manager, sampling, outputs)
and its share of the model. Each worker (`torch.multiprocessing`, spawn) loads the same model folder, keeps its
share (`scute.model.tp`: the model's tp plan), plans the same KV blocks and then loops: receive a step, apply the
adapter placements it carries, run the same forward, drop the logits (the LM head is replicated and the hidden
states are equal on every rank after each all-reduce). One broadcast per step carries the step (`StepInputs` or
a `GraphStep`, plain lists) and the placements made since the step before (slot, full folded adapter on the
CPU); each rank shards the slots itself as it places them.

Groups: the default one (gloo on the CPU, NCCL on CUDA) runs the row-parallel layers' all-reduces, with
`TIMEOUT`; the steps travel on a gloo group of their own (`IDLE`: a worker waits as long as an idle server
does). Rendezvous is a TCP store on a free port of 127.0.0.1, and gloo and NCCL connect over the loopback
interface only. A dead worker is an error on rank 0 (checked before each step); `close` (the engine's close,
its collection, or exit) tells the workers to leave and joins them.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scute.adapters.adapter import Adapter, Interned
from scute.adapters.conversion import intern_shared
from scute.config import EngineConfig
from scute.engine.adapter_loader import AdapterLoader
from scute.engine.adapter_manager import MAX_PREFETCH, AdapterManager
from scute.engine.adapter_memory import adapter_budget
from scute.engine.kv_plan import plan_kv_cache
from scute.engine.model_runner import ModelRunner
from scute.engine.step_inputs import GraphStep, StepInputs
from scute.model.hf import place_adapter
from scute.model.loader import NEEDS_A_PATH, load_model
from scute.model.tp import check_adapter, check_tp_size

TIMEOUT = datetime.timedelta(seconds=300)  # a collective (or the start) waiting longer for a rank fails: no hang
IDLE = datetime.timedelta(days=365)  # how long a worker waits for rank 0's next step
JOIN_SECONDS = 30  # how long `close` waits for a worker to leave before it is terminated
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}

Placement = tuple[int, Adapter | None]  # a device slot and the adapter put there (None: emptied)


class TensorParallel:
    """Rank 0's end: the worker processes, the step group and the placements to send with the next step."""

    def __init__(self, model, config: EngineConfig) -> None:
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(NEEDS_A_PATH)
        model, self.world_size = os.fspath(model), config.tensor_parallel_size
        if os.path.isdir(model):  # refused before any process starts
            from transformers import AutoConfig

            check_tp_size(AutoConfig.from_pretrained(model), self.world_size)
        if dist.is_initialized():
            raise RuntimeError("this process already has a torch.distributed process group (another engine with "
                               "tensor_parallel_size > 1?): close it first (Engine.close)")
        devices = [rank_device(config, rank) for rank in range(self.world_size)]
        if devices[0].type == "cuda" and devices[-1].index >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.world_size} needs GPUs {devices[0].index}-"
                             f"{devices[-1].index}; {torch.cuda.device_count()} are visible")
        listener = socket.create_server(("127.0.0.1", 0))  # the store's port, bound before any worker starts
        port, threads, spawn = listener.getsockname()[1], torch.get_num_threads(), mp.get_context("spawn")
        self.workers = [spawn.Process(target=_worker, args=(rank, port, model, replace(config, device=str(device)),
                                                            threads), name=f"scute-tp-rank{rank}", daemon=True)
                        for rank, device in enumerate(devices) if rank > 0]
        self.placements: list[Placement] = []
        self.group, self._store, self._closed = None, None, False
        atexit.register(self.close)
        try:
            for worker in self.workers:
                worker.start()
            self._store = dist.TCPStore("127.0.0.1", port, self.world_size, True, timeout=TIMEOUT,
                                        wait_for_workers=False, master_listen_fd=listener.detach())  # the store's now
            self._wait([f"joining/{rank}" for rank in range(1, self.world_size)])
            self.group = _join(self._store, 0, self.world_size, devices[0])
        except BaseException:
            self.close()
            raise

    def _wait(self, keys: list[str]) -> None:
        """Wait until the workers set `keys` in the store; a worker that exits first is an error, not a hang."""
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not self._store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {TIMEOUT}")
            time.sleep(0.02)

    def check(self) -> None:
        """Raise RuntimeError if a worker has exited."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {worker.pid}) exited with code "
                                   f"{worker.exitcode}; its error is on stderr. Close this engine and start another")

    def adapter_manager(self, *args, **kwargs) -> ShardedAdapterManager:
        return ShardedAdapterManager(self.placements, *args, **kwargs)

    def send(self, step: StepInputs | GraphStep) -> None:
        """Broadcast a step, and the placements made since the last one, to the workers (one collective)."""
        self.check()
        if isinstance(step, GraphStep) and step.gather[0]:
            raise RuntimeError("a tensor-parallel decode step takes its tokens from the host: land the step in "
                               "flight first")
        message = [(list(self.placements), step)]
        self.placements.clear()
        dist.broadcast_object_list(message, src=0, group=self.group)

    def close(self) -> None:
        """Tell the workers to leave, join them (terminating any that does not leave), end the groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        leaving = self.group is not None and all(w.is_alive() for w in self.workers)
        if leaving:  # else the others would wait for a collective that never comes: they are terminated
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([None], src=0, group=self.group)
        self.group = None
        for worker in self.workers:
            worker.join(JOIN_SECONDS if leaving else 0)
            if worker.is_alive():
                worker.terminate()
                worker.join()
        self.workers = []
        if dist.is_initialized():  # ours: a process with a group of its own was refused
            dist.destroy_process_group()
        self._store = None
        atexit.unregister(self.close)


@contextlib.contextmanager
def tensor_parallel(model, config: EngineConfig) -> Iterator[TensorParallel | None]:
    """Rank 0's `TensorParallel` (None when ``tensor_parallel_size`` is 1) while an engine is built; closed if
    building it raises."""
    tp = TensorParallel(model, config) if config.tensor_parallel_size > 1 else None
    try:
        yield tp
    except BaseException:
        if tp is not None:
            tp.close()
        raise


class ShardedAdapterManager(AdapterManager):
    """Rank 0's `AdapterManager`: adapters are converted against the full layers; one a sharded layer cannot hold
    fails its requests alone (its `check`: AdapterError, as other bad adapters do); each new placement is recorded
    for the workers (the CPU adapter, its full folded slots)."""

    def __init__(self, placements: list[Placement], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.check = lambda adapter: check_adapter(adapter, self.linears)
        self.placements = placements
        self._sent: list[str | None] = [None] * self.max_adapters  # identity each slot holds on the workers

    def acquire(self, adapter: Adapter | None) -> int:
        slot = super().acquire(adapter)
        if adapter is not None and self._sent[slot] != adapter.identity:
            self._sent[slot] = adapter.identity
            self.placements.append((slot, adapter.to(device="cpu")))
        return slot


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: the engine's on the CPU; on CUDA the GPU `rank` places after the engine's."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", (torch.cuda.current_device() if device.index is None else device.index) + rank)


@contextlib.contextmanager
def _loopback() -> Iterator[None]:
    """While the groups are made, gloo and NCCL connect over the loopback interface (unless told otherwise)."""
    unset = [k for k in LOOPBACK if k not in os.environ]
    os.environ.update({k: LOOPBACK[k] for k in unset})
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


def _join(store: dist.TCPStore, rank: int, world_size: int, device: torch.device):
    """Join the default group (NCCL on CUDA, gloo on the CPU) and make the step group (gloo); returns the latter."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    with _loopback():
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=TIMEOUT, device_id=device if cuda else None)
        return dist.new_group(backend="gloo", timeout=IDLE)


def _reshare(adapter: Adapter, interned: Interned) -> Adapter:
    """`adapter` with each shared matrix (VeRA's) the one tensor of its content in `interned` (this worker's), as
    the adapters sharing it on rank 0 share one: each placement arrives in its own message. Each storage of the
    message is interned once, whatever the number of layers that view it."""
    bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def whole(x: torch.Tensor) -> torch.Tensor:
        key = (x.untyped_storage().data_ptr(), x.dtype)
        if key not in bases:
            bases[key] = intern_shared(torch.empty(0, dtype=x.dtype).set_(x.untyped_storage()), interned)
        return bases[key].as_strided(x.size(), x.stride(), x.storage_offset())

    return replace(adapter, layers={n: replace(s, **{k: whole(getattr(s, k)) for k in s.shared})
                                    for n, s in adapter.layers.items()})


def _worker(rank: int, port: int, model: str, config: EngineConfig, threads: int) -> None:
    """A worker's life: join, load its share, plan the KV cache with the others, then run the steps it is sent."""
    torch.set_num_threads(threads)
    device = config.torch_device()
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False, timeout=TIMEOUT)
    store.set(f"joining/{rank}", "1")
    group = _join(store, rank, config.tensor_parallel_size, device)
    loaded = load_model(model, None, config, rank)
    loaded.adapter_base = None  # the full layers: only rank 0 converts adapters
    memory = adapter_budget(config, loaded.linears, loaded.dtype, device, MAX_PREFETCH) or 0
    runner = ModelRunner(loaded, config, *plan_kv_cache(loaded, config, memory))
    if runner.graphs is not None:
        runner.capture_graphs(progress=False)
    loader, memo, interned = AdapterLoader(device, loaded.dtype), {}, {}  # adapters as rank 0's slots hold them
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        if message[0] is None:
            break
        placements, step = message[0]
        for slot, adapter in placements:
            place_adapter(loaded.linears, slot, adapter and loader.to_device(_reshare(adapter, interned), memo))
        with torch.inference_mode():
            runner.replay(step) if isinstance(step, GraphStep) else runner.forward(step)
    dist.destroy_process_group()


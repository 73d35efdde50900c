"""The fast load path on the CPU: the safetensors reader (views of one buffer, identity, bad ranges), the packed
move (`Adapter.to`: one buffer, aligned, same values; a packed adapter moves whole) and DoRA's weight norm taken a
block of rows at a time on the served W0, still PEFT's."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from concurrent.futures import wait

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from scute.adapters import AdapterError, load_adapter, read_checkpoint
from scute.adapters.checkpoint import SAFETENSORS
from scute.adapters import checkpoint as ckpt_module
from scute.adapters import safetensors_file
from scute.adapters import conversion
from scute.adapters.adapter import ALIGN, pack
from scute.adapters.methods import dora
from scute.ops.sha256 import sha256_leaves
from scute.ops.slots import TENSOR_SLOTS, fold_layers
from tests.helpers import ALL_LINEAR, assert_matches_peft, make_adapter, tiny_model

WEIGHTS = SAFETENSORS


def test_reader_matches_safetensors_and_views_one_buffer(lora_dir, monkeypatch):
    want = load_file(os.path.join(lora_dir, WEIGHTS))
    monkeypatch.setattr(safetensors_file, "CHUNK", 4096)  # many chunks and leaves: the parallel read and the hash tree
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    ckpt = read_checkpoint(lora_dir)
    assert ckpt.tensors.keys() == want.keys()
    for key, x in want.items():
        got = ckpt.tensors[key]
        assert got.dtype == x.dtype and torch.equal(got, x), key
        assert got.untyped_storage().data_ptr() == ckpt.buffer.untyped_storage().data_ptr()
    assert read_checkpoint(lora_dir).identity == ckpt.identity
    for readers in (1, 3, 64):  # one thread, threads over several chunks each, a thread per chunk
        monkeypatch.setattr(safetensors_file, "READERS", readers)
        again = read_checkpoint(lora_dir)
        assert again.identity == ckpt.identity and torch.equal(again.buffer, ckpt.buffer)
    save_file({k: v + (k.endswith("q_proj.lora_B.weight") and k.startswith("base_model.model.model.layers.0."))
               for k, v in want.items()}, os.path.join(lora_dir, WEIGHTS))
    assert read_checkpoint(lora_dir).identity != ckpt.identity


def test_reader_threads_read_their_parts_behind_a_gate(lora_dir, monkeypatch):
    """With a gate, each reader thread calls it before each `PART` bytes it reads (the engine's `Turns.gate`: no
    read while the step loop holds its turn); reads held at the gate wait there, and the bytes are the file's."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 1024)  # a file of 8 KB: 9 chunks, 3 runs, 256-byte parts
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    monkeypatch.setattr(safetensors_file, "PART", 256)
    monkeypatch.setattr(safetensors_file, "READERS", 3)
    want = read_checkpoint(lora_dir)
    open_gate, calls, lock = threading.Event(), [], threading.Lock()

    def gate() -> None:
        with lock:
            calls.append(threading.current_thread().name)
        open_gate.wait(30)

    ckpt = read_checkpoint(lora_dir, gate=gate)
    time.sleep(0.2)
    assert ckpt.reading and not ckpt.is_read  # held at the gate
    assert 1 <= len(calls) <= 3 and all(name.startswith("scute-read") for name in calls)
    open_gate.set()
    size = os.path.getsize(os.path.join(lora_dir, WEIGHTS))
    assert torch.equal(ckpt.buffer, want.buffer) and ckpt.identity == want.identity
    head = 8 + int.from_bytes(want.buffer[:8].numpy().tobytes(), "little")
    assert len(calls) >= (size - head) // 256  # a call per part (a run's first part starts at a chunk's start)


def hash_tree(folder, leaf: int) -> str:
    """A folder's identity as defined (`Digest`): the sha256 of its config's bytes, then of the sha256 of each
    `leaf` bytes of its weights file, in order."""
    digest = hashlib.sha256((folder / "adapter_config.json").read_bytes())
    data = (folder / WEIGHTS).read_bytes()
    for i in range(0, len(data), leaf):
        digest.update(hashlib.sha256(data[i:i + leaf]).digest())
    return digest.hexdigest()


WHERE = ["read", "cpu", "cpu-arriving"]  # (a file read for a GPU: pinned; there, `cpu` is a CPU conversion's)
WHERE += [f"pinned-{w}" for w in WHERE + ["cuda", "cuda-arriving"]] if torch.cuda.is_available() else []


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("readers", [1, 3])
def test_identity_is_the_files_hash_tree_wherever_its_span_is_hashed(tmp_path, monkeypatch, where, readers):
    """The leaves inside the span are hashed where the converter copies the span (on the reader threads from a
    CPU copy; by the kernel on a GPU: its copy there, or one of its own for a file read into pinned memory:
    `SpanLeaves`), or from the buffer when the identity is asked first (`read`); the others on the reader threads:
    the identity is the same hash tree every way, of `LEAF`-byte leaves for a file read for a GPU (pinned), of
    `CHUNK`-byte ones for the CPU."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 512)
    monkeypatch.setattr(safetensors_file, "LEAF", 128)
    monkeypatch.setattr(safetensors_file, "READERS", readers)
    on_gpu = []
    monkeypatch.setattr(safetensors_file, "sha256_leaves",
                        lambda x, leaf, **kw: on_gpu.append(x) or sha256_leaves(x, leaf, **kw))
    saved(tmp_path, {f"t{k}": torch.randn(57, 29).bfloat16() for k in range(5)})
    pinned, action = where.startswith("pinned-"), where.removeprefix("pinned-")
    device = torch.device(action.split("-")[0] if action != "read" else "cpu")
    ckpt = read_checkpoint(tmp_path, pin_memory=pinned)
    assert ckpt.digest.span is not None and ckpt.digest.span.count >= 4  # most leaves, not all: a header before
    if action.endswith("arriving"):
        views = ckpt.arriving(device)
        ckpt.land()
        assert torch.equal(views["t1"].cpu(), ckpt.tensors["t1"])
    elif action != "read":
        ckpt.tensors_on(device)
    assert ckpt.identity == hash_tree(tmp_path, 128 if pinned else 512)
    assert bool(on_gpu) == pinned and all(x.is_cuda for x in on_gpu)


def test_identity_of_a_file_whose_span_holds_no_whole_leaf(tmp_path, monkeypatch):
    """A span shorter than a leaf: every leaf is hashed on the reader threads (`SpanLeaves` none), the tree the
    same."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 4096)
    saved(tmp_path, {"a": torch.randn(3, 5).bfloat16(), "b": torch.randn(7).bfloat16()})
    ckpt = read_checkpoint(tmp_path)
    assert ckpt.digest.span is None and ckpt.identity == hash_tree(tmp_path, 4096)


def test_reader_refuses_a_range_past_the_file(lora_dir):
    path = os.path.join(lora_dir, WEIGHTS)
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1)
    open(path, "wb").write(data[:8] + header + data[8 + n:])
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        read_checkpoint(lora_dir)


def test_pack_is_one_aligned_buffer_with_the_same_values():
    xs = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    moved = pack(xs, [torch.float64, torch.float32, torch.float16], torch.device("cpu"))
    assert len({m.untyped_storage().data_ptr() for m in moved}) == 1
    base = moved[0].untyped_storage().data_ptr()
    assert all((m.data_ptr() - base) % ALIGN == 0 for m in moved)  # and the allocator aligns the base
    assert [m.dtype for m in moved] == [torch.float64, torch.float32, torch.float16]
    assert all(torch.equal(m, x.to(m.dtype)) for m, x in zip(moved, xs))
    assert pack(xs, [None] * 3, torch.device("cpu")) == xs  # already there: the tensors themselves
    again = pack(moved, [None] * 3, torch.device("meta"))  # a packed buffer moves whole, views at the same places
    assert [m.storage_offset() for m in again] == [m.storage_offset() for m in moved]
    assert len({m.untyped_storage().data_ptr() for m in pack(moved, [None] * 3, torch.device("meta"))}) == 1


def test_adapter_to_keeps_matrices_and_vectors_apart(lora_dir):
    adapter = load_adapter(lora_dir, tiny_model())
    assert adapter.to() is adapter and adapter.to(torch.float32, "cpu") is adapter  # where and as asked already
    moved = adapter.to(torch.float16, vector_dtype=torch.float32)
    for name, slots in moved.layers.items():
        for key, x in slots.tensors().items():
            assert x.dtype == (torch.float32 if x.dim() == 1 else torch.float16), (name, key)
            assert torch.equal(x, adapter.layers[name].tensors()[key].to(x.dtype))


def mixed_tensors() -> dict[str, torch.Tensor]:
    """A file's worth of tensors: three bf16 ones (the file holds them side by side), a float32 and an int one."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(7, generator=g).bfloat16(),
            "c": torch.randn(4, generator=g), "d": torch.arange(2), "e": torch.randn(2, 2, generator=g).bfloat16()}


def saved(folder, tensors: dict[str, torch.Tensor]):
    """`folder` holding `tensors` as a (LoRA-typed) PEFT folder."""
    save_file(tensors, str(folder / WEIGHTS))
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return folder


def test_cast_together_casts_a_files_tensors_as_one_span(tmp_path):
    """A file's bf16 tensors come back in float32 as views of one cast span (one operation for all of them), with
    each tensor's own values; tensors of the target dtype, integer ones and lone ones as they are, or cast alone."""
    want = mixed_tensors()
    tensors = read_checkpoint(saved(tmp_path, want)).tensors
    lone = torch.randn(6, generator=torch.Generator().manual_seed(1)).half()
    cast = ckpt_module.cast_together({**tensors, "lone": lone}, torch.float32)
    for key, x in {**want, "lone": lone}.items():
        got = cast[key]
        assert got.dtype == (torch.float32 if x.is_floating_point() else x.dtype), key
        assert got.shape == x.shape and torch.equal(got, x.to(got.dtype)), key
    assert len({cast[k].untyped_storage().data_ptr() for k in "abe"}) == 1  # one span
    assert cast["c"] is tensors["c"] and cast["d"] is tensors["d"]


@pytest.mark.parametrize("where", ["a", "b", "c", "e", None])
def test_first_nonfinite_names_the_first_bad_tensor_of_a_file(tmp_path, monkeypatch, where):
    """A file's tensors that tile its buffer are checked as one span; a NaN or an Inf anywhere is still reported
    by the first key that holds one (two here when `where` is "b": b and e), a finite file by None."""
    want = mixed_tensors()
    if where is not None:
        want[where].view(-1)[-1] = float("nan")
    if where == "b":
        want["e"][0, 0] = float("inf")
    checked = []
    finite = ckpt_module._finite
    monkeypatch.setattr(ckpt_module, "_finite", lambda xs: checked.append(len(xs)) or finite(xs))
    assert ckpt_module.first_nonfinite(read_checkpoint(saved(tmp_path, want)).tensors) == where
    assert checked[0] == 2  # the bf16 span (a, b, e) and c: two checks for four tensors


def test_a_bf16_file_converts_as_each_tensor_cast_alone(lora_dir, monkeypatch):
    """LoRA's slots from a bf16 file for a float32 model, its tensors cast as one span of the file, equal those
    cast one by one (the file's header parsed again without a span, and nothing cast together)."""
    path = os.path.join(lora_dir, WEIGHTS)
    save_file({k: v.bfloat16() for k, v in load_file(path).items()}, path)
    model = tiny_model()
    together = load_adapter(lora_dir, model)
    assert read_checkpoint(lora_dir).layout.span is not None
    safetensors_file.layout_of.cache_clear()
    monkeypatch.setattr(safetensors_file, "span_of", lambda entries: None)
    monkeypatch.setattr(ckpt_module, "cast_together", lambda tensors, dtype: dict(tensors))
    alone = load_adapter(lora_dir, model)
    safetensors_file.layout_of.cache_clear()  # no layout without a span outlives the test
    assert together.layers.keys() == alone.layers.keys()
    for name, slots in together.layers.items():
        for key, x in slots.tensors().items():
            assert x.dtype == torch.float32 and torch.equal(x, alone.layers[name].tensors()[key]), (name, key)


@pytest.mark.parametrize("where", ["a", "b", "c", "e", None])
def test_tensors_on_checks_and_casts_a_files_span_at_once(tmp_path, where):
    """A file whose floating tensors tile one span (here all bf16, an int tensor beside them) comes back cast,
    each tensor a view of the one cast span with its own values; a NaN or an Inf anywhere raises, naming the
    first tensor that holds one."""
    want = {k: x.bfloat16() if x.is_floating_point() else x for k, x in mixed_tensors().items()}
    if where is not None:
        want[where].view(-1)[0] = float("inf")
    ckpt = read_checkpoint(saved(tmp_path, want))
    assert ckpt.layout.span is not None
    if where is not None:
        with pytest.raises(AdapterError, match=f"tensor '{where}' has NaN or Inf"):
            ckpt.tensors_on(torch.device("cpu"), torch.float32)
        return
    got = ckpt.tensors_on(torch.device("cpu"), torch.float32)
    for key, x in want.items():
        assert got[key].dtype == (torch.float32 if x.is_floating_point() else x.dtype), key
        assert torch.equal(got[key], x.to(got[key].dtype)), key
    assert len({got[k].untyped_storage().data_ptr() for k in "abce"}) == 1  # one cast span


@pytest.mark.parametrize("cast", [False, True], ids=["as-read", "cast"])
def test_a_files_views_are_made_a_run_at_a_time_and_are_each_tensors_own(tmp_path, cast):
    """A LoRA file's tensors come as a few runs (one projection's A or B across the layers: one view of all, split),
    each tensor exactly the view of its own bytes that one call per tensor makes (offset, shape, strides, values),
    in the file's order; as read, and as views of the span cast to float32."""
    make_adapter(str(tmp_path), LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))
    ckpt = read_checkpoint(tmp_path)
    layout = ckpt.layout
    assert len(layout.runs) == len(layout.entries) // 2 and all(len(keys) == 2 for keys, *_ in layout.runs)  # 2 layers
    pauses = []
    if cast:
        _, lo, hi = layout.span
        span = ckpt.buffer[lo:hi].view(layout.span[0]).float()
        got, want = layout.views(ckpt.buffer, span, lambda: pauses.append(1)), {}
        for key, dtype, shape, start in layout.entries:
            offset = span.storage_offset() + (start - lo) // dtype.itemsize
            want[key] = span.as_strided(shape, safetensors_file.contiguous_strides(shape), offset)
    else:
        got = layout.views(ckpt.buffer, pause=lambda: pauses.append(1))
        want = {key: ckpt.buffer[start:start + x.numel() * dtype.itemsize].view(dtype).view(shape)
                for (key, dtype, shape, start), x in zip(layout.entries, got.values())}
    assert list(got) == list(layout.keys) == list(want) and pauses
    for key, x in want.items():
        y = got[key]
        assert (y.storage_offset(), y.shape, y.stride(), y.dtype) == (x.storage_offset(), x.shape, x.stride(), x.dtype)
        assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and torch.equal(y, x), key


def test_a_header_is_parsed_once_for_every_file_that_has_it(tmp_path):
    """Files with the same header (a server's adapters of one kind) share one parsed `Layout`, and with it the
    split of their keys by method; their tensors are each file's own."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    want = mixed_tensors()
    saved(a, want)
    saved(b, {k: x + 1 if x.is_floating_point() else x for k, x in want.items()})
    first, second = read_checkpoint(a), read_checkpoint(b)
    assert first.layout is second.layout
    assert torch.equal(second.tensors["a"], want["a"] + 1) and torch.equal(first.tensors["a"], want["a"])
    assert safetensors_file.span_of(first.layout.entries) is None  # bf16 and float32 together: no one span
    third = read_checkpoint(a)  # one tensor alone (a model-level one), without every tensor's view
    assert all(torch.equal(third.tensor(k), x) for k, x in want.items()) and "tensors" not in vars(third)


def test_dora_norm_in_row_blocks_matches_peft(tmp_path, monkeypatch):
    """DoRA's norm over blocks of 8 rows of the served W0 (many blocks per layer): PEFT's outputs, in float64."""
    monkeypatch.setattr(dora, "CPU_CHUNK", 8 * 64)
    config = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    assert_matches_peft(tmp_path, config)


PLAIN_LORA = {
    "plain": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "patterns_rslora": lambda: LoraConfig(r=8, lora_alpha=16, rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 3},
                                          use_rslora=True, target_modules=ALL_LINEAR),
}
NOT_PLAIN = {  # converted layer by layer: a bias, DoRA's magnitude, trained biases of the base layers (qwen2's q/k/v)
    "lora_bias": lambda: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj"]),
    "dora": lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]),
    "bias_all": lambda: LoraConfig(r=4, lora_alpha=8, bias="all", target_modules=["q_proj", "v_proj"]),
}


def converted(path, model, monkeypatch=None, **kwargs):
    """`convert_checkpoint` of the folder `path` for `model`; with `monkeypatch`, LoRA's per-layer path raises."""
    from scute.adapters.methods import lora

    def per_layer(*args):
        raise AssertionError("per layer")

    if monkeypatch is not None:
        monkeypatch.setattr(lora, "lora_factors", per_layer)
    return conversion.convert_checkpoint(read_checkpoint(path), conversion.linear_modules(model), **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with a base bias
@pytest.mark.parametrize("config", list(PLAIN_LORA))
def test_plain_lora_converts_all_layers_at_once_to_the_per_layer_slots(tmp_path, monkeypatch, family, config):
    """A plain LoRA adapter is converted by `convert_plain_lora` (the per-layer path is not called), into exactly
    the slots the per-layer path makes (``dense=True`` takes the per-layer path: plain LoRA does not read it)."""
    make_adapter(str(tmp_path), PLAIN_LORA[config](), family)
    model = tiny_model(family)
    slow = converted(tmp_path, model, dense=True)
    fast = converted(tmp_path, model, monkeypatch)
    with pytest.raises(AssertionError, match="per layer"):
        converted(tmp_path, model, monkeypatch, dense=True)
    assert list(fast) == list(slow) and len(fast) == 14
    for name, sl in fast.items():
        want = slow[name]
        assert {k: v for k, v in vars(sl).items() if k not in TENSOR_SLOTS} == \
            {k: v for k, v in vars(want).items() if k not in TENSOR_SLOTS}, name
        assert sl.live == want.live == ("A", "B") and all(
            torch.equal(sl.tensors()[k], want.tensors()[k]) for k in sl.live), name
    scales = {round(sl.scale, 6) for sl in fast.values()}
    want = {8 / 4} if config == "plain" else {16 / 8 ** 0.5, 16 / 4 ** 0.5, 3 / 8 ** 0.5}  # rsLoRA: alpha / sqrt(r)
    assert scales == {round(s, 6) for s in want}


@pytest.mark.parametrize("config", list(NOT_PLAIN))
def test_lora_with_a_bias_or_dora_converts_layer_by_layer(tmp_path, monkeypatch, config):
    make_adapter(str(tmp_path), NOT_PLAIN[config](), "qwen2")
    with pytest.raises(AssertionError, match="per layer"):
        converted(tmp_path, tiny_model("qwen2"), monkeypatch)


def bf16_lora(path, config: str = "patterns_rslora") -> None:
    """A LoRA folder whose file is bf16, with scales that are not powers of two (their product rounds)."""
    make_adapter(str(path), PLAIN_LORA[config]())
    file = os.path.join(path, WEIGHTS)
    save_file({k: v.bfloat16() for k, v in load_file(file).items()}, file)


def test_plain_lora_in_the_serving_dtype_is_folded_in_place_to_the_cast_of_the_float32_fold(tmp_path):
    """Given its bf16 tensors before their values (`AdapterCheckpoint.arriving`, here on the CPU), `convert_plain_lora`
    makes the slots at once and folds B ← s·B where the tensors are once they land: the values that folding in
    float32 and casting to bf16 give, bit for bit; A is the file's tensor itself. `start_load` given the serving
    dtype takes that path on the CPU too, to the same values."""
    from scute.adapters.methods.lora import convert_plain_lora

    bf16_lora(tmp_path)
    model = tiny_model()
    modules = conversion.linear_modules(model)
    want = {n: sl.folded() for n, sl in converted(tmp_path, model, dense=True).items()}
    ckpt = read_checkpoint(tmp_path)
    arriving = ckpt.arriving(torch.device("cpu"))
    layers = {n: {"lora_A.weight": arriving[f"base_model.model.{n}.lora_A.weight"],
                  "lora_B.weight": arriving[f"base_model.model.{n}.lora_B.weight"]} for n in want}
    fast = convert_plain_lora(ckpt.config, layers, modules, ckpt.landing, lambda: None)
    ckpt.land()
    ckpt.verify()
    assert ckpt.landing is None and ckpt.finite is None
    rounded = 0
    for name, sl in fast.items():
        assert sl.scale == 1.0 and sl.merged == ("s",) and sl.A is layers[name]["lora_A.weight"], name
        assert sl.B is layers[name]["lora_B.weight"], name  # folded in place
        assert sl.B.dtype == torch.bfloat16 and torch.equal(sl.B, want[name].B.bfloat16()), name
        assert torch.equal(sl.A, want[name].A.bfloat16()), name
        rounded += not torch.equal(sl.B.float(), want[name].B)  # the fold rounded: the test can tell
    assert rounded > 0
    assert all(sl is fast[n] for n, sl in fold_layers(fast).items())  # folded already: kept as it is
    load = conversion.start_load(tmp_path, model, dtype=torch.bfloat16)
    assert load.arriving  # the file's own copy where W0 is, folded in place once its values land
    name = next(iter(load.layers))
    seen = []  # work on the values given to `then`: after they land and fold, or at once once they have
    load.then(lambda: seen.append(load.layers[name].B.clone()))
    assert seen == []
    load.land()
    load.then(lambda: seen.append(load.layers[name].B.clone()))
    assert len(seen) == 2 and all(torch.equal(b, fast[name].B) for b in seen)
    served = load.finish().layers
    assert served.keys() == fast.keys()
    assert all(torch.equal(sl.A, fast[n].A) and torch.equal(sl.B, fast[n].B) for n, sl in served.items())
    # tensors in another dtype than the serving one and the converter's: the per-layer path casts them
    other = ckpt_module.Landing(torch.float16, torch.empty(0))
    assert convert_plain_lora(ckpt.config, layers, modules, other, lambda: None) is None and not other.after


@pytest.mark.parametrize("where", ["b", None])
def test_arriving_tensors_get_the_files_values_at_land_then_their_writes(tmp_path, where):
    """`arriving`: views of a buffer of their own, made before the file's values are there; `land` copies the span
    in, then runs the writes given to `then` in order; `verify` fails a file with a NaN, naming its tensor (its
    check is of the values as read, before those writes)."""
    tensors = {k: x.bfloat16() for k, x in mixed_tensors().items() if x.is_floating_point()}
    if where is not None:
        tensors[where].view(-1)[1] = float("nan")
    saved(tmp_path, tensors)
    ckpt = read_checkpoint(tmp_path)
    views = ckpt.arriving(torch.device("cpu"))
    assert {k: (x.shape, x.dtype) for k, x in views.items()} == {k: (x.shape, x.dtype) for k, x in tensors.items()}
    assert len({x.untyped_storage().data_ptr() for x in views.values()}) == 1
    assert views["a"].untyped_storage().data_ptr() != ckpt.buffer.untyped_storage().data_ptr()  # its own
    done = []
    ckpt.landing.then(lambda: done.append(views["a"].clone()))
    ckpt.landing.then(lambda: views["a"].mul_(2))
    ckpt.land()
    if where is not None:
        with pytest.raises(AdapterError, match=f"tensor '{where}' has NaN"):
            ckpt.verify()
        return
    ckpt.verify()
    assert torch.equal(done[0], tensors["a"]) and torch.equal(views["a"], 2 * tensors["a"])
    assert all(torch.equal(views[k], tensors[k]) for k in tensors if k != "a")


def test_a_read_that_fails_on_the_reader_threads_fails_the_load(lora_dir, monkeypatch):
    """A file that ends while its chunks are read (shortened after its size was taken): the read's error names the
    file, and the load fails with it."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 1024)
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    preadv = os.preadv
    monkeypatch.setattr(safetensors_file.os, "preadv",  # the file as if it ended at byte 4096
                        lambda fd, bufs, pos: 0 if pos >= 4096 else preadv(fd, [bufs[0][:4096 - pos]], pos))
    ckpt = read_checkpoint(lora_dir)  # the header is read: the rest is read on the reader threads
    with pytest.raises(AdapterError, match="corrupt or truncated .*the file ended at byte 4096"):
        ckpt.buffer
    with pytest.raises(AdapterError, match="corrupt or truncated .*the file ended at byte 4096"):
        ckpt.identity
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        load_adapter(lora_dir, tiny_model())


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_plain_lora_from_a_bf16_file_is_served_as_the_files_views(device):
    """A bf16 LoRA loaded for a bf16 model with the serving dtype is its file's span where the model is, B folded
    there: the same tensors, bit for bit, as the float32 conversion cast to bf16 (what the engine's loader
    serves otherwise), and the device copy is the adapter itself."""
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        bf16_lora(path)
        model = tiny_model(dtype=torch.bfloat16).to(device)
        fast = load_adapter(path, model, dtype=torch.bfloat16)
        slow = load_adapter(path, model).to(torch.bfloat16, vector_dtype=torch.float32)
    assert fast.layers.keys() == slow.layers.keys()
    for name, sl in fast.layers.items():
        assert sl.live == slow.layers[name].live == ("A", "B"), name
        assert all(torch.equal(x, slow.layers[name].tensors()[k]) and x.dtype == torch.bfloat16
                   for k, x in sl.tensors().items()), name
    assert len({x.untyped_storage().data_ptr() for sl in fast.layers.values() for x in sl.tensors().values()}) == 1
    assert fast.to(torch.bfloat16, torch.device(device), vector_dtype=torch.float32) is fast


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["served-as-read", "float32"])
def test_a_non_finite_file_fails_its_load_alone(tmp_path, dtype, device):
    """A NaN in a bf16 LoRA's file (its span checked where the model is, as read or cast) fails `load_adapter`,
    naming the tensor; in the engine the bad adapter's request fails with that error and the clean one's
    completes."""
    from scute import Engine, SamplingParams

    good, bad = tmp_path / "good", tmp_path / "bad"
    bf16_lora(good)
    bf16_lora(bad)
    key = next(k for k in read_checkpoint(bad).layout.keys if k.endswith("lora_B.weight"))
    tensors = {k: x.clone() for k, x in read_checkpoint(bad).tensors.items()}
    tensors[key].view(-1)[5] = float("nan")
    save_file(tensors, str(bad / WEIGHTS))
    model = tiny_model(dtype=torch.bfloat16).to(device)
    load_adapter(good, model, dtype=dtype)
    with pytest.raises(AdapterError, match=f"tensor '{re.escape(key)}' has NaN or Inf"):
        load_adapter(bad, model, dtype=dtype)
    engine = Engine(model, device=device, dtype="bfloat16", max_model_len=64)
    outs = engine.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=2), [str(bad), str(good)], use_tqdm=False)
    assert "NaN or Inf" in outs[0].error and outs[1].error is None
    assert engine.adapters.loader.wait_idle(60)  # its CPU-tier copy's job ended before the next test's engine


def gated_file(folder, monkeypatch) -> tuple[dict[str, torch.Tensor], threading.Event]:
    """A bf16 file of a few chunks saved in `folder` (its tensors) whose reads past the header wait for the gate
    (set it to let them go on)."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 1024)
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    tensors = {f"t{k}": torch.randn(32, 64).bfloat16() for k in range(3)}
    saved(folder, tensors)
    gate, preadv = threading.Event(), os.preadv
    monkeypatch.setattr(safetensors_file.os, "preadv",  # every read past the header's two waits for the gate
                        lambda fd, bufs, pos: preadv(fd, bufs, pos) if pos in (0, 8) or gate.wait(10) else 0)
    return tensors, gate


def test_a_files_tensors_arrive_while_it_is_read(tmp_path, monkeypatch):
    """`read_checkpoint` returns once the header is read, the rest still being read on the reader threads: the
    views `arriving` makes need no value and do not wait for it; `land` waits for the read, and the values are the
    file's."""
    tensors, gate = gated_file(tmp_path, monkeypatch)
    ckpt = read_checkpoint(tmp_path)
    views = ckpt.arriving(torch.device("cpu"))
    assert ckpt.reading and not any(read.done() for read in ckpt.reading)
    gate.set()
    ckpt.land()
    ckpt.verify()
    assert not ckpt.reading and all(torch.equal(views[k], x) for k, x in tensors.items())
    assert ckpt.identity == read_checkpoint(tmp_path).identity


def test_a_load_lands_at_its_first_pause_point_after_the_read(tmp_path, monkeypatch):
    """`AdapterLoad.landing`: the pause points of work on the slots (their rows) land the values once the file's
    read has ended, not before: after the pause point's wait if the read ended during it, before the wait if it
    had ended already; `finish` then gives the file's values."""
    tensors, gate = gated_file(tmp_path, monkeypatch)

    def read_to_the_end(ckpt) -> None:
        gate.set()
        assert not wait(ckpt.reading, timeout=10).not_done

    ckpt = read_checkpoint(tmp_path)
    views = ckpt.arriving(torch.device("cpu"))
    landed = []  # at each wait of a pause point: whether the values had landed
    pause = conversion.AdapterLoad(ckpt, "a", "", {}, True).landing(
        lambda: (landed.append(ckpt.landing is None), read_to_the_end(ckpt) if len(landed) == 2 else None))
    pause()
    assert not ckpt.is_read and ckpt.landing is not None and landed == [False]  # still reading: not landed
    pause()  # the read ends during this one's wait
    assert ckpt.is_read and ckpt.landing is None and ckpt.finite is not None and landed == [False, False]
    adapter = conversion.AdapterLoad(ckpt, "a", "", {}, True).finish()
    assert all(torch.equal(views[k], x) for k, x in tensors.items())
    assert adapter.identity == read_checkpoint(tmp_path).identity
    again = read_checkpoint(tmp_path)
    again.arriving(torch.device("cpu"))
    read_to_the_end(again)
    conversion.AdapterLoad(again, "a", "", {}, True).landing(lambda: landed.append(again.landing is None))()
    assert landed[-1] is True  # the read had ended: landed before the wait


def test_a_loads_reads_land_one_by_one_at_its_pause_points(tmp_path, monkeypatch):
    """`AdapterLoad.landing`: each pause point copies the bytes of the reads that ended since the last one to
    the `arriving` tensors (their transfers run while the rest is read), each read once, the others' bytes not
    yet; the first pause point after the last read lands the rest (the check, the hash, the work given to
    `then`): the values and the identity are the file's."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 1024)  # 12 KB of tensors: 3 runs of 4 chunks
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    monkeypatch.setattr(safetensors_file, "READERS", 3)
    tensors = {f"t{k}": torch.randn(32, 64).bfloat16() for k in range(3)}
    saved(tmp_path, tensors)
    data = torch.frombuffer(bytearray((tmp_path / WEIGHTS).read_bytes()), dtype=torch.uint8)
    allowed, cond, preadv = set(), threading.Condition(), os.preadv

    def gated(fd, bufs, pos):  # a run's read waits until its start is allowed (the header's reads go on)
        with cond:
            if pos not in (0, 8) and not cond.wait_for(lambda: pos in allowed, 10):
                return 0
        return preadv(fd, bufs, pos)

    monkeypatch.setattr(safetensors_file.os, "preadv", gated)
    ranges, copy_bytes = [], ckpt_module.AdapterCheckpoint._copy_bytes
    monkeypatch.setattr(ckpt_module.AdapterCheckpoint, "_copy_bytes",
                        lambda self, landing, a, b: ranges.append((a, b)) or copy_bytes(self, landing, a, b))
    ckpt = read_checkpoint(tmp_path)
    reads = list(ckpt.reading)
    spans = [(read.start, read.end) for read in reads]

    def copied() -> list[int]:  # the reads whose bytes were copied, by index, in order (any other range: -1)
        return [spans.index(r) if r in spans else -1 for r in ranges]

    assert len(reads) == 3
    views = ckpt.arriving(torch.device("cpu"))
    _, lo, hi = ckpt.layout.span
    raw = ckpt.landing.raw.zero_()
    ckpt.landing.then(lambda: views["t0"].mul_(2))
    pause = conversion.AdapterLoad(ckpt, "a", "", {}, True).landing(lambda: None)

    def let(*ks: int) -> None:
        with cond:
            allowed.update(reads[k].start for k in ks)
            cond.notify_all()
        assert not wait([reads[k] for k in ks], timeout=10).not_done

    let(0)
    pause()
    a, b = max(reads[0].start, lo), min(reads[0].end, hi)
    assert copied() == [0] and ckpt.landing is not None  # the first read's bytes in place, not landed
    assert torch.equal(raw[a - lo:b - lo], data[a:b]) and not raw[b - lo:].any()
    pause()
    assert copied() == [0]  # once
    let(1, 2)
    pause()
    assert sorted(copied()) == [0, 1, 2] and ckpt.landing is None and ckpt.finite is not None  # no gap left
    adapter = conversion.AdapterLoad(ckpt, "a", "", {}, True).finish()
    assert torch.equal(views["t0"], 2 * tensors["t0"]) and torch.equal(views["t2"], tensors["t2"])
    assert adapter.identity == read_checkpoint(tmp_path).identity


def test_land_copies_what_land_arrived_did_not(tmp_path, monkeypatch):
    """`land` after some reads were copied (`land_arrived`) copies the rest of the span, the gaps between them,
    even when the reads' list is gone (`buffer` waited for it): the values are the file's."""
    monkeypatch.setattr(safetensors_file, "CHUNK", 1024)
    monkeypatch.setattr(safetensors_file, "LEAF", 256)
    monkeypatch.setattr(safetensors_file, "READERS", 3)
    tensors = {f"t{k}": torch.randn(32, 64).bfloat16() for k in range(3)}
    saved(tmp_path, tensors)
    ckpt = read_checkpoint(tmp_path)
    views = ckpt.arriving(torch.device("cpu"))
    ckpt.landing.raw.zero_()
    assert not wait(ckpt.reading, timeout=10).not_done
    middle = ckpt.reading[1]
    ckpt._copy_bytes(ckpt.landing, middle.start, middle.end)  # as `land_arrived` copies one read
    ckpt.landing.copied.append((middle.start, middle.end))
    ckpt.buffer  # noqa: B018 - the reads' list cleared
    assert not ckpt.reading
    ckpt.land()
    ckpt.verify()
    assert all(torch.equal(views[k], x) for k, x in tensors.items())

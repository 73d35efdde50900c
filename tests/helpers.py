"""The tests' shared helpers (every test folder imports from here, never from another test file).

* Tiny transformers models built from configs, and real PEFT adapters with every tensor randomized: PEFT's
  default inits are zero or identity (LoRA B = 0, OFT R = I, IA3 l = 1) and would hide bugs, so `make_adapter`
  perturbs every trainable adapter tensor before `save_pretrained`.
* The PEFT-equality check of one adapter (`check_layers`, `assert_matches_peft`), which the method table of
  `tests/adapters/test_peft_equality.py` runs for every method, and the references where PEFT's default path is
  not the oracle and that a method's own tests use too (`exact_filters`, `psoft_build`).
* The mixed-batch oracle (`peft_alone`, `mixed_forward`, `assert_rows_match`): PEFT ignores `adapter_names` for
  IA3, VeRA, OFT and others, so each row's reference is PEFT with that adapter alone.
* The engine's oracle (`Oracle`): transformers + PEFT greedy `generate` per adapter, and its requests.
* A stand-in for the GPU runner (`StandInRunner`), for the CPU tests of the overlap of decode steps.
* Adapters that cannot be served (`bad_adapters`), for the tests of failures that stay with their requests.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable

import torch
from peft import IA3Config, LoraConfig, OFTConfig, PeftModel, VeraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from scute.sampling_params import SamplingParams

FAMILIES = ("llama", "qwen2")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIVE_METHODS = {  # one config of each core method, for tests that mix them
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "dora": lambda: LoraConfig(r=6, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR),
}


BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def bench_module(name: str):
    """The script bench/`name`.py as a module (bench/ joins sys.path: the scripts import their siblings by name)."""
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module(name)


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, hidden: int = 64):
    """A 2-layer model with GQA (4 query heads, 2 kv heads); qwen2 has q/k/v biases. Deterministic per seed."""
    common = dict(
        vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # transformers inits biases to zero: make them matter
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


def randomize_adapter(peft_model, seed: int = 1) -> None:
    """Give every trainable adapter tensor a random, non-trivial value (a perturbation of its init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "lora_magnitude_vector" in name or "ia3_l" in name:
                p.mul_(1 + 0.3 * noise)  # scales around their identity init
            elif "oft_R" in name:
                p.copy_(0.15 * noise)
            elif "vera_lambda" in name:
                p.copy_(0.5 * noise)
            elif ".ranknum." in name:
                continue  # AdaLoRA's rank number: a constant (init_r) that PEFT marks trainable but never saves
            elif "boft_s" in name or "road_alpha" in name or "delora_lambda" in name:
                p.mul_(1 + 0.3 * noise)  # scales around their init (ones; DeLoRA: the configured lambda)
            elif name.endswith("bias"):
                p.add_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


@contextlib.contextmanager
def perturbed_buffers(scale: Callable[[str], float]):
    """While active, `make_adapter` also multiplies each saved buffer (frozen, so `randomize_adapter` leaves it
    as PEFT built it) by ``1 + scale(name)·noise`` (scale 0: untouched): for methods whose saved buffers shape the
    forward, so that a converter recomputing them instead of reading them fails."""
    global randomize_adapter
    original = randomize_adapter

    def randomize(peft_model, seed: int = 1) -> None:
        original(peft_model, seed)
        g, perturbed = torch.Generator().manual_seed(seed + 100), 0
        with torch.no_grad():
            for name, b in peft_model.named_buffers():
                if s := scale(name):
                    b.mul_(1 + s * torch.randn(b.shape, generator=g, dtype=torch.float64).to(b.dtype))
                    perturbed += 1
        assert perturbed, "perturbed_buffers: no buffer of this adapter matched (renamed by PEFT?)"

    randomize_adapter = randomize
    try:
        yield
    finally:
        randomize_adapter = original


def make_adapter(path: str, config, family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 1,
                 hidden: int = 64):
    """Build a PEFT model on a fresh tiny base, randomize its adapter, save it to `path`; returns the PEFT model."""
    peft_model = get_peft_model(tiny_model(family, dtype, hidden=hidden), config)
    randomize_adapter(peft_model, seed)
    peft_model.eval()
    os.makedirs(path, exist_ok=True)
    peft_model.save_pretrained(path)
    return peft_model


def edit_adapter_config(path, **changes) -> None:
    """Rewrite the adapter_config.json in the folder `path` with `changes` (a value of None deletes the key)."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    with open(file, "w") as f:
        json.dump(cfg, f)


def capture_layers(peft_model, input_ids: torch.Tensor, forward: Callable | None = None):
    """Run the PEFT model once (``forward(peft_model, input_ids)``, default ``peft_model(input_ids)``); returns
    (logits, {module name: (input, output)}) for every adapted layer, names as in the base model (without PEFT's
    ``base_model.model.`` prefix)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    records, hooks = {}, []
    prefix = "base_model.model."
    for name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer) and name.startswith(prefix):
            def hook(mod, args, out, name=name[len(prefix):]):
                records[name] = (args[0].detach(), out.detach())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        logits = (forward or (lambda m, ids: m(ids)))(peft_model, input_ids).logits
    for h in hooks:
        h.remove()
    return logits, records


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def effect_err(actual: torch.Tensor, expected: torch.Tensor, base: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected − base‖: the error as a fraction of the adapter's effect."""
    return ((actual - expected).norm() / (expected - base).norm()).item()


def check_layers(layers: dict, slots: dict, base_model, tol: dict) -> float:
    """Each PEFT-adapted layer's captured (input, output) against the reference op with the converted slots,
    unfolded and folded; asserts `tol` ("rel" of the output, "effect" of the adapter's change) and returns the
    largest relative error."""
    from scute.ops.reference import scute_linear_ref

    assert set(layers) <= set(slots), "a layer PEFT adapts was not converted"
    modules, worst = dict(base_model.named_modules()), 0.0
    for name, (x, y_peft) in layers.items():
        lin = modules[name]
        x2 = x.reshape(-1, lin.in_features)
        zeros = torch.zeros(x2.shape[0], dtype=torch.long)
        y_base = torch.nn.functional.linear(x2, lin.weight, lin.bias)
        for s in (slots[name], slots[name].folded()):
            y = scute_linear_ref(x2, lin.weight, lin.bias, [s], zeros)
            expected = y_peft.reshape(y.shape)
            worst = max(worst, rel_err(y, expected))
            assert rel_err(y, expected) <= tol["rel"], name
            if not torch.equal(expected, y_base):
                assert effect_err(y, expected, y_base) <= tol["effect"], name
    return worst


# ---------------------------------------------------------------------------------------------- PEFT equality
TOL = {torch.float64: {"rel": 1e-10, "effect": 1e-10}, torch.float32: {"rel": 1e-5, "effect": 1e-3}}
IDS = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(0))


def run_rows(model, row_slots, ids=IDS, token_slots=None):
    """Logits of `ids` through a swapped model, row i on adapter slot `row_slots[i]` (−1: the base model), or
    each token on its own slot when `token_slots` is given."""
    from scute.model.context import ForwardContext, forward_context

    if token_slots is None:
        token_slots = torch.tensor(row_slots).repeat_interleave(ids.shape[1])
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=token_slots)):
        return model(ids).logits


def assert_matches_peft(path, config, family="llama", dtype=torch.float64, build_ctx=contextlib.nullcontext,
                        run_ctx=None, dense=False, reference=None, forward=None, options=None) -> float:
    """Save a randomized PEFT adapter at `path`, then check Scute against PEFT per layer (unfolded and folded,
    from the checkpoint alone) and on the whole model; returns the largest relative error seen.

    `build_ctx()` wraps PEFT's model building and forward, `run_ctx(dtype)` PEFT's forward only; `reference`
    (path -> PEFT model) replaces the in-memory PEFT model (e.g. one reloaded from the checkpoint); `forward`
    (peft_model, ids -> output) runs PEFT (Poly: with its task ids); `options` are load options (Poly: task_id)."""
    from scute.adapters import convert_checkpoint, load_adapter, read_checkpoint
    from scute.adapters.conversion import linear_modules
    from scute.model.hf import place_adapter, swap_linears

    path = str(path)
    with build_ctx():
        peft_model = make_adapter(path, config, family, dtype)
        if reference is not None:
            peft_model = reference(path)
        with (run_ctx or (lambda d: contextlib.nullcontext()))(dtype):
            peft_logits, layers = capture_layers(peft_model, IDS, forward)
    base = tiny_model(family, dtype)
    with torch.no_grad():
        base_logits = base(IDS).logits
    tol = TOL[dtype]
    assert rel_err(base_logits, peft_logits) > 1e-3, "the adapter has no visible effect: the test could not fail"

    options = options or {}
    slots = convert_checkpoint(read_checkpoint(path), linear_modules(base), dense=dense, **options)
    worst = check_layers(layers, slots, base, tol)

    model = tiny_model(family, dtype)
    linears = swap_linears(model, max_adapters=2)
    place_adapter(linears, 1, load_adapter(path, model, dense=dense, **options))
    logits = run_rows(model, [1, 1, 1])
    worst = max(worst, rel_err(logits, peft_logits))
    assert rel_err(logits, peft_logits) <= tol["rel"]
    assert effect_err(logits, peft_logits, base_logits) <= tol["effect"]
    assert torch.equal(run_rows(model, [-1, -1, -1]), base_logits)
    return worst


@contextlib.contextmanager
def exact_filters(dtype):
    """PEFT's WaveFT with the exact Daubechies filters in its table, in float64 only: its tabulated db3 filter
    (copied from PyWavelets) is up to 3.6e-12 off the exact one Scute computes, ~5e-10 in the float64 logits."""
    if dtype != torch.float64:
        yield
        return
    from peft.tuners.waveft import wavelet

    from scute.adapters.methods.waveft import daubechies

    saved = dict(wavelet._WAVELET_COEFFS)
    wavelet._WAVELET_COEFFS.update({f"db{n}": list(daubechies(n)) for n in range(1, 11)})
    try:
        yield
    finally:
        wavelet._WAVELET_COEFFS.clear()
        wavelet._WAVELET_COEFFS.update(saved)


@contextlib.contextmanager
def psoft_build():
    """PEFT's PSOFT with float64 buffers on a float64 base, and R's tensors randomized around their init (see
    the top of `tests/adapters/test_peft_equality.py`)."""
    from peft.tuners.psoft.layer import PsoftLayer

    global randomize_adapter
    build, randomize = PsoftLayer._build_psoft_ab_cache_buffers, randomize_adapter

    def build64(self, adapter_name, init_type):
        weight = self.get_base_layer().weight
        if weight.dtype != torch.float64:
            return build(self, adapter_name, init_type)
        w64 = weight.data
        assert torch.equal(w64.float().double(), w64), "PEFT's float32 SVD would not see W0 itself"
        weight.data = w64.float()
        try:
            build(self, adapter_name, init_type)  # PEFT's own float32 SVD and factors
        finally:
            weight.data = w64
        A, B = self._get_psoft_ab_cache_buffers(adapter_name)
        self._set_psoft_ab_cache_buffers(adapter_name, A.double(), B.double())

    def randomize_psoft(peft_model, seed=1):
        randomize(peft_model, seed)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
                if name.endswith(("psoft_R.default.vector_a", "psoft_R.default.vector_b")):
                    p.copy_(1 + 0.3 * noise)
                elif name.endswith("psoft_R.default.weight") and p.dim() == 2:  # psoft_orth=False: R itself
                    p.copy_(torch.eye(p.shape[0], dtype=p.dtype) + 0.2 * noise)

    PsoftLayer._build_psoft_ab_cache_buffers, randomize_adapter = build64, randomize_psoft
    try:
        yield
    finally:
        PsoftLayer._build_psoft_ab_cache_buffers, randomize_adapter = build, randomize


# ---------------------------------------------------------------------------------------------- mixed batches
def peft_alone(root, configs: dict, family: str, dtype: torch.dtype, ids: torch.Tensor, seed: int = 10,
               contexts: Callable[[str], tuple] = lambda name: (contextlib.nullcontext, None)):
    """Save each adapter of `configs` (name -> config factory) under ``root/name`` (seed `seed` + its index) and
    PEFT's logits of `ids` with that adapter alone: PEFT ignores `adapter_names` for IA3, VeRA, OFT and most other
    methods, so a mixed batch's reference is built one adapter at a time. `contexts(name)` gives the
    (build_ctx, run_ctx) of `assert_matches_peft` for an adapter. Returns ({name: logits}, {name: path})."""
    refs, paths = {}, {}
    for i, (name, config) in enumerate(configs.items()):
        paths[name] = str(root / name)
        build_ctx, run_ctx = contexts(name)
        with build_ctx():
            peft_model = make_adapter(paths[name], config(), family, dtype, seed=seed + i)
            with (run_ctx or (lambda d: contextlib.nullcontext()))(dtype), torch.no_grad():
                refs[name] = peft_model(ids).logits
    return refs, paths


def mixed_forward(model, adapters: dict, order: list[str], rows: list[str | None], ids: torch.Tensor,
                  max_adapters: int | None = None) -> torch.Tensor:
    """Swap `model`'s linears, place adapter `order[k]` in slot k (put them in another order than the rows) and
    run one forward whose row i is on adapter `rows[i]` (None: the base model)."""
    from scute.model.hf import place_adapter, swap_linears

    linears = swap_linears(model, max_adapters=max_adapters or len(order))
    for slot, name in enumerate(order):
        place_adapter(linears, slot, adapters[name])
    token_slots = torch.tensor([-1 if r is None else order.index(r) for r in rows]).repeat_interleave(ids.shape[1])
    return run_rows(model, None, ids, token_slots.to(ids.device))


def assert_rows_match(logits, rows: list[str | None], refs: dict, base_logits, tol: dict) -> None:
    """Each adapter row of a mixed batch equals PEFT with that adapter alone (within `tol`: "rel" of the logits,
    "effect" of the adapter's change); each base row is bit-identical to the base model's."""
    for i, name in enumerate(rows):
        if name is None:
            assert torch.equal(logits[i], base_logits[i])
            continue
        assert rel_err(logits[i], refs[name][i]) <= tol["rel"], name
        assert effect_err(logits[i], refs[name][i], base_logits[i]) <= tol["effect"], name


# ---------------------------------------------------------------------------------------------- the engine
METHODS = list(FIVE_METHODS)
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def random_prompts(lengths, seed=0, vocab=128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts([3, 11, 21, 37])


class Oracle:
    """The five core adapters saved on disk and their transformers + PEFT greedy references (each with that
    adapter alone; computed once, cached)."""

    def __init__(self, root, family: str = "llama") -> None:
        self.family, self.paths, self._refs = family, {}, {}
        for i, (name, config) in enumerate(FIVE_METHODS.items()):
            self.paths[name] = str(root / f"{family}-{name}")
            make_adapter(self.paths[name], config(), family, seed=10 + i)

    def model(self, adapter: str | None):
        """transformers' model in float32, with PEFT's `adapter` alone (None: the base model)."""
        model = tiny_model(self.family)
        return model if adapter is None else PeftModel.from_pretrained(model, self.paths[adapter]).eval()

    def reference(self, adapter: str | None, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        key = (adapter, tuple(prompt), new_tokens)
        if key not in self._refs:
            model = self.model(adapter)
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            self._refs[key] = out[0, len(prompt):].tolist()
        return self._refs[key]

    @property
    def eos_token_id(self) -> int:
        return tiny_model(self.family).config.eos_token_id

    def logits(self, adapter: str | None, ids: list[int]) -> torch.Tensor:
        """The float32 logits [len(ids), vocab] of `ids` under transformers + PEFT with `adapter` alone."""
        with torch.no_grad():
            return self.model(adapter)(torch.tensor([ids])).logits[0].float()

    def engine(self, **options):
        from scute import Engine

        options = {"device": "cpu", "dtype": "float32", "max_model_len": 128, **options}
        return Engine(tiny_model(self.family), **options)


def check(oracle: Oracle, outputs, prompts, adapters, new_tokens: int = NEW_TOKENS) -> None:
    """Every output finished by length, without error, with exactly the oracle's greedy tokens."""
    for out, prompt, adapter in zip(outputs, prompts, adapters, strict=True):
        assert out.error is None, out.error
        assert out.finished and out.outputs[0].finish_reason == "length"
        want = oracle.reference(adapter, prompt, new_tokens)
        assert out.outputs[0].token_ids == want, f"adapter {adapter}, prompt of {len(prompt)} tokens"


def mixed_requests():
    """Every prompt of PROMPTS once per adapter (None: the base model), the adapters rotated between prompts."""
    names = [None, *METHODS]
    prompts_, adapters = [], []
    for i, prompt in enumerate(PROMPTS):
        for j in range(len(names)):
            prompts_.append(prompt)
            adapters.append(names[(i + j) % len(names)])
    return prompts_, adapters


# ---------------------------------------------------------------------------------------------- a stand-in runner
STAND_IN_VOCAB = 128


def stand_in_model(token: int, position: int) -> int:
    """The stand-in runner's "model": the next token as a fixed function of the input token and its position."""
    return (token * 31 + position * 7 + 3) % STAND_IN_VOCAB


class _Done:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class StandInRunner:
    """`ModelRunner`'s two entry points over `next_token` (the stand-in model; subclasses change it). `launch`
    plays a graph step on the GPU: it returns an `InFlight` whose tokens the engine reads one call later, and an
    input token the host does not have yet comes from the step in flight, as on the device. It plays decode steps,
    and with `mixed` also steps with prompt tokens (as `ModelRunner` plays mixed steps); `overlap=False`: `launch`
    declines, as for eager steps, and every step runs to its end."""

    def __init__(self, overlap: bool = True, mixed: bool = False) -> None:
        self.overlap, self.mixed, self.graphs, self.launched = overlap, mixed, None, 0

    def next_token(self, req, position: int, token: int) -> int:
        return stand_in_model(token, position)

    def execute(self, sched, sampling):
        from scute.engine.sampler import SamplerOutput

        tokens = [self.next_token(r, r.num_tokens - 1, r.all_token_ids[r.num_tokens - 1]) for r in sampling]
        return SamplerOutput(torch.tensor(tokens, dtype=torch.int64), None, None, None) if sampling else None

    def launch(self, sched, sampling, flight):
        from scute.engine.model_runner import InFlight
        from scute.engine.sampler import SamplerOutput

        decode = all(n == 1 for _, n in sched.scheduled) and len(sampling) == len(sched.scheduled)
        if not self.overlap or not sampling or not (decode or self.mixed):
            return None
        tokens = []
        for req in sampling:
            pos = req.num_tokens - 1  # a sampling request's last scheduled token
            token = req.all_token_ids[pos] if pos < len(req.all_token_ids) else \
                int(flight.result.token_ids[flight.rows[req]])  # in flight: taken "on the device"
            tokens.append(self.next_token(req, pos, token))
        self.launched += 1
        result = SamplerOutput(torch.tensor(tokens, dtype=torch.int64), None, None, None)
        host = SamplerOutput(result.token_ids.clone(), None, None, None)
        return InFlight(sampling, result, host, _Done(), {r: i for i, r in enumerate(sampling)})


# ---------------------------------------------------------------------------------------------- bad adapters
def bad_adapters(oracle: Oracle, root) -> dict[str, str]:
    """Folders that cannot be served, each for its own reason: missing, a truncated weights file, made for another
    model, an unknown method, a rank above 8 (the engines of these tests use max_adapter_rank=8)."""
    import shutil

    corrupt = str(root / "corrupt")
    shutil.copytree(oracle.paths["lora"], corrupt)
    weights = os.path.join(corrupt, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    other = str(root / "other-model")
    make_adapter(other, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), hidden=32)
    unknown = str(root / "unknown-method")
    shutil.copytree(oracle.paths["ia3"], unknown)
    edit_adapter_config(unknown, peft_type="NO_SUCH_METHOD")
    big = str(root / "big-rank")
    make_adapter(big, LoraConfig(r=16, target_modules=["q_proj"]))
    return {"missing": str(root / "does-not-exist"), "corrupt": corrupt, "other model": other,
            "unknown method": unknown, "rank": big}


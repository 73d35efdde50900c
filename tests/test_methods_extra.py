"""The methods beyond the core five, each against PEFT itself: per layer (unfolded and folded) and whole model,
float64 (≤ 1e-10) and float32 (≤ 1e-5); refusals; and one mixed batch with the core methods.

Two references are not PEFT's default path, on purpose:
* BOFT with several butterfly factors: PEFT forces one factor without its CUDA extension, so `butterfly_ext`
  stands in for the extension's block-diagonal builder (``torch.block_diag`` per factor) and PEFT's own code
  runs the general butterfly.
* FourierFT in float64: PEFT computes ΔW in float32 whatever the model dtype (≈1e-7 off), so the float64
  reference is PEFT with the float32 casts of its `get_delta_weight` removed (`fourierft_fp64`: its indices,
  scaling, ifft2 and forward, in complex128). In float32 it is PEFT's default path.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from peft import (
    AdaLoraConfig,
    BOFTConfig,
    C3AConfig,
    DeloraConfig,
    FourierFTConfig,
    GloraConfig,
    HiraConfig,
    HRAConfig,
    IA3Config,
    LilyConfig,
    OSFConfig,
    PeanutConfig,
    RandLoraConfig,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    MissConfig,
    OFTConfig,
    PeftModel,
    PveraConfig,
    RoadConfig,
    ShiraConfig,
    SupertuningConfig,
    VBLoRAConfig,
    VeraConfig,
)
from peft.tuners.lora.config import BdLoraConfig, MontecloraConfig, VeloraConfig

from scute.adapters import (
    AdapterError,
    alora_active,
    convert_checkpoint,
    load_adapter,
    read_checkpoint,
    supported_methods,
)
from scute.adapters.conversion import linear_modules
from scute.compat.convert import convert_adapter
from scute.compat.evaluate import SlotModel
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import place_adapter, swap_linears
from tests.helpers import ALL_LINEAR, capture_layers, check_layers, effect_err, make_adapter, rel_err, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]  # in 64/64/64/96, out 64/32/96/64
QKV = ["q_proj", "k_proj", "v_proj"]  # biased on qwen2


TOL = {torch.float64: {"rel": 1e-10, "effect": 1e-10}, torch.float32: {"rel": 1e-5, "effect": 1e-3}}
IDS = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def butterfly_ext():
    """Let PEFT's BOFT run N > 1 butterfly factors on CPU: its CUDA block-diagonal builder, in plain torch."""
    import peft.tuners.boft.layer as boft_layer

    class FastBlockDiag:
        @staticmethod
        def apply(R):  # [N, D, b, b] -> [N, D·b, D·b]
            return torch.stack([torch.block_diag(*r) for r in R])

    saved = boft_layer.get_fbd_cuda, boft_layer.FastBlockDiag
    boft_layer.get_fbd_cuda, boft_layer.FastBlockDiag = (lambda: FastBlockDiag), FastBlockDiag
    try:
        yield
    finally:
        boft_layer.get_fbd_cuda, boft_layer.FastBlockDiag = saved


@contextlib.contextmanager
def fourierft_fp64(dtype):
    """PEFT's FourierFT ΔW with its float32 casts removed (its own indices, scaling and forward; ifft2 in
    complex128): the float64 reference. PEFT's own path is float32 whatever the model dtype."""
    if dtype != torch.float64:
        yield
        return
    from peft.tuners.fourierft.layer import FourierFTLayer

    def get_delta_weight(self, adapter):
        spectrum, indices = self.fourierft_spectrum[adapter], self.indices[adapter]
        dense = torch.zeros(self.out_features, self.in_features, dtype=spectrum.dtype)
        dense[indices[0, :], indices[1, :]] = spectrum
        return torch.fft.ifft2(dense).real * self.fourierft_scaling[adapter]

    saved = FourierFTLayer.get_delta_weight
    FourierFTLayer.get_delta_weight = get_delta_weight
    try:
        yield
    finally:
        FourierFTLayer.get_delta_weight = saved


@contextlib.contextmanager
def c3a_fp64(dtype):
    """PEFT's C3A forward with its float32 casts removed (its own block-circular convolution, in float64): the
    float64 reference. PEFT's own path is float32 whatever the model dtype."""
    if dtype != torch.float64:
        yield
        return
    from peft.tuners.c3a.layer import C3ALinear
    from peft.tuners.c3a.utils import BlockCircularConvolution

    def forward(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)
        for name in self.active_adapters:
            if name in self.c3a_kernel.keys():
                result = result + BlockCircularConvolution.apply(x, self.c3a_kernel[name].double()) / x.size(-1)
        return result

    saved = C3ALinear.forward
    C3ALinear.forward = forward
    try:
        yield
    finally:
        C3ALinear.forward = saved


def peft_grid(families: dict[str, tuple[str, ...]]):
    """`parametrize("case,family,dtype")` over each case's model families, in float64 and float32."""
    grid = [(c, f, d) for c, fams in families.items() for f in fams for d in (torch.float64, torch.float32)]
    return pytest.mark.parametrize("case,family,dtype", grid, ids=[f"{c}-{f}-{str(d)[-7:]}" for c, f, d in grid])


def assert_matches_peft(path, config, family="llama", dtype=torch.float64, build_ctx=contextlib.nullcontext,
                        run_ctx=None, dense=False, reference=None) -> float:
    """Save a randomized PEFT adapter at `path`, then check Scute against PEFT per layer (unfolded and folded,
    from the checkpoint alone) and on the whole model; returns the largest relative error seen.

    `build_ctx()` wraps PEFT's model building and forward, `run_ctx(dtype)` PEFT's forward only; `reference`
    (path -> PEFT model) replaces the in-memory PEFT model (e.g. one reloaded from the checkpoint)."""
    path = str(path)
    with build_ctx():
        peft_model = make_adapter(path, config, family, dtype)
        if reference is not None:
            peft_model = reference(path)
        with (run_ctx or (lambda d: contextlib.nullcontext()))(dtype):
            peft_logits, layers = capture_layers(peft_model, IDS)
    base = tiny_model(family, dtype)
    with torch.no_grad():
        base_logits = base(IDS).logits
    tol = TOL[dtype]
    assert rel_err(base_logits, peft_logits) > 1e-3, "the adapter has no visible effect: the test could not fail"

    slots = convert_checkpoint(read_checkpoint(path), linear_modules(base), dense=dense)
    worst = check_layers(layers, slots, base, tol)

    model = tiny_model(family, dtype)
    linears = swap_linears(model, max_adapters=2)
    place_adapter(linears, 1, load_adapter(path, model, dense=dense))
    logits = run(model, [1, 1, 1])
    worst = max(worst, rel_err(logits, peft_logits))
    assert rel_err(logits, peft_logits) <= tol["rel"]
    assert effect_err(logits, peft_logits, base_logits) <= tol["effect"]
    assert torch.equal(run(model, [-1, -1, -1]), base_logits)
    return worst


def run(model, row_slots, ids=IDS, token_slots=None):
    if token_slots is None:
        token_slots = torch.tensor(row_slots).repeat_interleave(ids.shape[1])
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=token_slots)):
        return model(ids).logits


# name -> (config factory, options); every case runs in float64 and float32, on llama unless "families" says
# (qwen2 has biased q/k/v: the cases whose method touches the bias run there too)
BOTH = ("llama", "qwen2")
CASES = {
    "boft": (lambda: BOFTConfig(boft_block_size=8, target_modules=ALL_LINEAR), {"families": BOTH}),
    "boft_block_num": (lambda: BOFTConfig(boft_block_size=0, boft_block_num=4, target_modules=T4), {}),
    "boft_butterfly3": (lambda: BOFTConfig(boft_block_size=4, boft_n_butterfly_factor=3, target_modules=T4),
                        {"build_ctx": butterfly_ext, "families": BOTH}),
    "hra": (lambda: HRAConfig(r=4, target_modules=ALL_LINEAR), {}),
    "hra_gs": (lambda: HRAConfig(r=4, apply_GS=True, target_modules=T4), {}),
    "loha": (lambda: LoHaConfig(r=3, alpha=5, target_modules=ALL_LINEAR, rank_pattern={"v_proj": 2},
                                alpha_pattern={"up_proj": 7}), {}),
    "lokr": (lambda: LoKrConfig(r=2, alpha=3, target_modules=ALL_LINEAR), {}),
    "lokr_decompose_both": (lambda: LoKrConfig(r=1, alpha=3, decompose_both=True, target_modules=T4), {}),
    "lokr_full_factor4": (lambda: LoKrConfig(r=8, alpha=3, decompose_factor=4, target_modules=T4), {}),
    "adalora": (lambda: AdaLoraConfig(init_r=6, target_r=4, lora_alpha=5, total_step=10, target_modules=T4), {}),
    "road_1": (lambda: RoadConfig(variant="road_1", group_size=16, target_modules=ALL_LINEAR), {"families": BOTH}),
    "road_2": (lambda: RoadConfig(variant="road_2", group_size=8, target_modules=T4), {}),
    "road_4": (lambda: RoadConfig(variant="road_4", group_size=32, target_modules=T4), {"families": BOTH}),
    "vblora": (lambda: VBLoRAConfig(r=4, num_vectors=16, vector_length=8, topk=3, target_modules=ALL_LINEAR), {}),
    "vblora_topk_only": (lambda: VBLoRAConfig(r=4, num_vectors=16, vector_length=8, topk=2,
                                              save_only_topk_weights=True, target_modules=T4), {}),
    # n=20: rank 40 ≥ 32 on v_proj (served dense), < 64 elsewhere (rank-2n factors)
    "fourierft": (lambda: FourierFTConfig(n_frequency=20, scaling=40.0, target_modules=T4,
                                          n_frequency_pattern={"up_proj": 7}), {"run_ctx": fourierft_fp64}),
    "delora": (lambda: DeloraConfig(r=4, delora_lambda=3, target_modules=T4), {}),
    # r=5 does not divide the widths: the last basis is partial; in > out on down_proj/k_proj takes the other side
    "osf": (lambda: OSFConfig(init_weights=False, target_modules=ALL_LINEAR), {"families": BOTH}),
    "osf_rank": (lambda: OSFConfig(init_weights=False, effective_rank=20, target_modules=T4), {}),
    "randlora": (lambda: RandLoraConfig(r=5, randlora_alpha=7, target_modules=ALL_LINEAR), {"families": BOTH}),
    "hira_dense": (lambda: HiraConfig(r=3, target_modules=T4), {"dense": True}),
    # A computed from W0 at load through the residual tweaker net (depth 0: A, B only)
    "peanut": (lambda: PeanutConfig(r=4, depth=2, act_fn="gelu", scaling=0.7, target_modules=ALL_LINEAR),
               {"families": BOTH}),
    "peanut_depth0": (lambda: PeanutConfig(r=3, depth=0, target_modules=T4), {}),
    "shira_dense": (lambda: ShiraConfig(r=2, target_modules=ALL_LINEAR), {"dense": True, "families": BOTH}),
    # the sparse support alone (r unset), and with the Supra LoRA on top
    "supertuning_dense": (lambda: SupertuningConfig(sparsity=0.95, target_modules=ALL_LINEAR),
                          {"dense": True, "families": BOTH}),
    "supra_dense": (lambda: SupertuningConfig(sparsity=0.9, r=3, lora_alpha=5, target_modules=T4), {"dense": True}),
    # blocks of 16 (32 on up_proj): the widths are 64, 96 and 32 (v_proj)
    "c3a_dense": (lambda: C3AConfig(block_size=16, block_size_pattern={"up_proj": 32}, target_modules=T4),
                  {"dense": True, "run_ctx": c3a_fp64, "families": BOTH}),
    "glora_vector": (lambda: GloraConfig(r=4, config_A_B="vector", config_C="lora", config_D_E="vector",
                                         target_modules=ALL_LINEAR), {"families": BOTH}),
    "glora_constant": (lambda: GloraConfig(r=4, config_A_B="constant", config_C="vector", config_D_E="constant",
                                           target_modules=QKV), {"families": ("qwen2",)}),
    "glora_none": (lambda: GloraConfig(r=4, config_A_B="none", config_C="lora", config_D_E="none",
                                       target_modules=QKV), {"families": ("qwen2",)}),
    "glora_lora_dense": (lambda: GloraConfig(r=4, target_modules=T4 + ["k_proj"]), {"dense": True, "families": BOTH}),
    "miss_balance_pad": (lambda: MissConfig(r=5, target_modules=T4), {}),
    "miss_mini": (lambda: MissConfig(r=8, init_weights="mini", mini_r=8, target_modules=T4), {}),
    "miss_bat_dense": (lambda: MissConfig(r=8, init_weights="bat", target_modules=T4), {"dense": True}),
    "pvera": (lambda: PveraConfig(r=8, target_modules=T4), {}),
    "pvera_regenerated": (lambda: PveraConfig(r=8, save_projection=False, projection_prng_key=5,
                                              target_modules=T4), {}),
    "lora_velora": (lambda: LoraConfig(r=4, target_modules=T4, velora_config=VeloraConfig(num_groups=4)), {}),
    "lora_monteclora": (lambda: LoraConfig(r=4, target_modules=T4, monteclora_config=MontecloraConfig()), {}),
    "lora_bdlora": (lambda: LoraConfig(r=4, target_modules=T4, use_bdlora=BdLoraConfig(
        target_modules_bd_a=["q_proj", "v_proj", "up_proj"], target_modules_bd_b=["down_proj"], nblocks=2)), {}),
    "lora_mica": (lambda: LoraConfig(r=4, target_modules=T4, init_lora_weights="mica"), {"f32_only": True}),
}
GRID = [(c, f, d) for c, (_, o) in CASES.items() for f in o.get("families", ("llama",))
        for d in (torch.float64, torch.float32) if not (o.get("f32_only") and d == torch.float64)]
ERRORS: dict[tuple[str, str], float] = {}  # (case, dtype) -> worst error, written to $SCUTE_METHOD_ERRORS if set


@pytest.mark.parametrize("case,family,dtype", GRID, ids=[f"{c}-{f}-{str(d)[-7:]}" for c, f, d in GRID])
def test_matches_peft(case, family, dtype, tmp_path):
    factory, opts = CASES[case]
    err = assert_matches_peft(tmp_path, factory(), family, dtype, build_ctx=opts.get("build_ctx",
                              contextlib.nullcontext), run_ctx=opts.get("run_ctx"), dense=opts.get("dense", False))
    key = (case, str(dtype).removeprefix("torch."))
    ERRORS[key] = max(ERRORS.get(key, 0.0), err)
    if out := os.environ.get("SCUTE_METHOD_ERRORS"):
        with open(out, "w") as f:
            json.dump({f"{c}/{d}": e for (c, d), e in sorted(ERRORS.items())}, f, indent=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_adalora_pruned_ranks(dtype, tmp_path):
    """A checkpoint pruned by AdaLoRA's rank pattern (different r' per layer, ranknum still init_r) against
    PEFT reloading that checkpoint."""
    config = AdaLoraConfig(init_r=6, target_r=4, lora_alpha=5, total_step=10, target_modules=T4)
    keep = [[True, False, True, True, False, True], [False] * 5 + [True], [True] * 6, [True, True] + [False] * 4]

    def prune_and_reload(path):
        peft_model = make_adapter(path, config, "llama", dtype)
        names = [n for n, _ in peft_model.base_model.model.named_modules() if n.endswith(tuple(T4))]
        peft_model.peft_config["default"].rank_pattern = {
            f"{n}.lora_E": keep[i % len(keep)] for i, n in enumerate(names)}
        peft_model.save_pretrained(path)
        return PeftModel.from_pretrained(tiny_model("llama", dtype), path).eval()

    assert_matches_peft(tmp_path, config, dtype=dtype, reference=prune_and_reload)
    shapes = {k: v.shape for k, v in read_checkpoint(tmp_path).tensors.items() if k.endswith("lora_E")}
    assert sorted({s[0] for s in shapes.values()}) == [1, 2, 4, 6]


def test_hira_refused_without_dense(tmp_path):
    make_adapter(str(tmp_path), HiraConfig(r=3, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match=r"Hadamard product.*dense=True"):
        load_adapter(tmp_path, tiny_model())


def test_supertuning_without_saved_indices_refused(tmp_path):
    """Without its saved support positions (save_precomputed_indices=False) Super-Tuning is refused, saying why."""
    make_adapter(str(tmp_path), SupertuningConfig(save_precomputed_indices=False, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match="save_precomputed_indices=False"):
        load_adapter(tmp_path, tiny_model(), dense=True)


@pytest.mark.parametrize("config,message", [
    (GloraConfig(r=4, target_modules=["q_proj"]), r"W0 ⊙ Xd Xu.*dense=True"),
    (MissConfig(r=8, init_weights="bat", target_modules=["q_proj"]), r"every output block.*dense=True"),
    (PveraConfig(r=8, sample_at_inference=True, target_modules=["q_proj"]), "random noise at every forward"),
    (C3AConfig(block_size=16, target_modules=["q_proj"]), r"block-circulant.*dense=True"),
    (ShiraConfig(r=2, target_modules=["q_proj"]), r"sparse matrix.*dense=True"),
    (SupertuningConfig(target_modules=["q_proj"]), r"sparse support.*dense=True"),
], ids=["glora_lora", "miss_bat", "pvera_sampling", "c3a", "shira", "supertuning"])
def test_refused_without_dense(config, message, tmp_path):
    make_adapter(str(tmp_path), config)
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path, tiny_model())


def test_randlora_without_saved_bases_refused(tmp_path):
    make_adapter(str(tmp_path), RandLoraConfig(r=8, save_projection=False, target_modules=T4))
    with pytest.raises(AdapterError, match="save_projection=True"):
        load_adapter(tmp_path, tiny_model())


def test_lily_refused(tmp_path):
    make_adapter(str(tmp_path), LilyConfig(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(AdapterError, match="averaged over all tokens of the batch"):
        load_adapter(tmp_path, tiny_model(), dense=True)
    assert "LILY" not in supported_methods() and "HIRA" in supported_methods()  # HiRA: served with dense=True


def test_alora_gate_matches_peft(tmp_path):
    """aLoRA loads as its LoRA tensors plus the gate (`Adapter.invocation_tokens`); with the gate `alora_active`
    on the token slots (what the engine does per request) it reproduces PEFT's aLoRA exactly, and applied to
    every token it does not, so the paths that run an adapter on every token refuse it."""
    invocation = [5, 6]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=T4, alora_invocation_tokens=invocation,
                        task_type="CAUSAL_LM")
    peft_model = make_adapter(str(tmp_path / "alora"), config, "llama", torch.float64)
    ids = IDS.clone()
    ids[0, 2:4] = torch.tensor(invocation)
    ids[1, 4:6] = torch.tensor(invocation)  # row 2 has no invocation: base model throughout
    with torch.no_grad():
        expected = peft_model(ids).logits
    model = tiny_model("llama", torch.float64)
    adapter = load_adapter(tmp_path / "alora", model)
    assert adapter.invocation_tokens == (5, 6)
    linears = swap_linears(model, max_adapters=1)
    place_adapter(linears, 0, adapter)
    gate = torch.tensor([alora_active(row.tolist(), invocation) for row in ids])
    assert gate.sum(1).tolist() == [5, 3, 0]
    logits = run(model, None, ids, token_slots=torch.where(gate, 0, -1).flatten())
    assert rel_err(logits, expected) <= 1e-10
    assert rel_err(run(model, [0, 0, 0], ids), expected) > 1e-3  # ungated: wrong
    with pytest.raises(ValueError, match="applies only from its invocation tokens on"):
        SlotModel(tiny_model("llama", torch.float64), max_adapters=1).place(0, adapter)
    with pytest.raises(ValueError, match="an aLoRA adapter is already a LoRA"):
        convert_adapter(adapter, model, rank=2)


MIXED = {  # the five core methods and one of each added method, on the biased base (qwen2)
    "lora": (lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR), {}),
    "dora": (lambda: LoraConfig(r=6, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]), {}),
    "ia3": (lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
            {}),
    "vera": (lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]), {}),
    "oft": (lambda: OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR), {}),
    **{k: CASES[k] for k in ("boft_butterfly3", "hra", "loha", "lokr", "adalora", "road_1", "vblora", "fourierft",
                             "delora", "hira_dense", "lora_bdlora", "glora_vector", "miss_balance_pad", "pvera")},
}


def mixed_adapters(tmp_path, dtype, ids):
    """PEFT logits of `ids` for each MIXED adapter alone, and the adapters loaded by Scute (float `dtype`)."""
    refs, adapters = {}, {}
    model = tiny_model("qwen2", dtype)
    for i, (name, (factory, opts)) in enumerate(MIXED.items()):
        path = str(tmp_path / name)
        with opts.get("build_ctx", contextlib.nullcontext)():
            peft_model = make_adapter(path, factory(), "qwen2", dtype, seed=10 + i)
            with (opts.get("run_ctx") or (lambda d: contextlib.nullcontext()))(dtype), torch.no_grad():
                refs[name] = peft_model(ids).logits
        adapters[name] = load_adapter(path, model, name=name, dense=opts.get("dense", False))
    return refs, adapters


def mixed_forward(model, adapters, ids):
    """Place the adapters in shuffled slots and run rows of all of them plus two base rows; returns (logits, rows)."""
    linears = swap_linears(model, max_adapters=len(MIXED))
    order = list(MIXED)[1::2] + list(MIXED)[::2]  # slots in another order than the rows
    for slot, name in enumerate(order):
        place_adapter(linears, slot, adapters[name])
    rows = list(MIXED)[::-1]
    rows.insert(3, None)
    rows.insert(9, None)
    token_slots = torch.tensor([-1 if r is None else order.index(r) for r in rows]).repeat_interleave(ids.shape[1])
    return run(model, None, ids, token_slots.to(ids.device)), rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mixed_batch_with_core_methods(dtype, tmp_path):
    """One forward over rows of 19 adapters of 15 methods, in shuffled slots, plus base rows: every row equals
    PEFT with that adapter alone (PEFT cannot run this batch: it ignores adapter_names for most methods)."""
    ids = torch.randint(0, 128, (len(MIXED) + 2, 5), generator=torch.Generator().manual_seed(3))
    refs, adapters = mixed_adapters(tmp_path, dtype, ids)
    model = tiny_model("qwen2", dtype)
    with torch.no_grad():
        base_logits = model(ids).logits
    logits, rows = mixed_forward(model, adapters, ids)
    tol = TOL[dtype]
    for i, name in enumerate(rows):
        if name is None:
            assert torch.equal(logits[i], base_logits[i])
            continue
        assert rel_err(logits[i], refs[name][i]) <= tol["rel"], name
        assert effect_err(logits[i], refs[name][i], base_logits[i]) <= tol["effect"], name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_batch_triton(dtype, tmp_path):
    """The same mixed batch through the Triton kernels on CUDA, against PEFT in float32 on the CPU.

    float32: error ≤ 5e-3 of the adapter's effect (Triton's fp32 dots run in TF32; the vector and block slots are
    exact to ~1e-6). bf16: the base model itself is ~1e-2 off float32, so each row's relative error is bounded like
    the base rows', and its error relative to the effect only where the effect is large."""
    ids = torch.randint(0, 128, (len(MIXED) + 2, 5), generator=torch.Generator().manual_seed(3))
    refs, adapters = mixed_adapters(tmp_path, torch.float32, ids)
    with torch.no_grad():
        base_ref = tiny_model("qwen2")(ids).logits
    model = tiny_model("qwen2", dtype).cuda()
    with torch.no_grad():
        base_gpu = model(ids.cuda()).logits
    logits, rows = mixed_forward(model, {n: a.to(device="cuda") for n, a in adapters.items()}, ids.cuda())
    errors, bf16 = {}, dtype == torch.bfloat16
    for i, name in enumerate(rows):
        if name is None:
            assert torch.equal(logits[i], base_gpu[i])
            continue
        got, effect = logits[i].float().cpu(), rel_err(refs[name][i], base_ref[i])
        errors[name] = (effect_err(got, refs[name][i], base_ref[i]), rel_err(got, refs[name][i]), effect)
    print("\n".join(f"{k:16} err/effect {e:.1e} rel {r:.1e} effect {f:.1e}" for k, (e, r, f) in errors.items()))
    for name, (err, rel, effect) in errors.items():
        if bf16:
            assert rel <= 4e-2 and (effect < 0.3 or err <= 3e-2), name
        else:
            assert err <= 5e-3, name

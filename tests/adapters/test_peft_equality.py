"""Every method and config variant against PEFT itself, from one table: per layer (unfolded and folded, from the
checkpoint alone) and whole model through `ScuteLinear`, float64 (≤ 1e-10) and float32 (≤ 1e-5 of the output,
≤ 1e-3 of the adapter's effect), on llama and, where the method touches a bias, on qwen2 (biased q/k/v); and one
forward mixing rows of many methods, each row equal to PEFT with that adapter alone.

`CASES`: name -> `Case` (PEFT config factory and options). Every adapter tensor is randomized
(`tests/helpers.randomize_adapter`). Where PEFT's default path is not the oracle, or its default randomization
would hide a wrong converter, the case says so with a context:

* BOFT with several butterfly factors: PEFT forces one factor without its CUDA extension, so `butterfly_ext`
  stands in for the extension's block-diagonal builder (``torch.block_diag`` per factor) and PEFT's own code
  runs the general butterfly.
* FourierFT and C3A in float64: PEFT computes in float32 whatever the model dtype (≈1e-7 off), so the float64
  reference is PEFT with its float32 casts removed (`fourierft_fp64`, `c3a_fp64`). In float32: PEFT's own path.
* WaveFT in float64: PEFT's tabulated db3 filter is up to 3.6e-12 off the exact Daubechies filter Scute computes
  (`tests/helpers.exact_filters` puts the exact filters in PEFT's table; `test_method_waveft.py` pins the quirk).
* PSOFT: PEFT refuses a float64 base, so `tests/helpers.psoft_build` lets PEFT build A and B its own way
  (float32 SVD of W0, which the tiny models' float64 weights hold exactly) and widens them to float64; it also
  sets R's magnitudes to 1 + 0.3·noise and a free R to I + 0.2·noise, so that R itself carries the effect. The
  oracle is PEFT reloading the checkpoint (A and B are not in the file: rebuilt from W0, as Scute does).
* FRoD: the default randomization throws W0 away (W' = U·diag(noise)·Vᵀ); `frod_perturbed` keeps the trained
  regime (λ_l around its init times 1 + 0.3·noise, S values 0.3·noise·mean(λ_l)). Both are tested.
* TinyLoRA, UniLoRA: their saved buffers are perturbed too (TinyLoRA's SVD factors strongly and its projections
  P by a relative 1e-3; UniLoRA's scales), so that a converter recomputing them instead of reading them fails.
* Reloaded (`reloaded=True`): the reference is PEFT loading the saved checkpoint, for methods that rebuild part
  of the adapter at load (PSOFT, FRoD's U, WaveFT's positions, UniLoRA's indices when not saved).
* Poly: one case per task of the checkpoint (load option `task_id`), against PEFT run with that task id; its
  router logits are spread (`poly_router_spread`) so that tasks mix their skills differently.
* AdaMSS needs scikit-learn (KMeans) in PEFT and in Scute: skipped without it.

The worst error per (case, dtype) is written to $SCUTE_METHOD_ERRORS (JSON) if set.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from peft import (
    AdaLoraConfig,
    AdamssConfig,
    BOFTConfig,
    C3AConfig,
    DeloraConfig,
    FourierFTConfig,
    FrodConfig,
    GloraConfig,
    GraloraConfig,
    HiraConfig,
    HRAConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    MissConfig,
    OFTConfig,
    OSFConfig,
    PeanutConfig,
    PeftModel,
    PolyConfig,
    PsoftConfig,
    PveraConfig,
    RandLoraConfig,
    RoadConfig,
    ShiraConfig,
    SupertuningConfig,
    TinyLoraConfig,
    UniLoraConfig,
    VBLoRAConfig,
    VeraConfig,
    WaveFTConfig,
)
from peft.tuners.lora.config import BdLoraConfig, MontecloraConfig, VeloraConfig

from scute.adapters import load_adapter, read_checkpoint
from tests import helpers
from tests.helpers import (
    ALL_LINEAR,
    TOL,
    assert_matches_peft,
    assert_rows_match,
    effect_err,
    exact_filters,
    mixed_forward,
    peft_alone,
    perturbed_buffers,
    psoft_build,
    rel_err,
    tiny_model,
)

QKV = ["q_proj", "k_proj", "v_proj"]  # biased on qwen2
T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]  # in 64/64/64/96, out 64/32/96/64
BOTH = ("llama", "qwen2")
F64, F32 = torch.float64, torch.float32


@dataclass(frozen=True)
class Case:
    """One row of the table: the PEFT config and how to test it (see the module docstring)."""

    config: Callable[[], object]
    families: tuple[str, ...] = ("llama",)
    dtypes: tuple[torch.dtype, ...] = (F64, F32)
    build_ctx: Callable = contextlib.nullcontext  # wraps PEFT's model building and forward
    run_ctx: Callable | None = None  # (dtype) -> context around PEFT's forward only
    dense: bool = False  # load with dense=True
    reloaded: bool = False  # the reference is PEFT loading the saved checkpoint
    saved: Callable[[dict], None] | None = None  # a check of the saved tensors (what makes the case mean it)
    needs: str | None = None  # a module the method needs (skipped without it)
    forward: Callable | None = None  # (peft_model, ids) -> output: how PEFT runs (Poly: with task ids)
    options: dict | None = None  # load options (Poly: task_id)


# ---------------------------------------------------------------------------------------------- references
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


@contextlib.contextmanager
def frod_perturbed():
    """`make_adapter` with FRoD's λ_l and S perturbed around its init (W' ≈ W0) rather than replaced by noise."""
    randomize = helpers.randomize_adapter

    def perturb(peft_model, seed=1):
        g = torch.Generator().manual_seed(seed + 100)
        init = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "frod_lambda_l" in n}
        randomize(peft_model, seed)  # biases (bias="all"/"frod_only") and everything else as usual
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
                if "frod_lambda_l" in name:
                    p.copy_(init[name] * (1 + 0.3 * noise))
                elif "frod_lambda_s_values" in name:
                    lam = init[name.replace("frod_lambda_s_values", "frod_lambda_l")]
                    p.copy_(0.3 * noise * lam.mean())

    helpers.randomize_adapter = perturb
    try:
        yield
    finally:
        helpers.randomize_adapter = randomize


def tinylora_buffers() -> contextlib.AbstractContextManager:
    """TinyLoRA's SVD factors perturbed strongly, its projections P by a relative 1e-3 (P stays recognisably the
    draw for its seed, so a converter regenerating P from the seed fails)."""
    return perturbed_buffers(lambda name: 1e-3 if ".tinylora_P." in name else 0.5 if ".tinylora_" in name else 0.0)


def delora_norms() -> contextlib.AbstractContextManager:
    """DeLoRA's saved norms of W0's input columns perturbed (a converter computing them from W0 fails)."""
    return perturbed_buffers(lambda name: 0.5 if ".delora_w_norm." in name else 0.0)


def unilora_scales() -> contextlib.AbstractContextManager:
    """UniLoRA's saved scales perturbed (they are 1/√count, nearly constant)."""
    return perturbed_buffers(lambda name: 0.5 if ".unilora_scales_" in name else 0.0)


@contextlib.contextmanager
def poly_router_spread():
    """`make_adapter` with Poly's router logits ×10: logits of ±0.2 would give every task nearly equal skill weights
    (`test_method_poly.py` checks that two tasks then give different outputs)."""
    randomize = helpers.randomize_adapter

    def spread(peft_model, seed=1):
        randomize(peft_model, seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "module_logits" in name:
                    p.mul_(10)

    helpers.randomize_adapter = spread
    try:
        yield
    finally:
        helpers.randomize_adapter = randomize


def poly_case(splits: int, task: int) -> Case:
    """One task of a Poly checkpoint, served as one LoRA (`task_id`), against PEFT's forward with that task id
    (PolyModel.forward hands task_ids to the layers; PeftModel.forward without a task type goes around it)."""
    def forward(peft_model, ids):
        return peft_model.base_model(input_ids=ids, task_ids=torch.full((ids.shape[0],), task))

    return Case(lambda: PolyConfig(target_modules=ALL_LINEAR, r=4, n_tasks=3, n_skills=4, n_splits=splits), BOTH,
                build_ctx=poly_router_spread, forward=forward, options={"task_id": task})


def no_unilora_indices(tensors: dict) -> None:
    """PEFT's default save_indices=False: the file holds θ (and trained biases) only."""
    assert not any("unilora_indices" in k for k in tensors)


# ---------------------------------------------------------------------------------------------- the table
FROD = dict(dense=True, build_ctx=frod_perturbed)
CASES: dict[str, Case] = {
    # --- the core methods, on both families
    "lora": Case(lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR), BOTH),
    "lora_rslora": Case(lambda: LoraConfig(r=4, lora_alpha=6, use_rslora=True, target_modules=ALL_LINEAR), BOTH),
    "lora_patterns": Case(lambda: LoraConfig(
        r=4, lora_alpha=8, target_modules=ALL_LINEAR,
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6}, alpha_pattern={"v_proj": 3, "up_proj": 16},
    ), BOTH),
    "lora_bias": Case(lambda: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj"]),
                      BOTH),
    "lora_layers": Case(lambda: LoraConfig(r=4, lora_alpha=8, target_modules=QKV + ["o_proj"],
                                           layers_to_transform=[1]), BOTH),
    "dora": Case(lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL_LINEAR), BOTH),
    "dora_rslora": Case(lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, use_rslora=True, target_modules=QKV),
                        BOTH),
    "ia3": Case(lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
                BOTH),
    "ia3_output_only": Case(lambda: IA3Config(target_modules=["q_proj", "o_proj", "up_proj"], feedforward_modules=[]),
                            BOTH),
    "vera": Case(lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]), BOTH),
    "vera_regenerated": Case(lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                save_projection=False, projection_prng_key=7), BOTH),
    "oft": Case(lambda: OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR), BOTH),
    "oft_cayley": Case(lambda: OFTConfig(r=0, oft_block_size=8, use_cayley_neumann=False, target_modules=QKV), BOTH),
    "oft_neumann2": Case(lambda: OFTConfig(r=0, oft_block_size=8, num_cayley_neumann_terms=2, target_modules=QKV),
                         BOTH),
    "oft_neumann3": Case(lambda: OFTConfig(r=0, oft_block_size=8, num_cayley_neumann_terms=3, target_modules=QKV),
                         BOTH),
    "oft_neumann8": Case(lambda: OFTConfig(r=0, oft_block_size=16, num_cayley_neumann_terms=8, target_modules=QKV),
                         BOTH),
    "oft_coft": Case(lambda: OFTConfig(r=0, oft_block_size=8, coft=True, eps=3.0, target_modules=ALL_LINEAR), BOTH),
    "oft_block_share": Case(lambda: OFTConfig(r=0, oft_block_size=8, block_share=True, target_modules=ALL_LINEAR),
                            BOTH),
    "oft_r": Case(lambda: OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj", "o_proj"]), BOTH),
    # trained biases: need a base with biases (qwen2: q/k/v)
    "lora_bias_all": Case(lambda: LoraConfig(r=4, lora_alpha=8, bias="all", target_modules=["q_proj", "o_proj"]),
                          ("qwen2",)),
    "lora_bias_lora_only": Case(lambda: LoraConfig(r=4, lora_alpha=8, bias="lora_only", target_modules=QKV),
                                ("qwen2",)),
    "dora_bias_all": Case(lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, bias="all", target_modules=QKV),
                          ("qwen2",)),
    "ia3_bias": Case(lambda: IA3Config(target_modules=["q_proj", "k_proj"], feedforward_modules=["k_proj"]),
                     ("qwen2",)),
    # --- the further methods, on llama unless the method touches the bias
    "boft": Case(lambda: BOFTConfig(boft_block_size=8, target_modules=ALL_LINEAR), BOTH),
    "boft_block_num": Case(lambda: BOFTConfig(boft_block_size=0, boft_block_num=4, target_modules=T4)),
    "boft_butterfly3": Case(lambda: BOFTConfig(boft_block_size=4, boft_n_butterfly_factor=3, target_modules=T4),
                            BOTH, build_ctx=butterfly_ext),
    "hra": Case(lambda: HRAConfig(r=4, target_modules=ALL_LINEAR)),
    "hra_gs": Case(lambda: HRAConfig(r=4, apply_GS=True, target_modules=T4)),
    "loha": Case(lambda: LoHaConfig(r=3, alpha=5, target_modules=ALL_LINEAR, rank_pattern={"v_proj": 2},
                                    alpha_pattern={"up_proj": 7})),
    "lokr": Case(lambda: LoKrConfig(r=2, alpha=3, target_modules=ALL_LINEAR)),
    "lokr_decompose_both": Case(lambda: LoKrConfig(r=1, alpha=3, decompose_both=True, target_modules=T4)),
    "lokr_full_factor4": Case(lambda: LoKrConfig(r=8, alpha=3, decompose_factor=4, target_modules=T4)),
    "adalora": Case(lambda: AdaLoraConfig(init_r=6, target_r=4, lora_alpha=5, total_step=10, target_modules=T4)),
    "road_1": Case(lambda: RoadConfig(variant="road_1", group_size=16, target_modules=ALL_LINEAR), BOTH),
    "road_2": Case(lambda: RoadConfig(variant="road_2", group_size=8, target_modules=T4)),
    "road_4": Case(lambda: RoadConfig(variant="road_4", group_size=32, target_modules=T4), BOTH),
    "vblora": Case(lambda: VBLoRAConfig(r=4, num_vectors=16, vector_length=8, topk=3, target_modules=ALL_LINEAR)),
    "vblora_topk_only": Case(lambda: VBLoRAConfig(r=4, num_vectors=16, vector_length=8, topk=2,
                                                  save_only_topk_weights=True, target_modules=T4)),
    # n=20: rank 40 ≥ 32 on v_proj (served dense), < 64 elsewhere (rank-2n factors)
    "fourierft": Case(lambda: FourierFTConfig(n_frequency=20, scaling=40.0, target_modules=T4,
                                              n_frequency_pattern={"up_proj": 7}), run_ctx=fourierft_fp64),
    "delora": Case(lambda: DeloraConfig(r=4, delora_lambda=3, target_modules=T4), build_ctx=delora_norms),
    # r=5 does not divide the widths: the last basis is partial; in > out on down_proj/k_proj takes the other side
    "osf": Case(lambda: OSFConfig(init_weights=False, target_modules=ALL_LINEAR), BOTH),
    "osf_rank": Case(lambda: OSFConfig(init_weights=False, effective_rank=20, target_modules=T4)),
    "randlora": Case(lambda: RandLoraConfig(r=5, randlora_alpha=7, target_modules=ALL_LINEAR), BOTH),
    "hira_dense": Case(lambda: HiraConfig(r=3, target_modules=T4), dense=True),
    # A computed from W0 at load through the residual tweaker net (depth 0: A, B only)
    "peanut": Case(lambda: PeanutConfig(r=4, depth=2, act_fn="gelu", scaling=0.7, target_modules=ALL_LINEAR), BOTH),
    "peanut_depth0": Case(lambda: PeanutConfig(r=3, depth=0, target_modules=T4)),
    "shira_dense": Case(lambda: ShiraConfig(r=2, target_modules=ALL_LINEAR), BOTH, dense=True),
    # the sparse support alone (r unset), and with the Supra LoRA on top
    "supertuning_dense": Case(lambda: SupertuningConfig(sparsity=0.95, target_modules=ALL_LINEAR), BOTH, dense=True),
    "supra_dense": Case(lambda: SupertuningConfig(sparsity=0.9, r=3, lora_alpha=5, target_modules=T4), dense=True),
    # blocks of 16 (32 on up_proj): the widths are 64, 96 and 32 (v_proj)
    "c3a_dense": Case(lambda: C3AConfig(block_size=16, block_size_pattern={"up_proj": 32}, target_modules=T4), BOTH,
                      dense=True, run_ctx=c3a_fp64),
    "glora_vector": Case(lambda: GloraConfig(r=4, config_A_B="vector", config_C="lora", config_D_E="vector",
                                             target_modules=ALL_LINEAR), BOTH),
    "glora_constant": Case(lambda: GloraConfig(r=4, config_A_B="constant", config_C="vector", config_D_E="constant",
                                               target_modules=QKV), ("qwen2",)),
    "glora_none": Case(lambda: GloraConfig(r=4, config_A_B="none", config_C="lora", config_D_E="none",
                                           target_modules=QKV), ("qwen2",)),
    "glora_lora_dense": Case(lambda: GloraConfig(r=4, target_modules=T4 + ["k_proj"]), BOTH, dense=True),
    "miss_balance_pad": Case(lambda: MissConfig(r=5, target_modules=T4)),
    "miss_mini": Case(lambda: MissConfig(r=8, init_weights="mini", mini_r=8, target_modules=T4)),
    "miss_bat_dense": Case(lambda: MissConfig(r=8, init_weights="bat", target_modules=T4), dense=True),
    "pvera": Case(lambda: PveraConfig(r=8, target_modules=T4)),
    "pvera_regenerated": Case(lambda: PveraConfig(r=8, save_projection=False, projection_prng_key=5,
                                                  target_modules=T4)),
    "lora_velora": Case(lambda: LoraConfig(r=4, target_modules=T4, velora_config=VeloraConfig(num_groups=4))),
    "lora_monteclora": Case(lambda: LoraConfig(r=4, target_modules=T4, monteclora_config=MontecloraConfig())),
    "lora_bdlora": Case(lambda: LoraConfig(r=4, target_modules=T4, use_bdlora=BdLoraConfig(
        target_modules_bd_a=["q_proj", "v_proj", "up_proj"], target_modules_bd_b=["down_proj"], nblocks=2))),
    "lora_mica": Case(lambda: LoraConfig(r=4, target_modules=T4, init_lora_weights="mica"), dtypes=(F32,)),
    # --- GraLoRA: the tiny model's widths (64, 96, 32) are divisible by k = 1, 2, 4, 8 on every linear layer
    "gralora_k2_r4": Case(lambda: GraloraConfig(r=4, gralora_k=2, alpha=8, target_modules=T4), BOTH),
    "gralora_k4_r8_hybrid3": Case(lambda: GraloraConfig(r=8, gralora_k=4, hybrid_r=3, alpha=5,
                                                        target_modules=ALL_LINEAR), BOTH),
    # s = r / k = 1: every sub-block rank 1
    "gralora_k8_r8": Case(lambda: GraloraConfig(r=8, gralora_k=8, alpha=12, target_modules=ALL_LINEAR)),
    # k = 1 is plain LoRA (plus the hybrid LoRA)
    "gralora_k1_r3_hybrid2": Case(lambda: GraloraConfig(r=3, gralora_k=1, hybrid_r=2, alpha=7, target_modules=T4)),
    "gralora_k2_r6_hybrid1": Case(lambda: GraloraConfig(r=6, gralora_k=2, hybrid_r=1, alpha=3, target_modules=T4),
                                  ("qwen2",)),
    # trained biases (saved as base_layer.bias): the loader's generic correction
    "gralora_k2_r4_bias": Case(lambda: GraloraConfig(r=4, gralora_k=2, hybrid_r=2, bias="gralora_only",
                                                     target_modules=QKV), ("qwen2",)),
    # --- AdaMSS (scikit-learn). Σr_i = 4·2 = 8 ≤ R = 16: A = Â N_x, B = B̂
    "adamss_k4_r2": Case(lambda: AdamssConfig(r=16, num_subspaces=4, subspace_rank=2, target_modules=ALL_LINEAR),
                         BOTH, needs="sklearn"),
    # PEFT's defaults (r=100 clamps to min(out, in'): R = 32 on k/v, 64/65 elsewhere; K=5, r_i=1)
    "adamss_defaults": Case(lambda: AdamssConfig(target_modules=T4), BOTH, needs="sklearn"),
    # Σr_i = 6·3 = 18 > R = 8: A = N_x, B = B̂ Â; random_seed changes the partition
    "adamss_rank_R": Case(lambda: AdamssConfig(r=8, num_subspaces=6, subspace_rank=3, random_seed=7,
                                               target_modules=T4 + ["k_proj"]), BOTH, needs="sklearn"),
    # dynamic ranks (r_i ≤ 3 from the subspaces' spectra) and ASA (training only)
    "adamss_dynamic_asa": Case(lambda: AdamssConfig(r=24, num_subspaces=3, subspace_rank=3, use_dynamic_rank=True,
                                                    svd_threshold=0.3, use_asa=True, asa_target_subspaces=4,
                                                    target_modules=ALL_LINEAR), ("qwen2",), needs="sklearn"),
    # --- FRoD, served dense (ΔW = U (S + diag λ_l) Vᵀ − W0)
    "frod_t4_perturbed": Case(lambda: FrodConfig(sparse_rate=0.05, target_modules=T4, progressbar=False), **FROD),
    "frod_t4_noise": Case(lambda: FrodConfig(sparse_rate=0.05, target_modules=T4, progressbar=False), dense=True),
    # k_proj / o_proj / gate_proj: out 32 < in 64, in 64, out 96; S half full
    "frod_dense_S": Case(lambda: FrodConfig(sparse_rate=0.5, projection_prng_key=7,
                                            target_modules=["k_proj", "o_proj", "gate_proj"], progressbar=False),
                         **FROD),
    "frod_no_S": Case(lambda: FrodConfig(sparse_rate=0.0, target_modules=["q_proj", "down_proj"], progressbar=False),
                      **FROD),
    "frod_qwen2_all_linear": Case(lambda: FrodConfig(sparse_rate=0.02, frod_dropout=0.1, target_modules=ALL_LINEAR,
                                                     progressbar=False), ("qwen2",), **FROD),
    "frod_qwen2_frod_only_bias": Case(lambda: FrodConfig(sparse_rate=0.05, bias="frod_only",
                                                         target_modules=QKV + ["o_proj"], progressbar=False),
                                      ("qwen2",), **FROD),
    "frod_qwen2_bias_all": Case(lambda: FrodConfig(sparse_rate=0.05, bias="all", target_modules=T4,
                                                   progressbar=False), ("qwen2",), **FROD),
    # U rebuilt from W0 at load
    "frod_reloaded": Case(lambda: FrodConfig(sparse_rate=0.05, target_modules=ALL_LINEAR, progressbar=False),
                          ("qwen2",), reloaded=True, **FROD),
    # --- PSOFT against PEFT reloading it. Widths 64, 96, 32 (k/v out): r = 32 is full rank on k/v_proj
    "psoft_cayley": Case(lambda: PsoftConfig(r=8, psoft_alpha=16, target_modules=ALL_LINEAR), BOTH,
                         build_ctx=psoft_build, reloaded=True),
    "psoft_cayley_r32": Case(lambda: PsoftConfig(r=32, psoft_alpha=8, target_modules=T4 + ["k_proj"]),
                             build_ctx=psoft_build, reloaded=True),
    "psoft_neumann5": Case(lambda: PsoftConfig(r=4, psoft_alpha=6, use_cayley_neumann=True, target_modules=T4), BOTH,
                           build_ctx=psoft_build, reloaded=True),
    # ‖Q‖_F ≈ 0.2·√28 > 0.9: projected; t = 3 (the same polynomial as t = 4: I + 2Q + 2Q² + Q³)
    "psoft_neumann3_eps": Case(lambda: PsoftConfig(r=8, use_cayley_neumann=True, num_cayley_neumann_terms=3,
                                                   cayley_neumann_eps=0.9, target_modules=T4),
                               build_ctx=psoft_build, reloaded=True),
    # ‖Q‖_F ≈ 0.2·√3 < 0.95: not projected; t = 7
    "psoft_neumann7_eps_idle": Case(lambda: PsoftConfig(r=3, use_cayley_neumann=True, num_cayley_neumann_terms=7,
                                                        cayley_neumann_eps=0.95, target_modules=T4),
                                    build_ctx=psoft_build, reloaded=True),
    "psoft_free_R_no_mag": Case(lambda: PsoftConfig(r=6, psoft_alpha=12, psoft_orth=False, psoft_mag_a=False,
                                                    psoft_mag_b=False, target_modules=ALL_LINEAR), BOTH,
                                build_ctx=psoft_build, reloaded=True),
    "psoft_pissa_mag_a": Case(lambda: PsoftConfig(r=5, ab_svd_init="pissa_init", psoft_mag_b=False,
                                                  target_modules=T4), build_ctx=psoft_build, reloaded=True),
    "psoft_free_R_mag_b": Case(lambda: PsoftConfig(r=4, psoft_orth=False, psoft_mag_a=False, target_modules=T4),
                               ("qwen2",), build_ctx=psoft_build, reloaded=True),
    "psoft_lowrank": Case(lambda: PsoftConfig(r=4, psoft_svd="lowrank", psoft_svd_lowrank_niter=3, random_seed=7,
                                              target_modules=T4 + ["k_proj"]), BOTH,
                          build_ctx=psoft_build, reloaded=True),
    # --- TinyLoRA: one v per layer (14 layers), r = 2 everywhere
    "tinylora_r2_all_linear": Case(lambda: TinyLoraConfig(r=2, u=5, target_modules=ALL_LINEAR), BOTH,
                                   build_ctx=tinylora_buffers),
    # 8 layers, weight_tying 0.5: 4 groups of 2 layers
    "tinylora_tied_half": Case(lambda: TinyLoraConfig(r=4, u=13, weight_tying=0.5, projection_seed=7,
                                                      target_modules=T4), BOTH, build_ctx=tinylora_buffers),
    # one v for all layers, u = 1
    "tinylora_tied_full_u1": Case(lambda: TinyLoraConfig(r=3, u=1, weight_tying=1.0, target_modules=T4), BOTH,
                                  build_ctx=tinylora_buffers),
    # r = 40 clipped to 32 on v_proj (32×64); 8 layers, weight_tying 0.3: round(5.6) = 6 groups of 1, the last 3
    # layers share group 5; u·r² < 16 nowhere
    "tinylora_r_clipped_tied": Case(lambda: TinyLoraConfig(r=40, u=3, weight_tying=0.3, target_modules=T4), BOTH,
                                    build_ctx=tinylora_buffers),
    # bias="all": trained biases of every layer, adapted or not (k_proj only has a bias in the file)
    "tinylora_bias_all": Case(lambda: TinyLoraConfig(r=2, u=4, bias="all", target_modules=["q_proj", "v_proj",
                                                                                           "down_proj"]), BOTH,
                              build_ctx=tinylora_buffers),
    # --- Uni-LoRA, saved with save_indices=True
    "unilora_r4_d64": Case(lambda: UniLoraConfig(r=4, theta_d_length=64, save_indices=True, target_modules=T4), BOTH,
                           build_ctx=unilora_scales),
    # D = 3·1856 = 5568 entries over d = 5000: counts 1 or 2
    "unilora_r3_all_linear": Case(lambda: UniLoraConfig(r=3, theta_d_length=5000, proj_seed=3, save_indices=True,
                                                        target_modules=ALL_LINEAR), BOTH, build_ctx=unilora_scales),
    # heavy collisions: 7 values for 8·(2·128 + 2·96) entries
    "unilora_r8_d7": Case(lambda: UniLoraConfig(r=8, theta_d_length=7, save_indices=True,
                                                target_modules=["q_proj", "v_proj"]), BOTH, build_ctx=unilora_scales),
    "unilora_bias_all": Case(lambda: UniLoraConfig(r=4, theta_d_length=128, bias="all", save_indices=True,
                                                   target_modules=["q_proj", "down_proj"]), BOTH,
                             build_ctx=unilora_scales),
    # PEFT's default save_indices=False: every targeted layer's indices and scales rebuilt from the base model's
    # layer order (against PEFT reloading the file, which rebuilds them too)
    "unilora_unsaved_default": Case(lambda: UniLoraConfig(r=4, theta_d_length=64, target_modules=T4), BOTH,
                                    reloaded=True, saved=no_unilora_indices),
    "unilora_unsaved_all_linear_bias": Case(lambda: UniLoraConfig(r=3, theta_d_length=500, proj_seed=5, bias="all",
                                                                  target_modules=ALL_LINEAR), BOTH,
                                            reloaded=True, saved=no_unilora_indices),
    # --- WaveFT, served dense. in/out: 64/64 (q, o), 64/32 (k, v), 64/96 (gate, up), 96/64 (down)
    "waveft_db1": Case(lambda: WaveFTConfig(n_frequency=300, scaling=5.0, target_modules=ALL_LINEAR), BOTH,
                       run_ctx=exact_filters, dense=True),
    # L = 4: a padded 66×66 grid etc.; n per layer from the pattern
    "waveft_db2_pattern": Case(lambda: WaveFTConfig(n_frequency=150, scaling=7.0, wavelet_family="db2",
                                                    random_loc_seed=3, n_frequency_pattern={"up_proj": 40,
                                                                                            "k_proj": 2048},
                                                    target_modules=ALL_LINEAR), BOTH,
                               run_ctx=exact_filters, dense=True),
    "waveft_db3": Case(lambda: WaveFTConfig(n_frequency=120, scaling=3.0, wavelet_family="db3", target_modules=T4),
                       BOTH, run_ctx=exact_filters, dense=True),
    # L = 20: the grid is 18 wider than the layer on each axis
    "waveft_db10": Case(lambda: WaveFTConfig(n_frequency=500, scaling=2.0, wavelet_family="db10", target_modules=T4),
                        BOTH, run_ctx=exact_filters, dense=True),
    "waveft_no_idwt": Case(lambda: WaveFTConfig(n_frequency=200, scaling=4.0, use_idwt=False,
                                                target_modules=ALL_LINEAR), BOTH, run_ctx=exact_filters, dense=True),
    "waveft_proportional": Case(lambda: WaveFTConfig(n_frequency=100, scaling=5.0, wavelet_family="db4",
                                                     proportional_parameters=True, target_modules=ALL_LINEAR), BOTH,
                                run_ctx=exact_filters, dense=True),
    # the positions come from the seed on both sides: PEFT reloading the file agrees too
    # --- Poly: one adapter per task of the checkpoint
    **{f"poly_splits{s}_task{t}": poly_case(s, t) for s in (1, 2) for t in (0, 2)},
    "waveft_db5_reloaded": Case(lambda: WaveFTConfig(n_frequency=250, scaling=6.0, wavelet_family="db5",
                                                     random_loc_seed=11, target_modules=T4), ("qwen2",), (F64,),
                                run_ctx=exact_filters, dense=True, reloaded=True),
}
GRID = [(c, f, d) for c, case in CASES.items() for f in case.families for d in case.dtypes]
ERRORS: dict[tuple[str, str], float] = {}  # (case, dtype) -> worst error, written to $SCUTE_METHOD_ERRORS if set


def reloaded(family: str, dtype: torch.dtype):
    """The reference of a `reloaded` case: PEFT loading the saved checkpoint on a fresh base."""
    return lambda path: PeftModel.from_pretrained(tiny_model(family, dtype), path).eval()


@pytest.mark.parametrize("case,family,dtype", GRID, ids=[f"{c}-{f}-{'f64' if d == F64 else 'f32'}"
                                                         for c, f, d in GRID])
def test_matches_peft(case, family, dtype, tmp_path):
    spec = CASES[case]
    if spec.needs:
        pytest.importorskip(spec.needs)
    err = assert_matches_peft(tmp_path, spec.config(), family, dtype, build_ctx=spec.build_ctx, run_ctx=spec.run_ctx,
                              dense=spec.dense, reference=reloaded(family, dtype) if spec.reloaded else None,
                              forward=spec.forward, options=spec.options)
    if spec.saved is not None:
        spec.saved(read_checkpoint(tmp_path).tensors)
    key = (case, str(dtype).removeprefix("torch."))
    ERRORS[key] = max(ERRORS.get(key, 0.0), err)
    if out := os.environ.get("SCUTE_METHOD_ERRORS"):
        with open(out, "w") as f:
            json.dump({f"{c}/{d}": e for (c, d), e in sorted(ERRORS.items())}, f, indent=1)


# ---------------------------------------------------------------------------------------------- one mixed batch
MIXED = {  # the five core methods and one of each added method, on the biased base (qwen2)
    "lora": CASES["lora"],
    "dora": Case(lambda: LoraConfig(r=6, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"])),
    "ia3": CASES["ia3"],
    "vera": CASES["vera"],
    "oft": CASES["oft"],
    **{k: CASES[k] for k in ("boft_butterfly3", "hra", "loha", "lokr", "adalora", "road_1", "vblora", "fourierft",
                             "delora", "hira_dense", "lora_bdlora", "glora_vector", "miss_balance_pad", "pvera")},
}
ORDER = list(MIXED)[1::2] + list(MIXED)[::2]  # slots in another order than the rows
ROWS = list(MIXED)[::-1]
ROWS.insert(3, None)
ROWS.insert(9, None)


def mixed_adapters(tmp_path, dtype, ids):
    """PEFT logits of `ids` for each MIXED adapter alone, and the adapters loaded by Scute (float `dtype`)."""
    refs, paths = peft_alone(tmp_path, {n: c.config for n, c in MIXED.items()}, "qwen2", dtype, ids,
                             contexts=lambda n: (MIXED[n].build_ctx, MIXED[n].run_ctx))
    model = tiny_model("qwen2", dtype)
    return refs, {n: load_adapter(paths[n], model, name=n, dense=c.dense) for n, c in MIXED.items()}


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_mixed_batch_of_many_methods(dtype, tmp_path):
    """One forward over rows of 19 adapters of 15 methods, in shuffled slots, plus base rows: every row equals
    PEFT with that adapter alone (PEFT cannot run this batch: it ignores adapter_names for most methods)."""
    ids = torch.randint(0, 128, (len(MIXED) + 2, 5), generator=torch.Generator().manual_seed(3))
    refs, adapters = mixed_adapters(tmp_path, dtype, ids)
    model = tiny_model("qwen2", dtype)
    with torch.no_grad():
        base_logits = model(ids).logits
    logits = mixed_forward(model, adapters, ORDER, ROWS, ids)
    assert_rows_match(logits, ROWS, refs, base_logits, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mixed_batch_of_many_methods_triton(dtype, tmp_path):
    """The same mixed batch through the Triton kernels on CUDA, against PEFT in float32 on the CPU.

    float32: error ≤ 5e-3 of the adapter's effect (Triton's fp32 dots run in TF32; the vector and block slots are
    exact to ~1e-6). bf16: the base model itself is ~1e-2 off float32, so each row's relative error is bounded like
    the base rows', and its error relative to the effect by 3e-2 where the effect is large, by 0.3 where it is not
    (a dropped or another's adapter is ~1; PyTorch's bf16 run of this batch on the CPU is within 0.11, hira's
    effect of 0.08 being the smallest)."""
    ids = torch.randint(0, 128, (len(MIXED) + 2, 5), generator=torch.Generator().manual_seed(3))
    refs, adapters = mixed_adapters(tmp_path, torch.float32, ids)
    with torch.no_grad():
        base_ref = tiny_model("qwen2")(ids).logits
    model = tiny_model("qwen2", dtype).cuda()
    with torch.no_grad():
        base_gpu = model(ids.cuda()).logits
    logits = mixed_forward(model, {n: a.to(device="cuda") for n, a in adapters.items()}, ORDER, ROWS, ids.cuda())
    errors, bf16 = {}, dtype == torch.bfloat16
    for i, name in enumerate(ROWS):
        if name is None:
            assert torch.equal(logits[i], base_gpu[i])
            continue
        got, effect = logits[i].float().cpu(), rel_err(refs[name][i], base_ref[i])
        errors[name] = (effect_err(got, refs[name][i], base_ref[i]), rel_err(got, refs[name][i]), effect)
    print("\n".join(f"{k:16} err/effect {e:.1e} rel {r:.1e} effect {f:.1e}" for k, (e, r, f) in errors.items()))
    for name, (err, rel, effect) in errors.items():
        if bf16:
            assert rel <= 4e-2 and err <= (3e-2 if effect >= 0.3 else 0.3), name
        else:
            assert err <= 5e-3, name

"""FRoD against PEFT itself (dense ΔW = U (S + diag λ_l) Vᵀ − W0): per layer (unfolded and folded) and whole
model, float64 (≤ 1e-10) and float32 (≤ 1e-5), llama and qwen2 (trained biases too); PEFT's reload path as the
oracle (U rebuilt from W0 at load); the refusals.

No patch of PEFT is needed in float64: PEFT's FRoD forward runs in the model dtype (x's), with U rounded to float32
at init whatever the model dtype — a rounding Scute repeats, so the float64 comparison is exact to 1e-10.

Randomization: `tests/helpers.randomize_adapter` sets λ_l and the S values to 0.2·noise, which throws W0 away
entirely (W' becomes U·diag(noise)·Vᵀ). `frod_perturbed` keeps the trained-adapter regime instead: λ_l around its
init (the column norms of W0 V⁻ᵀ, so W' ≈ W0) times 1 + 0.3·noise, S values 0.3·noise·mean(λ_l). Both are tested.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import FrodConfig, PeftModel

from scute.adapters import AdapterError, load_adapter, read_checkpoint
from scute.adapters.methods.frod import category, frod_u
from tests import helpers
from tests.helpers import ALL_LINEAR, make_adapter, tiny_model
from tests.test_methods_extra import QKV, T4, assert_matches_peft


@contextlib.contextmanager
def frod_perturbed():
    """`make_adapter` with λ_l and S perturbed around FRoD's init (W' ≈ W0) rather than replaced by noise."""
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


def reload(family, dtype):
    """PEFT loading the saved adapter: U recomputed from W0 and the V PEFT rebuilds, the saved V, S, λ_l loaded."""
    return lambda path: PeftModel.from_pretrained(tiny_model(family, dtype), path).eval()


CASES = {  # name -> (config, family, build_ctx, reference)
    "t4_perturbed": (lambda: FrodConfig(sparse_rate=0.05, target_modules=T4, progressbar=False),
                     "llama", frod_perturbed, None),
    "t4_noise": (lambda: FrodConfig(sparse_rate=0.05, target_modules=T4, progressbar=False),
                 "llama", contextlib.nullcontext, None),
    # k_proj / o_proj / gate_proj: out 32 < in 64, in 64, out 96; S half full
    "dense_S": (lambda: FrodConfig(sparse_rate=0.5, projection_prng_key=7, target_modules=["k_proj", "o_proj",
                                                                                          "gate_proj"],
                                   progressbar=False), "llama", frod_perturbed, None),
    "no_S": (lambda: FrodConfig(sparse_rate=0.0, target_modules=["q_proj", "down_proj"], progressbar=False),
             "llama", frod_perturbed, None),
    "qwen2_all_linear": (lambda: FrodConfig(sparse_rate=0.02, frod_dropout=0.1, target_modules=ALL_LINEAR,
                                            progressbar=False), "qwen2", frod_perturbed, None),
    "qwen2_frod_only_bias": (lambda: FrodConfig(sparse_rate=0.05, bias="frod_only", target_modules=QKV + ["o_proj"],
                                                progressbar=False), "qwen2", frod_perturbed, None),
    "qwen2_bias_all": (lambda: FrodConfig(sparse_rate=0.05, bias="all", target_modules=T4, progressbar=False),
                       "qwen2", frod_perturbed, None),
    "reloaded": (lambda: FrodConfig(sparse_rate=0.05, target_modules=ALL_LINEAR, progressbar=False),
                 "qwen2", frod_perturbed, "reload"),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_frod_matches_peft(case, dtype, tmp_path):
    config, family, build_ctx, reference = CASES[case]
    assert_matches_peft(tmp_path, config(), family, dtype, build_ctx=build_ctx, dense=True,
                        reference=reload(family, dtype) if reference else None)


def test_frod_u_as_peft_recomputes_it():
    """`frod_u` is PEFT's U bit for bit (its own `_calculate_frod_u_and_lambda` on the same W0 and V)."""
    from peft.tuners.frod.layer import FrodLayer

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(32, 64, generator=g, dtype=torch.float64) * 0.02
    v = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0]
    u_peft, _ = FrodLayer._calculate_frod_u_and_lambda(None, v, w0)
    assert torch.equal(frod_u(w0, v, torch.float64), u_peft.double())
    assert not torch.equal(frod_u(w0, v, torch.float64), _unrounded_u(w0, v))  # the float32 rounding matters
    w0[:, 5] = 0  # a zero column of W0 V⁻ᵀ (V = I): U's column is zero, as in PEFT
    eye = torch.eye(64, dtype=torch.float64)
    u_peft, _ = FrodLayer._calculate_frod_u_and_lambda(None, eye, w0)
    assert torch.equal(frod_u(w0, eye, torch.float64), u_peft.double())
    assert not frod_u(w0, eye, torch.float64)[:, 5].any()


def _unrounded_u(w0, v):
    coeff = torch.linalg.solve(v, w0.T).T
    return coeff / coeff.norm(dim=0)


def test_frod_categories():
    assert category("model.layers.0.self_attn.q_proj") == "self_attn_q_proj"
    assert category("model.layers.3.mlp.experts.2.gate_proj") == "gate_proj"
    assert category("encoder.layer.0.attention.output.dense") == "attention_output"
    assert category("lm_head") == "lm_head"


def test_frod_refused_without_dense(tmp_path):
    make_adapter(str(tmp_path), FrodConfig(target_modules=["q_proj"], progressbar=False))
    with pytest.raises(AdapterError, match=r"FRoD replaces the weight.*full rank.*dense=True"):
        load_adapter(tmp_path, tiny_model())


def test_frod_without_saved_projection_refused(tmp_path):
    make_adapter(str(tmp_path), FrodConfig(save_projection=False, target_modules=T4, progressbar=False))
    assert not any(k.startswith("base_model.frod_") for k in read_checkpoint(tmp_path).tensors)
    with pytest.raises(AdapterError, match="save_projection=True"):
        load_adapter(tmp_path, tiny_model(), dense=True)


def test_frod_wrong_basis_shape_refused(tmp_path):
    """A V of the wrong size (another model) is refused, naming the tensor."""
    make_adapter(str(tmp_path), FrodConfig(target_modules=["down_proj"], progressbar=False), hidden=64)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "adapter_model.safetensors"
    sd = load_file(file)
    sd["base_model.frod_V.mlp_down_proj"] = sd["base_model.frod_V.mlp_down_proj"][:64, :64].contiguous()
    save_file(sd, file)
    with pytest.raises(AdapterError, match=r"frod_V.mlp_down_proj has shape \(64, 64\)"):
        load_adapter(tmp_path, tiny_model(), dense=True)

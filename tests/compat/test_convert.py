"""Adapter -> LoRA conversion: the effective delta is the served map, full rank is exact, PEFT loads the result."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import IA3Config, LoraConfig, OFTConfig, PeftModel, VeraConfig

from scute.adapters import load_adapter
from scute.compat.convert import convert_adapter, effective_delta, gram_svd, save_lora, target_modules
from scute.compat.convert_cli import convert_main
from scute.ops.reference import scute_linear_ref
from tests.helpers import ALL_LINEAR, effect_err, make_adapter, tiny_model

QKV = ["q_proj", "k_proj", "v_proj"]
CASES = {  # (config, family): every slot kind the delta must account for
    "lora": (lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR), "llama"),
    "lora_bias": (lambda: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=QKV), "qwen2"),
    "dora": (lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL_LINEAR), "qwen2"),
    "ia3": (lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
            "qwen2"),
    "vera": (lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]), "llama"),
    "oft": (lambda: OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "down_proj"]), "llama"),
    "oft_share": (lambda: OFTConfig(r=0, oft_block_size=8, block_share=True, target_modules=QKV), "qwen2"),
}
F64 = torch.float64


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> folder of its float64 PEFT adapter, made once per module."""
    root, made = tmp_path_factory.mktemp("adapters"), {}

    def get(case: str) -> str:
        if case not in made:
            config, family = CASES[case]
            made[case] = str(root / case)
            make_adapter(made[case], config(), family, F64)
        return made[case]

    return get


def loaded(saved, case):
    family = CASES[case][1]
    model = tiny_model(family, F64)
    return model, load_adapter(saved(case), model), family


def peft_logits(family, path, ids):
    model = PeftModel.from_pretrained(tiny_model(family, F64), path).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("case", CASES)
def test_effective_delta_is_the_served_map(case, saved):
    model, adapter, _ = loaded(saved, case)
    modules = dict(model.named_modules())
    x = torch.randn(5, 96, dtype=F64, generator=torch.Generator().manual_seed(0))
    for name, slots in adapter.layers.items():
        base = modules[name]
        xi = x[:, : base.in_features]
        served = scute_linear_ref(xi, base.weight, base.bias, [slots], torch.zeros(5, dtype=torch.long))
        dW, db = effective_delta(slots, base.weight, base.bias)
        plain = xi @ base.weight.T + (0 if base.bias is None else base.bias)
        torch.testing.assert_close(plain + xi @ dW.T + db, served, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_full_rank_is_exact_and_peft_loads_it(case, saved, tmp_path):
    model, adapter, family = loaded(saved, case)
    conv = convert_adapter(adapter, model, rank=96)  # >= every layer's min(in, out): the SVD keeps everything
    assert all(layer.exact for layer in conv.layers.values()), conv.rel_error
    out = save_lora(conv, model, str(tmp_path / "lora"), dtype=F64)
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == cfg["lora_alpha"] == 96
    assert cfg["lora_bias"] == (case in ("lora_bias", "ia3"))  # IA3 scales qwen2's k/v biases
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    want = peft_logits(family, saved(case), ids)
    got = peft_logits(family, out, ids)
    with torch.no_grad():
        base = tiny_model(family, F64)(ids).logits
    assert effect_err(got, want, base) < 1e-10


def test_vera_is_exact_at_its_own_rank_and_lora_stays_itself(saved):
    model, vera, _ = loaded(saved, "vera")
    conv = convert_adapter(vera, model, rank=8)
    assert {l.method for l in conv.layers.values()} == {"factors"} and conv.rel_error < 1e-14
    conv = convert_adapter(vera, model, rank=4)  # below its rank: the SVD, with an error
    assert {l.method for l in conv.layers.values()} == {"svd"} and conv.rel_error > 1e-3
    model, lora, _ = loaded(saved, "lora")
    conv = convert_adapter(lora, model, rank=4)
    assert all(l.method == "factors" and l.exact for l in conv.layers.values())


def test_error_is_the_svd_tail_and_falls_with_rank(saved):
    model, adapter, _ = loaded(saved, "oft")
    errors = [convert_adapter(adapter, model, rank=r).rel_error for r in (2, 8, 16, 32, 96)]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.1 and errors[-1] < 1e-12
    name, slots = next(iter(adapter.layers.items()))
    base = dict(model.named_modules())[name]
    dW, _ = effective_delta(slots, base.weight, base.bias)
    S = torch.linalg.svdvals(dW)
    layer = convert_adapter(adapter, model, rank=8).layers[name]
    assert layer.rel_error == pytest.approx((S[8:].square().sum() / S.square().sum()).sqrt().item(), rel=1e-9)
    assert (dW - layer.B @ layer.A).norm().item() == pytest.approx(layer.error_norm, rel=1e-9)


def test_a_low_rank_delta_converts_through_its_factors_as_through_its_svd(saved):
    """VeRA below its rank: the SVD of B'A' taken from the factors (`factored_svd`) gives the dense SVD's singular
    values, error and best rank-4 product."""
    model, adapter, _ = loaded(saved, "vera")
    conv = convert_adapter(adapter, model, rank=4)
    for name, slots in adapter.layers.items():
        base = dict(model.named_modules())[name]
        dW, _ = effective_delta(slots, base.weight, base.bias)
        U, S, Vh = torch.linalg.svd(dW, full_matrices=False)
        layer = conv.layers[name]
        assert layer.method == "svd"
        assert layer.error_norm == pytest.approx(S[4:].square().sum().sqrt().item(), rel=1e-9), name
        best = (U[:, :4] * S[:4]) @ Vh[:4]
        assert torch.allclose(layer.B @ layer.A, best, rtol=0, atol=1e-12 * S[0].item()), name


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_the_gram_svd_is_the_dense_svd(shape):
    """`gram_svd` against `torch.linalg.svd`: the same singular values (to rounding where they are above 1e-4 of
    the largest; the small ones of an ill-conditioned M to 1e-8 of it), U S Vh = M, orthonormal singular vectors
    of the large ones,
    the same best rank-k products, a tail that is the rank-k product's error; a rank-deficient M is exact at its
    rank, a zero M gives zeros."""
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(0, -10, min(shape), dtype=F64)  # singular values down to 1e-10 of the largest
    U0, _ = torch.linalg.qr(torch.randn(shape[0], min(shape), dtype=F64, generator=g))
    V0, _ = torch.linalg.qr(torch.randn(shape[1], min(shape), dtype=F64, generator=g))
    M = (U0 * scales) @ V0.T
    U, S, Vh = gram_svd(M)
    Ud, Sd, Vhd = torch.linalg.svd(M, full_matrices=False)
    big = Sd > 1e-4
    assert torch.allclose(S[big], Sd[big], rtol=1e-12, atol=0) and torch.allclose(S, Sd, rtol=0, atol=1e-8)
    assert torch.allclose((U * S) @ Vh, M, rtol=0, atol=1e-14)
    for X in (U[:, :4], Vh[:4].T):  # the vectors of the singular values above 1e-2 of the largest
        assert torch.allclose(X.T @ X, torch.eye(4, dtype=F64), rtol=0, atol=1e-12)
    for k in (1, 3, 8):
        best = (U[:, :k] * S[:k]) @ Vh[:k]
        assert torch.allclose(best, (Ud[:, :k] * Sd[:k]) @ Vhd[:k], rtol=0, atol=1e-12)
        assert (M - best).norm().item() == pytest.approx(S[k:].square().sum().sqrt().item(), rel=1e-9)
    low = M[:, :5] @ torch.randn(5, shape[1], dtype=F64, generator=g)  # rank 5
    U, S, Vh = gram_svd(low)
    assert ((low - (U[:, :5] * S[:5]) @ Vh[:5]).norm() / low.norm()).item() < 1e-12
    U, S, Vh = gram_svd(torch.zeros(shape, dtype=F64))
    assert not S.any() and not ((U * S) @ Vh).any()


def test_bias_drop_counts_it_in_the_error(saved):
    model, adapter, _ = loaded(saved, "ia3")
    keep = convert_adapter(adapter, model, rank=96)
    drop = convert_adapter(adapter, model, rank=96, bias_policy="drop")
    assert keep.lora_bias and keep.rel_error < 1e-12
    assert not drop.lora_bias and drop.rel_error > 1e-3 and drop.notes


def test_target_modules_select_exactly_the_adapted_layers():
    model = tiny_model("llama")
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert target_modules(names, model) == ["q_proj", "v_proj"]
    regex = target_modules(names[:2], model)
    assert isinstance(regex, str) and "layers\\.0\\.self_attn\\.q_proj" in regex


def test_cli_writes_a_lora_and_prints_errors_and_memory(tmp_path, capsys):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "base")
    make_adapter(str(tmp_path / "dora"), LoraConfig(r=4, use_dora=True, target_modules=ALL_LINEAR), "llama")
    rc = convert_main([str(tmp_path / "dora"), "--to", "lora", "--rank", "8", "--out", str(tmp_path / "out"),
                       "--model", str(tmp_path / "base"), "--probe-tokens", "64"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "model.layers.1.mlp.down_proj" in text and "weight error" in text and "logits error" in text
    assert "memory per adapter" in text
    with open(tmp_path / "out" / "scute_conversion.json") as f:
        report = json.load(f)
    assert report["rank"] == 8 and 0 < report["rel_error"] < 1
    rc = convert_main([str(tmp_path / "dora"), "--rank", "8", "--out", str(tmp_path / "o2"), "--model",
                       str(tmp_path / "nowhere")])
    assert rc == 2 and "no such folder" in capsys.readouterr().err
    out = str(tmp_path / "dora")
    for args, fragment in ((["--rank", "0"], "--rank"), (["--rank", "8", "--out", out], "own folder")):
        with pytest.raises(SystemExit):
            convert_main([out, "--out", str(tmp_path / "o3"), *args])
        assert fragment in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_a_model_on_the_gpu_converts_as_on_the_cpu(case, saved):
    """Adapters of a model on the GPU (converted where W0 is, or on the CPU as VeRA's are) convert there, with
    the CPU's errors."""
    model, adapter, family = loaded(saved, case)
    on_gpu = tiny_model(family, F64).cuda()
    cpu, gpu = convert_adapter(adapter, model, rank=2), convert_adapter(load_adapter(saved(case), on_gpu), on_gpu, 2)
    assert gpu.layers.keys() == cpu.layers.keys()
    for name, layer in cpu.layers.items():
        assert gpu.layers[name].error_norm == pytest.approx(layer.error_norm, rel=1e-6, abs=1e-12), name

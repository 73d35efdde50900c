"""`scute explain`: per-layer slots, bytes and FLOPs of one adapter of each method, checked against what the
checkpoint's tensors and hyperparameters say they must be (not against the code that computes them)."""

from __future__ import annotations

import math

import pytest
import torch
from peft import (
    AdaLoraConfig,
    BOFTConfig,
    DeloraConfig,
    FourierFTConfig,
    GloraConfig,
    HiraConfig,
    HRAConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    MissConfig,
    OFTConfig,
    PveraConfig,
    RoadConfig,
    VBLoRAConfig,
    VeraConfig,
)

from scute.adapters import read_checkpoint
from scute.adapters.explain import ExplainTable, explain, explain_main
from scute.ops.cost import VEC_BYTES
from tests.helpers import ALL_LINEAR, make_adapter, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]
E = 2  # bf16 matrices; vectors are float32 (VEC_BYTES)


def lowrank(r):
    """bytes of a per-adapter rank-r pair."""
    return lambda i, o, t: E * r * (i + o)


def lokr_rank(i, o, t):  # rank(U1)·rank(U2): a full factor [a, c] has rank min(a, c), a product w_a @ w_b r
    def rank(name):
        full = t.get(f"lokr_{name}")
        return min(full.shape) if full is not None else t[f"lokr_{name}_a"].shape[1]
    return rank("w1") * rank("w2")


# method -> (config, expected bytes per adapter per layer from (in, out, the layer's tensors), live slots but c)
METHODS = {
    "lora": (LoraConfig(r=4, target_modules=ALL_LINEAR), lowrank(4), ("A", "B")),
    "dora": (LoraConfig(r=4, use_dora=True, target_modules=["q_proj", "o_proj"]),
             lambda i, o, t: E * 4 * (i + o) + VEC_BYTES * o * (1 + t["bias"]), None),
    "ia3": (IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
            lambda i, o, t: VEC_BYTES * t["ia3_l"].numel(), None),
    "vera": (VeraConfig(r=8, target_modules=["q_proj", "up_proj"]), lambda i, o, t: VEC_BYTES * (8 + o),
             ("A", "m", "B", "v")),
    "oft": (OFTConfig(r=0, oft_block_size=8, target_modules=T4), lambda i, o, t: E * i * 8, ("t_blocks",)),
    "boft": (BOFTConfig(boft_block_size=4, target_modules=T4),
             lambda i, o, t: E * i * 4 + VEC_BYTES * o * (1 + t["bias"]), None),
    "hra": (HRAConfig(r=4, target_modules=T4), lowrank(4), ("A", "B")),
    "loha": (LoHaConfig(r=3, target_modules=T4), lowrank(9), ("A", "B")),
    "lokr": (LoKrConfig(r=2, target_modules=T4), lambda i, o, t: E * lokr_rank(i, o, t) * (i + o), ("A", "B")),
    "adalora": (AdaLoraConfig(init_r=6, target_r=4, total_step=10, target_modules=T4), lowrank(6), ("A", "B")),
    "road": (RoadConfig(variant="road_2", group_size=16, target_modules=T4), lambda i, o, t: VEC_BYTES * 2 * o,
             ("o", "o2")),
    "vblora": (VBLoRAConfig(r=4, num_vectors=16, vector_length=8, target_modules=T4), lowrank(4), ("A", "B")),
    # rank 2n = 40: factors where 40 < min(in, out), else the dense ΔW (identity side shared)
    "fourierft": (FourierFTConfig(n_frequency=20, target_modules=T4),
                  lambda i, o, t: E * (40 * (i + o) if 40 < min(i, o) else i * o), ("A", "B")),
    "delora": (DeloraConfig(r=4, target_modules=T4), lowrank(4), ("A", "B")),
    "hira": (HiraConfig(r=2, target_modules=["q_proj", "v_proj"]), lambda i, o, t: E * i * o, ("A", "B")),
    "glora": (GloraConfig(r=4, config_A_B="vector", config_C="lora", config_D_E="vector", target_modules=T4),
              lambda i, o, t: VEC_BYTES * o * (1 + t["bias"]) + E * o, ("o", "A", "B")),  # A = 1ᵀ shared
    "miss": (MissConfig(r=8, target_modules=T4), lambda i, o, t: E * 8 * o, ("A", "B")),  # A (chunk sums) shared
    "pvera": (PveraConfig(r=8, target_modules=T4), lambda i, o, t: VEC_BYTES * (8 + o), ("A", "m", "B", "v")),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    for name, (config, *_) in METHODS.items():
        make_adapter(str(root / name), config, "qwen2")
    return root


def layer_tensors(path, modules) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's tensors by adapted module (the longest module name that prefixes the key)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, x in read_checkpoint(path).tensors.items():
        rel = key.removeprefix("base_model.model.")
        if module := max((m for m in modules if rel.startswith(m + ".")), key=len, default=None):
            out.setdefault(module, {})[rel[len(module) + 1:]] = x
    return out


@pytest.mark.parametrize("method", list(METHODS))
def test_bytes_flops_and_slots(method, adapters):
    _, expected_bytes, live = METHODS[method]
    model = tiny_model("qwen2")
    table = explain(adapters / method, model, batch=8, dense=(method == "hira"))
    assert isinstance(table, ExplainTable) and table.peft_type == method.upper().replace("DORA", "LORA")
    modules = dict(model.named_modules())
    tensors = layer_tensors(adapters / method, modules)
    assert sorted(r.name for r in table.rows) == sorted(tensors)
    for r in table.rows:
        lin = modules[r.name]
        t = {**tensors[r.name], "bias": lin.bias is not None}
        assert r.adapter_bytes == expected_bytes(lin.in_features, lin.out_features, t), r.name
        if live is not None:  # c: a bias correction, present on biased layers only (in the byte counts)
            assert tuple(k for k in r.live if k != "c") == live, r.name
        assert r.flops > 0 and 0 < r.seconds and 0 < r.base_seconds
    assert table.adapter_bytes == sum(r.adapter_bytes for r in table.rows)
    text = str(table)
    assert method.upper().replace("DORA", "LORA") in text and "total" in text and f"{table.flops:,}" in text


def test_lora_numbers_by_hand(adapters):
    """LoRA r=4 on q_proj (64×64): 2·4·128 bytes, FLOPs 2·4·64 + 2·4·64 + 64, s merged into B."""
    table = explain(adapters / "lora", tiny_model("qwen2"))
    q = next(r for r in table.rows if r.name == "model.layers.0.self_attn.q_proj")
    assert (q.adapter_bytes, q.flops, q.base_flops, q.rank) == (1024, 1088, 8192, 4)
    assert q.filled == ("A", "B", "s") and q.merged == ("s",) and q.live == {"A": (4, 64), "B": (64, 4)}
    assert table.adapter_bytes == 2 * 4 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64),
                                                                    (64, 96), (64, 96), (96, 64)]) * 2


def test_dora_and_vera_slots(adapters):
    dora = explain(adapters / "dora", tiny_model("qwen2")).rows[0]  # q_proj has a bias on qwen2
    assert dora.filled == ("o", "c", "A", "B", "v", "s") and dora.merged == ("s", "v")
    assert tuple(dora.live) == ("o", "c", "A", "B")
    vera = explain(adapters / "vera", tiny_model("qwen2"))
    assert vera.rows[0].shared == ("A", "B") and vera.rows[0].merged == ()
    assert vera.shared_bytes == E * 8 * (64 + 96)  # the model-level pair [r, max_in] + [max_out, r], once
    assert vera.rows[0].flops == 2 * 8 * 64 + 8 + 2 * 8 * 64 + 64 + 64  # A, m, B (+add), v


def test_more_adapters_cost_their_bytes(adapters):
    """The byte model: one more distinct adapter in the batch costs exactly its bytes (RoAd: no rank space)."""
    model = tiny_model("qwen2")
    one, two = (explain(adapters / "road", model, batch=8, adapters=n) for n in (1, 2))
    for r1, r2 in zip(one.rows, two.rows):
        assert r2.seconds - r1.seconds == pytest.approx(r1.adapter_bytes / 4.2e12, rel=1e-9)
    lora = [explain(adapters / "lora", model, batch=16, adapters=n).seconds for n in (1, 4, 16)]
    assert lora[0] < lora[1] < lora[2]


def test_shapes_without_a_model(adapters, tmp_path):
    model = tiny_model("qwen2")
    def summary(table):  # without a model biases are unknown: leave out c, the bias-dependent slot
        return sorted((r.name, r.in_features, r.out_features, r.adapter_bytes - VEC_BYTES * r.out_features *
                       ("c" in r.live)) for r in table.rows)

    for method in ("lora", "loha", "lokr", "boft", "vblora", "adalora", "delora"):
        assert summary(explain(adapters / method)) == summary(explain(adapters / method, model)), method
    assert summary(explain(adapters / "hira", dense=True)) == summary(explain(adapters / "hira", model, dense=True))
    with pytest.raises(ValueError, match="pass --model"):
        explain(adapters / "ia3")
    model.config.save_pretrained(tmp_path / "base")  # a local HF folder: config only, no weights
    a, b = explain(adapters / "ia3", str(tmp_path / "base")), explain(adapters / "ia3", model)
    assert [(r.name, r.adapter_bytes, r.flops) for r in a.rows] == [(r.name, r.adapter_bytes, r.flops)
                                                                      for r in b.rows]
    assert len(a.rows) == 4


def test_cli(adapters, capsys):
    assert explain_main([str(adapters / "loha"), "--batch", "4", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "LOHA" in out and "µs @B=4" in out and "A[9×64]" in out and "weights fp32" in out
    assert explain_main([str(adapters / "loha"), "--batch", "4", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == out  # serve's spelling of the same dtype
    assert explain_main([str(adapters / "hira")]) == 2
    assert "dense=True" in capsys.readouterr().err
    assert explain_main([str(adapters / "hira"), "--dense", "--model", "/nonexistent"]) == 2
    for args, fragment in ((["--batch", "0"], "batch"), (["--adapters", "9", "--batch", "4"], "adapters"),
                           (["--bandwidth", "0"], "bandwidth")):
        assert explain_main([str(adapters / "loha"), *args]) == 2
        assert f"scute explain: {fragment}:" in capsys.readouterr().err
    for kw in (dict(batch=0), dict(batch=4, adapters=9), dict(bandwidth=0.0), dict(dtype="int8")):  # the library's
        with pytest.raises(ValueError, match=next(iter(kw)) if "adapters" not in kw else "adapters"):
            explain(adapters / "loha", **kw)
    assert math.isfinite(explain(adapters / "hira", tiny_model("qwen2"), dense=True).seconds)


def test_model_from_a_gguf_file(adapters, tmp_path):
    """A .gguf base is read for its metadata only (here a file with no layer weights at all)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256), w.add_embedding_length(64), w.add_block_count(2), w.add_feed_forward_length(96)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_vocab_size(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.zeros((128, 64), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    a, b = explain(adapters / "ia3", path), explain(adapters / "ia3", tiny_model("llama"))
    assert [(r.name, r.adapter_bytes, r.flops) for r in a.rows] == [(r.name, r.adapter_bytes, r.flops)
                                                                      for r in b.rows]
    assert a.model == "tiny.gguf"

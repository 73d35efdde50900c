"""OFT's rotations are computed for all of an adapter's layers in one batch per block size (its PEFT equality is
in `test_peft_equality.py`): the batch equals each layer computed alone, with COFT's radius each layer's own (it
depends on the layer's number of blocks), for PEFT's Neumann series and the exact Cayley map (PEFT's cases
`oft` and `oft_coft` cover layers of different block counts, 8 and 12, against PEFT)."""

from __future__ import annotations

import pytest
import torch

from scute.adapters.methods.oft import rotations


@pytest.mark.parametrize("config", [
    {"coft": True, "eps": 0.05},  # a radius small enough to project some blocks, not all
    {"coft": True, "eps": 0.05, "use_cayley_neumann": False},
    {"num_cayley_neumann_terms": 3},
], ids=["coft-neumann", "coft-exact", "neumann3"])
def test_a_batch_of_layers_equals_each_alone(config):
    gen = torch.Generator().manual_seed(0)
    b = 4
    vecs = [torch.randn(n, b * (b - 1) // 2, generator=gen, dtype=torch.float64) * scale
            for n, scale in ((2, 0.01), (6, 0.05), (1, 0.02))]  # 2, 6 and 1 blocks: three radii
    together = rotations(vecs, b, config)
    alone = [rotations([v], b, config)[0] for v in vecs]
    assert [r.shape for r in together] == [(2, b, b), (6, b, b), (1, b, b)]
    assert all(torch.equal(x, y) for x, y in zip(together, alone))
    if config.get("coft"):  # the projection ran, at each layer's radius: one radius for all would differ
        one_radius = rotations([torch.cat(vecs)], b, config)[0].split([2, 6, 1])
        assert not all(torch.equal(x, y) for x, y in zip(together, one_radius))


def test_a_layer_converted_alone_equals_its_adapters_batch():
    """`convert_oft` on a layer checkpoint made without its peers (not by `convert_checkpoint`) computes its own
    rotations, equal to those of the adapter's batch."""
    from scute.adapters.conversion import LayerCheckpoint
    from scute.adapters.methods.oft import convert_oft

    gen = torch.Generator().manual_seed(1)
    config = {"oft_block_size": 4, "coft": True, "eps": 0.05}
    vecs = {"a": torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.05,
            "b": torch.randn(2, 6, generator=gen, dtype=torch.float64) * 0.05}
    bases = {"a": torch.nn.Linear(16, 5, dtype=torch.float64), "b": torch.nn.Linear(8, 3, dtype=torch.float64)}
    shapes = {n: tuple(m.weight.shape) for n, m in bases.items()}

    def layer(name: str, peers: dict) -> LayerCheckpoint:
        return LayerCheckpoint(name, config, bases[name], None, {"oft_R.weight": vecs[name]}, None, {}, shapes,
                               {}, peers=peers)

    with_peers = layer("b", {n: {"oft_R.weight": v} for n, v in vecs.items()})
    batched = convert_oft(with_peers)
    assert set(with_peers.shared["oft_rotations"]) == {"a", "b"}  # both layers, in one batch
    alone = layer("b", {})
    assert torch.equal(convert_oft(alone).t_blocks, batched.t_blocks) and "oft_rotations" in alone.shared

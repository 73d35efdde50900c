"""FRoD (full-rank re-parameterization of the base weight over a shared basis).

PEFT (eval, one adapter, any dropout) does not run the base layer: it computes the adapted weight
``W' = U (S + diag(λ_l)) Vᵀ`` directly, ``y = W' x + b`` (b: the layer's bias, a trained one with ``bias="all"`` /
``"frod_only"``), as ``((x V)(Sᵀ + diag λ_l)) Uᵀ`` in the model dtype. The factors:

* ``V`` [in, in]: one basis per *category* of module (``self_attn_q_proj``, ``mlp_down_proj``, ...: the last two
  parts of the module path, or the last one after a layer number), computed at init from the category's base
  weights (float32 QR/SVD/eigh) and saved with ``save_projection=True`` as ``base_model.frod_V.<category>``.
* ``S`` [in, in]: sparse, the trained values ``frod_lambda_s_values`` [nnz] at the saved positions
  ``base_model.frod_s_indices.<category>`` [2, nnz] (rows, columns; a random off-diagonal pattern drawn from
  `projection_prng_key`), size ``base_model.frod_s_size.<category>`` = [in, in].
* ``λ_l`` = `frod_lambda_l` [in], trained.
* ``U`` [out, in]: *not saved*; PEFT recomputes it at every load from the layer's W0 and V: ``B = W0 V⁻ᵀ``
  (``linalg.solve(V, W0ᵀ)ᵀ`` in float64 on the CPU, the pseudo-inverse with rtol 1e-6 if V is singular), its
  columns normalized (a column of norm ≤ 1e-12 is zero), rounded to float32 and then to the model dtype. The
  solve is deterministic on the CPU and repeated here exactly, the roundings included.

So the change is ``ΔW = W' − W0``: full rank in general (the re-parameterization replaces the whole weight), no
low-rank form over a shared W0: served exactly as a dense per-adapter ΔW, with ``dense=True`` only. The bias is
the method's own (the loader corrects for the base bias the server keeps). ΔW is formed in float64 from the
(rounded) factors and returned in the converter dtype.

Refused: ``save_projection=False`` (V and the sparsity pattern are then rebuilt by PEFT at load from every
targeted layer of a category together; a converter sees one layer). Caveat: PEFT's reload computes U from the V it
rebuilds from the base weights, then loads the saved V for the forward; both are the same tensor when the base model
is the one the adapter was trained on (the case served here, and tested by reloading through PEFT).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def category(name: str) -> str:
    """The basis-sharing category of module `name` as FRoD names it: the last path part after a block index,
    else the last two joined by ``_`` (BERT's ``attention.output.dense``: ``attention_output``)."""
    parts = name.split(".")
    if len(parts) == 1:
        return parts[0]
    if parts[-2].isdigit():
        return parts[-1]
    if parts[-2:] == ["output", "dense"] and len(parts) >= 3 and parts[-3] == "attention":
        return "attention_output"
    return f"{parts[-2]}_{parts[-1]}"


def frod_u(w0: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """U [out, in] as PEFT recomputes it at load: the columns of W0 V⁻ᵀ (float64, CPU) normalized, zero where the
    column norm is ≤ 1e-12, rounded to float32, then to the model `dtype`."""
    w64, v64 = w0.to(torch.float64).cpu(), v.to(torch.float64).cpu()
    try:
        coeff = torch.linalg.solve(v64, w64.T).T  # W0 = coeff · Vᵀ
    except RuntimeError:  # singular V: least squares through the pseudo-inverse
        coeff = w64 @ torch.linalg.pinv(v64, rtol=1e-6).T
    norms = torch.linalg.norm(coeff, dim=0)
    keep = norms > 1e-12
    u = torch.where(keep, coeff / torch.where(keep, norms, torch.ones_like(norms)), torch.zeros_like(coeff))
    return u.to(torch.float32).to(dtype)


@register_method("FROD", keys=("frod_lambda_l", "frod_lambda_s_values"),
                 global_keys=("frod_V.*", "frod_s_indices.*", "frod_s_size.*"))
def convert_frod(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "FRoD replaces the weight by U (S + diag λ) Vᵀ (U, V full [in, in] bases, S sparse): its "
                         "delta from W0 is full rank, no low-rank form")
    if layer.config.get("save_projection", True) is False:
        raise layer.error("saved with save_projection=False: the shared bases V and the sparsity pattern are not in "
                          "the file (PEFT rebuilds them from all the category's base weights together); re-save the "
                          "adapter with save_projection=True")
    i = layer.in_features
    cat = category(layer.name)
    V = layer.global_tensor(f"frod_V.{cat}")
    if tuple(V.shape) != (i, i):
        raise layer.error(f"base_model.frod_V.{cat} has shape {tuple(V.shape)}, the layer needs ({i}, {i})")
    size = layer.global_tensor(f"frod_s_size.{cat}").round().long()
    if size.tolist() != [i, i]:
        raise layer.error(f"base_model.frod_s_size.{cat} is {size.tolist()}, the layer needs [{i}, {i}]")
    idx = layer.global_tensor(f"frod_s_indices.{cat}")
    if idx.dim() != 2 or idx.shape[0] != 2:
        raise layer.error(f"base_model.frod_s_indices.{cat} has shape {tuple(idx.shape)}, expected [2, nnz]")
    nnz = idx.shape[1]
    rows, cols = idx.round().long()
    if nnz and (min(rows.min(), cols.min()) < 0 or max(rows.max(), cols.max()) >= i):
        raise layer.error(f"base_model.frod_s_indices.{cat} point outside the {i}×{i} matrix S")
    values = layer.tensor("frod_lambda_s_values", (nnz,))
    lam = layer.tensor("frod_lambda_l", (i,))

    model_dtype = layer.base.weight.dtype
    U = frod_u(layer.weight, V, model_dtype).to(torch.float64)
    # PEFT holds V, S and λ_l in the model dtype too (the file's V, S and λ_l already are)
    core = torch.zeros(i, i, dtype=torch.float64).index_put_((rows, cols), values.to(model_dtype).double(),
                                                             accumulate=True)
    core = core + torch.diag(lam.to(model_dtype).double())
    w_new = U @ core @ V.to(model_dtype).double().T
    delta = w_new - layer.weight.to(torch.float64)
    return full_rank_slots(layer, delta.to(layer.dtype))

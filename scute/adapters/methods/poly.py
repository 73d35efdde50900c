"""Poly (Polytropon): a LoRA per task, mixed from shared skills.

PEFT forward (eval), for a request of task τ: ``w = sigmoid(module_logits[τ])`` viewed [n_splits, n_skills],
each split's row divided by its sum (+ 1e-12); per split q, ``A_q = Σ_s w[q, s] poly_lora_A[q, s]`` [in/n, r] and
``B_q = Σ_s w[q, s] poly_lora_B[q, s]`` [r, out/n]; A stacks the splits along the input, B along the output, and
``y = W0 x + b0 + (x A B) / r``. The router reads only the task id, so one task's adapter is an exact LoRA of
rank r (normal form: A = Aᵀ, B = Bᵀ, s = 1/r). The task is chosen when loading (``load_adapter(...,
task_id=τ)``); serving several tasks of one checkpoint is one adapter per task.
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import LoadOption, register_method
from scute.ops.slots import Slots

EPS = 1e-12  # PEFT's router: weights / (sum + EPS)


TASK_ID = LoadOption("the task to serve, 0..n_tasks-1: one adapter per task", suffix="@task{}")


@register_method("POLY", keys=("poly_lora_A", "poly_lora_B", "poly_router.module_logits"), options={"task_id": TASK_ID})
def convert_poly(layer: LayerCheckpoint) -> Slots:
    cfg = layer.config
    if cfg.get("poly_type", "poly") != "poly":
        raise layer.error(f"poly_type {cfg.get('poly_type')!r} is not supported (PEFT knows only 'poly')")
    task = layer.options.get("task_id")
    r, tasks, skills, splits = (int(cfg[k]) for k in ("r", "n_tasks", "n_skills", "n_splits"))
    if task is None:
        raise layer.error(f"Poly mixes its skills per task: load it with task_id=0..{tasks - 1} "
                          "(one adapter per task)")
    if not 0 <= task < tasks:
        raise layer.error(f"task_id={task} is out of range: the adapter has n_tasks={tasks}")
    n_in, n_out = layer.in_features, layer.out_features
    if n_in % splits or n_out % splits:
        raise layer.error(f"n_splits={splits} does not divide the layer's in ({n_in}) and out ({n_out}) features")
    A = layer.tensor("poly_lora_A", (splits, skills, n_in // splits, r))
    B = layer.tensor("poly_lora_B", (splits, skills, r, n_out // splits))
    logits = layer.tensor("poly_router.module_logits", (tasks, splits * skills))
    w = torch.sigmoid(logits[task]).view(splits, skills)
    w = w / (w.sum(-1, keepdim=True) + EPS)
    a = torch.einsum("qs,qsdr->qdr", w, A).reshape(n_in, r)  # [in, r]
    b = torch.einsum("qs,qsrd->qrd", w, B).transpose(0, 1).reshape(r, n_out)  # [r, out]
    return Slots(n_in, n_out, A=a.T.contiguous(), B=b.T.contiguous(), scale=1.0 / r)

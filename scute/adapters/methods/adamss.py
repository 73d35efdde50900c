"""AdaMSS (adaptive multi-subspaces).

PEFT clusters the output rows of W0 into K subspaces and trains, per subspace i, a pair A_i [r_i, R],
B_i [n_i, r_i] behind one frozen projection N = ``adamss_newB`` [R, in'] (the top-R right singular vectors of
``[W0 | b0]``; in' = in + 1 when the base layer has a bias, whose column then multiplies a constant 1). Forward
(eval; ASA only freezes gradients during training, so it changes nothing here):

    p = N · [x; 1]                                  ([x] without a bias)
    Δ = scatter_S( concat_i B_i (A_i p) )           S = concat_i (rows of subspace i, ascending)
    y = W0 x + b0 + Δ

S is a permutation of the output rows, so ``Δ = B̂ Â N [x; 1]`` with Â = concat_i A_i [Σr_i, R] and B̂
[out, Σr_i] the block matrix whose rows S_i, columns of block i hold B_i (zero elsewhere). With N = [N_x | n_b]:

    Normal form: an exact LoRA plus a bias term, c = B̂ Â n_b (biased layers only), and either
      rank Σr_i:  A = Â N_x, B = B̂           (when Σr_i ≤ R: the usual case, K·subspace_rank ≪ R)
      rank R:     A = N_x,   B = B̂ Â         (otherwise)
    (`normal_form.md` wrote the rank-R form; both are the same map, Scute takes the smaller rank.)

The partition S is **not saved**: PEFT recomputes it at load from W0, deterministically — a float32
``torch.svd_lowrank`` of ``[W0 | b0]`` (q = R, niter = 2) under a CPU RNG seeded with the config's
``random_seed``, then scikit-learn ``KMeans(min(K, out), init="random", n_init=1, max_iter=10,
random_state=123456789)`` on the rows of U, subspace i = the rows labelled i. Scute recomputes it the same way (on
the CPU, from the weight it serves: the result PEFT gets loading the adapter on a CPU-resident base of that
dtype) and checks it against the row counts n_i the checkpoint saved (B_i's shapes), refusing the adapter if they
differ. A partition that PEFT itself recomputes differently (on a GPU, whose RNG draws another projection; another
torch or scikit-learn version; a base in another dtype) is PEFT's own instability, not a property of the file.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

KMEANS_SEED = 123456789  # PEFT's fixed KMeans random_state
KMEANS_ITERS = 10


def subspace_labels(layer: LayerCheckpoint, rank: int, seed: int, k: int) -> Tensor:
    """PEFT's load-time clustering of W0's output rows: label per row (int64 [out])."""
    try:
        from sklearn.cluster import KMeans
    except ImportError:
        raise layer.error("AdaMSS's subspaces are not saved: they are recomputed from W0 with scikit-learn's "
                          "KMeans, as PEFT does at load; install scikit-learn") from None
    w = layer.weight.float()
    if layer.bias is not None:
        w = torch.cat([w, layer.bias.float()[:, None]], dim=1)
    # A forked CPU RNG seeded like PEFT's: svd_lowrank draws its projection from the global CPU generator; the
    # server's own RNG streams (CPU and accelerators) are left as they were.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        u, _, _ = torch.svd_lowrank(w, q=rank, niter=2)
    points = u[:, :rank].contiguous().numpy().astype("float32")
    kmeans = KMeans(n_clusters=min(k, w.shape[0]), init="random", n_init=1, max_iter=KMEANS_ITERS,
                    random_state=KMEANS_SEED)
    return torch.from_numpy(kmeans.fit_predict(points)).long()


@register_method("ADAMSS", keys=("adamss_newB", "adamss_A.*", "adamss_B.*"))
def convert_adamss(layer: LayerCheckpoint) -> Slots:
    i, o, cfg = layer.in_features, layer.out_features, layer.config
    biased = layer.bias is not None
    width = i + biased
    rank = min(int(cfg["r"]), o, width)
    newb = layer.tensor("adamss_newB", (rank, width))
    k = sum(1 for key in layer.tensors if key.startswith("adamss_A."))
    if k == 0 or any(not layer.has(f"adamss_{p}.{n}") for p in "AB" for n in range(k)):
        raise layer.error(f"AdaMSS subspaces must be saved as adamss_A.0..{max(k, 1) - 1} and adamss_B.0..: "
                          "some are missing")
    a_list, b_list = [], []
    for n in range(k):
        a = layer.tensor(f"adamss_A.{n}")
        if a.dim() != 2 or a.shape[1] != rank:
            raise layer.error(f"tensor 'adamss_A.{n}' has shape {tuple(a.shape)}, this layer needs (r_{n}, {rank})")
        b = layer.tensor(f"adamss_B.{n}")
        if b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise layer.error(f"tensor 'adamss_B.{n}' has shape {tuple(b.shape)}, this layer needs "
                              f"(rows of subspace {n}, {a.shape[0]})")
        a_list.append(a)
        b_list.append(b)

    labels = subspace_labels(layer, rank, int(cfg.get("random_seed", 0)), int(cfg["num_subspaces"]))
    rows = [torch.nonzero(labels == n).flatten() for n in range(int(labels.max()) + 1)]
    saved = [b.shape[0] for b in b_list]
    if [len(r) for r in rows] != saved:
        raise layer.error(
            f"the subspaces recomputed from the base weight have {[len(r) for r in rows]} rows, the checkpoint "
            f"saved {saved}: AdaMSS does not save its row partition and PEFT recomputes it from W0 (float32 "
            "svd_lowrank + KMeans); the base weights, their dtype or the torch/scikit-learn versions differ from "
            "those it was saved with"
        )

    ranks = [a.shape[0] for a in a_list]
    a_hat = torch.cat(a_list)  # [Σr_i, R]
    b_hat = torch.zeros(o, sum(ranks), dtype=a_hat.dtype)
    col = 0
    for r_n, idx, b in zip(ranks, rows, b_list):
        b_hat[idx, col:col + r_n] = b
        col += r_n
    n_x = newb[:, :i]
    c = b_hat @ (a_hat @ newb[:, i]) if biased else None
    if sum(ranks) <= rank:
        return Slots(i, o, A=a_hat @ n_x, B=b_hat, c=c)
    return Slots(i, o, A=n_x, B=b_hat @ a_hat, c=c)

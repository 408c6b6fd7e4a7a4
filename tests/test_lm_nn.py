"""colibri.nn.MoETransformer: trainable with PyTorch, exported as a token model that computes what
the module computes (logits over a prefill and single steps, greedy continuation)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri import image
from colibri.nn import MoETransformer
from colibri.reference import LMState


def _trained(seed: int, **kw) -> MoETransformer:
    """A few Adam steps on a periodic sequence: the loss must fall (the module trains)."""
    torch.manual_seed(seed)
    model = MoETransformer(64, 32, 2, 4, num_experts=4, hidden=24, **kw)
    data = torch.tensor([[(7 * i + 3 * (i // 5)) % 64 for i in range(33)]] * 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    return model.eval()


@pytest.mark.parametrize("kw", [
    dict(n_kv_heads=2, qk_norm=True, num_shared=1),  # GQA, per-head q/k norm, a shared expert, tied head
    dict(routing="topk_softmax", tie_embeddings=False, head_dim=6),  # Mixtral routing, untied head
])
def test_export_matches_the_module(kw: dict) -> None:
    model = _trained(0, **kw)
    result = colibri.export(model, max_seq_len=48, max_batch=8)
    g = image.read(result.image)
    assert (g.layers[-1].weight is g.layers[0].table) == kw.get("tie_embeddings", True)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 64, 44)]
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].numpy()
    state = LMState(image.read(result.image))
    got = np.concatenate([state.forward_tokens(ids[:4])] + [state.forward_tokens([t]) for t in ids[4:]])
    assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max())
    # greedy continuation: the module's argmax fed back, as LMState.generate
    seq = [3, 10, 17]
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert LMState(image.read(result.image)).generate([3, 10, 17], 20) == seq[3:]

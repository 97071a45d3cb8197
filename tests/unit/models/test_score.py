"""Per-query candidate scores (xc/models/classifier.py `score`): the dense path and the gathered path give the same
scores and the same gradients, and each is taken on the side of DENSE_ROWS_PER_COLUMN it is meant for."""

import pytest
import torch

from xc.models.classifier import DENSE_ROWS_PER_COLUMN, score


def _case(num_rows: int, columns: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(num_rows, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    inverse = torch.randint(0, num_rows, (6, columns), generator=gen)
    inverse[0, :2] = 0  # a row twice in one query: its gradients add up
    return emb, rows, inverse


def _by_hand(emb, rows, inverse):
    return torch.stack([torch.stack([emb[b] @ rows[int(i)] for i in inverse[b]]) for b in range(len(inverse))])


@pytest.mark.parametrize("num_rows", [3, DENSE_ROWS_PER_COLUMN * 3, DENSE_ROWS_PER_COLUMN * 3 + 1, 500])
def test_scores_and_gradients_are_the_inner_products(num_rows):
    emb, rows, inverse = _case(num_rows, 3)
    out = score(emb, rows, inverse)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * weights).sum().backward()
    g_emb, g_rows = emb.grad.clone(), rows.grad.clone()
    emb.grad = rows.grad = None
    expect = _by_hand(emb, rows, inverse)
    (expect * weights).sum().backward()
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(g_emb, emb.grad)
    torch.testing.assert_close(g_rows, rows.grad)


def test_the_rule_picks_the_dense_product_for_few_rows_only(monkeypatch):
    calls = []
    real = torch.Tensor.gather
    monkeypatch.setattr(torch.Tensor, "gather", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    score(*_case(DENSE_ROWS_PER_COLUMN * 3, 3))
    assert calls, "U = 32 C rows: one dense product"
    calls.clear()
    score(*_case(DENSE_ROWS_PER_COLUMN * 3 + 1, 3))
    assert not calls, "U > 32 C rows: gathered per query"

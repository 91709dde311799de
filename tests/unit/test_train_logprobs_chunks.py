"""--log-probs-chunk-size: log-probs and entropy computed over at most that many response tokens at a
time are the same numbers (and gradients) as all at once, and no computation sees more rows."""

from __future__ import annotations

import pytest
import torch

from tether.train.algorithms import logprobs


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 9, 13, generator=g, dtype=torch.float64)
    response_index = torch.tensor([3, 4, 5, 6, 7, 9 + 2, 9 + 3, 9 + 4, 9 + 5, 9 + 6, 9 + 7])
    targets = torch.randint(0, 13, (response_index.numel(),), generator=g)
    return logits, response_index, targets


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 11, 50])
def test_chunked_equals_unchunked_values_and_gradients(chunk: int) -> None:
    logits, index, targets = _case()
    results = []
    for size in (-1, chunk):
        x = logits.clone().requires_grad_(True)
        lp, ent = logprobs.log_probs_and_entropy(x, index, targets, temperature=0.7, chunk_size=size)
        assert ent is not None
        (lp.sum() + 0.3 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), x.grad))
    (lp0, ent0, grad0), (lp1, ent1, grad1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad1, grad0, rtol=0, atol=1e-12)


def test_no_computation_sees_more_rows_than_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, index, targets = _case()  # 11 response tokens
    seen: list[int] = []
    real = logprobs.token_log_probs

    def spy(rows: torch.Tensor, t: torch.Tensor, tp_group: object = None) -> torch.Tensor:
        seen.append(rows.shape[0])
        return real(rows, t, None)

    monkeypatch.setattr(logprobs, "token_log_probs", spy)
    logprobs.log_probs_and_entropy(logits, index, targets, chunk_size=4, with_entropy=False)
    assert seen == [4, 4, 3]  # ceil(11 / 4) chunks, slime's split
    seen.clear()
    logprobs.log_probs_and_entropy(logits, index, targets, chunk_size=-1, with_entropy=False)
    assert seen == [11]


def test_row_chunks_cover_every_row_once() -> None:
    for n in range(0, 30):
        for size in (-1, 1, 2, 5, 7, 40):
            parts = logprobs.row_chunks(n, size)
            rows = [r for p in parts for r in range(n)[p]]
            assert rows == list(range(n))
            if size > 0:
                assert all(p.stop - p.start <= size for p in parts)

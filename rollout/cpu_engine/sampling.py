"""Sampling parameters (SGLang's names and defaults) and the batched token choice.

Log-probs follow SGLang 0.5's sampler: a greedy row (temperature below 1e-6, or top_k 1) reports
log_softmax of the raw logits; a sampled row reports log_softmax of logits / temperature, taken
before top-k / top-p / min-p filtering. With `original_logprob` (SGLang's
SGLANG_RETURN_ORIGINAL_LOGPROB) every row reports log_softmax of the raw logits. Each log-prob
comes from the same logits that chose its token, and so do a row's top log-probs (SGLang's
`top_logprobs_num`). A row with a vocabulary mask (constrained decoding) has every other token's
logit set to -inf first, as SGLang's grammar backend does, so its log-probs are of the masked
distribution.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import torch

GREEDY_EPS = 1e-6


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `sampling_params` of one /generate prompt; unknown fields are rejected."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    """The output must be one JSON document matching this schema (a JSON text, SGLang's field),
    then the end; the keywords `constrained.schema_node` enforces."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, object, bool, str]] = [
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 0, "must be >= 0"),
            ("temperature", self.temperature, self.temperature >= 0, "must be >= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("min_new_tokens", self.min_new_tokens, self.min_new_tokens >= 0, "must be >= 0"),
            ("n", self.n, self.n == 1, "only n=1 is supported; send the prompt n times"),
            ("frequency_penalty", self.frequency_penalty, self.frequency_penalty == 0, "is not supported"),
            ("presence_penalty", self.presence_penalty, self.presence_penalty == 0, "is not supported"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty == 1, "is not supported"),
        ]
        for name, value, ok, why in checks:
            if not ok:
                raise ValueError(f"sampling_params.{name}={value!r}: {why}")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(
                    f"sampling_params.json_schema={self.json_schema[:80]!r}: not JSON ({e})"
                ) from None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


def parse_sampling_params(raw: Any) -> SamplingParams:
    """Validate a JSON object into SamplingParams; ValueError names the field and value."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params={raw!r}: must be an object")
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"sampling_params: {e}") from e


class Choice(msgspec.Struct, kw_only=True):
    """The tokens picked for a batch, one per row, with what each row asked to be reported."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]
    """Per row: the `top_logprobs_num` most likely (log-prob, token id) pairs, or None."""


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    original_logprob: bool,
    *,
    masks: list[torch.Tensor | None] | None = None,
    top_logprobs: list[int] | None = None,
) -> Choice:
    """Pick one token per row of logits [B, V].

    `masks`: per row, a bool tensor [V] of the tokens it may take (None: any). `top_logprobs`:
    per row, how many of the most likely tokens to report beside the chosen one. Everything runs
    on the logits' device; the seeded draws come from the rows' (CPU) generators, so a seed picks
    the same uniform numbers on any device."""
    logits = logits.float()
    dev = logits.device
    if masks is not None and any(m is not None for m in masks):
        logits = logits.clone()
        for row, mask in enumerate(masks):
            if mask is not None:
                logits[row].masked_fill_(~mask.to(dev), float("-inf"))
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    greedy = [p.greedy for p in params]
    tokens = raw_logprobs.argmax(dim=-1).tolist()
    logprobs = raw_logprobs.gather(1, torch.tensor(tokens, device=dev).view(-1, 1)).view(-1).tolist()
    reported = raw_logprobs  # the distribution each row's log-probs are read from
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        temps = torch.tensor([params[i].temperature for i in sampled], device=dev).view(-1, 1)
        scaled = logits[idx] / temps
        report = raw_logprobs[idx] if original_logprob else torch.log_softmax(scaled, dim=-1)
        if not original_logprob and any(k > 0 for k in top_logprobs or ()):
            reported = raw_logprobs.clone()
            reported[idx] = report
        probs = torch.softmax(scaled, dim=-1)
        draws = torch.stack([torch.rand((), generator=generators[i]) for i in sampled]).view(-1, 1).to(dev)
        # A row that filters nothing (no top-k, top-p or min-p) draws over the vocabulary as it
        # is; only a filtering row needs its tokens in probability order. Which way a row goes
        # depends on its own parameters only, so its seed gives the same token in any batch.
        filtering = [_filters(params[i]) for i in sampled]
        if not any(filtering):
            chosen = _draw_unfiltered(probs, draws, sampled)
        elif all(filtering):
            chosen = _draw_filtered(probs, draws, [params[i] for i in sampled], sampled)
        else:
            chosen = torch.empty(len(sampled), dtype=torch.long, device=dev)
            plain = [row for row, f in enumerate(filtering) if not f]
            at = torch.tensor(plain, device=dev)
            chosen[at] = _draw_unfiltered(probs[at], draws[at], [sampled[r] for r in plain])
            kept = [row for row, f in enumerate(filtering) if f]
            at = torch.tensor(kept, device=dev)
            names = [sampled[r] for r in kept]
            chosen[at] = _draw_filtered(probs[at], draws[at], [params[i] for i in names], names)
        chosen_logprobs = report.gather(1, chosen.view(-1, 1)).view(-1)
        for i, token, logprob in zip(sampled, chosen.tolist(), chosen_logprobs.tolist(), strict=True):
            tokens[i] = token
            logprobs[i] = logprob
    top: list[list[tuple[float, int]] | None] = [None] * len(params)
    for i, k in enumerate(top_logprobs or []):
        if k > 0:
            values, ids = reported[i].topk(min(k, reported.shape[-1]))
            top[i] = list(zip(values.tolist(), ids.tolist(), strict=True))
    return Choice(tokens=tokens, logprobs=logprobs, top=top)


def _filters(p: SamplingParams) -> bool:
    """Whether the row keeps only part of the vocabulary (top-k, top-p or min-p)."""
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _check_finite(total: torch.Tensor, rows: list[int]) -> None:
    bad = ~(torch.isfinite(total) & (total > 0))
    if bool(bad.any()):  # non-finite logits (poisoned weights): no distribution to sample from
        named = [rows[int(r)] for r in torch.nonzero(bad).flatten()]
        raise ValueError(f"rows {named}: the sampling distribution is not finite (inf/NaN logits)")


def _draw_unfiltered(probs: torch.Tensor, draws: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Inverse-CDF sampling over each row's whole vocabulary: the token ids [n]."""
    cdf = probs.cumsum(dim=-1)
    _check_finite(cdf[:, -1], rows)
    position = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True).view(-1)
    # A draw lands on a token with probability > 0 (the CDF rises there), except when float
    # round-off puts it at the very top: then the last token with any probability is taken.
    over = position >= probs.shape[-1]
    if bool(over.any()):
        position[over] = (probs[over] > 0).cumsum(dim=-1).argmax(dim=-1)
    return position


def _draw_filtered(
    probs: torch.Tensor, draws: torch.Tensor, params: list[SamplingParams], rows: list[int]
) -> torch.Tensor:
    """Top-k, top-p and min-p filtering, then inverse-CDF sampling over the kept tokens in
    probability order: the token ids [n]."""
    dev = probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=dev).view(1, -1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev).view(-1, 1)
    min_p = torch.tensor([p.min_p for p in params], device=dev).view(-1, 1)
    # A token survives when it is inside top-k, inside the top-p nucleus (the mass before it
    # is below top_p) and at least min_p times the most likely token's probability.
    keep = (ranks < top_k.view(-1, 1)) & ((sorted_probs.cumsum(-1) - sorted_probs) < top_p)
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True
    kept = sorted_probs * keep
    cdf = kept.cumsum(dim=-1)
    _check_finite(cdf[:, -1], rows)
    position = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True)
    position = torch.minimum(position, keep.sum(dim=-1, keepdim=True) - 1)  # float round-off
    return order.gather(1, position).view(-1)

"""Next-token sampling for autoregressive phases: temperature, top-k, top-p, drawn with no host sync.

Model-independent: logits in, a token id out, inside a compiled (and CUDA-graph) decode step.
The caller owns the random numbers (its generator, its seed).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Sampling(NamedTuple):
    """How the next token is drawn (host values; `step_args` gives what a compiled step takes)."""

    temperature: float
    top_k: int
    top_p: float

    def candidates(self, vocab: int) -> int:
        """How many top logits a step sorts: top-k rounded up to a power of two (all of the
        vocabulary when top-k is off). The one static number of a sampling setting, so
        nearby top-k values share a compiled step; the exact k is a tensor."""
        if self.top_k <= 0 or self.top_k >= vocab:
            return vocab
        return min(vocab, 1 << (self.top_k - 1).bit_length())

    def step_args(self, vocab: int, device: torch.device) -> "SamplingArgs":
        # once per request: building tensors on the device from host numbers waits for it
        values = torch.tensor([self.temperature, self.top_p], dtype=torch.float32, device=device)
        return SamplingArgs(values[0], torch.tensor(self.top_k, device=device), values[1],
                            self.candidates(vocab), self.temperature > 0)


class SamplingArgs(NamedTuple):
    """`Sampling` as a compiled step takes it: tensors, so that a new temperature, top-k or
    top-p reuses the step's graph; `candidates` (static) is the sort width."""

    temperature: torch.Tensor      # 0-d float32
    top_k: torch.Tensor            # 0-d int64, <= 0: off
    top_p: torch.Tensor            # 0-d float32
    candidates: int
    draws: bool                    # False: greedy, the step takes no uniforms (static)


def sample_token(logits: torch.Tensor, uniform: torch.Tensor | None, temperature, top_k, top_p,
                 candidates: int | None = None) -> torch.Tensor:
    """The next token id (a 0-d int64 tensor on logits' device) from logits [V] float32.

    temperature, top_k, top_p: numbers or 0-d tensors. `uniform` None is greedy (argmax);
    so is a temperature <= 0. Otherwise the Gumbel-max trick: with u ~ U(0, 1) per
    vocabulary id (`uniform` [V], drawn by the caller from its generator), argmax(logits / T
    - log(-log u)) over the ids that top-k and top-p keep is a draw from softmax(logits / T)
    renormalised over those ids. No host sync and no random op inside, so it runs in the
    compiled (and CUDA-graph) decode step; the caller owns the seed. `candidates`: how many
    top logits to sort (static; at least top-k; `Sampling.candidates` by default).
    """
    greedy = torch.argmax(logits)
    if uniform is None:
        return greedy
    vocab = logits.shape[-1]
    if candidates is None:
        candidates = Sampling(0.0, int(top_k), 1.0).candidates(vocab)
    t, k, p = (torch.as_tensor(x, device=logits.device) for x in (temperature, top_k, top_p))
    scaled = logits / torch.where(t > 0, t, torch.ones_like(t))
    # Descending: the top-k cut and the top-p cut are prefixes of the sorted candidates.
    values, ids = torch.topk(scaled, candidates)
    rank = torch.arange(candidates, device=logits.device)
    keep = (k <= 0) | (rank < k)
    values = values.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    keep = keep & ((torch.cumsum(probs, dim=-1) - probs < p) | (p >= 1.0))   # always keeps the top token
    values = values.masked_fill(~keep, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform[ids]))
    # gather, not ids[argmax]: indexing by a tensor value would need it on the host.
    sampled = ids.gather(0, torch.argmax(values + gumbel, dim=0, keepdim=True)).squeeze(0)
    return torch.where(t > 0, sampled, greedy)

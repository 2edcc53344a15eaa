"""A mixture-of-experts MLP for the llama family (`model.moe`), and what its router logs.

Each token's hidden state goes to a linear router; a softmax over `experts` gives its
probabilities, the `top_k` largest are kept and renormalised to sum to 1 (Mixtral's rule,
so export to `MixtralForCausalLM` is a renaming); the token's output is the weighted sum
of those experts' SwiGLU outputs. The experts live fused, as transformers keeps them:
`gate_up` [E, 2I, d] and `down` [E, d, I].

Dropless by default: every (token, expert) pair is computed, however skewed. With
`capacity_factor` f an expert takes at most ceil(f·N·k/E) of the N·k pairs, first choices
before second ones (GShard's priority), and a dropped pair contributes nothing (its token
keeps its residual).

Never a hang: every expert's matmul runs on every forward, an empty slice when it got
no token, so every expert parameter has a gradient (zeros) on every rank and ZeRO's
per-parameter reductions are issued identically whatever the routing. Under expert
parallelism (`expert_parallel` P) each rank holds E/P of the experts and the pairs travel
to them and back by all-to-all (models/moe_parallel.py).

Router losses, added to the training loss by the model (mean over layers, coefficient
times): the load-balancing loss E·Σ_e f_e·P_e (f_e: share of the pairs routed to e, P_e:
mean router probability of e; 1 when balanced) and the z-loss mean(logsumexp(logits)²).
Per-expert token counts, drops and the two losses accumulate in `stats` until the loop
logs them (`take_stats`); a recompute under activation checkpointing does not count twice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.config import ModelConfig
from zerotrain.models.moe_parallel import dispatch, ep_slot


def _recomputing() -> bool:
    """Inside backward (an activation-checkpointing recompute), not a forward of its own."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Experts(nn.Module):
    """E SwiGLU MLPs, fused: tokens arrive sorted by expert, `counts[e]` of them each.

    Under expert parallelism (`parallel` P > 1) this rank holds experts
    [first, first + n/P) of the layer's n (models/moe_parallel.py)."""

    def __init__(self, n: int, d: int, inner: int, parallel: int = 1):
        super().__init__()
        local = n // parallel
        self.total, self.expert_parallel = n, parallel
        self.first = ep_slot(parallel) * local
        self.gate_up = nn.Parameter(torch.empty(local, 2 * inner, d))
        self.down = nn.Parameter(torch.empty(local, d, inner))

    def forward(self, xs: Tensor, counts: list[int]) -> Tensor:
        outs, a = [], 0
        for e, c in enumerate(counts):  # every expert, an empty one too (see the module doc)
            gate, up = F.linear(xs[a:a + c], self.gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down[e]))
            a += c
        return torch.cat(outs)


class MoE(nn.Module):
    """Router + experts in place of a block's SwiGLU (same input and output shapes)."""

    position_wise = False  # the router's losses and capacity see all tokens together

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None and cfg.n_embd and cfg.intermediate_size
        m = cfg.moe
        self.n, self.k, self.capacity_factor = m.experts, m.top_k, m.capacity_factor
        self.aux_coef, self.z_coef = m.aux_loss, m.z_loss
        self.router = nn.Linear(cfg.n_embd, m.experts, bias=False)
        self.experts = Experts(m.experts, cfg.n_embd, cfg.intermediate_size,
                               m.expert_parallel)
        self.aux: Tensor | None = None  # this forward's weighted router loss (training)
        self.stats: Tensor | None = None  # [counts(E), dropped, aux, z, forwards], summed

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(expert, token, weight) of each kept (token, expert) pair, pairs ordered by
        expert; and the pairs routed to each expert before any drop."""
        N = logits.shape[0]
        w, idx = logits.softmax(-1).topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        expert = idx.t().reshape(-1)  # choice-major: every first choice, then the second
        token = torch.arange(N, device=logits.device).repeat(self.k)
        weight = w.t().reshape(-1)
        routed = torch.bincount(expert, minlength=self.n)
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * N * self.k / self.n)
            slot = F.one_hot(expert, self.n).cumsum(0).gather(1, expert[:, None])[:, 0] - 1
            keep = slot < cap
            expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert, stable=True)
        return expert[order], token[order], weight[order], routed

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.router(h).float()
        expert, token, weight, routed = self.route(logits)
        counts = torch.bincount(expert, minlength=self.n)
        if self.experts.expert_parallel > 1:  # to the experts' ranks and back
            ys = dispatch(self.experts, h[token], counts)
        else:
            ys = self.experts(h[token], counts.tolist())
        y = torch.zeros_like(h).index_add_(0, token, ys * weight[:, None].to(ys.dtype))
        if self.training:  # also in a recompute: checkpointing wants the same graph
            self._router_losses(logits, routed, counts)
        return y.view(shape)

    def _router_losses(self, logits: Tensor, routed: Tensor, counts: Tensor) -> None:
        N = logits.shape[0]
        if N == 0:  # no token: no loss, but still a graph through the router
            aux = z = logits.sum()
        else:
            f = routed.float() / (N * self.k)
            aux = self.n * (f * logits.softmax(-1).mean(0)).sum()
            z = torch.logsumexp(logits, -1).pow(2).mean()
        weighted = self.aux_coef * aux + self.z_coef * z
        if _recomputing():  # its loss and counts belong to the forward it repeats
            return
        self.aux = weighted
        dropped = (routed.sum() - counts.sum()).reshape(1).float()
        row = torch.cat([counts.float(), dropped, aux.detach().reshape(1),
                         z.detach().reshape(1), torch.ones(1, device=logits.device)])
        self.stats = row if self.stats is None else self.stats + row


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def router_loss(model: nn.Module) -> Tensor | None:
    """The mean over layers of this forward's weighted router losses (taken: each is
    added to one loss only)."""
    terms = []
    for m in moe_layers(model):
        if m.aux is not None:
            terms.append(m.aux)
            m.aux = None
    return torch.stack(terms).mean() if terms else None


def take_stats(model: nn.Module) -> Tensor | None:
    """[layers, E + 4] router statistics since the last call (then reset); None for a
    model without MoE layers or before its first training forward."""
    layers = moe_layers(model)
    if not layers or any(m.stats is None for m in layers):
        return None
    out = torch.stack([m.stats for m in layers])  # type: ignore[misc]
    for m in layers:
        m.stats = None
    return out


def active_numel(model: nn.Module, experts: int, top_k: int) -> int:
    """Parameters one token uses: an experts module's tensors ([E, ...]) count top_k/E."""
    total = 0
    for name, p in model.named_parameters():
        fused = ".experts." in f".{name}" and p.ndim >= 1 and p.shape[0] == experts
        total += p.numel() * top_k // experts if fused else p.numel()
    return total


def stats_record(stats: Tensor) -> dict:
    """The logged `moe` record of summed [layers, E + 4] statistics (over ranks too):
    tokens per expert per layer, dropped pairs, the mean losses, and the imbalance
    (the busiest expert's tokens over the mean, worst layer; 1.0 is perfect balance)."""
    counts, dropped = stats[:, :-4], stats[:, -4]
    forwards = stats[:, -1].clamp(min=1)
    mean = counts.mean(1).clamp(min=1e-9)
    return {"tokens_per_expert": counts.long().tolist(),
            "dropped": int(dropped.sum()),
            "aux_loss": float((stats[:, -3] / forwards).mean()),
            "z_loss": float((stats[:, -2] / forwards).mean()),
            "imbalance": float((counts.max(1).values / mean).max())}

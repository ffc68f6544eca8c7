"""The output layer only where a loss reads it.

A causal LM's last matmul, ``hidden (B, T, h) @ W (h, V)``, and the log-softmax over its ``V`` logits are most of
a small model's training arithmetic and memory traffic, and every RLHF loss reads only some positions: the answer
tokens (SFT's labels, DPO's answers, the policy-gradient algorithms' action mask), never the prompt or the
padding. ``selected_logits`` runs the model as usual (its engine's forward, so ZeRO-3's parameter hooks, LoRA and
gradient checkpointing behave as ever) but hands the output layer only the hidden states at the chosen positions:
a forward pre-hook on the model's output embedding, removed afterwards. The logits there are the same numbers as
the full ``(B, T, V)`` logits at those positions (the same row of the same product).

Models without ``get_output_embeddings`` (or whose forward does not call the module it names) get the full logits,
indexed afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dschat.losses import selective_log_softmax
from dschat.utils import unwrap


def output_layer(model: Any) -> torch.nn.Module | None:
    """The LM head of ``model`` (a module or a DeepSpeed engine), or None when it does not say."""
    module = unwrap(model)
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def selected_logits(model: Any, rows: torch.Tensor, cols: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """The logits ``(N, V)`` of ``model(**inputs)`` at positions ``(rows[i], cols[i])``, computing the output
    layer at those positions only. ``inputs`` are the model's (``input_ids``, ``attention_mask``, ...)."""
    head = output_layer(model)
    if head is None:
        return model(**inputs, use_cache=False).logits[rows, cols]

    fired = []

    def select(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        fired.append(True)
        return (args[0][rows, cols], *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        logits = model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    # a model whose forward does not call the module it names as its output embedding gave every position
    return logits if fired else logits[rows, cols]


def token_logps(model: Any, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor,
                temperature: float = 1.0, **inputs: Any) -> torch.Tensor:
    """``log p(targets[i])`` ``(N,)`` float32 under ``softmax(logits / temperature)`` at positions
    ``(rows[i], cols[i])`` (the position before each target token)."""
    logits = selected_logits(model, rows, cols, **inputs).float()
    if temperature != 1.0:
        logits = logits / temperature
    return selective_log_softmax(logits, targets)


def causal_lm_loss(model: Any, labels: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not -100 (``labels (B, T)`` aligned with the input:
    position ``t``'s logits predict ``labels[t + 1]``), as transformers' causal-LM loss computes it, with the
    output layer run only at those positions. Mixture-of-experts models that add their router's auxiliary loss
    (``output_router_logits``) get transformers' loss, which includes it."""
    module = unwrap(model)
    if getattr(getattr(module, "config", None), "output_router_logits", False):
        return model(**inputs, labels=labels, use_cache=False).loss
    rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    logits = selected_logits(model, rows, cols, **inputs).float()
    return F.cross_entropy(logits, labels[rows, cols + 1])

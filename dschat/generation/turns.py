"""Episodes on a backend that samples whole answers (HF ``generate``, vLLM): turn by turn.

dschat's own decode loop drives episodes token by token (``dschat.agents.episode.Episodes.advance``). A backend
that takes a batch of prompts and returns finished answers cannot be stopped at a call, so here each round samples every
unfinished row's continuation from its whole prefix (the prompt and the episode so far), keeps it up to the row's
first turn boundary (a call that closes, or EOS; what was sampled after it is dropped: it was drawn without the
tool's answer), and feeds the kept tokens to the same driver (``Episodes.step_row``), which runs the tool and
appends its result or the environment's observation. The next round samples again from the longer prefixes. The
tokens, masks, texts and counts are those of the decode loop's episodes; the prefix is recomputed each round (vLLM's
prefix cache keeps it), and a round waits for its rows' tools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dschat.generation.decode import Generated, GenerationConfig, OnToken, Prompts

if TYPE_CHECKING:
    from dschat.agents.episode import Episodes

Sample = Callable[[torch.Tensor, torch.Tensor, GenerationConfig], Generated]


def generate_by_turns(sample: Sample, prompts: Prompts, config: GenerationConfig, episodes: Episodes,
                      on_token: OnToken | None = None) -> Generated:
    """A batch of episodes through ``sample(prompts, mask, config)`` (left-padded prompts in, whole answers out),
    within ``config.max_new_tokens`` columns per row. Returns what the decode loop's episodes return: the
    sequences, the policy and real-token masks, and (from vLLM) the engine's log-probs of the policy's tokens.
    ``on_token`` sees each kept token of the policy's as the round's answers are read, row by row (the other rows'
    columns padding); where it stops, every row stops there."""
    prompt, prompt_mask, pad_token_id = prompts.ids, prompts.mask, prompts.pad_token_id
    B, N, dev = prompt.shape[0], config.max_new_tokens, prompt.device
    base = replace(config, logprobs=False)
    rows: list[list[tuple[int, bool, bool, float]]] = [[] for _ in range(B)]  # (token, real, policy, engine logp)
    prompt_rows = [p[m.bool()].tolist() for p, m in zip(prompt, prompt_mask, strict=True)]
    episodes.start()
    done = [False] * B

    def settle(i: int) -> None:
        """Feed row ``i``'s forced tokens (a result, an observation) until the policy's turn or the end."""
        while not done[i] and len(rows[i]) < N and not episodes.sampling(i):
            tok, real, policy, finished = episodes.step_row(i, pad_token_id, block=True)
            if finished:
                done[i] = True
                break
            rows[i].append((tok, real, policy, 0.0))

    def stopped(i: int, tok: int, policy: bool) -> bool:
        """Row ``i``'s kept token through ``on_token`` (the other rows' columns are padding, not the policy's)."""
        if on_token is None:
            return False
        tokens = torch.full((B,), pad_token_id, dtype=prompt.dtype)
        own = torch.zeros(B, dtype=torch.bool)
        tokens[i], own[i] = tok, policy
        return bool(on_token(tokens, own))

    for i in range(B):
        settle(i)
    while True:
        active = [i for i in range(B) if not done[i] and len(rows[i]) < N]
        if not active:
            break
        ids = [prompt_rows[i] + [t for t, real, _, _ in rows[i] if real] for i in active]
        width = max(len(x) for x in ids)
        batch = torch.full((len(active), width), pad_token_id, dtype=prompt.dtype, device=dev)
        mask = torch.zeros((len(active), width), dtype=prompt_mask.dtype, device=dev)
        for k, x in enumerate(ids):
            batch[k, width - len(x):] = torch.tensor(x, dtype=prompt.dtype, device=dev)
            mask[k, width - len(x):] = 1
        budget = max(N - len(rows[i]) for i in active)
        out = sample(batch, mask, replace(base, max_new_tokens=budget))
        new = out.sequences[:, width:].tolist()
        engine = out.engine_logprobs.tolist() if out.engine_logprobs is not None else None
        stop = False
        for k, i in enumerate(active):
            for j, tok in enumerate(new[k]):
                if len(rows[i]) >= N:
                    break
                tok, real, policy, finished = episodes.step_row(i, tok, block=True)
                if finished and not policy:
                    done[i] = True
                    break
                rows[i].append((tok, real, policy, engine[k][j] if engine is not None and policy else 0.0))
                stop = stopped(i, tok, policy)
                if stop:
                    break
                if finished:
                    done[i] = True
                    break
                if not episodes.sampling(i):  # a turn boundary: the rest was sampled without what answers it
                    break
            else:
                if len(rows[i]) < N and episodes.sampling(i) and not new[k]:
                    done[i] = True  # the backend wrote nothing more: nothing will change next round
            if stop:
                break
        if stop:
            break
        for i in active:  # the round's calls run side by side; then each row's result or observation
            settle(i)
    width = max(1, max(len(r) for r in rows))
    tokens = torch.full((B, width), pad_token_id, dtype=prompt.dtype, device=dev)
    real_mask = torch.zeros((B, width), dtype=torch.bool, device=dev)
    policy_mask = torch.zeros((B, width), dtype=torch.bool, device=dev)
    engine_logprobs = torch.zeros((B, width), dtype=torch.float32, device=dev)
    for i, r in enumerate(rows):
        for j, (tok, real, policy, lp) in enumerate(r):
            tokens[i, j], real_mask[i, j], policy_mask[i, j], engine_logprobs[i, j] = tok, real, policy, lp
    return Generated(torch.cat([prompt, tokens], dim=1), None,
                     engine_logprobs if any(x for r in rows for *_, x in r) else None,
                     policy_mask=policy_mask, real_mask=real_mask)

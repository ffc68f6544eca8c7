"""Rollouts: what the actor generated for a batch of prompts, and the per-token quantities every algorithm reads.

Layout of a rollout: prompts are left-padded to ``P`` columns, so every answer starts at column ``P``::

    sequences       (B, P + A)   prompt | answer (padding after the first EOS)
    attention_mask  (B, P + A)   prompt mask | action_mask
    action_mask     (B, A)       1 on answer tokens up to and including the first EOS

Log-probs and values are aligned with the answer tokens, ``(B, A)``: the log-prob of answer token ``t`` comes
from the logits at column ``P + t - 1``; the value of the state before token ``t`` likewise. A rollout may carry
the log-probs its generation computed (``logprobs``: fp32 actors, dschat's decode loop); ``behaviour_logprobs``
uses them instead of a second actor forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dschat.agents.episode import EpisodeInfo, Episodes
from dschat.data.packing import (
    attention_balance,
    layout_attention,
    layout_window,
    prompt_ids,
    shared_prefix_mask,
    shared_prompt_groups,
)
from dschat.generation.decode import Generated, GenerationConfig, decode_answers
from dschat.generation.hybrid_engine import HybridEngine
from dschat.models.logits import token_logps
from dschat.training import memory, oom


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    reached_eos: torch.Tensor  # (B,) bool
    logprobs: torch.Tensor | None = None  # (B, A) the sampling pass's log-probs of the answer tokens, if known
    # (B, A) the behaviour policy's log-probs of the answer tokens, where another engine sampled them (vLLM, or an
    # asynchronous sampler with older weights), for the importance-sampling correction only
    engine_logprobs: torch.Tensor | None = None
    # episodes with tools or environments (``dschat.agents``): each row's text, environment reward and counts; the
    # answer columns then hold context tokens too (in the attention mask, not in the action mask)
    episode: EpisodeInfo | None = None
    behaviour: str = "vllm"  # what sampled, where engine_logprobs are set: the correction's metrics' prefix

    @property
    def answer_lengths(self) -> torch.Tensor:
        return self.action_mask.sum(-1)

    def select(self, idx: torch.Tensor) -> Rollout:
        return Rollout(self.sequences[idx], self.attention_mask[idx], self.action_mask[idx], self.prompt_len,
                       self.reached_eos[idx], None if self.logprobs is None else self.logprobs[idx],
                       None if self.engine_logprobs is None else self.engine_logprobs[idx],
                       None if self.episode is None else self.episode.select(idx), self.behaviour)


def make_episode_rollout(prompt: torch.Tensor, prompt_mask: torch.Tensor, out: Generated, episodes: Any,
                         pad_token_id: int, min_answer_len: int = 2, behaviour: str = "vllm") -> tuple[Rollout, int]:
    """The rollout of a batch of episodes (``dschat.agents.episode``): the action mask holds the policy's own
    tokens alone, the attention mask every token fed (tool results and observations too, as context), and the
    columns of a row waiting on a tool or past its end are padding outside both. An episode whose policy wrote
    fewer than ``min_answer_len`` tokens gets an all-zero action mask. ``reached_eos``: the episode ended (by the
    policy or its environment), not by the token budget or ``--max-turns``."""
    assert out.policy_mask is not None and out.real_mask is not None
    P = prompt.shape[1]
    real = out.real_mask.bool()
    action_mask = out.policy_mask.long() & real.long()
    short = action_mask.sum(-1) < min_answer_len
    action_mask[short] = 0
    answer = out.sequences[:, P:].masked_fill(~real, pad_token_id)
    logprobs = None if out.logprobs is None else out.logprobs.float().masked_fill(action_mask == 0, 0.0)
    engine = None if out.engine_logprobs is None else out.engine_logprobs.float().masked_fill(action_mask == 0, 0.0)
    reached = torch.tensor(episodes.finished(), dtype=torch.bool, device=prompt.device)
    rollout = Rollout(torch.cat([prompt, answer], dim=1), torch.cat([prompt_mask.long(), real.long()], dim=1),
                      action_mask, P, reached, logprobs, engine, episodes.info(answer, real), behaviour)
    return rollout, int(short.sum())


def make_rollout(prompt: torch.Tensor, prompt_mask: torch.Tensor, sequences: torch.Tensor, eos_token_id: int,
                 pad_token_id: int, min_answer_len: int = 2,
                 logprobs: torch.Tensor | None = None,
                 engine_logprobs: torch.Tensor | None = None, behaviour: str = "vllm") -> tuple[Rollout, int]:
    """Mask everything after each answer's first EOS; answers shorter than ``min_answer_len`` get an all-zero
    action mask (dropped from every loss and count) rather than removed, so batch shapes stay equal on all
    ranks. Returns the rollout and the number of answers dropped."""
    P = prompt.shape[1]
    answer = sequences[:, P:]
    is_eos = answer == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    action_mask = (~after_eos).long()
    reached_eos = is_eos.any(-1)
    short = action_mask.sum(-1) < min_answer_len
    action_mask[short] = 0
    answer = answer.masked_fill(after_eos, pad_token_id)
    seq = torch.cat([prompt, answer], dim=1)
    mask = torch.cat([prompt_mask.long(), action_mask], dim=1)
    if logprobs is not None:
        logprobs = logprobs.float().masked_fill(action_mask == 0, 0.0)  # 0 where masked, as answer_logprobs gives
    if engine_logprobs is not None:
        engine_logprobs = engine_logprobs.float().masked_fill(action_mask == 0, 0.0)
    return Rollout(seq, mask, action_mask, P, reached_eos, logprobs, engine_logprobs, None, behaviour), \
        int(short.sum())


def by_halves(site: str, model: Any, rollout: Rollout, forward: Any) -> torch.Tensor:
    """``forward(rollout)`` ``(B, ...)``; without gradient, a forward that runs out of memory runs on the halves of
    the rows instead (``dschat.training.oom``; the rows' results do not depend on the rows beside them). With
    gradient (training) the error goes on: a training micro-batch stops the run."""
    if torch.is_grad_enabled():
        return forward(rollout)
    rows, dev = rollout.sequences.shape[0], rollout.sequences.device

    def run(a: int, b: int) -> torch.Tensor:
        return forward(rollout if (a, b) == (0, rows) else rollout.select(torch.arange(a, b, device=dev)))

    return oom.split_on_oom(site, rows, run, torch.cat, local=oom.rank_local(model))


def answer_logprobs(model: Any, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``(B, A)`` float32 of the answer tokens under ``model`` (an engine or a module); 0 where the
    action mask is 0 (the output layer runs only on answer tokens: ``dschat.models.logits``). Rows with the same prompt
    (a group's completions) run with that prompt once where it pays (``shared_prompt_inputs``). Without gradient,
    split in halves on out of memory (``by_halves``)."""
    return by_halves("experience", model, rollout, lambda r: _answer_logprobs(model, r, temperature))


def _answer_logprobs(model: Any, rollout: Rollout, temperature: float) -> torch.Tensor:
    rows, t = rollout.action_mask.nonzero(as_tuple=True)
    P = rollout.prompt_len
    shared = shared_prompt_inputs(model, rollout)
    if shared is None:
        inputs = {"input_ids": rollout.sequences, "attention_mask": rollout.attention_mask,
                  "position_ids": positions_from_mask(rollout.attention_mask)}
        at = (rows, P - 1 + t)
    else:
        inputs, flat_of = shared
        flat, width = flat_of[rows, P - 1 + t], inputs["input_ids"].shape[1]  # the predicting position's place
        at = (flat // width, flat % width)
    logps = token_logps(model, at[0], at[1], rollout.sequences[rows, P + t], temperature, **inputs)
    out = torch.zeros(rollout.action_mask.shape, dtype=logps.dtype, device=logps.device)
    return out.index_put((rows, t), logps)


def shared_prompt_inputs(model: Any, rollout: Rollout) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """The rollout's rows laid out with each prompt once: rows with the same prompt (GRPO's G completions, in
    whatever order a shuffled minibatch holds them) share one sequence, the prompt's real tokens then each row's
    answer tokens (action mask), each answer attending to the prompt and to itself at its own row's positions
    (``packing.shared_prefix_mask``), so every answer token's logits are those of its own row. How many rows a
    sequence takes is ``packing.shared_prompt_groups``'s choice: the fewest forward FLOPs for the padded batch
    (linear maps per token, dense attention per token and key), so long answers after a short prompt stay apart.
    Returns the model's inputs and ``flat_of`` ``(B, P + A)``: each real token's flat position in the layout; None
    when no two rows share a sequence or the model cannot take the layout (see ``packing.shared_prefix_inputs``)."""
    seq, P, B = rollout.sequences, rollout.prompt_len, rollout.sequences.shape[0]
    prompt, prompt_mask = seq[:, :P], rollout.attention_mask[:, :P]
    if B < 2 or P == 0 or rollout.episode is not None:  # episodes: context tokens between the policy's
        return None
    same_prompt = prompt_ids(prompt, prompt_mask)
    if int(same_prompt.max()) + 1 == B:  # every prompt once
        return None
    p_len, a_len = prompt_mask.sum(-1).tolist(), rollout.action_mask.sum(-1).tolist()
    if min(p_len) == 0:
        return None
    rows_of: dict[int, list[int]] = {}
    for r, u in enumerate(same_prompt.tolist()):
        rows_of.setdefault(u, []).append(r)
    groups = shared_prompt_groups(list(rows_of.values()), p_len, a_len, attention_balance(model), seq.shape[1],
                                  max_width=layout_window(model))
    if groups is None:
        return None
    W = max(p_len[g[0]] + sum(a_len[r] for r in g) for g in groups)
    attention = layout_attention(model, W)
    if attention is None:
        return None
    dev = seq.device
    ids = torch.zeros(len(groups), W, dtype=seq.dtype, device=dev)
    pos = torch.zeros(len(groups), W, dtype=torch.long, device=dev)
    part = torch.full((len(groups), W), -1, dtype=torch.long, device=dev)
    flat_of = torch.zeros(seq.shape, dtype=torch.long, device=dev)
    for s, g in enumerate(groups):
        p = p_len[g[0]]
        ids[s, :p], pos[s, :p], part[s, :p] = prompt[g[0], P - p:], torch.arange(p, device=dev), 0
        at = p
        for j, r in enumerate(g):
            a = a_len[r]
            ids[s, at: at + a] = seq[r, P: P + a]
            pos[s, at: at + a] = torch.arange(p, p + a, device=dev)
            part[s, at: at + a] = j + 1
            flat_of[r, P - p: P] = s * W + torch.arange(p, device=dev)
            flat_of[r, P: P + a] = s * W + at + torch.arange(a, device=dev)
            at += a
    return {"input_ids": ids, "position_ids": pos,
            "attention_mask": shared_prefix_mask(part, *attention)}, flat_of


def behaviour_logprobs(model: Any, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """The sampling policy's log-probs of the answer tokens (PPO's and GRPO's "old" log-probs): those the
    generation pass computed when it did, else a forward pass of ``model`` (the actor, in eval mode)."""
    if rollout.logprobs is not None:
        return rollout.logprobs
    return answer_logprobs(model, rollout, temperature)


def importance_weights(rollout: Rollout, trainer_logprobs: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance weights for answers another engine sampled: a serving engine (vLLM,
    docs/generation.md) or an asynchronous sampler holding older weights (the decoupled loss).

    The behaviour policy ``mu`` that sampled (``rollout.engine_logprobs``) is not exactly the policy ``p`` the loss
    takes the samples to come from (``trainer_logprobs``: the trainer's log-probs before the update, the proximal
    policy): other kernels, other precision, or older weights. Weighing each token's policy loss by
    ``w_t = min(exp(log p_t - log mu_t), cap)`` (``token``), or each answer's by
    ``min(exp(sum_t (log p_t - log mu_t)), cap)`` (``sequence``), corrects the gradient toward ``p``'s, with the
    truncation bounding the variance (Yao et al. 2025, truncated importance sampling; with the loss's own ratio
    against ``p`` this is the decoupled PPO objective of Hilton et al. 2022).

    Args:
        rollout: with ``engine_logprobs`` ``(B, A)``; without them (the trainer's own samples) there is no gap:
            ``None``.
        trainer_logprobs: ``(B, A)`` the trainer's log-probs of the same tokens under the proximal policy.
        mode: ``none | token | sequence``.

    Returns:
        ``(B, A)`` weights (1 off the action mask) or None, and the gap's metrics under ``rollout.behaviour``
        (``vllm/*`` or ``async/*``: the mean and largest absolute log-prob gap, the behaviour-to-proximal KL as
        the k3 estimate ``exp(d) - 1 - d`` with ``d = log p - log mu`` averaged over answer tokens, and with
        weights their mean and the share truncated at ``cap``), logged whether or not the weights are used.
    """
    q = rollout.engine_logprobs
    if q is None:
        return None, {}
    mask = rollout.action_mask.bool()
    gap = (trainer_logprobs.detach().float() - q.to(trainer_logprobs.device)).masked_fill(~mask, 0.0)
    n = mask.sum().clamp(min=1)
    at = rollout.behaviour
    stats = {f"{at}/logprob_diff_mean": float(gap.abs().sum() / n), f"{at}/logprob_diff_max": float(gap.abs().max()),
             f"{at}/kl_behaviour_prox": float((torch.expm1(gap) - gap).sum() / n)}
    if mode == "none":
        return None, stats
    if mode == "token":
        raw = torch.exp(gap)
    elif mode == "sequence":
        raw = torch.exp(gap.sum(-1, keepdim=True)).expand_as(gap)
    else:
        raise ValueError(f"unknown importance sampling mode {mode!r}")
    weights = raw.clamp(max=cap).masked_fill(~mask, 1.0)
    stats.update({f"{at}/is_weight_mean": float(weights[mask].mean()) if mask.any() else 1.0,
                  f"{at}/is_truncated_frac": float((raw[mask] > cap).float().mean()) if mask.any() else 0.0})
    return weights, stats


def answer_values(critic: Any, rollout: Rollout) -> torch.Tensor:
    """Critic values ``(B, A)`` of the state before each answer token (without gradient, split in halves on out of
    memory: ``by_halves``)."""
    def forward(r: Rollout) -> torch.Tensor:
        values = critic(r.sequences, r.attention_mask, positions_from_mask(r.attention_mask))
        return values[:, r.prompt_len - 1: -1]

    return by_halves("experience", critic, rollout, forward)


def generate_rollout(hybrid: HybridEngine, tokenizer: Any, batch: dict[str, Any], gen: GenerationConfig,
                     seed: int | None = None, min_answer_len: int = 2) -> tuple[Rollout, int]:
    """Sample answers for a batch of left-padded prompts through the hybrid engine and mask them; every
    algorithm's rollouts and evaluation come from here (the ``generate`` phase of ``memory``). With the hybrid
    engine's ``agent`` (tools, environments) every batch is a batch of episodes, whose counts go to the agent.

    A generation that runs out of memory samples the halves of the batch instead (``dschat.training.oom``), their
    rollouts joined in the batch's order (answers right-padded to the longer half's). Greedy answers are those
    of the whole batch; sampled ones are drawn afresh for each half, from the same distribution, but not the same
    draws: the sampler's random stream is consumed per batch (docs/planning.md, Out of memory)."""
    prompt, mask = batch["prompt"], batch["prompt_att_mask"]
    agent = hybrid.agent
    rows = episode_rows(tokenizer, batch) if agent is not None else []

    def run(a: int, b: int) -> tuple[Rollout, int]:
        p, m = (prompt, mask) if (a, b) == (0, prompt.shape[0]) else (prompt[a:b], mask[a:b])
        if agent is not None:  # a batch of episodes: tools and environments answer as it samples
            eos = hybrid.eos_token_id if isinstance(hybrid.eos_token_id, list) else [hybrid.eos_token_id]
            episodes = Episodes(agent, tokenizer, rows[a:b], eos, tokenizer.pad_token_id)
            out = hybrid.sample(p, m, gen, generator_seed=seed, episodes=episodes)
            assert out.real_mask is not None and out.policy_mask is not None
            agent.counts += episodes.counts(out.real_mask, out.policy_mask)
            return make_episode_rollout(p, m, out, episodes, tokenizer.pad_token_id, min_answer_len,
                                        getattr(hybrid, "behaviour", "vllm"))
        out = hybrid.sample(p, m, gen, generator_seed=seed)
        return make_rollout(p, m, out.sequences, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            min_answer_len=min_answer_len, logprobs=out.logprobs, engine_logprobs=out.engine_logprobs,
                            behaviour=getattr(hybrid, "behaviour", "vllm"))

    def join(parts: list[tuple[Rollout, int]]) -> tuple[Rollout, int]:
        return concat_rollouts([r for r, _ in parts], tokenizer.pad_token_id), sum(d for _, d in parts)

    with memory.phase("generate"):
        return oom.split_on_oom("generate", prompt.shape[0], run, join,
                                local=oom.rank_local(getattr(hybrid, "actor", None)))


def episode_rows(tokenizer: Any, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt's data row, what an environment starts its episode from: the row's fields, its ``answer`` and
    its ``prompt`` (decoded, special tokens dropped)."""
    prompts = tokenizer.batch_decode([p[m.bool()] for p, m in zip(batch["prompt"].cpu(),
                                                                    batch["prompt_att_mask"].cpu(), strict=True)],
                                     skip_special_tokens=True)
    n = len(prompts)
    extras = batch.get("extra") or [{} for _ in range(n)]
    answers = batch.get("answer") or [None] * n
    return [{**e, "prompt": p, "answer": a} for e, p, a in zip(extras, prompts, answers, strict=True)]


def repeat_prompts(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """Every prompt (and its row fields) ``n`` times in a row, so the completions of a prompt are consecutive:
    the layout group estimators (``L.group_advantages``, ``L.dynamic_sampling_mask``) expect."""
    out = {"prompt": batch["prompt"].repeat_interleave(n, 0),
           "prompt_att_mask": batch["prompt_att_mask"].repeat_interleave(n, 0)}
    for key in ("answer", "extra"):
        if key in batch:
            out[key] = [x for x in batch[key] for _ in range(n)]
    return out


def pad_right(t: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts whose prompt/answer widths differ (prompts padded left, answers right)."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_len for r in parts)
    A = max(r.action_mask.shape[1] for r in parts)
    seq, mask, amask = [], [], []
    logps = [pad_right(r.logprobs, A, 0.0) for r in parts if r.logprobs is not None]
    engine = [pad_right(r.engine_logprobs, A, 0.0) for r in parts if r.engine_logprobs is not None]
    for r in parts:
        lp, ra = P - r.prompt_len, A - r.action_mask.shape[1]
        seq.append(torch.nn.functional.pad(r.sequences, (lp, ra), value=pad_token_id))
        mask.append(torch.nn.functional.pad(r.attention_mask, (lp, ra), value=0))
        amask.append(pad_right(r.action_mask, A, 0))
    episodes = [r.episode for r in parts if r.episode is not None]
    return Rollout(torch.cat(seq), torch.cat(mask), torch.cat(amask), P, torch.cat([r.reached_eos for r in parts]),
                   torch.cat(logps) if len(logps) == len(parts) else None,
                   torch.cat(engine) if len(engine) == len(parts) else None,
                   EpisodeInfo.concat(episodes) if len(episodes) == len(parts) else None, parts[0].behaviour)


def completion_texts(tokenizer: Any, rollout: Rollout, prompt_mask: torch.Tensor) -> tuple[list[str], list[str],
                                                                                           list[int]]:
    """Decoded prompts and completions (special tokens dropped) and completion lengths in tokens, EOS included.

    Read from the sequences, not the action mask: a short or truncated answer whose mask was zeroed still has
    text for the rule rewards.
    """
    P = rollout.prompt_len
    prompts = tokenizer.batch_decode([row[m.bool()] for row, m in zip(rollout.sequences[:, :P].cpu(),
                                                                       prompt_mask.cpu(), strict=True)],
                                     skip_special_tokens=True)
    if rollout.episode is not None:  # the whole episode: calls, results, observations and answers
        return prompts, list(rollout.episode.texts), list(rollout.episode.lengths)
    completions, lengths = decode_answers(tokenizer, rollout.sequences[:, P:])
    return prompts, completions, lengths

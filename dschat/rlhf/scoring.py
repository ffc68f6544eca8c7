"""What a rollout earns: the reward model's end score (re-tokenized for it when its tokenizer differs) and the
rule, judge and user reward functions, mixed by weight (docs/algorithms.md, PPO and Rule rewards)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dschat.data.collators import pad_sequences
from dschat.data.usertext import reencode_for_reward
from dschat.losses import end_indices
from dschat.models.loading import same_tokenizer
from dschat.rewards.functions import RM, MixedRewards, RewardMixer, get_reward_func, parse_weights
from dschat.rewards.judge import JUDGE, load_judge_reward
from dschat.rewards.names import reward_labels
from dschat.rewards.remote import is_remote, remote_reward
from dschat.rlhf.rollout import Rollout, completion_texts, positions_from_mask
from dschat.training import oom

__all__ = ["JUDGE", "RM", "Retokenizer", "Scorer", "build_scorer", "encode_for_reward", "end_scores", "reward_scores",
           "row_fields", "same_tokenizer", "score_rows", "score_texts"]

# Rows are right-padded to a width that depends on their own length alone (a multiple of this), and rows of one
# width share a forward: padding width changes a row's float sums in the last bits, the number of rows beside it
# does not (fp32 on CPU, checked by tests/dschat/test_serve.py), so a row's score does not depend on the batch it
# came in. That is what lets `dschat serve` pack concurrent requests and still answer what stage 3 computes.
SCORE_WIDTH_MULTIPLE = 32


@torch.no_grad()
def end_scores(reward_model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """End scores ``(B,)`` of ``ids`` ``(B, T)`` under the reward model: the value at each row's last real token
    (the EOS of an answer that ended). Left or right padding; positions start at each row's first real token."""
    values = reward_model(ids, mask, positions_from_mask(mask))
    return values.gather(1, end_indices(mask).unsqueeze(1)).squeeze(1)


def score_width(n: int) -> int:
    """The padded width of a row of ``n`` ids (``SCORE_WIDTH_MULTIPLE``)."""
    return max(1, -(-n // SCORE_WIDTH_MULTIPLE)) * SCORE_WIDTH_MULTIPLE


@torch.no_grad()
def score_rows(reward_model: Any, rows: Sequence[Sequence[int]], pad_token_id: int, device: Any = None,
               max_tokens: int = 0) -> torch.Tensor:
    """End scores ``(B,)`` (fp32, CPU) of token rows (each: prompt, answer and, for an answer that ended, EOS):
    the one scoring path of the reward model (stage 3, ``dschat generate``, ``dschat eval``, ``dschat serve``).

    Rows are grouped by ``score_width``, right-padded to it and scored a group at a time (per
    forward: as many as fit in ``max_tokens`` padded tokens, at least one; 0: all), so a row's score is the same
    whatever rows it is scored with.
    """
    out = torch.zeros(len(rows), dtype=torch.float32)
    by_width: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"row {i} has no tokens to score")
        by_width.setdefault(score_width(len(row)), []).append(i)
    for width, idx in sorted(by_width.items()):
        step = max(1, max_tokens // width) if max_tokens > 0 else len(idx)
        for k in range(0, len(idx), step):
            part = idx[k: k + step]
            ids = torch.full((len(part), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for j, i in enumerate(part):
                ids[j, : len(rows[i])] = torch.as_tensor(list(rows[i]), dtype=torch.long)
                mask[j, : len(rows[i])] = 1
            if device is not None:
                ids, mask = ids.to(device), mask.to(device)
            out[part] = oom.split_on_oom(  # rows score alone, so halves give the same scores
                "score", len(part), lambda a, b, ids=ids, mask=mask: end_scores(reward_model, ids[a:b], mask[a:b])
                .float().cpu(), torch.cat, local=oom.rank_local(reward_model))
    return out


def real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (mask non-zero), padding dropped: ``(B, T) -> B`` lists."""
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


@torch.no_grad()
def reward_scores(reward_model: Any, rollout: Rollout, retokenize: Any | None = None) -> torch.Tensor:
    """End scores ``(B,)`` of prompt + answer under the reward model (its own tokenizer via ``retokenize``), on
    the rollout's device."""
    rows = retokenize.rows(rollout) if retokenize is not None else \
        real_rows(rollout.sequences, rollout.attention_mask)
    pad = getattr(getattr(reward_model, "config", None), "pad_token_id", None)
    scores = score_rows(reward_model, rows, pad if pad is not None else 0, rollout.sequences.device)
    return scores.to(rollout.sequences.device)


def encode_for_reward(prompts: Sequence[str], answers: Sequence[str], ended: Sequence[bool], tokenizer: Any,
                      max_len: int) -> tuple[list[list[int]], int]:
    """Decoded prompts and answers as the reward model reads them (``reencode_for_reward``: its template, its EOS
    after an answer that ended, the prompt's start cut when too long): one id row each, and how many were cut."""
    rows, cut = [], 0
    for prompt, answer, done in zip(prompts, answers, ended, strict=True):
        ids, was_cut = reencode_for_reward(prompt, answer, bool(done), tokenizer, max_len)
        cut += was_cut
        rows.append(ids)
    return rows, cut


@torch.no_grad()
def score_texts(reward_model: Any, tokenizer: Any, prompts: Sequence[str], answers: Sequence[str],
                ended: Sequence[bool], max_len: int, device: Any = None) -> tuple[torch.Tensor, int]:
    """End scores ``(B,)`` (fp32, CPU) of decoded prompts and answers (``encode_for_reward``, then ``score_rows``):
    what a text request to ``dschat serve`` answers. Returns the scores and how many rows were cut to ``max_len``."""
    rows, cut = encode_for_reward(prompts, answers, ended, tokenizer, max_len)
    return score_rows(reward_model, rows, tokenizer.pad_token_id, device), cut


class Retokenizer:
    """Decode with the actor's tokenizer and re-encode for a reward model whose tokenizer differs.

    Too long for the reward model: the prompt loses its start after BOS, never the BOS or the scored end
    (``dschat.data.usertext.reencode_for_reward``); ``truncated`` counts such rows.
    """

    def __init__(self, actor_tokenizer: Any, reward_tokenizer: Any, max_len: int):
        self.src, self.dst, self.max_len = actor_tokenizer, reward_tokenizer, max_len
        self.truncated = 0

    def __call__(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The re-encoded rows right-padded: ``(B, T)`` ids and mask on the rollout's device."""
        ids, mask = pad_sequences(self.rows(rollout), self.dst.pad_token_id, "right")
        return ids.to(rollout.sequences.device), mask.to(rollout.sequences.device)

    def rows(self, rollout: Rollout) -> list[list[int]]:
        """Each row's prompt + answer in the reward model's tokens (what ``score_rows`` pads and scores)."""
        P = rollout.prompt_len
        prompts, answers = [], []
        for seq, mask in zip(rollout.sequences, rollout.attention_mask, strict=True):
            prompts.append(self.src.decode(seq[:P][mask[:P].bool()], skip_special_tokens=True))
            answers.append(self.src.decode(seq[P:][mask[P:].bool()], skip_special_tokens=True))
        # As on the same-tokenizer path: only an answer that ended gets the EOS the reward model scores at.
        rows, cut = encode_for_reward(prompts, answers, rollout.reached_eos.tolist(), self.dst, self.max_len)
        self.truncated += cut
        return rows


def row_fields(batch: dict[str, Any]) -> dict[str, list[Any]]:
    """The reward functions' ``row_fields`` (dschat.rewards.functions): ``answer`` plus every other field of the
    rows."""
    extras: list[dict[str, Any]] = batch.get("extra") or [{} for _ in batch["answer"]]
    reserved = {"answer", "prompts", "completions", "completion_lengths", "reached_eos", "token_ids",
                "external", "env_reward"}
    names = sorted({k for e in extras for k in e} - reserved)
    fields = {k: [e.get(k) for e in extras] for k in names}
    fields["answer"] = list(batch["answer"])
    return fields


class Scorer:
    """What a rollout earns under the run's reward sources: the mixer over rule functions and, for ``rm``, the
    reward model's end score (re-tokenized for it when its tokenizer differs)."""

    def __init__(self, mixer: RewardMixer, tokenizer: Any, reward_model: Any | None, retok: Retokenizer | None):
        self.mixer, self.tokenizer, self.reward_model, self.retok = mixer, tokenizer, reward_model, retok
        self.needs_text = any(n != RM for n in mixer.sources)
        self.needs_ids = any(is_remote(n) for n in mixer.sources)  # a server with the actor's tokenizer reads ids

    def stats(self) -> dict[str, float]:
        """Counters to log: rows cut to fit the reward model after re-tokenization, so far."""
        return {"train/reward_truncated": self.retok.truncated} if self.retok is not None else {}

    def describe(self) -> str:
        return " + ".join(f"{w:g}*{n}" for n, w in zip(self.mixer.names, self.mixer.weights, strict=True))

    @torch.no_grad()
    def __call__(self, rollout: Rollout, batch: dict[str, Any]) -> MixedRewards:
        external: dict[str, torch.Tensor] = {}
        if RM in self.mixer.sources:
            external[RM] = reward_scores(self.reward_model, rollout, self.retok).float().cpu()
        if not self.needs_text:  # rm only (PPO): no decoding
            n = rollout.sequences.shape[0]
            return self.mixer([""] * n, [""] * n, external=external)
        prompts, completions, lengths = completion_texts(self.tokenizer, rollout, batch["prompt_att_mask"])
        ids = {"token_ids": real_rows(rollout.sequences, rollout.attention_mask)} if self.needs_ids else {}
        if rollout.episode is not None:  # the environment's reward, the source 'env' (dschat.agents.env)
            ids["env_reward"] = list(rollout.episode.env_rewards)
        return self.mixer(prompts, completions, external=external, completion_lengths=lengths,
                          reached_eos=rollout.reached_eos.tolist(), **ids, **row_fields(batch))


def reward_weights(r: Any, names: list[str]) -> list[float]:
    """--reward-weights (``r`` the ``RewardArgs``), with weight 1 for an 'overlong' that --overlong-penalty added
    after them."""
    weights = parse_weights(r.reward_weights)
    if weights and len(weights) == len(names) - 1 and names[-1] == "overlong" and "overlong" not in r.reward_funcs:
        weights.append(1.0)
    return weights


def build_scorer(cfg: Any, models: Any | None) -> Scorer:
    """The run's ``Scorer`` (``cfg`` an ``RLHFConfig``; ``models`` the engine set, None when no source needs the
    reward model). A judge is a model, not a rule: it loads here, on this rank's device, with the run's rubric."""
    r = cfg.rewards
    names = cfg.reward_func_names()
    labels = reward_labels(cfg.reward_entries())  # what names each source's metrics
    weights = reward_weights(r, names)
    funcs: dict[str, Any] = {label: get_reward_func(n, cfg.rl.max_answer_seq_len, r.overlong_buffer,
                                                    r.overlong_factor)
                             for label, n in zip(labels, names, strict=True) if n != JUDGE and not is_remote(n)}
    tokenizer = getattr(models, "tokenizer", None)
    for label, n in zip(labels, names, strict=True):
        if is_remote(n):
            funcs[label] = remote_reward(n, r.reward_timeout, r.reward_retries, r.reward_backoff,
                                         r.reward_request_rows, r.reward_token_file)
            funcs[label].bind_tokenizer(tokenizer)
        if n == JUDGE:
            funcs[label] = load_judge_reward(r.judge_model, r.judge_max_new_tokens, cfg.data.judge_system_prompt,
                                             cfg.model.dtype, cfg.model.trust_remote_code)
    reward_model = getattr(models, "reward", None)
    rm_tok = getattr(models, "reward_tokenizer", None)
    retok = None if rm_tok is None or same_tokenizer(tokenizer, rm_tok) else \
        Retokenizer(tokenizer, rm_tok, cfg.data.max_prompt_seq_len + cfg.rl.max_answer_seq_len)
    return Scorer(RewardMixer(names, weights, funcs, labels), tokenizer, reward_model, retok)

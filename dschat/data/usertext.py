"""User text is tokenized as text: control tokens come only from templates and code, never from what a user typed.

A fast HF tokenizer turns the characters ``</s>`` in a prompt into the EOS *token*, so a data row or a chat
message holding ``</s><s>`` ends the sequence where the user only wrote characters. Here a
text is encoded together with the user's parts of it (prompt strings, message contents, answers): special-token
strings inside those parts are split into ordinary pieces, while the ones a chat template wrote around them stay
control tokens.

Text whose user parts hold no special-token string is encoded exactly as ``tokenizer(text)`` always did (one
batched call), so the tokenized demo and every ordinary dataset keep their ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def special_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex of the strings the tokenizer would read as special (control) tokens, longest first; None if none.

    Added tokens that are not special (``<think>`` of the demo tokenizer, Qwen's ``<tool_call>``) are ordinary
    vocabulary: a user may write them, and ``split_special_tokens`` leaves them whole too.
    """
    cached = getattr(tokenizer, "_dschat_special_pattern", False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            strings.add(str(tok))
    strings.discard("")
    pattern = re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True))) if strings else None
    try:
        tokenizer._dschat_special_pattern = pattern
    except AttributeError:  # a tokenizer object that refuses new attributes: recompute each time
        pass
    return pattern


def has_special_text(tokenizer: Any, texts: Sequence[str | None]) -> bool:
    pattern = special_token_pattern(tokenizer)
    return pattern is not None and any(t and pattern.search(t) for t in texts)


def _wrapping(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``add_special_tokens=True`` puts before and after a text (e.g. ``[bos]``, ``[]``)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i: i + len(plain)] == plain:
            return list(full[:i]), list(full[i + len(plain):])
    return [], []


def _user_spans(text: str, parts: Sequence[str | None]) -> list[tuple[int, int]]:
    """Where the user's parts sit in ``text``, found in order (templates write messages in order); a part the
    template changed beyond a strip is not found and keeps the old behaviour."""
    spans, pos = [], 0
    for part in parts:
        if not part:
            continue
        for candidate in (part, part.strip()):
            at = text.find(candidate, pos) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                pos = at + len(candidate)
                break
    return spans


def encode_one(tokenizer: Any, text: str, parts: Sequence[str | None], add_special_tokens: bool) -> list[int]:
    """Ids of ``text`` in which every special-token string inside one of the user ``parts`` is plain text."""
    pattern = special_token_pattern(tokenizer)
    if pattern is None or not any(p and pattern.search(p) for p in parts):
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    spans = _user_spans(text, parts)
    template_marks = [m for m in pattern.finditer(text)
                      if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    if not template_marks:  # every special string in the text is the user's: one call, split everywhere
        return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])
    # A chat template's control tokens stay tokens; the text between them (user parts included) is split.
    ids: list[int] = []
    pos = 0
    for m in template_marks:
        if m.start() > pos:
            ids += tokenizer(text[pos: m.start()], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids.append(tokenizer.convert_tokens_to_ids(m.group()))
        pos = m.end()
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if add_special_tokens:
        head, tail = _wrapping(tokenizer)
        ids = head + ids + tail
    return ids


def encode_texts(tokenizer: Any, texts: Sequence[str], parts: Sequence[Sequence[str | None]],
                 add_special_tokens: bool, batch: int = 1024) -> list[list[int]]:
    """``tokenizer(texts)["input_ids"]`` with the user ``parts`` of each text tokenized as text (see module doc).

    Texts without a special-token string in their user parts go through the tokenizer in batches, as before.
    """
    pattern = special_token_pattern(tokenizer)
    out: list[list[int]] = [[] for _ in texts]
    plain = [i for i, p in enumerate(parts) if pattern is None or not any(x and pattern.search(x) for x in p)]
    for start in range(0, len(plain), batch):
        chunk = plain[start: start + batch]
        ids = tokenizer([texts[i] for i in chunk], add_special_tokens=add_special_tokens)["input_ids"]
        for i, row in zip(chunk, ids, strict=True):
            out[i] = list(row)
    done = set(plain)
    for i, text in enumerate(texts):
        if i not in done:
            out[i] = encode_one(tokenizer, text, parts[i], add_special_tokens)
    return out


def prompt_parts(prompt: str | Sequence[dict[str, Any]]) -> list[str | None]:
    """The user's text in a prompt: the string itself, or each message's content."""
    if isinstance(prompt, str):
        return [prompt]
    return [m.get("content") if isinstance(m.get("content"), str) else None for m in prompt]


def single_bos(ids: list[int], bos: int | None) -> list[int]:
    """``ids`` without the second of two leading BOS ids: a chat template that writes the BOS itself (Llama-2/3)
    and the tokenizer's own BOS would otherwise give the model a sequence it never saw."""
    return ids[1:] if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos else ids


def keep_end(ids: list[int], max_len: int, bos: int | None) -> list[int]:
    """Left truncation to at most ``max_len`` ids: the end (the question, the assistant marker, a scored answer)
    survives, and so does a leading BOS (keeping just the last ``max_len`` ids would drop it)."""
    if len(ids) <= max_len:
        return ids
    head = [bos] if bos is not None and ids and ids[0] == bos and max_len > 1 else []
    return head + ids[len(ids) - (max_len - len(head)):]


def reencode_for_reward(prompt: str, answer: str, ended: bool, tokenizer: Any,
                        max_len: int) -> tuple[list[int], bool]:
    """Stage 3 with a reward model whose tokenizer differs from the actor's (docs/algorithms.md, PPO): the
    decoded prompt and answer re-encoded for the reward model, at most ``max_len`` ids. Returns the ids and
    whether they were truncated.

    Decoded text is user text (special tokens were skipped when decoding), so it is encoded as text. An answer
    that ended gets the reward model's EOS, where it reads the score. Too long: the reward model's BOS stays and
    the prompt loses its start (then the answer, if it alone is longer), so the scored end always survives
    (keeping just the last ``max_len`` ids would drop BOS).
    """
    ids = encode_one(tokenizer, prompt, [prompt], add_special_tokens=True)
    ids += encode_one(tokenizer, answer, [answer], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    if eos is not None and ended:
        ids.append(eos)
    if len(ids) <= max_len:
        return ids, False
    return keep_end(ids, max_len, tokenizer.bos_token_id), True

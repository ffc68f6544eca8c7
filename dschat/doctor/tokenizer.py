"""The doctor's tokenizer and chat-template checks: EOS, pad and BOS as dschat pads with the tokenizer, and whether
the chat template renders a conversation at once as the stage renders it turn by turn."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.errors import first_line

# The conversation the chat template is checked on when the data has none: a system turn, an earlier assistant
# turn holding reasoning (which some templates drop once the conversation goes on), and a final answer.
PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>2 plus 3 is 5.</think><answer>5</answer>"},
    {"role": "user", "content": "And 4 + 4?"},
]
PROBE_ANSWER = "<think>4 plus 4 is 8.</think><answer>8</answer>"


def check_tokenizer(path: str, trust_remote_code: bool, report: Report, who: str = "") -> Any:
    """The folder's tokenizer as saved, then as dschat pads with it (``ensure_distinct_pad``); findings on EOS, pad
    and BOS. Returns dschat's tokenizer, or None when it does not load."""
    from transformers import AutoTokenizer

    from dschat.models.loading import ensure_distinct_pad

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loader failure is the folder's
        report.add("tokenizer", ERROR, f"{path}: {who}tokenizer does not load ({first_line(e)})")
        return None
    eos, bos, pad = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id
    if eos is None:
        report.add("tokenizer", ERROR, f"{path}: {who}tokenizer has no EOS token, so no answer can end; set "
                                       "eos_token in its tokenizer_config.json")
        return None
    n_before = len(tok)
    ensure_distinct_pad(tok)
    grew = len(tok) > n_before
    grown = ", a new token: the embedding grows by a row" if grew else ""
    if pad is None:
        report.add("tokenizer", OK, f"{who}tokenizer has no pad token; dschat pads with {tok.pad_token!r} (id "
                                    f"{tok.pad_token_id}){grown}")
    elif pad == eos:
        report.add("tokenizer", WARN, f"{path}: {who}tokenizer's pad is its EOS ({tok.eos_token!r}, id {eos}): a "
                                      "trainer that pads with it masks the EOS as padding and the model never learns "
                                      f"to stop; dschat pads with {tok.pad_token!r} (id {tok.pad_token_id}) instead"
                                      f"{grown} and saves that, but other tools reading this folder pad with EOS")
    elif pad == bos:
        report.add("tokenizer", WARN, f"{path}: {who}tokenizer's pad is its BOS ({tok.bos_token!r}, id {bos}): "
                                      "padding and the start of every sequence look alike to anything that finds "
                                      "padding by id rather than by the attention mask")
    else:
        report.add("tokenizer", OK, f"{who}pad {tok.pad_token!r} ({pad}), EOS {tok.eos_token!r} ({eos}), BOS "
                                    f"{tok.bos_token!r} ({bos}): distinct")
    return tok


def check_template(tok: Any, formats: list[str], report: Report) -> None:
    """Whether the chat template renders a conversation at once as the stage renders it turn by turn: the text
    (``render_turns``: every earlier turn unchanged once the conversation goes on) and the token ids (the whole
    conversation's ids equal the concatenation of its spans' ids, as stage 1 builds and masks them)."""
    from dschat.config import DataArgs
    from dschat.data.formats import PAIRWISE, Example, has_chat_template, render_turns
    from dschat.data.phases import tokenize_examples
    from dschat.data.usertext import encode_texts, single_bos

    if not has_chat_template(tok):
        report.add("template", OK, "no chat template: message rows use the plain Human/Assistant template")
        return
    # Only text pairwise rows never meet the template; with those alone a broken template is not used.
    used = any(f != PAIRWISE for f in formats)
    bad = ERROR if used else WARN
    unused = "" if used else " (this data renders no messages with it)"
    prompt, whole, failure = PROBE_CONVERSATION, "", ""
    for attempt in (PROBE_CONVERSATION, PROBE_CONVERSATION[1:]):  # some templates refuse a system turn
        try:
            whole = tok.apply_chat_template(attempt + [{"role": "assistant", "content": PROBE_ANSWER}],
                                            tokenize=False)
            prompt = attempt
            break
        except Exception as e:  # noqa: BLE001 - a template raising (jinja's raise_exception) is its own finding
            failure = first_line(e, 160)
    else:
        report.add("template", bad, f"the chat template fails to render a conversation ({failure}){unused}")
        return
    if render_turns(prompt, tok) is None:
        where = _rewritten_turn(prompt, tok)
        report.add("template", bad, "the chat template does not round-trip multi-turn rows: rendering the whole "
                                    f"conversation differs from rendering it turn by turn ({where}); stage 1 then "
                                    f"trains only the last answer of such rows (multi_turn_last_only){unused}")
        return
    counts: Counter[str] = Counter()
    rows = tokenize_examples([Example(list(prompt), chosen=PROBE_ANSWER, train_all_turns=True)], 1, tok,
                             DataArgs(max_seq_len=10**9), counts)
    staged = rows[0]["input_ids"] if rows else []
    parts: list[str | None] = [m["content"] for m in prompt] + [PROBE_ANSWER]
    # The stage ends every answer with the EOS id, in place of an EOS the template writes after it (render_answer).
    eos_text = tok.eos_token or ""
    if eos_text and whole.rstrip().endswith(eos_text):
        whole = whole.rstrip()[: -len(eos_text)]
    full = single_bos(encode_texts(tok, [whole], [parts], True)[0], tok.bos_token_id) + [tok.eos_token_id]
    if staged != full:
        at = _divergence(staged, full)
        report.add("template", WARN, f"the chat template round-trips the text, but the ids built turn by turn "
                                     f"({len(staged)}) differ from the whole conversation's ({len(full)}) from "
                                     f"token {at} (a merge across a turn boundary){unused}")
        return
    report.add("template", OK, f"the chat template round-trips a multi-turn conversation ({len(full)} tokens, "
                               "text and ids)")


def _rewritten_turn(prompt: list[dict[str, str]], tok: Any) -> str:
    """Where the whole-conversation rendering first departs from an earlier, shorter rendering of it."""
    full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": PROBE_ANSWER}], tokenize=False)
    for i in range(1, len(prompt) + 1):
        asks = prompt[i - 1]["role"] == "user"  # a prefix ending with a question gets the generation prompt
        try:
            head = tok.apply_chat_template(prompt[:i], tokenize=False, add_generation_prompt=asks)
        except Exception:  # noqa: BLE001 - a template may refuse a prefix (a system turn alone): skip it
            continue
        if not full.startswith(head):
            at = max(0, _divergence(head, full) - 12)  # from a little before, so the snippets show their turn
            return (f"after turn {i} ({prompt[i - 1]['role']}) alone it reads {head[at:at + 48]!r}, in the whole "
                    f"conversation {full[at:at + 48]!r}")
    return "the generation prompt is not a prefix of the answered turn"


def _divergence(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

"""Prompt text that the library and the demo share: turn markers, completion tags, the judge's task and rubrics.

The library needs these (the judge reward rebuilds the demo judge's prompts, rule rewards look for the tags, the
judge reward recovers a question from an rm-static prompt); the demo corpus builds its rows from them, so a row
the demo writes and a prompt the library builds at run time are the same text. Pure stdlib.
"""

from __future__ import annotations

from pathlib import Path

from dschat.errors import UserError

Messages = list[dict[str, str]]

#: rm-static turn markers (``Dahoas/rm-static``): a one-turn prompt is ``HUMAN_PREFIX + question + ASSISTANT_SUFFIX``.
HUMAN_PREFIX = "\n\nHuman: "
ASSISTANT_SUFFIX = "\n\nAssistant:"

#: Tags of the GRPO / RM-R1 completion format; the tiny tokenizer keeps each as one piece.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


def is_english(text: str) -> bool:
    """No CJK ideograph in ``text`` (the demo's two languages: English or Chinese)."""
    return not any("\u4e00" <= ch <= "\u9fff" for ch in text)


# ------------------------------------------------------------------------------------------------ judges
# RM-R1 judge prompts (Chen et al. 2025, arXiv:2505.02387): a rubric system message and a user turn holding the
# task, the question and the two answers between MT-Bench's markers.
ZH_RUBRIC = (
    "你是公正的评审，负责比较两位电商客服的回答。好的回答应当体谅顾客、给出具体的处理步骤，并说明订单号或处理时限；"
    "敷衍、推卸责任或给出错误政策的回答较差。"
)
EN_RUBRIC = (
    "You are an impartial judge comparing two customer-service answers. A good answer shows empathy, names a "
    "concrete next step and gives the order number or a time frame; curt, evasive or wrong-policy answers are "
    "worse."
)
ZH_JUDGE_TASK = (
    "请比较下面两个回答，先在<think></think>中简要分析，再输出<answer>[[A]]</answer>或<answer>[[B]]</answer>。"
)
EN_JUDGE_TASK = (
    "Compare the two answers below. Reason briefly in <think></think>, then output <answer>[[A]]</answer> or "
    "<answer>[[B]]</answer>."
)


def judge_user_message(question: str, answer_a: str, answer_b: str, english: bool) -> str:
    """The user turn of an RM-R1 judge row: task, question, and the two answers between the usual markers."""
    task = EN_JUDGE_TASK if english else ZH_JUDGE_TASK
    return (
        f"{task}\n\n[User Question]\n{question}\n\n"
        f"[The Start of Assistant A's Answer]\n{answer_a}\n[The End of Assistant A's Answer]\n\n"
        f"[The Start of Assistant B's Answer]\n{answer_b}\n[The End of Assistant B's Answer]"
    )


def read_system_prompt(path: str) -> str:
    """The text of a ``--judge-system-prompt`` file; missing or blank is a user error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{p}: judge system prompt file not found")
    text = p.read_text(encoding="utf-8").strip()
    if not text:
        raise UserError(f"{p}: judge system prompt file is empty")
    return text


def inject_system_prompt(messages: Messages, system: str | None) -> Messages:
    """``messages`` opened by ``system`` unless they already hold a system message (a row's own rubric wins)."""
    if not system or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]

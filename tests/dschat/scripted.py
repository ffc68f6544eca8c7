"""Episodes with a scripted policy and a small environment, shared by the in-process tests and the vLLM checks
(which run in processes of their own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Again:
    """An environment that answers every turn for two turns, then says done."""

    def reset(self, row: dict[str, Any]) -> None:
        self.turns = 0

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.turns += 1
        return ("once more", 0.5, False) if self.turns < 2 else (None, 1.0, True)


def script_policy(script_of: Callable[[int], list[int]]) -> Callable[[], None]:
    """Make the policy write ``script_of(row)`` (token ids; the row's index in its batch) then EOS, on any backend:
    where a row samples, the driver's token (``Episodes.step_row``, which both the decode loop and the turn-by-turn
    driver call) is the script's next one. The log-probs stay the model's own of those tokens. Returns what undoes
    it."""
    from dschat.agents import episode as EP

    step_row = EP.Episodes.step_row

    def scripted(self: Any, i: int, tok_id: int, block: bool = False) -> tuple[int, bool, bool, bool]:
        at = self.__dict__.setdefault("_script_at", [0] * len(self.state))
        if self.state[i].mode is EP.Mode.SAMPLE:
            words = list(script_of(i)) + [self.tokenizer.eos_token_id]
            tok_id = words[min(at[i], len(words) - 1)]
        out = step_row(self, i, tok_id, block)
        at[i] += bool(out[2])
        return out

    EP.Episodes.step_row = scripted  # type: ignore[method-assign]

    def undo() -> None:
        EP.Episodes.step_row = step_row  # type: ignore[method-assign]

    return undo

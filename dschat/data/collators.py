"""Batch collators: dynamic padding to the longest row of the batch.

* ``DataCollatorSFT``: right-padded ``input_ids``/``attention_mask``/``labels`` (labels padded with -100).
* ``DataCollatorReward``: the B chosen sequences first, then the B rejected ones: ``(2B, L)``, right-padded.
* ``DataCollatorRLHF``: left-padded prompts, so that generation starts at the same column for every row.

The SFT and pair collators also say how their rows are batched under ``--packing`` and ``--group-by-length``
(``dschat.data.packing``): a unit's packed length, the packed sequence's capacity, the packed collator, and the
padded width length grouping compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dschat.data.packing import PackedPairsCollator, PackedSFTCollator, pair_length, pair_width, sft_length


def pad_sequences(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right",
                  multiple_of: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence (rounded up to ``multiple_of``). Returns ``(ids, mask)``, both ``(B, L)``."""
    length = max((len(s) for s in seqs), default=0)
    if multiple_of > 1:
        length = -(-length // multiple_of) * multiple_of
    ids = torch.full((len(seqs), length), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        t = torch.as_tensor(list(s), dtype=torch.long)
        if side == "right":
            ids[i, : len(s)], mask[i, : len(s)] = t, 1
        else:
            ids[i, length - len(s):], mask[i, length - len(s):] = t, 1
    return ids, mask


class DataCollatorSFT:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, mask = pad_sequences([r["input_ids"] for r in rows], self.pad_token_id, "right", self.multiple_of)
        labels, _ = pad_sequences([r["labels"] for r in rows], -100, "right", self.multiple_of)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    pack_length = staticmethod(sft_length)
    width = staticmethod(sft_length)

    @staticmethod
    def pack_capacity(max_seq_len: int) -> int:
        return max_seq_len

    def packed(self) -> PackedSFTCollator:
        return PackedSFTCollator(self.pad_token_id)


class DataCollatorReward:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        ids, mask = pad_sequences(seqs, self.pad_token_id, "right", self.multiple_of)
        batch = {"input_ids": ids, "attention_mask": mask}
        if any("margin" in r for r in rows):
            batch["margin"] = torch.tensor([float(r.get("margin", 0.0)) for r in rows])
        return batch

    pack_length = staticmethod(pair_length)  # a pair is packed whole: chosen, then rejected
    width = staticmethod(pair_width)

    @staticmethod
    def pack_capacity(max_seq_len: int) -> int:
        return 2 * max_seq_len  # a pair of two longest rows still fits one sequence

    def packed(self) -> PackedPairsCollator:
        return PackedPairsCollator(self)


class DataCollatorRLHF:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids, mask = pad_sequences([r["prompt_input_ids"] for r in rows], self.pad_token_id, "left", self.multiple_of)
        # Ground truth and other row fields travel with the batch for rule rewards (GRPO).
        return {"prompt": ids, "prompt_att_mask": mask,
                "answer": [r.get("answer") for r in rows], "extra": [r.get("extra", {}) for r in rows]}

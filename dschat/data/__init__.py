"""Data: sources, row formats, train-phase datasets and collators (docs/data.md)."""

from dschat.data.collators import DataCollatorReward, DataCollatorRLHF, DataCollatorSFT, pad_sequences
from dschat.data.phases import PhaseData, load_phase

__all__ = ["DataCollatorReward", "DataCollatorRLHF", "DataCollatorSFT", "PhaseData", "load_phase", "pad_sequences"]

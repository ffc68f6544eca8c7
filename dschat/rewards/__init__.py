"""Reward sources: rule and user reward functions and the mixer that weighs them (``functions``), and generative
judges in the RM-R1 style (``judge``). See docs/algorithms.md (Rule rewards) and docs/judge.md."""

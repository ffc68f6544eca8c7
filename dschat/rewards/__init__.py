"""Reward sources: rule and user reward functions and the mixer that weighs them (``functions``), generative
judges in the RM-R1 style (``judge``), and the names of the sources that score with a model (``names``, without
torch). See docs/algorithms.md (Rule rewards) and docs/judge.md."""

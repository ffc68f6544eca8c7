"""The demo's data files, written once into the cache, and the default ``--data`` they provide.

The library has no data of its own: a stage (or ``dschat data inspect``) given no ``--data`` trains on what its
caller passes as ``default_data`` to ``dschat.data.load_phase``, which is ``demo_data`` for the stage mains and
the demo commands.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dschat import prompts
from dschat.demo import corpus
from dschat.utils import cache_root, write_jsonl

# Seed of the SFT warm-up rows of the GRPO demo: not the prompts' seed 0, so GRPO's held-out prompts were never
# seen with their worked answers during SFT.
PROMPTS_SFT_SEED = 1

# The GRPO demo's task (``dschat pipeline grpo``): one-digit sums, prompts of seed 0 for GRPO and worked solutions
# of other prompts (seed 1, none of seed 0's) for the SFT warm-up. SUMS_MAX_ADDEND bounds both addends.
SUMS_SEED, SUMS_SFT_SEED = 0, 1
SUMS_MAX_ADDEND = 5


# The tools demo's task (``dschat pipeline tools``): order totals, prompts of seed 0 for GRPO and its held-out
# evaluation, calculator traces of other prompts (seed 1, none of seed 0's) for SFT.
TOOLS_SEED, TOOLS_SFT_SEED = 0, 1

# Seeds of the judge demo's other files: the cold-start SFT rows and the held-out evaluation rows are drawn from
# streams of their own, so neither shares a row with the GRPO judge rows (seed 0) or with each other.
JUDGE_SFT_SEED = 1
JUDGE_SFT_VERDICTS = "winner"  # the cold start's verdicts: the true winner (RM-R1's distillation) or "random"
JUDGE_EVAL_SEED = 2
JUDGE_EVAL_ROWS = 300


def demo_files() -> dict[str, Path]:
    """The demo files, in a cache folder keyed by the generator's source (the corpus and the prompt text it
    takes from ``dschat.prompts``), so an edited corpus never reuses stale files: ``pairwise``, ``prompts``
    (GRPO prompt-only rows), ``judge`` (RM-R1 rows) and ``prompts_sft`` (prompt/response rows of other
    arithmetic prompts with worked ``<think>..</think><answer>..</answer>`` completions, to warm up the format
    with SFT before GRPO); ``sums`` and ``sums_sft`` (the GRPO demo's task: prompt-only rows of small sums, and
    worked solutions of other sums for its SFT warm-up); ``judge_sft`` (other judge rows with a cold-start
    ``response`` ending in the true winner's verdict, RM-R1's distillation step) and ``judge_eval`` (held-out
    judge rows for ``dschat eval --judge``); ``tools`` and ``tools_sft`` (the tools demo: prompt-only rows of order
    totals, and calculator traces of other ones for its SFT). Deterministic, so any rank may write them."""
    source = Path(corpus.__file__).read_bytes() + Path(prompts.__file__).read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    folder = cache_root() / f"demo-{digest}"
    names = {"pairwise": "pairwise.jsonl", "prompts": "prompts.jsonl", "judge": "judge.jsonl"}
    if not all((folder / n).exists() for n in names.values()):
        corpus.write_demo_files(folder)
    files = {k: folder / n for k, n in names.items()}
    files["prompts_sft"] = folder / f"prompts_sft-seed{PROMPTS_SFT_SEED}.jsonl"
    if not files["prompts_sft"].exists():
        rows = corpus.generate_prompts(seed=PROMPTS_SFT_SEED, with_solution=True)
        write_jsonl([{"prompt": r["prompt"], "response": r["solution"]} for r in rows], files["prompts_sft"])
    files["sums"] = folder / f"sums-seed{SUMS_SEED}-max{SUMS_MAX_ADDEND}.jsonl"
    sums = None
    if not files["sums"].exists():
        sums = corpus.generate_sum_prompts(seed=SUMS_SEED, max_addend=SUMS_MAX_ADDEND)
        write_jsonl(sums, files["sums"])
    files["sums_sft"] = folder / f"sums_sft-seed{SUMS_SFT_SEED}-max{SUMS_MAX_ADDEND}.jsonl"
    if not files["sums_sft"].exists():
        sums = sums or corpus.generate_sum_prompts(seed=SUMS_SEED, max_addend=SUMS_MAX_ADDEND)
        held = frozenset(r["prompt"] for r in sums)
        rows = corpus.generate_sum_prompts(seed=SUMS_SFT_SEED, with_solution=True, max_addend=SUMS_MAX_ADDEND,
                                           exclude=held)
        write_jsonl([{"prompt": r["prompt"], "response": r["solution"]} for r in rows], files["sums_sft"])
    files["tools"] = folder / f"tools-seed{TOOLS_SEED}.jsonl"
    tool_rows = None
    if not files["tools"].exists():
        tool_rows = corpus.generate_tool_prompts(seed=TOOLS_SEED)
        write_jsonl(tool_rows, files["tools"])
    files["tools_sft"] = folder / f"tools_sft-seed{TOOLS_SFT_SEED}.jsonl"
    if not files["tools_sft"].exists():
        tool_rows = tool_rows or corpus.generate_tool_prompts(seed=TOOLS_SEED)
        write_jsonl(corpus.generate_tool_prompts(seed=TOOLS_SFT_SEED, with_trace=True,
                                                 exclude=frozenset(r["prompt"] for r in tool_rows)),
                    files["tools_sft"])
    files["judge_sft"] = folder / f"judge_sft-seed{JUDGE_SFT_SEED}-{JUDGE_SFT_VERDICTS}.jsonl"
    if not files["judge_sft"].exists():
        write_jsonl(corpus.generate_judge_cold_start(seed=JUDGE_SFT_SEED, verdicts=JUDGE_SFT_VERDICTS),
                    files["judge_sft"])
    files["judge_eval"] = folder / f"judge_eval-seed{JUDGE_EVAL_SEED}.jsonl"
    if not files["judge_eval"].exists():
        write_jsonl(corpus.generate_judge_pairs(JUDGE_EVAL_ROWS, seed=JUDGE_EVAL_SEED), files["judge_eval"])
    return files


def demo_data(kind: str = "pairwise") -> list[str]:
    """``--data`` for one demo file (a key of ``demo_files``): ``pairwise`` is the default data of stages 1 and 2
    and of PPO, ``prompts`` that of GRPO."""
    return [str(demo_files()[kind])]

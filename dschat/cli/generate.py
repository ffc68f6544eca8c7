"""``dschat generate``: N samples per prompt from a saved model, scored, kept as SFT rows (best-of-n, rejection
sampling, distillation from a teacher) or pairwise rows (DPO); see ``dschat.apps.best_of_n``.

    dschat generate --model out/step1 --data prompts.jsonl --num-samples 8 --reward-model out/step2 \\
        --keep best --output best.jsonl
    dschat generate --model out/step1 --data prompts.jsonl --reward-funcs my_rules.py:score --keep pairs \\
        --output pairs.jsonl

Registered on the ``dschat`` group by ``dschat.cli.main``. The flags are ``GenerateConfig``'s, declared once with the
stages' (sampling and reward sources from stage 3's config, model and data from the shared pieces); that config
imports stage 3 (torch, deepspeed), so it is imported when the command runs, not when ``dschat --help`` lists it.
"""

from __future__ import annotations

from typing import Any

from dschat.cli.options import stage_command

HELP = ("Sample N answers per prompt from a saved model, score them (--reward-model, --reward-funcs, --judge-model) "
        "and write JSON Lines: every sample (--keep all), the best as SFT rows (--keep best: rejection sampling, "
        "best-of-n, distillation from a teacher) or best/worst as pairwise rows (--keep pairs: DPO). Resumable: "
        "run it again to continue.")


def _config() -> type:
    from dschat.apps.best_of_n import GenerateConfig

    return GenerateConfig


def _run(cfg: Any) -> dict[str, Any]:
    from dschat.apps.best_of_n import generate

    return generate(cfg)


generate_command = stage_command("generate", _config, _run, help=HELP)

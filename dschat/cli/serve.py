"""``dschat serve``: a reward model, a generative judge or rule functions behind HTTP (docs/serving.md).

    dschat serve --reward-model out/step2/model --port 8000
    dschat train --step 3 --algo grpo ... --reward-funcs http://127.0.0.1:8000/score

Registered on the ``dschat`` group by ``dschat.cli.main``. The flags are ``ServeConfig``'s (``dschat.serving.config``),
declared once with the stages'; FastAPI, uvicorn (the ``serve`` extra) and torch are imported when the command
runs, so its help needs neither.
"""

from __future__ import annotations

from typing import Any

from dschat.cli.options import stage_command

HELP = ("Serve a reward model (--reward-model), a generative judge (--judge-model) or rule functions (--reward-funcs) "
        "over HTTP: POST /score, POST /get_reward (OpenRLHF's shape), GET /health, GET /info. Scores equal stage "
        "3's in-process ones; concurrent requests are batched. Needs pip install -r requirements-serve.txt.")


def _config() -> type:
    from dschat.serving.config import ServeConfig  # light: --help lists the flags without the extra or torch

    return ServeConfig


def _run(cfg: Any) -> None:
    from dschat.serving.server import serve

    serve(cfg)  # without the extra: one line, exit 2, before anything loads


serve_command = stage_command("serve", _config, _run, help=HELP)

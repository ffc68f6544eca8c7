"""Language-model evaluation, shared by stage 1 (before, during and after training) and ``dschat eval --step 1``.

The metric is the token-level loss and perplexity of the answer tokens (``labels != -100``; the prompt is
masked unless ``--no-mask-prompt``) of ``DataCollatorSFT`` batches, as sums over every rank, so evaluating
disjoint shards on N ranks gives exactly the single-process numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dschat import engine as E
from dschat.data import DataCollatorSFT, load_phase
from dschat.devices import resolve_dtype
from dschat.errors import UserError
from dschat.losses import distill_sft_loss
from dschat.models.loading import frozen_causal_lm, load_tokenizer, resolve_saved_model
from dschat.training import oom
from dschat.training.stage import eval_loader, lockstep_batches, to_device
from dschat.utils import progress_bar


@torch.no_grad()
def evaluate_perplexity(model: Any, loader: Any, tick: Callable[[int], None] | None = None,
                        distiller: Any | None = None) -> dict[str, float]:
    """Token-level loss and perplexity over the answer tokens (labels != -100), summed exactly across ranks.
    ``tick(rows)`` is called after each batch (a progress bar). With a ``dschat.training.distill.Distiller`` (stage 1's
    teacher) also ``kd`` (T^2 * token-mean KL of the model to the teacher) and ``top1_agreement``."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # nll, answer tokens, T^2 * KL, top-1 agreements (token sums)
    for batch, real in lockstep_batches(loader):
        batch = to_device(batch, E.device())
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = oom.split_on_oom(  # out of memory: the batch's halves (a row's logits do not depend on the others)
            "eval", ids.shape[0], lambda a, b, ids=ids, mask=mask: model(input_ids=ids[a:b], attention_mask=mask[a:b],
                                                                          use_cache=False).logits,
            torch.cat, local=oom.rank_local(model))
        teacher_logits = None
        if distiller is not None:  # the teacher's forward is a collective under ZeRO-3: on filler batches too
            teacher_logits = distiller.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                               use_cache=False).logits
        if not real:
            continue
        labels = batch["labels"][:, 1:]
        n = (labels != -100).sum().double().cpu()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100, reduction="sum")
        sums[0] += loss.double().cpu()
        sums[1] += n
        if teacher_logits is not None:
            kd = distill_sft_loss(logits, teacher_logits, batch["labels"], 1.0, distiller.kd.kd_temperature)
            sums[2] += kd.kd.double().cpu() * n
            sums[3] += kd.top1_agreement.double().cpu() * n
        if tick is not None:
            tick(batch["input_ids"].shape[0])
    sums = E.all_reduce_sum(sums)
    if was_training:
        model.train()
    count = sums[1].clamp(min=1)
    mean = (sums[0] / count).item()
    result = {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}
    if distiller is not None:
        result.update(kd=(sums[2] / count).item(), top1_agreement=(sums[3] / count).item())
    return result


def evaluate_saved_lm(cfg: Any, default_data: Callable[[], Sequence[str]] | None = None, progress: bool = True,
                      log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Loss and perplexity of a saved causal LM on the held-out rows of train phase 1, chosen exactly as stage 1
    chooses them (``cfg`` an ``SFTConfig``: ``--data``, ``--data-split``, ``--eval-fraction``,
    ``--max-eval-rows``, ``--seed``, ``--max-seq-len``, ``--mask-prompt``), so a stage's own figure is
    reproduced with its flags. ``cfg.model.model`` may be a stage output folder (its ``model/``)."""
    t0 = time.time()
    path = resolve_saved_model(cfg.model.model)
    tokenizer = load_tokenizer(path, cfg.model.trust_remote_code)
    data = load_phase(cfg.data, 1, tokenizer, cfg.run.seed, log=log, default_data=default_data, need_train=False)
    if not data.eval:
        raise UserError("no held-out rows to evaluate: the phase-1 part has no test split and --eval-fraction or "
                        "--max-eval-rows leaves none (to score every row of a file: --data-split 1,0,0 "
                        "--eval-fraction 1 --max-eval-rows 0)")
    dtype = resolve_dtype(cfg.model.dtype, E.device())
    model = frozen_causal_lm(path, dtype, cfg.model.trust_remote_code)
    loader = eval_loader(data.eval, cfg.optim.per_device_eval_batch_size, DataCollatorSFT(tokenizer.pad_token_id))
    bar = progress_bar(progress, len(data.eval), "eval")
    try:
        result = evaluate_perplexity(model, loader, tick=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    counts = {k: v for k, v in data.counts.items() if k != "train_rows"}
    return {"model": path, **result, **counts, "sources": data.sources,
            "seconds": round(time.time() - t0, 1)}

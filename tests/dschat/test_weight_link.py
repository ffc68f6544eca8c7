"""Weights over a link between two jobs (``dschat.generation.weight_link`` over ``dschat.engine.Link``, gloo on
the CPU): a trainer process sends its policy in buckets, a sampler process receives it into its own copy. Checked:
the copy equals the trainer's (tied weights too) and carries the version; a bucket damaged on the way, or weights
that do not give the trainer's log-probs, stop both sides with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from dschat.utils import free_port

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def _model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


CASES = ("ok", "damaged", "off_probe", "bf16_trainer")


def _side(rank: int, port: int, out: str) -> None:
    """One process of the pair, over one link for every case in turn: rank 0 the trainer (seed 1), rank 1 the
    sampler (seed 2, then what it receives). A refused update leaves the link usable: both sides drained it."""
    from dschat import engine as E
    from dschat.generation import weight_link as W

    link = E.Link("127.0.0.1", port, rank, 2, timeout_s=60)
    probe = W.probe_logprobs
    results = {}
    for case in CASES:
        model = _model(1 if rank == 0 else 2)
        if case == "bf16_trainer" and rank == 0:  # a GPU trainer's bf16 weights into a CPU sampler's fp32 copy
            model = model.to(torch.bfloat16)
        result: dict[str, Any] = {}
        W.CORRUPT = None
        W.probe_logprobs = probe  # type: ignore[assignment]
        try:
            if rank == 0:
                if case == "damaged":
                    W.CORRUPT = lambda flat: flat.view(-1)[:1].add_(1.0) if flat.dtype == torch.float32 else None
                if case == "off_probe":  # the sampler's copy will hold these weights, the probe is not theirs
                    W.probe_logprobs = lambda module: [0.0] * (W.PROBE_LENGTH - 1)  # type: ignore[assignment]
                result["metrics"] = W.send_weights(link, model, version=7, bucket_bytes=4096)
            else:
                result["version"] = W.receive_weights(link, model)
        except W.WeightLinkError as e:
            result["error"] = str(e)
        result["state"] = {k: v.float().tolist() for k, v in model.state_dict().items()}
        result["tied"] = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        results[case] = result
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every case's (trainer, sampler) results, from one pair of processes."""
    out = tmp_path_factory.mktemp("link")
    mp.spawn(_side, args=(free_port(), str(out)), nprocs=2, join=True)
    sides = [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)]
    return {case: (sides[0][case], sides[1][case]) for case in CASES}


def test_a_sampler_receives_the_trainer_s_weights_in_buckets_with_the_version(pair):
    trainer, sampler = pair["ok"]
    assert "error" not in trainer and "error" not in sampler, (trainer, sampler)
    assert sampler["version"] == 7 and sampler["state"] == trainer["state"] and sampler["tied"]
    assert trainer["state"] != {k: v.tolist() for k, v in _model(2).state_dict().items()}  # it did change
    assert trainer["metrics"]["sync/bytes"] > 4096 * 3  # several buckets
    n_params = sum(p.numel() for p in _model(1).parameters())  # the tied head counted once, as sent
    assert trainer["metrics"]["sync/bytes"] == n_params * 4 and trainer["metrics"]["sync/seconds"] > 0


@pytest.mark.parametrize("case, says", [
    ("damaged", "arrived damaged (checksum"),
    ("off_probe", "differ from the trainer's by"),
])
def test_a_bad_update_stops_both_sides_with_one_line(pair, case, says):
    trainer, sampler = pair[case]
    assert says in sampler["error"] and "the sampler stops" in sampler["error"], sampler
    assert trainer["error"].startswith("weight update 7: the sampler refused it: ") and says in trainer["error"]
    assert "\n" not in trainer["error"] and "\n" not in sampler["error"]


def test_a_half_precision_trainer_s_update_is_checked_at_half_precision_s_tolerance(pair):
    # its probe, computed in bf16, is off the sampler's fp32 one by about 1e-3 nats: over float32's 1e-4, well
    # within half precision's
    trainer, sampler = pair["bf16_trainer"]
    assert "error" not in trainer and "error" not in sampler, (trainer, sampler)
    assert sampler["version"] == 7 and sampler["state"] == trainer["state"]

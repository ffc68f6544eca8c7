"""A sampler in a process of its own: it holds a copy of the policy on its own devices and answers batches of
prompts, and the trainer keeps its copy current over a link (``dschat.engine.Link``; weights as
``dschat.generation.weight_link`` sends them).

Who sends what, in the order both sides follow (the link's messages are collective, so the order is the
protocol):

```
trainer (SamplerClient, link rank 0)             sampler (SamplerServer, link rank 1)
  {"op": "weights"}  + the weight update   ->      receive_weights: checksums, probe; the verdict back
  {"op": "sample", settings, seed, shape}
     + prompt ids, prompt mask              ->      generate(...) through the one entry, from its copy
                                           <-      {"version", "shape"} + sequences + log-probs of its samples
  {"op": "stop"}                           ->      returns
```

A request is sent, then its answers received when the trainer wants them (``request``, then ``result``): what the
trainer does in between overlaps with the sampling. One request is in flight at a time: a message on the link
completes only when the other side takes it, and a sampler busy with one request takes the next only after its
answers are read. The answers carry the version of the weights that sampled
them, and the sampler's own log-probs of its tokens (the behaviour policy's). A peer that dies or stops answering
fails the other side's next message within the link's timeout, in one line (``SamplerLost``).
"""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import torch

from dschat.devices import forked_rng
from dschat.errors import UserError
from dschat.generation.backends import generate
from dschat.generation.decode import Backend, Generated, GenerationConfig, Prompts
from dschat.generation.weight_link import receive_weights, send_weights

SAMPLER_RANK = 1


class SamplerLost(UserError):
    """The other side of a sampler's link died or stopped answering."""


def _lost(what: str, error: BaseException) -> SamplerLost:
    from dschat.errors import first_line

    return SamplerLost(f"{what}: {first_line(error)}")


class SamplerClient:
    """The trainer's side of a sampler (its link's rank 0)."""

    def __init__(self, link: Any):
        self.link = link
        self.pending = False  # a request sent and not yet answered

    def push(self, module: torch.nn.Module, version: int) -> dict[str, float]:
        """Send ``module``'s weights as ``version``; the sampler checks them before its next sample (``sync/*``).
        Raises ``WeightLinkError`` when it refused them."""
        try:
            self.link.broadcast_json({"op": "weights"})
        except RuntimeError as e:
            raise _lost("the sampler is gone (sending a weight update)", e) from None
        return send_weights(self.link, module, version)

    def request(self, prompts: Prompts, settings: GenerationConfig, seed: int) -> None:
        """Ask for answers to ``prompts`` (left-padded, on any device), sampled with ``settings`` from a stream
        seeded with ``seed``; ``result`` gives them, before the next request."""
        if self.pending:
            raise RuntimeError("a sampler takes one request at a time: read the answers of the last one first")
        ids = prompts.ids.to(self.link.device)
        mask = prompts.mask.to(self.link.device, torch.long)
        try:
            self.link.broadcast_json({"op": "sample", "settings": asdict(settings), "seed": seed,
                                      "shape": list(ids.shape), "eos": prompts.eos_token_id,
                                      "pad": prompts.pad_token_id})
            self.link.broadcast(ids.to(torch.long))
            self.link.broadcast(mask)
        except RuntimeError as e:
            raise _lost("the sampler is gone (sending a request)", e) from None
        self.pending = True

    def result(self) -> tuple[Generated, int]:
        """The answers to the request in flight, and the version of the weights that sampled them."""
        if not self.pending:
            raise RuntimeError("no request is in flight")
        self.pending = False
        try:
            head = self.link.broadcast_json(None, src=SAMPLER_RANK)
            B, W = head["shape"]
            seqs = self.link.broadcast(torch.empty(B, W, dtype=torch.long, device=self.link.device), SAMPLER_RANK)
            logps = self.link.broadcast(torch.empty(B, W - head["prompt"], dtype=torch.float32,
                                                    device=self.link.device), SAMPLER_RANK)
        except RuntimeError as e:
            raise _lost("the sampler died or stopped answering", e) from None
        return Generated(seqs, None, engine_logprobs=logps if head["logprobs"] else None), int(head["version"])

    def stop(self) -> None:
        """Tell the sampler to exit (it answers what it was asked first)."""
        try:
            self.link.broadcast_json({"op": "stop"})
        except RuntimeError:
            pass  # already gone


class SamplerServer:
    """The sampler's side (its link's rank 1): ``serve`` answers the trainer until it says stop or is gone."""

    def __init__(self, link: Any, module: torch.nn.Module, backend: Backend, version: int = 0):
        self.link, self.module, self.backend, self.version = link, module.eval(), backend, version

    def serve(self) -> None:
        """Answer weight updates and sample requests in the order they come. Returns on ``stop``; raises
        ``SamplerLost`` when the trainer is gone, ``WeightLinkError`` on a bad update."""
        while True:
            try:
                msg = self.link.broadcast_json(None)
            except RuntimeError as e:
                raise _lost("the trainer is gone", e) from None
            if msg["op"] == "stop":
                return
            if msg["op"] == "weights":
                self.version = receive_weights(self.link, self.module)
            elif msg["op"] == "sample":
                self._answer(msg)

    @torch.no_grad()
    def _answer(self, msg: dict[str, Any]) -> None:
        B, P = msg["shape"]
        ids = self.link.broadcast(torch.empty(B, P, dtype=torch.long, device=self.link.device))
        mask = self.link.broadcast(torch.empty(B, P, dtype=torch.long, device=self.link.device))
        device = next(self.module.parameters()).device
        settings = GenerationConfig(**msg["settings"])
        with forked_rng(int(msg["seed"])):  # a backend with its own copy resyncs when the version moves
            out = generate(self.backend, self.module, Prompts(ids.to(device), mask.to(device), msg["eos"], msg["pad"]),
                           settings, engine=SimpleNamespace(global_steps=self.version))
        logps = out.logprobs if out.logprobs is not None else out.engine_logprobs
        seqs = out.sequences.to(self.link.device)
        answer = torch.zeros(B, seqs.shape[1] - P, dtype=torch.float32, device=self.link.device)
        if logps is not None:
            answer.copy_(logps.float().to(self.link.device))
        self.link.broadcast_json({"version": self.version, "shape": list(seqs.shape), "prompt": P,
                                  "logprobs": logps is not None}, src=SAMPLER_RANK)
        self.link.broadcast(seqs.contiguous(), SAMPLER_RANK)
        self.link.broadcast(answer, SAMPLER_RANK)

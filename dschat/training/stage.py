"""What every stage does the same way: output folder, seeding, process group, loaders, step counting."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from dschat import engine as E
from dschat.config import DataArgs, OptimArgs, RunArgs, to_flat_dict
from dschat.data.packing import LengthGroupedSampler, best_capacity, pack_rows
from dschat.errors import ExitCode, UserError
from dschat.models.loading import TINY
from dschat.training import memory
from dschat.training.lock import claim_output_dir
from dschat.training.oom_advice import Advisor
from dschat.training.resume import Checkpointer, _rng_state, _set_rng_state, checkpoint_root, latest_state
from dschat.training.sinks import RUN_IDS, check_trackers
from dschat.utils import METRICS_FILE, set_seed, write_json

TINY_LR = 1e-3  # a freshly initialised tiny model learns at rates a pretrained 7B would diverge at
DEFAULT_LR = 1e-5
# Below this size a model is a CPU-scale toy (the tiny preset, or a stage output built from it), not a
# pretrained LLM: 1e-5 would barely move it in a demo-length run.
SMALL_MODEL_PARAMS = 50_000_000


@dataclass
class Stage:
    """A running stage: its name (the log prefix), its output folder, and its advisor for a training micro-batch
    that runs out of memory (the stage and flags the planner needs, ``dschat.training.oom_advice``)."""

    name: str
    output_dir: Path
    advisor: Advisor

    def log(self, text: str) -> None:
        if E.is_main():
            print(f"[{self.name}] {text}", file=sys.stderr, flush=True)


def begin_stage(cfg: Any, name: str, default_output: str) -> Stage:
    """Prepare a run: check the trackers of --report-to, resolve and guard the output folder, join the process group,
    seed, write args.json.

    A finished run (eval.json) or resumable training states are never overwritten silently: ``--resume``
    continues the states, ``--force`` starts over. The folder is locked for the life of the process (one run per
    folder) and must be the same folder on every node (``dschat.training.lock``); rank 0 decides what it holds.
    """
    run: RunArgs = cfg.run
    out = Path(run.output_dir or default_output).expanduser()
    E.setup_distributed()
    quiet_interrupts_at_exit()
    check_trackers(run.report_to, out)  # a tracker's package or server missing: one line, before anything loads
    claim_output_dir(out, lambda text: print(f"[{name}] {text}", file=sys.stderr, flush=True))
    latest, finished = E.broadcast_object((latest_state(out), (out / "eval.json").exists()) if E.is_main() else None)
    if finished and not run.force and not (run.resume and latest is not None):
        raise UserError(f"{out} already holds a finished run (eval.json); pass --force to overwrite it, --resume "
                        "to train on from its final state, or choose another --output-dir")
    if latest is not None and not (run.resume or run.force):
        raise UserError(f"{out} holds a resumable training state ({latest}); pass --resume to "
                        "continue it or --force to start over")
    set_seed(run.seed)
    if E.is_main():
        if not (run.resume and latest is not None):  # a fresh start: nothing of an older run stays
            for stale in (METRICS_FILE, "eval.json", "health.jsonl", RUN_IDS):
                if (out / stale).exists():
                    (out / stale).unlink()
            shutil.rmtree(checkpoint_root(out), ignore_errors=True)
            shutil.rmtree(out / "tensorboard", ignore_errors=True)  # else its curves would overlay the new run's
        write_json(out / "args.json", {"stage": name, "world_size": E.world_size(), **to_flat_dict(cfg)})
    E.barrier()
    memory.reset()  # this run's figures only (a rollback runs the stage again in this process)
    stage = Stage(name, out, Advisor.for_stage(name, to_flat_dict(cfg), out, E.world_size()))
    if (line := stage.advisor.start_line()) is not None:
        stage.log(line)
    return stage


def learning_rate(optim: OptimArgs, model_name: str, n_params: int | None = None) -> float:
    """``--learning-rate`` if given; else the tiny rate for the ``tiny`` preset or any model under
    ``SMALL_MODEL_PARAMS`` parameters (e.g. a step-1 output of the preset), else ``DEFAULT_LR``."""
    if optim.learning_rate is not None:
        return optim.learning_rate
    if model_name == TINY or (n_params is not None and n_params < SMALL_MODEL_PARAMS):
        return TINY_LR
    return DEFAULT_LR


def train_loader(rows: list[Any], batch_size: int, collator: Any, seed: int, sampler: Any = None) -> DataLoader:
    """Shuffled each epoch (call ``loader.sampler.set_epoch``), sharded across ranks; ``sampler`` replaces the
    default ``DistributedSampler`` (length-grouped batches)."""
    if sampler is None:
        sampler = DistributedSampler(rows, num_replicas=E.world_size(), rank=E.rank(), shuffle=True, seed=seed,
                                     drop_last=E.world_size() > 1)
    # A private generator: starting an epoch's iterator must not draw from the global RNG, or a resumed run
    # (which restores the global RNG mid-epoch) would diverge from an uninterrupted one.
    return DataLoader(rows, batch_size=batch_size, sampler=sampler, collate_fn=collator, drop_last=False,
                      generator=torch.Generator().manual_seed(seed))


def training_loader(rows: list[Any], batch_size: int, collator: Any, seed: int, data: DataArgs) -> DataLoader:
    """``train_loader`` with the batching ``data`` asks for: ``--packing`` (the rows packed once into sequences
    of at most ``collator.pack_capacity(--max-seq-len)`` tokens, of the length wasting the least
    (``best_capacity``), batched by ``collator.packed()``; ``batch_size`` counts sequences) or
    ``--group-by-length`` (batches of rows of similar ``collator.width``)."""
    if data.packing:
        limit = collator.pack_capacity(data.max_seq_len)
        packs = pack_rows(rows, best_capacity([collator.pack_length(r) for r in rows], limit), collator.pack_length)
        return train_loader(packs, batch_size, collator.packed(), seed)
    if data.group_by_length:
        sampler = LengthGroupedSampler([collator.width(r) for r in rows], batch_size, E.world_size(), E.rank(), seed)
        return train_loader(rows, batch_size, collator, seed, sampler=sampler)
    return train_loader(rows, batch_size, collator, seed)


@dataclass
class EvalLoader:
    """This rank's shard of the evaluation rows as batches, plus ``filler``: a batch of real rows to run (and
    discard) while this rank waits for longer shards elsewhere (``lockstep_batches``). Iterates and has a length
    like the loader it holds."""

    loader: DataLoader
    filler: Any | None  # a collated batch of one row; None when there are no rows at all

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def eval_loader(rows: list[Any], batch_size: int, collator: Any) -> EvalLoader:
    """Each rank evaluates a disjoint strided shard, without padding duplicates: sums over ranks are exact.

    Iterate it with ``lockstep_batches``: shards can differ by a batch, and ZeRO-3 forwards are collective.
    """
    shard = rows[E.rank():: E.world_size()]
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False, collate_fn=collator)
    return EvalLoader(loader, collator(rows[:1]) if rows else None)


def lockstep_batches(loader: EvalLoader) -> Iterator[tuple[Any, bool]]:
    """``(batch, real)``: every rank yields as many batches as the longest shard. Under ZeRO-3 each forward (and
    each parameter gather around ``generate``) is a collective, so a rank that ran out of batches must keep
    running throw-away ones (``real`` False, results discarded) or the others would hang."""
    n_local = len(loader)
    n = n_local
    if E.world_size() > 1:
        n = int(E.all_reduce_max(torch.tensor(n_local)).item())
    for batch in loader:
        yield batch, True
    for _ in range(n - n_local):
        if loader.filler is None:
            raise RuntimeError("an empty evaluation shard has no batch to keep in step with")
        yield loader.filler, False


def plan_steps(batches_per_epoch: int, optim: OptimArgs) -> tuple[int, int]:
    """``(optimizer steps, epochs)``. ``--max-steps`` overrides ``--num-train-epochs`` (as in HF Trainer): the
    data is passed over as many times as it takes.

    DeepSpeed's accumulation windows run on across epoch boundaries, so the steps are the micro-batches of all
    epochs divided by ``--gradient-accumulation-steps`` (a last incomplete window takes no step).
    """
    gas = optim.gradient_accumulation_steps
    if optim.max_steps > 0:
        return optim.max_steps, math.ceil(optim.max_steps * gas / max(1, batches_per_epoch))
    steps = batches_per_epoch * optim.num_train_epochs // gas
    if steps < 1:
        raise UserError(f"{batches_per_epoch * optim.num_train_epochs} micro-batches make no optimizer step with "
                        f"--gradient-accumulation-steps {gas}; lower it, the batch size, or raise the epochs")
    return steps, optim.num_train_epochs


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def resumable_batches(loader: DataLoader, epochs: int, start_epoch: int = 0,
                      skip: int = 0) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, batches_done_in_epoch, batch)`` over ``epochs``, starting ``skip`` batches into ``start_epoch``.

    The order of every epoch is fixed by the sampler's seed and the epoch number, so a resumed run sees
    exactly the batches an uninterrupted run would have seen.
    """
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        batches = iter(loader)
        done = 0
        if epoch == start_epoch and skip:
            for _ in itertools.islice(batches, skip):
                done += 1
        for batch in batches:
            done += 1
            yield epoch, done, batch


class EpochStream:
    """Batches of epoch 0, 1, 2, ... without end (the caller stops by its own step count), counting the batches
    handed out so a resumed run continues at the very batch an uninterrupted one would see next.

    Stage 3 draws prompt batches from it: a step may take more than one (PPO's generation batches, GRPO's
    dynamic sampling), so the position is a batch count rather than a step.
    """

    def __init__(self, loader: DataLoader, consumed: int = 0, what: str = "batches"):
        if len(loader) == 0:
            raise UserError(f"no {what} on this rank (fewer rows than ranks?)")
        self.loader, self.consumed = loader, consumed
        self._batches = self._generate()

    def _generate(self) -> Iterator[Any]:
        epoch, skip = divmod(self.consumed, len(self.loader))
        while True:
            self.loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            for batch in itertools.islice(self.loader, skip, None):
                self.consumed += 1
                yield batch
            epoch, skip = epoch + 1, 0

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        return next(self._batches)


class ResumableLoop:
    """The training loop's skeleton, written once for every stage: resume from the output folder's latest state,
    count steps, save a state every ``--save-interval`` steps and (``--save-final-state``) at the end, turn
    Ctrl-C into a saved state and a clean exit, and run each training micro-batch (``micro_batch``: its memory
    phase, and out of memory stopping the run in one line).

    Two drivers share it: ``run`` (stages 1 and 2: micro-batches from a loader, a step per optimizer step, Ctrl-C
    saves at once) and ``updates`` (stage 3: a step per algorithm update, which is long, so Ctrl-C saves at the
    next step boundary). ``state`` and ``tensors`` are what the resumed state holds besides its position; the
    stage keeps ``extras`` (and, for stage 3, the ``state`` callback) current with what the next state should
    hold.
    """

    def __init__(self, stage: Stage, engines: dict[str, Any], tokenizer: Any, run: RunArgs, accumulation: int = 1):
        self.stage, self.engines, self.accumulation = stage, engines, accumulation
        self.save_interval, self.save_final = run.save_interval, run.save_final_state
        self.ckpt = Checkpointer(stage.output_dir, engines, run.keep_checkpoints, tokenizer)
        self.resumed_from, self.state, self.tensors = \
            self.ckpt.resume_latest(stage.log) if run.resume else (None, {}, {})
        self.step: int = self.state.get("step", 0)
        # stages 1-2: the epoch and batches drawn in it at the last optimizer step, where a resumed run starts
        self.position = {"epoch": self.state.get("epoch", 0), "batches": self.state.get("batches", 0)}
        self.extras: dict[str, Any] = {}
        self.health: Any = None  # a HealthMonitor: responds to its alarms after each step (dschat.training.health)
        self._save_now: Callable[[], Path | None] = self.save
        self._save_on_oom = False  # the driver ``run`` (stages 1-2) sets it: see ``_kept_after_oom``
        self._boundary: tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]] | None = None

    def watch(self, health: Any) -> None:
        """Let ``health`` act after each step (and resume its own state from the restored one)."""
        self.health = health
        health.resume(self.state, self.engines, self.resumed_from)

    def save_now(self) -> Path | None:
        """A state of the step just counted (what a health alarm saves), as the running driver saves it."""
        return self._save_now()

    @contextlib.contextmanager
    def micro_batch(self, phase: str, n: int) -> Iterator[None]:
        """Run training micro-batch ``n`` (from 1, within its step) of memory phase ``phase`` (``train``,
        ``train_actor``, ``train_critic``: measured as ``memory/<phase>_*``). Out of memory in it stops the run
        (``OutOfMemoryStop``, exit code 4) in one line with the planner's advice and the state kept; every stage
        and algorithm runs its forward, backward and optimizer step in it."""
        with memory.phase(phase), self.stage.advisor.stop_on_oom(phase, n, self._kept_after_oom):
            yield

    def _kept_after_oom(self) -> str:
        """What a run stopped by out of memory keeps. Stages 1-2 on one rank: a state of the last optimizer step
        (the failed micro-batch's gradients are not kept). With more ranks (saving is collective, and the other
        ranks are elsewhere) and in stage 3 (whose update may already have taken optimizer steps): the last state
        saved before."""
        if self._save_on_oom and E.world_size() == 1 and (saved := self.save()) is not None:
            return f"kept the state of step {self.step}: {saved}; continue with --resume"
        return self.stage.advisor.last_state_kept()

    def save(self, fields: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path | None:
        """A state of this step (``fields`` default: the position and ``extras``); None inside a
        gradient-accumulation window, where no state is exact (DeepSpeed checkpoints hold no partial gradients)."""
        if any(eng.micro_steps % self.accumulation for eng in self.engines.values()):
            self.stage.log(f"no state at step {self.step}: it ends inside a gradient-accumulation window")
            return None
        fields = {**self.position, **self.extras} if fields is None else fields
        if self.health is not None:  # the monitor as it is now: its windows and baselines go on after a resume
            fields = {**fields, "health": self.health.state_dict()}
        return self.ckpt.save(self.step, fields, tensors)

    def _start_state(self, save: Callable[[], Path | None]) -> None:
        """Under ``--on-alarm rollback``, a state of step 0 before a new run's first step: an alarm whose window
        reaches back to the start of the run then has a state to return to."""
        if self.step == 0 and self.resumed_from is None and self.health is not None and \
                self.health.args.on_alarm == "rollback":
            save()

    def _after_step(self, total_steps: int, save: Callable[[], Path | None]) -> None:
        if self.health is not None:
            self.health.respond(self)
        if self.save_interval and self.step % self.save_interval == 0 and self.step < total_steps:
            save()

    def run(self, loader: DataLoader, epochs: int, total_steps: int, micro_step: Callable[[dict[str, Any]], None],
            on_step: Callable[[int, int], None]) -> None:
        """Stages 1-2: ``micro_step(batch)`` runs forward, backward and ``engine.step()`` on one micro-batch (on the
        device); ``on_step(step, epoch)`` follows each optimizer step (metrics, logging, evaluation)."""
        dev = E.device()
        engine = next(iter(self.engines.values()))
        self._save_on_oom = True
        with save_on_interrupt(self.save):
            self._start_state(self.save)
            for epoch, done, batch in resumable_batches(loader, epochs, self.position["epoch"],
                                                        self.position["batches"]):
                if self.step >= total_steps:
                    break
                steps_before = engine.global_steps
                micro_step(to_device(batch, dev))
                if engine.global_steps == steps_before:  # inside a gradient-accumulation window
                    continue
                self.step += 1
                self.position = {"epoch": epoch, "batches": done}
                on_step(self.step, epoch)
                self._after_step(total_steps, self.save)
            if self.save_final:
                self.save()

    def updates(self, total_steps: int, state: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]],
                keep_boundary: bool = False,
                boundary: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None
                ) -> Iterator[int]:
        """Stage 3: yields each step number in turn; the caller runs the update in the loop body. A state holds
        the fields and tensors ``state()`` gives at that moment. The first Ctrl-C stops after the current step, with
        a state saved (``stop_after_step``). ``keep_boundary``: keep a copy of each step's starting fields, tensors
        and RNG for ``save_last_step`` (a copy per step, so only where a step can fail before its update: remote
        rewards, a sampler in another process), taken by ``boundary`` where given (what can be had at once: the copy
        must not wait), else by ``state``."""

        def save() -> Path | None:
            return self.save(*state())

        self._save_now = save
        with stop_after_step(self.stage.log) as stop:
            self._start_state(save)
            while self.step < total_steps:
                if keep_boundary:
                    fields, tensors = (boundary or state)()
                    self._boundary = (copy.deepcopy(fields), tensors, _rng_state())
                yield self.step + 1
                self.step += 1
                if stop.requested() and self.step < total_steps and (saved := save()) is not None:
                    raise Interrupted(f"interrupted: saved {saved}; continue with --resume")
                self._after_step(total_steps, save)
            if self.save_final:
                save()

    def save_last_step(self) -> Path | None:
        """Stage 3, from inside a step before its update (a reward source went down while scoring): a state of the
        last completed step. The fields, tensors and RNG are those kept at the step boundary, the engines those the
        unfinished step has not changed yet, so a resumed run goes on as an uninterrupted one."""
        if self._boundary is None:
            return None
        fields, tensors, rng = self._boundary
        now = _rng_state()
        _set_rng_state(rng)
        try:
            return self.save(fields, tensors)
        finally:
            _set_rng_state(now)


class Interrupted(UserError):
    """Ctrl-C: the state was saved; exit 130 like any interrupted command."""

    exit_code = ExitCode.INTERRUPTED


def sigint_unless_exiting(signum: int, frame: Any) -> None:
    """Python's own Ctrl-C (``KeyboardInterrupt``), except while the interpreter joins threads on its way out:
    a Ctrl-C there (say a second one after an interrupted run, waiting for the TensorBoard writer's thread)
    would only print a stray ``Exception ignored in threading._shutdown`` traceback."""
    import threading

    if not threading.main_thread().is_alive():  # false only once the interpreter has begun shutting down
        return
    raise KeyboardInterrupt


def quiet_interrupts_at_exit() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, sigint_unless_exiting)


@contextlib.contextmanager
def save_on_interrupt(save: Callable[[], Path | None]) -> Iterator[None]:
    """Ctrl-C inside the block saves a resumable state (via ``save``) and exits cleanly."""
    try:
        yield
    except KeyboardInterrupt:
        path = save()
        where = f"saved {path}; continue with --resume" if path else "nothing to save yet"
        raise Interrupted(f"interrupted: {where}") from None


class StopRequest:
    """Set by the first Ctrl-C inside ``stop_after_step``; read once per step with ``requested()``."""

    def __init__(self) -> None:
        self.flag = False

    def requested(self) -> bool:
        """Whether any rank was interrupted (collective: every rank must call it at the same step, so all of them
        stop at the same step rather than leaving the others in a collective)."""
        return bool(E.all_reduce_max(torch.tensor(float(self.flag))).item())


@contextlib.contextmanager
def stop_after_step(log: Callable[[str], None]) -> Iterator[StopRequest]:
    """Ctrl-C ends the run at the next step boundary instead of mid-step.

    A stage-3 step is long (generation, scoring, several optimizer steps); a state saved half-way through it
    would not be the state of any step. The first SIGINT only sets a flag the loop polls after each step (then
    it saves and raises ``Interrupted``); a second one stops at once without saving.
    """
    import signal

    stop = StopRequest()

    def handler(signum: int, frame: Any) -> None:
        if stop.flag:
            raise Interrupted("interrupted twice: stopped without saving a state")
        stop.flag = True
        log("interrupt: saving a state after this step (Ctrl-C again to stop without one)")

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started with SIGINT ignored (nohup, `cmd &`): respected
        yield stop
        return
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no handler, Ctrl-C behaves as usual
        yield stop
        return
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)

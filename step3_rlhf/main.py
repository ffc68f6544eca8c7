"""Stage 3: RLHF with PPO over four DeepSpeed engines (actor, reference, critic, reward), or the GRPO family.

    python step3_rlhf/main.py --actor-model out/step1/model --reward-model out/step2/model --output-dir out/step3
    deepspeed --num_gpus 8 step3_rlhf/main.py --actor-zero-stage 3 --enable-hybrid-engine ...
    python step3_rlhf/main.py --algo grpo --actor-model out/step1/model --data prompts.jsonl \\
        --reward-funcs format --reward-funcs accuracy --loss-type dapo
    dschat train --step 3 ...        (the same flags)

Reads top to bottom: set up, evaluate, loop (one ``step()`` of the chosen algorithm per update: ``dschat/rlhf/
ppo.py``, ``grpo.py``, ...), evaluate, save. The parts live in ``dschat.rlhf`` (see docs/architecture.md).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dschat.cli.options import run_command, stage_command
from dschat.rlhf.config import RLHFConfig

if TYPE_CHECKING:
    import torch


def run(cfg: RLHFConfig) -> dict[str, Any]:
    # The training stack (torch, DeepSpeed, transformers) is imported by the run, not by the module: declaring the
    # flags (``--help``, ``dschat plan``, ``dschat doctor``) needs none of it.

    import torch

    from dschat import engine as E
    from dschat.agents.agent import build_agent
    from dschat.data import load_phase
    from dschat.demo import demo_data
    from dschat.errors import UserError
    from dschat.generation.decode import GenerationConfig
    from dschat.generation.hybrid_engine import make_hybrid_engine
    from dschat.generation.sampler import SamplerLost
    from dschat.models.loading import load_tokenizer, resolve_model
    from dschat.rewards.remote import RewardServerDown, is_remote
    from dschat.rlhf.async_rollouts import make_rollouts
    from dschat.rlhf.config import check_config, check_reward_data
    from dschat.rlhf.ema import ActorEMA
    from dschat.rlhf.engines import build_models
    from dschat.rlhf.evaluation import eval_scalars, source_summary, summarize
    from dschat.rlhf.scoring import RM, build_scorer
    from dschat.training.checkpoint import save_hf
    from dschat.training.health import Context, HealthMonitor
    from dschat.training.run_tracker import RunTracker, write_eval
    from dschat.training.stage import EpochStream, ResumableLoop, begin_stage, eval_loader, training_loader

    check_config(cfg)
    Algo, d, o, rl = cfg.algorithm.load(), cfg.data, cfg.optim, cfg.rl  # the run-time class of --algo
    stage = begin_stage(cfg, "step3_rlhf", f"output/{Algo.output_name}")
    tok = load_tokenizer(resolve_model(cfg.actor.model), cfg.model.trust_remote_code)
    agent = build_agent(cfg.agent)  # tools and environments, if any (their schemas go to the chat template)
    if agent is not None:
        agent.warm()  # the tools' workers start while the models load
    with E.main_process_first():  # without --data: the algorithm's demo file (e.g. prompts with checkable answers)
        data = load_phase(d, 3, tok, cfg.run.seed, log=stage.log if E.is_main() else (lambda _: None),
                          default_data=lambda: demo_data(Algo.demo_data), tokenize_as=Algo.tokenize_as,
                          tools=agent.tool_schemas if agent is not None and agent.tools else None)
    check_reward_data(cfg.reward_func_names(), data.train + data.eval)
    if agent is not None:
        agent.check_rows(data.train + data.eval)  # every row's environment, before anything trains
    collator = Algo.collator(tok.pad_token_id)  # prompts (PPO, GRPO) or pairs (DPO)
    prompts = training_loader(data.train, Algo.batch_size(cfg), collator, cfg.run.seed, d)  # rows per update
    evals = eval_loader(data.eval, o.per_device_eval_batch_size, collator)
    per_epoch, micro_per_update = Algo.plan(cfg, len(prompts))
    total_updates = o.max_steps if o.max_steps > 0 else per_epoch * o.num_train_epochs  # the stream cycles epochs
    optimizer_steps = max(1, total_updates * micro_per_update // o.gradient_accumulation_steps)

    # 1. the engines, the generation path, the reward sources
    models = build_models(cfg, optimizer_steps)
    hybrid = make_hybrid_engine(models.actor, tok, rl.enable_hybrid_engine, rl.generation_backend, cfg.vllm,
                                max_model_len=d.max_prompt_seq_len + rl.max_answer_seq_len, agent=agent)
    scorer = build_scorer(cfg, models) if cfg.reward_func_names() else None  # DPO without rewards: none
    gen = GenerationConfig.from_flags(rl)
    ema = ActorEMA(models.actor, cfg.engines.ema_decay) if cfg.engines.enable_ema else None

    # 2. resume: the trained engines, the algorithm's state, the prompt stream's position, the shuffle generator
    loop = ResumableLoop(stage, models.trained, tok, cfg.run, accumulation=o.gradient_accumulation_steps)
    resume_from, state, tensors = loop.resumed_from, loop.state, loop.tensors
    if ema is not None and resume_from is not None:
        if "ema" not in tensors:
            raise UserError(f"{resume_from}: saved without --enable-ema; resume without it or start over")
        ema.load_full_state(tensors["ema"])
    shuffle = torch.Generator().manual_seed(cfg.run.seed)
    if "shuffle" in tensors:
        shuffle.set_state(tensors["shuffle"])
    # the answers: sampled here between updates, or by a sampler process while the trainer trains
    rollouts = make_rollouts(cfg, hybrid, tok, loop.step, state, tensors, stage.log)
    algo = Algo(cfg, models, rollouts.engine, scorer, gen, shuffle, ema, loop)
    stream = rollouts.watch(EpochStream(prompts, state.get("prompt_batches", 0), what="prompt batches"))
    tools = f" | {agent.describe()}" if agent is not None else ""
    stage.log(f"actor {cfg.actor.model} | {algo.describe()}{tools} | prompts {len(data.train)} "
              f"(eval {len(data.eval)}) | "
              f"{total_updates} updates, {optimizer_steps} optimizer steps | ZeRO actor "
              f"{cfg.actor_engine.zero_stage} | world {E.world_size()} | {rollouts.describe()}")

    # 3. evaluate before training (kept in the state, so a resumed run compares with the same numbers)
    def evaluation() -> dict[str, Any]:
        if not data.eval:
            return {}
        try:
            return algo.evaluate(evals)
        finally:
            hybrid.release()  # its captured graphs go before training
            hybrid.capture_metrics()  # and their count is no step's
    kept = state.get("before") or {}
    samples = kept.get("eval_samples", 1)  # runs saved before the flag sampled one answer per prompt
    if kept and samples != rl.eval_samples:  # the gain pairs before and after prompt by prompt
        raise UserError(f"{resume_from}: its before-training evaluation sampled {samples} answer(s) per prompt; "
                        f"resume with --eval-samples {samples} or start over")
    before = kept or evaluation()
    tracker = RunTracker(stage.output_dir, E.is_main(), total_updates, cfg.run.progress, desc=rl.algo)
    staleness = cfg.rollouts.max_staleness if cfg.rollouts.enabled else None
    health = HealthMonitor(cfg.health, 3, stage.output_dir, Context(rl.max_answer_seq_len, models.reward_stats,
                                                                    tuple(cfg.reward_func_names()), staleness),
                           log=stage.log, tracker=tracker)
    loop.watch(health)
    if before and resume_from is None:
        tracker.log(0, eval_scalars(before))
        tracker.log_samples(0, before.get("samples"))
        health.observe(0, eval_scalars(before))
    dropped_total = state.get("dropped_short_answers", 0)
    tracker.advance(loop.step)

    def state_now(wait: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """What a state holds besides the engines: its fields and its tensors (the answers sampled ahead in both,
        from one look; ``wait``: for those still being sampled)."""
        answers, answer_tensors = rollouts.state(wait)
        return ({"prompt_batches": stream.consumed, **algo.state(), "dropped_short_answers": dropped_total,
                 "before": before, **answers},
                {"shuffle": shuffle.get_state(), **({"ema": ema.full_state(as_model=False)} if ema is not None else {}),
                 **answer_tensors})

    # 4. the loop: one algorithm step per update; Ctrl-C stops at a step boundary with a state saved; the health
    # monitor watches each step's metrics and each evaluation and acts after the step (--on-alarm)
    try:
        remote = any(is_remote(name) for name in cfg.reward_func_names())
        for step in loop.updates(total_updates, state_now, keep_boundary=remote or rollouts.can_fail,
                                 boundary=lambda: state_now(wait=False)):
            try:
                if agent is not None:
                    agent.take_metrics()  # the step's episodes alone, not an evaluation's before it
                with rollouts.step():
                    metrics, dropped = algo.step(stream)
            except (RewardServerDown, SamplerLost) as e:  # before the update: keep the last completed step
                saved = loop.save_last_step()
                server = "server" if isinstance(e, RewardServerDown) else "sampler"
                where = f"the state of step {loop.step} is {saved}; continue with --resume once the {server} " \
                        "answers" if saved else "no state could be saved"
                raise type(e)(f"{e}; {where}") from None
            rollouts.updated(step)  # the new weights go to a sampler while the step's figures are made
            dropped_total += dropped
            metrics.update({"train/dropped_short_answers": dropped_total, **(scorer.stats() if scorer else {}),
                            **hybrid.sync_metrics(), **(agent.take_metrics() if agent is not None else {}),
                            **rollouts.take_metrics()})
            for name, engine in models.trained.items():
                if norms := E.take_grad_norms(engine):
                    metrics[f"train/{name}_grad_norm"] = max(norms)
            health.observe(step, metrics)
            if step % cfg.run.log_interval == 0 or step == total_updates:
                tracker.log(step, metrics)
            tracker.advance(1, **{k: metrics[f"train/{k}"] for k in ("reward", "kl") if f"train/{k}" in metrics})
            if cfg.run.eval_interval and step % cfg.run.eval_interval == 0 and data.eval:
                result = evaluation()
                scalars = eval_scalars(result)
                tracker.log(step, scalars)
                tracker.log_samples(step, result.get("samples"))
                health.observe(step, scalars)
        step = loop.step

        # 5. evaluate after training, save the models and eval.json
        after = evaluation()
        if after:
            tracker.log(step, eval_scalars(after))
            tracker.log_samples(step, after.get("samples"))
            health.observe(step, eval_scalars(after))
            health.respond(loop, final=True)
    except BaseException:
        rollouts.close()
        hybrid.close()  # a rollback runs the stage again in this process: no engine may stay behind
        raise
    finally:
        tracker.close()
    for name, engine in models.trained.items():
        save_hf(engine, tok, stage.output_dir / name)
    if ema is not None:
        save_hf(models.actor, tok, stage.output_dir / "actor_ema", state_dict=ema.full_state())
    metrics = {"algo": rl.algo, **summarize(before, after), "steps": step, "alarms": health.summary(),
               "dropped_short_answers": dropped_total,
               **data.counts, "sources": data.sources, **algo.summary(before, after)}
    if scorer is not None and scorer.mixer.names != [RM]:  # per-source means when there is more than the reward model
        metrics.update(source_summary(before, after, scorer))
    if E.is_main():
        write_eval(stage.output_dir, metrics)
        if before.get("reward") is not None and after.get("reward") is not None:
            kl = f" | KL {after['kl']:.3f}" if after["kl"] is not None else ""
            stage.log(f"reward {before['reward']:.3f} ± {before['reward_se']:.3f} -> {after['reward']:.3f} ± "
                      f"{after['reward_se']:.3f} (gain {metrics['reward_gain']:.3f} ± {metrics['reward_gain_se']:.3f})"
                      f"{kl} | saved {stage.output_dir}")
    rollouts.close()
    hybrid.close()  # a vLLM engine goes before the process group it runs in
    return metrics


command = stage_command("step3_rlhf", RLHFConfig, run,
                        help="Stage 3: RLHF with PPO, the GRPO family (--algo grpo), DPO and more (--algo).")

if __name__ == "__main__":
    run_command(command)

"""The four-model engine set of stage 3: actor (trained), reference (frozen copy of the actor), critic (trained,
from the reward model unless ``--critic-model``) and reward model (frozen); an algorithm asks only for what it
uses (``Algorithm.needs``), so GRPO with beta 0 loads the actor alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dschat import engine as E
from dschat.devices import resolve_dtype
from dschat.errors import UserError
from dschat.models.loading import (
    create_causal_lm,
    create_reward_model,
    frozen_causal_lm,
    frozen_reward_model,
    load_tokenizer,
    resolve_model,
    resolve_saved_model,
    same_tokenizer,
)
from dschat.models.lora import lora_param_groups
from dschat.models.reward_model import check_reward_checkpoint
from dschat.rewards.functions import RM

TINY_PARAMS = 50_000_000  # below this, a model is a from-scratch toy and takes toy-sized learning rates
DEFAULT_LR = {"actor": (1e-4, 1e-6), "critic": (5e-4, 5e-6)}  # (tiny, real)


@dataclass
class Models:
    actor: Any  # training engine
    ref: Any | None  # frozen (engine under ZeRO-3, else module); None when the algorithm needs no reference
    critic: Any | None  # training engine; None without a critic
    reward: Any | None  # frozen; None when no reward source needs it
    tokenizer: Any
    reward_tokenizer: Any | None
    reward_stats: tuple[float, float] | None  # the reward model's eval (mean, std) from its config

    @property
    def trained(self) -> dict[str, Any]:
        """The engines a resumable state holds; the frozen ones reload from their paths."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}


def default_lr(cfg: Any, who: str, model: torch.nn.Module) -> float:
    given = getattr(cfg, f"{who}_optim").learning_rate
    if given is not None:
        return given
    tiny, real = DEFAULT_LR[who]
    return tiny if sum(t.numel() for t in model.parameters()) < TINY_PARAMS else real


def _train_engine(cfg: Any, who: str, model: torch.nn.Module, dtype: torch.dtype, total_steps: int,
                  hybrid: dict[str, Any] | None = None) -> Any:
    optim, lora = cfg.optim_of(who), cfg.lora_of(who)
    lr = default_lr(cfg, who, model)
    return E.build_train_engine(model, engine=cfg.engine_of(who), optim=optim, dtype=dtype, total_steps=total_steps,
                                lr=lr, hybrid_engine=hybrid,
                                param_groups=lora_param_groups(model, optim.weight_decay, lr, lora.lora_learning_rate))


def build_models(cfg: Any, total_steps: int) -> Models:
    """The engines ``cfg.algorithm`` needs, each with its ZeRO stage, offload, LoRA and optimizer settings."""
    m, e = cfg.model, cfg.engines
    needs = cfg.algorithm.needs(cfg)
    need_reward = RM in cfg.reward_func_names()
    actor_path = resolve_model(cfg.actor.model)
    reward_path = resolve_model(cfg.rewards.reward_model) if need_reward else ""
    tok = load_tokenizer(actor_path, m.trust_remote_code)
    rm_tok = load_tokenizer(reward_path, m.trust_remote_code) if need_reward else None
    critic_path = ""
    if "critic" in needs:
        critic_path = resolve_model(cfg.critic.model) if cfg.critic.model else reward_path
        if not same_tokenizer(tok, load_tokenizer(critic_path, m.trust_remote_code)):
            raise UserError(f"the critic ({critic_path}) must share the actor's tokenizer; pass --critic-model with a "
                            "reward model (or the actor) trained on the actor's tokenizer")
    dtype = resolve_dtype(m.dtype)

    actor_lora = cfg.lora_of("actor")
    actor = create_causal_lm(actor_path, dtype, cfg.actor.dropout, cfg.actor.gradient_checkpointing,
                             m.trust_remote_code, lora=actor_lora)
    # DeepSpeed's hybrid engine fuses its own LoRA layers, not PEFT's: with actor LoRA the fallback generates.
    hybrid = {"max_out_tokens": cfg.data.max_prompt_seq_len + cfg.rl.max_answer_seq_len} \
        if cfg.rl.enable_hybrid_engine and torch.cuda.is_available() and not actor_lora.lora_dim else None
    actor_engine = _train_engine(cfg, "actor", actor, dtype, total_steps, hybrid)
    ref_engine = None
    if "reference" in needs:
        ref = create_causal_lm(actor_path, dtype, cfg.actor.dropout, False, m.trust_remote_code)
        stage = e.reference_zero_stage if e.reference_zero_stage is not None else cfg.actor_engine.zero_stage
        ref_engine = E.build_eval_engine(ref, zero_stage=stage, offload=e.offload_reference_model, dtype=dtype)
    critic_engine = None
    if "critic" in needs:
        critic = create_reward_model(critic_path, dtype, cfg.critic.dropout, cfg.critic.gradient_checkpointing,
                                     tok.pad_token_id, m.trust_remote_code, lora=cfg.lora_of("critic"))
        critic_engine = _train_engine(cfg, "critic", critic, dtype, total_steps)
    reward_engine, stats = None, None
    if need_reward:
        assert rm_tok is not None
        reward = create_reward_model(reward_path, dtype, 0.0, False, rm_tok.pad_token_id, m.trust_remote_code)
        if getattr(reward.config, "reward_mean", None) is not None:
            stats = (float(reward.config.reward_mean), float(getattr(reward.config, "reward_std", 1.0) or 1.0))
        stage = e.reward_zero_stage if e.reward_zero_stage is not None else cfg.critic_engine.zero_stage
        reward_engine = E.build_eval_engine(reward, zero_stage=stage, offload=e.offload_reward_model, dtype=dtype)
    return Models(actor_engine, ref_engine, critic_engine, reward_engine, tok, rm_tok, stats)


def reward_model_path(reward_model: str) -> str:
    """``--reward-model`` as a folder: a stage-2 output folder stands for its ``model/``."""
    return resolve_saved_model(reward_model, inside=("model",))


def frozen_models(policy_path: str, tokenizer: Any, dtype: torch.dtype, reward_path: str = "",
                  reference_path: str = "", trust_remote_code: bool = False) -> Models:
    """Saved models, all frozen on this process's device: the policy (and a reference, whose KL the policy is
    measured against) and, with ``reward_path``, the reward model with its own tokenizer. What ``dschat generate``
    and ``dschat eval --step 3`` sample and score with; ``build_scorer`` takes it as it takes stage 3's set."""
    policy = frozen_causal_lm(policy_path, dtype, trust_remote_code)
    ref = frozen_causal_lm(reference_path, dtype, trust_remote_code) if reference_path else None
    reward, rm_tok = None, None
    if reward_path:
        check_reward_checkpoint(reward_path, trust_remote_code)
        rm_tok = load_tokenizer(reward_path, trust_remote_code)
        reward = frozen_reward_model(reward_path, dtype, rm_tok.pad_token_id, trust_remote_code)
    return Models(policy, ref, None, reward, tokenizer, rm_tok, None)

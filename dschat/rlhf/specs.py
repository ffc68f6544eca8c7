"""What each stage-3 algorithm is before anything loads: its own flags (``PPOArgs``, ``GRPOArgs``, ``DPOArgs``,
``RLOOArgs``, pieces of ``RLHFConfig``) and its spec, the class that answers from the flags alone what the config,
``dschat plan`` and ``dschat doctor`` ask (``uses``, ``needs``, ``reward_func_names``, ``inert_flags``,
``check_config``, ``batch_size``, ``plan``, ...).

The split is TRL's between ``GRPOConfig`` and ``GRPOTrainer``: this module imports neither torch nor DeepSpeed,
so ``dschat train --step 3 --help``, the flag checks and ``dschat plan`` stay light. The run-time class of each
algorithm (``ppo.PPO``, ``grpo.GRPO``, ...) inherits its spec and adds what a run does (``__init__``, ``step``,
``evaluate``, ...); ``spec.load()`` imports it. The specs derive from one another as the run-time classes do: RLOO,
REINFORCE++ and ReMax from GRPO, online DPO beside DPO (whose checks it reuses).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from dschat.config import SAMPLING_ALARMS, VLLM_FLAGS, arg
from dschat.errors import UserError
from dschat.rewards.names import RM

DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, sec. 3.1)
DPO_LOSS_TYPES = ("sigmoid", "ipo", "cdpo", "simpo")
PPO_FLAGS = frozenset({"ppo.kl_ctl", "ppo.gamma", "ppo.clip_reward_value"})  # the PPO flags REINFORCE++ reads


# ------------------------------------------------------------------------------------------------------ flags
@dataclass
class PPOArgs:
    ppo_epochs: int = arg(1, "Passes over each batch of experience.", low=1)
    generation_batches: int = arg(1, "Generation batches collected before each PPO update.", low=1)
    kl_ctl: float = arg(0.1, "KL penalty coefficient in the per-token reward.", low=0)
    kl_target: float | None = arg(None, "Target KL for the adaptive controller (Ziegler et al. 2019); "
                                        "unset keeps kl_ctl fixed.", above=0)
    kl_horizon: int = arg(10000, "Horizon of the adaptive KL controller.", low=1)
    clip_reward_value: float = arg(5.0, "Reward scores are clipped to [-c, c].", above=0)
    cliprange: float = arg(0.2, "Policy ratio clip.", above=0)
    cliprange_value: float = arg(0.2, "Critic value clip.", above=0)
    gamma: float = arg(1.0, "Discount.", low=0)
    lam: float = arg(0.95, "GAE lambda.", low=0)
    whiten_advantages: bool = arg(True, "Whiten advantages over the answer tokens of each experience batch.")
    normalize_reward: bool = arg(False, "Normalise scores by the reward model's eval mean/std (from its config).")
    missing_eos_penalty: float | None = arg(None, "Subtracted from the score of answers that never reached EOS.")
    unsup_data: list[str] = arg(help="SFT-format data for the mixed pretraining loss (repeatable).", factory=list)
    unsup_coef: float = arg(27.8, "Weight of the mixed pretraining loss (InstructGPT's PPO-ptx gamma).")


@dataclass
class GRPOArgs:
    num_generations: int = arg(4, "Completions per prompt (G, one group).", low=2)
    num_iterations: int = arg(1, "Policy passes over each generation (mu); > 1 caches the old log-probs.", low=1)
    beta: float = arg(0.04, "KL coefficient to the reference; 0 loads no reference model.", low=0)
    kl_estimator: str = arg("k3", "Estimator of KL(policy || reference) in the loss (Schulman 2020).",
                            choices=("k1", "k2", "k3"))
    epsilon: float = arg(0.2, "Lower ratio clip: clip(ratio, 1 - epsilon, 1 + epsilon_high).", above=0)
    epsilon_high: float | None = arg(None, f"Upper ratio clip (default: --epsilon; {DAPO_EPS_HIGH} with "
                                           "--loss-type dapo, DAPO's clip-higher).", above=0)
    scale_rewards: str = arg("group", "Advantage scale: reward minus group mean, divided by the group's std, the "
                                      "batch's std, or nothing (Dr. GRPO).", choices=("group", "batch", "none"))
    loss_type: str | None = arg(None, "Loss aggregation: grpo (per-sequence token mean), dr_grpo (sum / (batch * "
                                      "max length)), dapo (token mean over the batch; clip-higher, dynamic "
                                      "sampling), gspo (sequence-level ratio). Default: grpo; remax: dr_grpo.",
                                choices=("grpo", "dr_grpo", "dapo", "gspo"))
    dynamic_sampling: bool | None = arg(None, "Drop groups whose rewards are all equal and generate more prompts to "
                                              "refill the batch (DAPO). Default: on with --loss-type dapo only.")
    max_resample_rounds: int = arg(3, "Extra generation rounds per step to refill dropped groups (dynamic "
                                      "sampling); the step trains on what it has after them.", low=0)
    mask_truncated_completions: bool = arg(False, "Completions that never reached EOS get a zero action mask.")
    overlong_penalty: bool | None = arg(None, "Add the reward 'overlong' (DAPO's soft overlong punishment, weight "
                                              "1) to the reward functions. Default: on with --loss-type dapo only.")

    @property
    def eps_high(self) -> float:
        if self.epsilon_high is not None:
            return self.epsilon_high
        return DAPO_EPS_HIGH if self.loss_type == "dapo" else self.epsilon

    @property
    def dynamic(self) -> bool:
        return self.dynamic_sampling if self.dynamic_sampling is not None else self.loss_type == "dapo"

    @property
    def overlong(self) -> bool:
        return self.overlong_penalty if self.overlong_penalty is not None else self.loss_type == "dapo"


def grpo_flags(*without: str) -> frozenset[str]:
    """``uses`` entries for an algorithm that reads GRPO's flags except ``without`` (``"grpo.<field>"`` each):
    the flags left out are refused under it, as another algorithm's are."""
    names = {f.name for f in fields(GRPOArgs)}
    if unknown := set(without) - names:
        raise ValueError(f"not GRPO flags: {sorted(unknown)}")
    return frozenset(f"grpo.{n}" for n in names - set(without))


@dataclass
class RLOOArgs:
    kl_in_reward: bool = arg(False, "RLOO: fold the KL to the reference (--beta times the summed k1 estimate of each "
                                    "answer) into its reward before the leave-one-out baseline, as TRL's and "
                                    "OpenRLHF's RLOO do, instead of adding beta * k3 to the loss.")


@dataclass
class DPOArgs:
    dpo_loss_type: str = arg("sigmoid", "DPO loss: sigmoid (DPO), ipo (on length-averaged log-ratios; its reported "
                                        "rewards on summed ones, as TRL's), cdpo (label "
                                        "smoothing, --label-smoothing), simpo (no reference, length-normalised, "
                                        "margin --simpo-gamma).", choices=DPO_LOSS_TYPES)
    dpo_beta: float | None = arg(None, "DPO's beta (IPO's tau) [default 0.1; 2.0 with simpo, SimPO's setting].",
                                 above=0)
    label_smoothing: float = arg(0.0, "cdpo: the probability that a preference label is flipped, in [0, 0.5).",
                                 low=0)
    simpo_gamma: float = arg(0.5, "simpo: the target reward margin gamma subtracted inside the sigmoid.", low=0)
    rpo_alpha: float = arg(0.0, "Weight of the chosen answers' negative log-likelihood per token (a mean over all "
                                "chosen tokens of the batch, as TRL's rpo_alpha) added to the loss (RPO: Pang et al. "
                                "2024, arXiv:2404.19733). DPO alone can lower the likelihood of both answers and "
                                "drift; this keeps the chosen ones likely.", low=0)

    @property
    def beta(self) -> float:
        if self.dpo_beta is not None:
            return self.dpo_beta
        return 2.0 if self.dpo_loss_type == "simpo" else 0.1

    def inert_fields(self) -> dict[str, str]:
        out = {}
        if self.dpo_loss_type != "cdpo":
            out["label_smoothing"] = "without {dpo_loss_type} cdpo"
        if self.dpo_loss_type != "simpo":
            out["simpo_gamma"] = "without {dpo_loss_type} simpo"
        return out


ASYNC_FLAGS = ("async_rollouts", "sampler", "sampler_devices", "max_staleness", "sampler_timeout")


def no_importance_sampling(algo: str) -> dict[str, str]:
    """The vLLM importance-sampling flags under an algorithm without a policy-gradient loss to weigh."""
    return {n: f"with --algo {algo} (no policy-gradient loss to weigh)"
            for n in ("vllm_importance_sampling", "vllm_importance_sampling_cap")}


def no_reference(cfg: Any) -> dict[str, str]:
    """The reference model's settings under ``--dpo-loss-type simpo`` (offline and online DPO)."""
    if cfg.dpo.dpo_loss_type != "simpo":
        return {}
    return {n: "with --dpo-loss-type simpo (no reference)" for n in ("reference_zero_stage", "offload_reference_model")}


def scoring_forwards(cfg: Any, rows: int) -> list[tuple[str, int]]:
    """The scoring forwards over ``rows`` answers: the reward model (``rm``) and a generative judge (``judge``,
    each answer judged in both orders)."""
    from dschat.rewards.names import JUDGE

    names = cfg.reward_func_names()
    return ([("reward", rows)] if RM in names else []) + ([("judge", 2 * rows)] if JUDGE in names else [])


# ------------------------------------------------------------------------------------------------------ specs
class AlgorithmSpec:
    """The config-time part of an algorithm (the contract: ``dschat.rlhf.algorithms``). ``runtime`` names its
    run-time class as ``"module:Class"``; ``load()`` imports it (torch, DeepSpeed) and returns it."""

    name: ClassVar[str]
    help: ClassVar[str]
    uses: ClassVar[frozenset[str]]
    output_name: ClassVar[str]  # the default --output-dir under output/
    demo_data: ClassVar[str]  # without --data: the demo file
    tokenize_as: ClassVar[int]  # the phase-3 part of --data is tokenized as this phase's rows
    runtime: ClassVar[str]

    @classmethod
    def load(cls) -> type[Any]:
        module, _, attr = cls.runtime.partition(":")
        return getattr(importlib.import_module(module), attr)

    # What a training step holds in memory, for ``dschat plan`` (``dschat.planning.plan``): per rank, from the flags
    # alone, as the run-time class's ``step()`` does it. Rows count sequences of prompt + answer.
    @staticmethod
    def sampled_per_prompt(cfg: Any) -> int:
        """Answers a training step samples per prompt (0: it samples none)."""
        return 0

    @staticmethod
    def generation_rows(cfg: Any) -> int:
        """Rows of the step's largest single generation call (0: no generation in training)."""
        return 0

    @staticmethod
    def experience_forwards(cfg: Any) -> list[tuple[str, int]]:
        """``(role, rows)`` of the forwards without gradient over a step's rows, one at a time: ``actor`` (old
        log-probs), ``reference``, ``critic`` (old values), ``reward`` (the reward model), ``judge`` (a generative
        judge, its completions)."""
        return []

    @staticmethod
    def train_rows(cfg: Any) -> int:
        """Sequences in one training micro-batch."""
        return int(cfg.optim.per_device_train_batch_size)


class OnPolicySpec(AlgorithmSpec):
    """Defaults of the algorithms that learn from the policy's own samples (PPO, the GRPO family, online DPO)."""

    tokenize_as = 3  # prompts

    @staticmethod
    def batch_size(cfg: Any) -> int:
        """Dataset rows (prompts) per update: a generation batch."""
        return int(cfg.rl.per_device_generation_batch_size)

    @staticmethod
    def inert_flags(cfg: Any) -> dict[str, str]:
        # Training rows are the policy's own samples, batched by the algorithm: the data flags that shape training
        # batches of dataset rows have nothing to act on.
        why = f"with --algo {cfg.rl.algo} (it trains on its own samples, not on dataset rows)"
        return {"packing": why, "group_by_length": why}


class PPOSpec(OnPolicySpec):
    name = "ppo"
    help = "PPO with actor, critic, reference and reward model"
    uses = frozenset({"ppo", "critic", "critic_optim", "critic_engine", "critic_lora"})
    output_name = "step3_rlhf"
    demo_data = "pairwise"  # without --data: the demo corpus (its phase-3 prompts)
    runtime = "dschat.rlhf.ppo:PPO"

    @staticmethod
    def needs(cfg: Any) -> set[str]:
        return {"reference", "critic"}

    @staticmethod
    def reward_func_names(cfg: Any) -> list[str]:
        return list(cfg.rewards.reward_funcs) or [RM]  # the reward model unless told otherwise

    @staticmethod
    def check_config(cfg: Any) -> None:
        if not cfg.rewards.reward_model and not cfg.critic.model:
            raise UserError("stage 3 with --algo ppo needs --actor-model (a step-1 output) and --reward-model (a "
                            "step-2 output), or --reward-funcs without 'rm' and a --critic-model")

    @staticmethod
    def plan(cfg: Any, prompt_batches: int) -> tuple[int, int]:
        """``(updates per epoch, optimizer steps per update)``. The mixed pretraining loss takes its own actor
        step after each PPO micro-batch (InstructGPT's PPO-ptx mixes the two losses into one step, as
        DeepSpeed-Chat does; two steps keep the PPO update exactly PPO's, and weight the LM loss by its own rate)."""
        p, o = cfg.ppo, cfg.optim
        rows = cfg.rl.per_device_generation_batch_size * p.generation_batches
        micro = p.ppo_epochs * math.ceil(rows / o.per_device_train_batch_size) * (2 if p.unsup_data else 1)
        return max(1, prompt_batches // p.generation_batches), micro

    @staticmethod
    def sampled_per_prompt(cfg: Any) -> int:
        return 1

    @staticmethod
    def generation_rows(cfg: Any) -> int:
        """One generation per generation batch (``make_experience``), each of ``--per-device-generation-batch-size``
        prompts."""
        return int(cfg.rl.per_device_generation_batch_size)

    @staticmethod
    def experience_forwards(cfg: Any) -> list[tuple[str, int]]:
        rows = PPOSpec.generation_rows(cfg)
        return [("actor", rows), ("reference", rows), ("critic", rows), *scoring_forwards(cfg, rows)]


class GRPOSpec(OnPolicySpec):
    name = "grpo"
    help = "the GRPO family, G completions per prompt and group-relative advantages, no critic"
    uses = frozenset({"grpo"})
    output_name = "step3_grpo"
    demo_data = "prompts"  # without --data: the demo's arithmetic prompts, whose answers the rules can check
    default_loss_type = "grpo"  # without --loss-type
    runtime = "dschat.rlhf.grpo:GRPO"

    @staticmethod
    def needs(cfg: Any) -> set[str]:
        return {"reference"} if cfg.grpo.beta != 0.0 else set()

    @staticmethod
    def reward_func_names(cfg: Any) -> list[str]:
        """--reward-funcs, else rm with a reward model, else format + accuracy; plus 'overlong' with
        --overlong-penalty (default with dapo, whose recipe includes it)."""
        names = list(cfg.rewards.reward_funcs) or ([RM] if cfg.rewards.reward_model else ["format", "accuracy"])
        if cfg.grpo.overlong and "overlong" not in names:
            names.append("overlong")
        return names

    @staticmethod
    def check_config(cfg: Any) -> None:
        if cfg.grpo.num_generations < 2:
            raise UserError("--num-generations must be >= 2: GRPO's advantage compares completions of one prompt")

    @staticmethod
    def plan(cfg: Any, prompt_batches: int) -> tuple[int, int]:
        """``(updates per epoch, optimizer steps' micro-batches per update)``: one prompt batch per update, each
        prompt with G completions, mu passes."""
        rows = cfg.rl.per_device_generation_batch_size * cfg.grpo.num_generations
        return prompt_batches, cfg.grpo.num_iterations * math.ceil(rows / cfg.optim.per_device_train_batch_size)

    @classmethod
    def sampled_per_prompt(cls, cfg: Any) -> int:
        return int(cfg.grpo.num_generations)

    @staticmethod
    def generation_rows(cfg: Any) -> int:
        """The G completions of every prompt of a batch, in one call (``repeat_prompts``). Dynamic sampling's
        refills are further calls of the same size."""
        return int(cfg.rl.per_device_generation_batch_size * cfg.grpo.num_generations)

    @classmethod
    def experience_forwards(cls, cfg: Any) -> list[tuple[str, int]]:
        """Old log-probs (when the sampling pass gave none), the reference's (with a KL), the scores."""
        rows = cls.generation_rows(cfg)
        ref = [("reference", rows)] if "reference" in cls.needs(cfg) else []
        return [("actor", rows), *ref, *scoring_forwards(cfg, rows)]


class RLOOSpec(GRPOSpec):
    name = "rloo"
    help = "RLOO: k completions per prompt, leave-one-out baseline, no critic (Ahmadian et al. 2024)"
    uses = grpo_flags("scale_rewards") | {"rloo"}
    output_name = "step3_rloo"
    runtime = "dschat.rlhf.rloo:RLOO"

    @staticmethod
    def inert_flags(cfg: Any) -> dict[str, str]:
        out = GRPOSpec.inert_flags(cfg)
        if cfg.rloo.kl_in_reward:
            out["kl_estimator"] = "with --kl-in-reward (the reward takes the k1 estimate, as TRL's and OpenRLHF's)"
        return out


class ReinforcePPSpec(GRPOSpec):
    name = "reinforce_pp"
    help = ("REINFORCE++: KL-penalised token rewards, discounted returns whitened over the global batch, PPO "
            "clip, no critic (Hu 2025)")
    # The KL sits in the reward (--kl-ctl), the aggregation is a token mean and no group is dropped, so GRPO's
    # loss-side KL, loss type, reward scaling and dynamic sampling do not apply.
    uses = grpo_flags("beta", "kl_estimator", "scale_rewards", "loss_type", "dynamic_sampling",
                      "max_resample_rounds") | PPO_FLAGS
    output_name = "step3_reinforce_pp"
    runtime = "dschat.rlhf.reinforce_pp:ReinforcePP"

    @staticmethod
    def needs(cfg: Any) -> set[str]:
        return {"reference"} if cfg.ppo.kl_ctl != 0.0 else set()


class ReinforcePPBaselineSpec(ReinforcePPSpec):
    name = "reinforce_pp_baseline"
    help = "REINFORCE++ with the group mean subtracted from each score before global whitening (reasoning tasks)"
    output_name = "step3_reinforce_pp_baseline"
    runtime = "dschat.rlhf.reinforce_pp:ReinforcePPBaseline"


class ReMaxSpec(GRPOSpec):
    name = "remax"
    help = "ReMax: the greedy answer's reward as each prompt's baseline, no critic (Li et al. 2023)"
    uses = grpo_flags("scale_rewards", "dynamic_sampling", "max_resample_rounds")
    output_name = "step3_remax"
    # The greedy baseline is not the group mean, so advantages need not sum to zero: a per-sequence token mean
    # (grpo, gspo) then weighs a short answer's tokens more than a long one's, and a baseline far above the samples'
    # mean pushes every answer down, short ones most (the demo's figures: docs/algorithms.md, the critic-free
    # estimators). REINFORCE's gradient is the sum over an answer's tokens, as dr_grpo's constant normaliser keeps it.
    default_loss_type = "dr_grpo"
    runtime = "dschat.rlhf.remax:ReMax"

    @classmethod
    def sampled_per_prompt(cls, cfg: Any) -> int:
        return int(cfg.grpo.num_generations) + 1  # and the greedy answer of the baseline, in a call of its own


class DPOSpec(AlgorithmSpec):
    name = "dpo"
    help = "offline DPO on preference pairs (sigmoid, ipo, cdpo, simpo)"
    uses = frozenset({"dpo"})
    output_name = "step3_dpo"
    demo_data = "pairwise"
    tokenize_as = 2  # the phase-3 part of --data, tokenized as chosen/rejected pairs
    runtime = "dschat.rlhf.dpo:DPO"

    @staticmethod
    def needs(cfg: Any) -> set[str]:
        return set() if cfg.dpo.dpo_loss_type == "simpo" else {"reference"}

    @staticmethod
    def reward_func_names(cfg: Any) -> list[str]:
        """Only for evaluating sampled answers: --reward-funcs, else rm with --reward-model, else none."""
        return list(cfg.rewards.reward_funcs) or ([RM] if cfg.rewards.reward_model else [])

    @staticmethod
    def inert_flags(cfg: Any) -> dict[str, str]:
        out = {"min_answer_len": "with --algo dpo (no answers are trained on)",
               "per_device_generation_batch_size": "with --algo dpo (an update takes --per-device-train-batch-size "
                                                   "x --gradient-accumulation-steps pairs)"}
        if not DPOSpec.reward_func_names(cfg):
            why = "with --algo dpo without --reward-model or --reward-funcs (no answers are sampled)"
            out.update({n: why for n in ("tools", "env", "temperature", "top_p", "top_k", "max_answer_seq_len",
                                         "eval_samples",
                                         "enable_hybrid_engine", "generation_backend", "reward_weights",
                                         *VLLM_FLAGS)})
        out.update(no_importance_sampling("dpo"))
        out.update({n: "with --algo dpo (it trains on dataset pairs: nothing to sample while it trains)"
                    for n in ASYNC_FLAGS})
        out.update({n: "with --algo dpo (it trains on dataset pairs: no sampled answers to watch)"
                    for n in SAMPLING_ALARMS})
        out.update(no_reference(cfg))
        return out

    @staticmethod
    def check_config(cfg: Any) -> None:
        a = cfg.dpo
        if not 0.0 <= a.label_smoothing < 0.5:
            raise UserError("--label-smoothing must be in [0, 0.5): at 0.5 the labels carry no preference")
        if a.dpo_loss_type == "cdpo" and a.label_smoothing == 0.0:
            raise UserError("--dpo-loss-type cdpo needs --label-smoothing > 0 (at 0 it is --dpo-loss-type sigmoid)")

    @staticmethod
    def batch_size(cfg: Any) -> int:
        """Pairs per update, as TRL's DPO counts them: ``--per-device-train-batch-size`` pairs per micro-batch times
        ``--gradient-accumulation-steps`` micro-batches, one optimizer step."""
        return int(cfg.optim.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps)

    @staticmethod
    def plan(cfg: Any, pair_batches: int) -> tuple[int, int]:
        """One batch of pairs per update (``batch_size``), in ``--gradient-accumulation-steps`` micro-batches."""
        return pair_batches, int(cfg.optim.gradient_accumulation_steps)

    @staticmethod
    def experience_forwards(cfg: Any) -> list[tuple[str, int]]:
        """The reference's log-probs of every pair, once, and the held-out pairs' evaluation (actor and reference):
        both in batches of ``--per-device-eval-batch-size`` pairs, chosen and rejected rows together."""
        rows = 2 * int(cfg.optim.per_device_eval_batch_size)
        return [("actor", rows)] + ([("reference", rows)] if "reference" in DPOSpec.needs(cfg) else [])

    @staticmethod
    def train_rows(cfg: Any) -> int:
        return 2 * int(cfg.optim.per_device_train_batch_size)  # a micro-batch's chosen and rejected rows


class OnlineDPOSpec(OnPolicySpec):
    name = "online_dpo"
    help = ("online DPO: G samples per prompt from the current policy, best vs worst by any reward source, a DPO "
            "step")
    uses = frozenset({"dpo", "grpo.num_generations"})
    output_name = "step3_online_dpo"
    demo_data = "prompts"  # without --data: the arithmetic prompts, scored by the default rules
    runtime = "dschat.rlhf.online_dpo:OnlineDPO"

    @staticmethod
    def needs(cfg: Any) -> set[str]:
        return DPOSpec.needs(cfg)

    @staticmethod
    def reward_func_names(cfg: Any) -> list[str]:
        """--reward-funcs, else rm with --reward-model, else format + accuracy (GRPO's defaults)."""
        return list(cfg.rewards.reward_funcs) or ([RM] if cfg.rewards.reward_model else ["format", "accuracy"])

    @staticmethod
    def inert_flags(cfg: Any) -> dict[str, str]:
        return {**no_importance_sampling("online_dpo"), **no_reference(cfg)}

    @staticmethod
    def check_config(cfg: Any) -> None:
        DPOSpec.check_config(cfg)
        if cfg.grpo.num_generations < 2:
            raise UserError("--num-generations must be >= 2: a pair needs two answers to one prompt")

    @staticmethod
    def plan(cfg: Any, prompt_batches: int) -> tuple[int, int]:
        """One prompt batch per update; at most one pair per prompt, in micro-batches of
        ``--per-device-train-batch-size`` pairs (ties make some updates shorter)."""
        return prompt_batches, math.ceil(cfg.rl.per_device_generation_batch_size
                                         / cfg.optim.per_device_train_batch_size)

    @staticmethod
    def sampled_per_prompt(cfg: Any) -> int:
        return int(cfg.grpo.num_generations)

    @staticmethod
    def generation_rows(cfg: Any) -> int:
        return int(cfg.rl.per_device_generation_batch_size * cfg.grpo.num_generations)

    @staticmethod
    def experience_forwards(cfg: Any) -> list[tuple[str, int]]:
        """The scores of every sample, then the reference over at most one pair per prompt (``make_pairs``)."""
        rows, pairs = OnlineDPOSpec.generation_rows(cfg), 2 * int(cfg.rl.per_device_generation_batch_size)
        ref = [("reference", pairs)] if "reference" in OnlineDPOSpec.needs(cfg) else []
        return [*scoring_forwards(cfg, rows), *ref]

    @staticmethod
    def train_rows(cfg: Any) -> int:
        return 2 * int(cfg.optim.per_device_train_batch_size)  # a micro-batch's chosen and rejected rows


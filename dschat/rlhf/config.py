"""Stage 3's flags: the shared pieces of ``dschat.config`` composed per model, plus the RL pieces.

Every flag is declared once. Per-model flags come from one prefixed declaration (``piece(LoraArgs, "actor")`` is
``--actor-lora-dim``, ...); the algorithms' own flags live beside their specs (``specs.PPOArgs``,
``specs.GRPOArgs``), and a flag that belongs to another algorithm than ``--algo`` is refused before anything loads
(``inert_flags``). Building and checking the config imports neither torch nor DeepSpeed (the algorithms' run-time
classes load with ``spec.load()``); the checks that need the generation stack import it when they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dschat.config import (
    BACKENDS,
    HEALTH_STAGE2,
    VLLM_FLAGS,
    AgentArgs,
    DataArgs,
    EngineArgs,
    HealthArgs,
    LoraArgs,
    ModelArgs,
    OptimArgs,
    RunArgs,
    VLLMArgs,
    arg,
    backend_help,
    flag_specs,
    merged,
    piece,
)
from dschat.errors import UserError
from dschat.rewards.names import JUDGE, RM, reward_sources
from dschat.rewards.remote import check_url, is_remote
from dschat.rlhf.algorithms import ALGORITHMS, OWNED_GROUPS
from dschat.rlhf.specs import DPOArgs, GRPOArgs, PPOArgs, RLOOArgs

PER_MODEL_OPTIM = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2")
PER_MODEL = ("model", "gradient_checkpointing", "dropout")
REMOTE_FLAGS = ("reward_timeout", "reward_retries", "reward_backoff", "reward_request_rows", "reward_token_file")


@dataclass
class RLArgs:
    algo: str = arg("ppo", "RL algorithm: " + "; ".join(f"{k}: {v.help}" for k, v in ALGORITHMS.items()) + ".",
                    choices=tuple(ALGORITHMS))
    per_device_generation_batch_size: int = arg(8, "Prompts per device per generation batch (GRPO: prompts per "
                                                   "step, each with --num-generations completions; DPO: pairs "
                                                   "per update; online DPO: prompts per update).", low=1)
    max_answer_seq_len: int = arg(256, "Longest generated answer in tokens.", low=1)
    min_answer_len: int = arg(2, "Answers shorter than this many tokens (EOS included) get no gradient and are "
                                 "counted as dropped.", low=0)
    temperature: float = arg(1.0, "Sampling temperature.", above=0)
    top_p: float = arg(1.0, "Nucleus sampling threshold.", above=0, high=1)
    top_k: int = arg(0, "Top-k sampling (0 disables).", low=0)
    eval_samples: int = arg(1, "Answers sampled per held-out prompt in each evaluation (before/after training, "
                               "--eval-interval): a prompt's reward is the mean of its answers and the standard "
                               "errors are over prompts, as dschat eval --num-samples n (same seeds, and with "
                               "the same batch size the same figures). More samples give the reward gain a "
                               "smaller standard error.", low=1)
    enable_hybrid_engine: bool = arg(False, "Use DeepSpeed's hybrid engine for generation where it is supported "
                                            "(CUDA); otherwise the eval-mode KV-cache fallback is used.")
    generation_backend: str = arg("auto", backend_help("dschat"), choices=BACKENDS)
    vllm_importance_sampling: str = arg("token", "Correction for the gap between vLLM's sampling log-probs and the "
                                                 "trainer's: each token's policy loss (token) or each answer's "
                                                 "(sequence) weighed by exp(trainer - vLLM log-prob), truncated at "
                                                 "--vllm-importance-sampling-cap; none: no weights.",
                                        choices=("none", "token", "sequence"))
    vllm_importance_sampling_cap: float = arg(2.0, "Largest importance weight of --vllm-importance-sampling.",
                                              above=0)


@dataclass
class AsyncArgs:
    async_rollouts: bool = arg(False, "Sample in a sampler process of its own, started here on --sampler-devices, "
                                      "while the trainer trains: answers at most --max-staleness updates old, "
                                      "weighed by the decoupled PPO loss (docs/generation.md, Asynchronous "
                                      "rollouts).")
    sampler: str = arg("", "HOST:PORT of a sampler started apart (dschat sampler --listen HOST:PORT, say on another "
                           "node): asynchronous rollouts from it.")
    sampler_devices: str = arg("cpu", "Where --async-rollouts starts its sampler: cpu (as many threads as the "
                                      "trainer), cpu:CORES (e.g. cpu:1 or cpu:2-3: those cores alone, which the "
                                      "trainer then leaves) or cuda:N (a GPU no trainer rank of this node uses, "
                                      "unless --sampler-share-gpu).")
    max_staleness: int = arg(1, "Most updates an answer may lag behind the policy it trains (K): the sampler "
                                "samples at most K updates ahead and an older answer is dropped. 0: every answer "
                                "from the current weights, in lockstep (the synchronous run's figures).", low=0)
    sampler_timeout: float = arg(600.0, "Seconds the trainer waits for its sampler (to connect, and for each "
                                        "answer or weight update): past it the run stops with a state saved. "
                                        "Longer than the slowest batch's sampling.", above=0)
    sampler_token_file: str = arg("", "--sampler: file holding the secret the sampler was started with (default: "
                                      "$DSCHAT_SAMPLER_TOKEN); each side must prove it to the other. A sampler "
                                      "this run starts gets a fresh one of its own.")
    sampler_share_gpu: bool = arg(False, "Let --sampler-devices cuda:N name a GPU a trainer rank of this node trains "
                                         "on (refused otherwise: both would hold it); the sampler's vLLM then takes "
                                         "a share of its memory and sleeps between samples.")
    weight_staging: str = arg("auto", "Where the trainer keeps a weight update while it waits to go to the sampler: "
                                      "device (a copy on the trainer's GPU), host (pinned host memory) or auto "
                                      "(the device when it has room for the copy twice over).",
                              choices=("auto", "device", "host"))

    @property
    def enabled(self) -> bool:
        return self.async_rollouts or bool(self.sampler)

    def inert_fields(self) -> dict[str, str]:
        if not self.enabled:
            return {f: "without --async-rollouts or --sampler" for f in
                    ("sampler_devices", "max_staleness", "sampler_timeout", "sampler_token_file", "sampler_share_gpu",
                     "weight_staging")}
        out = {}
        if self.sampler:
            out["sampler_devices"] = "with --sampler (a sampler started apart chose its devices)"
            out["sampler_share_gpu"] = "with --sampler (a sampler started apart chose its devices)"
        else:
            out["sampler_token_file"] = "with --async-rollouts (the sampler it starts gets a secret of its own)"
            if not self.sampler_devices.startswith("cuda:"):
                out["sampler_share_gpu"] = "without --sampler-devices cuda:N"
        return out


@dataclass
class RewardArgs:
    """Where a completion's reward comes from (every algorithm; docs/algorithms.md, PPO and Rule rewards)."""

    reward_model: str = arg("", "Reward model: a step-2 output (…/model). Needed by the reward source 'rm' (PPO's "
                                "default).")
    reward_funcs: list[str] = arg(help="Reward source (repeatable): rm (the reward model's end score), format, "
                                       "accuracy, judge_match, overlong, judge (a generative judge, --judge-model), "
                                       "or path/to/file.py:function, or a reward server's URL; LABEL=SOURCE names "
                                       "its metrics (train/reward/LABEL; default: the function's name, made "
                                       "unique). Default: rm with --reward-model (PPO: always), else format and "
                                       "accuracy.", factory=list)
    reward_weights: list[str] = arg(help="Weight of each --reward-funcs entry, in order (repeatable floats; "
                                         "default 1 each).", factory=list)
    judge_model: str = arg("", "Generative judge (RM-R1) of the reward source 'judge': a causal LM, e.g. a `dschat "
                               "pipeline judge` output. It compares each completion with the row's reference "
                               "answer in both orders (+1 better, -1 worse, 0 unparseable; averaged).")
    judge_max_new_tokens: int = arg(128, "Longest completion of the judge of the reward source 'judge'.", low=1)
    overlong_buffer: int | None = arg(None, "Reward 'overlong': the penalty falls from 0 at max_answer_seq_len - "
                                            "buffer to -overlong_factor at max_answer_seq_len (default: a quarter "
                                            "of --max-answer-seq-len).", low=1)
    overlong_factor: float = arg(1.0, "Reward 'overlong': the penalty at max_answer_seq_len.")
    reward_timeout: float = arg(60.0, "Remote reward source (--reward-funcs http://host:port/score): seconds to "
                                      "wait for one request.", above=0)
    reward_retries: int = arg(4, "Remote reward source: retries of a request after a connection error, a timeout, "
                                 "HTTP 429 or 5xx (never another 4xx), with exponential backoff; then the source "
                                 "is down and stage 3 stops with the state of its last completed step (exit 4).",
                              low=0)
    reward_backoff: float = arg(1.0, "Remote reward source: seconds before the first retry, doubled each time.",
                                low=0)
    reward_request_rows: int = arg(0, "Remote reward source: completions per request (0: one request per scoring "
                                      "batch).", low=0)
    reward_token_file: str = arg("", "Remote reward source: file holding the server's bearer token (default: the "
                                     "environment variable DSCHAT_REWARD_TOKEN). The token is never logged or "
                                     "saved.")


@dataclass
class RLEngineArgs:
    reference_zero_stage: int | None = arg(None, "ZeRO stage of the frozen reference (default: the actor's).", low=0)
    reward_zero_stage: int | None = arg(None, "ZeRO stage of the frozen reward model (default: "
                                              "--critic-zero-stage).", low=0)
    offload: bool = arg(False, "Offload actor and critic optimizer state (ZeRO >= 1) to CPU memory.")
    offload_reference_model: bool = arg(False, "Keep the reference model in CPU memory.")
    offload_reward_model: bool = arg(False, "Keep the reward model in CPU memory.")
    enable_ema: bool = arg(False, "Keep an exponential moving average of the actor's weights (saved to actor_ema/).")
    ema_decay: float = arg(0.992, "EMA decay per actor optimizer step.", low=0)

    def inert_fields(self) -> dict[str, str]:
        return {} if self.enable_ema else {"ema_decay": "without {enable_ema}"}


def vllm_inert(backend: str, with_training: bool = False) -> dict[str, str]:
    """The vLLM settings when vLLM does not sample (``--generation-backend`` other than vllm; auto off a GPU), and
    on a CPU the GPU-only ones. ``with_training``: the command trains (stage 3), so the correction and sleep flags
    exist."""
    names = list(VLLM_FLAGS)
    if with_training:
        names += ["vllm_importance_sampling", "vllm_importance_sampling_cap"]
    if not (backend == "vllm" or (backend == "auto" and _vllm_on_gpu())):
        from dschat.generation.backends import resolve_backend

        return {n: f"without --generation-backend vllm (here: {resolve_backend(backend)})" for n in names}
    import torch

    out = {} if with_training else {"vllm_enable_sleep": "without training (nothing to give the memory back to)"}
    if torch.cuda.is_available():
        out["vllm_kv_cache_memory"] = "on a GPU (it sizes the KV cache with --vllm-gpu-memory-utilization)"
    else:
        out.update({n: "on a CPU" for n in ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                                             "vllm_enable_sleep")})
    return out


def _vllm_on_gpu() -> bool:
    import torch

    from dschat.generation.vllm_engine import vllm_installed

    return torch.cuda.is_available() and vllm_installed()


def reward_settings_inert(names: list[str]) -> dict[str, str]:
    """Settings of the reward sources 'judge' and 'overlong' (``RewardArgs``) when ``names`` has no such source."""
    out: dict[str, str] = {}
    if JUDGE not in names:
        out.update({n: "without the reward source 'judge'" for n in ("judge_model", "judge_max_new_tokens")})
    if "overlong" not in names:
        out.update({n: "without the reward source 'overlong'" for n in ("overlong_buffer", "overlong_factor")})
    if not any(is_remote(n) for n in names):
        out.update({n: "without a remote reward source (--reward-funcs http://...)" for n in REMOTE_FLAGS})
    return out


def _model(who: str, help_model: str) -> Any:
    return piece(ModelArgs, who, only=PER_MODEL, defaults={"model": "", "dropout": 0.0},
                 aliases={"model": ("model",)} if who == "actor" else None,
                 help={"model": help_model, "dropout": f"{who.capitalize()} dropout (default 0: train-mode and "
                                                       "eval-mode log-probs are equal)."})


@dataclass
class RLHFConfig:
    rl: RLArgs = field(default_factory=RLArgs)
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    actor: ModelArgs = _model("actor", "Actor initialisation: a step-1 output (…/model) or any model name "
                                       "('--model' works too, as in the other stages).")
    critic: ModelArgs = _model("critic", "Critic initialisation (default: the reward model).")
    model: ModelArgs = piece(ModelArgs, only=("dtype", "trust_remote_code"))
    rewards: RewardArgs = field(default_factory=RewardArgs)
    optim: OptimArgs = piece(OptimArgs, exclude=PER_MODEL_OPTIM, defaults={"warmup_ratio": 0.0},
                             aliases={"per_device_train_batch_size": ("per_device_training_batch_size",)},
                             help={"per_device_train_batch_size": "Experience rows (GRPO: completions) per device "
                                                                  "per micro-batch.",
                                   "per_device_eval_batch_size": "Prompts per device per evaluation batch.",
                                   "num_train_epochs": "Passes over the prompts.",
                                   "max_steps": "Updates to run; overrides --num-train-epochs, as in the other "
                                                "stages (-1: run all epochs).",
                                   "warmup_ratio": "Fraction of the optimizer steps spent in linear warmup "
                                                   "(stage 3 starts from trained models: none by default)."})
    actor_optim: OptimArgs = piece(OptimArgs, "actor", only=PER_MODEL_OPTIM, help={
        "learning_rate": "Actor learning rate (default 1e-4 for models under 50M parameters, else 1e-6)."})
    critic_optim: OptimArgs = piece(OptimArgs, "critic", only=PER_MODEL_OPTIM, help={
        "learning_rate": "Critic learning rate (default 5e-4 for models under 50M parameters, else 5e-6)."})
    actor_engine: EngineArgs = piece(EngineArgs, "actor", only=("zero_stage",), help={
        "zero_stage": "ZeRO stage of the actor (the reference follows unless set)."})
    critic_engine: EngineArgs = piece(EngineArgs, "critic", only=("zero_stage",), help={
        "zero_stage": "ZeRO stage of the critic (the reward model follows unless set)."})
    engines: RLEngineArgs = field(default_factory=RLEngineArgs)
    actor_lora: LoraArgs = piece(LoraArgs, "actor", exclude=("save_adapter",))
    critic_lora: LoraArgs = piece(LoraArgs, "critic", exclude=("save_adapter",))
    lora: LoraArgs = piece(LoraArgs, only=("save_adapter",))
    ppo: PPOArgs = field(default_factory=PPOArgs)
    grpo: GRPOArgs = field(default_factory=GRPOArgs)
    dpo: DPOArgs = field(default_factory=DPOArgs)
    rloo: RLOOArgs = field(default_factory=RLOOArgs)
    data: DataArgs = field(default_factory=DataArgs)
    run: RunArgs = field(default_factory=RunArgs)
    health: HealthArgs = piece(HealthArgs, exclude=HEALTH_STAGE2)
    agent: AgentArgs = field(default_factory=AgentArgs)
    rollouts: AsyncArgs = field(default_factory=AsyncArgs)

    @property
    def algorithm(self) -> Any:
        """The spec of ``--algo`` (``.load()``: its run-time class)."""
        return ALGORITHMS[self.rl.algo]

    def inert_flags(self) -> dict[str, str]:
        """Flags of the pieces other algorithms own (``Algorithm.uses``), and reward settings no source reads."""
        mine = self.algorithm.uses
        out = {s.name: f"with --algo {self.rl.algo}" for s in flag_specs(type(self))
               if s.group in OWNED_GROUPS and s.group not in mine and f"{s.group}.{s.field}" not in mine}
        out.update(self.algorithm.inert_flags(self))
        out.update(reward_settings_inert(self.reward_func_names()))
        vllm = vllm_inert(self.rl.generation_backend, with_training=True)
        if self.rollouts.enabled and self.rollouts.max_staleness > 0:  # the decoupled loss weighs by them
            for n in ("vllm_importance_sampling", "vllm_importance_sampling_cap"):
                vllm.pop(n, None)
        out.update(vllm)
        if not (self.rollouts.enabled and self.rollouts.max_staleness > 0):
            out["alarm_async_kl"] = "without asynchronous rollouts (--async-rollouts or --sampler, --max-staleness > 0)"
        if self.actor_lora.lora_dim == 0 and self.critic_lora.lora_dim == 0:
            out["save_adapter"] = "without --actor-lora-dim or --critic-lora-dim"
        if "critic" not in self.algorithm.needs(self):
            out["alarm_value_growth"] = f"with --algo {self.rl.algo} (no critic)"
        if RM not in self.reward_func_names():
            out["alarm_rm_sigma"] = "without the reward model among the reward sources"
        return out

    def reward_func_names(self) -> list[str]:
        """The run's reward sources: --reward-funcs (without their ``LABEL=``) or the algorithm's default (and what
        it adds)."""
        return reward_sources(self.reward_entries())

    def reward_entries(self) -> list[str]:
        """The run's ``--reward-funcs`` entries as given (``LABEL=SOURCE`` kept), or the default: the environment's
        reward with ``--env``, else the algorithm's."""
        if self.agent.env and not self.rewards.reward_funcs:  # the environment owns the reward
            return ["env"]
        return self.algorithm.reward_func_names(self)

    def optim_of(self, who: str) -> OptimArgs:
        """The full ``OptimArgs`` of 'actor' or 'critic': its own rate and decay, the shared schedule."""
        return merged(getattr(self, f"{who}_optim"), self.optim)

    def engine_of(self, who: str) -> EngineArgs:
        return EngineArgs(zero_stage=getattr(self, f"{who}_engine").zero_stage, offload=self.engines.offload)

    def lora_of(self, who: str) -> LoraArgs:
        return merged(getattr(self, f"{who}_lora"), self.lora)


def check_config(cfg: RLHFConfig) -> None:
    """Stop before any model loads on flag combinations that cannot work."""
    if not cfg.actor.model:
        raise UserError("stage 3 needs --actor-model (a step-1 output)")
    check_reward_models(cfg.reward_func_names(), cfg.rewards)
    if cfg.rl.generation_backend == "vllm":
        from dschat.generation.vllm_engine import require_vllm

        require_vllm()
        if cfg.rl.enable_hybrid_engine:
            raise UserError("--enable-hybrid-engine and --generation-backend vllm both name what samples; pick one")
    if cfg.rl.generation_backend in ("compiled", "graph"):
        name = cfg.rl.generation_backend
        if name == "graph":
            from dschat.generation.backends import require_cuda_for_graph

            require_cuda_for_graph()
        if cfg.actor_lora.lora_dim > 0:
            raise UserError(f"--generation-backend {name} runs the actor's plain weights, and LoRA wraps its "
                            "layers; use --generation-backend dschat with --actor-lora-dim")
        from dschat.generation.lean_llama import LEAN_MODEL_TYPES
        from dschat.models.loading import local_model_type

        kind = local_model_type(cfg.actor.model)
        if kind is not None and kind not in LEAN_MODEL_TYPES:
            raise UserError(f"--generation-backend {name} needs a Llama-architecture model "
                            f"({', '.join(LEAN_MODEL_TYPES)} layouts); {cfg.actor.model} is {kind}: use "
                            f"--generation-backend dschat")
    check_agent(cfg.agent, cfg.reward_func_names())
    check_async(cfg)
    check_sampler_start(cfg)
    cfg.algorithm.check_config(cfg)


def check_async(cfg: RLHFConfig) -> None:
    """Asynchronous rollouts: one sampler, named once; devices that parse."""
    a = cfg.rollouts
    if not a.enabled:
        return
    if a.async_rollouts and a.sampler:
        raise UserError("--async-rollouts starts a sampler and --sampler names one started apart; pick one")
    if a.sampler:
        from dschat.utils import address

        address(a.sampler)
    else:
        sampler_devices(a.sampler_devices)


def check_sampler_start(cfg: RLHFConfig) -> None:
    """What stage 3 needs to start its sampler, checked before anything loads: the secret a sampler started apart
    was given; for ``cuda:N``, a GPU no trainer rank of this node trains on (unless ``--sampler-share-gpu``)."""
    a = cfg.rollouts
    if not a.enabled:
        return
    if a.sampler:
        from dschat.generation.channel import load_secret

        load_secret(a.sampler_token_file, "--sampler-token-file")
        return
    device, _ = sampler_devices(a.sampler_devices)
    if device.startswith("cuda:") and not a.sampler_share_gpu:
        index = int(device.partition(":")[2])
        trained = trainer_gpus()
        if index in trained:
            raise UserError(f"--sampler-devices {device}: a trainer rank of this node trains on it (GPUs "
                            f"{', '.join(map(str, trained))}); name another GPU, or pass --sampler-share-gpu")


def trainer_gpus() -> list[int]:
    """The CUDA indices this node's trainer ranks take (``cuda:LOCAL_RANK`` for each rank the launcher started on
    this node: torchrun's ``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``; one without a launcher), as this
    process numbers them."""
    import os

    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    return list(range(max(int(local), 1))) if local.isdigit() else [0]


def sampler_devices(text: str) -> tuple[str, list[int]]:
    """``--sampler-devices`` as (device, CPU cores): ``cpu`` -> ("cpu", []), ``cpu:1,3-4`` -> ("cpu", [1, 3, 4]),
    ``cuda:1`` -> ("cuda:1", []); anything else a one-line error."""
    kind, _, rest = text.partition(":")
    if kind == "cuda" and rest.isdigit():
        return text, []
    if kind == "cpu":
        cores: list[int] = []
        try:
            for part in filter(None, rest.split(",")):
                lo, _, hi = part.partition("-")
                cores.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            cores = [-1]
        if not rest or (cores and min(cores) >= 0):
            return "cpu", cores
    raise UserError(f"--sampler-devices {text!r}: expected cpu, cpu:CORES (e.g. cpu:1 or cpu:0-3) or cuda:N")


def check_agent(agent: AgentArgs, reward_names: list[str]) -> None:
    """'env' needs an environment, and the tools and environments load (a missing file, function or class stops
    here)."""
    if "env" in reward_names and not agent.env:
        raise UserError("reward function 'env' is an environment's reward: it needs --env")
    if not (agent.tools or agent.env):
        return
    from dschat.agents.agent import build_agent

    build_agent(agent)  # a missing file, function or class stops here, before any model loads


def check_reward_models(names: list[str], rewards: RewardArgs) -> None:
    """The reward sources ``names`` that score with a model have it (stage 3, ``dschat generate``, ``dschat
    eval``)."""
    if RM in names and not rewards.reward_model:
        raise UserError("reward function 'rm' needs --reward-model (a step-2 output)")
    if JUDGE in names and not rewards.judge_model:
        raise UserError("reward function 'judge' needs --judge-model (a trained generative judge)")
    for name in names:
        if is_remote(name):
            check_url(name)  # a malformed address stops here, not at the first request after the models load


def check_reward_data(names: list[str], rows: list[dict[str, Any]]) -> None:
    """Rules that compare with a ground truth stop before any model loads when prompts have none."""
    missing = sum(r.get("answer") is None for r in rows)
    for name in ("accuracy", "judge_match", JUDGE):
        if name in names and missing:
            raise UserError(f"reward '{name}' needs a ground truth, but {missing} of {len(rows)} prompts have none; "
                            "pass prompt-only rows with an 'answer' (or judge rows with a 'winner') via --data")

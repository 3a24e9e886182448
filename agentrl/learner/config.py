"""``LearnConfig``: the config tree of ``agentrl learn``; ``loss`` is the loss's own parameters.

The loss section is a tagged union on ``kind`` (``pg``, ``ppo``, ``decoupled_ppo``, ``gspo``,
``cispo``). Each variant holds the parameters :func:`agentrl.learner.losses.compute_loss` takes for
that kind, under the names docs/losses.md uses, and :meth:`LossConfig.arguments` hands them over
as they are; fields marked ``STEP`` in their metadata are read by the step itself instead
(advantages, the truncated-episode policy, the number of optimizer passes, the proximal policy).
Only the standard library is imported here (torch is imported by the learner itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.errors import ConfigError
from agentrl.learner.lora import LoraConfig
from agentrl.weights.config import WeightsConfig

STEP = {"step": True}  # a loss setting the step reads (not a compute_loss parameter)


@dataclass
class LossConfig:
    """Parameters every loss kind shares: the off-policy correction, the aggregation, the advantages."""

    correction: Literal["none", "tis", "mis"] = "tis"  # importance correction against the behaviour policy
    level: Literal["token", "sequence", "geometric"] = "token"  # unit of the correction's ratio
    tis_cap: float = 2.0  # tis: weights are min(pi_old / mu, tis_cap)
    mis_low: float = 0.5  # mis: units whose ratio is below this are dropped (and leave the denominator)
    mis_high: float = 2.0  # mis: units whose ratio is above this are dropped (and leave the denominator)
    mismatch_band: tuple[float, float] | None = None
    """drop single tokens whose pi_old / mu leaves [low, high]"""
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "token-mean"
    """loss aggregation; seq-mean-token-sum-norm is Dr. GRPO's (a constant length, norm_tokens)"""
    norm_tokens: int = 0
    """seq-mean-token-sum-norm: the constant length L per sequence (0: the batch's longest completion)"""
    advantage_std: bool = field(default=True, metadata=STEP)
    """divide group-centred rewards by the group's std (GRPO); false: Dr. GRPO"""
    overlong: Literal["keep", "mask", "penalize"] = field(default="keep", metadata=STEP)
    """truncated episodes: train as they are, mask them out of the loss (DAPO's overlong filtering; still in
    their group's baseline), or subtract overlong_penalty from their reward"""
    overlong_penalty: float = field(default=1.0, metadata=STEP)
    """overlong = "penalize": subtracted from a truncated episode's reward before advantages"""
    distill_coef: float = field(default=0.0, metadata=STEP)
    """on-policy distillation: a token a teacher scored gains distill_coef * (its teacher logprob - its
    behaviour logprob) in its advantage (a per-token reverse KL; docs/scoring.md); 0: off"""
    process_coef: float = field(default=1.0, metadata=STEP)
    """process rewards (samples' token_rewards, a per-turn scorer's): each token's advantage gains
    process_coef * the return-to-go of its group's normalized step rewards (DeepSeekMath's process
    supervision; docs/scoring.md); 0: ignore them"""
    distill_topk_coef: float = field(default=0.0, metadata=STEP)
    """on-policy distillation over the teacher's top-k (scoring.teacher.top_k): the loss gains
    distill_topk_coef * the forward KL from the teacher's renormalized top-k to the student at each position a
    teacher scored, aggregated as the loss (docs/scoring.md); 0: off"""
    distill_reward: bool = field(default=True, metadata=STEP)
    """with distill_coef > 0: keep the episodes' reward advantages beside the teacher's term (false:
    distillation alone)"""

    def arguments(self) -> dict[str, Any]:
        """``compute_loss``'s keyword arguments for this loss (``kind`` included)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("step")}


@dataclass
class PGLoss(LossConfig):
    """Plain policy gradient (REINFORCE / single-step GRPO) with the chosen correction."""

    kind: Literal["pg"] = "pg"


@dataclass
class PPOLoss(LossConfig):
    """PPO's clipped objective around the learner's own logprobs at the start of the step."""

    kind: Literal["ppo"] = "ppo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high (above clip_low: DAPO's clip-higher)
    minibatches: int = field(default=1, metadata=STEP)
    """optimizer updates per epoch: the batch split into this many minibatches"""
    epochs: int = field(default=1, metadata=STEP)
    """passes over the batch; pi_old stays the weights at the start of the step"""


@dataclass
class DecoupledPPOLoss(LossConfig):
    """Decoupled PPO (AReaL): the trust region around a proximal policy, pi_prox / mu correcting for
    staleness."""

    kind: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high
    minibatches: int = field(default=1, metadata=STEP)
    """optimizer updates per epoch: the batch split into this many minibatches"""
    epochs: int = field(default=1, metadata=STEP)
    """passes over the batch; pi_prox stays the weights at the start of the step"""
    proximal: Literal["recompute", "approx"] = field(default="recompute", metadata=STEP)
    """pi_prox: a no-grad forward pass at the start of the step, or approx_proximal_logp (no extra pass)"""


@dataclass
class GSPOLoss(LossConfig):
    """GSPO (Zheng et al. 2025): PPO's clip on the length-normalised sequence ratio, one unit per sequence."""

    kind: Literal["gspo"] = "gspo"
    level: Literal["token", "sequence", "geometric"] = "geometric"
    """unit of the correction's ratio (GSPO's own: the sequence's geometric mean)"""
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "seq-mean-token-mean"  # loss aggregation; GSPO's own counts each sequence once
    clip_low: float = 3e-4
    """sequence-ratio floor 1 - clip_low (GSPO's ratios are geometric means: a narrow range)"""
    clip_high: float = 4e-4  # sequence-ratio ceiling 1 + clip_high
    minibatches: int = field(default=1, metadata=STEP)
    """optimizer updates per epoch: the batch split into this many minibatches"""
    epochs: int = field(default=1, metadata=STEP)
    """passes over the batch; pi_old stays the weights at the start of the step"""


@dataclass
class CISPOLoss(LossConfig):
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, stop-gradient ratio pi_theta / pi_old."""

    kind: Literal["cispo"] = "cispo"
    clip_low: float = 1.0  # weight floor 1 - clip_low (1: no floor, as MiniMax-M1)
    clip_high: float = 1.0  # weight ceiling 1 + clip_high
    minibatches: int = field(default=1, metadata=STEP)
    """optimizer updates per epoch: the batch split into this many minibatches"""
    epochs: int = field(default=1, metadata=STEP)
    """passes over the batch; pi_old stays the weights at the start of the step"""


Loss = PGLoss | PPOLoss | DecoupledPPOLoss | GSPOLoss | CISPOLoss


@dataclass
class WandbConfig:
    project: str = ""  # a Weights & Biases project: log every step there (extra agentrl[wandb]); empty: off
    entity: str = ""  # team or user (empty: wandb's default)
    name: str = ""  # run name (empty: wandb picks one)
    mode: Literal["", "online", "offline", "disabled"] = ""  # empty: $WANDB_MODE or online


@dataclass
class LearnConfig:
    serve: str = "http://127.0.0.1:8000"  # serve's URL
    admin_token: str = ""  # serve's admin token; config file only (never --admin_token=)
    admin_token_file: str = ""
    """file holding it; empty: $AGENTRL_ADMIN_TOKEN(_FILE), then run_dir/admin_token"""
    model: str = ""  # empty: the model serve reports
    run_dir: str = "runs/latest"
    steps: int = 3  # optimizer steps, then exit (0: run until stopped)
    max_minutes: float = 0.0
    """Stop after the step that ends this many minutes of training (counted from the first pull, so
    model loading is not in it; 0: no limit). With ``steps``, whichever comes first: equal-time
    comparisons (benchmarks/curriculum.py) set ``steps = 0``."""
    batch_size: int = 0  # samples per optimizer step (0: serve's buffer.batch_size)
    max_staleness: int = -1
    """train on samples at most this many versions old (-1: serve's buffer.max_staleness)"""
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up of the learning rate from lr/warmup_steps to lr
    decay_steps: int = 0
    """after warm-up, linear decay to min_lr_ratio * lr over this many steps (0: constant)"""
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    micro_batch_tokens: int = 2048
    """Tokens per packed row; one row per forward/backward pass. The activations of a row grow with its
    tokens: SmolLM2-135M full fine-tuning peaked at 5.35 GB for one 2,048-token step (6.56 GB with the
    unchunked LM head), where 8,192 tokens were OOM-killed at 24 GB before the chunked head; 8,192 tokens
    fit in 6.63 GB with activation_checkpointing and glibc's default allocator settings, 2.72 GB with
    blocks over 1 MB mapped on their own, which the learner sets at start-up (agentrl/learner/heap.py;
    benchmarks/learner_memory.py, docs/learner.md)."""
    head_chunk_tokens: int = 1024
    """Positions per chunk of the LM head (agentrl.learner.head): about three [chunk, vocabulary] fp32
    tensors exist at once (0.6 GB for SmolLM2's 49,152-token vocabulary); 0: the whole row's logits."""
    activation_checkpointing: bool = False  # recompute decoder-layer activations in backward (less memory)
    routing_replay: bool = True
    """MoE models: route each token through the experts the engine used when it sampled it (its
    recorded routing); false: the learner routes every token itself, and still counts where its
    routing differs from the record (learner.jsonl's routing_disagreement)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute + fp32 master weights on GPU, fp32 on CPU"""
    loss: Loss = field(default_factory=PGLoss)
    batch_timeout_s: float = 0.0
    """Give up waiting for serve (a batch, an ack, its info) after this long; 0: wait for ever, saying
    so (a partition or a restart of any length is ridden out)."""
    dist_timeout_s: float = 1800.0
    """Several processes: torch.distributed's timeout, the longest a step, a publish or a checkpoint
    may keep one rank waiting on another (rank 0's waits on serve send heartbeats and do not count)."""
    policy_wait_s: float = 2.0
    """Named LoRA policies (serve.policies): how long the learner waits for the batch of the policy
    whose turn it is before it tries the next one (a long wait makes the turns strict)."""
    seed: int = 0
    checkpoint_every: int = 0  # save a torch.distributed.checkpoint every this many steps (0: never)
    checkpoint_dir: str = ""  # empty: run_dir/checkpoints (shared by all ranks on several machines)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: keep all)
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir (none there: start fresh)
    export_dir: str = ""  # at exit, write the policy here as a Hugging Face folder (empty: no export)
    metrics_port: int = 0
    """Prometheus /metrics of the learner (rank 0); 0: a free port (logged, in run_dir/learner_metrics_url);
    -1: off"""
    metrics_host: str = "127.0.0.1"  # bind address of /metrics; loopback unless told otherwise
    no_signal_steps: int = 3
    """warn once when a run has had no learning signal for this many steps in a row (0: never)"""
    tensorboard: bool = False
    """also write each step's metrics as TensorBoard events in run_dir/tensorboard (extra
    agentrl[tensorboard])"""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """rank > 0: train LoRA adapters (peft) instead of every weight; with weights.transport.kind =
    "adapter" only the adapter travels to the engines (docs/learner.md, docs/weights.md)."""

    def check(self) -> None:
        self.lora.check()
        if self.weights.transport.kind == "adapter" and not self.lora.enabled:
            raise ConfigError("weights.transport.kind = \"adapter\" sends a LoRA adapter: set "
                              "learn.lora.rank > 0 (or another transport for full fine-tuning)")
        if self.lr <= 0:
            raise ConfigError("lr must be positive")
        if self.batch_timeout_s < 0 or self.dist_timeout_s < 10:
            raise ConfigError("batch_timeout_s must be >= 0 (0: wait for serve for ever) and "
                              "dist_timeout_s at least 10")
        if self.micro_batch_tokens < 2:
            raise ConfigError("micro_batch_tokens must be at least 2")
        if self.head_chunk_tokens < 0:
            raise ConfigError("head_chunk_tokens must be >= 0 (0: the whole row's logits at once)")
        if self.max_minutes < 0:
            raise ConfigError("max_minutes must be >= 0 (0: no time limit)")
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("warmup_steps, decay_steps and checkpoint_every must not be negative")
        if self.batch_size < 0 or self.max_staleness < -1:
            raise ConfigError("batch_size must be >= 0 (0: serve's) and max_staleness >= -1 (-1: serve's)")
        loss = self.loss
        band = loss.mismatch_band
        if band is not None and not 0 < band[0] <= band[1]:
            raise ConfigError(f"loss.mismatch_band needs 0 < low <= high, got {list(band)}")
        if getattr(loss, "minibatches", 1) < 1 or getattr(loss, "epochs", 1) < 1:
            raise ConfigError("loss.minibatches and loss.epochs must be at least 1")
        if min(loss.norm_tokens, loss.overlong_penalty, loss.distill_coef, loss.process_coef) < 0:
            raise ConfigError("loss.norm_tokens, loss.overlong_penalty, loss.distill_coef "
                              "and loss.process_coef must not be negative")
        clip = (getattr(loss, "clip_low", 0.0), getattr(loss, "clip_high", 0.0))
        if not (0 <= clip[0] <= 1 and clip[1] >= 0):
            raise ConfigError(f"loss.clip_low must be in [0, 1] and loss.clip_high >= 0, got {list(clip)}")

"""``LearnConfig``: the config tree of ``agentrl learn``; ``loss`` is the loss's own parameters.

The loss section is a tagged union on ``kind`` (``pg``, ``ppo``, ``decoupled_ppo``): each variant holds
exactly the parameters :func:`agentrl.learner.losses.compute_loss` takes for that kind, under the
names docs/losses.md uses, and :meth:`LossConfig.arguments` hands them over as they are. Only the
standard library is imported here (torch is imported by the learner itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.errors import ConfigError
from agentrl.weights.config import WeightsConfig


@dataclass
class LossConfig:
    """Parameters every loss kind shares: the off-policy correction and the aggregation."""

    correction: Literal["none", "tis", "mis"] = "tis"  # importance correction against the behaviour policy
    level: Literal["token", "sequence", "geometric"] = "token"  # unit of the correction's ratio
    tis_cap: float = 2.0  # tis: weights are min(pi_old / mu, tis_cap)
    mis_low: float = 0.5  # mis: units whose ratio is below this are dropped
    mis_high: float = 2.0  # mis: units whose ratio is above this are dropped
    mismatch_band: tuple[float, float] | None = None  # drop single tokens whose pi_old / mu leaves [low, high]
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"  # loss aggregation

    def arguments(self) -> dict[str, Any]:
        """``compute_loss``'s keyword arguments for this loss (``kind`` included)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


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


@dataclass
class DecoupledPPOLoss(LossConfig):
    """Decoupled PPO (AReaL): the trust region around a proximal policy, pi_prox / mu correcting for staleness."""

    kind: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high


Loss = PGLoss | PPOLoss | DecoupledPPOLoss


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
    admin_token_file: str = ""  # file holding it; empty: $AGENTRL_ADMIN_TOKEN(_FILE), then run_dir/admin_token
    model: str = ""  # empty: the model serve reports
    run_dir: str = "runs/latest"
    steps: int = 3  # optimizer steps, then exit (0: run until stopped)
    batch_size: int = 0  # samples per optimizer step (0: serve's buffer.batch_size)
    max_staleness: int = -1  # train on samples at most this many versions old (-1: serve's buffer.max_staleness)
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up of the learning rate from lr/warmup_steps to lr
    decay_steps: int = 0  # after warm-up, linear decay to min_lr_ratio * lr over this many steps (0: constant)
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    micro_batch_tokens: int = 8192  # tokens per packed row; one row per forward/backward pass
    activation_checkpointing: bool = False  # recompute decoder-layer activations in backward (less memory)
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 compute + fp32 master weights on GPU, fp32 on CPU
    loss: Loss = field(default_factory=PGLoss)
    batch_timeout_s: float = 600.0  # give up waiting for a batch after this long
    seed: int = 0
    checkpoint_every: int = 0  # save a torch.distributed.checkpoint every this many steps (0: never)
    checkpoint_dir: str = ""  # empty: run_dir/checkpoints (shared by all ranks on several machines)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: keep all)
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir (none there: start fresh)
    export_dir: str = ""  # at exit, write the policy here as a Hugging Face folder (empty: no export)
    metrics_port: int = 0  # Prometheus /metrics of the learner (rank 0); 0: a free port (logged, in run_dir/learner_metrics_url); -1: off
    metrics_host: str = "127.0.0.1"  # bind address of /metrics; loopback unless told otherwise
    no_signal_steps: int = 3  # warn once when a run has had no learning signal for this many steps in a row (0: never)
    tensorboard: bool = False  # also write each step's metrics as TensorBoard events in run_dir/tensorboard (extra agentrl[tensorboard])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)

    def check(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr must be positive")
        if self.micro_batch_tokens < 2:
            raise ConfigError("micro_batch_tokens must be at least 2")
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("warmup_steps, decay_steps and checkpoint_every must not be negative")
        if self.batch_size < 0 or self.max_staleness < -1:
            raise ConfigError("batch_size must be >= 0 (0: serve's) and max_staleness >= -1 (-1: serve's)")
        band = self.loss.mismatch_band
        if band is not None and not 0 < band[0] <= band[1]:
            raise ConfigError(f"loss.mismatch_band needs 0 < low <= high, got {list(band)}")

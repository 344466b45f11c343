"""[pipeline]: the options of pipeline parallel (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError
from hpctrain.option import given, option
from hpctrain.registry import FLAVOUR_NAMES

__all__ = ["PipelineOptions", "SCHEDULES", "BALANCE", "P2P"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # schedule.py SCHEDULES: the same
BALANCE = ("param-count", "measured")
P2P = ("auto", "eager", "ordered")  # p2p.py P2P_MODES: the same


@dataclass
class PipelineOptions:
    """Typed options of the pipeline over the mesh's pp dimension (strategy pipeline)."""

    schedule: str = option("1f1b", "gpipe, 1f1b, or interleaved-1f1b", choices=SCHEDULES)
    microbatches: int = option(4, "pipeline micro-batches per (grad-accumulation) batch", min=1)
    virtual_stages: int = option(2, "model chunks per rank (interleaved-1f1b only)", min=1)
    balance: str = option("param-count", "split layers by parameter count or measured layer "
                          "time", choices=BALANCE)
    split_points: str = option("", "explicit stage starts: comma-separated layer indices or "
                               "names (e.g. '3,6' or 'blocks.2'); empty: balanced split")
    dp_sharding: str = option("ddp", "the dp flavour over each stage's replicas (as "
                              "--dp-flavour): all-reduced (ddp), optimizer state (zero1), + "
                              "gradients (zero2), + parameters (zero3) sharded, or fsdp",
                              choices=FLAVOUR_NAMES)
    p2p: str = option("auto", "how stages post messages: eager (non-blocking sends, MPI tags; "
                      "CPU) or ordered (grouped send/recv matched by order, as NCCL needs; on "
                      "MPI the sends are synchronous, so a CPU run proves the order safe); "
                      "auto: ordered on GPUs", choices=P2P)
    mesh: object = given("", "a MeshLayout (the plan's); '' -> pp = world size")
    activation_checkpointing: bool = given(False, "recompute each layer's activations in "
                                           "backward (train.activation_checkpointing)")

    @property
    def chunks(self) -> int:
        return self.virtual_stages if self.schedule == "interleaved-1f1b" else 1

    def check(self, cfg, plan) -> None:
        """The config's rules for a plan with a pipeline: micro-batches that divide the
        batch, fp32/bf16 (ConfigError)."""
        t = cfg.train
        m, dp, p = self.microbatches, plan.dp, plan.pp
        if plan.tp > 1 and self.balance == "measured":
            raise ConfigError("pipeline.balance = 'measured' times each layer alone, which "
                              "tensor-parallel layers (tp > 1) cannot be; use param-count")
        if t.global_batch_size % (t.grad_accum * dp * m):
            raise ConfigError(
                f"pipeline.microbatches = {m} does not divide the batch: global_batch_size = "
                f"{t.global_batch_size} must be a multiple of grad_accum ({t.grad_accum}) x dp "
                f"({dp}) x microbatches ({m}) = {t.grad_accum * dp * m}; change "
                f"--global-batch-size or --set pipeline.microbatches=N")
        if self.schedule == "interleaved-1f1b":
            if self.virtual_stages < 2:
                raise ConfigError("pipeline.virtual_stages = 1 with interleaved-1f1b: use 2 or "
                                  "more chunks per rank, or schedule 1f1b")
            if m % p:
                raise ConfigError(
                    f"pipeline.microbatches = {m} with interleaved-1f1b must be a multiple of "
                    f"pp = {p}; use --set pipeline.microbatches={max(p, m - m % p)}")
        if t.precision == "fp16":
            raise ConfigError("train.precision = 'fp16' is not supported with strategy "
                              "'pipeline' (stages would need to agree on skipped steps); use bf16")

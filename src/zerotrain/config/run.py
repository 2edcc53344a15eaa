"""zero:, comm:, checkpoint:, logging: and train: — how a run is spread, saved and watched."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from zerotrain.config.base import _Section
from zerotrain.config.zero_facts import (  # noqa: F401  (re-exported: their old home)
    OFFLOAD_RULE,
    OFFLOAD_STAGES,
    offload_allowed,
    zero_option_problems,
)


class ZeroConfig(_Section):
    stage: Literal[0, 1, 2, 3] = 0
    bucket_mb: float = Field(25.0, gt=0.0, description="size of flat communication buckets")
    overlap: bool = Field(True, description="overlap gradient communication with backward")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="where the sharded gradients, FP32 masters and optimizer states "
        "live between steps (stages 2-3): device memory (none), host memory (cpu, "
        "ZeRO-Offload) or files under zero.nvme_path (nvme, ZeRO-Infinity; stage 3)")
    offload_param: Literal["none", "cpu", "nvme"] = Field(
        "none", description="ZeRO-3: where each unit's parameter shard lives between its "
        "uses: device memory (none), host memory (cpu) or files under zero.nvme_path (nvme); "
        "fetched for the unit's forward and backward, zero.offload_prefetch units ahead")
    nvme_path: str | None = Field(
        None, description="a directory for the run's own offload files (nvme tiers); its "
        "free space is checked before start and the files are removed at exit")
    offload_prefetch: int = Field(
        1, ge=0, le=8, description="offload tiers: units fetched ahead of the one computing "
        "(and optimizer units read ahead of the one updating); 0: no overlap")
    nvme_threads: int = Field(4, ge=1, le=64, description="nvme: I/O threads")
    nvme_block_mb: float = Field(
        1.0, gt=0.0, le=256.0,
        description="nvme: size of one read/write request (aligned to 4 KiB)")
    nvme_direct: bool | Literal["auto"] = Field(
        "auto", description="nvme: O_DIRECT reads/writes (bypass the page cache); auto: when "
        "the filesystem allows, buffered otherwise (said once)")
    param_persistence_threshold: int = Field(
        0, ge=0, description="ZeRO-3: units with fewer elements stay gathered between uses"
    )
    prefetch: bool = Field(True, description="ZeRO-3: gather the next unit while this one runs")
    secondary_partition: int | None = Field(
        None, ge=1, description="ZeRO++ hpZ (ZeRO-3): after a unit's forward each rank keeps "
        "its slice of the unit over a group of K consecutive ranks (a node), so the "
        "backward's all-gather stays inside the group; costs 1/K of each unit until its "
        "backward. K must divide comm.node_size. null: off")
    param_wire: Literal["plain", "fp8", "int8"] = Field(
        "plain", description="ZeRO-3: how gathered parameters travel. fp8: the FP8 linears' "
        "weights as one byte (precision.fp8.all_gather is its alias; needs precision.fp8); "
        "int8: ZeRO++ qwZ, every parameter block-quantised (256 per fp32 scale)")
    grad_wire: Literal["plain", "int8", "int4"] = Field(
        "plain", description="ZeRO-3: ZeRO++ qgZ, the gradient reduce-scatter reduced in full "
        "precision inside each node, then block-quantised (int8 or int4) across nodes")
    reductions_in_flight: int | Literal["auto"] = Field(
        "auto", description="gradient reductions that may run while backward goes on; each "
        "holds a full-size bucket (stages 2-3), so every one fewer lowers the peak by a "
        "unit's gradient and overlaps less (0: each bucket is reduced before backward goes "
        "on). auto: 2 on CUDA (NCCL runs beside the compute), 0 on CPU (gloo shares the "
        "cores backward computes on, so overlap buys little there and costs memory)")

    @field_validator("reductions_in_flight", mode="before")
    @classmethod
    def _in_flight(cls, v: Any) -> int | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise ValueError(f"zero.reductions_in_flight must be auto or 0-8, got {v!r}")
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"zero.reductions_in_flight must be auto or 0-8, got {v!r}") from None
        if not 0 <= n <= 8:
            raise ValueError(f"zero.reductions_in_flight must be auto or 0-8, got {n}")
        return n

    def in_flight(self, device_type: str) -> int:
        """`reductions_in_flight` resolved for a device ("cuda", "cpu", ...)."""
        if self.reductions_in_flight == "auto":
            return 2 if device_type == "cuda" else 0
        return int(self.reductions_in_flight)

    @model_validator(mode="after")
    def _options_need_their_shard(self) -> ZeroConfig:
        problems = zero_option_problems(self)  # config/zero_facts.py: the facts, once
        if problems:
            raise ValueError("; ".join(problems))
        if "nvme" in (self.offload_param, self.offload_optimizer) and not self.nvme_path:
            raise ValueError("an nvme offload tier needs zero.nvme_path (a directory on a fast "
                             "local disk, e.g. zero.nvme_path: /local_nvme/zerotrain)")
        return self


class CommConfig(_Section):
    algorithm: Literal["native", "ring", "auto"] = Field(
        "auto", description="native: torch.distributed's collectives; ring: zerotrain's ring "
        "over isend/irecv; auto: the ring for reduce-scatters and all-gathers of buffers >= "
        "ring_min_mb on gloo, native otherwise"
    )
    ring_min_mb: float = Field(2.0, gt=0.0, description="auto: smallest buffer for the ring")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: int = Field(
        120, ge=10, description="how long a collective may wait for the other ranks before "
        "the job fails (a stuck rank, or ranks that ran different collectives: see "
        "check_lockstep). On gloo the error names this setting; on NCCL the watchdog aborts "
        "the process instead (SIGABRT and a watchdog dump). One rank's solo work — data "
        "preparation, checkpoint finishing, the optimizer's compile — is exempt")
    grad_group: bool | Literal["auto"] = Field(
        "auto", description="gradient reductions on a process group of their own; on NCCL "
        "each group is one CUDA stream, so ZeRO-3's reduce-scatters then run beside the "
        "prefetch all-gathers instead of queueing behind them. auto: on with NCCL")
    node_size: int | None = Field(
        None, ge=1, description="ranks per node (consecutive ranks share one): splits the byte "
        "counts into intra- and inter-node bytes and places ZeRO++'s groups. null: "
        "LOCAL_WORLD_SIZE, else one node. Set it to emulate nodes on one machine")
    check_lockstep: bool = Field(
        False, description="debug: before every collective, check across ranks that all "
        "run the same one (sequence number, operation, size); a mismatch is an error naming "
        "the ranks, not a hang. One small extra all-gather per collective")


class CheckpointConfig(_Section):
    dir: str | None = Field(None, description="default: <logging.run_dir>/checkpoints")
    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    keep: int = Field(2, ge=1, description="how many recent checkpoints of this run to keep")
    reset_optimizer: bool = Field(
        False, description="on resume, start the optimizer state afresh (needed to resume "
        "with another optimizer); weights, counters and loss scale still load")


class WandbConfig(_Section):
    """Weights & Biases run naming; offline unless the WANDB_MODE environment variable says."""

    project: str = "zerotrain"
    entity: str | None = Field(None, description="team or user; None: wandb's default")
    group: str | None = None


class LoggingConfig(_Section):
    run_dir: str = "runs/default"
    backends: list[Literal["jsonl", "tensorboard", "wandb", "csv"]] = Field(
        default_factory=lambda: ["jsonl"], description="where metrics go (rank 0): jsonl "
        "(metrics.jsonl), tensorboard, wandb, csv; each but jsonl and csv is an optional extra "
        "(pip install 'zerotrain[tensorboard]')")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=0, description="0 disables periodic validation")
    eval_batches: int = Field(8, ge=1)
    plot: bool = True
    sample_tokens: int = Field(300, ge=0)
    progress: bool = True
    overwrite: bool = Field(
        False, description="start afresh in a run_dir that holds another run, deleting its "
        "checkpoints and metrics (otherwise that is refused)")

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: Any) -> Any:
        # `--logging.backends tensorboard,csv` on the command line arrives as one string
        v = [b.strip() for b in v.split(",") if b.strip()] if isinstance(v, str) else v
        if isinstance(v, list) and len(set(map(str, v))) != len(v):
            raise ValueError(f"logging.backends lists a backend twice: {v}")
        return v


class SpikeGuardConfig(_Section):
    """Skip a step whose loss or gradient norm is an outlier (off by default)."""

    enabled: bool = False
    window: int = Field(50, ge=5, description="recent steps the mean and spread come from")
    zscore: float = Field(6.0, gt=0.0, description="skip beyond this many standard deviations")


class FaultConfig(_Section):
    """Fault injection, for tests and demos of --max-restarts: SIGKILL rank `rank` when it
    completes step `step` (in the job's first attempt only; null: never)."""

    rank: int = Field(0, ge=0)
    step: int | None = Field(None, ge=1)


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1)
    seed: int = Field(1337, ge=0, le=2**63 - 1, description="0 to 2^63-1: numpy's and "
                      "torch's generators take no negative seed")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: cores / local ranks)"
    )
    host_mmap_mb: float | Literal["auto"] | None = Field(
        "auto", description="host (glibc) tensors of at least this many MiB (at most 32) get "
        "their own memory map, returned to the OS when freed; glibc's default lets its "
        "heap keep freed blocks below a threshold that rises to 32 MiB, which a long "
        "sequence's step fragments (memory/host.py). auto: 4 with sequence.tile_tokens or "
        "sequence.parallel > 1 (above the CPU optimizer's 1 MiB blocks), else glibc's "
        "default (fresh maps cost page faults: the main job ran 35% slower with 1); "
        "null: glibc's default (so does a MALLOC_MMAP_THRESHOLD_ in the environment)")
    max_skipped_steps: int = Field(
        50, ge=1, description="abort after this many consecutive skipped (non-finite) steps; "
        "fp16's loss-scale search never needs as many")
    spike_guard: SpikeGuardConfig = Field(default_factory=SpikeGuardConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)

    @field_validator("host_mmap_mb")
    @classmethod
    def _mmap_mb(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float | int) and not 0 < v <= 32:
            raise ValueError(f"train.host_mmap_mb must be in (0, 32] MiB (glibc's limit), "
                             f"auto or null, got {v}")
        return v


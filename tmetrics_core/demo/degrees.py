"""Parallel degrees of a demo run and the DeviceMesh they describe.

Vocabulary: an *axis* is a named mesh dimension bound to a process group; a *dim* is a tensor
dimension. Axes, outermost first (global rank = row-major index over the present axes):

=============  ============================================================================
``pp``         pipeline stages; each owns contiguous layers
``dp_rep``     HSDP only: replicas of the FSDP shard group
``dp``         data parallel: DDP replicas, or FSDP2 shards with ``fsdp`` (``dp_shard`` in HSDP)
``ep``         expert parallel; each rank owns ``n_experts / ep`` experts and its own batch rows
``tp``         tensor parallel (DTensor); ranks share batch rows
=============  ============================================================================

Only axes of size > 1 are in the mesh. The global batch is split over the *data axes*
(``dp_rep``, ``dp``/``dp_shard``, ``ep``); ``tp`` and ``pp`` ranks of one data slice see the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.errors import ConfigError

__all__ = ["ParallelDegrees"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDegrees:
    """Degrees of parallelism; their product is the world size. Defaults: one process."""

    dp: int = 1
    """Data-parallel degree: DDP replicas, or FSDP2 shards when ``fsdp`` (the HSDP shard size)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP hidden units split over ``tp`` ranks."""
    ep: int = 1
    """Expert-parallel degree: experts split over ``ep`` ranks, which also split the batch."""
    pp: int = 1
    """Pipeline degree: layers split into ``pp`` contiguous stages."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over ``dp`` with FSDP2 (``fully_shard``)."""
    dp_replicate: int = 1
    """HSDP: number of replicas of each FSDP shard group (needs ``fsdp``)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep", "pp", "dp_replicate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"got {getattr(self, name)}; need >= 1", path=f"--{name.replace('_', '-')}")
        if self.dp_replicate > 1 and not self.fsdp:
            raise ConfigError(f"dp_replicate={self.dp_replicate} (HSDP replicas) needs fsdp=True; "
                              "set fsdp or use dp_replicate=1", path="topology.dp_replicate")
        if self.fsdp and self.dp < 2:
            raise ConfigError(f"--fsdp shards over the data-parallel axis, but dp is {self.dp}; "
                              "use --dp 2 or more (or more --nproc)", path="--fsdp")
        if self.ep > 1 and (self.dp > 1 or self.fsdp or self.tp > 1):
            raise ConfigError(
                f"expert parallelism combines with --pp only (got dp={self.dp}, tp={self.tp}, "
                f"fsdp={self.fsdp}); the expert-parallel ranks already split the batch", path="--ep")

    @classmethod
    def for_world(cls, world_size: int, *, dp: int | None = None, tp: int = 1, ep: int = 1, pp: int = 1,
                  fsdp: bool = False, dp_replicate: int = 1) -> ParallelDegrees:
        """The topology for ``world_size`` ranks; ``dp`` defaults to what the other degrees leave.

        Raises:
            ConfigError: the degrees do not multiply to ``world_size``.
        """
        rest = tp * ep * pp * dp_replicate
        if dp is None:
            if world_size % rest:
                raise ConfigError(f"world size {world_size} is not a multiple of tp*ep*pp*dp_replicate = "
                                  f"{tp}*{ep}*{pp}*{dp_replicate} = {rest}; change --nproc or the degrees",
                                  path="--nproc")
            dp = world_size // rest
        topology = cls(dp=dp, tp=tp, ep=ep, pp=pp, fsdp=fsdp, dp_replicate=dp_replicate)
        if topology.world_size != world_size:
            raise ConfigError(
                f"dp_replicate*dp*ep*tp*pp = {dp_replicate}*{dp}*{ep}*{tp}*{pp} = {topology.world_size}, "
                f"but the world size is {world_size}; make them equal", path="--nproc")
        return topology

    def __str__(self) -> str:
        """Short form for logs: ``"dp=2 x tp=2"``, ``"pp=2 x fsdp=2"``, or ``"single process"``."""
        parts = [f"{'fsdp' if self.fsdp and name in ('dp', 'dp_shard') else name}={size}" for name, size in self.axes]
        return " x ".join(parts) or "single process"

    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp_replicate * dp * ep * tp * pp``."""
        return self.dp_replicate * self.dp * self.ep * self.tp * self.pp

    @property
    def data_parallel(self) -> int:
        """Number of distinct slices of the global batch: ``dp_replicate * dp * ep``."""
        return self.dp_replicate * self.dp * self.ep

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Names of the data-parallel axes of the parameters (``dp``, or ``dp_rep``, ``dp_shard``)."""
        if self.dp_replicate > 1:
            return ("dp_rep", "dp_shard")
        return ("dp",) if self.dp > 1 else ()

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of every mesh axis of size > 1, outermost first."""
        named = [("pp", self.pp), ("dp_rep", self.dp_replicate),
                 ("dp_shard" if self.dp_replicate > 1 else "dp", self.dp), ("ep", self.ep), ("tp", self.tp)]
        return tuple((name, size) for name, size in named if size > 1)

    def check(self, config: ModelConfig, *, batch_size: int) -> None:
        """Raise :class:`ConfigError` unless ``config`` and ``batch_size`` split evenly.

        Needs: ``n_heads % tp == 0``, ``d_ff % tp == 0``, ``n_experts % ep == 0``,
        ``n_layers >= pp`` and ``batch_size % (dp_replicate * dp * ep) == 0``.
        """
        checks = [
            (config.n_heads % self.tp == 0, f"n_heads {config.n_heads} is not a multiple of tp {self.tp}", "--tp"),
            (config.d_ff % self.tp == 0, f"d_ff {config.d_ff} is not a multiple of tp {self.tp}", "--tp"),
            (config.n_experts % self.ep == 0,
             f"n_experts {config.n_experts} is not a multiple of ep {self.ep}", "--ep"),
            (config.n_layers >= self.pp, f"{config.n_layers} layers cannot fill {self.pp} stages", "--pp"),
            (batch_size % self.data_parallel == 0,
             f"global batch {batch_size} is not a multiple of the {self.data_parallel} data-parallel ranks",
             "--dp"),
        ]
        for ok, message, path in checks:
            if not ok:
                raise ConfigError(message, path=path)

    def stage_layers(self, n_layers: int, stage: int) -> range:
        """Global layer indices of pipeline ``stage``: contiguous, earlier stages take the remainder."""
        base, extra = divmod(n_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def stage_experts(self, n_experts: int, ep_rank: int) -> range:
        """Global expert indices owned by ``ep_rank``: ``n_experts / ep`` contiguous experts."""
        per_rank = n_experts // self.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def build_mesh(self) -> DeviceMesh | None:
        """A CPU DeviceMesh over :attr:`axes` (``None`` for one process). Needs an initialised group."""
        if self.world_size == 1:
            return None
        names, sizes = zip(*self.axes)
        return init_device_mesh("cpu", tuple(sizes), mesh_dim_names=tuple(names))

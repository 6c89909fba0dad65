"""The hybrid DP x PP x TP process-group layout, on torch's DeviceMesh.

A job of ``dp * pp * tp`` processes is a three-dimensional grid: ``tp`` ranks split each
layer (tensor parallel), ``pp`` stages split the layers (pipeline parallel), ``dp`` replicas
split the batch (data parallel). Every rank belongs to one group along each dimension.

Rank placement follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", arXiv 1909.08053;
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21, arXiv 2104.04473): tensor parallel innermost, then data
parallel, pipeline parallel outermost::

    global rank = (pp_i * dp + dp_i) * tp + tp_i

Consecutive ranks form a tp group, so on real machines the tensor-parallel ranks (two
activation allreduces per block, the most traffic) share a node and its fast links (on
the emulated cluster, a host); the pipeline's point-to-point traffic, the least, crosses
the slowest links. The torch ``DeviceMesh`` is built with shape ``(pp, dp, tp)`` and
dimension names ``("pp", "dp", "tp")``, the same order, so ``device_mesh.mesh`` is
``arange(world).reshape(pp, dp, tp)``.

:class:`MeshLayout` is the arithmetic alone (no process, no collective): tests, the
planner and :meth:`Mesh.describe` use it. :class:`Mesh` adds this rank and its groups.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.errors import ConfigError, DTrainError

__all__ = ["DIMS", "Mesh", "MeshLayout", "mesh_rank"]

DIMS: tuple[str, ...] = ("dp", "pp", "tp")
"""The dimension names, in the order coordinates are printed and passed."""

_MESH_ORDER: tuple[str, ...] = ("pp", "dp", "tp")
"""Outermost to innermost: the DeviceMesh's dimension order."""


def mesh_rank(dp_i: int, pp_i: int, tp_i: int, *, dp: int, tp: int) -> int:
    """Global rank of mesh coordinate ``(dp_i, pp_i, tp_i)``: tp innermost, then dp, pp outermost
    (``(pp_i * dp + dp_i) * tp + tp_i``; :meth:`MeshLayout.coords` is its inverse)."""
    return (pp_i * dp + dp_i) * tp + tp_i


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"mesh size {name} must be a positive int, got {value!r} (bool)")
    try:
        n = operator.index(value)
    except TypeError:
        raise ConfigError(f"mesh size {name} must be a positive int, got {value!r} ({type(value).__name__})") from None
    if n < 1:
        raise ConfigError(f"mesh size {name} must be a positive int, got {n}; use 1 for no {name} parallelism")
    return n


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ConfigError(f"unknown mesh dimension {dim!r}; one of {', '.join(DIMS)}")
    return dim


@dataclass(frozen=True)
class MeshLayout:
    """Where every global rank sits in a ``dp x pp x tp`` grid; pure arithmetic.

    Args:
        dp: data-parallel replicas (default: 1).
        pp: pipeline stages (default: 1).
        tp: tensor-parallel ranks per stage (default: 1).

    Raises:
        ConfigError: a size is not a positive int.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))

    @property
    def world_size(self) -> int:
        """The number of processes the layout needs: ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    def size(self, dim: str) -> int:
        """The size of dimension ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``)."""
        return int(getattr(self, _check_dim(dim)))

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError unless the layout fills a world of ``world_size`` processes exactly."""
        if self.world_size != world_size:
            raise ConfigError(
                f"dp {self.dp} x pp {self.pp} x tp {self.tp} = {self.world_size} "
                f"process{'es' if self.world_size > 1 else ''}, "
                f"but the world has {world_size}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank``: ``{"dp": dp_i, "pp": pp_i, "tp": tp_i}``.

        Raises:
            ConfigError: ``rank`` is outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh's {self.world_size} processes")
        rest, tp_i = divmod(rank, self.tp)
        pp_i, dp_i = divmod(rest, self.dp)
        return {"dp": dp_i, "pp": pp_i, "tp": tp_i}

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The global rank at coordinates ``(dp, pp, tp)``: ``(pp * DP + dp) * TP + tp``.

        Raises:
            ConfigError: a coordinate is outside its dimension.
        """
        for name, i in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not 0 <= i < self.size(name):
                raise ConfigError(f"{name} coordinate {i} is outside [0, {self.size(name)})")
        return mesh_rank(dp, pp, tp, dp=self.dp, tp=self.tp)

    def ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``dim``, ascending (``rank`` among them)."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, dim: i}) for i in range(self.size(_check_dim(dim)))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, ordered by its first rank; together they partition the world."""
        _check_dim(dim)
        return [g for r in range(self.world_size) if (g := self.ranks(dim, r))[0] == r]

    def table(self) -> list[dict[str, int]]:
        """The coordinates of every global rank, indexed by rank."""
        return [self.coords(r) for r in range(self.world_size)]

    def describe(self, mark: int | None = None) -> str:
        """A text table: a header, then one line per global rank with its coordinates and groups.

        Args:
            mark: a rank whose line ends with ``" <- this rank"`` (default: none).

        Returns:
            e.g. ``"rank 5: dp 0, pp 1, tp 1 | tp group [4, 5], dp group [5, 7], pp group [1, 5]"``
            for each rank, under ``"mesh dp 2 x pp 2 x tp 2 = 8 processes (tp innermost, pp outermost)"``.
        """
        width = len(str(self.world_size - 1))
        lines = [
            f"mesh dp {self.dp} x pp {self.pp} x tp {self.tp} = {self.world_size} "
            f"process{'es' if self.world_size > 1 else ''} (tp innermost, pp outermost)"
        ]
        for r, c in enumerate(self.table()):
            where = ", ".join(f"{d} {c[d]}" for d in DIMS)
            groups = ", ".join(f"{d} group {self.ranks(d, r)}" for d in _MESH_ORDER[::-1])
            lines.append(f"rank {r:>{width}}: {where} | {groups}" + (" <- this rank" if r == mark else ""))
        return "\n".join(lines)


class Mesh:
    """The hybrid DP x PP x TP mesh of this job: this rank's coordinates and process groups.

    Every rank must build the same mesh, in the same order relative to its other
    collectives (building it creates the DeviceMesh's groups, which is collective). The
    sizes are checked before anything is created, so a wrong shape fails on every rank
    with the same :class:`~dtrain.errors.ConfigError` instead of hanging.

    Without ``torch.distributed`` initialised the world is this one process: every size
    must be 1, :attr:`device_mesh` is None and :meth:`group` returns None (collectives
    on a world of 1 are no-ops; callers skip them). With it initialised every dimension
    has a real group, a group of one rank where the size is 1.

    Args:
        dp: data-parallel replicas (default: 1).
        pp: pipeline stages (default: 1).
        tp: tensor-parallel ranks per stage (default: 1).
        device_type: the DeviceMesh's device type (default: ``"cuda"`` when the default
            process group's backend is NCCL, else ``"cpu"``).

    Raises:
        ConfigError: a size is not a positive int, or ``dp * pp * tp`` is not the world size.

    Example::

        mesh = dtrain.Mesh(dp=2, pp=2, tp=2)          # on 8 processes
        dist.all_reduce(grad, group=mesh.group("dp"))
        print(mesh.describe())
    """

    def __init__(self, *, dp: int = 1, pp: int = 1, tp: int = 1, device_type: str | None = None) -> None:
        self._layout = MeshLayout(dp=dp, pp=pp, tp=tp)
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        self._layout.check_world(world)
        self._rank = dist.get_rank() if initialised else 0
        self._device_mesh: DeviceMesh | None = None
        if device_type is None:
            device_type = "cuda" if initialised and "nccl" in str(dist.get_backend()) else "cpu"
        self._device_type = device_type
        if initialised:
            shape = tuple(self._layout.size(d) for d in _MESH_ORDER)
            self._device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=_MESH_ORDER)
            self._check_agrees(self._device_mesh)

    def _check_agrees(self, device_mesh: DeviceMesh) -> None:
        # A torch whose DeviceMesh numbered ranks differently would silently swap groups.
        coordinate = device_mesh.get_coordinate()
        mine = self.coords(self._rank)
        if coordinate is None or list(coordinate) != [mine[d] for d in _MESH_ORDER]:
            raise DTrainError(
                f"rank {self._rank}: torch's DeviceMesh places this rank at {coordinate} (pp, dp, tp), "
                f"dtrain's layout at {mine}"
            )

    @classmethod
    def layout(cls, dp: int = 1, pp: int = 1, tp: int = 1) -> MeshLayout:
        """The coordinates table of a ``dp x pp x tp`` mesh, without processes or groups.

        Returns:
            a :class:`MeshLayout` (``.table()``, ``.coords(rank)``, ``.groups(dim)``, ``.describe()``).
        """
        return MeshLayout(dp=dp, pp=pp, tp=tp)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of processes: ``dp * pp * tp``."""
        return self._layout.world_size

    @property
    def device_type(self) -> str:
        """The DeviceMesh's device type (``"cpu"`` or ``"cuda"``)."""
        return self._device_type

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The torch DeviceMesh, dimensions ``("pp", "dp", "tp")``; None without torch.distributed."""
        return self._device_mesh

    def size(self, dim: str) -> int:
        """The size of dimension ``dim`` (``"dp"``, ``"pp"`` or ``"tp"``)."""
        return self._layout.size(dim)

    def index(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self.coords(self._rank)[_check_dim(dim)]

    def group(self, dim: str) -> ProcessGroup | None:
        """This rank's process group along ``dim``; None without torch.distributed (a world of 1)."""
        _check_dim(dim)
        return None if self._device_mesh is None else self._device_mesh.get_group(dim)

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this rank's group along ``dim``, ascending."""
        return self._layout.ranks(dim, self._rank)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank``: ``{"dp": ..., "pp": ..., "tp": ...}``."""
        return self._layout.coords(rank)

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The global rank at coordinates ``(dp, pp, tp)``."""
        return self._layout.rank_of(dp=dp, pp=pp, tp=tp)

    def describe(self) -> str:
        """Every global rank with its coordinates and groups, one line each; this rank's line marked."""
        return self._layout.describe(mark=self._rank)

    def __repr__(self) -> str:
        lay = self._layout
        return (
            f"Mesh(dp={lay.dp}, pp={lay.pp}, tp={lay.tp}, rank={self._rank}, "
            f"coords={self.coords(self._rank)}, device_type={self._device_type!r})"
        )

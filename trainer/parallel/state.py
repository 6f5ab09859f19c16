"""ParallelState: the rank grid (tp fastest, then dp, then pp — Megatron's order) and its groups.

One validated object, built once and passed explicitly; there are no module-level groups. Rank r (its
position in ``ranks``) sits at ``tp_rank = r % tp``, ``dp_rank = (r // tp) % dp``, ``pp_rank = r // (tp·dp)``,
so a TP group is consecutive ranks (one node, NVLink) and pipeline neighbours are ``tp·dp`` apart.

Groups are :class:`Group` values; a one-rank group has no process group and every collective on it is a
no-op, so a world of one needs no torch.distributed at all. Each rank creates only the groups it belongs
to (``use_local_synchronization``), which also lets tests run several layouts side by side on disjoint
subsets of one process world.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """A communication group: its global ranks, and the process group (None when it has one rank)."""

    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    index: int = 0
    """This process's position in ``ranks`` (its rank within the group)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def check_layout(world_size: int, tp_size: int, pp_size: int) -> int:
    """The data-parallel size for a world, or a ValueError that names every factor."""
    model_parallel = tp_size * pp_size
    if tp_size < 1 or pp_size < 1 or world_size % model_parallel:
        raise ValueError(
            f"cannot lay out world_size={world_size} as tp_size={tp_size} × pp_size={pp_size} × dp_size: "
            f"{world_size} / ({tp_size}·{pp_size}) = {world_size / max(model_parallel, 1):g} is not a whole "
            f"data-parallel size. Choose tp_size·pp_size dividing {world_size}, or launch a multiple of "
            f"{model_parallel} ranks (nodes × GPUs per node).")
    return world_size // model_parallel


@dataclass(frozen=True)
class GridCell:
    """One rank's coordinates in the grid and the global ranks of its groups (pure arithmetic)."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]
    """(first, last) stage of the pipeline on the first and last stage; just this rank elsewhere."""


def grid_cell(ranks: list[int], tp_size: int, pp_size: int, rank: int) -> GridCell:
    """Where ``rank`` sits when ``ranks`` are laid out tp fastest, then dp, then pp."""
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the layout's ranks {ranks}")
    dp_size = check_layout(len(ranks), tp_size, pp_size)
    pos = ranks.index(rank)
    tp_rank, dp_rank, pp_rank = pos % tp_size, (pos // tp_size) % dp_size, pos // (tp_size * dp_size)

    def at(t: int, d: int, p: int) -> int:
        return ranks[p * tp_size * dp_size + d * tp_size + t]

    pp_ranks = tuple(at(tp_rank, dp_rank, p) for p in range(pp_size))
    ends = (pp_ranks[0], pp_ranks[-1]) if pp_size > 1 and pp_rank in (0, pp_size - 1) else (rank,)
    return GridCell(tp_rank, pp_rank, dp_rank, tuple(at(t, dp_rank, pp_rank) for t in range(tp_size)),
                    pp_ranks, tuple(at(tp_rank, d, pp_rank) for d in range(dp_size)), ends)


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the (pp, dp, tp) grid and the groups it communicates in."""

    tp_size: int
    pp_size: int
    dp_size: int
    rank: int
    """Global rank (torch.distributed rank; 0 in a world of one)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Group
    pp_group: Group
    dp_group: Group
    embedding_group: Group
    """First and last pipeline stage of this (tp, dp) column, for the tied embedding's gradient."""
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        check_layout(self.tp_size * self.pp_size * self.dp_size, self.tp_size, self.pp_size)
        for name, size in (("tp", self.tp_size), ("pp", self.pp_size), ("dp", self.dp_size)):
            if not 0 <= getattr(self, f"{name}_rank") < size:
                raise ValueError(f"{name}_rank={getattr(self, f'{name}_rank')} is outside "
                                 f"[0, {name}_size={size})")
            if getattr(self, f"{name}_group").size != size:
                raise ValueError(f"{name}_group has {getattr(self, f'{name}_group').size} ranks, not {size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (same tp, dp)."""
        return self.pp_group.ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (same tp, dp)."""
        return self.pp_group.ranks[self.pp_rank + 1]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """A world of one: no torch.distributed needed."""
        one = Group((0,))
        return cls(1, 1, 1, 0, 0, 0, 0, one, one, one, one, torch.device(device))

    @classmethod
    def build(cls, tp_size: int, pp_size: int, ranks: list[int] | None = None,
              device: torch.device | str = "cpu") -> ParallelState:
        """Lay ``ranks`` (default: the whole torch.distributed world) out as a grid and create groups.

        Call on every rank of ``ranks``; with more than one rank torch.distributed must be initialised.
        """
        if ranks is None:
            ranks = list(range(dist.get_world_size())) if dist.is_initialized() else [0]
        rank = dist.get_rank() if dist.is_initialized() else 0
        cell = grid_cell(ranks, tp_size, pp_size, rank)
        # Fixed creation order (tp, dp, pp, embedding): the members of each group reach it in step.
        tp, dp, pp = _group(cell.tp_ranks), _group(cell.dp_ranks), _group(cell.pp_ranks)
        # A process group's name is its rank set, so the pp=2 embedding group reuses the pp group.
        emb = pp if cell.embedding_ranks == cell.pp_ranks else _group(cell.embedding_ranks)
        device = torch.device(device)
        if device.type != "cpu":
            # NCCL creates communicators lazily, at a group's first operation, which all its members must
            # join; the pipeline's first p2p ops are not collective, so initialise every group here.
            for group in (tp, dp, pp, emb):
                if group.pg is not None:
                    dist.all_reduce(torch.zeros(1, device=device), group=group.pg)
        return cls(tp_size, pp_size, len(ranks) // (tp_size * pp_size), rank, cell.tp_rank, cell.pp_rank,
                   cell.dp_rank, tp, pp, dp, emb, device)

    def destroy(self) -> None:
        """Destroy this state's process groups.

        A group's name is its rank set, and its rendezvous keys stay in the world's store, so a new
        layout over the same ranks needs a new world (re-initialised torch.distributed), not just this.
        """
        seen: set[int] = set()
        for group in (self.tp_group, self.dp_group, self.pp_group, self.embedding_group):
            if group.pg is not None and id(group.pg) not in seen:
                seen.add(id(group.pg))
                dist.destroy_process_group(group.pg)


def _group(ranks: tuple[int, ...]) -> Group:
    if len(ranks) == 1:
        return Group(ranks)
    index = ranks.index(dist.get_rank())
    return Group(ranks, dist.new_group(list(ranks), use_local_synchronization=True), index)

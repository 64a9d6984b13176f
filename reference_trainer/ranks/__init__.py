"""Logical data parallelism: L logical ranks over W processes, in rank mode and zero mode.

This ``__init__`` is the subpackage's public boundary: the names below are
what the rest of the project uses. ``logical.py`` holds the entry points
(``run_logical``, the rank-mode view :class:`LogicalRank`,
``logical_gradients``, ``logical_traffic``); ``state.py`` what a trainer
keeps for its logical ranks between calls (its gradients are folded by
``reduction.py`` in the order of ``tree.py``, fed by the trainer's own
``RankGradients`` sink, ``sinks.py``); each rule below names the module that
holds the rest.

NOTE [Logical ranks]
  1. Layout (``layout.py``): ``logical_dp = L`` logical ranks over the default group's ``W`` processes (none:
     ``W = 1``), ``L % W == 0``; physical rank ``p`` hosts logical ranks ``p*L/W ... (p+1)*L/W - 1``.
  2. Fibers (``fibers.py``): each hosted logical rank runs on its own thread, one at a time in logical order (a
     baton) between collective points, with its own RNG stream (rank 0's seed and the logical rank), so what it
     computes does not depend on the hosting process. Its outputs are backpropagated only through its own view (also
     in a later ``run_logical``); other backwards, and ``trainer.backward`` or ``load_checkpoint`` in ``fn``, are
     refused: they would bypass the logical ranks' buffers (``RankGradients.check_route``).
  3. Rounds (``fibers.py``): at a collective point (``reduce``, a backward's agreement, the end of ``fn``) every
     process runs its fibers to their next point, then all exchange what each logical rank asked for and act
     together; different requests in one round fail every logical rank, so no process waits in a mismatched call.
  4. Fixed order (``tree.py``, ``reduction.py``, ``layout.ordered_sum``), so the bits depend on ``L`` only, never on
     ``W``. With ``g[b][r]`` what logical rank ``r`` committed in the ``b``-th agreed backward round since the last
     step, ``optim_step`` adds ``sum_b tree(g[b][0..L-1])`` (rounds left to right; ``tree(lo, hi) = tree(lo, m) +
     tree(m, hi)``, ``m - lo`` the largest power of two below ``hi - lo``; a rank without the tensor is skipped, not
     added as zero). Per agreed round one ``all_to_all`` per bucket gives rank ``q`` shard ``q`` to finish, and
     ``optim_step`` all-gathers the shards (about ``(W-1)/W`` of the gradient bytes per round and per step);
     ``view.reduce`` adds left to right in logical order. Bitwise equal: every ``W`` dividing ``L``; zero and rank
     mode; at ``L <= 2`` a plain ``Trainer`` with one forward per logical chunk and one backward of the global loss.
  5. Gradients (``state.py``, ``sinks.py``): a backward commits through its logical rank's ``BufferGradSink`` in the
     trainer's ``rank_gradients`` sink, which folds it (Rule 4), keeps the origins, owns the gradient (held once,
     NOTE [Gradient commit] Rule 5) and agrees with every other logical rank (Rule 6): all commit or none.
     ``optim_step`` validates the origins in ``.grad`` and the buffers on every process before it adds the sums and
     steps; ``zero_grad`` drops the sums; ``load_checkpoint`` refuses while any are pending (``discard_graphs=True``
     drops them). ``logical_gradients`` and ``logical_traffic`` show the pending shards and the bytes moved.
  6. Errors (``../peers.py``; ``fibers.py`` and ``zero.py`` pick it): the lowest logical rank's own error is raised
     on every process (the original where it happened, the same type rebuilt elsewhere), so all take the same path.
     A process that dies, hangs past ``timeout_s`` or diverges makes the others raise ``PeerError`` naming it.
  7. Zero mode (``zero.py``): global rank 0 runs ``fn(zero)``; the others serve its commands. ``forward`` spreads
     inputs over logical ranks in contiguous chunks, in order, and gives rank 0 leaf copies of the outputs (a copy
     rank 0 drops frees the hosted output at the next command); ``backward`` computes the cotangents on rank 0 and
     each logical rank backpropagates ``sum((leaf * cotangent).sum())``, bitwise the direct path's gradient. A
     command's error is raised everywhere; if rank 0's ``fn`` catches it, the servers follow.
  8. Transport (``../peers.py``): control messages go through rank 0 (a star), so a silent peer is named; tensors go
     by collectives (gloo on CPU, NCCL on GPU), started only once every process has the command or reported
     success, so a local failure never leaves a peer waiting in a collective.
"""

from __future__ import annotations

from ..errors import PeerError
from ..peers import PeerFailure, TrafficCount, init_distributed
from .batches import LogicalBatch, logical_batches
from .layout import LogicalLayout, ordered_sum, spread
from .logical import LogicalRank, logical_gradients, logical_traffic, run_logical
from .zero import RankZero

__all__ = [
    "LogicalBatch",
    "LogicalLayout",
    "LogicalRank",
    "PeerError",
    "PeerFailure",
    "RankZero",
    "TrafficCount",
    "init_distributed",
    "logical_batches",
    "logical_gradients",
    "logical_traffic",
    "ordered_sum",
    "run_logical",
    "spread",
]

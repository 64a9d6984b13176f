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
  1. Layout (``layout.py``): ``logical_dp = L`` logical ranks over the ``W``
     processes of the default process group (none: ``W = 1``),
     ``L % W == 0``. Physical rank ``p`` hosts the consecutive logical ranks
     ``p*L/W ... (p+1)*L/W - 1``.
  2. Fibers (``fibers.py``): each hosted logical rank's code runs on its own
     thread, but only while it holds the process's baton, so hosted ranks
     run one at a time in logical order between collective points. Each
     draws from its own RNG stream (seeded by rank 0's seed and the logical
     rank), so what a logical rank computes does not depend on which process
     hosts it. A view's outputs belong to its logical rank: backpropagate
     them through the view of that logical rank (in a later ``run_logical``
     call if need be): any other backward of them is refused, and so are
     ``trainer.backward`` and ``load_checkpoint`` inside ``fn``, which would
     bypass the logical ranks' buffers (``RankGradients.check_route``).
  3. Rounds (``fibers.py``): at a collective point (``reduce``, a backward's
     agreement, the end of ``fn``) every process runs its fibers to their
     next point, then all processes exchange what each logical rank asked
     for and act together. Different requests in one round (one logical rank
     reduces while another returned) fail every logical rank.
  4. Fixed order (``tree.py``, ``reduction.py``; ``layout.ordered_sum``).
     A gradient's leaves are ``g[b][r]``: what logical rank ``r`` committed
     in the ``b``-th agreed backward round since the last ``optim_step``
     (every logical rank takes part in every round, Rule 3, so ``b`` counts
     rounds across ``run_logical`` calls). ``optim_step`` adds
     ``sum_b tree(g[b][0], ..., g[b][L-1])`` to ``.grad``, rounds left to
     right, where ``tree`` over ranks ``lo .. hi-1`` is
     ``tree(lo, m) + tree(m, hi)`` with ``m - lo`` the largest power of two
     below ``hi - lo``, and a rank without the tensor is skipped (not added
     as zero). The tree depends on ``L`` only, so the bits do not depend on
     ``W``. A process folds each hosted rank's commit as it publishes (a
     binary counter: with ``k = L/W`` a power of two at most
     ``log2(k) + 1`` partial sums); once every process agreed the round, one
     ``all_to_all`` per bucket sends shard ``q`` of each partial sum to
     physical rank ``q``, which finishes the tree for its shard and adds it
     to its running total; ``optim_step`` all-gathers the shards. Per
     process and round: about ``(W-1)/W`` of the gradient bytes received,
     and as much again per step. A chunk that is not one subtree (``k`` not
     a power of two) ships the two or three subtrees that cover it, the
     same bits at that many times the bytes. ``view.reduce`` (small tensors)
     all-gathers and adds left to right in logical order, ``((x0 + x1) +
     x2) + ...`` (``ordered_sum``). What is bitwise equal, then: the same
     job for every ``W`` dividing ``L``; zero mode and rank mode (per-rank
     losses summing to the global one); and, at ``L <= 2`` only (where the
     tree is left to right), a plain ``Trainer`` that makes one forward call
     per logical rank's chunk, in logical order, and one backward of the
     global loss per optimizer step. Otherwise the plain trainer's
     left-to-right sums equal the tree in exact arithmetic only, and so do
     ``sum_b (sum_r ...)`` and ``sum_r (sum_b ...)``.
  5. Gradients (``state.py``, ``sinks.py``): in a logical mode a backward
     commits through its logical rank's ``BufferGradSink`` in the trainer's
     ``rank_gradients`` sink, which hands each gradient to the fold of Rule
     4 and keeps the origins (NOTE [Gradient commit] Rule 5: it takes
     ownership, so a folded gradient is held once), and agrees with every
     other logical rank (Rule 6): all commit or none; a failed round drops
     what it folded, whole. ``optim_step``, called on every process,
     validates every origin already in ``.grad`` (the outcome agreed by
     every process, Rule 6), gathers the sums of Rule 4, validates every
     buffered origin, and only then adds the sums to ``.grad``, drops them
     and steps, the same everywhere; ``zero_grad`` drops the sums,
     ``load_checkpoint`` refuses while any are pending
     (``discard_graphs=True`` drops them). ``logical_gradients`` shows this
     process's shards of the pending sums; ``logical_traffic`` the bytes
     each collective moved (``peers.TrafficCount``).
  6. Errors (``../peers.py`` carries them; ``fibers.py`` and ``zero.py`` pick
     the common one): the lowest logical rank's own error (not one it
     received from a peer) is the common error; every process raises it: the
     original object where it happened, elsewhere the same type rebuilt from
     its args and attributes. A process that dies, hangs past ``timeout_s``
     or diverges makes the others raise ``PeerError`` naming it and the
     command; the job cannot go on after that.
  7. Zero mode (``zero.py``): global rank 0 runs ``fn(zero)``; the other
     processes serve its commands. ``forward`` spreads inputs over logical
     ranks in contiguous chunks, in source order; rank 0 gets leaf copies of
     every output. ``backward`` computes every output's cotangent on rank 0
     and each logical rank backpropagates ``sum((leaf * cotangent).sum())``
     over its outputs, whose cotangents are then exactly the sent ones: the
     gradient is bitwise that of the direct path. A copy rank 0 drops frees
     the hosted output (and its graph) at the next command, before it runs.
     A command's error is raised on every process; rank 0's ``fn`` may catch
     it and go on, and the servers follow.
  8. Transport (``../peers.py``): control messages go through rank 0 (a star),
     so a silent peer is named; tensors travel by collectives (gloo on CPU,
     NCCL on GPU). A data collective starts only when every process has
     received the command that needs it or has reported success in a
     control exchange, so a local failure never leaves a peer waiting in a
     collective.
"""

from __future__ import annotations

from .batches import LogicalBatch, logical_batches
from .layout import LogicalLayout, ordered_sum, spread
from .logical import LogicalRank, logical_gradients, logical_traffic, run_logical
from .zero import RankZero
from ..peers import PeerFailure, TrafficCount, init_distributed
from ..errors import PeerError

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

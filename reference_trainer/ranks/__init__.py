"""Logical data parallelism: L logical ranks over W processes, in rank mode and zero mode.

This ``__init__`` is the subpackage's public boundary: the names below are
what the rest of the project uses. ``logical.py`` holds the entry points
(``run_logical``, the rank-mode view :class:`LogicalRank`,
``logical_gradients``); ``state.py`` what a trainer keeps for its logical
ranks between calls (its gradient buffers live in the trainer's own
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
  4. Fixed order (``layout.ordered_sum``): a sum over logical ranks gathers
     every logical rank's contribution to every process and adds them left
     to right in logical-rank order, ``((x0 + x1) + x2) + ...``, so the bits
     do not depend on ``W``. What is bitwise equal, then: the same job for
     every ``W`` dividing ``L``; and zero mode, rank mode (per-rank losses
     summing to the global one) and a plain ``Trainer`` that makes one
     forward call per logical rank's chunk, in logical order, and one
     backward of the global loss per optimizer step. With k backwards per
     step the plain trainer associates ``sum_b (sum_r g[b][r])`` and logical
     ranks ``sum_r (sum_b g[b][r])``: equal in exact arithmetic only.
  5. Gradients (``state.py``, ``sinks.py``): in a logical mode a backward
     commits into its logical rank's own buffer in the trainer's
     ``rank_gradients`` sink (NOTE [Gradient commit] Rule 5) and agrees with
     every other logical rank (Rule 6): all commit or none. ``optim_step``,
     called on every process, validates every origin already in ``.grad``
     (the outcome agreed by every process, Rule 6), sums the buffers by
     Rule 4, validates every buffered origin, and only then adds the sums to
     ``.grad`` and steps, the same everywhere; ``zero_grad`` clears the buffers, ``load_checkpoint`` refuses
     while any are pending (``discard_graphs=True`` drops them).
  6. Errors (``peers.py`` carries them; ``fibers.py`` and ``zero.py`` pick
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
  8. Transport (``peers.py``): control messages go through rank 0 (a star),
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
from .peers import PeerFailure, TrafficCount, init_distributed
from .zero import RankZero
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

"""The rollout side: a KV-cached sampling engine and the weight publications it serves.

It imports the trainer's model code (``model``, ``lora``, ``sampling``) and
its version and error types, never the trainer itself: a trainer sends it
weights through ``Trainer.publish`` (NOTE [Weight publication] in
``publication.py``), and its samples go back to ``Trainer.forward`` as
``ForwardInput`` s with per-token behaviour log-probs and revisions.
"""

from .engine import Generation, RolloutEngine
from .publication import PublicationReport, WeightPublication, publication_of

__all__ = ["Generation", "PublicationReport", "RolloutEngine", "WeightPublication", "publication_of"]

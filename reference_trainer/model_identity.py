"""The base model's identity: its config and a digest of its weights, which a save holds and a load compares.

A save records :func:`model_identity` of the trainer's base model, and
``Trainer.load`` refuses a model whose identity differs (NOTE [Resume]
Rule 1 in ``resume.py``). The digest is the SHA-256 of every ``state_dict``
entry in order, each as ``name:dtype:shape`` then its raw bytes, read in
place from a contiguous CPU copy with torch alone (no numpy): the same
digest numpy's bytes give, so saves written before stay loadable.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from .model import DecoderLM

__all__ = ["model_identity"]


def model_identity(model: DecoderLM) -> dict[str, str]:
    """The base model's config and a SHA-256 of its weights (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, param in model.state_dict().items():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(_raw_bytes(tensor))
    return {"config": repr(model.config), "digest": digest.hexdigest()}


def _raw_bytes(tensor: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """A contiguous CPU tensor's bytes, in place, as a buffer ``hashlib`` reads (torch alone: no numpy, no copy).

    Valid while ``tensor`` lives; torch offers no buffer of its own (``bytes(storage)`` iterates byte by byte)."""
    return (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())

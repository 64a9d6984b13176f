"""The mutation suite (``canary``: every injected bug is caught) and its catalogue of bugs (``catalogue``).

The bugs are written beside the part of the trainer they break (``versions``,
``gradients``, ``ranks``, ``corrections``, ``memory``), each a ``Mutation``
of ``injection``; the catalogue lists them all.
"""

"""Loading progress: a log line at every tenth of a model's layers (and at the end), with the
bytes placed on the device so far, so a 61 GB model's minutes of loading are visible."""

from __future__ import annotations

import logging
import time

import jax

logger = logging.getLogger("jaxserve.models.loaders")


class LayerProgress:
    """Call `done(arrays)` once per loaded layer (and once for the rest of the model)."""

    def __init__(self, what: str, num_layers: int):
        self.what, self.num_layers = what, num_layers
        self.loaded, self.nbytes = 0, 0
        self.t0 = time.perf_counter()
        self._next = 1

    def done(self, arrays, layer: bool = True) -> None:
        leaves = [a for a in jax.tree.leaves(arrays) if isinstance(a, jax.Array)]
        self.nbytes += sum(a.nbytes for a in leaves)
        if not layer:
            return
        self.loaded += 1
        # NOTE: every tenth: waiting for the layer makes the line say what is on the device,
        # not what was queued (the draws and copies run asynchronously)
        if self.loaded >= self._next * self.num_layers / 10 or self.loaded == self.num_layers:
            jax.block_until_ready(leaves)
            self._next = int(self.loaded * 10 / max(self.num_layers, 1)) + 1
            logger.info("%s: layer %d/%d, %.2f GiB in %.1f s", self.what, self.loaded,
                        self.num_layers, self.nbytes / 2**30, time.perf_counter() - self.t0)

"""Synthetic target-tower drift for testing and benchmarking stale-cache corrections (digests 000/002 §8.2).

`DriftingTargets` holds clustered unit-norm target embeddings E_0 (n, d) (a Gaussian mixture, so trees
have structure to find) and a random residual ReLU MLP h; after drift the "encoder" returns
    E_t = normalize(E_0 + strength · h(E_0)),   h(e) = ReLU(e W1 + b1) W2,  W1 (d, 4d), W2 (4d, d)
so the cached E_0 is stale in a smooth, nonlinear, target-dependent way (what a training label tower
does between refreshes). With `rank` r < d the embeddings have r dominant directions plus an isotropic
floor of relative size `floor` (a decaying spectrum, like a trained encoder's; an isotropic cloud is the
worst case for a rank-d' Nystrom cache). `encoder(t)` is an `encode(local_ids) -> (m, d)` callback for either state.
"""

from __future__ import annotations

import numpy as np
import torch


def normalize(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


class DriftingTargets:
    def __init__(self, n: int, d: int, clusters: int = 50, spread: float = 0.8, strength: float = 0.5,
                 seed: int = 0, rank: int | None = None, floor: float = 0.05):
        rng = np.random.default_rng(seed)
        r = d if rank is None else rank
        centres = rng.normal(size=(clusters, r))
        latent = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, r))
        if r < d:  # most energy in r directions, as trained encoders' outputs have, plus an isotropic floor
            latent = latent @ np.linalg.qr(rng.normal(size=(d, r)))[0].T * np.sqrt(d / r)
            latent += floor * np.linalg.norm(latent, axis=1, keepdims=True) / np.sqrt(d) * rng.normal(size=(n, d))
        self.fresh0 = normalize(latent)
        w1 = (rng.normal(size=(d, 4 * d)) / np.sqrt(d)).astype(np.float32)
        b1 = (0.1 * rng.normal(size=4 * d)).astype(np.float32)
        w2 = (rng.normal(size=(4 * d, d)) / np.sqrt(4 * d)).astype(np.float32)
        self.delta = np.empty_like(self.fresh0)  # h(E_0), in row chunks to bound the (n, 4d) temporary
        for a in range(0, n, 16384):
            self.delta[a:a + 16384] = np.maximum(self.fresh0[a:a + 16384] @ w1 + b1, 0) @ w2
        self.strength = strength
        self.fresh1 = self.at(1.0)
        self.rng = rng

    def at(self, t: float) -> np.ndarray:
        """Fresh embeddings (n, d) after a fraction t of the drift: normalize(E_0 + t·strength·h(E_0))."""
        return normalize(self.fresh0 + (t * self.strength) * self.delta)

    def encoder_at(self, t: float):
        table = self.at(t)
        return lambda ids: torch.from_numpy(table[np.asarray(ids)])

    def encoder(self, drifted: bool):
        table = self.fresh1 if drifted else self.fresh0

        def encode(ids: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(table[np.asarray(ids)])
        return encode

    def queries(self, b: int, noise: float = 0.3, drifted: bool = True) -> np.ndarray:
        """(b, d) unit queries near random targets of the given state."""
        table = self.fresh1 if drifted else self.fresh0
        return normalize(table[self.rng.integers(0, len(table), b)] + noise * self.rng.normal(size=(b, table.shape[1])))

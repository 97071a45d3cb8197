"""Nystrom low-dimensional target cache with regression-based approximate re-encoding ("Improving Dual-Encoder Training through Dynamic Indexes for Negative Mining", §2.6-2.7).

d' landmarks are drawn uniformly from the shard's targets once and kept fixed. With their full-dimensional
embeddings L (d', d) and W = L Lᵀ (d', d'), every target y is cached as a d'-dim Nystrom feature

    phi(y) = W^{-1/2} L f(y)                      (n, d') float32, CPU (optionally a numpy memmap)

and a query as phi(x) = W^{-1/2} L f(x), so phi(x)·phi(y) = f(x)ᵀ Lᵀ W⁻¹ L f(y) is the inner product after
projecting onto the span of the landmark embeddings (the paper's u(x)ᵀ v(y)). We cache ONE representation
(the symmetric one) instead of the paper's u and v: target-target similarity for the tree is then a plain
dot product, and the paper's W⁻¹ is folded in. W⁻¹ᐟ² is a *regularised* pseudo-inverse square root:
eigenvalues below `rcond`·λ_max are dropped (W is rank-deficient whenever d' > d or landmarks nearly
coincide; dropping, not flooring, keeps round-off from being amplified along null directions).

Algorithm 5 (approximate re-encode) every w steps: encode s' random targets J with the current encoder
(E_J, (s', d)), fit ridge regression from the cached features to the fresh encodings,
    B = (Φ_Jᵀ Φ_J + λ·tr(Φ_JᵀΦ_J)/d' · I)⁻¹ Φ_Jᵀ E_J      (d', d),   ê(y) = Bᵀ phi(y)
which is Nystrom kernel ridge regression with the same landmarks (push-through identity, digest §2.7).
Landmarks are updated through the regressor (L ← Φ[landmarks] B, the paper's "update landmarks via R"),
W⁻¹ᐟ² is recomputed, and every cached target is updated with ONE d'×d' matrix:
    phi_new(y) = W_new^{-1/2} L_new ê(y) = M phi(y),   M = W_new^{-1/2} L_new Bᵀ.
Only the s' regression pairs and the landmarks are ever full-dimensional. Optionally (`exact_writeback`,
our choice, default on) the s' targets that were just encoded get their exact features written back.
Ridge predictions shrink towards the mean, so regressed rows come out shorter than the unit-norm
encodings (A3) written back exactly, and inner-product mining would then favour the written-back rows;
with `renormalize` (default on) every ê(y) is rescaled to unit norm, computed in d' dims as
|ê(y)|² = phi(y)ᵀ (B Bᵀ) phi(y), so the update stays O(d'²) per row (regressed landmarks likewise).
A full refresh (Algorithm 6) re-encodes every target exactly and re-initialises landmarks and W.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch

EncodeFn = Callable[[np.ndarray], torch.Tensor]
_CHUNK = 1 << 14


def inv_sqrt_psd(w: np.ndarray, rcond: float) -> np.ndarray:
    """Regularised W^{-1/2} of a PSD (d', d') matrix: eigen-directions below rcond·λ_max are dropped."""
    vals, vecs = np.linalg.eigh(w.astype(np.float64))
    keep = vals > rcond * max(float(vals.max()), 1e-30)
    inv = np.zeros_like(vals)
    inv[keep] = 1.0 / np.sqrt(vals[keep])
    return (vecs * inv) @ vecs.T


def _to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class NystromCache:
    """Landmarks, W^{-1/2} and the (n, d') Nystrom feature cache of one shard's n targets."""

    def __init__(self, num_rows: int, num_landmarks: int, ridge: float = 1e-3, rcond: float = 1e-6,
                 exact_writeback: bool = True, seed: int = 0, storage: str | None = None,
                 renormalize: bool = True):
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        if not 1 <= num_landmarks <= num_rows:
            raise ValueError(f"num_landmarks must be in [1, num_rows={num_rows}], got {num_landmarks}")
        if ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {ridge}")
        self.num_rows, self.dim_low = num_rows, num_landmarks
        self.ridge, self.rcond, self.exact_writeback = ridge, rcond, exact_writeback
        self.renormalize = renormalize
        self.rng = np.random.default_rng(seed)
        # fixed for the whole run (paper: landmarks sampled uniformly from targets, identities kept)
        self.landmark_ids = np.sort(self.rng.choice(num_rows, num_landmarks, replace=False)).astype(np.int64)
        self.landmarks: np.ndarray | None = None  # L (d', d) float32
        self.w_isqrt: np.ndarray | None = None  # W^{-1/2} (d', d') float64
        if storage is None:
            self.features = np.zeros((num_rows, num_landmarks), dtype=np.float32)
        else:  # the low-dim cache can live on disk; it is only ever touched in row chunks
            os.makedirs(os.path.dirname(os.path.abspath(storage)), exist_ok=True)
            self.features = np.lib.format.open_memmap(storage, mode="w+", dtype=np.float32,
                                                      shape=(num_rows, num_landmarks))

    @property
    def ready(self) -> bool:
        return self.landmarks is not None

    # ---- projections ------------------------------------------------------------------------------
    def _set_landmarks(self, landmarks: np.ndarray) -> None:
        self.landmarks = landmarks.astype(np.float32)
        lm = self.landmarks.astype(np.float64)
        self.w_isqrt = inv_sqrt_psd(lm @ lm.T, self.rcond)
        # phi(x) = P f(x) with P = W^{-1/2} L (d', d); precomputed once per landmark update
        self._proj = (self.w_isqrt @ lm).astype(np.float32)

    def project(self, emb: torch.Tensor | np.ndarray) -> np.ndarray:
        """Full-dim embeddings (B, d) -> Nystrom features (B, d') float32 (queries or targets)."""
        if not self.ready:
            raise RuntimeError("NystromCache.project before full_refresh: no landmarks yet")
        return _to_numpy(emb).astype(np.float32) @ self._proj.T

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """The cache's full-dim view of targets (n, d): the projection of f(y) onto span(L)."""
        return self.features[ids] @ self._proj

    # ---- Algorithm 6 / full refresh ----------------------------------------------------------------
    def full_refresh(self, encode: EncodeFn, progress: Callable[[int], None] | None = None) -> int:
        """Exact re-encode of every target (landmarks first, then the rest): returns n, the count encoded."""
        landmarks = _to_numpy(encode(self.landmark_ids))
        self._set_landmarks(landmarks)
        self.features[self.landmark_ids] = self.project(landmarks)
        is_lm = np.zeros(self.num_rows, dtype=bool)
        is_lm[self.landmark_ids] = True
        for start in range(0, self.num_rows, _CHUNK):
            ids = np.arange(start, min(start + _CHUNK, self.num_rows), dtype=np.int64)
            ids = ids[~is_lm[ids]]
            if len(ids):
                self.features[ids] = self.project(encode(ids))
            if progress is not None:
                progress(len(ids))
        return self.num_rows

    # ---- Algorithm 5 ------------------------------------------------------------------------------
    def fit_regression(self, ids: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        """Ridge B (d', d) from cached features of `ids` (s', d') to fresh encodings (s', d)."""
        phi = self.features[ids].astype(np.float64)
        gram = phi.T @ phi
        lam = self.ridge * max(np.trace(gram) / gram.shape[0], 1e-12)
        return np.linalg.solve(gram + lam * np.eye(gram.shape[0]), phi.T @ fresh.astype(np.float64))

    def approximate_reencode(self, encode: EncodeFn, num_samples: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Algorithm 5: encode s' random targets, regress, update landmarks, W^{-1/2} and every cached row.

        Returns (encoded count, sampled ids J (s',), the regressor B (d', d)). `reconstruct(ids)` before and
        after gives the stale and the regressed full-dim view to compare against exact encodings."""
        if not self.ready:
            raise RuntimeError("approximate_reencode before full_refresh")
        s = min(num_samples, self.num_rows)
        ids = np.sort(self.rng.choice(self.num_rows, s, replace=False)).astype(np.int64)
        fresh = _to_numpy(encode(ids)).astype(np.float32)
        b = self.fit_regression(ids, fresh)
        lm_new = self.features[self.landmark_ids].astype(np.float64) @ b  # L_new = Φ[landmarks] B
        if self.renormalize:
            lm_new /= np.maximum(np.linalg.norm(lm_new, axis=1, keepdims=True), 1e-12)
        self._set_landmarks(lm_new)
        m = (self.w_isqrt @ self.landmarks.astype(np.float64) @ b.T).astype(np.float32)  # (d', d')
        g = (b @ b.T).astype(np.float32)  # |ê(y)|² = phi(y)ᵀ B Bᵀ phi(y): the norm without leaving d' dims
        for start in range(0, self.num_rows, _CHUNK):  # the only O(n) work: O(d'²) per row
            stop = min(start + _CHUNK, self.num_rows)
            phi = self.features[start:stop]
            new = phi @ m.T
            if self.renormalize:
                new /= np.sqrt(np.maximum(((phi @ g) * phi).sum(1, keepdims=True), 1e-12))
            self.features[start:stop] = new
        if self.exact_writeback:
            self.features[ids] = self.project(fresh)
        return s, ids, b

    # ---- diagnostics ------------------------------------------------------------------------------
    def memory_bytes(self, accelerator_rows: int = 0) -> dict[str, int]:
        """Bytes per structure; `accelerator_rows` = s' regression pairs held in full dim during a refresh."""
        d = 0 if self.landmarks is None else self.landmarks.shape[1]
        return {
            "nystrom_cache": int(self.features.size * 4),
            "landmarks": int(self.dim_low * d * 4 + 2 * self.dim_low * self.dim_low * 4),
            "regression_data": int(accelerator_rows * (d + self.dim_low) * 4),
        }

    def state_dict(self) -> dict:
        return {"landmark_ids": self.landmark_ids.copy(), "landmarks": self.landmarks,
                "features": np.asarray(self.features).copy(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state["features"].shape != self.features.shape:
            raise ValueError(f"nystrom features shape {state['features'].shape} != {self.features.shape}")
        self.landmark_ids = np.asarray(state["landmark_ids"], dtype=np.int64)
        self.features[:] = state["features"]
        if state["landmarks"] is not None:
            self._set_landmarks(np.asarray(state["landmarks"]))
        self.rng.bit_generator.state = state["rng"]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine (n,) between (n, d) arrays."""
    num = (a * b).sum(1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-12)


def topk_overlap(scores_a: np.ndarray, scores_b: np.ndarray, k: int) -> float:
    """Mean |top-k(a) ∩ top-k(b)| / k over rows of two (B, n) score matrices."""
    ta = np.argpartition(-scores_a, k - 1, axis=1)[:, :k]
    tb = np.argpartition(-scores_b, k - 1, axis=1)[:, :k]
    return float(np.mean([len(np.intersect1d(x, y)) / k for x, y in zip(ta, tb)]))

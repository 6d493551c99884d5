"""Attention shared by the flow's encoder and estimator: chunk-causal masks over absolute positions,
and per-request key/value buffers that grow in place so a streamed chunk attends to every earlier
chunk without re-running it.

Offline (no buffers) all rows share positions 0..T-1; streamed, each group of rows (one request)
has its own start and its own `KVBuffer`, appended before it is read.
"""

from __future__ import annotations

import torch


class KVBuffer:
    """Keys and values of one request for one attention layer: [rows, heads, n, d], capacity doubling."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [R, H, T, d] after the cached ones; returns views of all n + T."""
        need = self.n + k.shape[2]
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (self.k.shape[2] if self.k is not None else 0), 16)
            grown_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            grown_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if self.k is not None:
                grown_k[:, :, : self.n] = self.k[:, :, : self.n]
                grown_v[:, :, : self.n] = self.v[:, :, : self.n]
            self.k, self.v = grown_k, grown_v
        assert self.v is not None
        self.k[:, :, self.n : need] = k
        self.v[:, :, self.n : need] = v
        self.n = need
        return self.k[:, :, :need], self.v[:, :, :need]

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.element_size() * self.k[:, :, : self.n].numel()

    def clone(self) -> KVBuffer:
        out = KVBuffer()
        if self.k is not None:
            out.k, out.v, out.n = self.k[:, :, : self.n].clone(), self.v[:, :, : self.n].clone(), self.n
        return out


def chunk_mask(qpos: torch.Tensor, kpos: torch.Tensor, chunk: int) -> torch.Tensor:
    """[Tq, Tk] bool: key visible to query when it lies before the end of the query's chunk (all when chunk=0)."""
    if chunk <= 0:
        return torch.ones(qpos.shape[0], kpos.shape[0], dtype=torch.bool, device=qpos.device)
    return kpos.unsqueeze(0) < ((qpos // chunk + 1) * chunk).unsqueeze(1)


class AttnCall:
    """Where the rows of one forward sit: offline (positions 0..T-1, no buffers) or streamed
    (group g = rows [g*R, (g+1)*R) starts at `starts[g]`, keys/values in `buffers[g][layer]`)."""

    def __init__(self, starts: list[int] | None = None, buffers: list[list[KVBuffer]] | None = None) -> None:
        self.starts = starts
        self.buffers = buffers

    @property
    def streamed(self) -> bool:
        return self.starts is not None

    def layer(self, index: int) -> list[KVBuffer] | None:
        return None if self.buffers is None else [b[index] for b in self.buffers]

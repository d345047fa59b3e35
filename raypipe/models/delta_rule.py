"""The gated delta rule over a prefill chunk, chunkwise, with the recurrent state at chosen positions.

A gated-delta-net layer (Qwen3.5, MiniCPM-V 4.6) keeps a state `S` (`k_dim x v_dim` per value head)
that each token t decays by `exp(g_t)` and corrects towards its value: `S <- exp(g_t) S`, then
`S <- S + k_t (beta_t (v_t - S^T k_t))^T`; the output is `S^T q_t`. Token by token that is a long
sequential loop, so a prefill runs it chunkwise (the DeltaNet / Gated DeltaNet papers' UT form,
Yang et al. 2024, arXiv:2406.06484 and arXiv:2412.06464; what transformers' torch fallback and the
FLA kernels compute): inside a chunk of `chunk_size` tokens everything is a few batched matmuls and a
triangular solve, and only the state passes from chunk to chunk.

What raypipe needs besides the output is the state at a few positions inside the chunk (state
snapshots for prefix caching, `decode/snapshot_pool.py`), without splitting the forward there. The
chunk grid here is laid out per segment: the tokens `[0, b1), [b1, b2), ..., [bn, L)` between the
requested boundaries are each cut into chunks from their own start, the last chunk of each padded
with zero tokens (`k = v = 0`, `beta = 0`, `g = 0`: no decay, no write, so the state passes through
unchanged), so every boundary ends a chunk and its state is simply the scan's state after that chunk.
That is the same chunking a forward split at the boundaries runs, so the states equal the split
forward's (up to float rounding of batched matmuls), and with no boundary it is the plain chunking
from the chunk's start. A boundary costs at most one padded chunk.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64  # tokens per chunk of the UT form (transformers' and FLA's default)


def chunked_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                             boundaries: list[int] | tuple[int, ...] = (), chunk_size: int = CHUNK_SIZE,
                             ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Output `(B, L, Hv, dv)` (in `query`'s dtype), the final state `(B, Hv, dk, dv)` (fp32) and the state
    after each token count in `boundaries` (increasing, each in `1..L-1`).

    `query`, `key`: `(B, L, Hk, dk)` (not normalized: the layer's q and k are L2-normalized here, and q
    scaled by `dk ** -0.5`); `value`: `(B, L, Hv, dv)`, each key head serving `Hv / Hk` consecutive value
    heads; `g`: `(B, L, Hv)` log decays (<= 0); `beta`: `(B, L, Hv)`; `initial_state`: the state before
    token 0 (zeros when None)."""
    out_dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads = value.shape[2]
    if list(boundaries) != sorted(set(boundaries)) or any(not 0 < b < length for b in boundaries):
        raise ValueError(f"boundaries must increase inside 1..{length - 1}, got {list(boundaries)}")
    if v_heads != k_heads:
        query, key = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (query, key))
    # Heads first, fp32 throughout (the state is fp32 in every implementation).
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    q = l2_normalize(q) * k_dim ** -0.5
    k = l2_normalize(k)

    slots, chunk_ends = _segment_layout(length, list(boundaries), chunk_size)
    index = torch.tensor(slots, device=q.device)
    q, k, v = (_laid_out(x, index) for x in (q, k, v))
    g, beta = (_laid_out(x[..., None], index)[..., 0] for x in (g, beta))
    chunks = index.numel() // chunk_size
    q, k, v = (x.reshape(batch, v_heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, v_heads, chunks, chunk_size) for x in (g, beta))

    # Inside each chunk: decay[i, j] = exp(sum of g over j+1..i) for j <= i (the decay token j's write
    # sees by token i), and the UT system T = I + strictly lower (beta_i k_i . k_j decay[i, j]).
    log_decay = g.cumsum(-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    # Solving T u = beta v and T w = beta k exp(log_decay) gives each token's correction before (u) and
    # the part the state at the chunk's start predicts of it (w @ S).
    corrections = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    predicted = torch.linalg.solve_triangular(system, k_beta * log_decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay  # causal q.k inside the chunk, decayed
    q_from_start = q * log_decay.exp()[..., None]  # what each query reads of the state at the chunk's start
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]  # each write, decayed to the chunk's end
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    state = (torch.zeros(batch, v_heads, k_dim, v.shape[-1], dtype=torch.float32, device=q.device)
             if initial_state is None else initial_state.float())
    outputs, states = [], []
    for i in range(chunks):
        written = corrections[:, :, i] - predicted[:, :, i] @ state
        outputs.append(q_from_start[:, :, i] @ state + within[:, :, i] @ written)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ written
        if i in chunk_ends[:-1]:
            states.append(state)
    out = torch.stack(outputs, dim=2).reshape(batch, v_heads, chunks * chunk_size, -1)
    real = torch.tensor([j for j, s in enumerate(slots) if s < length], device=q.device)
    out = out.index_select(2, real).transpose(1, 2).to(out_dtype).contiguous()
    return out, state, states


def _segment_layout(length: int, boundaries: list[int], chunk_size: int) -> tuple[list[int], list[int]]:
    """Each slot of the padded token layout (a token index, or `length` for a zero token), and the chunk
    that ends each segment."""
    slots, chunk_ends = [], []
    edges = [0, *boundaries, length]
    for start, end in zip(edges, edges[1:]):
        padded = -(-(end - start) // chunk_size) * chunk_size
        slots += list(range(start, end)) + [length] * (padded - (end - start))
        chunk_ends.append(len(slots) // chunk_size - 1)
    return slots, chunk_ends


def _laid_out(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x` `(B, H, L, d)` in the padded layout `index` (`L` selects a zero token)."""
    zero = x.new_zeros(*x.shape[:2], 1, x.shape[-1])
    return torch.cat([x, zero], dim=2).index_select(2, index)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # FLA's definition (what the checkpoints were trained with): x / sqrt(|x|^2 + eps), not F.normalize's max.
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)

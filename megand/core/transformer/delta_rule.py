"""The gated delta rule (Gated DeltaNet, as Qwen3-Next / Qwen3.5 define it), in pure torch.

Per value head, a state ``S [dk, dv]`` is decayed and corrected token by token::

    S  <- exp(g_t) * S                              (the gate: a per-token, per-head decay, g_t <= 0)
    S  <- S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write the part of v_t that S mispredicts)
    o_t = S^T q_t

``recurrent`` is that loop, the reference. ``chunked`` is the training form: within a chunk of ``C`` tokens
the corrections are one unit-lower-triangular solve (the UT transform), and only the chunks are sequential.
Both start from a given state and return the final one, so a sequence can be cut anywhere (context-parallel
ranks, generation steps) and continued exactly.

Documents (a packed sample): the state restarts at each document's first token. ``docs [b, s]`` are the
tokens' document ids and ``prev [b]`` the id of the token before the first (-1: none); a pair of tokens
interacts only within one document, and the incoming state reaches only the tokens of its document.
"""

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (the queries' and keys' normalisation)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent(q, k, v, g, beta, state=None, docs=None, prev=None):
    """Token by token. ``q, k [b, h, s, dk]`` (normalised and scaled), ``v [b, h, s, dv]``, ``g, beta
    [b, h, s]``, ``state [b, h, dk, dv]`` (None: zeros); returns (``o [b, h, s, dv]``, final state)."""
    b, h, s, dk = k.shape
    S = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state
    out = []
    for t in range(s):
        if docs is not None:  # a document's first token starts from an empty state
            before = prev if t == 0 else docs[:, t - 1]
            S = S * (docs[:, t] == before).to(S.dtype)[:, None, None, None]
        S = S * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2), S


def chunked(q, k, v, g, beta, state=None, docs=None, prev=None, chunk: int = 64):
    """The chunked parallel form of :func:`recurrent` (same arguments and results)."""
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = (-s) % chunk
    if pad:  # zero keys, values and betas and no decay: the padding leaves the state as it is
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
        if docs is not None:
            docs = torch.cat([docs, docs[:, -1:].expand(-1, pad)], dim=1)
    n = (s + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if docs is None:
        same, cont = lower, None  # one document: every earlier token of the chunk, and the incoming state
    else:
        d = docs.reshape(b, 1, n, chunk)
        before = torch.cat([prev.reshape(b, 1, 1), d[:, :, :-1, -1]], dim=2)  # the token before each chunk
        same = (d[..., :, None] == d[..., None, :]) & lower  # [b, 1, n, C, C]
        cont = (d == before[..., None]).to(q.dtype)  # [b, 1, n, C]: still the incoming state's document
    # the log-decays' running sums and their differences in fp64: a chunk's sums grow with its length (tens at
    # C = 64), and differences of fp32 sums would lose ~1e-6 relative of every decay factor (and of the gates'
    # gradients); the differences themselves are then exact enough in the working precision
    cum = g.double().cumsum(-1)
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.to(q.dtype).exp() * same  # decay from token j to token i of a chunk, within one document (i >= j)
    start = cum.exp().to(q.dtype)  # the incoming state's decay at each token
    start = start if cont is None else start * cont
    kb, vb = k * beta[..., None], v * beta[..., None]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    T = eye + (kb @ k.transpose(-1, -2)) * decay * (1 - eye)  # unit lower triangular
    u = torch.linalg.solve_triangular(T, vb, upper=False, unitriangular=True)  # corrections without the state
    w = torch.linalg.solve_triangular(T, kb * start[..., None], upper=False, unitriangular=True)  # state's share
    attn = (q @ k.transpose(-1, -2)) * decay
    q_state = q * start[..., None]
    k_state = k * decay[..., -1, :, None]  # each token's key, decayed to the chunk's end
    carry = start[..., -1, None, None]  # the incoming state's decay over the whole chunk
    S = q.new_zeros(b, h, dk, dv) if state is None else state
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S
        out.append(q_state[:, :, i] @ S + attn[:, :, i] @ v_new)
        S = S * carry[:, :, i] + k_state[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
    return o, S

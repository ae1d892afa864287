"""Teacher-forced sequence log-probs of completions.

log π(y|x) = Σ_t log π(y_t | x, y_<t) over completion tokens, EOS counted once, no length
normalisation. Completions are cut after their first EOS *before* padding, and the mask comes
from those lengths, never from comparing ids with the pad token: that is what keeps the EOS
log-prob when pad and EOS are the same token (a pitfall of the paper's reference code).

Layout of one forward batch (prompts left-padded, completions right-padded):

    [pad pad x x x | y y y EOS pad pad]
     <---- P ----->  <------ C ------>
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.utils.checkpoint import checkpoint


def truncate_at_eos(tokens: list[int], eos_ids: int | set[int] | None) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    if eos_ids is None:
        return list(tokens)
    eos = {eos_ids} if isinstance(eos_ids, int) else eos_ids
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


def pack(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-pad prompts, right-pad completions, concatenate.

    Returns ``input_ids [N, P+C]``, ``attention_mask [N, P+C]``, ``completion_mask [N, C]`` and P.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    n = len(prompts)
    p_len = max(len(p) for p in prompts)
    c_len = max(1, max(len(c) for c in completions))
    ids = torch.full((n, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + c_len), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long)
        ids[i, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(c)] = 1
    comp_mask = attn[:, p_len:].clone()
    return ids.to(device), attn.to(device), comp_mask.to(device), p_len


def pack_for(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_id: int, eos_ids
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`pack` of the completions cut after their first EOS, on ``model``'s device."""
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    return pack(prompts, completions, pad_id, next(model.parameters()).device)


def token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[N, C]`` of completion tokens in fp32 (0 where masked) and the mask ``[N, C]``.

    Lean: no logits of prompt positions, and never the logits of a whole batch at once. The model
    runs to its final hidden states; the output head is applied to completion positions only, a
    chunk of positions at a time, and each log-prob is the target's logit minus the logsumexp of
    its row, in fp32 (:func:`head_logprobs`). For the backward pass each chunk keeps only its
    hidden states and recomputes its logits. Models whose logits are not the head's output (soft-
    capped or scaled logits, a head with an adapter) get their logits from their own forward,
    completion positions only (``logits_to_keep``), with the same chunked fp32 log-softmax.
    """
    ids, attn, comp_mask, p_len = pack_for(model, prompts, completions, pad_id, eos_ids)
    c_len = ids.shape[1] - p_len
    # Position t predicts token t+1, so the last prompt position and every completion position are
    # kept; the last one predicts past the end: it gets a dummy target, dropped below.
    targets = torch.cat([ids[:, p_len:], ids.new_zeros(ids.shape[0], 1)], dim=1)  # [N, C+1]
    logp = completion_logprobs(model, ids, attn, p_len, targets, temperature)[:, :c_len]  # [N, C]
    mask = comp_mask.to(logp.dtype)
    return logp * mask, mask


def completion_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, p_len: int, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """fp32 log-probs ``[N, C+1]`` of ``targets`` at the last prompt position and every completion
    position of a :func:`pack` batch."""
    head = output_head(model)
    if head is not None and _hidden_states_cost_less(model, head):
        out = model(**_forward_kwargs(ids, attn), logits_to_keep=1, output_hidden_states=True)
        states = out.hidden_states
        hidden = states[-1][:, p_len - 1 :] if states else None  # [N, C+1, H]: the head's input
        ok = hidden is not None and _head_gives_logits(head, hidden[:, -1:], out.logits[:, -1:])
        if on_every_rank(ok, ids.device):
            return head_logprobs(head, hidden, targets, temperature)
        _HEAD_ALONE[type(unwrap(model))] = False  # and do not try again for this kind of model
    return gathered_logprobs(completion_logits(model, ids, attn, p_len), targets, temperature)


def _hidden_states_cost_less(model: torch.nn.Module, head: torch.nn.Linear) -> bool:
    """Whether the head path holds less than the logits path. Asking the model for its hidden
    states keeps every layer's output until the forward returns: free with gradients (autograd
    keeps them anyway), L x H values a position without, against V for the logits of one position.
    So without gradients (searchers: reference and sampler log-probs) the head path is taken only
    where (L + 1) x H < V: Qwen2.5-0.5B (25 x 896 < 151,936) yes, Llama-2-7B (33 x 4096 > 32,000) no."""
    if torch.is_grad_enabled():
        return True
    layers = getattr(getattr(unwrap(model), "config", None), "num_hidden_layers", None)
    return isinstance(layers, int) and (layers + 1) * head.in_features < head.out_features


def _forward_kwargs(ids: torch.Tensor, attn: torch.Tensor) -> dict:
    # Positions count real tokens only, so a left-padded prompt sees the same positions as an
    # unpadded one. No KV cache: nothing is generated, and it would hold every layer's keys.
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": position_ids, "use_cache": False}


def completion_logits(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, p_len: int) -> torch.Tensor:
    """Logits ``[N, C+1, V]`` of the last prompt position and every completion position of a
    :func:`pack` batch, in the model's compute dtype."""
    keep = ids.shape[1] - p_len + 1
    if accepts_logits_to_keep(model):
        return model(**_forward_kwargs(ids, attn), logits_to_keep=keep).logits
    return model(**_forward_kwargs(ids, attn)).logits[:, -keep:]


def on_every_rank(ok: bool, device: torch.device) -> bool:
    """``ok`` on every trainer rank (a process group of several): the path a rank takes decides the
    forward passes it runs, and each pass over sharded weights is a collective of all ranks, so one
    rank alone taking the logits path (a second forward) would leave the others waiting."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# Model classes whose logits turned out not to be their output head's output (soft-capping,
# scaling): they take the logits path from then on.
_HEAD_ALONE: dict[type, bool] = {}


def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output head when log-probs can be computed from its hidden states: a plain
    ``nn.Linear`` (an adapter on the head, or a head the model does not expose, takes the logits
    path), on a model whose forward takes ``logits_to_keep``."""
    inner = unwrap(model)
    if not _HEAD_ALONE.get(type(inner), True) or not accepts_logits_to_keep(model):
        return None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear else None


@torch.no_grad()
def _head_gives_logits(head: torch.nn.Linear, hidden: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the model's own logits (of one position) are the head applied to its last hidden
    states: false where the model soft-caps or scales its logits, or where the last hidden state
    it reports is not the head's input."""
    mine = head(hidden).float()
    return mine.shape == logits.shape and torch.allclose(mine, logits.float(), rtol=1e-3, atol=1e-3)


def head_logprobs(
    head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(head(hidden) / temperature)[target]`` in fp32, ``[N, T, H]`` and ``[N, T]`` in,
    ``[N, T]`` out, computed a chunk of positions at a time. With gradients, each chunk is
    checkpointed: the backward pass keeps its hidden states and recomputes its logits, so the
    logits of the batch (``[N, T, V]``, the largest tensor of a step with a large vocabulary) are
    never held, forward or backward."""
    n, t, h = hidden.shape
    flat_h, flat_t = hidden.reshape(n * t, h), targets.reshape(n * t)  # [M, H], [M]
    rows = max(1, CHUNK_ELEMENTS // head.out_features)
    checkpointed = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)

    def chunk(h_part: torch.Tensor, t_part: torch.Tensor) -> torch.Tensor:
        return gathered_logprobs(head(h_part), t_part, temperature)

    parts = [
        checkpoint(chunk, flat_h[i : i + rows], flat_t[i : i + rows], use_reentrant=False)
        if checkpointed
        else chunk(flat_h[i : i + rows], flat_t[i : i + rows])
        for i in range(0, n * t, rows)
    ]
    return torch.cat(parts).view(n, t)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside wrappers (PEFT, a LoRA reference view)."""
    inner = model
    while hasattr(inner, "get_base_model"):
        base = inner.get_base_model()
        if base is inner:
            break
        inner = base
    return inner


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs since 4.50);
    wrappers (PEFT, a LoRA reference view) are looked through."""
    return _forward_takes(type(unwrap(model)), "logits_to_keep")


@functools.cache
def _forward_takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters


# Logits per chunk of the log-prob computation (64 MiB in fp32): 110 positions of Qwen's 152k
# vocabulary, 512 of a 32k one; large enough that a GPU's matmuls stay efficient and the chunks
# few, small beside the logits of a real batch (a micro-batch of 20 x 512 tokens: 10k positions).
CHUNK_ELEMENTS = 2**24


def gathered_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` per position, in fp32: ``[..., V]`` and
    ``[...]`` in, ``[...]`` out, differentiable. Equal to gathering from a full ``log_softmax``,
    without its memory: it keeps only ``logits`` (in their own dtype) and one logsumexp per
    position, and computes in fp32 one chunk of positions at a time, backward included."""
    shape = targets.shape
    out = _GatheredLogProbs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), float(temperature))
    return out.view(shape)


class _GatheredLogProbs(torch.autograd.Function):
    """log p[t] = z[t] − logsumexp(z), z = logits / T; d log p[t] / dz = onehot(t) − softmax(z)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        # logits [M, V] (any float dtype), targets [M]
        rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # [M]
        lse = torch.empty_like(out)  # [M]
        for i in range(0, logits.shape[0], rows):
            z = logits[i : i + rows].float() / temperature  # [m, V]
            lse[i : i + rows] = torch.logsumexp(z, dim=-1)
            out[i : i + rows] = z.gather(-1, targets[i : i + rows, None]).squeeze(-1) - lse[i : i + rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)  # [M, V], the logits' dtype
        rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        for i in range(0, logits.shape[0], rows):
            g_out = grad_out[i : i + rows].float()  # [m]
            # one fp32 chunk-sized temporary: a new tensor from div, then in place (never the saved logits)
            g = logits[i : i + rows].float().div(t).sub_(lse[i : i + rows, None]).exp_().mul_(-g_out[:, None])
            g.scatter_add_(-1, targets[i : i + rows, None], g_out[:, None])
            grad[i : i + rows] = g.div_(t)
        return grad, None, None


def chunked_sums(
    logprobs,
    prompts: list[list[int]],
    completions: list[list[int]],
    chunks: list[list[int]],
    action_masks: list[list[int]] | None = None,
):
    """Per-sequence sums ``[N]`` of ``logprobs(prompts, completions)`` (``[n, C]`` log-probs and a
    mask) computed one chunk of sequence indices at a time, in the given order; with
    ``action_masks``, of the tokens marked 1 only."""

    def sums(idx: list[int]) -> torch.Tensor:
        logp, _ = logprobs([prompts[i] for i in idx], [completions[i] for i in idx])
        if action_masks is None:
            return logp.sum(-1)
        keep = torch.zeros(logp.shape, dtype=logp.dtype, device=logp.device)
        for row, i in enumerate(idx):
            marks = action_masks[i][: logp.shape[1]]
            keep[row, : len(marks)] = torch.tensor(marks, dtype=logp.dtype)
        return (logp * keep).sum(-1)

    if len(chunks) <= 1:
        return sums(list(range(len(prompts))))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for chunk in chunks:
        for i, value in zip(chunk, sums(chunk), strict=True):
            out[i] = value
    return torch.stack(out)


def plan_micro_batches(
    sizes: list[tuple[int, int]],
    group_size: int,
    max_groups: int | None = None,
    max_tokens: int | None = None,
    cost=None,
) -> list[list[int]]:
    """Groups per micro-batch, as lists of group indices. ``sizes[g]`` is (longest prompt, longest
    completion) of group g, in tokens. A micro-batch holds at most ``max_groups`` groups and at most
    ``max_tokens`` tokens: the positions its pass computes, ``cost(groups)`` (for packed passes),
    by default the padded batch's (sequences × (longest prompt + longest completion) in it). A
    group over the budget alone goes alone. With a token budget, groups are taken shortest first,
    so groups of like length share a micro-batch and little goes to padding."""
    order = list(range(len(sizes)))
    if max_tokens is not None:
        order.sort(key=lambda g: sum(sizes[g]))  # stable: equal lengths keep the batch's order
    plan: list[list[int]] = []
    current: list[int] = []
    longest_p = longest_c = 0
    for g in order:
        p, c = max(longest_p, sizes[g][0]), max(longest_c, sizes[g][1])
        too_many = max_groups is not None and len(current) >= max_groups
        too_long = False
        if max_tokens is not None and current and not too_many:
            tokens = cost([*current, g]) if cost is not None else (len(current) + 1) * group_size * (p + c)
            too_long = tokens > max_tokens
        if current and (too_many or too_long):
            plan.append(current)
            current, p, c = [], sizes[g][0], sizes[g][1]
        current.append(g)
        longest_p, longest_c = p, c
    if current:
        plan.append(current)
    return plan

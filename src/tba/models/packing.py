"""Packed (padding-free) forward passes: several sequences in one row, no compute on padding.

A padded batch (:func:`tba.models.logprobs.pack`) spends a position on every pad token up to the
longest sequence; with prompts of 60-250 tokens and completions of 20-500 that is a large share
of a step. A packed batch concatenates whole sequences into rows of at most ``max_tokens``
positions (:func:`plan_rows`, balanced so that little is left at their ends), gives each sequence ``position_ids`` that
restart at 0, and passes no attention mask and no KV cache: transformers then builds a
block-diagonal causal mask from the restarts (``sdpa``, ``eager``, ``flex_attention``; flash
attention's variable-length kernels on a GPU), so no sequence sees another. With the KV cache on
(transformers' default) that detection is skipped without a word: every packed forward here passes
``use_cache=False``.

:func:`packed_token_logprobs` returns what :func:`tba.models.logprobs.token_logprobs` returns, the
same log-probs within summation-order rounding, through the same lean head path (the output head
applied to completion positions only, in chunks). :func:`packing_problem` says why a model cannot
take it (the caller then pads). :class:`Passes`, chosen once per model
(:func:`tba.models.packing_choice.choose_packing`), is the one entry point that packs or pads each
pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.models.logprobs import (
    chunked_sums,
    head_logprobs,
    on_every_rank,
    output_head,
    plan_micro_batches,
    token_logprobs,
    truncate_at_eos,
    unwrap,
)


def plan_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the sequences in each row, every sequence whole: the fewest rows of at most
    ``max_tokens`` positions that hold them (a longer sequence gets a row of its own), balanced so
    that the longest row, the batch's width, is as short as this greedy finds. Each sequence,
    longest first, goes to the row with the fewest tokens; with a row over the budget, one more row
    is tried. Rows come out longest first, indices in each row ascending."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n_rows = max(1, -(-sum(lengths) // max_tokens))
    while True:
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        load = [0] * n_rows
        for i in order:
            r = min(range(n_rows), key=lambda r: (load[r], r))
            rows[r].append(i)
            load[r] += lengths[i]
        if n_rows >= len(lengths) or all(load[r] <= max_tokens or len(rows[r]) == 1 for r in range(n_rows)):
            break
        n_rows += 1
    filled = sorted((r for r in range(n_rows) if rows[r]), key=lambda r: -load[r])
    return [sorted(rows[r]) for r in filled]


ATTENTION_ONE_ROW = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations whose cost stays within each sequence (variable-length kernels, a
block-sparse mask): a pass goes into one row (flash attention's packed path also takes one row
only, a batch of one)."""

LONGEST = "longest"
"""A row width: as wide as the longest sequence of the pass. For ``sdpa`` and ``eager``, whose
dense mask computes every query of a row against every key of it: a packed pass then computes at
most the positions, and the attention scores, of the padded pass over the same sequences (each
sequence fits a row of the longest's width, rows are no wider than the padded batch), and short
sequences share rows instead of padding to the longest. Wider rows leave less padding at their
ends but waste attention across sequences: on a CPU, one wide row was slower than the padded batch
on short, alike sequences and took more memory (``benchmarks/results/packing/README.md``)."""


def row_tokens(model: torch.nn.Module, setting: int | str | None = "auto") -> int | str | None:
    """The width of packed rows for ``model``: ``setting`` when it is a number; ``"auto"``: one
    row per pass (None) where attention stays within sequences (:data:`ATTENTION_ONE_ROW`), else
    :data:`LONGEST`."""
    if setting != "auto":
        return setting
    attention = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None)
    return None if attention in ATTENTION_ONE_ROW else LONGEST


def positions_per_row(lengths: list[int], width: int | str | None) -> int:
    """Positions per row for sequences of ``lengths``: ``width`` (a number), the longest sequence
    (:data:`LONGEST`) or all in one row (None)."""
    if width is None:
        return max(1, sum(lengths))
    if width == LONGEST:
        return max(1, max(lengths, default=1))
    return width


def packing_problem(model: torch.nn.Module, probe: bool = True) -> str | None:
    """Why ``model`` cannot take packed rows here (None: it can). With ``probe``, two short
    sequences packed in one row must give the log-probs each gives alone (within the rounding of
    the model's dtype): a model whose attention reads no restarts, or reads them wrong, is caught
    here rather than trained on log-probs that see other sequences. The probe is a forward pass
    without gradients: with sharded weights, every rank must call it."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager", *ATTENTION_ONE_ROW):
        return f"attention {attention!r} builds no mask from restarting position_ids"
    if output_head(model) is None:
        return "its logits are not a plain output head's (soft-capped or scaled logits, an adapter on the head)"
    if not probe:
        return None
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 4:
        return None  # nothing to probe with; the forward's own head check still holds
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (5, 9)]
    completions = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (11, 7)]
    dtype = next(model.parameters()).dtype
    was_training = model.training
    model.eval()  # no dropout in the comparison
    try:
        with torch.no_grad():
            packed, mask = packed_token_logprobs(model, prompts, completions, None, 1.0, None, 0, check=False)
            alone = [token_logprobs(model, [p], [c], 0, None)[0][0] for p, c in zip(prompts, completions, strict=True)]
    except Exception as e:  # noqa: BLE001 - any failure of the packed forward means: pad instead
        return f"its forward failed on a packed row ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
        _reshard(model)
    tol = max(1e-4, 16 * torch.finfo(dtype).eps if dtype.is_floating_point else 1e-4)
    for i, ref in enumerate(alone):
        got = packed[i, : ref.shape[0]]
        if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol):
            gap = (got.float() - ref.float()).abs().max().item()
            return (
                f"packed sequences see each other: log-probs differ from the sequences alone by up to {gap:.3g} "
                f"(attention {attention!r} ignores restarting position_ids)"
            )
    return None


@dataclass(frozen=True)
class Passes:
    """How log-prob passes over one model run, decided once at start
    (:func:`tba.models.packing_choice.choose_packing`): the
    entry point that the trainer, the searcher's reference and the ranks all score through.

    ``packed``: sequences go in rows of ``width`` positions (:func:`positions_per_row`) wherever
    that saves enough positions over padding (:func:`worth_packing`); otherwise every pass pads."""

    packed: bool = False
    width: int | str | None = None

    def describe(self) -> str:
        """The choice in words, for the run's start lines (the row width that ``auto`` resolves to
        is known only once the model has loaded: it follows its attention kernel)."""
        if not self.packed:
            return "padded"
        if self.width is None:
            return "packed, one row a pass"
        return f"packed, rows of {'the longest sequence' if self.width == LONGEST else f'{self.width} positions'}"

    def packs(self, prompt_lens: list[int], completion_lens: list[int]) -> bool:
        """Whether a pass over sequences of these lengths packs."""
        return self.packed and worth_packing(prompt_lens, completion_lens, self.width)

    def positions(
        self, prompt_lens: list[int], completion_lens: list[int], packed: bool | None = None
    ) -> tuple[int, int]:
        """(positions computed, real tokens) of a pass over these sequences (:func:`forward_positions`);
        ``packed``: the pass's :meth:`packs`, when the caller has it already."""
        if packed is None:
            packed = self.packs(prompt_lens, completion_lens)
        return forward_positions(prompt_lens, completion_lens, packed, self.width)

    def cost(self, groups: list[list[tuple[int, int]]]):
        """The positions a pass over some of ``groups`` computes, for :func:`plan_micro_batches`
        (:func:`pass_cost`); None when every pass pads (the planner's own padded count)."""
        return pass_cost(groups, self.width) if self.packed else None

    def token_logprobs(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        completions: list[list[int]],
        pad_id: int,
        temperature: float = 1.0,
        packed: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs ``[N, C]`` (fp32, 0 where masked) and the mask of ``completions``,
        already cut where they are scored (at their first EOS), in one pass, packed or padded
        (``packed``: the pass's :meth:`packs`, when the caller has it already)."""
        if packed is None:
            packed = self.packs([len(p) for p in prompts], [len(c) for c in completions])
        if packed:
            return packed_token_logprobs(model, prompts, completions, None, temperature, self.width, pad_id)
        return token_logprobs(model, prompts, completions, pad_id, None, temperature)

    def sequence_logprobs(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        completions: list[list[int]],
        pad_id: int,
        eos_ids: int | set[int] | None = None,
        temperature: float = 1.0,
        micro_batch: int | None = None,
        max_tokens: int | None = None,
        action_masks: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Sum of completion-token log-probs per sequence, ``[N]``, in the given order;
        differentiable unless under no_grad. Completions are cut after their first of ``eos_ids``;
        with ``action_masks`` (multi-turn trajectories, whole: pass no ``eos_ids``) the sum is over
        the tokens marked 1 (the model's), never the environment's. ``micro_batch`` (sequences) and
        ``max_tokens`` (positions a pass computes, padding included) bound each pass, planned as
        the trainer plans its micro-batches (each sequence a group of one)."""
        completions = [truncate_at_eos(c, eos_ids) for c in completions]
        sizes = [(len(p), len(c)) for p, c in zip(prompts, completions, strict=True)]
        chunks = plan_micro_batches(sizes, 1, micro_batch, max_tokens, cost=self.cost([(s,) for s in sizes]))
        return chunked_sums(
            lambda ps, cs: self.token_logprobs(model, ps, cs, pad_id, temperature),
            prompts,
            completions,
            chunks,
            action_masks,
        )


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 leaves the root module's weights gathered after a forward pass (the backward pass it
    expects needs them): with no backward after the probe, shard them again, else an optimizer
    built next would hold the gathered copies."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # no FSDP2 in this torch: nothing is sharded
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def packed_token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
    width: int | str | None = None,
    pad_id: int = 0,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[N, C]`` of the completion tokens in fp32 (0 where masked) and the
    mask ``[N, C]``, as :func:`tba.models.logprobs.token_logprobs`, from rows of packed sequences
    (``width``: positions a row, :data:`LONGEST`, or None, the default, for one row). ``pad_id``
    fills the end of rows shorter than the longest: it is attended by nothing. ``check``: refuse a
    model :func:`packing_problem` refuses (without its probe)."""
    head, picked, targets, mask = _packed_hidden(model, prompts, completions, eos_ids, width, pad_id, check)
    logp = head_logprobs(head, picked, targets, temperature)[:, : mask.shape[1]]
    return logp * mask, mask


def packed_completion_logits(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    eos_ids: int | set[int] | None = None,
    width: int | str | None = LONGEST,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary logits ``[N, C, V]`` that predict each completion token, and the mask
    ``[N, C]``, from packed rows (as :func:`tba.models.logprobs.completion_logits` from a padded
    batch)."""
    head, picked, _, mask = _packed_hidden(model, prompts, completions, eos_ids, width, pad_id, True)
    return head(picked[:, : mask.shape[1]]), mask


def _packed_hidden(model, prompts, completions, eos_ids, width, pad_id, check):
    """The packed forward: the output head, the last hidden states ``[N, C+1, H]`` from each
    sequence's last prompt position through its last token (the last one predicts past the end: a
    dummy target), the targets ``[N, C+1]`` and the mask ``[N, C]``."""
    if check and (problem := packing_problem(model, probe=False)) is not None:
        raise ValueError(f"this model cannot be packed: {problem}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    rows = plan_rows(lengths, positions_per_row(lengths, width))
    width = max(sum(lengths[i] for i in row) for row in rows)
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    where: list[tuple[int, int]] = [(0, 0)] * len(prompts)  # sequence → (row, offset of its first token)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            seq = prompts[i] + completions[i]
            ids[r, offset : offset + len(seq)] = torch.tensor(seq, dtype=torch.long)
            positions[r, offset : offset + len(seq)] = torch.arange(len(seq))
            where[i] = (r, offset)
            offset += len(seq)
        positions[r, offset:] = torch.arange(width - offset)  # the tail: one more "sequence", never read
    ids, positions = ids.to(device), positions.to(device)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # [R, W, H]
    head = output_head(model)
    with torch.no_grad():  # the head path holds only where the model's logits are its head's output
        last = head(hidden[:, -1:]).float()
        ok = last.shape == out.logits[:, -1:].shape and torch.allclose(
            last, out.logits[:, -1:].float(), rtol=1e-3, atol=1e-3
        )
    # agreed with the other trainer ranks as the padded path does, so that ranks whose passes take
    # different layouts still run the same collectives
    if not on_every_rank(ok, hidden.device):
        raise ValueError("this model cannot be packed: its logits are not its output head's (scaled or capped)")
    # position t predicts token t+1: from each sequence's last prompt position to its last token
    c_len = max(1, max(len(c) for c in completions))
    row_of = torch.zeros((len(prompts), c_len + 1), dtype=torch.long)
    col_of = torch.zeros_like(row_of)
    targets = torch.zeros_like(row_of)
    mask = torch.zeros((len(prompts), c_len), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        r, offset = where[i]
        start = offset + len(p) - 1
        row_of[i] = r
        col_of[i, : len(c) + 1] = torch.arange(start, start + len(c) + 1)
        col_of[i, len(c) + 1 :] = start  # padding of the gathered block: any real position, masked out
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = 1.0
    picked = hidden[row_of.to(device), col_of.to(device)]  # [N, C+1, H]
    return head, picked, targets.to(device), mask.to(device)


PACK_GAIN = 0.9
"""A pass is packed only if that computes at most this share of the padded pass's positions: a
packed pass costs a little more per position (the mask built from the restarts, the gather of
completion positions), which on sequences of like length made it slower on a CPU
(``benchmarks/results/packing/README.md``)."""


def worth_packing(prompt_lens: list[int], completion_lens: list[int], width: int | str | None) -> bool:
    """Whether packing these sequences in rows of ``width`` saves enough positions over padding
    them (:data:`PACK_GAIN`)."""
    packed, _ = forward_positions(prompt_lens, completion_lens, True, width)
    padded, _ = forward_positions(prompt_lens, completion_lens, False)
    return packed <= PACK_GAIN * padded


def pass_cost(groups: list[list[tuple[int, int]]], width: int | str | None):
    """The cost function of :func:`tba.models.logprobs.plan_micro_batches` for passes that pack
    where it pays (:func:`worth_packing`): the positions a pass over some of ``groups`` computes,
    ``groups[g]`` being the (prompt, completion) lengths of group g's sequences. So a token budget
    bounds what a pass computes, and its memory, packed or padded; packed passes hold more real
    tokens in it."""

    def cost(chosen: list[int]) -> int:
        prompts = [p for g in chosen for p, _ in groups[g]]
        completions = [c for g in chosen for _, c in groups[g]]
        packed = worth_packing(prompts, completions, width)
        return forward_positions(prompts, completions, packed, width)[0]

    return cost


def forward_positions(
    prompt_lens: list[int], completion_lens: list[int], packed: bool, width: int | str | None = None
) -> tuple[int, int]:
    """(positions computed, real tokens) of one forward pass over these sequences: padded (every
    sequence as wide as the longest prompt plus the longest completion) or ``packed`` in rows of
    ``width`` positions (:func:`positions_per_row`)."""
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens, strict=True)]
    real = sum(lengths)
    if not lengths:
        return 0, 0
    if not packed:
        return len(lengths) * (max(prompt_lens) + max(1, max(completion_lens))), real
    planned = plan_rows(lengths, positions_per_row(lengths, width))
    return len(planned) * max(sum(lengths[i] for i in row) for row in planned), real

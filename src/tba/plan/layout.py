"""``runtime.num_searchers: auto`` and ``trainer.num_ranks: auto``: how a machine's GPUs, or a
cluster's, split between the trainer's ranks and the searchers, by the cost model's predicted steps
a second (:mod:`tba.plan.cost`), with the trainer's memory and the searchers' as constraints.

Every split of G GPUs into R ranks and G - R searcher GPUs, one, two or four searchers a GPU, is
predicted for the run's model (its size read from its ``config.json``; nothing loads) and batch,
and the fastest that fits taken; the plan prints it with the runner-up. A number the user set is
kept, and only the other is chosen. On a CPU, or one GPU, there is nothing to split: one searcher,
one rank (the sync runtime generates in the trainer's process anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tba.config import Config, with_values
from tba.hardware import Hardware
from tba.plan.auto import lag_bound
from tba.plan.cost import (
    Layout,
    Prediction,
    Workload,
    gpu_kind,
    gpu_parts,
    predict,
    searchers_fit,
    trainer_fits,
)
from tba.plan.shape import model_shape, size
from tba.weights.transports import transport, weight_transport

PROMPT_TOKENS = 128
"""The prompt length the split assumes (prompts are not read before the plan)."""
PER_GPU = (1, 2, 4)
"""Searchers a GPU that the split tries."""
TIE = 0.05
"""Candidates predicted within this fraction of the fastest step count as equal: the parts are not
known closer than that (``benchmarks/results/cost_model``). Among them the split takes the fewest
ranks, then the fewest engines a GPU, then the fewest searchers."""


@dataclass(frozen=True)
class Candidate:
    ranks: int
    searchers: int
    per_gpu: int
    prediction: Prediction

    def describe(self) -> str:
        share = f", {self.per_gpu} a GPU" if self.per_gpu > 1 else ""
        return f"{self.ranks} rank(s) + {self.searchers} searcher(s){share}: {self.prediction.describe()}"


def workload(cfg: Config, shape: tuple[float, int]) -> Workload:
    g = cfg.generation
    return Workload(
        params=shape[0],
        layers=shape[1],
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=g.max_new_tokens,
        completions_per_batch=g.prompts_per_batch * g.group_size,
        completions_per_step=cfg.trainer.batch_prompts * g.group_size,
        engine=g.backend,
    )


def candidates(cfg: Config, hw: Hardware, transport_name: str, shape: tuple[float, int], kind: str) -> list[Candidate]:
    """Every split that fits, fastest first: R ranks (``trainer.num_ranks`` if set; on one node, as
    many as the batch has prompts, one if the transport serves no ranks) and the other GPUs'
    searchers, 1, 2 or 4 a GPU (``runtime.num_searchers`` if set: spread over those GPUs)."""
    total = hw.gpus * hw.nodes - evaluation_gpus(cfg)
    w = workload(cfg, shape)
    fixed_ranks = cfg.trainer.num_ranks if cfg.trainer.num_ranks != "auto" else None
    fixed_searchers = cfg.runtime.num_searchers if cfg.runtime.num_searchers != "auto" else None
    most = min(hw.gpus, total - 1, cfg.trainer.batch_prompts)
    if not weight_transport_serves_ranks(cfg):
        most = 1
    k = cfg.trainer.sync_interval
    bound, cost = lag_bound(cfg.runtime, k), transport(transport_name).cost_parts
    found = []
    for ranks in [fixed_ranks] if fixed_ranks else range(1, most + 1):
        free = total - ranks
        if free < 1 or not trainer_fits(kind, w.params, ranks):
            continue
        if fixed_searchers:
            options = [(fixed_searchers, max(1, math.ceil(fixed_searchers / free)))]
        else:
            options = [(free * m, m) for m in PER_GPU]
        cores = hw.cpus * hw.nodes - ranks - 1  # each rank and the tba train process keep a core
        remote = (total - hw.gpus) / free  # the searcher GPUs on other nodes than the trainer's
        for searchers, per_gpu in options:
            crowded = searchers * cfg.runtime.searcher_cpus > cores
            if not fixed_searchers and (crowded or not searchers_fit(kind, w.params, per_gpu)):
                continue
            sp = gpu_parts(kind, w, cost, ranks, per_gpu, remote, hw.nodes - 1)
            c_step, c_batch = w.completions_per_step, w.completions_per_batch
            layout = Layout("ray", c_step, c_batch, searchers, ranks, sync_interval=k, lag_bound=bound)
            found.append(Candidate(ranks, searchers, per_gpu, predict(sp, layout)))
    return ranked(found)


def ranked(found: list[Candidate]) -> list[Candidate]:
    """``found`` in the split's order: those that tie with the fastest (:func:`tied`) first, fewest
    ranks, then engines a GPU, then searchers; then the rest, fastest first."""
    first = sorted(tied(found), key=lambda c: (c.ranks, c.per_gpu, c.searchers, c.prediction.step_s))
    rest = [c for c in found if c not in first]
    rest.sort(key=lambda c: (c.prediction.step_s, c.ranks, c.per_gpu, c.searchers))
    return first + rest


def tied(found: list[Candidate]) -> list[Candidate]:
    """The candidates predicted within :data:`TIE` of the fastest."""
    fastest = min((c.prediction.step_s for c in found), default=0.0)
    return [c for c in found if c.prediction.step_s <= fastest * (1 + TIE)]


def ties(found: list[Candidate]) -> int:
    """How many of :func:`ranked`'s candidates tie with the fastest."""
    return len(tied(found))


def evaluation_gpus(cfg: Config) -> int:
    """Whole GPUs that the evaluation actor takes out of the split (``eval.async`` with
    ``eval.eval_gpus`` of one or more; a share, or none given, shares the searchers')."""
    e = cfg.eval
    return int(e.eval_gpus) if e.async_ and e.eval_gpus is not None and e.eval_gpus >= 1 else 0


def weight_transport_serves_ranks(cfg: Config) -> bool:
    name = cfg.runtime.weight_transport
    return name == "auto" or transport(name).serves_ranks


def sync_prediction(cfg: Config, hw: Hardware, shape: tuple[float, int], kind: str) -> Prediction:
    """The sync runtime on ``hw``'s first node for comparison: the ranks train on every GPU there, and
    generation takes the trainer's first GPU in turn."""
    w = workload(cfg, shape)
    sp = gpu_parts(kind, w, "in_process", sync_ranks(cfg, hw))
    return predict(sp, Layout("sync", w.completions_per_step, w.completions_per_batch, 1, sync_ranks(cfg, hw)))


def sync_ranks(cfg: Config, hw: Hardware) -> int:
    """The ranks the sync runtime would train on: every GPU of the node, at most a prompt each."""
    return min(hw.gpus, cfg.trainer.batch_prompts)


def choose(cfg: Config, hw: Hardware, transport_name: str, model_path) -> tuple[int, int, dict[str, str]]:
    """(searchers, ranks, why) for a ray run: what ``auto`` leaves to the split, decided; what the
    user set, kept. ``why`` holds the plan's lines on the layout (the prediction, the runner-up).
    ``model_path``: a callable giving the policy's location, called only where there is a split."""
    r, t = cfg.runtime, cfg.trainer
    ranks = 1 if t.num_ranks == "auto" else t.num_ranks
    searchers = 1 if r.num_searchers == "auto" else r.num_searchers
    why: dict[str, str] = {}
    if r.address and "auto" in (r.num_searchers, t.num_ranks):  # the cluster's GPUs are known once joined
        why["num_searchers"] = (
            f"auto: {searchers} searcher(s), {ranks} rank(s) on the cluster at {r.address}, whose GPUs the plan "
            "does not see before it joins: set runtime.num_searchers and trainer.num_ranks (tba train --print-plan "
            "--hardware=NODESxGPUSxKIND predicts a split)"
        )
        return searchers, ranks, why
    if hw.gpus * hw.nodes < 2 or not cfg.run.device.startswith(("cuda", "auto")):
        if r.num_searchers == "auto":
            why["num_searchers"] = "auto: 1, as the searcher shares the trainer's device (nothing to split)"
        return searchers, ranks, why
    path = model_path()
    shape = model_shape(path)
    if shape is None:
        if r.num_searchers == "auto":
            searchers = max(1, hw.gpus * hw.nodes - ranks - evaluation_gpus(cfg))
            why["num_searchers"] = (
                f"auto: {searchers}, one a GPU beyond the trainer's {ranks}; no config.json for {path}, "
                "so no prediction"
            )
        return searchers, ranks, why
    known = gpu_kind(hw.gpu_name)
    kind = known or "h100"
    unknown = "" if known else f" (no parts for {hw.gpu_name or 'this GPU'}: an H100's)"
    found = candidates(cfg, hw, transport_name, shape, kind)
    if not found:
        why["layout"] = (
            f"no split of {hw.gpus * hw.nodes} GPUs fits a {size(shape[0])} model's trainer state in "
            f"{'trainer.num_ranks=' + str(t.num_ranks) if t.num_ranks != 'auto' else 'fewer ranks than GPUs'}"
        )
        return searchers, ranks, why
    best = found[0]
    runner = next((c for c in found[1:] if (c.ranks, c.searchers) != (best.ranks, best.searchers)), None)
    sync = sync_prediction(cfg, hw, shape, kind)
    auto_keys = [k for k, v in (("num_searchers", r.num_searchers), ("num_ranks", t.num_ranks)) if v == "auto"]
    chosen = f"auto ({', '.join(auto_keys)}): " if auto_keys else ""
    tie = ties(found)
    tied = (
        f"; {tie} splits within {TIE:.0%} of the fastest tie, and the fewest ranks, then engines a GPU, win"
        if tie > 1
        else ""
    )
    model = f"predicted for a {size(shape[0])} model, {PROMPT_TOKENS}-token prompts{unknown}"
    why["layout"] = f"{chosen}{best.describe()}; {model}{tied}"
    if runner is not None:
        why["runner_up"] = runner.describe()
    if best.prediction.bound == "lag":
        why["lag_bound_holds"] = (
            f"a searcher's batch takes {best.prediction.parts['generate_s']:.3g} s and runtime.max_lag="
            f"{lag_bound(r, t.sync_interval)} lets the trainer take that many steps over two of them: a higher "
            "runtime.max_lag (or a smaller generation.prompts_per_batch) lets more GPUs pay"
        )
    why["sync_would_take"] = (
        f"{sync.step_s:.3g} s a step, generating and training in turns on {sync_ranks(cfg, hw)} rank(s)"
    )
    return best.searchers, best.ranks, why


def resolve(cfg: Config, hw: Hardware, model_path) -> tuple[Config, dict[str, str]]:
    """``cfg`` with ``runtime.num_searchers`` and ``trainer.num_ranks`` decided where ``auto``
    (``model_path``: a callable giving the policy's location, read only on several GPUs), and the
    plan's lines on the layout (its ``why``)."""
    why: dict[str, str] = {}
    searchers, ranks = cfg.runtime.num_searchers, cfg.trainer.num_ranks
    if cfg.runtime.type == "ray":
        searchers, ranks, why = choose(cfg, hw, weight_transport(cfg.runtime.weight_transport, True), model_path)
    values = {}
    if cfg.runtime.num_searchers == "auto":
        values["runtime.num_searchers"] = 1 if searchers == "auto" else searchers
    if cfg.trainer.num_ranks == "auto":
        values["trainer.num_ranks"] = 1 if ranks == "auto" else ranks
    return (with_values(cfg, values) if values else cfg), why

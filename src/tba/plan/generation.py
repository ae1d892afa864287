"""How a run generates, as the plan decides it: batch generation or a stream (and a stream's
prompts in flight and refill), and each vLLM engine's settings by role."""

from __future__ import annotations

from tba.config import Config
from tba.plan.auto import engine_memory_fraction, engine_sleeps, streams


def vllm_engines(cfg: Config, device: str, searcher_gpus: float | None, eval_gpus: float | None) -> dict[str, dict]:
    """Each vLLM engine's memory and sleep by role, from its process's share of a GPU: a searcher's
    (``searcher_gpus`` in the ray runtime; in the sync runtime it shares the trainer's process and
    GPU), an evaluation's (the evaluation actor's ``eval_gpus``; ``tba eval``: a whole GPU)."""
    if cfg.generation.backend != "vllm":
        return {}
    settings, ray_runtime = cfg.generation.vllm, cfg.runtime.type == "ray"
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    shares = {
        "searcher": searcher_gpus if ray_runtime else None,
        "evaluation": eval_gpus if ray_runtime and cfg.eval.async_ else 1.0,
    }
    eager = settings.enforce_eager if settings.enforce_eager is not None else device_type == "cpu"
    return {
        role: {
            "gpu_memory_utilization": engine_memory_fraction(settings, share),
            "sleep": engine_sleeps(settings, device_type, share),
            "enforce_eager": eager,  # CUDA graphs on a GPU; on a CPU compiling takes most of a start
        }
        for role, share in shares.items()
    }


def stream_sizes(cfg: Config, stream: str) -> dict[str, int | None]:
    """A stream's prompts in flight and its refill (the plan's ``max_in_flight`` and ``refill``):
    in the sync runtime each step's batch, all of it at once; in the ray runtime
    ``generation.max_in_flight`` (default ``prompts_per_batch``), refilled a quarter at a time."""
    if stream == "batch":
        return {"max_in_flight": None, "refill": None}
    g, exact = cfg.generation, cfg.runtime.type != "ray"
    in_flight = g.prompts_per_batch if exact else g.max_in_flight or g.prompts_per_batch
    return {"max_in_flight": in_flight, "refill": g.refill or (in_flight if exact else max(1, in_flight // 4))}


def stream_kind(cfg: Config, device: str, exact: bool) -> str:
    """The searcher's generation: ``batch``, or the stream it runs (``vllm``, ``hf_continuous``,
    ``hf_refill``; ``exact``: the plan's ``exact_stream``); HF's continuous batching may still fall
    back to refills when the model cannot serve it (said when the searcher is built)."""
    g = cfg.generation
    if cfg.task.multi_turn or not streams(g, cfg.runtime.type, "cuda" if device.startswith("cuda") else "cpu"):
        return "batch"
    if g.backend == "vllm":
        return "vllm"
    return "hf_continuous" if not exact and g.hf_stream == "continuous" else "hf_refill"


def searcher_sampling(cfg: Config) -> tuple[dict, ...]:
    """Each searcher's sampling, by its number (the plan's ``sampling``): its temperature and top-p
    (``generation.searcher_temperatures`` / ``searcher_top_ps``, entry i mod their length, else
    ``temperature`` / ``top_p``) and, with ``explore_prob``, the range its exploring batches draw a
    temperature from (``explore_temperature``, default ``[T, T * 1.1 / 0.7]``) or None. The sync
    runtime's one searcher is number 0, as is ``tba eval``'s engine."""
    g = cfg.generation
    count = cfg.runtime.num_searchers if cfg.runtime.type == "ray" else 1
    out = []
    for i in range(count):
        t = g.searcher_temperatures[i % len(g.searcher_temperatures)] if g.searcher_temperatures else g.temperature
        top_p = g.searcher_top_ps[i % len(g.searcher_top_ps)] if g.searcher_top_ps else g.top_p
        explore = None
        if g.explore_prob > 0:
            explore = list(g.explore_temperature or (t, t * 1.1 / 0.7))
        out.append({"temperature": t, "top_p": top_p, "explore_temperature": explore})
    return tuple(out)


def sampling_line(sampling: tuple[dict, ...], explore_prob: float) -> str:
    """The searchers' sampling as the plan prints it: one entry when all sample alike."""

    def one(s: dict) -> str:
        text = f"temperature {s['temperature']:g}, top-p {s['top_p']:g}"
        if s["explore_temperature"] is not None:
            lo, hi = s["explore_temperature"]
            text += f"; exploring {explore_prob:.0%} of batches at {lo:g}-{hi:g}"
        return text

    if not sampling:
        return "  sampling: none"
    if all(s == sampling[0] for s in sampling):
        return f"  sampling: {one(sampling[0])}" + (" (every searcher)" if len(sampling) > 1 else "")
    return "  sampling: " + "; ".join(f"searcher {i}: {one(s)}" for i, s in enumerate(sampling))

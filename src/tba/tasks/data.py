"""Prompts from datasets: a Hugging Face hub id, or local JSONL / JSON / CSV / Parquet files, all
through ``datasets.load_dataset``.

:class:`DataTask` is the part that the dataset-backed tasks share (``dataset``, ``gsm8k``):

- **Loading.** ``task.path`` is a local file (its format from the extension), a local folder
  (``datasets`` infers format and splits from the file names: ``train.jsonl``, ``test.parquet``),
  or a hub id with ``task.config`` and ``task.split``.
- **Columns.** Rows are kept column by column (a 100k-row file costs one list per column, not a
  dict per row). A column of dicts (verl's ``reward_model``, ``extra_info``) is kept as it is and
  its fields are also offered under their own names (``ground_truth``) where no other column or
  field has that name.
- **Evaluation split.** ``eval_split`` or ``eval_path`` if given, otherwise ``eval_size`` rows held
  out of the training split with a fixed seed. Training never draws a prompt whose id is in the
  evaluation split, duplicates included.
- **Prompt ids** come from ``id_column``, or are a hash of the prompt (text or messages), so they
  are the same in every run and every process.
- **Length.** Prompts longer than ``max_prompt_tokens`` after the chat template are dropped at
  load and counted, never truncated.
- **Order.** Each searcher walks the training prompts in its own shuffled order, epoch by epoch.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from tba.errors import UserError
from tba.tasks.base import Prompt, Task

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DatasetLoadError(UserError, ValueError):
    """A dataset could not be loaded or lacks what the task needs; the message says what to do."""


def load_split(path: str, config: str | None, split: str) -> dict[str, list]:
    """One split as ``{column: values}``; a local file has a single split, whatever ``split`` says."""
    import datasets

    datasets.disable_progress_bars()  # per-file bars would bury the run's own output
    local = Path(path).expanduser()
    if local.is_file() and local.stat().st_size == 0:
        raise DatasetLoadError(f"{path} is empty; give a dataset with at least one row")
    try:
        if local.is_file():
            fmt = FORMATS.get(local.suffix.lower())
            if fmt is None:
                raise DatasetLoadError(
                    f"task.path {path}: unknown file type {local.suffix!r}; use one of {', '.join(FORMATS)}"
                )
            ds = datasets.load_dataset(fmt, data_files=str(local), split="train")
        elif local.is_dir():
            ds = datasets.load_dataset(str(local), split=split)
        else:
            if path.startswith((".", "/", "~")) or Path(path).suffix.lower() in FORMATS:
                raise DatasetLoadError(f"task.path {path} does not exist (a local file or folder was expected)")
            ds = datasets.load_dataset(path, config, split=split)
    except DatasetLoadError:
        raise
    except ValueError as err:  # datasets says which splits exist
        raise DatasetLoadError(f"cannot load split {split!r} of {path}: {err}") from None
    except Exception as err:  # network, hub and parser errors: one line, not the hub client's traceback
        raise DatasetLoadError(
            f"cannot load dataset {path!r}"
            + (f" (config {config!r})" if config else "")
            + f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
            "  A hub id needs network access (or a local copy in the datasets cache); "
            "a local file needs a .jsonl, .json, .csv or .parquet extension."
        ) from None
    if len(ds) == 0:
        raise DatasetLoadError(f"split {split!r} of {path} has no rows; give a dataset with at least one row")
    return flatten_columns(ds.to_dict())


def flatten_columns(columns: dict[str, list]) -> dict[str, list]:
    """Add the fields of dict-valued columns under their own names, where unambiguous."""
    out = dict(columns)
    fields: dict[str, list[str]] = {}
    for name, values in columns.items():
        first = next((v for v in values if v is not None), None)
        if isinstance(first, dict):
            for key in first:
                fields.setdefault(key, []).append(name)
    for key, parents in fields.items():
        if len(parents) == 1 and key not in columns:
            parent = columns[parents[0]]
            out[key] = [v.get(key) if isinstance(v, dict) else None for v in parent]
    return out


def prompt_hash(value: Any) -> str:
    """A stable id for a prompt (the same text or messages give the same id in every process)."""
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def last_user_text(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return str(users[-1] if users else messages[-1]["content"])


def held_out(n: int, eval_size: int, seed: int, columns: dict[str, list]):
    """``eval_size`` of ``n`` rows held out with ``seed``: the training rows, the columns, and the
    held-out rows (what :meth:`DataTask.load_columns` returns after the training columns)."""
    held_idx = set(random.Random(seed).sample(range(n), eval_size))
    return [i for i in range(n) if i not in held_idx], columns, sorted(held_idx)


class DataTask(Task):
    """A task whose prompts are the rows of a dataset. Subclasses say how a row becomes a prompt
    (:meth:`make_prompt`) and what rewards it."""

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print):
        self.cfg = cfg
        self.log = log
        self.dropped_long = self.dropped_long_eval = 0
        train, train_rows, held, eval_rows = self.load_columns()
        self._eval = [self.make_prompt(held, i) for i in eval_rows]
        eval_ids = {p.id for p in self._eval}
        self._columns = train
        self._ids = {i: self.prompt_id(train, i) for i in train_rows}
        self._train = [i for i in train_rows if self._ids[i] not in eval_ids]
        self.overlap = len(train_rows) - len(self._train)
        if tokenizer is not None and cfg.max_prompt_tokens is not None:
            self._train = self._drop_long(self._train, tokenizer, chat_template)
            kept = self._drop_long_prompts(self._eval, tokenizer, chat_template)
            self.dropped_long_eval = len(self._eval) - len(kept)
            self._eval = kept
        too_long = f"longer than task.max_prompt_tokens={cfg.max_prompt_tokens}; raise it (or set it to null)"
        if not self._train:
            why = f"all {self.dropped_long} are {too_long}"
            if not self.dropped_long:
                why = "every row is held out for evaluation or repeats an evaluation prompt; give more rows"
            raise DatasetLoadError(f"no training prompts left in {self.source}: {why}")
        if not self._eval:
            raise DatasetLoadError(f"no evaluation prompts left in {self.source}: all are {too_long}")
        self._order: list[int] = []
        self._epoch: list | None = None  # the random state that shuffled the current epoch

    # ------------------------------------------------------------ what subclasses define

    @property
    def source(self) -> str:
        """Where the prompts come from, for messages."""
        return self.cfg.path

    def load_columns(self) -> tuple[dict[str, list], list[int], dict[str, list], list[int]]:
        """The training columns and the rows of them to train on; the evaluation columns and their
        rows. By default from ``task.path``: ``eval_split`` / ``eval_path`` if given, else
        ``eval_size`` rows held out of the training split with ``task.seed``."""
        cfg = self.cfg
        train = load_split(cfg.path, cfg.config, cfg.split)
        if cfg.max_rows is not None:
            train = {k: v[: cfg.max_rows] for k, v in train.items()}
        self.check_columns(train, f"{cfg.path} split {cfg.split!r}")
        n = _num_rows(train)
        if cfg.eval_path or cfg.eval_split:
            held = load_split(cfg.eval_path or cfg.path, cfg.config, cfg.eval_split or cfg.split)
            self.check_columns(held, f"the evaluation split of {cfg.eval_path or cfg.path}")
            return train, list(range(n)), held, list(range(_num_rows(held)))
        if cfg.eval_size >= n:
            raise DatasetLoadError(
                f"task.eval_size {cfg.eval_size} holds out every row of {cfg.path} ({n} rows); "
                "lower task.eval_size, or give task.eval_split / task.eval_path"
            )
        return train, *held_out(n, cfg.eval_size, cfg.seed, train)

    def check_columns(self, columns: dict[str, list], where: str) -> None:
        """Raise :class:`DatasetLoadError` if a column the task needs is missing."""

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        """The prompt of row ``i`` as a string or a message list."""
        raise NotImplementedError

    def make_prompt(self, columns: dict[str, list], i: int) -> Prompt:
        value = self.prompt_value(columns, i)
        row = {k: v[i] for k, v in columns.items()}
        pid = self.prompt_id(columns, i)
        if is_messages(value):
            return Prompt(pid, last_user_text(value), self.answer_of(row), tuple(value), row)
        return Prompt(pid, str(value), self.answer_of(row), None, row)

    def answer_of(self, row: dict[str, Any]) -> str | None:
        return None

    # ------------------------------------------------------------ shared

    def prompt_id(self, columns: dict[str, list], i: int) -> str:
        if self.cfg.id_column:
            return str(columns[self.cfg.id_column][i])
        return prompt_hash(self.prompt_value(columns, i))

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            if not self._order:  # a new epoch, in this caller's own shuffled order
                self._epoch = [list(x) if isinstance(x, tuple) else x for x in rng.getstate()]
                self._order = list(self._train)
                rng.shuffle(self._order)
            out.append(self.make_prompt(self._columns, self._order.pop()))
        return out

    def sampler_state(self) -> dict:
        """The current epoch as the random state that shuffled it and the prompts taken from it: a
        few kilobytes whatever the dataset's size (a searcher of the ray runtime sends it with
        every batch)."""
        if not self._order:
            return {"order": []}
        return {"epoch": self._epoch, "taken": len(self._train) - len(self._order)}

    def load_sampler_state(self, state: dict) -> None:
        if "epoch" not in state:  # an empty epoch, or an older checkpoint's explicit order
            self._order = list(state.get("order", []))
            return
        version, internal, gauss = state["epoch"]
        rng = random.Random()
        rng.setstate((version, tuple(internal), gauss))
        self._epoch, self._order = state["epoch"], list(self._train)
        rng.shuffle(self._order)
        del self._order[len(self._order) - state["taken"] :]  # (taken from the end)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    @property
    def num_train(self) -> int:
        return len(self._train)

    def describe(self) -> str:
        parts = [f"task {self.name}: {len(self._train):,} training prompts, {len(self._eval):,} evaluation prompts"]
        if self.dropped_long or self.dropped_long_eval:
            parts.append(
                f"dropped {self.dropped_long:,} training and {self.dropped_long_eval:,} evaluation prompts "
                f"longer than task.max_prompt_tokens={self.cfg.max_prompt_tokens}"
            )
        if self.overlap:
            parts.append(f"{self.overlap:,} training rows repeat an evaluation prompt and are not trained on")
        return "; ".join(parts)

    def _drop_long(self, rows: list[int], tokenizer, chat_template) -> list[int]:
        prompts = [self.make_prompt(self._columns, i) for i in rows]
        kept_ids = {id(p) for p in self._drop_long_prompts(prompts, tokenizer, chat_template)}
        kept = [i for i, p in zip(rows, prompts, strict=True) if id(p) in kept_ids]
        self.dropped_long = len(rows) - len(kept)
        return kept

    def _drop_long_prompts(self, prompts: list[Prompt], tokenizer, chat_template) -> list[Prompt]:
        from tba.models.loading import encode_prompts

        limit = self.cfg.max_prompt_tokens
        # A token covers at least one byte of text, so a prompt of at most `limit - overhead` bytes
        # cannot be too long; only the others are tokenized (a 100k-row load stays fast).
        overhead = len(encode_prompts(tokenizer, [Prompt("", "")], chat_template)[0]) + 2
        if any(p.is_chat for p in prompts):  # per message: role markers, end-of-turn tokens
            empty_turn = Prompt("", "", messages=({"role": "user", "content": ""},))
            overhead_chat = len(encode_prompts(tokenizer, [empty_turn], chat_template)[0]) + 2
        suspects = [
            p for p in prompts if _byte_len(p) + (overhead_chat * len(p.messages) if p.is_chat else overhead) > limit
        ]
        too_long: set[int] = set()
        for start in range(0, len(suspects), 1024):
            chunk = suspects[start : start + 1024]
            for p, ids in zip(chunk, encode_prompts(tokenizer, chunk, chat_template), strict=True):
                if len(ids) > limit:
                    too_long.add(id(p))
        return [p for p in prompts if id(p) not in too_long]


def _num_rows(columns: dict[str, list]) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def _byte_len(p: Prompt) -> int:
    if p.messages is not None:
        return sum(len(str(m.get("content", "")).encode()) for m in p.messages)
    return len(p.text.encode())

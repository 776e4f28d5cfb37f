"""Prompt datasets for paper-scale runs: HPDv2 train/test, DrawBench, Pick-a-Pic (docs/references.md).

No package ships these prompts. ``load_prompts`` takes either a local file or a registered dataset name:
    local file   .txt (one prompt per line, as DanceGRPO's prompts.txt and Flow-GRPO's dataset/*/train.txt),
                 .json (a list of strings, a list of records, or {"prompts": [...]}) , .jsonl, .csv, .parquet;
                 records use the first of PROMPT_COLUMNS they have, and CATEGORY_COLUMNS for a category.
    dataset name hpdv2_train / hpdv2_test (the train.json / test.json annotation files of the hub dataset
                 ymhao/HPDv2, without its 32 GB of images), drawbench (shunk031/DrawBench, parquet conversion),
                 pickapic (captions of yuvalkirstain/pickapic_v2, streamed through ``datasets``).
Hub sources are tried cache-first and fail fast offline with a ``WeightsUnavailableError`` (jagg.scale.hub).
The hub layouts were not reachable from the development machine; if one changed, pass a local file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jagg.errors import WeightsUnavailableError
from jagg.scale.hub import hub_file, hub_offline, load_or_explain

PROMPT_COLUMNS = ("prompt", "prompts", "Prompts", "caption", "text")
CATEGORY_COLUMNS = ("category", "Category", "style", "Categories")
LOCAL_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".parquet")


@dataclass
class PromptSet:
    """An ordered list of prompts with optional per-prompt categories (HPDv2 style, DrawBench category)."""

    name: str
    prompts: list[str]
    categories: list[str] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> str:
        return self.prompts[i]

    def shard(self, rank: int, world_size: int) -> PromptSet:
        """Every ``world_size``-th prompt starting at ``rank`` (disjoint, covering shards for data parallelism)."""
        cats = self.categories[rank::world_size] if self.categories is not None else None
        return PromptSet(self.name, self.prompts[rank::world_size], cats)


@dataclass(frozen=True)
class HubPromptSource:
    """Where a named prompt set lives on the hub. ``filename`` set: one annotation file; else ``datasets``."""

    repo: str
    split: str = "train"
    filename: str | None = None
    revision: str | None = None
    streaming: bool = False


PROMPT_DATASETS: dict[str, HubPromptSource] = {
    "hpdv2_train": HubPromptSource("ymhao/HPDv2", filename="train.json"),
    "hpdv2_test": HubPromptSource("ymhao/HPDv2", split="test", filename="test.json"),
    "drawbench": HubPromptSource("shunk031/DrawBench", split="test", revision="refs/convert/parquet"),
    "pickapic": HubPromptSource("yuvalkirstain/pickapic_v2", split="train", streaming=True),
}


# --------------------------------------------------------------------------- local files
def _column(record: dict, columns: Sequence[str], what: str, source: str) -> str | None:
    for c in columns:
        if c in record:
            return record[c]
    if what == "prompt":
        raise ValueError(f"{source}: record has none of the prompt columns {columns}; keys: {sorted(record)}")
    return None


def _from_records(records: Iterable, source: str) -> tuple[list[str], list[str | None]]:
    prompts, cats = [], []
    for r in records:
        if isinstance(r, str):
            prompts.append(r)
            cats.append(None)
        else:
            prompts.append(_column(r, PROMPT_COLUMNS, "prompt", source))
            cats.append(_column(r, CATEGORY_COLUMNS, "category", source))
    return prompts, cats


def read_prompt_file(path: str) -> tuple[list[str], list[str | None]]:
    """(prompts, categories) from a .txt / .json / .jsonl / .csv / .parquet file (see module docstring)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".txt":
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
        return [ln for ln in lines if ln], [None] * sum(1 for ln in lines if ln)
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):
            key = next((c for c in PROMPT_COLUMNS if c in data), None)
            if key is None:
                raise ValueError(f"{path}: JSON object without any of the keys {PROMPT_COLUMNS}")
            data = data[key]
        return _from_records(data, path)
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return _from_records((json.loads(ln) for ln in f if ln.strip()), path)
    if suffix in (".csv", ".parquet"):
        import pandas as pd

        df = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        return _from_records(df.to_dict("records"), path)
    raise ValueError(f"unsupported prompt file {path!r}; expected one of {LOCAL_SUFFIXES}")


# --------------------------------------------------------------------------- hub
def _read_hub(name: str, src: HubPromptSource, limit: int | None) -> tuple[list[str], list[str | None]]:
    what = f"prompt dataset {name!r}"
    if src.filename is not None:
        path = hub_file(src.repo, src.filename, what=what, repo_type="dataset")
        return read_prompt_file(path)
    if src.streaming and limit is None:
        raise ValueError(f"{what} is streamed from the hub (it stores images too); pass limit=N")
    import datasets

    def load(repo: str, cache_only: bool):
        # `datasets` has no per-call cache-only switch: it uses its cache by itself when it was imported
        # offline; offline set later (hub_offline) must not reach the network either.
        if cache_only and not os.path.isdir(repo) and not datasets.config.HF_HUB_OFFLINE:
            raise OSError("offline" if hub_offline() else "not looked up in the cache")
        return datasets.load_dataset(repo, split=src.split, revision=src.revision, streaming=src.streaming)

    ds = load_or_explain(load, src.repo, what=what)
    prompts, cats, seen = [], [], set()
    for row in ds:  # stop after `limit` distinct prompts (streamed sources are large)
        (p,), (c,) = _from_records([row], src.repo)
        if p not in seen:
            seen.add(p)
            prompts.append(p)
            cats.append(c)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts, cats


def load_prompts(
    source: str, *, limit: int | None = None, dedupe: bool = True, name: str | None = None
) -> PromptSet:
    """A ``PromptSet`` from a local file or a name in ``PROMPT_DATASETS`` (first ``limit`` prompts).

    ``dedupe`` drops repeated prompts keeping the first occurrence (HPDv2 and Pick-a-Pic annotate several
    image pairs per prompt); hub datasets read through ``datasets`` are always deduplicated.
    """
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        prompts, cats = read_prompt_file(path)
    elif source in PROMPT_DATASETS:
        prompts, cats = _read_hub(source, PROMPT_DATASETS[source], limit)
    elif source.lower().endswith(LOCAL_SUFFIXES):
        raise WeightsUnavailableError(f"prompt file {source!r} does not exist")
    else:
        raise ValueError(f"prompts: {source!r} is neither a file nor one of {sorted(PROMPT_DATASETS)}")
    if dedupe:
        first = {}
        for i, p in enumerate(prompts):
            first.setdefault(p, i)
        keep = sorted(first.values())
        prompts, cats = [prompts[i] for i in keep], [cats[i] for i in keep]
    if limit is not None:
        prompts, cats = prompts[:limit], cats[:limit]
    if not prompts:
        raise ValueError(f"prompts: {source!r} contains no prompts")
    has_cats = any(c is not None for c in cats)
    return PromptSet(
        name or os.path.splitext(os.path.basename(source))[0], prompts, cats if has_cats else None
    )

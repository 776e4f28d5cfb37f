"""Prompt datasets for paper-scale runs: HPDv2 train/test, DrawBench, Pick-a-Pic (docs/references.md).

No package ships these prompts. ``load_prompts`` takes either a local file or a registered dataset name:
    local file   .txt (one prompt per line, as DanceGRPO's prompts.txt and Flow-GRPO's dataset/*/train.txt),
                 .json (a list of strings, a list of records, or {"prompts": [...]}) , .jsonl, .csv, .parquet;
                 records use the first of PROMPT_COLUMNS they have, and CATEGORY_COLUMNS for a category.
    dataset name hpdv2_train / hpdv2_test (the train.json / test.json annotation files of the hub dataset
                 ymhao/HPDv2, without its 32 GB of images), drawbench (shunk031/DrawBench, parquet conversion),
                 pickapic (captions of yuvalkirstain/pickapic_v2, streamed through ``datasets``),
                 pickscore_flowgrpo_train / pickscore_flowgrpo_test (Flow-GRPO's Pick-a-Pic caption split,
                 ``dataset/pickscore/{train,test}.txt`` of yifan123/flow_grpo @ ac4c86e: 25,432 and 2,048
                 captions, a ``RepoFileSource``).
Hub sources are tried cache-first and fail fast offline with a ``WeightsUnavailableError`` (jagg.scale.hub).
A ``RepoFileSource`` is read from a copy of its repository's layout under ``prompts_dir()``
($JAGG_PROMPTS_DIR, default ~/.cache/jagg/prompts), fetched there once when missing and online, and its
SHA-256 checked either way; offline (HF_HUB_OFFLINE, or GitHub unreachable) it fails fast the same way.
The hub layouts were not reachable from the development machine; if one changed, pass a local file.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
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


@dataclass(frozen=True)
class RepoFileSource:
    """One text file of a public GitHub repository at a pinned commit, with the SHA-256 of its bytes and its
    count of lines (Flow-GRPO's caption splits: one prompt a line, read as their ``TextPromptDataset``)."""

    repo: str  # owner/name
    commit: str
    path: str  # inside the repository
    sha256: str
    lines: int

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    def local_path(self, root: str) -> str:
        """Where a copy lives: ``root``/owner/name/path (a checkout of the repository there also serves)."""
        return os.path.join(root, *self.repo.split("/"), *self.path.split("/"))


FLOW_GRPO = "yifan123/flow_grpo"
FLOW_GRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
FLASH_GRPO = "Shredded-Pork/Flash-GRPO"
FLASH_GRPO_COMMIT = "8cfc97330752136824b0fe40b445155aa63f54f9"

PROMPT_DATASETS: dict[str, HubPromptSource | RepoFileSource] = {
    "hpdv2_train": HubPromptSource("ymhao/HPDv2", filename="train.json"),
    "hpdv2_test": HubPromptSource("ymhao/HPDv2", split="test", filename="test.json"),
    "drawbench": HubPromptSource("shunk031/DrawBench", split="test", revision="refs/convert/parquet"),
    "pickapic": HubPromptSource("yuvalkirstain/pickapic_v2", split="train", streaming=True),
    # Flow-GRPO's pickscore_sd3 prompts (config/grpo.py:109, scripts/train_sd3.py:41-51, 477-479): unique
    # Pick-a-Pic v1 captions of >= 6 words, shuffled, the first 2,048 held out (dataset/pickscore/prpocess.py)
    "pickscore_flowgrpo_train": RepoFileSource(
        FLOW_GRPO,
        FLOW_GRPO_COMMIT,
        "dataset/pickscore/train.txt",
        sha256="2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f",
        lines=25_432,
    ),
    "pickscore_flowgrpo_test": RepoFileSource(
        FLOW_GRPO,
        FLOW_GRPO_COMMIT,
        "dataset/pickscore/test.txt",
        sha256="d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262",
        lines=2_048,
    ),
    # Flash-GRPO's video prompts (config/dgx.py wan2_1_flash: config.dataset = dataset/video, read by their
    # TextPromptDataset in scripts/train_wanx2_1_flash.py): one prompt a line
    "flashgrpo_video_train": RepoFileSource(
        FLASH_GRPO,
        FLASH_GRPO_COMMIT,
        "dataset/video/train.txt",
        sha256="610e16e6b0e8a30bbb1e75cf87413bf592fe491faa74d918d57d914d865e0016",
        lines=19_700,
    ),
    "flashgrpo_video_test": RepoFileSource(
        FLASH_GRPO,
        FLASH_GRPO_COMMIT,
        "dataset/video/test.txt",
        sha256="96536b01ab2d091158118c4fd9f548950abce4fa5fa9a7f9ac2ebaae47776da5",
        lines=300,
    ),
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


# --------------------------------------------------------------------------- files of a pinned repository
def prompts_dir() -> str:
    """Where ``RepoFileSource`` copies live: $JAGG_PROMPTS_DIR, else ~/.cache/jagg/prompts."""
    return os.path.expanduser(os.environ.get("JAGG_PROMPTS_DIR") or "~/.cache/jagg/prompts")


def _github_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(("raw.githubusercontent.com", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _fetch(src: RepoFileSource, path: str) -> None:
    """Download ``src`` to ``path`` (atomically: a checked temporary file renamed into place)."""
    from urllib.request import urlopen

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with urlopen(src.url, timeout=60) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != src.sha256:
        raise WeightsUnavailableError(f"{src.url}: downloaded file does not have SHA-256 {src.sha256}")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def repo_file(name: str, src: RepoFileSource) -> str:
    """The local path of ``src``'s file, fetched into ``prompts_dir()`` when missing and online; a
    ``WeightsUnavailableError`` saying how to provide it when offline, or when the copy there is another file."""
    path = src.local_path(prompts_dir())
    where = f"{src.repo}@{src.commit[:7]}:{src.path}"
    how = (
        f"Copy it (from a {src.repo} checkout at {src.commit[:7]} or {src.url}) to {path}, set JAGG_PROMPTS_DIR "
        f"to a folder holding {src.repo}/{src.path}, or pass a file as data.train_prompts / data.eval_prompts."
    )
    if not os.path.isfile(path):
        if hub_offline() or not _github_reachable():
            why = "HF_HUB_OFFLINE is set" if hub_offline() else "GitHub is unreachable"
            raise WeightsUnavailableError(f"prompt dataset {name!r}: {where} is not available ({why}). {how}")
        _fetch(src, path)
    digest = _sha256(path)
    if digest != src.sha256:
        raise WeightsUnavailableError(
            f"prompt dataset {name!r}: {path} is not {where} (SHA-256 {digest[:12]}..., expected "
            f"{src.sha256[:12]}...). {how}"
        )
    return path


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
    elif isinstance(PROMPT_DATASETS.get(source), RepoFileSource):
        src = PROMPT_DATASETS[source]
        prompts, cats = read_prompt_file(repo_file(source, src))
        if len(prompts) != src.lines:  # the file is theirs (SHA-256): our reading must keep every line
            raise ValueError(
                f"prompts: {source!r} read as {len(prompts)} prompts, {src.lines} lines expected"
            )
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

"""Prompt datasets from local files in every supported format, and a fast clear error for hub sets offline."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from jagg.errors import WeightsUnavailableError
from jagg.scale.prompts import PROMPT_DATASETS, load_prompts, read_prompt_file

PROMPTS = ["a red circle on the left", "a photo of a cat", "a red circle on the left", "an owl, oil painting"]
CATS = ["shapes", "photo", "shapes", "paintings"]


def write(tmp_path, fmt: str):
    path = tmp_path / f"prompts.{fmt}"
    records = [{"prompt": p, "category": c} for p, c in zip(PROMPTS, CATS, strict=True)]
    if fmt == "txt":
        path.write_text("\n".join(PROMPTS) + "\n\n")
    elif fmt == "json":
        path.write_text(json.dumps(records))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    elif fmt == "csv":
        pd.DataFrame({"Prompts": PROMPTS, "Category": CATS}).to_csv(path, index=False)  # DrawBench's columns
    elif fmt == "parquet":
        pd.DataFrame({"caption": PROMPTS, "style": CATS}).to_parquet(path)  # Pick-a-Pic / HPDv2 style names
    return path


@pytest.mark.parametrize("fmt", ["txt", "json", "jsonl", "csv", "parquet"])
def test_local_formats(tmp_path, fmt):
    ps = load_prompts(str(write(tmp_path, fmt)))
    assert ps.prompts == ["a red circle on the left", "a photo of a cat", "an owl, oil painting"]  # deduped
    assert ps.name == "prompts"
    if fmt == "txt":
        assert ps.categories is None
    else:
        assert ps.categories == ["shapes", "photo", "paintings"]
    raw, _ = read_prompt_file(str(write(tmp_path, fmt)))
    assert raw == PROMPTS


def test_json_variants_and_limit(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(PROMPTS))
    (tmp_path / "b.json").write_text(json.dumps({"prompts": PROMPTS}))
    for f in ("a.json", "b.json"):
        assert load_prompts(str(tmp_path / f), dedupe=False).prompts == PROMPTS
    assert load_prompts(str(tmp_path / "a.json"), limit=2).prompts == PROMPTS[:2]
    assert len(load_prompts(str(tmp_path / "a.json"), dedupe=False, limit=3)) == 3


def test_shard_is_a_partition(tmp_path):
    ps = load_prompts(str(write(tmp_path, "json")), dedupe=False)
    shards = [ps.shard(r, 2) for r in range(2)]
    assert sorted(shards[0].prompts + shards[1].prompts) == sorted(PROMPTS)
    assert shards[1].categories == CATS[1::2]


def test_errors(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"nope": 1}]))
    with pytest.raises(ValueError, match="prompt columns"):
        load_prompts(str(tmp_path / "bad.json"))
    with pytest.raises(WeightsUnavailableError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="neither a file nor one of"):
        load_prompts("not-a-dataset")
    (tmp_path / "x.yaml").write_text("a")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts(str(tmp_path / "x.yaml"))
    with pytest.raises(ValueError, match="limit"):
        load_prompts("pickapic")


@pytest.mark.parametrize("name", sorted(PROMPT_DATASETS))
def test_hub_sets_fail_fast_offline(monkeypatch, tmp_path, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match=PROMPT_DATASETS[name].repo):
        load_prompts(name, limit=10)

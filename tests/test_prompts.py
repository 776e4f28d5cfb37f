"""Prompt datasets from local files in every supported format, and a fast clear error for hub sets offline;
Flow-GRPO's Pick-a-Pic caption split from a copy of its repository's layout (a tiny fixture here), fetched once
when online (a fake network here), refused when it is another file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from jagg.errors import WeightsUnavailableError
from jagg.scale import prompts as prompt_sets
from jagg.scale.prompts import PROMPT_DATASETS, RepoFileSource, load_prompts, read_prompt_file

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
    monkeypatch.setenv("JAGG_PROMPTS_DIR", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match=PROMPT_DATASETS[name].repo):
        load_prompts(name, limit=10)


# --------------------------------------------------------------------------- Flow-GRPO's caption split
FIXTURE = Path(__file__).parent / "fixtures" / "flow_grpo"  # yifan123/flow_grpo/dataset/pickscore/*.txt
SPLITS = {"pickscore_flowgrpo_train": "train", "pickscore_flowgrpo_test": "test"}


def fixture_file(split: str) -> Path:
    return FIXTURE / "yifan123" / "flow_grpo" / "dataset" / "pickscore" / f"{split}.txt"


def as_fixture(monkeypatch, name: str) -> list[str]:
    """Register ``name`` with the fixture's SHA-256 and length (the real file's are pinned below); its lines."""
    path = fixture_file(SPLITS[name])
    lines = path.read_text(encoding="utf-8").splitlines()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    fixture = dataclasses.replace(PROMPT_DATASETS[name], sha256=digest, lines=len(lines))
    monkeypatch.setitem(PROMPT_DATASETS, name, fixture)
    return lines


def no_network(*_, **__):
    raise AssertionError("the network was used")


def test_flow_grpo_split_is_pinned():
    for name, split in SPLITS.items():
        src = PROMPT_DATASETS[name]
        assert isinstance(src, RepoFileSource) and src.repo == "yifan123/flow_grpo"
        assert src.commit.startswith("ac4c86e") and src.path == f"dataset/pickscore/{split}.txt"
        assert src.url == f"https://raw.githubusercontent.com/yifan123/flow_grpo/{src.commit}/{src.path}"
    assert (
        PROMPT_DATASETS["pickscore_flowgrpo_train"].lines,
        PROMPT_DATASETS["pickscore_flowgrpo_test"].lines,
    ) == (
        25_432,
        2_048,
    )


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_flow_grpo_split_reads_a_local_copy_of_the_repository_layout(monkeypatch, name):
    monkeypatch.setenv("JAGG_PROMPTS_DIR", str(FIXTURE))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local copy needs no network
    monkeypatch.setattr("urllib.request.urlopen", no_network)
    lines = as_fixture(monkeypatch, name)
    ps = load_prompts(name)
    assert ps.name == name and ps.prompts == lines and len(set(lines)) == len(lines) == 3
    assert load_prompts(name, limit=2).prompts == lines[:2]


def test_flow_grpo_split_fails_fast_offline_naming_the_ways_to_provide_it(monkeypatch, tmp_path):
    monkeypatch.setenv("JAGG_PROMPTS_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("urllib.request.urlopen", no_network)
    monkeypatch.setattr(prompt_sets, "_github_reachable", no_network)
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE is set") as err:
        load_prompts("pickscore_flowgrpo_train")
    msg = str(err.value)
    assert "\n" not in msg and "yifan123/flow_grpo@ac4c86e:dataset/pickscore/train.txt" in msg
    target = tmp_path / "yifan123" / "flow_grpo" / "dataset" / "pickscore" / "train.txt"
    assert str(target) in msg and "JAGG_PROMPTS_DIR" in msg and "data.train_prompts" in msg
    assert not target.exists()


def test_flow_grpo_split_is_fetched_once_and_checked(monkeypatch, tmp_path):
    """Online (a fake GitHub serving the fixture): fetched into JAGG_PROMPTS_DIR, read from there afterwards;
    a download or a copy with other bytes is refused, and nothing half-written is left."""
    import io

    monkeypatch.setenv("JAGG_PROMPTS_DIR", str(tmp_path))
    monkeypatch.setattr(prompt_sets, "hub_offline", lambda: False)  # the tests run offline
    monkeypatch.setattr(prompt_sets, "_github_reachable", lambda: True)
    lines = as_fixture(monkeypatch, "pickscore_flowgrpo_test")
    src = PROMPT_DATASETS["pickscore_flowgrpo_test"]
    served = {"body": fixture_file("test").read_bytes(), "urls": []}

    def urlopen(url, timeout):
        served["urls"].append(url)
        return io.BytesIO(served["body"])

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    assert load_prompts("pickscore_flowgrpo_test").prompts == lines
    assert load_prompts("pickscore_flowgrpo_test").prompts == lines
    assert served["urls"] == [src.url]  # once
    target = Path(src.local_path(str(tmp_path)))
    target.write_text("another caption\n", encoding="utf-8")
    with pytest.raises(WeightsUnavailableError, match="is not yifan123/flow_grpo@ac4c86e"):
        load_prompts("pickscore_flowgrpo_test")
    target.unlink()
    served["body"] = b"tampered\n"
    with pytest.raises(WeightsUnavailableError, match="does not have SHA-256"):
        load_prompts("pickscore_flowgrpo_test")
    assert list(target.parent.iterdir()) == []


def test_flow_grpo_split_refuses_the_fixture_as_the_real_file(monkeypatch):
    monkeypatch.setenv("JAGG_PROMPTS_DIR", str(FIXTURE))
    with pytest.raises(WeightsUnavailableError, match=r"SHA-256 48b75ff9f98a\.\.\., expected 2f425adcbb9a"):
        load_prompts("pickscore_flowgrpo_train")

"""``python -m jagg.scale.weights_check``: tiny saved checkpoints of the real classes pass; one deliberately broken
checkpoint per model kind (a key removed, a key added, a shape changed, at keys drawn at random) fails, naming
the file and each key; truncated files, shards missing from an index and absent models fail; nothing is
downloaded (the hub is offline in the tests)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from jagg.config import load_config
from jagg.scale.weights_check import Spec, check_model, check_weights, main, model_specs

FLUX, QWEN = "configs/paper/flux_dancegrpo.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml"
MIX = "configs/paper/flux_mixgrpo.yaml"  # hpsv2 + imagereward + pickscore


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Tiny Flux / Qwen-Image pipelines, an HPSv2-style .pt (DDP prefix, nested) and a CLIPModel folder."""
    import open_clip

    from test_pretrained_pipeline import save_flux_pipeline, save_qwenimage_pipeline
    from test_rewards_real import TINY_OPEN_CLIP, tiny_hf_clip, tiny_open_clip

    root = tmp_path_factory.mktemp("weights")
    save_flux_pipeline(root / "flux")
    save_qwenimage_pipeline(root / "qwen")
    tiny_hf_clip(seed=3).save_pretrained(root / "clip")
    sd = {f"module.{k}": v for k, v in tiny_open_clip().state_dict().items()}
    (root / "hps").mkdir()
    torch.save({"state_dict": sd, "epoch": 1}, root / "hps" / "HPS_v2.1_compressed.pt")
    (root / "tiny-hps.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(root / "tiny-hps.json")
    save_imagereward(root / "imagereward")
    save_hpsv3(root / "hpsv3")
    return root


def save_imagereward(folder: Path) -> None:
    """ImageReward.pt in the authors' key layout (with the BLIP weights the score drops) + med_config.json."""
    from test_imagereward import TINY_MED, WORDS, reference_layout, tiny_model

    folder.mkdir()
    torch.save(reference_layout(tiny_model(seed=4)), folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps({**TINY_MED, "vocab_size": len(WORDS) + 2}))


def save_hpsv3(folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """HPSv3.safetensors in the layout saved before transformers 4.52, the model in ``dtype`` and the head in
    float32 as HPSv3 stores them, and the Qwen2-VL base's config and processor (without ``<|Reward|>``)."""
    from safetensors.torch import save_file

    from test_hpsv3 import tiny, tiny_processor

    model, _, config = tiny(seed=5)
    model.to(dtype).rm_head.float()
    config.save_pretrained(folder / "base")
    tiny_processor().save_pretrained(folder / "base")
    legacy = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(legacy, folder / "HPSv3.safetensors")


def _overrides(root: Path, pipeline: str) -> list[str]:
    return [
        f"model.path={root / pipeline}",
        f"reward.kwargs.hpsv2.checkpoint={root / 'hps'}",
        "reward.kwargs.hpsv2.arch=tiny-hps",
        f"reward.kwargs.pickscore.model={root / 'clip'}",
        f"reward.kwargs.clipscore.model={root / 'clip'}",
    ]


def _reward_overrides(root: Path) -> list[str]:
    """MixGRPO's config (HPSv2.1, ImageReward, PickScore) evaluated with CLIPScore, HPSv3 and JPEG too."""
    from test_imagereward import TINY_VIT

    return [
        *_overrides(root, "flux"),
        "reward.eval=[hpsv2, pickscore, clipscore, hpsv3, jpeg_incompressibility]",
        f"reward.kwargs.imagereward.checkpoint={root / 'imagereward'}",
        # floats as YAML reads them (PyYAML takes 1e-06 for a string)
        f"reward.kwargs.imagereward.vision={json.dumps(TINY_VIT).replace('1e-06', '1.0e-06')}",
        f"reward.kwargs.hpsv3.checkpoint={root / 'hpsv3' / 'HPSv3.safetensors'}",
        f"reward.kwargs.hpsv3.base={root / 'hpsv3' / 'base'}",
    ]


def test_specs_cover_every_model_of_a_config():
    whats = [s.what for s in model_specs(load_config(FLUX))]
    assert whats[:4] == ["flux transformer", "flux text_encoder", "flux text_encoder_2", "flux vae"]
    assert set(whats[4:]) == {"hpsv2 reward", "pickscore reward", "clipscore reward"}
    qwen = [s.what for s in model_specs(load_config(QWEN))]
    assert qwen[:3] == ["qwenimage transformer", "qwenimage text_encoder", "qwenimage vae"]
    hps = next(s for s in model_specs(load_config(FLUX)) if s.what == "hpsv2 reward")
    assert (hps.source, hps.filename, hps.arch) == ("xswu/HPSv2", "HPS_v2.1_compressed.pt", "ViT-H-14")


def test_specs_cover_every_reward_and_name_what_is_not_checked():
    """ImageReward and HPSv3 are checked like the others (from their constructors' defaults: hub id, file,
    dtype); a reward without files is a spec that says why it is not checked."""
    cfg = load_config(MIX, ["reward.eval=[hpsv3, jpeg, attr_judge]"])
    specs = {s.what: s for s in model_specs(cfg)}
    assert {"hpsv2 reward", "imagereward reward", "pickscore reward", "hpsv3 reward"} <= set(specs)
    ir, h3 = specs["imagereward reward"], specs["hpsv3 reward"]
    assert (ir.source, ir.filename, ir.extra["med_config"], ir.dtype) == (
        "THUDM/ImageReward",
        "ImageReward.pt",
        "med_config.json",
        torch.float32,
    )
    assert (h3.source, h3.filename, h3.extra["base"], h3.dtype) == (
        "MizzenAI/HPSv3",
        "HPSv3.safetensors",
        "Qwen/Qwen2-VL-7B-Instruct",
        torch.bfloat16,  # HPSv3's default, as the reward builds it
    )
    assert specs["jpeg reward"].skip.startswith("no weights")
    assert "embedded world" in specs["attr_judge reward"].skip
    assert not any(s.skip for s in specs.values() if s.library)
    report = check_model(specs["jpeg reward"])
    assert not report.ok and report.lines()[0].split()[:3] == ["not", "checked", "jpeg"]


def test_every_registered_reward_is_checked_or_says_why_not():
    """A reward added to the registry without a rule here is still listed (as having no rule), but the known
    ones are each either checked or named with their reason; the dtype names are the loop's."""
    from jagg.loop.rewards import REWARD_DTYPES
    from jagg.rewards import REWARDS
    from jagg.scale.weights_check import DTYPE_NAMES, NOT_CHECKED, REWARD_RULES

    assert set(REWARDS) == set(REWARD_RULES) | set(NOT_CHECKED) and not set(REWARD_RULES) & set(NOT_CHECKED)
    assert DTYPE_NAMES == REWARD_DTYPES
    cfg = load_config(MIX)
    cfg.reward.eval = [*cfg.reward.eval, "someone_elses"]
    spec = model_specs(cfg)[-1]
    assert (spec.what, spec.skip) == (
        "someone_elses reward",
        "the weights check has no rule for this reward's files",
    )


def test_rewards_pass_and_unchecked_are_listed(saved, capsys):
    """Every reward of the config, each through its own loader's rules (ImageReward's renamed ViT keys and the
    BLIP weights it drops, HPSv3's pre-4.52 key layout and processor vocabulary), and the JPEG reward listed as
    not checked; exit 0."""
    reports = {r.spec.what: r for r in check_weights(load_config(MIX, _reward_overrides(saved)))}
    checked = {w: r for w, r in reports.items() if not r.skipped}
    assert set(checked) == {
        *(f"flux {p}" for p in ("transformer", "text_encoder", "text_encoder_2", "vae")),
        *(f"{r} reward" for r in ("hpsv2", "imagereward", "pickscore", "clipscore", "hpsv3")),
    }
    assert all(r.ok for r in checked.values()), "\n".join(
        line for r in reports.values() for line in r.lines()
    )
    assert reports["jpeg_incompressibility reward"].skipped.startswith("no weights")
    h3 = reports["hpsv3 reward"]
    assert (h3.stored, h3.built, h3.notes) == ({"bf16", "fp32"}, {"bf16", "fp32"}, [])  # the head in fp32
    assert main(["--config", MIX, *_reward_overrides(saved)]) == 0
    out = capsys.readouterr().out
    assert "9 of 9 models ok; not checked: jpeg_incompressibility reward" in out
    assert re.search(r"not checked +jpeg_incompressibility reward +no weights", out)


REWARD_KINDS = {  # reward -> (folder of `saved`, weights file, a key of that file, the Spec's overrides)
    "imagereward": ("imagereward", "ImageReward.pt", "blip.text_encoder.encoder.layer.0.output.dense.weight"),
    "hpsv3": ("hpsv3", "HPSv3.safetensors", "model.layers.0.mlp.up_proj.weight"),
}


def _reward_spec(saved: Path, name: str, root: Path) -> Spec:
    spec = next(s for s in model_specs(load_config(MIX, _reward_overrides(saved))) if s.what.startswith(name))
    extra = dict(spec.extra, base=str(saved / "hpsv3" / "base")) if name == "hpsv3" else spec.extra
    source = root / "HPSv3.safetensors" if name == "hpsv3" else root
    return dataclasses.replace(spec, source=str(source), extra=extra)


@pytest.mark.parametrize("name", list(REWARD_KINDS))
def test_broken_reward_checkpoint_names_file_and_keys(saved, tmp_path, name):
    """A weight removed, one reshaped, a ViT key ImageReward has no rule for (its loader raises) / a key HPSv3's
    model lacks: each named with the file."""
    from safetensors.torch import load_file, save_file

    folder, filename, reshaped = REWARD_KINDS[name]
    root = tmp_path / folder
    shutil.copytree(saved / folder, root)
    path = root / filename
    sd = torch.load(path, weights_only=True) if name == "imagereward" else load_file(path)
    removed = "mlp.layers.4.weight" if name == "imagereward" else "rm_head.3.weight"
    del sd[removed]
    sd[reshaped] = torch.cat([sd[reshaped], sd[reshaped][:1]])
    extra = "blip.visual_encoder.head.weight" if name == "imagereward" else "model.extra.weight"
    sd[extra] = torch.zeros(3)
    torch.save(sd, path) if name == "imagereward" else save_file(sd, path)
    report = check_model(_reward_spec(saved, name, root))
    assert not report.ok and list(report.files) == [filename]
    p = report.files[filename]
    model_key = {"mlp.layers.4.weight": "mlp.4.weight"}.get(removed, removed)
    assert (p.missing, p.unexpected) == ([model_key], [extra])
    assert len(p.mis_shaped) == 1 and p.mis_shaped[0].startswith(f"{reshaped}: file (")
    assert check_model(_reward_spec(saved, name, saved / folder)).ok  # the intact copy


def test_dtypes_compared(saved, tmp_path):
    """The stored dtype against the built one: fp32 files built in bf16 (the configured cast) pass silently;
    bf16 files built in fp32 keep bf16's precision, fp32 files cast to fp16 overflow past 65504 (notes, not
    failures); a floating weight stored as integers fails."""
    from safetensors.torch import load_file, save_file

    fp32 = load_config(FLUX, [*_overrides(saved, "flux"), "train.precision=fp32"])
    spec = next(s for s in model_specs(fp32) if s.subfolder == "vae")
    assert spec.dtype == torch.float32
    report = check_model(dataclasses.replace(spec, dtype=torch.bfloat16))
    assert report.ok and (report.stored, report.built, report.notes) == ({"fp32"}, {"bf16"}, [])
    root = tmp_path / "vae"
    shutil.copytree(saved / "flux" / "vae", root)
    path = root / "diffusion_pytorch_model.safetensors"
    sd = load_file(path)
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, path)
    report = check_model(dataclasses.replace(spec, source=str(root)))
    assert report.ok and report.stored == {"bf16"} and report.built == {"fp32"}
    assert len(report.notes) == 1 and f"{len(sd)} tensors stored bf16 are built fp32" in report.notes[0]
    assert "keep bf16's precision" in report.notes[0] and "note: " in "\n".join(report.lines())
    save_file(sd, path)
    report = check_model(dataclasses.replace(spec, source=str(root), dtype=torch.float16))
    assert report.ok and len(report.notes) == 1 and "values past 65504 become inf" in report.notes[0]
    key = sorted(sd)[0]
    save_file({**sd, key: sd[key].to(torch.int8)}, path)
    report = check_model(dataclasses.replace(spec, source=str(root)))
    assert not report.ok and report.files[path.name].mis_typed == [f"{key}: file int8 vs model fp32"]


def test_reward_dtype_from_kwargs(saved):
    """``reward.kwargs.<name>.dtype`` by name is the dtype the reward is built in, as jagg.loop.rewards does; the
    heads stay float32."""
    overrides = [
        *_reward_overrides(saved),
        "reward.kwargs.hpsv3.dtype=fp32",
        "reward.kwargs.hpsv2.dtype=bf16",
    ]
    specs = {s.what: s for s in model_specs(load_config(MIX, overrides))}
    assert specs["hpsv3 reward"].dtype == torch.float32 and specs["hpsv2 reward"].dtype == torch.bfloat16
    h3 = check_model(specs["hpsv3 reward"])
    assert h3.ok and h3.built == {"fp32"} and "keep bf16's precision" in h3.notes[0]
    ir = check_model(specs["imagereward reward"])
    assert ir.ok and ir.built == {"fp32"}


def test_local_path_hints_do_not_suggest_hf_download(saved, tmp_path):
    """A local path that is missing or incomplete gets what to fix there and the key that points at it; only a
    hub id gets `hf download <id>`."""
    from jagg.scale.hub import unavailable_message

    assert "hf download" not in unavailable_message("x", "/data/flux", "local path does not exist")
    assert "`hf download owner/name`" in unavailable_message("x", "owner/name", "not cached")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "absent", tmp_path / "empty"):
        cfg = load_config(FLUX, [*_overrides(saved, "flux"), f"model.path={path}"])
        report = check_model(model_specs(cfg)[0])
        assert not report.ok and "hf download" not in report.error, report.error
        assert str(path) in report.error and "model.path points at it" in report.error
    cfg = load_config(MIX, [*_reward_overrides(saved), f"reward.kwargs.imagereward.checkpoint={tmp_path}"])
    report = check_model(next(s for s in model_specs(cfg) if s.what == "imagereward reward"))
    assert "ImageReward.pt missing" in report.error and "hf download" not in report.error
    assert "reward.kwargs.imagereward.checkpoint points at it" in report.error


def test_single_file_checkpoint_is_named(saved, tmp_path):
    """``model.path`` at an original-format file, or at a folder holding only one (a partial download of the
    hub repo), is named as a single-file checkpoint, not as a folder without transformer/."""
    from safetensors.torch import save_file

    single = tmp_path / "repo" / "flux1-dev.safetensors"
    single.parent.mkdir()
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, single)
    for path in (single, single.parent):
        cfg = load_config(FLUX, [*_overrides(saved, "flux"), f"model.path={path}"])
        report = check_model(model_specs(cfg)[0])
        assert not report.ok and "single-file (original-format) checkpoint" in report.error, report.error
        assert "flux1-dev.safetensors" in report.error and "no transformer/ folder" in report.error


@pytest.mark.parametrize(("config", "pipeline"), [(FLUX, "flux"), (QWEN, "qwen")])
def test_intact_checkpoints_pass(saved, config, pipeline):
    reports = check_weights(load_config(config, _overrides(saved, pipeline)))
    assert len(reports) == (7 if pipeline == "flux" else 6)
    assert all(r.ok for r in reports), "\n".join(line for r in reports for line in r.lines())
    # Qwen2.5-VL is saved as "model.layers..." and built as "model.language_model.layers...": transformers' own
    # renaming is applied; T5's tied encoder.embed_tokens is absent from its file and allowed to be
    assert all(r.tensors > 0 for r in reports)


def _break(path: Path, seed: int, nested: bool = False) -> tuple[str, str]:
    """Remove one key, reshape another, add ``bogus.weight``; returns (removed as the model names it, reshaped
    as the file names it)."""
    from safetensors.torch import load_file, save_file

    obj = torch.load(path, weights_only=True) if nested else load_file(path)
    sd = obj["state_dict"] if nested else obj
    keys = sorted(k for k, v in sd.items() if v.ndim >= 1)
    removed, reshaped = random.Random(seed).sample(keys, 2)
    del sd[removed]
    sd[reshaped] = torch.cat([sd[reshaped], sd[reshaped][:1]])  # one more row
    sd["bogus.weight"] = torch.zeros(3)
    torch.save(obj, path) if nested else save_file(sd, path, metadata={"format": "pt"})
    return removed.removeprefix("module."), reshaped


KINDS = {  # model kind -> (pipeline or reward folder, Spec of check_model, weights file inside it)
    "flux transformer": ("flux", "transformer", "diffusion_pytorch_model.safetensors"),
    "CLIP-L text encoder": ("flux", "text_encoder", "model.safetensors"),
    "T5 text encoder": ("flux", "text_encoder_2", "model.safetensors"),
    "Flux VAE": ("flux", "vae", "diffusion_pytorch_model.safetensors"),
    "qwenimage transformer": ("qwen", "transformer", "diffusion_pytorch_model.safetensors"),
    "Qwen2.5-VL text encoder": ("qwen", "text_encoder", "model.safetensors"),
    "Qwen-Image VAE": ("qwen", "vae", "diffusion_pytorch_model.safetensors"),
    "HPSv2.1 (open_clip .pt)": ("hps", None, "HPS_v2.1_compressed.pt"),
    "PickScore / CLIPScore (CLIPModel)": ("clip", None, "model.safetensors"),
}


def _spec(saved: Path, kind: str, root: Path) -> Spec:
    folder, sub, _ = KINDS[kind]
    if folder == "hps":
        return Spec(kind, str(root), None, "open_clip", filename=KINDS[kind][2], arch="tiny-hps")
    if folder == "clip":
        from transformers import CLIPModel

        return Spec(kind, str(root), None, "transformers", CLIPModel)
    backbone = "flux" if folder == "flux" else "qwenimage"
    spec = next(s for s in model_specs(load_config(FLUX if folder == "flux" else QWEN)) if s.subfolder == sub)
    assert spec.what.startswith(backbone)
    return Spec(kind, str(root), sub, spec.library, spec.cls)


@pytest.mark.parametrize("kind", list(KINDS))
def test_broken_checkpoint_names_file_and_keys(saved, tmp_path, kind):
    folder, sub, filename = KINDS[kind]
    root = tmp_path / folder
    shutil.copytree(saved / folder, root)
    path = root / (sub or "") / filename
    removed, reshaped = _break(path, seed=len(kind), nested=folder == "hps")
    report = check_model(_spec(saved, kind, root))
    assert not report.ok and list(report.files) == [filename]
    p = report.files[filename]
    assert p.unexpected == ["bogus.weight"]
    # a renamed key (Qwen2.5-VL) is reported under the model's name: compare the leaf
    leaf = lambda k: ".".join(k.split(".")[-3:])  # noqa: E731
    assert [leaf(k) for k in p.missing] == [leaf(removed)]
    assert len(p.mis_shaped) == 1 and p.mis_shaped[0].startswith(f"{reshaped}: file (")
    text = "\n".join(report.lines())
    assert "FAILED" in text and filename in text and "bogus.weight" in text and reshaped in text


def test_truncated_and_sharded(saved, tmp_path):
    from transformers import T5EncoderModel

    src = saved / "flux" / "text_encoder_2"
    sharded = tmp_path / "t5"
    T5EncoderModel.from_pretrained(src).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (sharded / "model.safetensors.index.json").is_file()
    spec = Spec("t5", str(sharded), None, "transformers", T5EncoderModel)
    assert check_model(spec).ok
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) // 2])  # a copy cut short
    report = check_model(spec)
    assert not report.ok and "truncated" in report.files[shards[-1].name].broken
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    lost = [k for k, f in index["weight_map"].items() if f == shards[-1].name]
    assert sorted(report.files[shards[-1].name].missing) == sorted(
        lost
    )  # attributed to the file named for them
    shards[-1].unlink()
    assert "missing on disk" in check_model(spec).files[shards[-1].name].broken


def test_cli_exit_codes(saved, capsys):
    assert main(["--config", FLUX, *_overrides(saved, "flux")]) == 0
    assert "7 of 7 models ok" in capsys.readouterr().out
    # a hub id not in the cache (tests run offline): not available, nothing downloaded
    assert main(["--config", FLUX, *_overrides(saved, "flux"), "model.path=nobody/not-a-model"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAILED +flux transformer", out) and "not in the local hub cache" in out
    assert main(["--config", "configs/world/flux_dancegrpo.yaml"]) == 2
    assert "model.source=pretrained" in capsys.readouterr().err


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> int:
    """A safetensors file of real size whose tensor bytes are a hole (a sparse file: nothing written, nothing on
    disk): the header is all the check reads. Returns the apparent size."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())  # bf16
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    return 8 + len(blob) + offset


def test_real_size_in_seconds_without_reading_weights(tmp_path):
    """FLUX.1-dev's transformer (11.9B) and Qwen2.5-VL-7B (8.3B) at their published sizes: built on the meta
    device, checked against real-size files whose weights were never written, in seconds and without the
    process's memory growing by anything like their size (23 + 16 GB in bf16)."""
    import resource
    import time

    from diffusers import FluxTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from jagg.scale.architectures import KNOWN_CONFIGS, QWEN25_VL_7B

    root = tmp_path / "pipeline"
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "config.json").write_text(
        json.dumps(dict(KNOWN_CONFIGS["flux"], _class_name="FluxTransformer2DModel"))
    )
    Qwen2_5_VLConfig(**QWEN25_VL_7B).save_pretrained(root / "text_encoder")
    specs = [
        Spec("flux transformer", str(root), "transformer", "diffusers", FluxTransformer2DModel),
        Spec(
            "qwen text encoder", str(root), "text_encoder", "transformers", Qwen2_5_VLForConditionalGeneration
        ),
    ]
    from jagg.scale.weights_check import meta_model

    sizes = []
    for spec, name in zip(specs, ("diffusion_pytorch_model.safetensors", "model.safetensors")):
        model = meta_model(spec, root / spec.subfolder)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        sizes.append(_sparse_safetensors(root / spec.subfolder / name, shapes))
    assert sizes[0] > 20e9 and sizes[1] > 15e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    reports = [check_model(spec) for spec in specs]
    seconds = time.perf_counter() - start
    assert all(r.ok for r in reports), "\n".join(line for r in reports for line in r.lines())
    assert reports[0].parameters > 11e9 and reports[1].parameters > 8e9
    assert seconds < 120
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss < 2e9

"""``python -m jagg.scale.weights_check``: tiny saved checkpoints of the real classes pass; one deliberately broken
checkpoint per model kind (a key removed, a key added, a shape changed, at keys drawn at random) fails, naming
the file and each key; truncated files, shards missing from an index and absent models fail; nothing is
downloaded (the hub is offline in the tests)."""

from __future__ import annotations

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
    return root


def _overrides(root: Path, pipeline: str) -> list[str]:
    return [
        f"model.path={root / pipeline}",
        f"reward.kwargs.hpsv2.checkpoint={root / 'hps'}",
        "reward.kwargs.hpsv2.arch=tiny-hps",
        f"reward.kwargs.pickscore.model={root / 'clip'}",
        f"reward.kwargs.clipscore.model={root / 'clip'}",
    ]


def test_specs_cover_every_model_of_a_config():
    whats = [s.what for s in model_specs(load_config(FLUX))]
    assert whats[:4] == ["flux transformer", "flux text_encoder", "flux text_encoder_2", "flux vae"]
    assert set(whats[4:]) == {"hpsv2 reward", "pickscore reward", "clipscore reward"}
    qwen = [s.what for s in model_specs(load_config(QWEN))]
    assert qwen[:3] == ["qwenimage transformer", "qwenimage text_encoder", "qwenimage vae"]
    hps = next(s for s in model_specs(load_config(FLUX)) if s.what == "hpsv2 reward")
    assert (hps.source, hps.filename, hps.arch) == ("xswu/HPSv2", "HPS_v2.1_compressed.pt", "ViT-H-14")


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

"""The CLI's checks before the heavy imports: names, the device, the run directory, a resumed run's config.

``python -m jagg.train`` runs these right after ``jagg.config.load_config``, before diffusers, the world or
the real-model path are imported and before anything is written, so a typo costs a second, not a model load:

    check_reward_names   reward.weights / reward.eval against the names ``jagg.loop.rewards`` registers
                         (``REWARD_NAMES``, a static copy; a test checks it equals the registry)
    check_prompt_sets    data.train_prompts / data.eval_prompts: a readable file with a prompt, or a name in
                         ``PROMPT_DATASETS`` (a pinned repository's file, such as Flow-GRPO's caption split,
                         is found or fetched here, or the run stops before any weight loads)
    check_device         train.device=cuda needs a CUDA device (one per local rank under torchrun)
    check_trackers       every tracker in log.report_to is installed
    start_run_dir        fresh / resume / resume-if-checkpoint (never over metrics or an incomplete checkpoint),
                         what --overwrite may delete, and a resumed run's config against run.json and the
                         checkpoint's own (progress.pt); changes the checkpoint cannot take are refused

Every failure is a ``ConfigError`` naming the key (the CLI prints it as one line, exit status 2).
"""

from __future__ import annotations

import difflib
import errno
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from jagg.config import RENAMED_KEYS, Config, json_safe, known_keys, stored_config
from jagg.errors import ConfigError, WeightsUnavailableError
from jagg.ops.checkpoint import checkpoint_candidates, find_checkpoint, incomplete_message
from jagg.ops.rundir import MARKER, check_overwrite, entries, is_run_dir

# The rewards ``jagg.loop.rewards`` registers (jpeg, world, real models); tests/test_cli.py checks they agree.
REWARD_NAMES = (
    "attr",
    "attr_geom",
    "attr_judge",
    "attr_soft",
    "clip",
    "clipscore",
    "frames_attr",
    "frames_attr_soft",
    "frames_clip",
    "frames_pref",
    "hpsv2",
    "hpsv3",
    "imagereward",
    "jpeg",
    "jpeg_incompressibility",
    "motion_geom",
    "per_frame",
    "pickscore",
    "pref",
    "render_match",
    "temporal",
    "video_geom",
    "video_pref",
)
REWARD_DTYPE_NAMES = ("bf16", "fp16", "fp32")  # reward.kwargs.<name>.dtype (jagg.loop.rewards.REWARD_DTYPES)
# Keys a resumed run may change without --allow-config-change: iteration `it` depends only on (seed, it) and
# the restored state, so a longer run continues the shorter one exactly.
# log.report_to only adds where the same rows go; log.run_dir is where the directory is now (moved or copied);
# log.async_checkpoint changes when a checkpoint is written, not what it holds.
RESUMABLE_KEYS = ("train.iterations", "log.report_to", "log.run_dir", "log.async_checkpoint")
# Keys even --allow-config-change cannot change on resume (nor optim.ema_decay between 0 and > 0: the EMA is
# there or not): the checkpoint's tensors are laid out for the old value (the backbone and its source: the
# architecture; LoRA's rank and targets: which parameters are trained, of what shape). The optimizer's
# hyperparameters can change: jagg.loop.trainer applies them to the restored optimizer.
FIXED_ON_RESUME = ("model.backbone", "model.source", "model.lora_rank", "model.lora_targets")


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_reward_names(cfg: Config, known: Iterable[str] = REWARD_NAMES) -> None:
    """``ConfigError`` naming the key when ``reward.weights`` / ``reward.eval`` names a reward not in ``known``,
    or a ``reward.kwargs.<name>.dtype`` is not a dtype name."""
    known = sorted(known)
    for key, names in (("reward.weights", list(cfg.reward.weights)), ("reward.eval", cfg.reward.eval)):
        unknown = [n for n in names if n not in known]
        if unknown:
            hint = _did_you_mean(unknown[0], known)
            raise ConfigError(f"{key}: unknown reward {unknown[0]!r}{hint}; known: {known}")
    for name, kwargs in cfg.reward.kwargs.items():
        dtype = kwargs.get("dtype") if isinstance(kwargs, dict) else None
        if dtype is not None and dtype not in REWARD_DTYPE_NAMES:
            raise ConfigError(
                f"reward.kwargs.{name}.dtype must be one of {list(REWARD_DTYPE_NAMES)}, got {dtype!r}"
            )


def check_prompt_sets(cfg: Config, *, fetch: bool = True) -> None:
    """With model.source=pretrained, each prompt source is an existing file or a known prompt set; a pinned
    repository's file is also found or fetched (``fetch``; not in a dry run, which reads and writes nothing)."""
    if cfg.model.source != "pretrained":
        return
    # no model code: the names, their sources, and the files of a pinned repository
    from jagg.scale.prompts import PROMPT_DATASETS, RepoFileSource, repo_file

    for key in ("train_prompts", "eval_prompts"):
        source = getattr(cfg.data, key)
        if Path(source).expanduser().is_file():
            _check_prompt_file(f"data.{key}", str(Path(source).expanduser()))
            continue
        if fetch and isinstance(PROMPT_DATASETS.get(source), RepoFileSource):
            try:  # a few MB: found, fetched or refused before the weights
                repo_file(source, PROMPT_DATASETS[source])
            except WeightsUnavailableError as err:
                raise ConfigError(f"data.{key}: {err}") from None
            continue
        if source in PROMPT_DATASETS:
            continue
        hint = _did_you_mean(source, PROMPT_DATASETS)
        raise ConfigError(
            f"data.{key}: {source!r} is neither a file nor a prompt set{hint}; "
            f"prompt sets: {sorted(PROMPT_DATASETS)}"
        )


def _check_prompt_file(key: str, path: str) -> None:
    """The file parses and holds a non-blank prompt (read now, not after minutes of loading weights)."""
    from jagg.scale.prompts import read_prompt_file

    try:
        prompts, _ = read_prompt_file(path)
    except (OSError, ValueError, KeyError, TypeError) as err:  # JSON / CSV / encoding errors are ValueErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{key}: prompt file {path} cannot be read ({first})") from None
    if not any(isinstance(p, str) and p.strip() for p in prompts):
        raise ConfigError(f"{key}: prompt file {path} holds no prompt (it is empty or blank)")


def check_trackers(cfg: Config) -> None:
    """Every tracker in log.report_to is installed (``jagg.ops.trackers`` imports it only when a run starts)."""
    import importlib.util

    for name in cfg.log.report_to:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"log.report_to: {name} is not installed (pip install {name}, or pip install 'jagg[trackers]')"
            )


def check_device(cfg: Config) -> None:
    """train.device=cuda needs CUDA, and under torchrun a device for this process's LOCAL_RANK."""
    if cfg.train.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "train.device=cuda, but no CUDA device is available (torch.cuda.is_available() is False); "
            "use train.device=cpu or train.device=auto"
        )
    local_rank, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"train.device=cuda: LOCAL_RANK={local_rank} but only {count} CUDA device(s)")


def config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Flattened ``{"section.key": (old, new)}`` for every value that differs between two config dicts."""
    out: dict[str, tuple] = {}
    for k in sorted(set(old) | set(new)):
        a, b, key = old.get(k), new.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, key + "."))
        elif a != b:
            out[key] = (a, b)
    return out


@dataclass
class RunStart:
    """How the CLI starts in ``log.run_dir``: resume from its checkpoint or not, remove what is there first or
    not, (on resume) the config keys that differ from run.json's ``{key: (old, new)}``, the metrics rows found
    (those past the checkpoint are dropped and redone) and, for a run preempted before its first checkpoint that
    starts again, the record of it for run.json (``restarts``: the earlier ones, then this one)."""

    resume: bool
    wipe: bool
    changes: dict[str, tuple] = field(default_factory=dict)
    metrics_rows: int = 0
    restarts: list[dict] = field(default_factory=list)
    promoted: int | None = (
        None  # the iteration of a complete save promoted from checkpoint.tmp/ (the CLI sets it)
    )
    dropped: int = (
        0  # metrics rows past the loaded checkpoint (the CLI sets it once the checkpoint has loaded)
    )


def start_run_dir(
    cfg: Config, resume: str | None, overwrite: bool, allow_change: Iterable[str] = ()
) -> RunStart:
    """Decide fresh / resume for ``--resume`` (``"required"``), ``--resume auto`` or neither; reads only (the
    CLI calls it holding the directory's lock, so no other run changes it meanwhile).

    ``auto`` resumes when a checkpoint exists and otherwise starts again from iteration 0 in an empty
    directory or one a preempted attempt left before its first checkpoint (its run.json must match, as on
    resume): nothing is lost there, since metrics rows past the last checkpoint are dropped and redone in every
    case (here all of them; the restart is recorded in run.json's ``restarts``). It never starts over an
    incomplete checkpoint. A resumed config must equal run.json's except ``RESUMABLE_KEYS`` and the keys
    named in ``allow_change`` (``--allow-config-change KEY ...``).
    """
    run_dir = Path(cfg.log.run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: drop one")
    if not resume:
        return _fresh_start(run_dir, overwrite)
    what = "--resume" if resume == "required" else "--resume auto"
    found, checkpoint = checkpoint_candidates(run_dir), find_checkpoint(run_dir)
    if found and checkpoint is None:  # reported as what it is, never taken for "no checkpoint yet"
        raise ConfigError(f"{what}: {incomplete_message(found[0])}")
    if resume == "required" and checkpoint is None:
        raise ConfigError(f"--resume: missing checkpoint {run_dir / 'checkpoint'} (log.run_dir={run_dir})")
    allowed = allowed_keys(allow_change)
    changes = _resumed_config_changes(cfg, run_dir, allowed, what, checkpoint)
    rows = _metrics_rows(run_dir)
    if checkpoint is not None:
        return RunStart(resume=True, wipe=False, changes=changes, metrics_rows=rows)
    restarts = _earlier_restarts(run_dir)
    if rows or restarts or (run_dir / "run.json").is_file():
        restarts.append(
            {"reason": "no checkpoint yet (preempted before the first one)", "metrics_rows_dropped": rows}
        )
    return RunStart(resume=False, wipe=bool(entries(run_dir)), metrics_rows=rows, restarts=restarts)


def _earlier_restarts(run_dir: Path) -> list[dict]:
    """The ``restarts`` an earlier attempt recorded in run.json (a restart replaces run.json and keeps them)."""
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return []
    restarts = meta.get("restarts") if isinstance(meta, dict) else None
    return list(restarts) if isinstance(restarts, list) else []


def _fresh_start(run_dir: Path, overwrite: bool) -> RunStart:
    """Neither resume flag: an empty or new directory, or ``--overwrite`` of a run directory of this project."""
    occupied = bool(entries(run_dir))
    if overwrite:
        check_overwrite(run_dir)
        return RunStart(resume=False, wipe=occupied)
    if occupied and is_run_dir(run_dir):
        raise ConfigError(
            f"log.run_dir={run_dir} already exists; pass --resume to continue or --overwrite to replace"
        )
    if occupied:
        raise ConfigError(
            f"log.run_dir={run_dir} is not empty and not a run directory of this project (no {MARKER} marker, "
            "no run.json of this CLI); choose another log.run_dir"
        )
    return RunStart(resume=False, wipe=False)


def _metrics_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def allowed_keys(names: Iterable[str]) -> frozenset[str]:
    """The keys ``--allow-config-change KEY ...`` names, under their current names; a name that is no config key
    is a ``ConfigError`` (a typo would otherwise allow nothing and be refused as if not given)."""
    known, out = known_keys(), set()
    for name in names:
        key = RENAMED_KEYS.get(name, name)
        if key not in known:
            raise ConfigError(
                f"--allow-config-change: {name!r} is not a config key{_did_you_mean(key, known)}; name the "
                "keys to allow as section.key (e.g. --allow-config-change optim.lr)"
            )
        out.add(key)
    return frozenset(out)


def _resumed_config_changes(
    cfg: Config, run_dir: Path, allowed: frozenset[str], what: str, checkpoint: Path | None
) -> dict[str, tuple]:
    """The keys whose value differs from the config the run was trained with; ``ConfigError`` unless resumable
    (``RESUMABLE_KEYS``) or allowed by name.

    Compared with both records, whatever the other says: run.json's config and the checkpoint's own (its
    progress.pt), so neither a deleted nor an edited run.json hides a change from the weights' config; where
    both differ, run.json's value is reported (it is what a resume records). Both are read as the current code
    reads them (``jagg.config.stored_config``): a run written by an earlier version, which lacks the keys added
    since, compares equal where nothing changed. run.json's config is the first attempt's with every change a
    resume recorded applied; a change so recorded that the checkpoint does not carry yet (the resume stopped
    before its next save) is not asked for again. Without run.json and without a checkpoint there is nothing
    to compare: fine in an empty directory, refused in a non-empty one (not a run directory of this CLI).
    """
    new = json_safe(cfg.to_dict())
    meta_path, progress_path = run_dir / "run.json", checkpoint / "progress.pt" if checkpoint else None
    recorded, changed_before = _run_json_config(meta_path, what)
    trained = _checkpoint_config(checkpoint) if checkpoint is not None else None
    if recorded is None and trained is None:
        if entries(run_dir) and not is_run_dir(run_dir):
            raise ConfigError(
                f"{what}: {meta_path} is missing, so {run_dir} is not a run directory of this CLI"
            )
        return {}
    # run.json's changes are what a resume records; the checkpoint adds the changes run.json does not show
    # (deleted or edited), except the keys a recorded resume changed to the value run.json now holds
    changes = _changes_from(recorded, new, meta_path) if recorded is not None else {}
    for key, change in _changes_from(trained, new, progress_path).items():
        if key in changes or key in changed_before:
            continue
        if recorded is None or key not in RESUMABLE_KEYS:
            changes[key] = change
    _refuse_unresumable(changes, allowed, what)
    return {k: (old, value) for k, (old, value, _) in sorted(changes.items())}


def _changes_from(old: dict | None, new: dict, where: Path) -> dict[str, tuple]:
    """``{key: (old, new, where)}``: ``config_changes`` with the record the old value comes from."""
    return {k: (*change, where) for k, change in config_changes(old or {}, new).items()} if old else {}


def _refuse_unresumable(changes: dict[str, tuple], allowed: frozenset[str], what: str) -> None:
    """``ConfigError`` (one line naming the keys, their values and where the old ones are recorded) for the
    changed keys a resume may not make: those the restored state cannot take (``FIXED_ON_RESUME``), allowed or
    not, then any outside ``RESUMABLE_KEYS`` that --allow-config-change does not name."""

    def shown(keys: list[str]) -> str:
        return ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r} (in {changes[k][2]})" for k in keys)

    fixed = sorted(k for k in changes if _top_key(k) in FIXED_ON_RESUME or _ema_switched(k, changes[k]))
    if fixed:
        raise ConfigError(
            f"{what}: {shown(fixed)} cannot change on resume, even with --allow-config-change (the checkpoint's "
            "tensors are laid out for the old value); start a new run (another log.run_dir) for it"
        )
    refused = sorted(k for k in changes if k not in RESUMABLE_KEYS and _top_key(k) not in allowed)
    if refused:
        names = " ".join(sorted({_top_key(k) for k in refused}))
        raise ConfigError(
            f"{what}: the config differs from the one the run was trained with in {shown(refused)}; "
            f"pass --allow-config-change {names} to continue with the new values"
        )


def _top_key(key: str) -> str:
    """The config key a flattened change belongs to: ``reward.weights.jpeg`` -> ``reward.weights`` (a mapping
    value is one key), else the key itself."""
    known = known_keys()
    while key not in known and "." in key:
        key = key.rsplit(".", 1)[0]
    return key


def _ema_switched(key: str, change: tuple) -> bool:
    """optim.ema_decay turned on or off: the checkpoint holds an EMA or not (a new positive decay applies)."""
    return key == "optim.ema_decay" and (change[0] == 0) != (change[1] == 0)


def _run_json_config(path: Path, what: str) -> tuple[dict | None, set[str]]:
    """run.json's config as the current code reads it (``jagg.config.stored_config``) with the changes its
    ``resumes`` recorded applied in order, and the keys they changed; (None, set()) without run.json. A
    run.json that is not JSON, not a mapping or without a config mapping is one ``ConfigError`` line."""
    if not path.is_file():
        return None, set()
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:  # unreadable is not corrupt: no advice to delete a file that may be intact
        raise ConfigError(
            f"{what}: cannot read {path}: {err.strerror} [{errno.errorcode.get(err.errno, err.errno)}]; it is "
            "not known to be corrupt: make it readable (permissions, the disk) and start again"
        ) from None
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{what}: {path} is corrupt ({first}); {_RUN_JSON_ADVICE}") from None
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(f"{what}: {path} is corrupt (no config mapping in it); {_RUN_JSON_ADVICE}")
    config, changed = stored_config(config, str(path)), set()
    resumes = meta.get("resumes")
    for resume in resumes if isinstance(resumes, list) else []:
        recorded = resume.get("config_changes") if isinstance(resume, dict) else None
        for key, change in (recorded if isinstance(recorded, dict) else {}).items():
            if isinstance(change, list) and len(change) == 2 and _set_key(config, key, change[1]):
                changed.add(RENAMED_KEYS.get(key, key))
    return config, changed


def _set_key(config: dict, key: str, value) -> bool:
    """``config[section][...][name] = value`` for the dotted ``key`` (renamed keys under their new name);
    False where the path is not there (a key removed since)."""
    *path, name = RENAMED_KEYS.get(key, key).split(".")
    node = config
    for part in path:
        node = node.get(part)
        if not isinstance(node, dict):
            return False
    node[name] = value
    return True


# a resume without run.json compares the checkpoint's own config and writes run.json anew
_RUN_JSON_ADVICE = (
    "delete it to resume against the checkpoint's own config (a new run.json is written; the old one's record of "
    "the first start, resumes and restarts is lost)"
)


def _checkpoint_config(checkpoint: Path) -> dict | None:
    """The config stored in the checkpoint's progress.pt, under the current key names; None where it cannot be
    read (loading the checkpoint then verifies it and reports what is wrong, naming the file)."""
    from jagg.ops.checkpoint import read_progress

    try:
        config = read_progress(checkpoint).get("config")
    except Exception:  # noqa: BLE001 - any unreadable progress.pt: the verified load reports it
        return None
    if not isinstance(config, dict):
        return None
    return stored_config(json_safe(config), str(checkpoint / "progress.pt"))

"""Command line: ``python -m jagg.train --config configs/world/flux_dancegrpo.yaml [key=value ...]``.

    --config FILE         the YAML config (required; configs/ holds the world and paper ones)
    key=value             overrides (``backward.strategy=exact``), anywhere on the line
    --resume              continue the run in log.run_dir from its checkpoint (log.run_dir/checkpoint/, sharded);
                          the config must equal run.json's and the checkpoint's own (train.iterations may
                          grow; a key added since the run was written reads as its default, a renamed one
                          as its new name); run.json is kept and the resume recorded in it
    --allow-config-change KEY [KEY ...]
                          resume although the named keys changed (exactly those; optim.* applies to the
                          restored optimizer); never the model's layout (backbone, source, LoRA rank /
                          targets, EMA on or off). The change is recorded in run.json, and a later
                          --resume (auto) with the new values continues
    --resume auto         the same when a checkpoint exists, else start again from iteration 0 (preemptible
                          clusters: a retry loop passes it on every attempt); metrics rows past the checkpoint
                          (all of them when there is none yet) are dropped and redone, recorded in run.json
                          (resumes / restarts); a complete save left in checkpoint.tmp/ is promoted, never
                          deleted; an incomplete checkpoint is an error, never a silent restart
    --overwrite           replace a run directory of this project (one holding its .jagg_run marker, or empty,
                          and nothing a run does not write; never the working directory, a repository root or
                          the home directory); not with --resume
    --dry-run             validate the config, report the node (torch's CUDA build, driver, NCCL, GPUs) and print the
                          plan (steps, groups, passes, memory); no weights, no writes; --world-size N and
                          --nproc-per-node M plan N ranks on nodes of M (default: torchrun's variables, else 1)
    --export OUT          no training: write the weights of log.run_dir's checkpoint to OUT, a diffusers transformer
                          folder (full fine-tuning) or a peft / diffusers LoRA adapter (jagg.loop.export); OUT must
                          be absent, empty or an earlier export whose files still match its marker's sizes and
                          hashes (never '', '.', '..', a symlink, inside or above the run directory, a git root
                          or the home directory; '~' expanded): written beside OUT and renamed into place; an
                          earlier export is moved aside, checked byte for byte, then deleted or put back
Invalid configs (unknown keys, bad values, YAML syntax, a config file that is not UTF-8 text or cannot be read,
unknown reward or prompt-set names, train.device=cuda without CUDA, a driver older than torch's CUDA build needs,
a rollout larger than the memory it would need (the key named with the largest value that fits), a resume that
contradicts run.json or the checkpoint, a corrupt run.json) exit with status
2 and one line naming the key, before the model code is imported and before anything is written. One run writes
to a run directory at a time: rank 0 locks it (log.run_dir/.lock) before writing, and a second run there exits 2
naming the holder. A run that may use CUDA sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and the NCCL
flight recorder unless they are set (``jagg.ops.node``); the checkpoints' weights are checked with
``python -m jagg.scale.weights_check``.

Signals, from the first instruction: SIGTERM or SIGUSR1 (a scheduler's warning before it kills the job) finish
the current phase (an iteration, an evaluation or a save), write a checkpoint and exit with status 143 / 138
and one line (``jagg.ops.signals``); during start-up, before anything is written, they exit with that status
and one line. SIGINT (Ctrl-C) stops at once with one line and status 130, without a checkpoint. Any other
expected failure (an ``OSError``: the path and the errno; an error of ``jagg.errors``) is one line, status 2.

Multi-process (FSDP2): ``torchrun --standalone --nproc_per_node N -m jagg.train --config ...`` (gloo on CPU,
nccl on GPU). Every rank validates and builds; rank 0 alone writes run.json, metrics and grids; each rank
writes its own shards of a checkpoint. ``--export`` runs under torchrun too (any world size; rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def _interrupted_at_start(signum, frame) -> None:
    sys.stderr.write("error: interrupted (SIGINT) during start-up: nothing written (exit status 130)\n")
    raise SystemExit(130)


if __name__ == "__main__":  # from the first instruction: Ctrl-C is one line, TERM / USR1 set the stop flag
    signal.signal(signal.SIGINT, _interrupted_at_start)
    from jagg.ops.signals import install_early

    install_early()


log = logging.getLogger("jagg.train")  # not __name__: "__main__" under python -m
VALUE_OPTIONS = (
    "--config",
    "--export",
    "--world-size",
    "--nproc-per-node",
)  # options whose value is the next token


class ConsoleHandler(logging.Handler):
    """INFO lines to stdout as they are, warnings and errors to stderr as ``warning: ...`` / ``error: ...``;
    the streams are looked up per record, so a redirected ``sys.stdout`` (pytest's capsys) is followed."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = self.format(record)
        if record.levelno >= logging.WARNING:
            sys.stderr.write(f"{record.levelname.lower()}: {msg}\n")
            sys.stderr.flush()
        else:
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()


def configure_logging(level: int = logging.INFO) -> None:
    """The ``jagg`` loggers print through one ``ConsoleHandler`` (installed once per process); under torchrun
    every line starts with ``[rank r/n]`` (torchrun's ``RANK`` / ``WORLD_SIZE``), so interleaved logs of a hang
    say which rank said what."""
    root = logging.getLogger("jagg")
    root.setLevel(level)
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        handler = ConsoleHandler()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            tag = f"[rank {os.environ.get('RANK', '?')}/{os.environ['WORLD_SIZE']}] "
            handler.setFormatter(logging.Formatter(tag.replace("%", "%%") + "%(message)s"))
        root.addHandler(handler)


def _fail(msg: str, code: int = 2) -> None:
    log.error(msg)
    raise SystemExit(code)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(options, overrides)``: every ``key=value`` token that is not an option's value is an override, so
    overrides may stand anywhere on the line (also after ``--resume`` or ``--world-size 2``)."""
    options, overrides = [], []
    expects_value = False
    for tok in argv:
        if not expects_value and not tok.startswith("-") and "=" in tok:
            overrides.append(tok)
            continue
        options.append(tok)
        expects_value = tok in VALUE_OPTIONS
    return options, overrides


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jagg.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", help="YAML config (see configs/); required")
    ap.add_argument(
        "--resume",
        nargs="?",
        const="required",
        choices=("required", "auto"),
        help="continue from log.run_dir's checkpoint; 'auto': start fresh when there is none yet",
    )
    ap.add_argument(
        "--allow-config-change",
        nargs="*",
        action="extend",
        metavar="KEY",
        help="resume although these config keys differ from the run's (exactly those named)",
    )
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (offline, no weights)")
    ap.add_argument(
        "--export",
        metavar="OUT_DIR",
        help="no training: export the weights of log.run_dir's checkpoint to OUT_DIR and exit",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="ranks assumed by --dry-run (default: $WORLD_SIZE or 1)",
    )
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None,
        help="ranks per node assumed by --dry-run's host memory (default: $LOCAL_WORLD_SIZE, else one node)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """The CLI (module docstring), with its one edge for expected failures: an ``OSError`` (one line naming the
    path and the errno) or an error of ``jagg.errors`` (its message) exits 2, SIGINT (Ctrl-C) 130, each with one
    line and no traceback."""
    from jagg.errors import USER_ERRORS, os_error_line
    from jagg.ops.signals import SIGINT_STATUS, stop_requests

    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:  # Ctrl-C is KeyboardInterrupt from here on
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with stop_requests():  # TERM / USR1 set a flag for the whole run (jagg.ops.signals)
            return _main(argv)
    except USER_ERRORS as err:
        _fail(str(err))
    except OSError as err:
        _fail(_write_error(err) if _disk_full(err) else os_error_line(err))
    except RuntimeError as err:
        if not _peer_lost(err):
            raise
        _fail(_peer_lost_line(err))
    except KeyboardInterrupt:
        log.error(
            f"interrupted (SIGINT): stopped without a checkpoint (exit status {SIGINT_STATUS}); continue from "
            "the last one with --resume (SIGTERM or SIGUSR1 save one before stopping)"
        )
        return SIGINT_STATUS


# What gloo / NCCL say when another rank's process died in the middle of a collective.
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "communicator was aborted",
)


def _peer_lost(err: RuntimeError) -> bool:
    return any(m in str(err) for m in PEER_LOST) or type(err).__name__ == "DistBackendError"


def _peer_lost_line(err: RuntimeError) -> str:
    """One line for a rank whose peer died: which rank this is, what the backend said, what to do."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    said = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return (
        f"rank {rank} of {world}: another rank's process ended during a collective ({said}); the rank that "
        "failed first printed why (torchrun names it); continue with --resume auto"
    )


def _main(argv: list[str] | None) -> int:
    configure_logging()
    argv_used = sys.argv if argv is None else argv
    options, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(options)
    if not args.config:
        _fail("--config is required: a YAML file such as configs/world/flux_dancegrpo.yaml (see configs/)")
    if args.allow_config_change == []:
        _fail(
            "--allow-config-change names the keys a resume may change, e.g. --allow-config-change optim.lr "
            "(section.key; the values are given as overrides, optim.lr=0.001)"
        )
    from jagg.config import load_config  # the engine's names (torch), not the model code
    from jagg.errors import ConfigError
    from jagg.ops import preflight
    from jagg.ops.checkpoint import find_checkpoint
    from jagg.ops.node import prepare_node

    try:
        cfg = load_config(args.config, overrides)
        preflight.check_reward_names(cfg)
        preflight.check_prompt_sets(cfg, fetch=not args.dry_run)
        prepare_node(cfg, dry_run=args.dry_run)  # report torch / driver / NCCL / GPUs; CUDA env before CUDA
        if args.dry_run:
            return _dry_run(cfg, args.world_size, args.nproc_per_node)
        preflight.check_device(cfg)
        preflight.check_trackers(cfg)
        _stop_before_writing()
        if args.export is not None:  # '' too: refused by name, never a training run
            return _export(cfg, args.export, find_checkpoint(cfg.log.run_dir), args)
        _check_sizes(cfg)
    except ConfigError as err:
        _fail(str(err))
    return _train(cfg, args, argv_used)


def _check_sizes(cfg) -> None:
    """One rollout against the memory it would need (``jagg.capacity.memory_model.check_sizes``), before the
    process group, the build and any write; torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE say how many ranks share
    a batch and a host."""
    from jagg.capacity.memory_model import check_sizes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_sizes(cfg, world, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def _train(cfg, args: argparse.Namespace, argv_used: list[str]) -> int:
    """Join the process group, lock log.run_dir (rank 0, before anything is written), decide fresh / resume
    under the lock, then run; every refusal is one line from rank 0 and exit 2 on every rank."""
    from jagg.common import set_threads

    set_threads(1)
    from jagg.distributed import DistInfo, init_distributed
    from jagg.errors import ConfigError
    from jagg.ops import rundir

    init_distributed(timeout_s=cfg.train.dist_timeout_s)
    info = DistInfo.current()
    try:
        with rundir.hold(cfg.log.run_dir, info):
            promoted = _promote_interrupted_save(cfg, info) if args.resume else None
            start = _agreed_start(cfg, args, info)
            start.promoted = promoted
            if info.is_main and start.restarts and not start.resume:
                log.info(
                    f"--resume auto: {cfg.log.run_dir} has no checkpoint yet (preempted before the first one): "
                    f"starting again from iteration 0; {start.metrics_rows} metrics rows dropped and redone "
                    "(recorded in run.json's restarts)"
                )
            return _run(cfg, start, argv_used, info)
    except ConfigError as err:
        _fail_once(info, str(err))


def _agreed_start(cfg, args: argparse.Namespace, info):
    """``preflight.start_run_dir`` on every rank (each reads the shared run directory), the outcome the same on
    all: one rank's refusal, or ranks that decided differently, stop every rank before anything is built."""
    from jagg.errors import ConfigError
    from jagg.ops import preflight

    start, error = None, None
    try:
        start = preflight.start_run_dir(cfg, args.resume, args.overwrite, args.allow_config_change or ())
    except ConfigError as err:
        error = str(err)
    decision = None if start is None else (start.resume, start.wipe, start.metrics_rows)
    decisions = {d for d in info.gather_objects(decision) if d is not None}
    if error is None and len(decisions) > 1:
        error = f"log.run_dir={cfg.log.run_dir}: the ranks read it differently ({sorted(decisions)})"
    error = info.first_error(error)
    if error is not None:
        raise ConfigError(error)
    return start


def _promote_interrupted_save(cfg, info) -> int | None:
    """Rank 0, holding the lock, before the fresh / resume decision: a complete save a killed attempt left in
    ``checkpoint.tmp/`` becomes the checkpoint (``jagg.ops.checkpoint.promote_interrupted_save``); the other
    ranks wait for it. Returns its iteration (None: there was none)."""
    from jagg.ops.checkpoint import promote_interrupted_save

    promoted = None
    if info.is_main:
        try:
            promoted = promote_interrupted_save(cfg.log.run_dir, keep=cfg.log.keep_checkpoints)
        except OSError as err:  # left as it is: the next start removes it as an interrupted save
            log.warning(f"could not promote {Path(cfg.log.run_dir) / 'checkpoint.tmp'}: {err}")
        if promoted is not None:
            log.info(
                f"promoted {Path(cfg.log.run_dir) / 'checkpoint.tmp'} (iteration {promoted}), a complete save "
                "the interrupted attempt had not made visible"
            )
    info.barrier()
    return promoted


def _fail_once(info, msg: str, code: int = 2) -> None:
    """The same error on every rank: one line from rank 0, the exit status on all."""
    if info.is_main:
        log.error(msg)
    raise SystemExit(code)


def _run(cfg, start, argv_used: list[str], info) -> int:
    """Build the components (the heavy imports start here), prepare the directory and write run.json on rank 0
    (a resume records itself only once its checkpoint has loaded), fit."""
    from jagg.config import validate_world_size
    from jagg.errors import ArtefactError, CheckpointError, ConfigError, WeightsUnavailableError
    from jagg.loop.components import build_components  # the registries: world, diffusers
    from jagg.loop.rewards import check_run_rewards
    from jagg.loop.trainer import Trainer, TrainingAborted
    from jagg.ops.signals import StopRequested, stop_requests

    run_dir, stopped = Path(cfg.log.run_dir), None
    info.barrier()  # every rank has checked run_dir before rank 0 touches it
    try:
        validate_world_size(cfg, info.world_size)
        comp = build_components(cfg)
        check_run_rewards(cfg)  # the trainer builds them: a missing artefact is one line before any write
    except (ConfigError, ArtefactError, WeightsUnavailableError) as err:
        _fail(str(err))
    _stop_before_writing(info)
    try:
        if info.is_main:
            _prepare_run_dir(run_dir, start)
            if not start.resume:
                _write_run_json(cfg, run_dir, start, argv_used, info.world_size, info.nodes)
        info.barrier()
        trainer = Trainer(cfg, comp, run_dir)
        if start.resume:
            trainer.load_checkpoint()
            start.dropped = max(0, start.metrics_rows - len(trainer.metrics))
            if info.is_main:
                _write_run_json(cfg, run_dir, start, argv_used, info.world_size, info.nodes)
                log.info(f"resumed {run_dir} at iteration {trainer.iteration}")
                if start.dropped:
                    log.info(
                        f"metrics.jsonl: {start.dropped} rows past the checkpoint dropped; they are redone "
                        "(recorded in run.json's resumes)"
                    )
        display = _progress(cfg.train.iterations, trainer.iteration) if info.is_main else None
        with stop_requests() as flag:  # SIGTERM / SIGUSR1: finish the phase, save, exit 143 / 138
            try:
                trainer.fit(
                    progress=_after_iteration(trainer, display),
                    before_iteration=_stop_check(flag, info),
                )
            except StopRequested as stop:
                stopped = stop
                _save_and_stop(trainer)
    except TrainingAborted as err:
        _fail(str(err), code=3)
    except CheckpointError as err:  # the same on every rank (a collective decided it)
        _fail_once(info, str(err))
    except OSError as err:  # a write failed: read-only, disk full, quota
        _fail(_write_error(err, run_dir))
    if info.is_main and stopped is not None:
        log.error(
            f"stopped by {stopped.name} after iteration {stopped.iteration}: checkpoint {trainer.checkpoint_path} "
            f"written (exit status {stopped.status}); continue with --resume (or --resume auto)"
        )
    elif info.is_main:
        log.info(f"done: {run_dir}/metrics.jsonl, {run_dir}/samples/, {trainer.checkpoint_path}/")
    del trainer, comp  # the sharded model and its gloo / NCCL work objects go before the process group
    _shutdown()
    return 0 if stopped is None else stopped.status


def _after_iteration(trainer, display):
    """``Trainer.fit``'s progress callback: the display (rank 0); an asynchronous save whose write is done on
    every rank becomes the checkpoint (``CheckpointWriter.poll``: a preemption from here on resumes from it)."""

    def after_iteration(row: dict) -> None:
        if display is not None:
            display(row)
        trainer.checkpoints.poll()

    return after_iteration


def _stop_check(flag, info):
    """``Trainer.fit``'s ``before_iteration`` hook: ``StopRequested`` when a stop signal arrived on any rank
    (``jagg.ops.signals``; one all-reduce), so the run stops at the end of the phase the signal arrived in
    (an iteration, its evaluation or its save), not after another iteration."""
    from jagg.ops.signals import StopRequested

    def before_iteration(iteration: int) -> None:
        signum = flag.agreed(info)
        if signum is not None:
            raise StopRequested(signum, iteration)

    return before_iteration


def _stop_before_writing(info=None) -> None:
    """A stop signal that arrived during start-up, before anything is written: one line and its exit status
    (every rank agrees when ``info`` is given)."""
    from jagg.ops.signals import EXIT_STATUS, active_flag, stop_message

    flag = active_flag()
    if flag is None:
        return
    signum = flag.agreed(info) if info is not None else flag.signum
    if signum is not None:
        msg = stop_message(signum, "during start-up, before anything was written; start again when ready")
        code = EXIT_STATUS.get(signum, 128 + signum)
        _fail_once(info, msg, code) if info is not None else _fail(msg, code)


def _save_and_stop(trainer) -> None:
    """After ``StopRequested`` left ``fit``: the checkpoint of the iteration reached, complete on every rank."""
    if trainer.checkpointed_at != trainer.iteration:
        trainer.save_checkpoint()
    trainer.checkpoints.finish()
    trainer.watch.stop()
    trainer.run_log.close()


def _prepare_run_dir(run_dir: Path, start) -> None:
    """Rank 0, holding the lock: empty the directory for --overwrite, remove what a killed save left, mark it."""
    from jagg.ops import rundir

    if start.wipe:
        rundir.wipe(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for path in rundir.clean_stale(run_dir):
        log.info(f"removed {path}, left by an interrupted save")
    if not (run_dir / rundir.MARKER).is_file():
        rundir.write_marker(run_dir)


def _disk_full(err: OSError) -> bool:
    import errno

    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_error(err: OSError, run_dir: Path | None = None) -> str:
    """One line for a failed write, with the free space when the disk is full (on ``run_dir``, else on the
    nearest existing folder of the file named)."""
    from jagg.errors import os_error_line
    from jagg.ops.checkpoint import format_bytes

    where = err.filename or run_dir
    if not _disk_full(err):
        return os_error_line(err)
    disk = Path(run_dir or where or ".")
    disk = next((p for p in (disk, *disk.parents) if p.exists()), None)
    free = format_bytes(shutil.disk_usage(disk).free) if disk is not None else "?"
    return f"disk full while writing {where}: {free} free on {disk}; free some space and resume with --resume"


def _write_run_json(cfg, run_dir: Path, start, argv_used: list[str], world_size: int, nodes: int = 1) -> None:
    """A fresh run writes run.json; a resumed one (after its checkpoint loaded) keeps it and appends what this
    attempt changed. ``nodes``: how many machines the ranks ran on (a resume may use another layout)."""
    from jagg.common import atomic_write_text, git_sha, run_metadata
    from jagg.ops.rundir import not_inputs

    path = run_dir / "run.json"
    if start.resume and path.is_file():
        meta = json.loads(path.read_text())
        if not isinstance(
            meta.get("resumes", []), list
        ):  # edited by hand: kept, not dropped, as the first entry
            log.warning(f"{path}: 'resumes' was not a list; kept as its first entry")
            meta["resumes"] = [{"earlier_record": meta["resumes"]}]
        meta.setdefault("resumes", []).append(
            {
                "argv": argv_used,
                "git_sha": git_sha(ignore=not_inputs(cfg.model.source)),
                "world_size": world_size,
                "nodes": nodes,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "config_changes": {k: list(v) for k, v in start.changes.items()},
                "metrics_rows_dropped": start.dropped,
                "promoted_checkpoint_tmp": start.promoted,
            }
        )
    else:
        meta = run_metadata(
            outputs=not_inputs(cfg.model.source),
            config=cfg.to_dict(),
            seed=cfg.train.seed,
            argv=argv_used,
            world_size=world_size,
        )
        meta["nodes"] = nodes
        if start.restarts:  # preempted before its first checkpoint: started again, the attempts recorded
            stamp = {"argv": argv_used, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            meta["restarts"] = [*start.restarts[:-1], {**start.restarts[-1], **stamp}]
        if cfg.model.source == "world":  # which build: runs on different builds do not compare exactly
            from jagg.world.pretrained import VIDEO_ARTEFACTS, VIDEO_BACKBONE_NAMES, world_build

            meta["world_build"] = world_build()  # the image world's artefacts, whatever the run
            if cfg.model.backbone in VIDEO_BACKBONE_NAMES:  # a video run also names the video world's
                meta["video_build"] = world_build(artefacts=VIDEO_ARTEFACTS)
    atomic_write_text(path, json.dumps(meta, indent=2, default=str) + "\n")


def _progress(total: int, start: int):
    """A tqdm bar (iterations, reward, s/it, ETA) on a TTY, a plain line per iteration with an ETA otherwise."""
    from jagg.common import ProgressETA, format_seconds

    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="it")

        def update(row: dict) -> None:
            bar.set_postfix(reward=f"{row['reward_mean']:.4f}", s_it=f"{row['time_iteration_s']:.1f}")
            bar.update(1)

        return update
    eta = ProgressETA(total - start)

    def line(row: dict) -> None:
        eta.done += 1
        left = eta.eta_seconds()
        log.info(
            f"iter {row['iteration']}/{total} reward {row['reward_mean']:.4f} "
            f"({row['time_iteration_s']:.1f} s/it, {row['backward_passes']} backward passes, "
            f"ETA {format_seconds(left)})"
        )

    return line


def _export(cfg, out_dir: str, ckpt: Path | None, args: argparse.Namespace) -> int:
    """``--export``: the checkpoint's weights to ``out_dir`` (``jagg.loop.export.export_run``), no training."""
    from jagg.common import set_threads
    from jagg.errors import ArtefactError, CheckpointError, ConfigError, WeightsUnavailableError

    if args.resume or args.overwrite:
        raise ConfigError("--export does not train: drop --resume / --overwrite (train first, then export)")
    from jagg.ops.exportdir import check_export_target, export_path

    out_dir = export_path(out_dir)  # '~' expanded, '' refused
    check_export_target(out_dir, cfg.log.run_dir)  # before anything is built; export_trained checks it again
    if ckpt is None:
        run_dir = Path(cfg.log.run_dir)
        raise ConfigError(f"--export: missing checkpoint {run_dir / 'checkpoint'} (log.run_dir={run_dir})")
    set_threads(1)
    from jagg.distributed import DistInfo, init_distributed
    from jagg.loop.export import export_run

    init_distributed(timeout_s=cfg.train.dist_timeout_s)
    try:
        out = export_run(cfg, out_dir)
    except (ConfigError, ArtefactError, WeightsUnavailableError, CheckpointError) as err:
        _fail(str(err))
    if DistInfo.current().is_main:
        log.info(f"exported: {out}")
    _shutdown()
    return 0


def _dry_run(cfg, world_size: int, ranks_per_node: int | None = None) -> int:
    """Validate against ``world_size`` and print the plan (``jagg.capacity.dry_run``; ``ranks_per_node``: the
    host memory per node); no weights read, nothing written."""
    from jagg.capacity.dry_run import build_plan
    from jagg.config import validate_world_size

    if world_size < 1:
        _fail(f"--world-size must be >= 1, got {world_size}")
    if ranks_per_node is not None and not 1 <= ranks_per_node <= world_size:
        _fail(f"--nproc-per-node must be in [1, --world-size={world_size}], got {ranks_per_node}")
    validate_world_size(cfg, world_size)
    log.info(f"dry run: config valid; plan for world size {world_size}")
    log.info(build_plan(cfg, world_size, ranks_per_node))
    return 0


def _shutdown() -> None:
    """Ordered teardown: free the sharded model while the interpreter is alive (FSDP modules sit in reference
    cycles; collected at interpreter exit, a tensor held by a finished gloo work object is destroyed without a
    usable Python runtime and the process aborts), wait for every rank, then destroy the process group."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

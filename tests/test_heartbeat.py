"""Per-phase heartbeats and hang stacks (``jagg.ops.heartbeat``): when a heartbeat and the stack dump are due,
the reporting thread, and the phases the trainer names in one iteration."""

from __future__ import annotations

import logging
import time

from jagg.ops.heartbeat import PhaseWatch


def test_heartbeat_and_dump_are_due_per_phase(tmp_path, caplog):
    watch = PhaseWatch(rank=3, heartbeat_s=10, timeout_s=20, dump_dir=tmp_path)
    caplog.set_level(logging.INFO, logger="jagg")
    watch.check(0.0)  # no phase yet: nothing
    watch.enter("update", 7)
    t0 = watch.since
    watch.check(t0 + 5)
    assert not caplog.records
    watch.check(t0 + 10)
    watch.check(t0 + 12)  # the next one is due at 20
    beats = [r.getMessage() for r in caplog.records]
    assert beats == ["heartbeat rank 3: update (iteration 7) for 10 s"]
    watch.check(t0 + 21)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[-2] == "heartbeat rank 3: update (iteration 7) for 21 s"
    assert "past log.phase_timeout_s=20" in messages[-1] and caplog.records[-1].levelno == logging.WARNING
    dump = (tmp_path / "hang_rank3.txt").read_text()
    assert "rank 3: update (iteration 7) for 21 s" in dump
    assert "test_heartbeat_and_dump_are_due_per_phase" in dump  # the main thread's stack, with this frame
    watch.check(t0 + 25)  # once per phase entry
    assert (tmp_path / "hang_rank3.txt").read_text() == dump
    watch.enter("checkpoint", 8)  # a new phase starts its own clock
    watch.check(watch.since + 21)
    assert (tmp_path / "hang_rank3.txt").read_text().count("===") == 2


def test_thread_reports_while_a_phase_hangs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jagg")
    watch = PhaseWatch(rank=0, heartbeat_s=0.05, timeout_s=0.2, dump_dir=tmp_path)
    watch.start()
    watch.enter("reward", 0)
    time.sleep(0.6)
    watch.stop()
    assert any(r.getMessage().startswith("heartbeat rank 0: reward (iteration 0)") for r in caplog.records)
    assert (tmp_path / "hang_rank0.txt").is_file()
    assert watch._thread is None
    off = PhaseWatch(rank=0, heartbeat_s=0, timeout_s=0, dump_dir=tmp_path)
    off.start()
    assert off._thread is None  # both off: no thread


def test_trainer_names_its_phases(tiny_trainer, monkeypatch):
    seen: list[tuple[str, int]] = []
    enter = PhaseWatch.enter

    def record(self, phase, iteration):
        seen.append((phase, iteration))
        enter(self, phase, iteration)

    monkeypatch.setattr(PhaseWatch, "enter", record)
    trainer = tiny_trainer("train.iterations=1", "log.eval_every=1")
    trainer.fit()
    phases = [p for p, _ in seen]
    assert phases == ["evaluate", "rollout", "reward", "update", "evaluate", "checkpoint"], phases
    assert trainer.watch._thread is None  # stopped when fit returns

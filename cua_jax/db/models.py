"""SQLAlchemy 2 models of the trajectory database (one schema for SQLite and PostgreSQL).

    runs ─┬─ steps        one row per logged step (every metric in `metrics`, a few typed)
          ├─ groups ── rollouts ── turns     a GRPO step's groups, their episodes, their turns
          ├─ evals  ── rollouts ── turns     an eval's episodes (task, category, success)
          └─ sft_phases

Rows are keyed for idempotent re-writes: (run, step) for steps, (run, step, index) for groups,
(run, step, tag) for evals, so a resumed run or a replayed spill file never duplicates a step.
The schema is created and upgraded by the Alembic migrations in `cua_jax/db/migrations` (never
by `create_all`); `tests/db` checks that the migrations and these models agree.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Alembic's version table: its presence marks a cua_jax database (tools/monitor.py checks it).
VERSION_TABLE = "cua_jax_alembic_version"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Run(Base):
    """A training run (kind "train") or a standalone evaluation (kind "eval")."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(64), unique=True)  # kept in WORKDIR/trajectories.run
    name: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16), default="train")
    workdir: Mapped[str] = mapped_column(Text)  # screenshots live under it
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # running | finished | failed: ... ; "; lost ..." names records the database never got
    status: Mapped[str] = mapped_column(Text, default="running")
    host: Mapped[str | None] = mapped_column(String(255))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_step: Mapped[int | None] = mapped_column(Integer)

    steps: Mapped[list[Step]] = relationship(back_populates="run", order_by="Step.step")


class Step(Base):
    """One logged step: the metrics row the trainer wrote to metrics.jsonl."""

    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_steps_run_step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # typed copies of the metrics people filter and sort by (NULL when not logged)
    reward: Mapped[float | None] = mapped_column(Float)  # rollout/reward
    success: Mapped[float | None] = mapped_column(Float)  # rollout/success
    eval_success: Mapped[float | None] = mapped_column(Float)  # eval/success
    loss: Mapped[float | None] = mapped_column(Float)  # train/loss
    step_time_s: Mapped[float | None] = mapped_column(Float)  # time/step

    run: Mapped[Run] = relationship(back_populates="steps")


class Group(Base):
    """A GRPO group of one step: one task, `group_size` rollouts; kept for training or why not."""

    __tablename__ = "groups"
    __table_args__ = (UniqueConstraint("run_id", "step", "index", name="uq_groups_run_step_index"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    index: Mapped[int] = mapped_column(Integer)
    group_key: Mapped[str] = mapped_column(String(64))  # Trajectory.group_id
    task_id: Mapped[str] = mapped_column(String(255))
    policy_version: Mapped[int] = mapped_column(Integer)  # the oldest of its rollouts
    staleness: Mapped[int] = mapped_column(Integer)  # learner version - policy_version
    kept: Mapped[bool] = mapped_column(Boolean)
    drop_reason: Mapped[str | None] = mapped_column(String(64))  # zero_variance | infra_fault
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)

    rollouts: Mapped[list[Rollout]] = relationship(
        back_populates="group", order_by="Rollout.index", passive_deletes=True
    )


class Eval(Base):
    """One evaluation (greedy episodes of a task list) at a step, tagged (step0, after_sft, ...)."""

    __tablename__ = "evals"
    __table_args__ = (UniqueConstraint("run_id", "step", "tag", name="uq_evals_run_step_tag"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    tag: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    success: Mapped[float | None] = mapped_column(Float)
    num_tasks: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    rollouts: Mapped[list[Rollout]] = relationship(
        back_populates="eval", order_by="Rollout.index", passive_deletes=True
    )


class Rollout(Base):
    """One episode: of a GRPO group (kind "train") or of an eval (kind "eval")."""

    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_run_step_kind", "run_id", "step", "kind"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8))
    group_id: Mapped[int | None] = mapped_column(
        ForeignKey("groups.id", ondelete="CASCADE"), index=True
    )
    eval_id: Mapped[int | None] = mapped_column(
        ForeignKey("evals.id", ondelete="CASCADE"), index=True
    )
    index: Mapped[int] = mapped_column(Integer)  # member of its group / position in the eval
    task_id: Mapped[str] = mapped_column(String(255))
    category: Mapped[str | None] = mapped_column(String(64))
    reward: Mapped[float | None] = mapped_column(Float)
    score: Mapped[float | None] = mapped_column(Float)
    success: Mapped[bool] = mapped_column(Boolean)
    advantage: Mapped[float | None] = mapped_column(Float)  # NULL: not trained on
    length: Mapped[int] = mapped_column(Integer)  # turns
    generated_tokens: Mapped[int] = mapped_column(Integer)
    invalid_actions: Mapped[int] = mapped_column(Integer)
    infra_fault: Mapped[bool] = mapped_column(Boolean)
    finish_reason: Mapped[str | None] = mapped_column(Text)  # Trajectory.failure_reason
    policy_version: Mapped[int] = mapped_column(Integer)
    timings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    group: Mapped[Group | None] = relationship(back_populates="rollouts")
    eval: Mapped[Eval | None] = relationship(back_populates="rollouts")
    turns: Mapped[list[Turn]] = relationship(
        back_populates="rollout", order_by="Turn.index", passive_deletes=True
    )


class Turn(Base):
    """One policy turn: what the model wrote, the actions parsed from it, the screen it saw."""

    __tablename__ = "turns"
    __table_args__ = (UniqueConstraint("rollout_id", "index", name="uq_turns_rollout_index"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    model_text: Mapped[str | None] = mapped_column(Text)
    actions: Mapped[list[Any]] = mapped_column(JSON, default=list)  # [{"type": "Click", ...}]
    x: Mapped[float | None] = mapped_column(Float)  # the first pointer action's screen point
    y: Mapped[float | None] = mapped_column(Float)
    logprob_sum: Mapped[float | None] = mapped_column(Float)
    generated_tokens: Mapped[int] = mapped_column(Integer)
    timing_s: Mapped[float | None] = mapped_column(Float)
    feedback: Mapped[str | None] = mapped_column(Text)
    trained: Mapped[bool] = mapped_column(Boolean)
    screenshot: Mapped[str | None] = mapped_column(String(255))  # screens/<sha256>.png
    screen_w: Mapped[int | None] = mapped_column(Integer)
    screen_h: Mapped[int | None] = mapped_column(Integer)

    rollout: Mapped[Rollout] = relationship(back_populates="turns")


class SftPhase(Base):
    """The SFT warm-up of a run: its data source, steps and losses."""

    __tablename__ = "sft_phases"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    source: Mapped[str | None] = mapped_column(Text)
    steps: Mapped[int | None] = mapped_column(Integer)
    loss_first: Mapped[float | None] = mapped_column(Float)
    loss_last: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


__all__ = ["VERSION_TABLE", "Base", "Eval", "Group", "Rollout", "Run", "SftPhase", "Step", "Turn"]

"""The first schema: runs, steps, groups, evals, rollouts, turns, sft_phases.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), primary_key=True)


def _run_fk() -> sa.Column:
    return sa.Column(
        "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "runs",
        _id(),
        sa.Column("uid", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("workdir", sa.Text(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("git_commit", sa.String(64), nullable=True),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("updated_at", TZ, nullable=False),
        sa.Column("ended_at", TZ, nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
    )
    op.create_table(
        "steps",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("success", sa.Float(), nullable=True),
        sa.Column("eval_success", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("step_time_s", sa.Float(), nullable=True),
        sa.UniqueConstraint("run_id", "step", name="uq_steps_run_step"),
    )
    op.create_table(
        "groups",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("group_key", sa.String(64), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("staleness", sa.Integer(), nullable=False),
        sa.Column("kept", sa.Boolean(), nullable=False),
        sa.Column("drop_reason", sa.String(64), nullable=True),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_std", sa.Float(), nullable=True),
        sa.UniqueConstraint("run_id", "step", "index", name="uq_groups_run_step_index"),
    )
    op.create_table(
        "evals",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("tag", sa.String(64), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("success", sa.Float(), nullable=True),
        sa.Column("num_tasks", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.UniqueConstraint("run_id", "step", "tag", name="uq_evals_run_step_tag"),
    )
    op.create_table(
        "rollouts",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column(
            "group_id", sa.Integer(), sa.ForeignKey("groups.id", ondelete="CASCADE"), nullable=True
        ),
        sa.Column(
            "eval_id", sa.Integer(), sa.ForeignKey("evals.id", ondelete="CASCADE"), nullable=True
        ),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("category", sa.String(64), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.Column("length", sa.Integer(), nullable=False),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("invalid_actions", sa.Integer(), nullable=False),
        sa.Column("infra_fault", sa.Boolean(), nullable=False),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("timings", sa.JSON(), nullable=False),
    )
    op.create_index("ix_rollouts_run_step_kind", "rollouts", ["run_id", "step", "kind"])
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_eval_id", "rollouts", ["eval_id"])
    op.create_table(
        "turns",
        _id(),
        sa.Column(
            "rollout_id",
            sa.Integer(),
            sa.ForeignKey("rollouts.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model_text", sa.Text(), nullable=True),
        sa.Column("actions", sa.JSON(), nullable=False),
        sa.Column("x", sa.Float(), nullable=True),
        sa.Column("y", sa.Float(), nullable=True),
        sa.Column("logprob_sum", sa.Float(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("timing_s", sa.Float(), nullable=True),
        sa.Column("feedback", sa.Text(), nullable=True),
        sa.Column("trained", sa.Boolean(), nullable=False),
        sa.Column("screenshot", sa.String(255), nullable=True),
        sa.Column("screen_w", sa.Integer(), nullable=True),
        sa.Column("screen_h", sa.Integer(), nullable=True),
        sa.UniqueConstraint("rollout_id", "index", name="uq_turns_rollout_index"),
    )
    op.create_table(
        "sft_phases",
        _id(),
        _run_fk(),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("loss_first", sa.Float(), nullable=True),
        sa.Column("loss_last", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
    )
    op.create_index("ix_sft_phases_run_id", "sft_phases", ["run_id"])


def downgrade() -> None:
    for table in ("sft_phases", "turns", "rollouts", "evals", "groups", "steps", "runs"):
        op.drop_table(table)

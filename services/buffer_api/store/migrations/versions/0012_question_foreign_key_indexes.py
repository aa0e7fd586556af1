"""indexes on the question ids that refer to a question: states and tasks

Deleting a question deletes its states and tasks by their foreign keys' cascades, one lookup per
question, and neither table had an index that starts with `question_id` (a state's key is
(scope, question_id)). Each lookup read the whole table: deleting a pool of 1M questions on
Postgres ran for more than 15 minutes without finishing (200,000 states read once per question),
on SQLite 63 s. With the indexes each lookup reads the question's own rows.

A state's pool (`run_question.pool_id`, also a cascading foreign key) gets no index: a pool is
deleted in one statement, whose cascade reads the states once.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 22:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_run_question_question", "run_question", ["question_id"])
    op.create_index("ix_task_question", "task", ["question_id"])


def downgrade() -> None:
    op.drop_index("ix_task_question", table_name="task")
    op.drop_index("ix_run_question_question", table_name="run_question")

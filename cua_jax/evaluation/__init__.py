"""Evaluating any agent: OpenAI-style chat rendering, statistics, offline step scoring, and
OSWorld-style result directories.

Modules: `openai_chat` (chat-completions requests -> the trainer's prompt ids), `stats`
(Wilson intervals, pass@k, McNemar), `offline` (AgentNetBench-style step scoring),
`results` (RESULT_DIR/<domain>/<task_id>/ writer, summaries, side-by-side pages), `server`
(the OpenAI-compatible policy server, Starlette: the one module here that speaks HTTP),
`episodes` (greedy eval episodes, per-category success, the viewer page), `live` (serving the
live policy during a run), `summary` (summary.json's eval fields). A run's policy is loaded by
`cua_jax.job.loading` (the job's builders rebuild it), which this package does not import.
"""

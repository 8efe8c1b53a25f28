"""Evaluating any agent: OpenAI-style chat rendering, statistics, offline step scoring, and
OSWorld-style result directories. HTTP-free (the server and the HTTP agents live in tools/).

Modules: `openai_chat` (chat-completions requests -> the trainer's prompt ids), `stats`
(Wilson intervals, pass@k, McNemar), `offline` (AgentNetBench-style step scoring),
`results` (RESULT_DIR/<domain>/<task_id>/ writer, summaries, side-by-side pages), `loading`
(a run's checkpoint or a preset -> model, processor).
"""

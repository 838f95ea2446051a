"""OpenAI's API for token plugins: api.py (/v1/completions, /v1/models), chat.py (/v1/chat/completions),
text.py (prompts, stop strings, streamed text) over common.py (errors, deadlines, server-sent events).

What they read of a plugin is declared in `phyai_ray.plugins.tokens`.
"""
